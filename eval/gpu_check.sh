#!/usr/bin/env bash
# The GPU check of window-local SWA attention's CUDA path (issue 19): on a lent GPU machine,
# `SplitPrefill` (vllm_mimo/attention_backends/split_prefill.py) against the torch reference
# and FlashInfer's stock call, exactness and time (eval/gpu_check.py says what is checked).
#
# Here, once:   bash eval/gpu_wheels.sh          (fills .whl/, about 35 MiB)
# There:        device run, carry [".whl"], command: bash eval/gpu_check.sh   (timeout 600 s)
# The first run JIT-compiles FlashInfer's fa2 prefill kernels (minutes, with nvcc there); the
# host tier's copy check runs first (no FlashInfer), so a run cut short still reports it.
# Output: the table on stdout, JSON (rewritten after each step) and the log in $OUT (the device
# tool brings them back) or eval/results/.
# Record both in eval/RESULTS.md ("Window-local SWA attention (issue 19)", "The CUDA path").
set -euo pipefail
cd "$(dirname "$0")/.."
ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu_check: no wheels in .whl/; run bash eval/gpu_wheels.sh here first and carry .whl" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp} MAX_JOBS=${MAX_JOBS:-16}  # JIT cache under /tmp/.cache/flashinfer
# FlashInfer's JIT runs `nvcc` (or $CUDA_HOME/bin/nvcc) and `ninja` (the Python package's, next
# to python3).
command -v nvcc >/dev/null || [ -n "${CUDA_HOME:-}" ] || { [ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH; } || true
PATH=$PATH:$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
out=${OUT:-eval/results}
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  { command -v nvcc && nvcc --version | tail -n 2; } || echo "no nvcc on PATH"
  command -v ninja || echo "no ninja on PATH"
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  python3 -m eval.gpu_check --backend fa2 --out "$out/gpu-check.json" "$@"
} 2>&1 | tee "$out/gpu-check.log"

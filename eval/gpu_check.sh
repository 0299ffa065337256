#!/usr/bin/env bash
# The one prepared GPU check of window-local SWA attention's CUDA path (issue 52): on a lent GPU
# machine (torch with CUDA, no vLLM, no network), eval/gpu_check.py (the kernel layer, scratch.py,
# against FlashInfer's stock call: exactness, host syncs, step times; the host tier's copies),
# then eval/gpu_vllm_harness.py through vLLM's own classes where vLLM is installed (skipped, and
# said, where it is not).
#
# Here, once:   bash eval/gpu_wheels.sh          (fills .whl/, about 32 MiB)
#               python -m eval.gpu_check --dry-run --out /tmp/dry.json   (the same code on CPU)
# There:        device run, carry [".whl"], command: bash eval/gpu_check.sh, timeout_s 480
#               (timing steps stop starting after BUDGET_S, 330 s by default, the rest marked skipped)
# The first call of each shape JIT-compiles its FlashInfer kernels (nvcc there); exactness runs
# first, then the timings; the JSON is rewritten after each step, so a run cut short keeps what
# it finished. Output: the tables on stdout, JSON and the log in $OUT (the device tool brings
# them back) or eval/results/; then `python -m eval.results_page` here ("On a GPU").
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
status=0
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  { command -v nvcc && nvcc --version | tail -n 2; } || echo "no nvcc on PATH"
  command -v ninja || echo "no ninja on PATH"
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  python3 -m eval.gpu_check --budget-s "${BUDGET_S:-330}" --out "$out/gpu-check-scratch.json" "$@" || status=$?
  if python3 -c 'import vllm' 2>/dev/null; then
    python3 -m eval.gpu_vllm_harness --device cuda --json "$out/gpu-vllm-harness-cuda.json" || status=$?
  else
    echo "gpu_vllm_harness: skipped, no vLLM on this machine (its CPU dry run is in eval/RESULTS.md)"
  fi
  exit $status
} 2>&1 | tee "$out/gpu-check.log"

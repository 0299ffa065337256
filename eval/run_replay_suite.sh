#!/usr/bin/env bash
# The issue-3 side-by-side replay: every workload at five KV budgets (four for the long
# conversations of issue 18), all engines, JSON + plot.
# Budgets are chosen per workload from the swa-free ceiling (see eval/RESULTS.md).
#   eval/run_replay_suite.sh              sessions closed-loop (the default of eval.replay)
#   eval/run_replay_suite.sh --open-loop  every request at its timestamp; files *-open-loop.*
#   eval/run_replay_suite.sh --host       the host tier (issue 21) at the same budgets, host
#       memory 4x the device's: the plugin without and with its host tier (mask-only), the same
#       storing SWA tails whole, vLLM's own OffloadingConnector; and swa-free at device + host
#       bytes (5x), the reference. Files eval/results/host-<workload>[-open-loop].{json,txt}
#   ONLY="mixed agent-sessions" eval/run_replay_suite.sh ...   those workloads only
#   PLOT=0 eval/run_replay_suite.sh ...   no plots (they need matplotlib: pip install 'vllm-mimo[eval]')
#   OUT=DIR eval/run_replay_suite.sh ...  the files into DIR instead of eval/results
#   ENGINES=mimo eval/run_replay_suite.sh ...   only these of eval.replay's engines on the plugin's side
#       (a policy change's guard: with SGLANG=0 PLOT=0 OUT=..., then eval.replay_compare --table mimo --min)
#   SGLANG=0 / SGLANG=only eval/run_replay_suite.sh ...   without / only SGLang's engines (make sglang):
#       they run apart, into replay-<workload>[-open-loop]-sglang.{json,txt}, as they do not change
#       with the plugin; SGLang as it ships at three ratios and with its unified pool, and its best
#       two without the waiting-prefix refresh (a cache against a cache)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# vLLM's block hashes and the OffloadingConnector's order follow Python's hash seed: fix it.
export PYTHONHASHSEED=${PYTHONHASHSEED:-0}
OUT=${OUT:-eval/results}
ENGINES=${ENGINES:-}
EXTRA=() SUFFIX= HOST= ONLY=${ONLY:-} PLOT=${PLOT:-1} SGLANG=${SGLANG:-1}
SGLANG_ENGINES=sglang-r0.8,sglang-r0.2,sglang-r0.05,sglang-unified,sglang-r0.05-norefresh,sglang-unified-norefresh
for arg in "$@"; do
  case "$arg" in
    --open-loop) EXTRA=(--open-loop) SUFFIX=-open-loop ;;
    --host) HOST=1 ;;
    *) echo "usage: $0 [--open-loop] [--host]" >&2; exit 2 ;;
  esac
done
if [ -n "$ENGINES" ] && { [ -n "$HOST" ] || [ "$SGLANG" = only ]; }; then
  echo "$0: ENGINES picks the plugin side's engines of the replay suite; it does not apply to --host or SGLANG=only" >&2
  exit 2
fi
case "$PLOT" in 0|1) ;; *) echo "$0: PLOT must be 0 or 1, got '$PLOT'" >&2; exit 2 ;; esac
case "$SGLANG" in 0|1|only) ;; *) echo "$0: SGLANG must be 0, 1 or only, got '$SGLANG'" >&2; exit 2 ;; esac
if [ -z "$HOST" ] && [ "$SGLANG" != 0 ] && ! "$PY" -c 'from eval import sglang_peer; sglang_peer.load()' >/dev/null 2>&1; then
  echo "$0: SGLang's engines need SGLang's cache code: make sglang (or SGLANG=0 to run without them)" >&2
  exit 2
fi
if [ -z "$HOST" ] && [ "$PLOT" = 1 ] && ! "$PY" -c 'import matplotlib' 2>/dev/null; then
  echo "$0: the plots need matplotlib, which $PY lacks: pip install 'vllm-mimo[eval]', or PLOT=0 for no plots" >&2
  exit 2
fi
mkdir -p "$OUT"
run() {  # name, source args..., -- budgets...
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $1 "* ]]; then return 0; fi
  local name=$1$SUFFIX; shift
  local src=(); while [ "$1" != "--" ]; do src+=("$1"); shift; done; shift
  if [ -z "$HOST" ]; then
    local plot=(); [ "$PLOT" = 1 ] && plot=(--plot "$OUT/replay-$name.png")
    if [ "$SGLANG" != only ]; then
      local engines=(); [ -n "$ENGINES" ] && engines=(--engines "$ENGINES")
      "$PY" -m eval.replay "${src[@]}" "${EXTRA[@]}" --layout mimo-v2.5-pro --kv-gib "$@" "${engines[@]}" \
        --json "$OUT/replay-$name.json" "${plot[@]}" | tee "$OUT/replay-$name.txt"
    fi
    if [ "$SGLANG" != 0 ]; then
      "$PY" -m eval.replay "${src[@]}" "${EXTRA[@]}" --layout mimo-v2.5-pro --kv-gib "$@" \
        --engines "$SGLANG_ENGINES" --json "$OUT/replay-$name-sglang.json" | tee "$OUT/replay-$name-sglang.txt"
    fi
    return
  fi
  local five=(); for g in "$@"; do five+=("$(awk "BEGIN{print 5*$g}")"); done
  "$PY" -m eval.replay "${src[@]}" "${EXTRA[@]}" --layout mimo-v2.5-pro --kv-gib "$@" --quiet \
    --engines mimo,mimo-host,mimo-host-dense,upstream-offload --json "$OUT/host-$name.json" | tee "$OUT/host-$name.txt"
  "$PY" -m eval.replay "${src[@]}" "${EXTRA[@]}" --layout mimo-v2.5-pro --kv-gib "${five[@]}" --quiet \
    --engines swa-free --json "$OUT/host-$name-swa-free-5x.json" | tee -a "$OUT/host-$name.txt"
}
run shared-system-prompt --workload shared-system-prompt -- 2 3 4 8 16
run agent-sessions --workload agent-sessions -- 4 6 8 12 16
run mixed --workload mixed -- 4 6 10 16 32
run agentic-mooncake --trace eval/traces/agentic-mooncake.jsonl -- 4 6 10 16 32
# Many long conversations whose working set is 5-10x the budget (issue 18). Their next turns are
# sent at their timestamps either way (the answer is not in the next prompt), so they run once.
if [ -z "$SUFFIX" ]; then
  run long-conversations --workload long-conversations -- 10 13 16 20
  run long-conversations-shared --workload long-conversations-shared -- 7 10 14 20
  # The public slice (../shared/traces, its README): 4,031 requests of the Mooncake FAST'25
  # conversation trace. Mooncake traces carry no answers: one loop.
  run mooncake-conversation --trace eval/traces/mooncake-conversation-dev.jsonl -- 80 160 320 640
  # The same at a load one engine keeps up with (issue 42): recorded on a cluster, the slice
  # overloads one simulated engine (mean TTFT ~10 min for every engine); at 4x its timestamps
  # swa-free's mean TTFT is ~3 s at 320 GiB. Every request is kept, so the trace's reuse is the same.
  run mooncake-conversation-stretch4 --trace eval/traces/mooncake-conversation-dev.jsonl --stretch 4 -- 80 160 320 640
  # A second public trace (issue 56): 2,183 requests of the Mooncake FAST'25 synthetic trace, whose
  # prompts fork mid-prompt (at a block an earlier prompt passed through) far more often.
  run mooncake-synthetic --trace eval/traces/mooncake-synthetic-dev.jsonl -- 80 160 320 640
  run mooncake-synthetic-stretch4 --trace eval/traces/mooncake-synthetic-dev.jsonl --stretch 4 -- 80 160 320 640
fi

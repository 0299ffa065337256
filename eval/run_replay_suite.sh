#!/usr/bin/env bash
# The issue-3 side-by-side replay: every workload at five KV budgets (four for the long
# conversations of issue 18), all engines, JSON + plot.
# Budgets are chosen per workload from the swa-free ceiling (see eval/RESULTS.md).
#   eval/run_replay_suite.sh              sessions closed-loop (the default of eval.replay)
#   eval/run_replay_suite.sh --open-loop  every request at its timestamp; files *-open-loop.*
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=eval/results
EXTRA=() SUFFIX=
case "${1:-}" in
  "") ;;
  --open-loop) EXTRA=(--open-loop) SUFFIX=-open-loop ;;
  *) echo "usage: $0 [--open-loop]" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
run() {  # name, source args..., -- budgets...
  local name=$1$SUFFIX; shift
  local src=(); while [ "$1" != "--" ]; do src+=("$1"); shift; done; shift
  "$PY" -m eval.replay "${src[@]}" "${EXTRA[@]}" --layout mimo-v2.5-pro --kv-gib "$@" \
    --json "$OUT/replay-$name.json" --plot "$OUT/replay-$name.png" | tee "$OUT/replay-$name.txt"
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
fi

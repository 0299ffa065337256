"""Compare two sets of `eval.replay` JSON files: the same counts run for run, or what differs.

    python -m eval.replay_compare BEFORE_DIR AFTER_DIR [--pattern 'replay-*.json']

For a change that must not change what the managers do (a refactor), run the replay suite
(`eval/run_replay_suite.sh`) on the commit before it and after it, each writing its own
`eval/results`, and compare the two folders. Counts are compared exactly: prompt, ideal, hit,
full-hit and pseudo-hit tokens, recomputed prefill tokens, preemptions, steps cut, anchors kept
and evicted by kind, peak blocks held, simulated seconds and TTFT; not the manager's time per
call, which is measured and varies with the machine's state (compare it in alternated runs).
Exit status 0 when every run in both folders has the same counts, 1 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COUNTS = (
    "requests", "prompt_tokens", "ideal_hit_tokens", "hit_tokens", "full_hit_tokens", "pseudo_hit_tokens",
    "recomputed_prefill_tokens", "preemptions", "prefill_steps_cut", "anchors", "peak_blocks",
    "sim_seconds", "ttft_mean_s", "ttft_p90_s",
)


def _runs(path: Path) -> dict[tuple[str, float], dict]:
    return {(run["engine"], run["kv_gib"]): run for run in json.loads(path.read_text())["runs"]}


def compare(before: Path, after: Path, pattern: str) -> tuple[list[str], int]:
    """Lines describing every difference, and the number of runs compared."""
    lines: list[str] = []
    compared = 0
    names = sorted({p.name for p in before.glob(pattern)} | {p.name for p in after.glob(pattern)})
    for name in names:
        a, b = before / name, after / name
        if not (a.exists() and b.exists()):
            lines.append(f"{name}: only in {before if a.exists() else after}")
            continue
        runs_a, runs_b = _runs(a), _runs(b)
        if set(runs_a) != set(runs_b):
            lines.append(f"{name}: different runs {sorted(set(runs_a) ^ set(runs_b))}")
        for key in sorted(set(runs_a) & set(runs_b)):
            compared += 1
            x, y = runs_a[key], runs_b[key]
            diff = {k: (x.get(k), y.get(k)) for k in COUNTS if x.get(k) != y.get(k)}
            if diff:
                lines.append(f"{name} {key[0]} {key[1]:g} GiB: {diff}")
    return lines, compared


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.replay_compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="folder of eval.replay JSON files (the reference)")
    parser.add_argument("after", type=Path, help="folder of eval.replay JSON files to compare with it")
    parser.add_argument("--pattern", default="replay-*.json", help="file names to compare (default: replay-*.json)")
    args = parser.parse_args(argv)
    for folder in (args.before, args.after):
        if not folder.is_dir():
            parser.error(f"{folder} is not a folder")
    try:
        lines, compared = compare(args.before, args.after, args.pattern)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not compared:
        print(f"error: no runs to compare ({args.pattern} in {args.before} and {args.after})", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    print(f"{compared} runs compared: {'the same counts' if not lines else f'{len(lines)} differences'}")
    return 0 if not lines else 1


if __name__ == "__main__":
    raise SystemExit(main())

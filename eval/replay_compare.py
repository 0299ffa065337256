"""Compare two sets of `eval.replay` JSON files: the same counts run for run, or what differs.

    python -m eval.replay_compare BEFORE_DIR AFTER_DIR [--pattern 'replay-*.json'] [--table ENGINE]

For a change that must not change what the managers do (a refactor), run the replay suite
(`eval/run_replay_suite.sh`) on the commit before it and after it, each writing its own
`eval/results`, and compare the two folders. Counts are compared exactly: prompt, ideal, hit,
full-hit and pseudo-hit tokens, recomputed prefill tokens, preemptions, steps cut, anchors kept
and evicted by kind, peak blocks held, simulated seconds and TTFT; not the manager's time per
call, which is measured and varies with the machine's state (compare it in alternated runs).
Exit status 0 when every run in both folders has the same counts, 1 otherwise, 2 on bad input.

For a change that is meant to change one engine's results (a policy), `--table ENGINE` prints
that engine's hit tokens, mean and p90 TTFT and preemptions before and after, point by point, as
a Markdown table, and the worst ratio of hit tokens after to before; with `--min RATIO` the exit
status is 1 when some point's ratio is below RATIO. The guard of a policy change (issue 56: no
point of the suite, the slice or the synthetic trace loses more than 2%), with the plugin alone
run into another folder:

    SGLANG=0 PLOT=0 ENGINES=mimo OUT=/tmp/after eval/run_replay_suite.sh
    SGLANG=0 PLOT=0 ENGINES=mimo OUT=/tmp/after eval/run_replay_suite.sh --open-loop
    python -m eval.replay_compare eval/results /tmp/after --table mimo --min 0.98

The long conversations' current plugin rows are in `replay-long-conversations{,-shared}-mimo.json`
(a rerun of the plugin alone; the files without `-mimo` keep the rows of the commit the peers ran
at): compare the suite's files of those two workloads with them, under the `-mimo` names.
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


def table(before: Path, after: Path, pattern: str, engine: str) -> tuple[list[str], float]:
    """One Markdown row per budget of `engine` in both folders, and a closing line; and the
    lowest ratio of hit tokens after to before."""
    lines = [
        "| file | KV GiB | hit before | hit after | after ÷ before | TTFT s before / after | p90 before / after | "
        "preemptions before / after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    worst: tuple[float, str] | None = None
    for path in sorted(before.glob(pattern)):
        other = after / path.name
        if not other.exists():
            continue
        runs_a, runs_b = _runs(path), _runs(other)
        for key in sorted(k for k in runs_a if k[0] == engine and k in runs_b):
            x, y = runs_a[key], runs_b[key]
            ratio = y["hit_tokens"] / x["hit_tokens"] if x["hit_tokens"] else float("inf")
            where = f"{path.stem} {key[1]:g} GiB"
            if worst is None or ratio < worst[0]:
                worst = (ratio, where)
            lines.append(
                f"| {path.stem} | {key[1]:g} | {x['hit_tokens']:,} | {y['hit_tokens']:,} | {ratio:.4f} | "
                f"{x['ttft_mean_s']:.3f} / {y['ttft_mean_s']:.3f} | {x['ttft_p90_s']:.3f} / {y['ttft_p90_s']:.3f} | "
                f"{x['preemptions']} / {y['preemptions']} |"
            )
    if worst is None:
        raise ValueError(f"no {engine} runs in both {before} and {after}")
    lines.append(f"\n{len(lines) - 2} points; lowest hit tokens after ÷ before: {worst[0]:.4f} ({worst[1]})")
    return lines, worst[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.replay_compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="folder of eval.replay JSON files (the reference)")
    parser.add_argument("after", type=Path, help="folder of eval.replay JSON files to compare with it")
    parser.add_argument("--pattern", default="replay-*.json", help="file names to compare (default: replay-*.json)")
    parser.add_argument(
        "--table",
        metavar="ENGINE",
        help="print ENGINE's hits, TTFT and preemptions before and after, point by point, instead of the differences",
    )
    parser.add_argument(
        "--min",
        type=float,
        metavar="RATIO",
        help="with --table: exit status 1 when some point's hit tokens after ÷ before is below RATIO (> 0)",
    )
    args = parser.parse_args(argv)
    if args.min is not None and (args.table is None or not args.min > 0):
        parser.error(f"--min needs --table and a ratio > 0, got --min {args.min}" + ("" if args.table else " without --table"))
    for folder in (args.before, args.after):
        if not folder.is_dir():
            parser.error(f"{folder} is not a folder")
    if args.table:
        try:
            lines, lowest = table(args.before, args.after, args.pattern, args.table)
        except (OSError, ValueError, KeyError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print("\n".join(lines))
        if args.min is not None and lowest < args.min:
            print(f"below {args.min:g} at some point: lowest {lowest:.4f}")
            return 1
        return 0
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

"""Fourteen fixed replay points that a refactor of the KV cache must leave exactly as they were.

    python -m eval.replay_points OUT_DIR [--root TREE]     run them, JSON files into OUT_DIR
    python -m eval.replay_points --compare BEFORE AFTER    the same counts, point by point?

The points, each small enough for a shared 2-core machine (about a minute in all):
  * `eval.replay` on agent-sessions (scale 0.25) at 2 and 3 GiB: the plugin with its defaults,
    on stock attention (which cannot serve 2 GiB: 3 GiB only), with its host tier and with the
    dense host tier (7 points);
  * `eval.replay` on mixed (scale 0.25) at 2 GiB: the plugin, its host tier and the dense one
    (3 points);
  * `eval.replay_cluster` on agent-sessions (scale 0.25), 2 GiB device, 1 GiB host and an 8 GiB
    shared L3 per run: one instance, and four behind the kv-aware and round-robin routers, with
    the single-instance ideal (4 points), so the L3's puts and reads are in it.

`--root` runs another checkout (a `git worktree` of the commit before a change), with the same
Python. `--compare` compares the counts of `eval.replay_compare.COUNTS` for the replay points
and every count of a cluster row (all but its wall time); exit status 0 when all are the same,
1 otherwise (each difference printed), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from eval.replay_compare import compare

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = ["--layout", "mimo-v2.5-pro", "--scale", "0.25", "--quiet"]
REPLAYS = {
    "replay-agent-sessions": [
        "--workload", "agent-sessions", "--kv-gib", "2", "3", "--engines", "mimo,mimo-stock-attention,mimo-host,mimo-host-dense",
    ],
    "replay-mixed": ["--workload", "mixed", "--kv-gib", "2", "--engines", "mimo,mimo-host,mimo-host-dense"],
}
CLUSTER = [
    "--workload", "agent-sessions", "--kv-gib", "2", "--host-gib", "1", "--instances", "1,4",
    "--routers", "kv-aware,round-robin", "--l3", "on", "--l3-gib", "8",
]
NOT_COUNTS = {"wall_seconds"}


def run(out: Path, root: Path) -> None:
    """Every point, run in `root` (its own `vllm_mimo` and `eval`)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONHASHSEED": "0"}
    jobs = [("eval.replay", name, args) for name, args in REPLAYS.items()]
    jobs.append(("eval.replay_cluster", "cluster-agent-sessions", [a for a in LAYOUT if a != "--quiet"] + CLUSTER))
    for module, name, args in jobs:
        extra = LAYOUT if module == "eval.replay" else []
        subprocess.run(
            [sys.executable, "-m", module, *args, *extra, "--json", str(out / f"{name}.json")],
            cwd=root, env=env, check=True, stdout=subprocess.DEVNULL,
        )


def compare_cluster(before: Path, after: Path) -> tuple[list[str], int]:
    """Differences between two cluster JSON files, row by row, and the rows compared."""
    rows = [{(r["instances"], r["router"], r["l3"]): r for r in json.loads(p.read_text())["runs"]} for p in (before, after)]
    lines = [f"{before.name}: different rows {sorted(set(rows[0]) ^ set(rows[1]))}"] if set(rows[0]) != set(rows[1]) else []
    for key in sorted(set(rows[0]) & set(rows[1])):
        a, b = rows[0][key], rows[1][key]
        diff = {k: (a.get(k), b.get(k)) for k in sorted((set(a) | set(b)) - NOT_COUNTS) if a.get(k) != b.get(k)}
        if diff:
            lines.append(f"{before.name} {key}: {diff}")
    return lines, len(set(rows[0]) & set(rows[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, help="run the points, JSON files here")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to run (default: this one)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="compare two runs' folders")
    args = parser.parse_args(argv)
    if (args.out is None) == (args.compare is None):
        parser.error("give OUT_DIR to run, or --compare BEFORE AFTER")
    if args.out is not None:
        run(args.out, args.root.resolve())
        return 0
    before, after = args.compare
    for folder in (before, after):
        if not folder.is_dir():
            parser.error(f"{folder} is not a folder")
    lines, points = compare(before, after, "replay-*.json")
    name = "cluster-agent-sessions.json"
    cluster_lines, rows = compare_cluster(before / name, after / name)
    lines += cluster_lines
    print("\n".join(lines) if lines else f"{points + rows} points, the same counts")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())

"""Manager time per call of two or more revisions of this repository, run at once on one CPU.

    python -m eval.replay_us --rev 7aa9986 --rev HEAD [--cpu 1] [--no-gc] [--json out.json] \\
        -- --workload mixed --kv-gib 4 6 10

Each revision (a git revision, or `.` for the working tree as it is) is exported into a
temporary folder (`git archive`) and replays the same input (`eval.replay`, the arguments
after `--`, one engine) in a process of its own. All of them start together, pinned to the
same CPU, so the machine's state over the run (clock speed, other tenants, what the other CPU
does) is the same for each; each counts its manager's CPU time as `eval.replay` does (this
thread's CPU time per manager call). On this project's 2-core VM, a revision against itself
this way agrees within about 1% at a point, where runs one after the other, or at once on two
CPUs, spread by 10-45% (eval/RESULTS.md, issue 18).

Prints, per budget, each revision's µs per call and its ratio to the first revision's, and
which revisions' counts (`eval.replay_compare.COUNTS`: hits, TTFT, preemptions, ...) are the
same (a change meant only to be faster must make the same decisions); writes the same as JSON.
Exit status 0, 1 if a replay failed, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eval.replay_compare import COUNTS

ROOT = Path(__file__).resolve().parent.parent
# The replay in each revision's own folder; the collector off on request (`--no-gc`).
_RUN = "import gc, sys\nif sys.argv[1] == 'off': gc.disable()\nfrom eval.replay import main\nsys.exit(main(sys.argv[2:]))"


@dataclass
class Revision:
    name: str
    """As given (`.`: the working tree)."""
    commit: str
    """The commit it resolves to (for `.`, HEAD's, plus `-dirty` when the tree has changes)."""


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def resolve(name: str) -> Revision:
    """The commit a revision names; ValueError naming it if git does not know it."""
    try:
        if name == ".":
            dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
            return Revision(name, _git("rev-parse", "HEAD") + ("-dirty" if dirty else ""))
        return Revision(name, _git("rev-parse", "--verify", "--quiet", f"{name}^{{commit}}"))
    except (OSError, subprocess.CalledProcessError):
        raise ValueError(f"--rev {name!r} is not a commit of {ROOT} (a git revision, or '.' for the working tree)") from None


def export(revision: Revision, folder: Path) -> Path:
    """The revision's files in `folder`, a new one (the working tree itself for `.`)."""
    if revision.name == ".":
        return ROOT
    folder.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision.commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def run_together(folders: list[Path], replay_args: list[str], cpu: int, gc: bool, out: Path) -> list[subprocess.CompletedProcess]:
    """Start one replay per folder at once, all pinned to `cpu`; wait for all of them."""
    procs = []
    for i, folder in enumerate(folders):
        env = {**os.environ, "PYTHONPATH": str(folder), "PYTHONHASHSEED": "0"}
        args = [sys.executable, "-c", _RUN, "on" if gc else "off", *replay_args, "--quiet", "--json", str(out / f"{i}.json")]
        procs.append(
            subprocess.Popen(
                args, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
            )
        )
    done = []
    for proc in procs:
        stdout, stderr = proc.communicate()
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return done


def compare_runs(revisions: list[Revision], results: list[list[dict]]) -> list[dict]:
    """Per (engine, budget): each revision's µs per call, its ratio to the first's, and which
    revisions' counts are the same."""
    points = []
    first = {(r["engine"], r["kv_gib"]): r for r in results[0]}
    for key, base in first.items():
        runs = [{(r["engine"], r["kv_gib"]): r for r in rs}.get(key) for rs in results]
        if any(run is None for run in runs):
            raise ValueError(f"{key[0]} at {key[1]:g} GiB is missing from a revision's runs")
        points.append(
            {
                "engine": key[0],
                "kv_gib": key[1],
                "us_per_call": {rev.name: run["mean_us_per_call"] for rev, run in zip(revisions, runs, strict=False)},
                "ratio_to_first": {
                    rev.name: run["mean_us_per_call"] / base["mean_us_per_call"] for rev, run in zip(revisions, runs, strict=False)  # noqa: E501
                },
                "same_counts": _same_counts(revisions, runs),
                "hit_tokens": {rev.name: run["hit_tokens"] for rev, run in zip(revisions, runs, strict=False)},
            }
        )
    return points


def _same_counts(revisions: list[Revision], runs: list[dict]) -> list[list[str]]:
    """The revisions whose runs have the same counts, in groups of two or more."""
    groups: dict[tuple, list[str]] = {}
    for rev, run in zip(revisions, runs, strict=False):
        groups.setdefault(tuple(json.dumps(run.get(k), sort_keys=True) for k in COUNTS), []).append(rev.name)
    return [names for names in groups.values() if len(names) > 1]


def table(revisions: list[Revision], points: list[dict]) -> list[str]:
    head = ["engine", "KV GiB", *(f"{r.name} µs/call" for r in revisions), *(f"{r.name} ÷ {revisions[0].name}" for r in revisions[1:])]  # noqa: E501
    lines = ["| " + " | ".join(head) + " | the same counts |", "|" + "---|" * 2 + "---:|" * (len(head) - 2) + "---|"]
    for p in points:
        us, ratio = p["us_per_call"], p["ratio_to_first"]
        same = "; ".join(" = ".join(names) for names in p["same_counts"]) or "none"
        cells = [p["engine"], f"{p['kv_gib']:g}", *(f"{us[r.name]:.1f}" for r in revisions), *(f"{ratio[r.name]:.3f}" for r in revisions[1:])]  # noqa: E501
        lines.append("| " + " | ".join(cells) + f" | {same} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    replay_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, replay_args = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m eval.replay_us",
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after `--` go to eval.replay (the input, --layout, --kv-gib, ...); --engines "
        "is set from --engine here, --quiet and --json by this tool.",
    )
    parser.add_argument(
        "--rev",
        action="append",
        required=True,
        metavar="REV",
        help="a git revision to measure, or '.' for the working tree; twice or more (ratios are to the first)",
    )
    cpus = sorted(os.sched_getaffinity(0))
    parser.add_argument("--cpu", type=int, default=cpus[-1], help=f"the CPU every replay is pinned to, one of {cpus} (default: {cpus[-1]})")  # noqa: E501
    parser.add_argument("--engine", default="mimo", help="the eval.replay engine to time (default: mimo)")
    parser.add_argument("--no-gc", action="store_true", help="turn Python's garbage collector off in the replays (default: on, as served)")  # noqa: E501
    parser.add_argument("--json", type=Path, help="write the points as JSON here")
    args = parser.parse_args(argv)
    if len(args.rev) < 2:
        parser.error(f"--rev: give two revisions or more to compare, got {len(args.rev)}")
    if len(set(args.rev)) < len(args.rev):
        parser.error(f"--rev: give each revision once, got {' '.join(args.rev)}")
    if args.cpu not in cpus:
        parser.error(f"--cpu must be one of {cpus} (this process's CPUs), got {args.cpu}")
    if not replay_args:
        parser.error("give the replay's arguments after `--` (e.g. -- --workload mixed --layout mimo-v2.5-pro --kv-gib 6)")
    if any(a == "--engines" or a.startswith("--engines=") or a in ("--json", "--quiet") for a in replay_args):
        parser.error("after `--`: --engines, --json and --quiet are set by this tool (use --engine)")
    try:
        revisions = [resolve(name) for name in args.rev]
    except ValueError as e:
        parser.error(str(e))
    replay_args = [*replay_args, "--engines", args.engine]

    with tempfile.TemporaryDirectory(prefix="replay-us-") as tmp:
        tmp_path = Path(tmp)
        folders = [export(rev, tmp_path / f"rev-{i}") for i, rev in enumerate(revisions)]
        print(f"replaying {', '.join(r.name for r in revisions)} at once on CPU {args.cpu} "
              f"(eval.replay {' '.join(replay_args)}; collector {'off' if args.no_gc else 'on'}) ...", flush=True)
        start = time.monotonic()
        done = run_together(folders, replay_args, args.cpu, not args.no_gc, tmp_path)
        print(f"done in {time.monotonic() - start:.0f} s", flush=True)
        for rev, proc in zip(revisions, done, strict=False):
            if proc.returncode:
                print(f"error: the replay of {rev.name} exited with {proc.returncode}:\n{proc.stderr[-2000:]}", file=sys.stderr)
                return 2 if proc.returncode == 2 else 1  # 2: the replay refused its arguments
        results = [json.loads((tmp_path / f"{i}.json").read_text())["runs"] for i in range(len(revisions))]
    try:
        points = compare_runs(revisions, results)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n".join(table(revisions, points)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "replay_args": replay_args,
            "cpu": args.cpu,
            "gc": not args.no_gc,
            "revisions": [asdict(r) for r in revisions],
            "points": points,
        }
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where later prompts fork mid-prompt, by depth: what a grid anchor there would have served.

    python -m eval.trace_forks --trace eval/traces/mooncake-synthetic-dev.jsonl \
        --json eval/results/forks-mooncake-synthetic-dev.json

A prompt's segment boundaries strictly inside it, but for the one before its last segment (a
prompt tail's place: a next turn keeps only whole segments), are its mid-prompt points; a
point is counted once, for the prompt that first reached it. A later prompt forks there when
its cached prefix (the longest prefix some earlier prompt started with) ends exactly there:
the hit a grid window at the point serves, which without one is a pseudo hit (the Full KV of
the path is cached, the SWA window at its end is not). Per band of depth in tokens: the points,
the share a later prompt forked at, the hit tokens of every fork there, the seconds from the
point's first prompt to the first fork (quartiles), and how many of the forked points some
later prompt passed through (cached beyond it) before the first fork: what a cache that
refreshes the SWA along every hit path (SGLang's LRU) sees of a fork coming. The plugin's
grid anchors sit on these points for Mooncake traces (512-token segments, `grid_anchor_tokens`
512): eval/notes/branch-points.md, issue 56.
"""

from __future__ import annotations

import argparse
import json
import statistics
from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eval.replay import add_source_arguments, load_source
from eval.trace_reuse import cached_segments, token_edges
from eval.workloads import ReplayRequest

DEFAULT_DEPTHS = (4096, 16384, 32768, 65536)


@dataclass
class DepthBand:
    """Mid-prompt points at least `min_tokens` deep and less than `max_tokens` (None: no bound)."""

    min_tokens: int
    max_tokens: int | None
    points: int = 0
    forked: int = 0  # points a later prompt forked at
    fork_tokens: int = 0  # hit tokens of every fork at them (the depth, per fork)
    passed_first: int = 0  # forked points some later prompt passed through before the first fork
    seconds: list[float] = field(default_factory=list, repr=False)  # until the first fork, per forked point

    @property
    def share(self) -> float:
        return self.forked / self.points if self.points else 0.0

    @property
    def label(self) -> str:
        return f"{self.min_tokens:,}-{self.max_tokens:,}" if self.max_tokens is not None else f">= {self.min_tokens:,}"

    def quartiles(self) -> tuple[float, float, float] | None:
        if not self.seconds:
            return None
        if len(self.seconds) == 1:
            return (self.seconds[0],) * 3
        p25, median, p75 = statistics.quantiles(self.seconds, n=4)
        return p25, median, p75


def fork_bands(requests: list[ReplayRequest], edges: tuple[int, ...]) -> list[DepthBand]:
    """One `DepthBand` per interval between `edges` (ascending depths in tokens), counted over
    `requests` in arrival order (see the module docstring)."""
    bounds = (0, *edges)
    bands = [DepthBand(lo, hi) for lo, hi in zip(bounds, (*edges, None), strict=True)]
    # prefix -> (first request, depth in tokens, a mid-prompt point of that request)
    seen: dict[tuple, tuple[int, int, bool]] = {}
    passed: set[tuple] = set()  # mid-prompt points a later prompt went beyond
    first_fork: set[tuple] = set()
    for i, request in enumerate(requests):
        prompt = request.prompt
        cached = cached_segments(prompt, seen)
        for end in range(1, cached):
            if seen[prompt[:end]][0] != i and prompt[:end] not in first_fork:
                passed.add(prompt[:end])
        if cached:
            point = prompt[:cached]
            first, depth, mid = seen[point]
            if mid:
                band = bands[bisect_right(edges, depth)]
                band.fork_tokens += depth
                if point not in first_fork:
                    first_fork.add(point)
                    band.forked += 1
                    band.passed_first += point in passed
                    band.seconds.append(request.arrival_s - requests[first].arrival_s)
        depth = sum(s.length for s in prompt[:cached])
        for end in range(cached + 1, len(prompt) + 1):
            depth += prompt[end - 1].length
            mid = end < len(prompt) - 1
            seen[prompt[:end]] = (i, depth, mid)
            if mid:
                bands[bisect_right(edges, depth)].points += 1
    return bands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.trace_forks", description=__doc__.split("\n\n")[0])
    add_source_arguments(parser, replay=False)
    parser.add_argument(
        "--bands", type=token_edges, metavar="TOKENS,...",
        help="depths in tokens where one band ends and the next starts, ascending "
        f"(default: {','.join(map(str, DEFAULT_DEPTHS))})",
    )
    parser.add_argument("--json", type=Path, help="write the table as JSON here")
    args = parser.parse_args(argv)
    source = load_source(parser, args)
    if source is None:
        return 1
    bands = fork_bands(source.requests, args.bands or DEFAULT_DEPTHS)

    def seconds(band: DepthBand) -> str:
        q = band.quartiles()
        return " | | " if q is None else " | ".join(f"{s:.1f}" for s in q)

    print(f"{source.name}: {len(source.requests)} requests")
    print("| depth (tokens) | mid-prompt points | a later prompt forked there | share | fork hit tokens "
          "| passed through before the first fork | seconds until it: p25 | median | p75 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for band in bands:
        print(f"| {band.label} | {band.points:,} | {band.forked:,} | {band.share:.4f} | {band.fork_tokens:,} "
              f"| {band.passed_first:,} | {seconds(band)} |")
    total = DepthBand(0, None, *(sum(getattr(b, k) for b in bands) for k in ("points", "forked", "fork_tokens")))
    print(f"all depths: {total.points:,} points, {total.forked:,} forked ({total.share:.4f}), "
          f"{total.fork_tokens:,} fork hit tokens")
    if args.json:
        rows = []
        for band in bands:
            row = {k: v for k, v in asdict(band).items() if k != "seconds"}
            q = band.quartiles()
            p25, median, p75 = q if q is not None else (None, None, None)
            row.update(label=band.label, share=band.share, seconds_p25=p25, seconds_median=median, seconds_p75=p75)
            rows.append(row)
        data = {"source": source.name, "requests": len(source.requests), "bands": rows}
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How often, and how soon, a later request goes on from a request's prompt, by prompt length
or by how much of the prompt was cached when it came.

    python -m eval.trace_reuse --trace eval/traces/agentic-mooncake.jsonl --json eval/results/reuse-agentic-mooncake.json
    python -m eval.trace_reuse --trace eval/traces/mooncake-synthetic-dev.jsonl --by cached

A request "goes on" from an earlier one when its prompt starts with all of the earlier prompt
but its last segment (a Mooncake trace's last 512-token block is partial, and a next turn keeps
only whole blocks): what a prompt-tail anchor serves. Per band of prompt length: how many
requests, the share some later request goes on from, and the seconds until the first one does
(quartiles, by arrival time). With `--by cached` the bands are the share of the prompt's segments
some earlier prompt started with (what an ideal cache held of it on arrival): none, under half,
half or more. What it shows is what an eviction order that knows the future
(`eval.replay_bound`'s `clairvoyant`) uses and an online one must learn (eval/RESULTS.md, issue 18;
eval/notes/branch-points.md, issue 56).
"""

from __future__ import annotations

import argparse
import json
import statistics
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Container
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path

from eval.replay import add_source_arguments, load_source
from eval.workloads import ReplayRequest

DEFAULT_BANDS = (3000, 6000, 15000)
CACHED_BANDS = ("none", "under half", "half or more")
"""`--by cached`'s bands: the share of a prompt's segments an earlier prompt started with."""


@dataclass
class Band:
    """Requests whose prompt is at least `min_tokens` long and shorter than `max_tokens` (None:
    no upper bound)."""

    min_tokens: int
    max_tokens: int | None
    name: str = ""
    """The band's label where it is not a range of prompt lengths (`--by cached`)."""
    requests: int = 0
    continued: int = 0  # a later request goes on from its prompt
    seconds_p25: float | None = None
    seconds_median: float | None = None
    seconds_p75: float | None = None

    @property
    def share(self) -> float:
        return self.continued / self.requests if self.requests else 0.0

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return f"{self.min_tokens:,}-{self.max_tokens:,}" if self.max_tokens is not None else f">= {self.min_tokens:,}"


def next_use_seconds(requests: list[ReplayRequest]) -> list[float | None]:
    """Per request (in arrival order), the seconds until the first later request goes on from its
    prompt (see the module docstring), or None if none does or its prompt has one segment."""
    starts: dict[tuple, list[int]] = defaultdict(list)  # prompt prefix -> requests starting with it
    for j, request in enumerate(requests):
        for end in range(1, len(request.prompt) + 1):
            starts[request.prompt[:end]].append(j)
    out: list[float | None] = []
    for i, request in enumerate(requests):
        later = starts.get(request.prompt[:-1], []) if len(request.prompt) > 1 else []
        k = bisect_right(later, i)
        out.append(requests[later[k]].arrival_s - request.arrival_s if k < len(later) else None)
    return out


def cached_segments(prompt: tuple, seen: Container[tuple]) -> int:
    """How many leading segments of `prompt` some earlier prompt started with (`seen`: every
    prefix of the earlier prompts)."""
    cached = 0
    while cached < len(prompt) and prompt[: cached + 1] in seen:
        cached += 1
    return cached


def cached_shares(requests: list[ReplayRequest]) -> list[float]:
    """Per request (in arrival order), the share of its prompt's segments that some earlier
    prompt started with."""
    seen: set[tuple] = set()
    out = []
    for request in requests:
        prompt = request.prompt
        cached = cached_segments(prompt, seen)
        out.append(cached / len(prompt) if prompt else 0.0)
        seen.update(prompt[:end] for end in range(1, len(prompt) + 1))
    return out


def bands_of(requests: list[ReplayRequest], edges: tuple[int, ...], by_cached: bool = False) -> list[Band]:
    """One `Band` per interval between `edges` (ascending token counts), counted; with
    `by_cached`, one per `CACHED_BANDS` instead."""
    if by_cached:
        bands = [Band(0, None, name) for name in CACHED_BANDS]
        which = [0 if share == 0 else 1 if share < 0.5 else 2 for share in cached_shares(requests)]
    else:
        bounds = (0, *edges)
        bands = [Band(lo, hi) for lo, hi in zip(bounds, (*edges, None), strict=True)]
        which = [bisect_right(edges, request.prompt_len) for request in requests]
    gaps: list[list[float]] = [[] for _ in bands]
    for b, seconds in zip(which, next_use_seconds(requests), strict=True):
        bands[b].requests += 1
        if seconds is not None:
            bands[b].continued += 1
            gaps[b].append(seconds)
    for band, seconds in zip(bands, gaps, strict=True):
        if len(seconds) >= 2:
            band.seconds_p25, band.seconds_median, band.seconds_p75 = statistics.quantiles(seconds, n=4)
        elif seconds:
            band.seconds_p25 = band.seconds_median = band.seconds_p75 = seconds[0]
    return bands


def token_edges(text: str) -> tuple[int, ...]:
    """`--bands`: comma-separated token counts, positive and ascending."""
    try:
        edges = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bands must be comma-separated token counts, got {text!r}") from None
    if not edges or edges[0] < 1 or any(b <= a for a, b in pairwise(edges)):
        raise argparse.ArgumentTypeError(f"--bands must be positive and ascending, got {text!r}")
    return edges


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.trace_reuse", description=__doc__.split("\n\n")[0])
    add_source_arguments(parser, replay=False)
    parser.add_argument(
        "--bands", type=token_edges, metavar="TOKENS,...",
        help="with --by length, prompt lengths where one band ends and the next starts, ascending "
        f"(default: {','.join(map(str, DEFAULT_BANDS))})",
    )
    parser.add_argument(
        "--by", choices=("length", "cached"), default="length",
        help="band the requests by prompt length, or by the share of the prompt an earlier prompt "
        f"started with ({', '.join(CACHED_BANDS)}) (default: length)",
    )
    parser.add_argument("--json", type=Path, help="write the table as JSON here")
    args = parser.parse_args(argv)
    if args.by == "cached" and args.bands is not None:
        parser.error("--bands applies to --by length only")
    source = load_source(parser, args)
    if source is None:
        return 1
    requests = source.requests
    bands = bands_of(requests, args.bands or DEFAULT_BANDS, by_cached=args.by == "cached")

    def seconds(value: float | None) -> str:
        return "" if value is None else f"{value:.1f}"

    name = source.name
    print(f"{name}: {len(requests)} requests")
    band_column = "prompt cached on arrival" if args.by == "cached" else "prompt tokens"
    print(f"| {band_column} | requests | a later request goes on from it | share | seconds until then: p25 | median | p75 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for band in bands:
        print(f"| {band.label} | {band.requests} | {band.continued} | {band.share:.2f} | "
              f"{seconds(band.seconds_p25)} | {seconds(band.seconds_median)} | {seconds(band.seconds_p75)} |")
    if args.json:
        rows = [{**asdict(band), "label": band.label, "share": band.share} for band in bands]
        args.json.write_text(json.dumps({"source": name, "requests": len(requests), "bands": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

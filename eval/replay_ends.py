"""Each engine's hits by where the ideal hit ends: after an earlier prompt's tail, mid-prompt, or a whole prompt.

    python -m eval.replay_ends --trace eval/traces/mooncake-synthetic-dev.jsonl --stretch 4 \\
        --layout mimo-v2.5-pro --kv-gib 320 --engines mimo,sglang-unified,swa-free \\
        --json eval/results/ends-mooncake-synthetic-dev-stretch4-320.json

Replays one point with each engine (`eval.replay`'s way: the same requests and blocks) and
splits every request by where its longest prefix some earlier prompt started with ends, in the
source's segments (a Mooncake trace's 512-token blocks):
  * tail: where an earlier prompt's last segment starts (a next turn, or a prompt going on from
    an earlier one: what a prompt-tail anchor serves);
  * mid-prompt: anywhere else inside an earlier prompt (a fork: what a grid or branch anchor
    serves);
  * whole prompt: all of an earlier prompt (a resend: what a prompt-end anchor serves);
  * none: nothing cached.
Per class, the ideal hit tokens (an unlimited cache) and each engine's, with their share of the
ideal: which kind of reuse one engine keeps and another loses (eval/notes/branch-points.md,
issue 56).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from eval.replay import ENGINES, SimParams, add_source_arguments, ideal_hits, load_source, parse_engines, simulate
from eval.trace_reuse import cached_segments
from eval.workloads import ReplayRequest

CLASSES = ("tail", "mid-prompt", "whole prompt", "none")


def hit_ends(requests: list[ReplayRequest]) -> list[str]:
    """Per request (in arrival order), the `CLASSES` entry its longest cached prefix ends at."""
    seen: set[tuple] = set()  # every prefix of an earlier prompt
    tails: set[tuple] = set()  # earlier prompts but their last segment
    wholes: set[tuple] = set()
    out = []
    for request in requests:
        prompt = request.prompt
        cached = cached_segments(prompt, seen)
        point = prompt[:cached]
        out.append("none" if not cached else "tail" if point in tails else "whole prompt" if point in wholes else "mid-prompt")
        seen.update(prompt[:end] for end in range(1, len(prompt) + 1))
        wholes.add(prompt)
        if len(prompt) > 1:
            tails.add(prompt[:-1])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.replay_ends", description=__doc__.split("\n\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--kv-gib", type=float, required=True, help="the KV cache budget in GiB, > 0")
    parser.add_argument("--engines", default="mimo,swa-free",
                        help=f"comma-separated engines: {','.join(ENGINES)}, and SGLang's (sglang-unified, "
                        "sglang-r<RATIO>, each optionally -norefresh: make sglang) (default: mimo,swa-free)")
    parser.add_argument("--json", type=Path, help="write the table as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    engines = parse_engines(parser, args.engines)
    if engines is None:
        return 2
    if len(set(engines)) < len(engines):
        parser.error(f"--engines names an engine twice: {args.engines!r}")
    if not args.kv_gib > 0:
        parser.error(f"--kv-gib must be > 0, got {args.kv_gib}")
    source = load_source(parser, args)
    if source is None:
        return 2
    requests = source.requests
    params = SimParams(max_model_len=source.max_model_len, closed_loop=not args.open_loop)
    ideal = ideal_hits(requests)
    classes = hit_ends(requests)
    rows = {c: {"requests": 0, "ideal": 0, **dict.fromkeys(engines, 0)} for c in CLASSES}
    for c, tokens in zip(classes, ideal, strict=True):
        rows[c]["requests"] += 1
        rows[c]["ideal"] += tokens
    for engine in engines:
        if not args.quiet:
            print(f"replay_ends: {engine} at {args.kv_gib:g} GiB", file=sys.stderr)
        try:
            run = simulate(engine, args.layout, args.kv_gib, requests, ideal, params, progress=not args.quiet)
        except ValueError as e:
            print(f"error: {engine} at {args.kv_gib} GiB: {e}", file=sys.stderr)
            return 2
        for i, c in enumerate(classes):
            first = run.first_tokens.get(str(i))
            rows[c][engine] += first.hit_tokens if first is not None else 0

    load = f", {args.stretch:g}x stretched" if args.stretch != 1 else ""
    loop = ", open loop" if args.open_loop else ""
    print(f"{source.name}: {len(requests)} requests{load}{loop}, {args.kv_gib:g} GiB, layout {args.layout}")
    print("| the ideal hit ends at | requests | ideal hit tokens | " + " | ".join(engines) + " |")
    print("|---|---:|---:|" + "---:|" * len(engines))
    for c, row in rows.items():
        cells = " | ".join(f"{row[e]:,} ({row[e] / row['ideal']:.2f})" if row["ideal"] else f"{row[e]:,}" for e in engines)
        print(f"| {c} | {row['requests']:,} | {row['ideal']:,} | {cells} |")
    if args.json:
        data = {"source": source.name, "stretch": args.stretch, "layout": args.layout, "kv_gib": args.kv_gib,
                "params": asdict(params), "engines": engines, "rows": rows}
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

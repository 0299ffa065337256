"""Where two engines' mean time to first token differs at one replay point, request by request.

    python -m eval.replay_ttft (--trace FILE | --workload NAME) --layout LAYOUT --kv-gib G
        [--engines mimo,mimo-stock-attention] [--seed S] [--scale X] [--max-requests N]
        [--open-loop] [--json OUT] [--quiet]

Replays the point with both engines (`eval.replay`'s way, the same requests and blocks) and
splits the difference of their mean TTFT (A - B) by request:
  * requests A hits more tokens of, requests it hits fewer of, and requests both hit alike;
  * for each group, what the difference is made of: the wait before the step that first admits
    the request (queueing, and the step grid: a request sent while a step runs waits for the
    next one), and the time from that step's start to the first token (its prefill).
The rows add up to the difference of the means. A difference that sits in the waits of
requests hit alike is when the steps fell, not what either engine computed: a step that ends
earlier moves the grid of the steps after it, and requests sent within that shift wait one
step more or less.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from eval.replay import ENGINES, RunResult, SimParams, add_source_arguments, ideal_hits, load_source, simulate

GROUPS = ("A hits more", "A hits fewer", "hit alike")


@dataclass
class Share:
    """One group's part of A's mean TTFT minus B's (seconds, each over all requests)."""

    requests: int = 0
    hit_tokens: int = 0
    """A's hit tokens minus B's."""
    wait_s: float = 0.0
    """From sending to the start of the step that first admitted the request."""
    prefill_s: float = 0.0
    """From that step's start to the first token."""
    admitted_later: int = 0
    """Requests A admitted later than B did (by any time)."""
    admitted_earlier: int = 0
    steps_apart: int = 0
    """Requests admitted half a decode step or more apart (the rest moved with the grid)."""

    @property
    def ttft_s(self) -> float:
        return self.wait_s + self.prefill_s


def split(a: RunResult, b: RunResult, step_s: float = SimParams.decode_s_per_step) -> dict[str, Share]:
    """The difference of `a`'s and `b`'s mean TTFT, split by group (see the module docstring);
    `step_s`: the simulated decode step."""
    if a.first_tokens.keys() != b.first_tokens.keys():
        raise ValueError(f"{a.engine} and {b.engine} replayed different requests")
    n = len(a.first_tokens)
    shares = {g: Share() for g in GROUPS}
    for rid, x in a.first_tokens.items():
        y = b.first_tokens[rid]
        share = shares[GROUPS[0] if x.hit_tokens > y.hit_tokens else GROUPS[1] if x.hit_tokens < y.hit_tokens else GROUPS[2]]
        wait_x, wait_y = x.admitted_s - x.arrival_s, y.admitted_s - y.arrival_s
        share.requests += 1
        share.hit_tokens += x.hit_tokens - y.hit_tokens
        share.wait_s += (wait_x - wait_y) / n
        share.prefill_s += ((x.ttft_s - wait_x) - (y.ttft_s - wait_y)) / n
        share.admitted_later += x.admitted_s > y.admitted_s + 1e-9
        share.admitted_earlier += x.admitted_s < y.admitted_s - 1e-9
        share.steps_apart += abs(x.admitted_s - y.admitted_s) >= step_s / 2
    return shares


def print_table(a: RunResult, b: RunResult, shares: dict[str, Share]) -> None:
    print(f"A = {a.engine}, B = {b.engine} at {a.kv_gib:g} GiB: mean TTFT {a.ttft_mean_s:.6f} s against "
          f"{b.ttft_mean_s:.6f} s ({a.ttft_mean_s / b.ttft_mean_s:.4f}x), hit tokens {a.hit_tokens:,} against {b.hit_tokens:,}")
    print(
        "| requests | count | hit tokens, A - B | mean TTFT, A - B (ms) | of it: wait for the first step | first step "
        "to first token "
        "| admitted later / earlier | of them half a step or more apart |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    total = Share(*(sum(getattr(s, f) for s in shares.values()) for f in Share.__dataclass_fields__))
    for group, s in [*shares.items(), ("all", total)]:
        print(f"| {group} | {s.requests} | {s.hit_tokens:+,} | {1e3 * s.ttft_s:+.4f} | {1e3 * s.wait_s:+.4f} | "
              f"{1e3 * s.prefill_s:+.4f} | {s.admitted_later} / {s.admitted_earlier} | {s.steps_apart} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.replay_ttft", description=__doc__.split("\n\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--kv-gib", type=float, required=True, help="the KV cache budget in GiB, > 0")
    parser.add_argument("--engines", default="mimo,mimo-stock-attention",
                        help=f"A,B: two of {','.join(ENGINES)} (default: mimo,mimo-stock-attention)")
    parser.add_argument("--json", type=Path, help="write both runs and the split as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",")]
    if len(engines) != 2 or any(e not in ENGINES for e in engines) or engines[0] == engines[1]:
        parser.error(f"--engines must name two different engines of {', '.join(ENGINES)}, got {args.engines!r}")
    if not args.kv_gib > 0:
        parser.error(f"--kv-gib must be > 0, got {args.kv_gib}")
    source = load_source(parser, args)
    if source is None:
        return 2
    params = SimParams(max_model_len=source.max_model_len, closed_loop=not args.open_loop)
    ideal = ideal_hits(source.requests)
    print(f"replay_ttft: {source.name}, {len(source.requests)} requests, layout {args.layout}", file=sys.stderr)
    runs = []
    for engine in engines:
        try:
            runs.append(simulate(engine, args.layout, args.kv_gib, source.requests, ideal, params, progress=not args.quiet))
        except ValueError as e:
            print(f"error: {engine} at {args.kv_gib} GiB: {e}", file=sys.stderr)
            return 2
    shares = split(*runs, params.decode_s_per_step)
    print_table(*runs, shares)
    if args.json:
        args.json.write_text(json.dumps({
            "source": source.name, "layout": args.layout, "params": asdict(params), "engines": engines,
            "split": {g: asdict(s) for g, s in shares.items()},
            "runs": [r.as_dict() for r in runs],
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

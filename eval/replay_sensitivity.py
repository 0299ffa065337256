"""How much a replay point moves when nothing but the budget moves a little, and the plugin
against one variant of itself over those budgets.

    python -m eval.replay_sensitivity (--trace FILE | --workload NAME) --layout LAYOUT --kv-gib G [G ...]
        [--against mimo-lru|mimo-stock-attention|swa-free] [--spread 0.01] [--steps 2] [--seed S]
        [--scale X] [--max-requests N] [--open-loop] [--json OUT] [--quiet]

For each budget G, replays `eval.replay`'s way at the budgets G x (1 + spread x k / steps) for k
= -steps .. steps (default: G -1%, -0.5%, G, +0.5%, +1%), with two engines on the same requests
and blocks:
  * `mimo`: the plugin as it is;
  * `--against` (default `mimo-lru`): `mimo-lru`, the plugin with every live anchor worth 0, so
    they go least recently used first (the order before issue 18; everything else is the
    plugin's); or `mimo-stock-attention`, the plugin on vLLM's stock attention backends (as
    `eval.replay`'s engine of that name).
Per budget G and engine it prints the hit tokens and simulated TTFT (mean and p90) averaged over
the nearby budgets, and how far the single budgets spread around G's own value (min..max, as
ratios). Where a 1% change of memory moves one policy's TTFT by several percent, a difference
between two policies at one budget that is smaller says nothing about the policies; the means
over the nearby budgets do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from eval.replay import RunResult, SimParams, add_source_arguments, ideal_hits, load_source, simulate
from vllm_mimo.engine.kv_manager import HybridKVCacheManager
from vllm_mimo.kv_cache.anchor_policy import AnchorPlacement
from vllm_mimo.kv_cache.node import Anchor

AGAINST = ("mimo-lru", "mimo-stock-attention", "swa-free")


class LruPlacement(AnchorPlacement):
    """The plugin's anchor policy with every anchor worth 0: its live anchors go least recently
    used first, the order before issue 18."""

    def worth(self, anchor: Anchor) -> float:
        return 0.0


def lru_factory() -> Callable[..., HybridKVCacheManager]:
    """The plugin's manager with `LruPlacement`."""

    def make(*args, **kwargs) -> HybridKVCacheManager:
        return HybridKVCacheManager(*args, anchor_policy=LruPlacement, **kwargs)

    return make


def budgets(kv_gib: float, spread: float, steps: int) -> list[float]:
    return [round(kv_gib * (1 + spread * k / steps), 6) for k in range(-steps, steps + 1)]


def summarize(runs: list[RunResult], center: RunResult) -> dict:
    """Means over the nearby budgets, and the single budgets' spread around the center's value."""
    def spread(attr: str) -> list[float]:
        base = getattr(center, attr) or 1
        values = [getattr(r, attr) / base for r in runs]
        return [min(values), max(values)]

    return {
        "hit_tokens": statistics.mean(r.hit_tokens for r in runs),
        "ttft_mean_s": statistics.mean(r.ttft_mean_s for r in runs),
        "ttft_p90_s": statistics.mean(r.ttft_p90_s for r in runs),
        "hit_tokens_spread": spread("hit_tokens"),
        "ttft_mean_spread": spread("ttft_mean_s"),
        "ttft_p90_spread": spread("ttft_p90_s"),
    }


def print_table(points: list[dict], engines: tuple[str, str]) -> None:
    print(
        "| KV GiB | engine | hit tokens, mean | hits: single budgets ÷ G's | TTFT s, mean | TTFT: single ÷ G's | p90 s, mean | p90: single ÷ G's |"  # noqa: E501
    )
    print("|---:|---|---:|---|---:|---|---:|---|")
    for point in points:
        for engine in engines:
            s = point["engines"][engine]
            print(
                f"| {point['kv_gib']:g} | {engine} | {s['hit_tokens']:,.0f} | {s['hit_tokens_spread'][0]:.3f}..{s['hit_tokens_spread'][1]:.3f} "  # noqa: E501
                f"| {s['ttft_mean_s']:.4f} | {s['ttft_mean_spread'][0]:.3f}..{s['ttft_mean_spread'][1]:.3f} "
                f"| {s['ttft_p90_s']:.3f} | {s['ttft_p90_spread'][0]:.3f}..{s['ttft_p90_spread'][1]:.3f} |"
            )
        r = point["mimo_over_other"]
        print(f"| {point['kv_gib']:g} | mimo ÷ {engines[1]} | {r['hit_tokens']:.3f} | | {r['ttft_mean_s']:.3f} | | {r['ttft_p90_s']:.3f} | |")  # noqa: E501


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.replay_sensitivity", description=__doc__.split("\n\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--kv-gib", type=float, nargs="+", required=True, help="KV cache budgets in GiB, each > 0")
    parser.add_argument("--against", choices=AGAINST, default="mimo-lru",
                        help="the engine to compare with (default: mimo-lru; see above)")
    parser.add_argument("--spread", type=float, default=0.01,
                        help="the largest relative change of the budget, in (0, 0.5) (default: 0.01, i.e. 1%%)")
    parser.add_argument("--steps", type=int, default=2,
                        help="budgets on each side of G, >= 1 (default: 2: G -1%%, -0.5%%, G, +0.5%%, +1%%)")
    parser.add_argument("--json", type=Path, help="write every run and the summaries as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    if any(not g > 0 for g in args.kv_gib):
        parser.error(f"--kv-gib values must be > 0, got {args.kv_gib}")
    if not 0 < args.spread < 0.5:
        parser.error(f"--spread must be in (0, 0.5), got {args.spread}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    source = load_source(parser, args)
    if source is None:
        return 2
    requests = source.requests
    params = SimParams(max_model_len=source.max_model_len, closed_loop=not args.open_loop)
    ideal = ideal_hits(requests)
    print(f"replay_sensitivity: {source.name}, {len(requests)} requests, layout {args.layout}", file=sys.stderr)
    engines = ("mimo", args.against)
    # (the replay's engine, a manager factory) per engine compared
    setups = {"mimo": ("mimo", None), "mimo-lru": ("mimo", lru_factory()), "mimo-stock-attention": ("mimo-stock-attention", None), "swa-free": ("swa-free", None)}  # noqa: E501
    points, all_runs = [], []
    for kv_gib in args.kv_gib:
        nearby = budgets(kv_gib, args.spread, args.steps)
        by_engine: dict[str, list[RunResult]] = {}
        for engine in engines:
            for i, gib in enumerate(nearby):
                if not args.quiet:
                    print(f"  {engine} at {gib:g} GiB ({i + 1}/{len(nearby)} near {kv_gib:g})", file=sys.stderr)
                try:
                    run = simulate(setups[engine][0], args.layout, gib, requests, ideal, params, progress=False,
                                   mimo_factory=setups[engine][1])
                except ValueError as e:
                    print(f"error: {engine} at {gib} GiB: {e}", file=sys.stderr)
                    return 2
                run.engine = engine
                run.skipped_too_long = source.skipped_too_long
                by_engine.setdefault(engine, []).append(run)
                all_runs.append(run)
        summaries = {e: summarize(runs, runs[args.steps]) for e, runs in by_engine.items()}
        ours, other = summaries["mimo"], summaries[args.against]
        points.append({
            "kv_gib": kv_gib, "budgets": nearby, "engines": summaries, "against": args.against,
            "mimo_over_other": {k: ours[k] / (other[k] or 1) for k in ("hit_tokens", "ttft_mean_s", "ttft_p90_s")},
        })
    print_table(points, engines)
    if args.json:
        args.json.write_text(json.dumps({
            "source": source.name, "layout": args.layout, "spread": args.spread, "steps": args.steps,
            "skipped_too_long": source.skipped_too_long, "points": points,
            "runs": [r.as_dict() for r in all_runs],
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

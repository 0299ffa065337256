"""Where the plugin's KV blocks go in a replay, and why hits are lost (one engine, one budget).

    python -m eval.replay_diagnose (--trace FILE | --workload NAME) --layout LAYOUT --kv-gib G
        [--seed S] [--scale X] [--max-requests N] [--open-loop] [--chunk-anchor-tokens T]
        [--json OUT] [--plot PNG]

Replays like `eval.replay` with the plugin's manager only, observed through its events and
its public state:
  * mean blocks by use over the run (sampled every 10 simulated steps): running requests' Full
    and SWA blocks (the SWA blocks of the tokens scheduled in the latest step counted apart),
    SWA blocks kept only by anchors, unreferenced cached Full blocks, free blocks;
  * pseudo-hit tokens at first admission by cause: the Full path ends at a node a running
    request holds (its window has moved on), a deeper anchor keeps the Full path alive, or
    the Full path is unreferenced and past every anchor (kept until the memory is wanted);
  * pseudo-hit tokens by where the Full path ends (the fork point a window there would have
    made a hit): an earlier request's output end or prompt end, a grid point (every
    `grid_anchor_tokens`), a junction off the grid (an earlier prompt went on past it), or
    nowhere of these; and by what became of the anchor that would have served it, an anchor at
    that node: never placed, or evicted, after it started demoted, was demoted later, or while
    live (and by what kind it was);
  * anchor evictions by trigger: the anchor budget, or an allocation that needed more SWA
    blocks than one request's window (a prefill: stock attention backends read a prefill
    chunk's keys back from the cache, so each of its tokens needs SWA blocks) or not;
  * over time (`--plot`, and `series` in the JSON): the blocks anchors keep and the cached
    Full blocks at each sample, against the anchors' cap (all blocks when none is set) and
    half the blocks (the fixed budget the plugin had before issue 42), so it can be seen how
    the anchors' share follows the traffic.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from eval.replay import (
    SimParams,
    add_chunk_anchor_argument,
    add_source_arguments,
    check_chunk_anchor_argument,
    ideal_hits,
    load_source,
    simulate,
)
from vllm_mimo.engine.kv_manager import HybridKVCacheManager
from vllm_mimo.kv_cache.contract import CacheObserver, EvictionCause
from vllm_mimo.kv_cache.node import AnchorKind

SAMPLE_EVERY = 10


class Diagnosis(CacheObserver):
    """Where the manager's blocks are, and why hits are lost."""

    def __init__(self, manager: HybridKVCacheManager) -> None:
        self.cache = manager.cache
        self.block_use: Counter = Counter()
        self.samples = 0
        self.pseudo_causes: Counter = Counter()
        self.anchor_evictions: Counter = Counter()
        self.pseudo_ends: Counter = Counter()
        self.pseudo_anchors: Counter = Counter()
        self.pseudo_end_anchor: Counter = Counter()  # (where, what became of its anchor)
        self._grid = getattr(manager.cache.anchor_policy, "grid_blocks", 0)
        self._request_ends: dict[object, str] = {}  # node key -> "output end" / "prompt end"
        # Node key -> what became of the latest anchor there: "evicted (...)" once evicted.
        self._fate: dict[object, str] = {}
        self._born_demoted: set[int] = set()  # ids of live anchors that started demoted
        self._just_placed: int | None = None
        self.series: list[tuple[int, int, int]] = []  # (step, anchor SWA, cached Full) per sample
        self._steps = 0
        manager.cache.subscribe(self)

    def step(self) -> None:
        self._steps += 1
        if self._steps % SAMPLE_EVERY == 0:
            self._sample()

    def _sample(self) -> None:
        # Shared nodes and shared SWA block tuples are counted once: the uses partition the pool.
        cache = self.cache
        geometry = cache.geometry
        held_nodes: set[int] = set()
        window: set[int] = set()
        step: set[int] = set()
        private_full = 0
        for state in cache.requests.values():
            held_nodes.update(id(node) for node in state.nodes)
            private_full += max(0, len(state.full) - len(state.nodes))
            live = [ids for ids in state.swa if ids is not None]
            cut = len(live) - min(state.step_blocks, len(live))
            window.update(id(ids) for ids in live[:cut])
            step.update(id(ids) for ids in live[cut:])
        size = cache.size_info()
        use = self.block_use
        use["running Full"] += (len(held_nodes) + private_full) * geometry.full_ids_per_position
        use["running SWA (window)"] += len(window - step) * geometry.swa_ids_per_position
        use["running SWA (latest step's tokens)"] += len(step) * geometry.swa_ids_per_position
        use["anchor SWA"] += size.anchor_swa
        use["cached Full"] += size.cached_full
        use["free"] += size.free
        self.samples += 1
        self.series.append((self._steps, size.anchor_swa, size.cached_full))

    def admitted(self, request, hit_tokens: int, path) -> None:
        pseudo = len(path) * self.cache.block_size - hit_tokens
        if request.num_preemptions == 0 and pseudo:
            end = path[-1]
            if end.full_refs > 1:  # this request took one reference already
                cause = "Full path ends at a node a running request holds"
            elif self._anchor_below(end):
                cause = "a deeper anchor keeps the Full path"
            else:
                cause = "unreferenced Full past every anchor (not yet reclaimed)"
            self.pseudo_causes[cause] += pseudo
            where = self._where(end, len(path))
            fate = self._fate.get(end.block_hash, "never placed")
            if end.anchor is not None:
                fate = "anchor there (its window not whole)"
            self.pseudo_ends[where] += pseudo
            self.pseudo_anchors[fate] += pseudo
            self.pseudo_end_anchor[f"{where} / {fate}"] += pseudo
        self._just_placed = None

    def _where(self, end, positions: int) -> str:
        """Where a pseudo hit's Full path ends (see the module docstring)."""
        ended = self._request_ends.get(end.block_hash)
        if ended is not None:
            return ended
        if self._grid and positions % self._grid == 0:
            return "grid point"
        if end.children:
            return "junction off the grid (an earlier prompt went on)"
        return "nowhere of these"

    def cached(self, request, nodes) -> None:
        self._just_placed = None

    def anchor_placed(self, anchor, kind) -> None:
        key = anchor.node.block_hash
        if kind is AnchorKind.OUTPUT_END:
            self._request_ends[key] = "output end"
        elif kind is AnchorKind.PROMPT_END:
            self._request_ends.setdefault(key, "prompt end")
        if len(anchor.kinds) == 1:  # a new anchor
            self._fate.pop(key, None)
            self._just_placed = id(anchor)

    def anchor_demoted(self, anchor) -> None:
        if self._just_placed == id(anchor) and not anchor.served:
            self._born_demoted.add(id(anchor))
        else:
            self._born_demoted.discard(id(anchor))
        self._just_placed = None

    @staticmethod
    def _anchor_below(node) -> bool:
        stack = [node]
        while stack:
            node = stack.pop()
            if node.anchor is not None:
                return True
            stack.extend(node.children.values())
        return False

    def anchor_evicted(self, anchor, cause: EvictionCause) -> None:
        if cause.by_budget:
            trigger = "anchor budget"
        elif cause.swa_blocks > self.cache.geometry.swa_blocks_per_request:
            trigger = "allocation of more SWA blocks than a window (a prefill)"
        else:
            trigger = "allocation within a window (decode, short prefill)"
        self.anchor_evictions[trigger] += 1
        kinds = ",".join(sorted(kind.value for kind in anchor.kinds))
        if not anchor.demoted:
            how = "live"
        elif id(anchor) in self._born_demoted:
            how = "started demoted"
        else:
            how = "demoted later"
        self._born_demoted.discard(id(anchor))
        self._fate[anchor.node.block_hash] = f"evicted, {how} ({kinds})"
        self._just_placed = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.replay_diagnose", description=__doc__.split("\n\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--kv-gib", type=float, required=True, help="KV cache budget in GiB, > 0")
    add_chunk_anchor_argument(parser)
    parser.add_argument("--json", type=Path, help="write the diagnosis as JSON here")
    parser.add_argument("--plot", type=Path, metavar="PNG",
                        help="draw the anchors' and cached Full blocks over the run against the anchors' cap (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'vllm-mimo[eval]'")
    if not args.kv_gib > 0:
        parser.error(f"--kv-gib must be > 0, got {args.kv_gib}")
    check_chunk_anchor_argument(parser, args)
    source = load_source(parser, args)
    if source is None:
        return 2
    requests = source.requests

    diagnoses: list[Diagnosis] = []

    def observed(*a, **k) -> HybridKVCacheManager:
        manager = HybridKVCacheManager(*a, **k)
        diagnoses.append(Diagnosis(manager))
        return manager

    params = SimParams(max_model_len=source.max_model_len, closed_loop=not args.open_loop,
                       chunk_anchor_tokens=args.chunk_anchor_tokens)
    try:
        run = simulate("mimo", args.layout, args.kv_gib, requests, ideal_hits(requests), params,
                       mimo_factory=observed, on_step=lambda: diagnoses[0].step())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = diagnoses[0]
    use = {k: round(v / max(m.samples, 1)) for k, v in m.block_use.items()}
    out = {
        "source": source.name, "layout": args.layout, "skipped_too_long": source.skipped_too_long,
        "kv_gib": args.kv_gib, "chunk_anchor_tokens": args.chunk_anchor_tokens,
        "blocks": run.num_blocks, "hit_tokens": run.hit_tokens,
        "pseudo_hit_tokens": run.pseudo_hit_tokens, "mean_blocks_by_use": use,
        "pseudo_hit_tokens_by_cause": dict(m.pseudo_causes),
        "pseudo_hit_tokens_by_end": dict(m.pseudo_ends), "pseudo_hit_tokens_by_anchor_fate": dict(m.pseudo_anchors),
        "pseudo_hit_tokens_by_end_and_fate": dict(m.pseudo_end_anchor),
        "anchor_evictions_by_trigger": dict(m.anchor_evictions),
        "anchor_cap_blocks": m.cache.anchor_budget_blocks,
        "series": {"sample_every_steps": SAMPLE_EVERY, "step": [t for t, _, _ in m.series],
                   "anchor_swa": [a for _, a, _ in m.series], "cached_full": [f for _, _, f in m.series]},
    }
    print(f"{out['source']} on {args.layout} at {args.kv_gib} GiB ({run.num_blocks} blocks): "
          f"{run.hit_tokens} hit tokens, {run.pseudo_hit_tokens} pseudo-hit tokens")
    for title, table in (("mean blocks by use", use), ("pseudo-hit tokens by cause", m.pseudo_causes),
                         ("pseudo-hit tokens by where the Full path ends", m.pseudo_ends),
                         ("pseudo-hit tokens by what became of an anchor there", m.pseudo_anchors),
                         ("pseudo-hit tokens by both", m.pseudo_end_anchor),
                         ("anchor evictions by trigger", m.anchor_evictions)):
        print(f"  {title}:")
        for name, value in sorted(table.items(), key=lambda kv: -kv[1]):
            print(f"    {value:>10}  {name}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    if args.plot is not None:
        plot(out, args.plot)
    return 0


def plot(out: dict, path: Path) -> None:
    """The anchors' SWA blocks and the cached Full blocks over the run, with the anchors' cap
    and the old fixed budget (half the blocks) as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = out["series"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(series["step"], series["anchor_swa"], label="anchor SWA blocks")
    ax.plot(series["step"], series["cached_full"], label="cached Full blocks", alpha=0.7)
    ax.axhline(out["anchor_cap_blocks"], color="k", linestyle="--", label="anchors' cap")
    ax.axhline(out["blocks"] // 2, color="r", linestyle=":", label="the old fixed budget (0.5)")
    ax.set_xlabel("scheduler step")
    ax.set_ylabel("KV blocks")
    ax.set_title(f"{Path(out['source']).name}, {out['layout']}, {out['kv_gib']:g} GiB: {out['hit_tokens']:,} hit tokens")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())

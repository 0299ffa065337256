"""Where the plugin's KV blocks go in a replay, and why hits are lost (one engine, one budget).

    python -m eval.replay_diagnose (--trace FILE | --workload NAME) --layout LAYOUT --kv-gib G
        [--seed S] [--scale X] [--max-requests N] [--open-loop] [--json OUT]

Replays like `eval.replay` with the plugin's manager only, observed from a subclass:
  * mean blocks by use over the run (sampled every 50 manager calls): running requests' Full
    and SWA blocks (the SWA blocks of the tokens scheduled in the latest step counted apart),
    SWA blocks kept only by anchors, unreferenced cached Full blocks, free blocks;
  * pseudo-hit tokens at first admission by cause: the Full path ends at a node a running
    request holds (its window has moved on), a deeper anchor keeps the Full path alive, or
    the Full path is unreferenced and past every anchor (kept until the memory is wanted);
  * anchor evictions by trigger: the anchor budget, or an allocation that needed more SWA
    blocks than one request's window (a prefill: stock attention backends read a prefill
    chunk's keys back from the cache, so each of its tokens needs SWA blocks) or not.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from eval.replay import SimParams, add_source_arguments, ideal_hits, load_source, simulate
from vllm_mimo.block_manager.manager import HybridKVCacheManager

SAMPLE_EVERY = 50


class ObservedManager(HybridKVCacheManager):
    """The plugin's manager, counting where its blocks are and why hits are lost."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.block_use: Counter = Counter()
        self.samples = 0
        self.pseudo_causes: Counter = Counter()
        self.anchor_evictions: Counter = Counter()
        self._calls = 0
        self._swa_asked: int | None = None  # SWA blocks of the allocation in progress

    def allocate_slots(self, request, *args, **kwargs):
        out = super().allocate_slots(request, *args, **kwargs)
        self._calls += 1
        if self._calls % SAMPLE_EVERY == 0:
            self._sample()
        return out

    def _sample(self) -> None:
        # Shared nodes and shared SWA block tuples are counted once: the uses partition the pool.
        held_nodes: set[int] = set()
        window: set[int] = set()
        step: set[int] = set()
        private_full = 0
        for state in self._requests.values():
            held_nodes.update(id(node) for node in state.nodes)
            private_full += max(0, len(state.full) - len(state.nodes))
            live = [ids for ids in state.swa if ids is not None]
            cut = len(live) - min(state.step_blocks, len(live))
            window.update(id(ids) for ids in live[:cut])
            step.update(id(ids) for ids in live[cut:])
        use = self.block_use
        use["running Full"] += (len(held_nodes) + private_full) * self._n_full
        use["running SWA (window)"] += len(window - step) * self._n_swa
        use["running SWA (latest step's tokens)"] += len(step) * self._n_swa
        use["anchor SWA"] += self._swa_retained
        use["cached Full"] += self._full_cached_unref
        use["free"] += self.pools.num_free_total()
        self.samples += 1

    def _on_admit(self, request, state, hit_tokens: int) -> None:
        pseudo = len(state.nodes) * self.block_size - hit_tokens
        if request.num_preemptions == 0 and pseudo:
            end = state.nodes[-1]
            if end.full_refs > 1:  # this request took one reference already
                cause = "Full path ends at a node a running request holds"
            elif self._anchor_below(end):
                cause = "a deeper anchor keeps the Full path"
            else:
                cause = "unreferenced Full past every anchor (not yet reclaimed)"
            self.pseudo_causes[cause] += pseudo
        super()._on_admit(request, state, hit_tokens)

    @staticmethod
    def _anchor_below(node) -> bool:
        stack = [node]
        while stack:
            node = stack.pop()
            if node.anchor is not None:
                return True
            stack.extend(node.children.values())
        return False

    def _take(self, need_full: int, need_swa: int, evict_held: bool):
        self._swa_asked = need_swa
        try:
            return super()._take(need_full, need_swa, evict_held)
        finally:
            self._swa_asked = None

    def _evict_anchor(self, anchor) -> None:
        if self._swa_asked is None:
            trigger = "anchor budget"
        elif self._swa_asked > self.geometry.swa_blocks_per_request:
            trigger = "allocation of more SWA blocks than a window (a prefill)"
        else:
            trigger = "allocation within a window (decode, short prefill)"
        self.anchor_evictions[trigger] += 1
        super()._evict_anchor(anchor)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.replay_diagnose", description=__doc__.split("\n\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--kv-gib", type=float, required=True, help="KV cache budget in GiB, > 0")
    parser.add_argument("--json", type=Path, help="write the diagnosis as JSON here")
    args = parser.parse_args(argv)
    if not args.kv_gib > 0:
        parser.error(f"--kv-gib must be > 0, got {args.kv_gib}")
    requests = load_source(parser, args)
    if requests is None:
        return 2

    managers: list[ObservedManager] = []

    class Recorded(ObservedManager):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            managers.append(self)

    params = SimParams(closed_loop=not args.open_loop)
    try:
        run = simulate("mimo", args.layout, args.kv_gib, requests, ideal_hits(requests), params, mimo_cls=Recorded)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = managers[0]
    use = {k: round(v / max(m.samples, 1)) for k, v in m.block_use.items()}
    out = {
        "source": str(args.trace) if args.trace else args.workload, "layout": args.layout,
        "kv_gib": args.kv_gib, "blocks": run.num_blocks, "hit_tokens": run.hit_tokens,
        "pseudo_hit_tokens": run.pseudo_hit_tokens, "mean_blocks_by_use": use,
        "pseudo_hit_tokens_by_cause": dict(m.pseudo_causes), "anchor_evictions_by_trigger": dict(m.anchor_evictions),
    }
    print(f"{out['source']} on {args.layout} at {args.kv_gib} GiB ({run.num_blocks} blocks): "
          f"{run.hit_tokens} hit tokens, {run.pseudo_hit_tokens} pseudo-hit tokens")
    for title, table in (("mean blocks by use", use), ("pseudo-hit tokens by cause", m.pseudo_causes),
                         ("anchor evictions by trigger", m.anchor_evictions)):
        print(f"  {title}:")
        for name, value in sorted(table.items(), key=lambda kv: -kv[1]):
            print(f"    {value:>10}  {name}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

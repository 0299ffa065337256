"""How close any anchor policy could come to `swa-free`: the plugin's manager with clairvoyant anchors.

    python -m eval.replay_bound (--trace FILE | --workload NAME) --layout LAYOUT --kv-gib G [G ...]
        [--seed S] [--scale X] [--max-requests N] [--open-loop] [--engines E,...]
        [--oracle-kinds K,...] [--json OUT] [--quiet]

Replays like `eval.replay`, and per budget runs four engines on the same requests and blocks:
`swa-free`, the plugin (`mimo`), and two variants of the plugin's manager that read the whole
workload in advance:
  * `clairvoyant-placement`: an anchor is placed only at a node where some request's ideal hit
    ends (the longest prefix an earlier request computed, as `eval.replay` counts the ideal),
    of the kind the plugin would place there; the plugin's eviction order;
  * `clairvoyant`: the same anchors, and the anchor evicted is the one whose next such request
    comes last in arrival order (Belady's rule over anchors; a preempted request's resume
    anchor goes last, since that request comes back first in line).
Everything else (the pools, Full eviction, the SWA mask, the step cut) is the plugin's. They are
measuring tools, not policies. With `--oracle-kinds` the clairvoyant engines place the
speculative kinds (grid points, prompt tails and ends, output ends) not named by the plugin's own
rule, and the rest (those named, hot prefixes, branch points) only where a later hit ends: which
kinds' choices the plugin's gap to the bound comes from. Where even they stay well below
`swa-free`, what is missing is the memory SWA KV itself takes (anchor windows, running windows, a prefill's own blocks), not
a better choice of which anchors to keep.

A second table splits each plugin engine's hit tokens by the kind of anchor each hit ends at
(`HitsByKind`), so where the clairvoyant engines gain on the plugin shows which anchors the
plugin lets go too early.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from eval.replay import RunResult, SimParams, add_source_arguments, ideal_hits, load_source, simulate
from eval.workloads import ReplayRequest, tokens
from vllm_mimo.engine.kv_manager import HybridKVCacheManager
from vllm_mimo.kv_cache.anchor_policy import AnchorPlacement
from vllm_mimo.kv_cache.anchors import SPECULATIVE_KINDS, AnchorDecision, AnchorSet
from vllm_mimo.kv_cache.contract import CacheObserver
from vllm_mimo.kv_cache.node import Anchor, AnchorKind, Node

ENGINES = ("swa-free", "mimo", "clairvoyant-placement", "clairvoyant")

# Anchors a request asks for itself: placed whatever the future holds.
_ALWAYS_PLACED = frozenset(
    {AnchorKind.RESUME, AnchorKind.DECLARED, AnchorKind.SYSTEM_PROMPT, AnchorKind.CACHE_CONTROL, AnchorKind.PINNED_PROMPT}
)


class Clairvoyance(CacheObserver):
    """What the whole workload says about anchors, for one replay of the plugin's manager: where
    some request's ideal hit ends (its junctions), and which request comes to each next. It
    observes admissions, so the next use of a junction is the next request not admitted yet."""

    def __init__(self, requests: list[ReplayRequest], ideal: list[int]) -> None:
        self.requests = requests
        self.ideal = ideal
        self.manager: HybridKVCacheManager | None = None
        # Built when first needed: block hashes need the hash seed the replay sets up.
        self._uses: dict[object, list[int]] | None = None
        self._next: dict[object, int] = {}  # per junction: index into its uses not yet admitted
        self._admitted: set[int] = set()

    def junction_uses(self) -> dict[object, list[int]]:
        """Per node key: the requests whose ideal hit ends at that position, in arrival order."""
        if self._uses is not None:
            return self._uses
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256

        from vllm_mimo.compat import Request, get_request_block_hasher

        cache = self.manager.cache
        hasher = get_request_block_hasher(cache.block_size // cache.hash_stride, sha256)
        uses: dict[object, list[int]] = {}
        for i, (request, hit) in enumerate(zip(self.requests, self.ideal, strict=False)):
            if hit >= cache.block_size:
                probe = Request(str(i), tokens(request.prompt), SamplingParams(max_tokens=1), None,
                                arrival_time=0.0, block_hasher=hasher)
                end = hit // cache.block_size
                uses.setdefault(cache.position_hashes(probe, end)[end - 1], []).append(i)
        self._uses = uses
        return uses

    def admitted(self, request, hit_tokens: int, path) -> None:
        if request.num_preemptions == 0:
            self._admitted.add(int(request.request_id))

    def worth_placing(self, node: Node, kind: AnchorKind) -> bool:
        """An anchor goes only where a later request's hit ends (or where a request asks)."""
        return kind in _ALWAYS_PLACED or node.block_hash in self.junction_uses()

    def next_use(self, anchor: Anchor) -> float:
        """Arrival index of the next request not admitted yet whose hit ends at the anchor; a
        preempted request's resume anchor first (it comes back first in line)."""
        if AnchorKind.RESUME in anchor.kinds and not anchor.served:
            return -1.0
        key = anchor.node.block_hash
        uses = self.junction_uses().get(key, ())
        k = self._next.get(key, 0)
        while k < len(uses) and uses[k] in self._admitted:
            k += 1
        self._next[key] = k
        return uses[k] if k < len(uses) else math.inf

    def farthest(self, tier: list[Anchor]) -> Anchor:
        """Belady's rule over anchors: the one used again last."""
        return max(tier, key=self.next_use)


class ClairvoyantPlacement(AnchorPlacement):
    """The plugin's anchor policy placing anchors only where `sight` says a later request's
    hit ends (`Clairvoyance.worth_placing`), and with `belady`, evicting within each tier of
    the eviction order (`AnchorSet.tiers`) the anchor used again last."""

    def __init__(
        self, *args, sight: Clairvoyance, belady: bool, oracle_kinds: frozenset[AnchorKind] = SPECULATIVE_KINDS, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.sight = sight
        self.belady = belady
        self.oracle_kinds = oracle_kinds

    def keep(self, decisions: list[AnchorDecision]) -> Sequence[AnchorDecision]:
        """Decisions to place a speculative kind outside `oracle_kinds` are kept as the plugin
        made them."""
        return [
            d
            for d in decisions
            if d.demote
            or (d.kind in SPECULATIVE_KINDS and d.kind not in self.oracle_kinds)
            or self.sight.worth_placing(d.node, d.kind)
        ]

    def victim(self, anchors: AnchorSet, include_held: bool = False) -> Anchor | None:
        if not self.belady:
            return super().victim(anchors, include_held)
        for tier in anchors.tiers(include_held):
            if tier:
                return self.sight.farthest(tier)
        return None


HIT_KINDS = (AnchorKind.OUTPUT_END, AnchorKind.PROMPT_TAIL, AnchorKind.PROMPT_END, AnchorKind.HOT,
             AnchorKind.BRANCH, AnchorKind.GRID, AnchorKind.RESUME, AnchorKind.DECLARED)
"""`HitsByKind`'s columns: an anchor of several kinds counts as the first of them here."""


class HitsByKind(CacheObserver):
    """Hit tokens of requests' first admissions (as the replay counts them), by the kind of the
    anchor each hit ends at (`HIT_KINDS`); "window" for a hit that ends at no anchor (inside a
    running request's window)."""

    def __init__(self) -> None:
        self.tokens: Counter[str] = Counter()
        self.block_size = 0  # set when the manager is built

    def admitted(self, request, hit_tokens: int, path) -> None:
        if request.num_preemptions or not hit_tokens:
            return
        anchor = path[hit_tokens // self.block_size - 1].anchor
        kind = "window" if anchor is None else next(k.value for k in HIT_KINDS if k in anchor.kinds)
        self.tokens[kind] += hit_tokens


def plugin_factory(requests: list[ReplayRequest], ideal: list[int], hits: HitsByKind, engine: str,
                   oracle_kinds: frozenset[AnchorKind] = SPECULATIVE_KINDS) -> Callable[..., HybridKVCacheManager]:
    """Builds the manager of one of the plugin's `ENGINES` (see the module docstring), observed
    by `hits`; a clairvoyant one reads the future for `oracle_kinds` of the speculative kinds."""

    def make(*args, **kwargs) -> HybridKVCacheManager:
        if engine == "mimo":
            manager = HybridKVCacheManager(*args, observers=[hits], **kwargs)
        else:
            sight = Clairvoyance(requests, ideal)
            policy = partial(ClairvoyantPlacement, sight=sight, belady=engine == "clairvoyant", oracle_kinds=oracle_kinds)
            manager = HybridKVCacheManager(*args, observers=[sight, hits], anchor_policy=policy, **kwargs)
            sight.manager = manager
        hits.block_size = manager.cache.block_size
        return manager

    return make


def print_table(runs: list[RunResult], engines: Sequence[str] = ENGINES) -> None:
    """Hit tokens per budget and engine, and (with `swa-free` among `engines`) each plugin
    engine's over `swa-free`'s."""
    by_budget: dict[float, dict[str, RunResult]] = {}
    for run in runs:
        by_budget.setdefault(run.kv_gib, {})[run.engine] = run
    over = [e for e in engines if e != "swa-free"] if "swa-free" in engines else []
    print("| KV GiB | ideal | " + " | ".join(engines) + "".join(f" | {e} ÷ swa-free" for e in over) + " |")
    print("|" + "---:|" * (2 + len(engines) + len(over)))
    for kv_gib, row in by_budget.items():
        cells = [f"{kv_gib:g}", f"{row[engines[0]].ideal_hit_tokens:,}"]
        cells += [f"{row[e].hit_tokens:,}" for e in engines]
        cells += [f"{row[e].hit_tokens / (row['swa-free'].hit_tokens or 1):.2f}" for e in over]
        print("| " + " | ".join(cells) + " |")


def print_kinds_table(runs: list[RunResult], kinds: dict[tuple[str, float], Counter[str]]) -> None:
    """Hit tokens by the kind of anchor each hit ends at, per plugin engine and budget."""
    columns = [k.value for k in HIT_KINDS] + ["window"]
    columns = [c for c in columns if any(counts[c] for counts in kinds.values())]
    print("\nHit tokens by the anchor kind each hit ends at:\n")
    print("| KV GiB | engine | " + " | ".join(columns) + " |")
    print("|---:|---|" + "---:|" * len(columns))
    for run in runs:
        counts = kinds.get((run.engine, run.kv_gib))
        if counts is not None:
            print(f"| {run.kv_gib:g} | {run.engine} | " + " | ".join(f"{counts[c]:,}" for c in columns) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.replay_bound", description=__doc__.split("\n\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--kv-gib", type=float, nargs="+", required=True, help="KV cache budgets in GiB, each > 0")
    parser.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help=f"comma-separated engines to run, of {', '.join(ENGINES)} (default: all, in that order)",
    )
    kinds = sorted(k.value for k in SPECULATIVE_KINDS)
    parser.add_argument(
        "--oracle-kinds",
        default=",".join(kinds),
        help=f"comma-separated speculative anchor kinds the clairvoyant engines place from the future, of "
        f"{', '.join(kinds)}; those not named they place by the plugin's own rule (hot prefixes and branch "
        "points always from the future) (default: all of them)",
    )
    parser.add_argument("--json", type=Path, help="write the runs as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    if any(not g > 0 for g in args.kv_gib):
        parser.error(f"--kv-gib values must be > 0, got {args.kv_gib}")
    engines = [e for e in args.engines.split(",") if e]
    if not engines or set(engines) - set(ENGINES) or len(set(engines)) < len(engines):
        parser.error(f"--engines must name each of {', '.join(ENGINES)} at most once, got {args.engines!r}")
    oracle = [k for k in args.oracle_kinds.split(",") if k]
    if not oracle or set(oracle) - set(kinds):
        parser.error(f"--oracle-kinds must name one or more of {', '.join(kinds)}, got {args.oracle_kinds!r}")
    oracle_kinds = frozenset(AnchorKind(k) for k in oracle)
    source = load_source(parser, args)
    if source is None:
        return 2
    requests, source_name = source.requests, source.name
    params = SimParams(max_model_len=source.max_model_len, closed_loop=not args.open_loop)
    ideal = ideal_hits(requests)
    print(f"replay_bound: {source_name}, {len(requests)} requests, layout {args.layout}", file=sys.stderr)
    runs = []
    kinds: dict[tuple[str, float], Counter[str]] = {}
    for kv_gib in args.kv_gib:
        for name in engines:
            engine = "swa-free" if name == "swa-free" else "mimo"
            factory = None
            if engine == "mimo":
                hits = HitsByKind()
                kinds[name, kv_gib] = hits.tokens
                factory = plugin_factory(requests, ideal, hits, name, oracle_kinds)
            try:
                run = simulate(engine, args.layout, kv_gib, requests, ideal, params,
                               progress=not args.quiet, mimo_factory=factory)
            except ValueError as e:
                print(f"error: {name} at {kv_gib} GiB: {e}", file=sys.stderr)
                return 2
            run.engine = name
            run.skipped_too_long = source.skipped_too_long
            if engine == "mimo":
                assert sum(kinds[name, kv_gib].values()) == run.hit_tokens, "hits by kind do not add up"
            runs.append(run)
    print_table(runs, engines)
    print_kinds_table(runs, kinds)
    if args.json:
        rows = []
        for run in runs:
            row = run.as_dict()
            if (run.engine, run.kv_gib) in kinds:
                row["hits_by_anchor_kind"] = dict(kinds[run.engine, run.kv_gib])
            rows.append(row)
        args.json.write_text(json.dumps({
            "source": source_name, "layout": args.layout, "skipped_too_long": source.skipped_too_long,
            "oracle_kinds": sorted(oracle), "runs": rows,
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""HybridKVCache: the `base.KVCache` contract over two pools, the prefix tree and SWA anchors.

Per running request it keeps, for every position, the Full block ids and, inside the SWA mask,
the SWA block ids: the last W tokens, plus the positions of the tokens scheduled in the
current step. With stock attention backends (`window_local` false) that is every position of
a prefill chunk, since they read a chunk's own keys back from the cache. With window-local
SWA attention (`vllm_mimo.attention_backends`) a chunk's keys are read in flight, so only the
positions read after the step get SWA blocks: from the window at the chunk's end on (its
tail, what `_release_out_of_window` keeps) and the windows of anchors the policy may place
inside the chunk (`anchor_window_positions`); the other positions get none
(vLLM sees the null block, whose writes the backend drops). Everything older is released:
kept in the tree while an anchor covers it, freed otherwise. A
request holds a reference on every tree node of its prefix, so an unreferenced node never has
a referenced descendant and Full eviction can always go leaf first.

Where a new block comes from: the pool's own free list, else the other pool's (see `pools.py`),
else eviction (`evict`). Anchors may also have a cap a user sets (`anchor_budget_fraction`); over
it, anchors are evicted. With a host tier (`host_tier.py`, whose rules are all written
there), an evicted anchor is demoted to host memory instead of dropped (`HostTier.demote`), and
a request's hit extends into what the host holds (`host_extend`): its
positions past the device's hit get Full blocks like new tokens, SWA blocks only for the window
before the load's end, and are loaded from host (`take_load`), the way vLLM treats a KV
connector's external computed tokens. Loaded positions are not computed, so the SWA KV of the
others is on neither tier: an anchor is placed only where its whole window's SWA KV is on the
device (`_window_on_device`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vllm_mimo.config import MimoConfig, MimoConfigError
from vllm_mimo.kv_cache.anchor_policy import AnchorPlacement
from vllm_mimo.kv_cache.anchors import Anchor, AnchorDecision, AnchorKind, AnchorSet
from vllm_mimo.kv_cache.contract import (
    ANCHOR_BUDGET,
    AnchorPolicy,
    CacheObserver,
    EvictionCause,
    KVCache,
    NewBlocks,
    Observers,
    RequestBlocks,
    SizeInfo,
)
from vllm_mimo.kv_cache.geometry import KVGeometry, cdiv
from vllm_mimo.kv_cache.pools import BlockPools, Pool
from vllm_mimo.kv_cache.prefix_tree import DEVICE, Blocks, Node, PrefixTree, TreeMatch, position_hashes
from vllm_mimo.kv_cache.tiers.host import Copy, HostMatch, HostTier, LoadPlan
from vllm_mimo.kv_cache.tiers.l3 import L3Copy

_NO_MATCH = TreeMatch([], 0)


@dataclass(slots=True)
class _Plan:
    """One allocation's plan (`HybridKVCache.allocate`), in positions, and the blocks it took."""

    match: TreeMatch
    """The prefix an admission adopts (`_NO_MATCH` for a running request)."""
    keys: Sequence[Any]
    """An admission's node keys (`position_hashes`)."""
    hit: int
    """The window-safe hit an admission adopts."""
    have_full: int
    """Positions with Full blocks before the new ones: held, or adopted (hit and takeover)."""
    have_swa: int
    """Positions with SWA entries before the new ones."""
    adopted_full: int = 0
    adopted_swa: int = 0
    """Nodes an admission takes out of the evictable sets (`TreeMatch.unreferenced`)."""
    extension: HostMatch | None = None
    """The host tier's extension of an admission's hit, loaded (`external_tokens`)."""
    loaded: range = range(0)
    """Positions a host extension loads SWA KV into."""
    end: int = 0
    tail: int = 0
    """New SWA blocks go to `loaded`, `windows` and `tail`..`end`."""
    windows: Collection[int] = frozenset()
    kept: int = 0
    """New SWA positions: the step's `RequestBlocks.step_blocks`."""
    need_full: int = 0
    need_swa: int = 0
    full: list[Blocks] | None = None
    swa: list[Blocks | None] | None = None
    """The positions the allocation added (`NewBlocks`)."""


def auto_swa_pool_blocks(geometry: KVGeometry, max_running: int, anchor_budget_blocks: int) -> int:
    """SWA pool size: every running request's window, plus the anchor budget, at most half the
    blocks (free blocks move between the pools as either runs out)."""
    running = max_running * geometry.swa_blocks_per_request
    return max(geometry.swa_blocks_per_request, min(running + anchor_budget_blocks, (geometry.num_blocks - 1) // 2))


class HybridKVCache(KVCache):
    """Two pools, the dual-index prefix tree and SWA anchors (see the module docstring).

    `window_local`: the SWA groups' attention runs window-locally (see the module docstring).
    `host_pages`: host memory for the host tier, in pages of a device block's bytes (0: no
    tier). `anchor_policy` and `host_tier` build the anchor policy and the host tier, called
    with `AnchorPlacement`'s and `HostTier`'s arguments: those classes (the plugin's), or a
    subclass of theirs (eval's variants: `eval.replay_bound`, `eval.replay_sensitivity`,
    `eval.host_dense`)."""

    def __init__(
        self,
        geometry: KVGeometry,
        max_model_len: int,
        hash_block_size: int,
        config: MimoConfig,
        *,
        enable_caching: bool = True,
        use_eagle: bool = False,
        max_num_running: int = 256,
        observers: Iterable[CacheObserver] = (),
        window_local: bool = False,
        host_pages: int = 0,
        anchor_policy: Callable[..., AnchorPolicy] = AnchorPlacement,
        host_tier: Callable[..., HostTier] = HostTier,
    ) -> None:
        self.geometry = geometry
        self.window_local = window_local
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        # EAGLE/MTP drafting needs the target's hidden states of the last hit position, so a
        # hit stops one position short (as upstream's drop_eagle_block does).
        self.use_eagle = use_eagle
        self.block_size = geometry.block_size
        self.window_blocks = geometry.window_blocks
        # With EAGLE/MTP a hit ends one position before an anchor, so an anchor keeps one more
        # position of SWA KV, and so does a running request behind its latest boundary.
        self.anchor_window_blocks = self.window_blocks + (1 if use_eagle else 0)
        self.hash_stride = geometry.block_size // hash_block_size
        self._n_full = geometry.full_ids_per_position
        self._n_swa = geometry.swa_ids_per_position
        all_blocks = geometry.num_blocks - 1
        self.anchor_budget_blocks = (
            all_blocks if config.anchor_budget_fraction is None else int(config.anchor_budget_fraction * all_blocks)
        )
        self.pools = BlockPools(geometry.num_blocks, self._swa_pool_blocks(config, max_num_running))
        self._observers = Observers()
        self.tree = PrefixTree(self._observers)
        self.host = (
            host_tier(
                self.tree, host_pages, self._n_full, self._n_swa, self.window_blocks, self.block_size,
                back_off=1 if use_eagle else 0,
            )
            if host_pages
            else None
        )
        self.placement: AnchorPolicy = self._anchor_policy(config, anchor_policy)
        self.anchors = AnchorSet(
            self.anchor_window_blocks if self.window_blocks else 0,
            self.placement.starts_demoted,
            self._anchor_placed,
            self._anchor_demoted,
            worth=self.placement.worth,
        )
        self.subscribe(self.placement)
        for observer in observers:
            self.subscribe(observer)
        self._requests: dict[str, RequestBlocks] = {}
        self._tick = 0

    def _anchor_policy(self, config: MimoConfig, anchor_policy: Callable[..., AnchorPolicy]) -> AnchorPolicy:
        """The anchor policy, built with `AnchorPlacement`'s arguments."""
        # Evicted anchors are remembered as many as half the blocks (or a smaller cap) hold:
        # what twice that would keep (the size of ARC's ghost lists).
        anchor_blocks = max(1, self._n_swa * self.anchor_window_blocks)
        return anchor_policy(
            self.block_size,
            config.grid_anchor_tokens,
            config.hot_prefix_min_hits,
            ghost_capacity=min(self.anchor_budget_blocks, (self.geometry.num_blocks - 1) // 2) // anchor_blocks,
            window_cost=anchor_blocks,
            full_blocks_per_position=self._n_full,
        )

    def _swa_pool_blocks(self, config: MimoConfig, max_num_running: int) -> int:
        """The SWA pool's size: `swa_pool_fraction`, or `auto_swa_pool_blocks`."""
        geometry = self.geometry
        if config.swa_pool_fraction is None:
            swa_blocks = auto_swa_pool_blocks(geometry, max_num_running, self.anchor_budget_blocks)
        else:
            swa_blocks = round(config.swa_pool_fraction * (geometry.num_blocks - 1))
        if swa_blocks < geometry.swa_blocks_per_request:
            raise MimoConfigError(
                f"swa_pool_fraction={config.swa_pool_fraction} gives the SWA pool {swa_blocks} of "
                f"{geometry.num_blocks - 1} blocks, fewer than one request's window needs "
                f"({geometry.swa_blocks_per_request} = {self._n_swa} SWA blocks per position x "
                f"{geometry.window_blocks + 1} positions); raise it or leave it null (auto)"
            )
        return swa_blocks

    def subscribe(self, observer: CacheObserver) -> None:
        self._observers.register(observer)

    def _anchor_placed(self, anchor: Anchor, kind: AnchorKind) -> None:
        for placed in self._observers.anchor_placed:
            placed(anchor, kind)

    def _anchor_demoted(self, anchor: Anchor) -> None:
        for demoted in self._observers.anchor_demoted:
            demoted(anchor)

    @property
    def requests(self) -> Mapping[str, RequestBlocks]:
        return self._requests

    # ----------------------------------------------------------------- lookups

    def position_hashes(self, request: Any, positions: int) -> Sequence[Any]:
        """The node keys of the request's first `positions` positions (or fewer, as far as
        hashed)."""
        return position_hashes(request.block_hashes, self.hash_stride, positions)

    def match(self, request: Any, max_tokens: int) -> TreeMatch:
        if not self.enable_caching:
            return _NO_MATCH
        positions = max_tokens // self.block_size
        keys = self.position_hashes(request, positions)
        match = self.tree.match(keys, positions, self.window_blocks)
        if self.use_eagle and match.safe_blocks:
            match = self.tree.match(keys, match.safe_blocks - 1, self.window_blocks)
        return match

    def host_extend(self, request: Any, match: TreeMatch, max_tokens: int) -> HostMatch | None:
        """The host tier's extension of the device's window-safe hit (`match`, up to
        `max_tokens`): its positions past the hit are what `allocate` takes as `external_tokens`,
        and the extension itself is handed to that `allocate` (the lookup is not made twice).
        None without a host tier. Never mutates."""
        if self.host is None or not self.enable_caching:
            return None
        positions = max_tokens // self.block_size
        return self.host.extend(self.position_hashes(request, positions), match, match.safe_blocks, positions)

    def take_load(self, request_id: str) -> LoadPlan | None:
        """The copies from host that the latest admission of this request needs (its host
        extension), held until `finish_load` (`HostTier.take_load`)."""
        return self.host.take_load(request_id) if self.host is not None else None

    def finish_load(self, plan: LoadPlan, failed: bool = False) -> None:
        """A load plan's copies are done, or `failed` (the request recomputes; `HostTier.finish_load`)."""
        assert self.host is not None
        self.host.finish_load(plan, failed)

    def remaining_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks a request needs beyond those it holds to reach `num_tokens` tokens: Full for
        every position, SWA for its window."""
        state = self._requests.get(request_id)
        positions = cdiv(min(num_tokens, self.max_model_len), self.block_size)
        have_full = len(state.full) if state is not None else 0
        have_swa = sum(1 for ids in state.swa[state.swa_start :] if ids is not None) if state is not None else 0
        swa = min(positions, self.window_blocks + 1)
        return max(0, positions - have_full) * self._n_full + max(0, swa - have_swa) * self._n_swa

    def take_stores(self) -> list[tuple[str, Copy]]:
        """The copies to host that demotions since the last call need (`HostTier.take_stores`);
        called once per step, when its scheduling is done."""
        return self.host.take_stores() if self.host is not None else []

    def take_puts(self) -> list[L3Copy]:
        """The copies to L3 that host evictions since the last call need (`HostTier.take_puts`);
        taken with `take_stores`."""
        return self.host.take_puts() if self.host is not None else []

    # -------------------------------------------------------------- allocation
    #
    # `allocate` in steps: plan (`_plan_admission` or a running request's holdings, then
    # `_plan_blocks`), admit only if it fits (`_fits`), then commit (`_commit`: adopt the hit,
    # take blocks, plan a host load, tell the policy), and end (`_allocated`).

    def allocate(
        self,
        request: Any,
        num_new_tokens: int,
        *,
        hit_tokens: int = 0,
        match: TreeMatch | None = None,
        num_lookahead_tokens: int = 0,
        headroom: int = 0,
        whole_request: bool = False,
        cache: bool = True,
        external_tokens: int = 0,
        extension: HostMatch | None = None,
    ) -> NewBlocks | None:
        self._tick += 1
        bs = self.block_size
        state = self._requests.get(request.request_id)
        total_computed = min(request.num_computed_tokens + hit_tokens + external_tokens, self.max_model_len)
        num_slots = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_tokens = total_computed + num_new_tokens
        if external_tokens and (state is not None or external_tokens % bs):
            raise ValueError(
                f"request {request.request_id}: {external_tokens} external tokens: only an admission "
                f"takes them, in whole {bs}-token positions"
            )
        if state is None:
            plan = self._plan_admission(request, hit_tokens, match, external_tokens, extension)
        else:
            self._release_out_of_window(state, max(0, total_computed - request.num_in_flight_tokens))
            if cdiv(num_slots, bs) <= min(len(state.full), len(state.swa)) and not (hit_tokens or headroom or whole_request):
                # A step within the positions the request holds (most decode steps): what the
                # planning below comes to when it adds nothing.
                return self._allocated(request, state, 0, (), num_lookahead_tokens, num_tokens, cache)
            plan = _Plan(_NO_MATCH, (), 0, len(state.full), len(state.swa))
        self._plan_blocks(request, state, plan, cdiv(num_slots, bs), num_tokens)
        need = plan.need_full + plan.need_swa + headroom
        if whole_request:
            total = cdiv(min(request.num_tokens, self.max_model_len), bs) - plan.have_full
            need = max(plan.need_full, total * self._n_full) + plan.need_swa + headroom
        # Held shared anchors are kept for the other requests that reach them; with no other
        # request running they may go, or a request that needs nearly every block could never
        # run (vLLM would wait for it forever).
        evict_held = len(self._requests) == (0 if state is None else 1)
        if not self._fits(plan, need, evict_held):
            return None
        state = self._commit(request, state, plan, evict_held, hit_tokens + external_tokens)
        return self._allocated(
            request, state, plan.kept, plan.windows, num_lookahead_tokens, num_tokens, cache, plan.full, plan.swa
        )

    def _plan_admission(
        self, request: Any, hit_tokens: int, match: TreeMatch | None, external_tokens: int, extension: HostMatch | None
    ) -> _Plan:
        """The prefix a request not running yet adopts: a window-safe hit of `hit_tokens` (of
        `match`, or the prefix matched again) and the pseudo hit after it, extended by
        `external_tokens` from the host tier (`extension`, the lookup's, while nothing changed
        since; else found again)."""
        bs, window = self.block_size, self.window_blocks
        hit = hit_tokens // bs
        positions = (request.num_tokens - 1) // bs
        keys = position_hashes(request.block_hashes, self.hash_stride, positions)
        if match is None or not match.holds(hit, window):
            # The tree changed since the lookup, or the caller trimmed the hit: match again.
            match, extension = self.tree.match(keys, positions, window), None
            if hit and not match.holds(hit, window):
                raise ValueError(
                    f"request {request.request_id}: {hit_tokens} computed tokens passed in, "
                    f"but only {match.safe_blocks * bs} are a window-safe hit"
                )
            if not self.enable_caching:
                match = _NO_MATCH
        plan = _Plan(match, keys, hit, hit + match.takeover(hit), hit)
        plan.adopted_full, plan.adopted_swa = match.unreferenced(hit, window)
        if external_tokens:
            extended = extension
            if self.host is None or extended is None or extended.generation != self.host.generation or extended.hit != hit:
                extended = self.host.extend(keys, match, hit, positions) if self.host is not None else None
            load_end = hit + external_tokens // bs
            if extended is None or extended.blocks < load_end:
                raise ValueError(
                    f"request {request.request_id}: {external_tokens} external tokens passed in, but the host tier "
                    f"extends its hit of {hit_tokens} tokens by {0 if extended is None else (extended.blocks - hit) * bs}"
                )
            plan.extension = replace(extended, blocks=load_end)
        return plan

    def _plan_blocks(self, request: Any, state: RequestBlocks | None, plan: _Plan, end: int, num_tokens: int) -> None:
        """The positions up to `end` that get new blocks: Full every one the request does not
        hold; SWA the positions a host extension loads and those computed from then on, only
        from `tail` on and for `windows` when window-local (see the module docstring)."""
        computed_from = plan.have_swa
        if plan.extension is not None:  # loaded, not computed (see the module docstring)
            load_end = plan.extension.blocks
            computed_from, plan.loaded = load_end, range(max(plan.hit, load_end - self.window_blocks), load_end)
        plan.end, plan.tail = end, computed_from
        if self.window_local and end > computed_from:
            plan.tail = max(computed_from, min(end, self.window_start(num_tokens)))
            if plan.tail > computed_from:
                plan.windows = self.anchor_window_positions(
                    request,
                    plan.match.path if state is None else state.nodes,
                    plan.hit if state is None else state.num_cached,
                    len(plan.match.path) - 1 if state is None else -1,
                    computed_from,
                    plan.tail,
                )
        plan.kept = len(plan.loaded) + len(plan.windows) + max(0, end - plan.tail)
        plan.need_full = max(0, end - plan.have_full) * self._n_full
        plan.need_swa = plan.kept * self._n_swa

    def _fits(self, plan: _Plan, need: int, evict_held: bool) -> bool:
        """Whether `need` block ids are free or evictable once the request adopts its plan."""
        free = self.pools.num_free_total()
        if need <= free:
            return True
        # Everything cached that nobody references is evictable, less what the request adopts
        # and, unless `evict_held`, the windows held shared anchors keep (admitting the request
        # may hold more).
        tree, n_full, n_swa = self.tree, self._n_full, self._n_swa
        evictable_full = (tree.unreferenced_full - plan.adopted_full) * n_full
        evictable = evictable_full + (tree.retained_swa - plan.adopted_swa) * n_swa
        # Held windows are part of the retained SWA: count them only when the Full KV alone
        # would not cover the request (the count walks every held anchor).
        if not evict_held and need > free + evictable_full:
            evictable -= self.anchors.held_window_nodes(plan.match.path, plan.hit, self.window_blocks) * n_swa
        return need <= free + evictable

    def _commit(
        self, request: Any, state: RequestBlocks | None, plan: _Plan, evict_held: bool, admitted_tokens: int
    ) -> RequestBlocks:
        """Carry out a plan that fits: admit the request (if new), take its blocks, plan its
        host load; returns its blocks."""
        extension = plan.extension
        host = self.host if extension is not None else None  # an extension implies a host tier
        held = host.hold_load(extension, plan.have_full) if host is not None and extension is not None else []
        admitting = state is None
        if state is None:
            state = self._admit(plan)
        self._take_blocks(state, plan, evict_held)
        if host is not None and extension is not None:
            host.plan_load(
                request.request_id, extension, plan.have_full, held, plan.full, plan.swa,  # type: ignore[arg-type]
                bool(request.num_preemptions), self._tick,
            )
            # The request reads the window before the load's end next: the hit's older SWA goes.
            self._release_swa_below(state, extension.blocks - self.window_blocks)
        if admitting:
            self._requests[request.request_id] = state
            for admitted in self._observers.admitted:
                admitted(request, admitted_tokens, state.nodes)
            self._apply(self.placement.on_admitted(request, plan.keys, state.nodes, admitted_tokens))
        return state

    def _admit(self, plan: _Plan) -> RequestBlocks:
        """A new request's blocks: it references its whole Full path, hit and pseudo hit, keeping
        its prefix in the tree. It recomputes the pseudo hit: into the nodes' own Full blocks for
        the first `takeover` positions (nobody else is reading them, and vLLM caches blocks at
        schedule time the same way), into blocks of its own for the rest."""
        path, hit, window = plan.match.path, plan.hit, self.window_blocks
        state = RequestBlocks()
        state.swa, anchored = self.tree.adopt(path, hit, window, self._tick)
        state.nodes = list(path)
        state.full = [node.full_blocks for node in path[: plan.have_full]]  # type: ignore[misc]
        state.swa_start = max(0, hit - window)
        state.num_cached = hit
        state.adopted_full = plan.have_full
        # A hit ends at an anchor (or inside a running request's window).
        anchor = path[hit - 1].anchor if hit else None
        decisions = self.placement.on_hit(anchor, goes_on=len(path) == hit) if anchor is not None else ()
        self.anchors.hold_nodes(anchored)
        if anchor is not None:
            self.anchors.record_hit(anchor)
        self._apply(decisions)
        return state

    def _take_blocks(self, state: RequestBlocks, plan: _Plan, evict_held: bool) -> None:
        """Evict what the plan needs, take its blocks and give them to the request's positions
        (`plan.full`, `plan.swa`: the positions it adds)."""
        n_full, n_swa, need_full, need_swa = self._n_full, self._n_swa, plan.need_full, plan.need_swa
        need = need_full + need_swa
        if need > self.pools.num_free_total() and not self.evict(need, EvictionCause(need_full, need_swa), evict_held):
            raise AssertionError("allocation plan and pools disagree")
        new_full, new_swa = self.pools.take_many(Pool.FULL, need_full), self.pools.take_many(Pool.SWA, need_swa)
        # zip over one iterator n times: consecutive ids in tuples of n, one per position.
        plan.full = list(zip(*[iter(new_full)] * n_full, strict=False))
        plan.swa = [None] * max(0, plan.end - plan.have_swa)
        positions = (*plan.loaded, *sorted(plan.windows), *range(plan.tail, plan.end))
        for pos, ids in zip(positions, zip(*[iter(new_swa)] * n_swa, strict=False), strict=False):
            plan.swa[pos - plan.have_swa] = ids
        state.full.extend(plan.full)
        state.swa.extend(plan.swa)

    def _allocated(
        self,
        request: Any,
        state: RequestBlocks,
        step_blocks: int,
        windows: Collection[int],
        num_lookahead_tokens: int,
        num_tokens: int,
        cache: bool,
        full: list[Blocks] | None = None,
        swa: list[Blocks | None] | None = None,
    ) -> NewBlocks:
        """An allocation's end: the request's step size recorded, observers told, its first
        `num_tokens` cached (if `cache`), the anchor budget enforced; `full` / `swa` are the
        positions it added."""
        state.step_blocks = step_blocks
        state.lookahead_blocks = cdiv(num_lookahead_tokens, self.block_size) + 1 if num_lookahead_tokens else 0
        if self._observers.allocated:
            in_window = state.swa[state.swa_start :]
            live = len(in_window) - in_window.count(None) - len(windows)
            for allocated in self._observers.allocated:
                allocated(request, live * self._n_swa, len(windows) * self._n_swa)
        if cache and self.enable_caching:
            self._cache(request, state, min(num_tokens, request.num_tokens))
        self._enforce_anchor_budget()
        return NewBlocks(full or [], swa or [])

    def anchor_window_positions(
        self, request: Any, nodes: Sequence[Node], num_cached: int, junction: int, start: int, stop: int
    ) -> set[int]:
        """The positions in `start`..`stop` (exclusive) a window-local allocation keeps besides
        its tail: the windows ending where the anchor policy may place an anchor as the step's
        positions are cached (`AnchorPolicy.window_points`). `nodes`, `num_cached`, `junction`:
        the request's prefix in the tree, its positions already cached, and where its cached
        prefix ends when it is being admitted (-1 otherwise)."""
        hashed = len(request.block_hashes) // self.hash_stride
        branched: list[int] = []
        if hashed > num_cached:
            keys = position_hashes(request.block_hashes, self.hash_stride, hashed)[num_cached:hashed]
            branched = self.tree.branch_points(nodes, keys, num_cached)
        windows: set[int] = set()
        for point in self.placement.window_points(request, start, stop + self.anchor_window_blocks, junction, branched):
            windows.update(range(max(start, point - self.anchor_window_blocks + 1), min(stop, point + 1)))
        return windows

    def touch_prefix(self, request: Any) -> None:
        if request.request_id in self._requests or not self.enable_caching:
            return
        match = self.match(request, request.num_tokens - 1)
        if not match.path:
            return
        self._tick += 1
        self.tree.touch(reversed(match.path), self._tick)
        anchor = match.path[match.safe_blocks - 1].anchor if match.safe_blocks else None
        if anchor is not None:
            self.anchors.touch(anchor)

    # ------------------------------------------------------------------ caching

    def cache(self, request: Any, num_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is not None and self.enable_caching:
            self._cache(request, state, num_tokens)
            self._enforce_anchor_budget()

    def _cache(self, request: Any, state: RequestBlocks, num_tokens: int) -> None:
        """Offer the request's newly filled positions to the tree, and place anchors due there."""
        block_hashes, stride = request.block_hashes, self.hash_stride
        start = state.num_cached
        end = min(num_tokens // self.block_size, len(block_hashes) // stride, len(state.full))
        if end <= start:
            return
        keys = block_hashes[(start + 1) * stride - 1 : end * stride : stride]
        for caching in self._observers.caching:
            caching(request, start, end)
        branched, anchored = self.tree.add_positions(state.nodes, keys, state.full, state.swa, start, self._tick)
        self.tree.share_swa(state.nodes, state.swa, max(state.swa_start, start - self.anchor_window_blocks), start)
        if self.host is not None:
            self.host.cached(state.nodes[start:end])
        state.num_cached = end
        decisions = self.placement.on_cached(request, state.nodes, start, end, branched)
        self.anchors.hold_nodes(anchored)
        self._apply(decisions)
        for cached in self._observers.cached:
            cached(request, state.nodes[start:end])

    def _apply(self, decisions: Iterable[AnchorDecision]) -> None:
        """Carry out the anchor policy's decisions; an anchor is placed only where its window's
        SWA KV is on the device (`_window_on_device`)."""
        self.anchors.apply(d for d in decisions if d.demote or self._window_on_device(d.node))

    def _window_on_device(self, node: Node) -> bool:
        """Whether the SWA KV of the anchor window ending at `node` is on the device (see the
        module docstring)."""
        for _ in range(self.anchor_window_blocks):
            if node.depth < 0:
                return True
            if node.swa_blocks is None:
                return False
            node = node.parent  # type: ignore[assignment]
        return True

    # ------------------------------------------------------------------ release

    def release_window(self, request_id: str, num_computed_tokens: int) -> None:
        state = self._requests.get(request_id)
        if state is not None:
            self._release_out_of_window(state, num_computed_tokens)

    def _release_out_of_window(self, state: RequestBlocks, processed_tokens: int) -> None:
        """Release SWA blocks before `window_start`."""
        self._release_swa_below(state, self.window_start(processed_tokens))

    def _release_swa_below(self, state: RequestBlocks, first_needed: int) -> None:
        """Let go of the request's SWA blocks before position `first_needed` (`_release_swa`)."""
        if first_needed > state.swa_start:
            self._release_swa(state, min(first_needed, len(state.swa)))
            state.swa_start = first_needed

    def window_start(self, processed_tokens: int) -> int:
        """The first position of the SWA window a request keeps once it has processed
        `processed_tokens`: the window that ends at the last position boundary (at most one
        position more than its next queries read, so it holds the SWA KV an anchor at that
        boundary needs), one position more with EAGLE/MTP."""
        bs = self.block_size
        first_needed = max(0, processed_tokens // bs * bs - self.geometry.window + 1) // bs
        return max(0, first_needed - (self.anchor_window_blocks - self.window_blocks))

    def _release_swa(self, state: RequestBlocks, stop: int) -> None:
        """Let go of the request's SWA blocks of positions below `stop`: those it shares with
        the tree go back to the tree, its own to the pool."""
        nodes, swa, tree, pools = state.nodes, state.swa, self.tree, self.pools
        for pos in range(state.swa_start, stop):
            ids = swa[pos]
            if ids is None:
                continue
            swa[pos] = None
            node = nodes[pos] if pos < len(nodes) else None
            if node is not None and node.swa_blocks is ids:
                ids = tree.unref_swa(node)
                if ids is None:
                    continue
            pools.give_back(ids)

    def free(self, request: Any) -> None:
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return
        finished = request.is_finished()
        if not finished:
            self.withdraw_uncomputed(request, state)
        first = max(state.swa_start, state.num_cached - self.anchor_window_blocks)
        self.tree.share_swa(state.nodes, state.swa, first, state.num_cached)
        placement = self.placement.on_finished if finished else self.placement.on_preempted
        self._apply(placement(request, state.nodes, state.num_cached))
        nodes = state.nodes
        self._release_swa(state, len(state.swa))
        for pos, ids in enumerate(state.full):
            if pos >= len(nodes) or nodes[pos].full_blocks is not ids:
                self.pools.give_back(ids)
        self.anchors.release_nodes(self.tree.unref_full(reversed(nodes)))
        self._enforce_anchor_budget()
        for freed in self._observers.freed:
            freed(request)

    def withdraw_uncomputed(self, request: Any, state: RequestBlocks) -> None:
        """A preempted request leaves nothing in the tree it did not compute. Positions are
        cached when their step is scheduled, so a request preempted within that step (vLLM's
        priority policy does it) has cached positions past its computed tokens that no forward
        wrote. The KV it gave their nodes goes to another running request's own copy of the
        same position (which its forward writes) or back to it; anchors that end on KV taken
        back, or cover it, go; the request's blocks and references end where its computed
        tokens do."""
        computed = request.num_computed_tokens // self.block_size
        nodes, full, swa, tree = state.nodes, state.full, state.swa, self.tree
        if computed >= len(nodes) and computed >= len(full):
            return
        for pos in range(len(nodes) - 1, computed - 1, -1):
            node = nodes[pos]
            if pos < state.num_cached and pos < len(swa) and swa[pos] is not None and node.swa_blocks is swa[pos]:
                other = self._own_copy(pos, node, Pool.SWA)
                if other is None:
                    for anchor in self._anchors_covering(node):
                        self._drop_anchor(anchor)
                    assert node.swa_refs == 1 and not node.anchor_refs, node
                    node.swa_refs = 0
                node.swa_blocks = other  # the other request's reference replaces this one's
                if other is None:
                    self._observers.tell_removed((node,), Pool.SWA, DEVICE)
            if pos < state.num_cached and pos >= state.adopted_full and node.full_blocks is full[pos]:
                other = self._own_copy(pos, node, Pool.FULL)
                if other is None:
                    if node.anchor is not None:
                        self._drop_anchor(node.anchor)
                    assert node.full_refs == 1 and not node.full_children, node
                    node.full_refs = 0
                    tree.set_full(node, None)
                    tree.prune(node)
                    continue
                tree.set_full(node, other)
                node.full_refs -= 1
                continue
            self.anchors.release_nodes(tree.unref_full([node]))
        for pos in range(computed, len(full)):
            if pos >= len(nodes) or nodes[pos].full_blocks is not full[pos]:
                self.pools.give_back(full[pos])
        for pos in range(max(computed, state.swa_start), len(swa)):
            if swa[pos] is not None:
                self.pools.give_back(swa[pos])  # type: ignore[arg-type]
        withdrawn = max(0, state.num_cached - computed)
        del nodes[computed:], full[computed:], swa[computed:]
        state.num_cached = min(state.num_cached, computed)
        if withdrawn:
            for observer in self._observers.withdrawn:
                observer(request, withdrawn)

    def _own_copy(self, pos: int, node: Node, pool: Pool) -> Blocks | None:
        """Another running request's own blocks of `pool` for `node`'s position, which it has
        cached (so its forward writes them), where the node holds other blocks."""
        held = node.full_blocks if pool is Pool.FULL else node.swa_blocks
        for other in self._requests.values():
            if pos < other.num_cached and other.nodes[pos] is node:
                ids = other.full[pos] if pool is Pool.FULL else other.swa[pos]
                if ids is not None and ids is not held:
                    return ids
        return None

    def _anchors_covering(self, node: Node) -> list[Anchor]:
        """The anchors whose window covers `node`: at it or below it, up to a window deep."""
        found, level = [], [node]
        for _ in range(self.anchor_window_blocks):
            for below in level:
                if below.anchor is not None and node in below.anchor.window:
                    found.append(below.anchor)
            level = [child for below in level for child in below.children.values()]
        return found

    def reset(self) -> bool:
        if self._requests:
            return False
        for anchor in list(self.anchors):
            self._drop_anchor(anchor)
        while self._evict_full_leaves(len(self.tree.nodes)):
            pass
        if self.host is not None:
            self.host.clear()
        assert not self.tree.nodes, "reset left nodes in the tree"
        self.tree.clear()
        for cleared in self._observers.cleared:
            cleared()
        return True

    # ----------------------------------------------------------------- eviction

    def evict(self, num_blocks: int, cause: EvictionCause, evict_held: bool = False) -> bool:
        pools, n_full = self.pools, self._n_full
        short = num_blocks - pools.num_free_total()
        while short > 0:
            leaves = self._evict_full_leaves(cdiv(short, n_full))
            if leaves:
                short -= leaves * n_full
                continue
            anchor = self.placement.victim(self.anchors, evict_held)
            if anchor is None:
                return False
            self._evict_anchor(anchor, cause)
            short = num_blocks - pools.num_free_total()
        return True

    def _enforce_anchor_budget(self) -> None:
        while self.tree.retained_swa * self._n_swa > self.anchor_budget_blocks:
            anchor = self.placement.victim(self.anchors)
            if anchor is None:
                return
            self._evict_anchor(anchor, ANCHOR_BUDGET)

    def _evict_full_leaves(self, positions: int) -> int:
        """Evict the Full KV of up to `positions` Full leaves (`PrefixTree.evict_full`); returns
        how many."""
        dropped = self.tree.evict_full(positions)
        if dropped:
            self.pools.give_back([block_id for ids in dropped for block_id in ids])
            for evicted in self._observers.blocks_evicted:
                evicted(Pool.FULL, len(dropped) * self._n_full)
        return len(dropped)

    def _evict_anchor(self, anchor: Anchor, cause: EvictionCause) -> None:
        for evicted in self._observers.anchor_evicted:
            evicted(anchor, cause)
        if self.host is not None:
            self.host.demote(anchor, self._tick)
        self.anchors.evicted(anchor)
        self._free_window(anchor)

    def _drop_anchor(self, anchor: Anchor) -> None:
        self.anchors.remove(anchor)
        self._free_window(anchor)

    def _free_window(self, anchor: Anchor) -> None:
        freed = self.tree.drop_window(anchor.node, anchor.uncover())
        for ids in freed:
            self.pools.give_back(ids)
        if freed:
            for evicted in self._observers.blocks_evicted:
                evicted(Pool.SWA, len(freed) * self._n_swa)

    # ------------------------------------------------------------------- sizes

    def size_info(self) -> SizeInfo:
        tree, pools = self.tree, self.pools
        cached_full = tree.unreferenced_full * self._n_full
        anchor_swa = tree.retained_swa * self._n_swa
        return SizeInfo(
            free=pools.num_free_total(),
            cached_full=cached_full,
            anchor_swa=anchor_swa,
            held_full=pools.used[Pool.FULL] - cached_full,
            held_swa=pools.used[Pool.SWA] - anchor_swa,
            anchors=len(self.anchors),
            demoted_anchors=self.anchors.num_demoted(),
        )

    def check_integrity(self) -> None:
        self.pools.check_integrity()
        self.tree.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
        self.anchors.check_integrity()
        self.placement.check_integrity(list(self._requests))  # type: ignore[attr-defined]
        pools = self.pools
        owner: dict[int, str] = {}

        def own(ids: Iterable[int], who: str, pool: Pool) -> None:
            for block_id in ids:
                assert block_id != 0, f"{who} holds the null block"
                assert block_id not in owner, f"block {block_id} owned by {owner[block_id]} and {who}"
                assert pools.owner(block_id) == pool, f"{who} holds block {block_id} of the other pool"
                owner[block_id] = who

        full_refs, swa_refs = self._check_requests(own)
        anchor_refs: dict[int, int] = {}
        for anchor in self.anchors:
            assert anchor.node.anchor is anchor
            for node in anchor.window:
                anchor_refs[id(node)] = anchor_refs.get(id(node), 0) + 1
                assert node.swa_blocks is not None, f"{anchor} covers {node}, which has no SWA KV"
        for node in self.tree.nodes.values():
            assert node.full_refs == full_refs.get(id(node), 0), (node, full_refs.get(id(node), 0))
            assert node.swa_refs == swa_refs.get(id(node), 0), (node, swa_refs.get(id(node), 0))
            assert node.anchor_refs == anchor_refs.get(id(node), 0), node
            if node.full_blocks is not None:
                own(node.full_blocks, f"node {node.depth} full", Pool.FULL)
            if node.swa_blocks is not None:
                own(node.swa_blocks, f"node {node.depth} swa", Pool.SWA)
        # Over the budget only while every anchor left is one the budget may not evict (held).
        retained = self.tree.retained_swa * self._n_swa
        assert retained <= self.anchor_budget_blocks or self.anchors.victim() is None, "anchor budget exceeded"
        assert len(owner) == pools.used[0] + pools.used[1], (len(owner), pools.used)

    def _check_requests(self, own: Callable[[Iterable[int], str, Pool], None]) -> tuple[dict[int, int], dict[int, int]]:
        """The running requests' invariants; their blocks go to `own` (those not the tree's).
        Returns the Full and SWA references they hold, by node id."""
        full_refs: dict[int, int] = {}
        swa_refs: dict[int, int] = {}
        for rid, state in self._requests.items():
            for node in state.nodes:
                full_refs[id(node)] = full_refs.get(id(node), 0) + 1
            for pos, ids in enumerate(state.full):
                node = state.nodes[pos] if pos < len(state.nodes) else None  # type: ignore[assignment]
                if node is None or node.full_blocks is not ids:
                    own(ids, f"request {rid} full@{pos}", Pool.FULL)
            live = 0
            for pos, ids in enumerate(state.swa):  # type: ignore[assignment]
                if ids is None:
                    assert self.window_local or pos < state.swa_start or pos >= len(state.full), (rid, pos)
                    continue
                live += 1
                assert pos >= state.swa_start, (rid, pos)
                node = state.nodes[pos] if pos < len(state.nodes) else None  # type: ignore[assignment]
                if node is not None and node.swa_blocks is ids:
                    swa_refs[id(node)] = swa_refs.get(id(node), 0) + 1
                else:
                    own(ids, f"request {rid} swa@{pos}", Pool.SWA)
            bound = self.anchor_window_blocks + 1 + state.step_blocks + state.lookahead_blocks
            assert live <= bound, f"request {rid} holds {live} SWA positions, bound {bound}"
            for i, node in enumerate(state.nodes):
                assert node.depth == i, (rid, i, node)
        return full_refs, swa_refs

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
it, anchors are evicted. With a host tier (`host_tier.py`), an evicted anchor is demoted to host memory
instead of dropped (but a grid point or prompt end given up on before it served:
`_evict_anchor`), and a request's hit extends into what the host holds (`host_extend`): its
positions past the device's hit get Full blocks like new tokens, SWA blocks only for the window
before the load's end, and are loaded from host (`take_load`), the way vLLM treats a KV
connector's external computed tokens. Loaded positions are not computed, so the SWA KV of the
others is on neither tier: an anchor is placed only where its whole window's SWA KV is on the
device (`_window_on_device`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from vllm_mimo.block_manager.anchors import Anchor, AnchorDecision, AnchorKind, AnchorSet, AnchorState
from vllm_mimo.block_manager.base import (
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
from vllm_mimo.block_manager.geometry import KVGeometry, cdiv
from vllm_mimo.block_manager.host_tier import Copy, HostTier, LoadPlan
from vllm_mimo.block_manager.placement import AnchorPlacement
from vllm_mimo.block_manager.pools import BlockPools, Pool
from vllm_mimo.block_manager.prefix_tree import Blocks, Node, PrefixTree, TreeMatch, position_hashes
from vllm_mimo.config import MimoConfig, MimoConfigError


_NO_MATCH = TreeMatch([], 0)
_NOT_STORED_WHEN_GIVEN_UP = frozenset({AnchorKind.GRID, AnchorKind.PROMPT_END})
"""Anchor kinds the host tier does not take from the device once demoted unserved (`_evict_anchor`)."""


def auto_swa_pool_blocks(geometry: KVGeometry, max_running: int, anchor_budget_blocks: int) -> int:
    """SWA pool size: every running request's window, plus the anchor budget, at most half the
    blocks (free blocks move between the pools as either runs out)."""
    running = max_running * geometry.swa_blocks_per_request
    return max(geometry.swa_blocks_per_request, min(running + anchor_budget_blocks, (geometry.num_blocks - 1) // 2))


class HybridKVCache(KVCache):
    """Two pools, the dual-index prefix tree and SWA anchors (see the module docstring).

    `window_local`: the SWA groups' attention runs window-locally (see the module docstring).
    `host_pages`: host memory for the host tier, in pages of a device block's bytes (0: no
    tier); `host_dense`: the tier keeps every stored position's SWA KV (`HostTier`'s `dense`).
    `anchor_filter`, `anchor_victim` and `anchor_worth` are for measuring tools
    (`eval.replay_bound`, `eval.replay_sensitivity`), never for serving: a veto on anchor
    placements (`AnchorPlacement.only_where`), a choice of victim among a tier of anchors
    (`AnchorSet.victim_in_tier`), and an anchor's worth in place of the policy's."""

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
        anchor_filter: Callable[[Node, AnchorKind], bool] | None = None,
        anchor_victim: Callable[[list[Anchor]], Anchor] | None = None,
        anchor_worth: Callable[[Anchor], float] | None = None,
        window_local: bool = False,
        host_pages: int = 0,
        host_dense: bool = False,
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
        self.pools = BlockPools(geometry.num_blocks, swa_blocks)
        self.tree = PrefixTree()
        self.host = (
            HostTier(
                self.tree, host_pages, self._n_full, self._n_swa, self.window_blocks,
                dense=host_dense, back_off=1 if use_eagle else 0,
            )
            if host_pages
            else None
        )
        self._loads: dict[str, LoadPlan] = {}
        self._stores: list[tuple[str, Copy]] = []
        # Nodes cached since the last `take_stores` (at schedule time, as vLLM caches blocks):
        # their KV is written by the coming forward, so an anchor on one is not stored yet.
        self._uncomputed: set[int] = set()
        # Evicted anchors are remembered as many as half the blocks (or a smaller cap) hold:
        # what twice that would keep (the size of ARC's ghost lists).
        anchor_blocks = max(1, self._n_swa * self.anchor_window_blocks)
        self.placement: AnchorPolicy = AnchorPlacement(
            geometry.block_size,
            config.grid_anchor_tokens,
            config.hot_prefix_min_hits,
            ghost_capacity=min(self.anchor_budget_blocks, all_blocks // 2) // anchor_blocks,
            only_where=anchor_filter,
            window_cost=anchor_blocks,
            full_blocks_per_position=self._n_full,
        )
        self._observers = Observers()
        self.anchors = AnchorSet(
            self.anchor_window_blocks if self.window_blocks else 0,
            self.placement.starts_demoted,
            self._anchor_placed,
            self._anchor_demoted,
            victim_in_tier=anchor_victim,
            worth=anchor_worth or self.placement.worth,
        )
        self.subscribe(self.placement)
        for observer in observers:
            self.subscribe(observer)
        self._requests: dict[str, RequestBlocks] = {}
        self._tick = 0

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

    def host_extend(self, request: Any, match: TreeMatch, max_tokens: int) -> int:
        """Tokens past the device's window-safe hit (`match`, up to `max_tokens`) that the host
        tier holds for the request: what `allocate` takes as `external_tokens`. 0 without a host
        tier. Never mutates."""
        if self.host is None or not self.enable_caching:
            return 0
        positions = max_tokens // self.block_size
        hit = match.safe_blocks
        keys = self.position_hashes(request, positions)
        extended = self.host.extend(keys, match.path, hit, match.takeover(hit), positions)
        return (extended.blocks - hit) * self.block_size

    def take_load(self, request_id: str) -> LoadPlan | None:
        """The copies from host that the latest admission of this request needs (its host
        extension), held until `finish_load`."""
        return self._loads.pop(request_id, None)

    def finish_load(self, plan: LoadPlan, failed: bool = False) -> None:
        """A load plan's copies are done, or `failed` (the request recomputes; `HostTier.fail_load`)."""
        assert self.host is not None
        if failed:
            self.host.fail_load(plan)
        else:
            self.host.finish_load(plan)

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
        """The copies to host that demotions since the last call need ("full" / "swa"). Called
        once per step, when its scheduling is done (the copies run before its forward): the
        positions cached since, computed by that forward, may be stored from then on."""
        stores, self._stores = self._stores, []
        self._uncomputed.clear()
        return stores

    # -------------------------------------------------------------- allocation

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
    ) -> NewBlocks | None:
        self._tick += 1
        state = self._requests.get(request.request_id)
        total_computed = min(request.num_computed_tokens + hit_tokens + external_tokens, self.max_model_len)
        num_slots = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        bs, n_full, n_swa, window = self.block_size, self._n_full, self._n_swa, self.window_blocks
        if (
            state is not None
            and cdiv(num_slots, bs) <= min(len(state.full), len(state.swa))
            and not (hit_tokens or external_tokens or headroom or whole_request)
        ):
            # A step within the positions the request holds (most decode steps): what the
            # planning below comes to when it adds nothing.
            self._release_out_of_window(state, max(0, total_computed - request.num_in_flight_tokens))
            return self._allocated(request, state, 0, (), num_lookahead_tokens, total_computed + num_new_tokens, cache)

        hit = hit_tokens // bs
        load_end = hit + external_tokens // bs  # a host extension: positions hit..load_end
        host_path: list[Node] | None = None
        adopted_full = adopted_swa = 0
        keys: Sequence[Any] = ()
        if external_tokens and (state is not None or external_tokens % bs):
            raise ValueError(
                f"request {request.request_id}: {external_tokens} external tokens: only an admission "
                f"takes them, in whole {bs}-token positions"
            )
        if state is not None:
            self._release_out_of_window(state, max(0, total_computed - request.num_in_flight_tokens))
            match = _NO_MATCH
            have_full, have_swa = len(state.full), len(state.swa)
        else:
            positions = (request.num_tokens - 1) // bs
            keys = position_hashes(request.block_hashes, self.hash_stride, positions)
            if match is None or not match.holds(hit, window):
                # The tree changed since the lookup, or the caller trimmed the hit: match again.
                match = self.tree.match(keys, positions, window)
                if hit and not match.holds(hit, window):
                    raise ValueError(
                        f"request {request.request_id}: {hit_tokens} computed tokens passed in, "
                        f"but only {match.safe_blocks * bs} are a window-safe hit"
                    )
                if not self.enable_caching:
                    match = _NO_MATCH
            have_full, have_swa = hit + match.takeover(hit), hit
            adopted_full, adopted_swa = match.unreferenced(hit, window)
            if load_end > hit:
                extended = self.host.extend(keys, match.path, hit, match.takeover(hit), positions) if self.host else None
                if extended is None or extended.blocks < load_end:
                    raise ValueError(
                        f"request {request.request_id}: {external_tokens} external tokens passed in, but the "
                        f"host tier extends its hit of {hit_tokens} tokens by {0 if extended is None else (extended.blocks - hit) * bs}"
                    )
                host_path = extended.path

        end = cdiv(num_slots, bs)
        full_positions, swa_positions = max(0, end - have_full), max(0, end - have_swa)
        # A host extension's positions are loaded, not computed (see the module docstring).
        computed_from, loaded = have_swa, range(0)
        if host_path is not None:
            computed_from, loaded = load_end, range(max(hit, load_end - window), load_end)
        # Window-local: SWA blocks only from `tail` on and for `windows` (see the module docstring).
        tail, windows = computed_from, set()
        if self.window_local and end > computed_from:
            tail = max(computed_from, min(end, self.window_start(total_computed + num_new_tokens)))
            if tail > computed_from:
                windows = self.anchor_window_positions(
                    request,
                    match.path if state is None else state.nodes,
                    hit if state is None else state.num_cached,
                    len(match.path) - 1 if state is None else -1,
                    computed_from,
                    tail,
                )
        kept_positions = len(loaded) + len(windows) + max(0, end - tail)
        need_full, need_swa = full_positions * n_full, kept_positions * n_swa
        need = need_full + need_swa + headroom
        if whole_request:
            total = cdiv(min(request.num_tokens, self.max_model_len), bs) - have_full
            need = max(need_full, total * n_full) + need_swa + headroom
        # Held shared anchors are kept for the other requests that reach them; with no other
        # request running they may go, or a request that needs nearly every block could never
        # run (vLLM would wait for it forever).
        evict_held = len(self._requests) == (0 if state is None else 1)
        free = self.pools.num_free_total()
        if need > free:
            # Everything cached that nobody references is evictable, less what the request
            # adopts and, unless `evict_held`, the windows held shared anchors keep (admitting
            # the request may hold more).
            tree = self.tree
            evictable_full = (tree.unreferenced_full - adopted_full) * n_full
            evictable = evictable_full + (tree.retained_swa - adopted_swa) * n_swa
            # Held windows are part of the retained SWA: count them only when the Full KV
            # alone would not cover the request (the count walks every held anchor).
            if not evict_held and need > free + evictable_full:
                evictable -= self.anchors.held_window_nodes(match.path, hit, window) * n_swa
            if need > free + evictable:
                return None

        admitting = state is None
        held = self.host.hold(self._load_sources(host_path, hit, have_full, load_end)) if host_path is not None else []
        if admitting:
            # The request references its whole Full path, hit and pseudo hit, keeping its prefix
            # in the tree. It recomputes the pseudo hit: into the nodes' own Full blocks for the
            # first `takeover` positions (nobody else is reading them, and vLLM caches blocks at
            # schedule time the same way), into blocks of its own for the rest.
            state = RequestBlocks()
            path = match.path
            state.swa, anchored = self.tree.adopt(path, hit, window, self._tick)
            state.nodes = list(path)
            state.full = [node.full_blocks for node in path[:have_full]]  # type: ignore[misc]
            state.swa_start = max(0, hit - window)
            state.num_cached = hit
            state.adopted_full = have_full
            # A hit ends at an anchor (or inside a running request's window).
            anchor = path[hit - 1].anchor if hit else None
            decisions = self.placement.on_hit(anchor, goes_on=len(path) == hit) if anchor is not None else ()
            self.anchors.hold_nodes(anchored)
            if anchor is not None:
                self.anchors.record_hit(anchor)
            self._apply(decisions)
        if need_full + need_swa > free and not self.evict(need_full + need_swa, EvictionCause(need_full, need_swa), evict_held):
            raise AssertionError("allocation plan and pools disagree")
        new_full, new_swa = self.pools.take_many(Pool.FULL, need_full), self.pools.take_many(Pool.SWA, need_swa)
        # zip over one iterator n times: consecutive ids in tuples of n, one per position.
        full: list[Blocks] = list(zip(*[iter(new_full)] * n_full))
        swa: list[Blocks | None] = [None] * swa_positions
        for pos, ids in zip((*loaded, *sorted(windows), *range(tail, end)), zip(*[iter(new_swa)] * n_swa)):
            swa[pos - have_swa] = ids
        state.full.extend(full)
        state.swa.extend(swa)
        if host_path is not None:
            self._plan_load(request, host_path, hit, have_full, load_end, full, swa, held)
            # The request reads the window before the load's end next: the hit's older SWA goes.
            if load_end - window > state.swa_start:
                self._release_swa(state, load_end - window)
                state.swa_start = load_end - window
        if admitting:
            self._requests[request.request_id] = state
            for admitted in self._observers.admitted:
                admitted(request, hit_tokens + external_tokens, state.nodes)
            self._apply(self.placement.on_admitted(request, keys, state.nodes, hit_tokens + external_tokens))
        return self._allocated(request, state, kept_positions, windows, num_lookahead_tokens, total_computed + num_new_tokens, cache, full, swa)

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

    def _load_sources(self, path: list[Node], hit: int, have_full: int, load_end: int) -> list[Node]:
        """The nodes whose host copies a host extension reads: Full past what the request adopts
        from the device, SWA of the window before its end."""
        full = path[max(hit, have_full) : load_end]
        return full + path[max(hit, load_end - self.window_blocks) : load_end]

    def _plan_load(
        self,
        request: Any,
        path: list[Node],
        hit: int,
        have_full: int,
        load_end: int,
        full: list[Blocks],
        swa: list[Blocks | None],
        held: list[Node],
    ) -> None:
        assert self.host is not None
        plan = LoadPlan(held=held)
        for pos in range(max(hit, have_full), load_end):
            plan.full.append(Copy(path[pos].host_full, full[pos - have_full]))  # type: ignore[arg-type]
        for pos in range(max(hit, load_end - self.window_blocks), load_end):
            plan.swa.append(Copy(path[pos].host_swa, swa[pos - hit]))  # type: ignore[arg-type]
        stats = self.host.stats
        stats.loaded_full += len(plan.full)
        stats.loaded_swa += len(plan.swa)
        stats.hit_tokens += (load_end - hit) * self.block_size
        if request.num_preemptions:
            stats.swapped_in_tokens += (load_end - hit) * self.block_size
        self.host.touch(path[load_end - 1], self._tick)
        self._loads[request.request_id] = plan

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
        branched, anchored = self.tree.add_positions(state.nodes, keys, state.full, state.swa, start, self._tick)
        self.tree.share_swa(state.nodes, state.swa, max(state.swa_start, start - self.anchor_window_blocks), start)
        if self.host is not None:
            self._uncomputed.update(id(node) for node in state.nodes[start:end])
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
        first_needed = self.window_start(processed_tokens)
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
                self.pools.give_back(swa[pos])
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
            self._stores.clear()
            self._uncomputed.clear()
        assert not self.tree.nodes, "reset left nodes in the tree"
        self.tree.clear()
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
            anchor = self.anchors.victim(include_held=evict_held)
            if anchor is None:
                return False
            self._evict_anchor(anchor, cause)
            short = num_blocks - pools.num_free_total()
        return True

    def _enforce_anchor_budget(self) -> None:
        while self.tree.retained_swa * self._n_swa > self.anchor_budget_blocks:
            anchor = self.anchors.victim()
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
        # The host takes every evicted anchor but a grid point or a prompt's end demoted before
        # it served: grid points are placed everywhere on speculation, a prompt's end is passed
        # by its own output and then serves only a retry of that prompt, and one the policy gave
        # up on is not worth a window of host memory (how this was chosen: eval/RESULTS.md,
        # issue 21). Output ends are kept: a next turn that comes late continues from one.
        given_up = anchor.state is AnchorState.DEMOTED_UNSERVED and anchor.kinds <= _NOT_STORED_WHEN_GIVEN_UP
        self.anchors.evicted(anchor)
        if self.host is not None and id(anchor.node) in self._uncomputed:
            self.host.stats.uncomputed_stores += 1
        elif self.host is not None and not given_up:
            stored = self.host.stats.stored_anchors
            self._stores.extend(self.host.store(anchor.node, anchor.window, self._tick))
            if AnchorKind.RESUME in anchor.kinds and self.host.stats.stored_anchors > stored:
                self.host.stats.swapped_out_tokens += (anchor.node.depth + 1) * self.block_size
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
        self.placement.check_integrity(list(self._requests))
        pools = self.pools
        owner: dict[int, str] = {}

        def own(ids: Iterable[int], who: str, pool: Pool) -> None:
            for block_id in ids:
                assert block_id != 0, f"{who} holds the null block"
                assert block_id not in owner, f"block {block_id} owned by {owner[block_id]} and {who}"
                assert pools.owner(block_id) == pool, f"{who} holds block {block_id} of the other pool"
                owner[block_id] = who

        full_refs: dict[int, int] = {}
        swa_refs: dict[int, int] = {}
        for rid, state in self._requests.items():
            for node in state.nodes:
                full_refs[id(node)] = full_refs.get(id(node), 0) + 1
            for pos, ids in enumerate(state.full):
                node = state.nodes[pos] if pos < len(state.nodes) else None
                if node is None or node.full_blocks is not ids:
                    own(ids, f"request {rid} full@{pos}", Pool.FULL)
            live = 0
            for pos, ids in enumerate(state.swa):
                if ids is None:
                    assert self.window_local or pos < state.swa_start or pos >= len(state.full), (rid, pos)
                    continue
                live += 1
                assert pos >= state.swa_start, (rid, pos)
                node = state.nodes[pos] if pos < len(state.nodes) else None
                if node is not None and node.swa_blocks is ids:
                    swa_refs[id(node)] = swa_refs.get(id(node), 0) + 1
                else:
                    own(ids, f"request {rid} swa@{pos}", Pool.SWA)
            bound = self.anchor_window_blocks + 1 + state.step_blocks + state.lookahead_blocks
            assert live <= bound, f"request {rid} holds {live} SWA positions, bound {bound}"
            for i, node in enumerate(state.nodes):
                assert node.depth == i, (rid, i, node)
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

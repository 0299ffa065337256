"""The allocation path of `HybridKVCache` (`cache.py`): what a request holds, in steps.

`allocate` plans in two steps, each a plain value: where the request starts (`_Start`: the
prefix `_plan_admission` adopts, or a running request's holdings) and the positions that get
new blocks (`_Positions`, `_plan_blocks`); it admits only if they fit (`_fits`), then commits
(`_commit`: adopt the hit, take blocks, the `NewBlocks` added, plan a host load, tell the
anchor policy) and ends (`_allocated`: observers told, positions offered to the tree by
`cache`, the anchor budget enforced). A request's SWA blocks follow its window
(`release_window`, `window_start`); the rules of which positions get SWA blocks are the module
docstring of `cache.py`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vllm_mimo.kv_cache.anchors import AnchorDecision
from vllm_mimo.kv_cache.contract import CacheRequest, EvictionCause, NewBlocks, RequestBlocks
from vllm_mimo.kv_cache.geometry import cdiv
from vllm_mimo.kv_cache.node import Blocks, Node
from vllm_mimo.kv_cache.pools import Pool
from vllm_mimo.kv_cache.prefix_tree import TreeMatch, position_hashes
from vllm_mimo.kv_cache.state import CacheState
from vllm_mimo.kv_cache.tiers.host_copies import HostMatch

NO_MATCH = TreeMatch([], 0)


@dataclass(frozen=True, slots=True)
class _Start:
    """What an allocation starts from (`HybridKVCache.allocate`), in positions: the prefix an
    admission adopts (`_plan_admission`), or a running request's holdings."""

    match: TreeMatch
    """The prefix an admission adopts (`NO_MATCH` for a running request)."""
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


@dataclass(frozen=True, slots=True)
class _Positions:
    """The positions an allocation gives new blocks (`_plan_blocks`): Full up to `end`, SWA
    to `loaded`, `windows` and `tail`..`end`."""

    end: int
    tail: int
    loaded: range = range(0)
    """Positions a host extension loads SWA KV into."""
    windows: Collection[int] = frozenset()
    kept: int = 0
    """New SWA positions: the step's `RequestBlocks.step_blocks`."""
    need_full: int = 0
    need_swa: int = 0
    """Block ids to take, per pool."""


class Allocation(CacheState):
    """`HybridKVCache`'s allocation path (see the module docstring)."""

    def allocate(
        self,
        request: CacheRequest,
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
            start = self._plan_admission(request, hit_tokens, match, external_tokens, extension)
        else:
            self._release_out_of_window(state, max(0, total_computed - request.num_in_flight_tokens))
            if cdiv(num_slots, bs) <= min(len(state.full), len(state.swa)) and not (hit_tokens or headroom or whole_request):
                # A step within the positions the request holds (most decode steps): what the
                # planning below comes to when it adds nothing.
                return self._allocated(request, state, 0, (), num_lookahead_tokens, num_tokens, cache)
            start = _Start(NO_MATCH, (), 0, len(state.full), len(state.swa))
        positions = self._plan_blocks(request, state, start, cdiv(num_slots, bs), num_tokens)
        need = positions.need_full + positions.need_swa + headroom
        if whole_request:
            total = cdiv(min(request.num_tokens, self.max_model_len), bs) - start.have_full
            need = max(positions.need_full, total * self._n_full) + positions.need_swa + headroom
        # Held shared anchors are kept for the other requests that reach them; with no other
        # request running they may go, or a request that needs nearly every block could never
        # run (vLLM would wait for it forever).
        evict_held = len(self._requests) == (0 if state is None else 1)
        if not self._fits(start, need, evict_held):
            return None
        state, new = self._commit(request, state, start, positions, evict_held, hit_tokens + external_tokens)
        return self._allocated(request, state, positions.kept, positions.windows, num_lookahead_tokens, num_tokens, cache, new)

    def _plan_admission(
        self, request: CacheRequest, hit_tokens: int, match: TreeMatch | None, external_tokens: int, extension: HostMatch | None
    ) -> _Start:
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
                match = NO_MATCH
        adopted_full, adopted_swa = match.unreferenced(hit, window)
        loaded = None
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
            loaded = replace(extended, blocks=load_end)
        return _Start(match, keys, hit, hit + match.takeover(hit), hit, adopted_full, adopted_swa, loaded)

    def _plan_blocks(
        self, request: CacheRequest, state: RequestBlocks | None, start: _Start, end: int, num_tokens: int
    ) -> _Positions:
        """The positions up to `end` that get new blocks: Full every one the request does not
        hold; SWA the positions a host extension loads and those computed from then on, only
        from `tail` on and for `windows` when window-local (see the module docstring)."""
        computed_from, loaded = start.have_swa, range(0)
        if start.extension is not None:  # loaded, not computed (see the module docstring)
            load_end = start.extension.blocks
            computed_from, loaded = load_end, range(max(start.hit, load_end - self.window_blocks), load_end)
        tail = computed_from
        windows: Collection[int] = frozenset()
        if self.window_local and end > computed_from:
            tail = max(computed_from, min(end, self.window_start(num_tokens)))
            if tail > computed_from:
                windows = self.anchor_window_positions(
                    request,
                    start.match.path if state is None else state.nodes,
                    start.hit if state is None else state.num_cached,
                    len(start.match.path) - 1 if state is None else -1,
                    computed_from,
                    tail,
                )
        kept = len(loaded) + len(windows) + max(0, end - tail)
        return _Positions(end, tail, loaded, windows, kept, max(0, end - start.have_full) * self._n_full, kept * self._n_swa)

    def _fits(self, start: _Start, need: int, evict_held: bool) -> bool:
        """Whether `need` block ids are free or evictable once the request adopts its plan."""
        free = self.pools.num_free_total()
        if need <= free:
            return True
        # Everything cached that nobody references is evictable, less what the request adopts
        # and, unless `evict_held`, the windows held shared anchors keep (admitting the request
        # may hold more).
        tree, n_full, n_swa = self.tree, self._n_full, self._n_swa
        evictable_full = (tree.unreferenced_full - start.adopted_full) * n_full
        evictable = evictable_full + (tree.retained_swa - start.adopted_swa) * n_swa
        # Held windows are part of the retained SWA: count them only when the Full KV alone
        # would not cover the request (the count walks every held anchor).
        if not evict_held and need > free + evictable_full:
            evictable -= self.anchors.held_window_nodes(start.match.path, start.hit, self.window_blocks) * n_swa
        return need <= free + evictable

    def _commit(
        self,
        request: CacheRequest,
        state: RequestBlocks | None,
        start: _Start,
        positions: _Positions,
        evict_held: bool,
        admitted_tokens: int,
    ) -> tuple[RequestBlocks, NewBlocks]:
        """Carry out a plan that fits: admit the request (if new), take its blocks, plan its
        host load; returns its blocks and the positions added."""
        extension = start.extension
        host = self.host if extension is not None else None  # an extension implies a host tier
        held = host.hold_load(extension, start.have_full) if host is not None and extension is not None else []
        admitting = state is None
        if state is None:
            state = self._admit(start)
        new = self._take_blocks(state, start.have_swa, positions, evict_held)
        if host is not None and extension is not None:
            host.plan_load(
                request.request_id, extension, start.have_full, held, new.full, new.swa,
                bool(request.num_preemptions), self._tick,
            )
            # The request reads the window before the load's end next: the hit's older SWA goes.
            self._release_swa_below(state, extension.blocks - self.window_blocks)
        if admitting:
            self._requests[request.request_id] = state
            for admitted in self._observers.admitted:
                admitted(request, admitted_tokens, state.nodes)
            self._apply(self.anchor_policy.on_admitted(request, start.keys, state.nodes, admitted_tokens))
        return state, new

    def _admit(self, start: _Start) -> RequestBlocks:
        """A new request's blocks: it references its whole Full path, hit and pseudo hit, keeping
        its prefix in the tree. It recomputes the pseudo hit: into the nodes' own Full blocks for
        the first `takeover` positions (nobody else is reading them, and vLLM caches blocks at
        schedule time the same way), into blocks of its own for the rest."""
        path, hit, window = start.match.path, start.hit, self.window_blocks
        state = RequestBlocks()
        state.swa, anchored = self.tree.adopt(path, hit, window, self._tick)
        state.nodes = list(path)
        state.full = [node.full_blocks for node in path[: start.have_full]]  # type: ignore[misc]
        state.swa_start = max(0, hit - window)
        state.num_cached = hit
        state.adopted_full = start.have_full
        # A hit ends at an anchor (or inside a running request's window).
        anchor = path[hit - 1].anchor if hit else None
        decisions = self.anchor_policy.on_hit(anchor, goes_on=len(path) == hit) if anchor is not None else ()
        self.anchors.hold_nodes(anchored)
        if anchor is not None:
            self.anchors.record_hit(anchor)
        self._apply(decisions)
        return state

    def _take_blocks(self, state: RequestBlocks, have_swa: int, positions: _Positions, evict_held: bool) -> NewBlocks:
        """Evict what the plan needs, take its blocks and give them to the request's positions
        (`have_swa`: its SWA entries before them); returns the positions added."""
        n_full, n_swa, need_full, need_swa = self._n_full, self._n_swa, positions.need_full, positions.need_swa
        need = need_full + need_swa
        if need > self.pools.num_free_total() and not self.evict(need, EvictionCause(need_full, need_swa), evict_held):
            raise AssertionError("allocation plan and pools disagree")
        new_full, new_swa = self.pools.take_many(Pool.FULL, need_full), self.pools.take_many(Pool.SWA, need_swa)
        # zip over one iterator n times: consecutive ids in tuples of n, one per position.
        full: list[Blocks] = list(zip(*[iter(new_full)] * n_full, strict=False))
        swa: list[Blocks | None] = [None] * max(0, positions.end - have_swa)
        order = (*positions.loaded, *sorted(positions.windows), *range(positions.tail, positions.end))
        for pos, ids in zip(order, zip(*[iter(new_swa)] * n_swa, strict=False), strict=False):
            swa[pos - have_swa] = ids
        state.full.extend(full)
        state.swa.extend(swa)
        return NewBlocks(full, swa)

    def _allocated(
        self,
        request: CacheRequest,
        state: RequestBlocks,
        step_blocks: int,
        windows: Collection[int],
        num_lookahead_tokens: int,
        num_tokens: int,
        cache: bool,
        new: NewBlocks | None = None,
    ) -> NewBlocks:
        """An allocation's end: the request's step size recorded, observers told, its first
        `num_tokens` cached (if `cache`), the anchor budget enforced; `new`: the positions it
        added (none if omitted)."""
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
        return new if new is not None else NewBlocks([], [])

    def anchor_window_positions(
        self, request: CacheRequest, nodes: Sequence[Node], num_cached: int, junction: int, start: int, stop: int
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
        for point in self.anchor_policy.window_points(request, start, stop + self.anchor_window_blocks, junction, branched):
            windows.update(range(max(start, point - self.anchor_window_blocks + 1), min(stop, point + 1)))
        return windows

    def cache(self, request: CacheRequest, num_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is not None and self.enable_caching:
            self._cache(request, state, num_tokens)
            self._enforce_anchor_budget()

    def _cache(self, request: CacheRequest, state: RequestBlocks, num_tokens: int) -> None:
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
        decisions = self.anchor_policy.on_cached(request, state.nodes, start, end, branched)
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

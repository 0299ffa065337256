"""HybridKVCacheManager: separate Full/SWA pools, the dual-index prefix tree and SWA anchors.

It offers the methods and attributes vLLM's `Scheduler` uses on its `KVCacheManager`, so the
scheduler (and the replay in `eval/replay.py`) drives either one through the same calls.

Per running request it keeps, for every block position, the Full block ids (one per Full group,
or more where a group's blocks are smaller than a position: see `KVGeometry`) and, inside the
SWA mask, the SWA block ids (likewise per SWA group): the last W tokens, plus the
blocks of the tokens scheduled in the current step (vLLM's attention backends read a prefill
chunk's own keys from the cache). Everything older is released: kept in the tree while an anchor
covers it, freed otherwise. A request holds a reference on every tree node of its prefix, so an
unreferenced node never has a referenced descendant and Full eviction can always go leaf-first.

Where a new block comes from: the pool's own free list, else the other pool's free list (see
`pools.py`), else eviction: first Full KV past the deepest anchor of its path (no hit can end
there), then the least recently used anchor with the Full KV only it made reachable, pinned
anchors last; hot prefixes and prompt tails that running requests hold are in use and stay
(see `anchors.py`).
Anchors also have a budget (`anchor_budget_fraction`); over it, the oldest go.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_mimo.block_manager.anchors import (
    PASSED_KINDS,
    SPECULATIVE_KINDS,
    Anchor,
    AnchorKind,
    AnchorSet,
    declared_anchors,
)
from vllm_mimo.block_manager.geometry import KVGeometry, UnsupportedKVLayout, cdiv
from vllm_mimo.block_manager.metrics import KVManagerMetrics
from vllm_mimo.block_manager.pools import BlockPools, Pool
from vllm_mimo.block_manager.prefix_tree import Node, PrefixTree, TreeMatch, window_safe_blocks
from vllm_mimo.compat import KVCacheBlock, KVCacheBlocks, PrefixCacheStats, RequestStatus
from vllm_mimo.config import MimoConfig, MimoConfigError


# Below this share of anchors that served a hit (or would have, had they not been evicted first:
# see AnchorSet), new speculative anchors of a kind start at the front of the eviction order:
# kept when memory is plentiful, first to go when it is not.
_USEFUL_SHARE = 0.25


def auto_swa_pool_blocks(geometry: KVGeometry, max_running: int, anchor_budget_blocks: int) -> int:
    """SWA pool size: every running request's window, plus the anchor budget."""
    running = max_running * geometry.swa_blocks_per_request
    return max(geometry.swa_blocks_per_request, min(running + anchor_budget_blocks, (geometry.num_blocks - 1) // 2))


def _group_slices(geometry: KVGeometry, group_ids: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """(group id, start, stop): where each group's block ids lie in a position's id tuple."""
    slices, start = [], 0
    for gid in group_ids:
        stop = start + geometry.blocks_per_position(gid)
        slices.append((gid, start, stop))
        start = stop
    return tuple(slices)


@dataclass(frozen=True)
class GroupView:
    """What vLLM's engine reads from a per-group manager (`coordinator.single_type_managers`)."""

    kv_cache_group_id: int
    kv_cache_spec: Any
    block_size: int


@dataclass(frozen=True)
class CoordinatorView:
    """The parts of vLLM's KV cache coordinator that the engine and scheduler read."""

    single_type_managers: tuple[GroupView, ...]
    enable_partial_hash_hits: bool = False


@dataclass
class _RequestBlocks:
    """A running request's blocks, by block position."""

    full: list[tuple[int, ...]] = field(default_factory=list)
    swa: list[tuple[int, ...] | None] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    """Tree nodes of the prefix, each holding one Full reference for this request."""
    swa_start: int = 0
    """Positions below this hold no SWA blocks."""
    num_cached: int = 0
    """Positions already offered to the tree."""
    step_blocks: int = 0
    """SWA positions allocated by the latest allocate_slots call."""
    lookahead_blocks: int = 0
    """Positions the latest call allocated past its tokens, for speculative tokens."""
    anchor_ends: dict[int, tuple[AnchorKind, bool]] = field(default_factory=dict)
    """Anchors to place when caching reaches these block counts: kind, pinned."""


class HybridKVCacheManager:
    """vLLM's KV cache manager surface over two pools and a dual-index prefix tree."""

    def __init__(
        self,
        kv_cache_config: Any,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        *,
        enable_caching: bool = True,
        use_eagle: bool = False,
        log_stats: bool = False,
        mimo_config: MimoConfig | None = None,
        max_num_running: int = 256,
        kv_blocks: list[KVCacheBlock] | None = None,
        watermark: float = 0.0,
        **_vllm_kwargs: Any,
    ) -> None:
        """`kv_blocks`: vLLM's block objects for ids 0..N-1 to reuse (block 0 the null block);
        `watermark`: vLLM's `--watermark`, the share of blocks kept free when admitting."""
        geometry = KVGeometry.from_kv_cache_config(kv_cache_config)
        if scheduler_block_size != geometry.block_size or geometry.block_size % hash_block_size:
            raise UnsupportedKVLayout(
                f"scheduler block size {scheduler_block_size} must equal the least common multiple "
                f"of the KV cache groups' block sizes ({geometry.block_size}), and the hash block "
                f"size {hash_block_size} must divide it"
            )
        if not geometry.uniform and max_model_len % geometry.block_size:
            # vLLM's block tables hold cdiv(max_model_len, group block size) blocks per group;
            # whole positions past a max_model_len that ends mid-position would overflow them.
            raise UnsupportedKVLayout(
                f"max_model_len {max_model_len} is not a multiple of {geometry.block_size}: with KV "
                f"cache groups of block sizes {sorted(set(geometry.group_block_sizes))}, the hybrid KV "
                f"manager allocates whole {geometry.block_size}-token positions; set --max-model-len "
                f"to a multiple of {geometry.block_size}"
            )
        config = mimo_config or MimoConfig()
        self.geometry = geometry
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        # EAGLE/MTP drafting needs the target's hidden states of the last hit block, so a hit
        # stops one block short (as upstream's drop_eagle_block does).
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.mamba_shared_prefix_checkpoint = False
        self.block_size = geometry.block_size
        self.window_blocks = geometry.window_blocks
        # With EAGLE/MTP a hit ends one block before an anchor, so an anchor keeps one more
        # block of SWA KV, and so does a running request behind its latest block boundary.
        self.anchor_window_blocks = self.window_blocks + (1 if use_eagle else 0)
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        # Block ids per position in each pool; each group's are a slice of a position's tuple.
        self._n_full = geometry.full_ids_per_position
        self._n_swa = geometry.swa_ids_per_position
        self._full_slices = _group_slices(geometry, geometry.full_group_ids)
        self._swa_slices = _group_slices(geometry, geometry.swa_group_ids)
        self._hash_stride = geometry.block_size // hash_block_size

        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        # As upstream: headroom kept for waiting and preempted admissions while others run.
        self.watermark_blocks = int(watermark * geometry.num_blocks)
        self.anchor_budget_blocks = int(config.anchor_budget_fraction * (geometry.num_blocks - 1))
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
        self.hot_prefix_min_hits = config.hot_prefix_min_hits
        self.grid_anchor_blocks = config.grid_anchor_tokens // geometry.block_size
        self.tree = PrefixTree()
        # Evicted anchors are remembered as many as the budget holds: what twice the budget
        # would keep (the size of ARC's ghost lists).
        anchor_blocks = max(1, self._n_swa * self.anchor_window_blocks)
        self.anchors = AnchorSet(ghost_capacity=self.anchor_budget_blocks // anchor_blocks)
        self.metrics = KVManagerMetrics()

        self.coordinator = CoordinatorView(
            tuple(
                GroupView(gid, group.kv_cache_spec, group.kv_cache_spec.block_size)
                for gid, group in enumerate(kv_cache_config.kv_cache_groups)
            )
        )
        self._kv_blocks = kv_blocks or [KVCacheBlock(i) for i in range(geometry.num_blocks)]
        self.null_block = self._kv_blocks[0]
        self.null_block.is_null = True
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))
        self._requests: dict[str, _RequestBlocks] = {}
        self._matches: dict[str, TreeMatch] = {}
        self._full_cached_unref = 0  # Full block ids in unreferenced nodes (all evictable)
        self._swa_retained = 0  # SWA block ids kept only by anchors
        self._tick = 0

    # ----------------------------------------------------------------- lookups

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The window-safe prefix hit: (blocks per group, hit tokens, 0). Does not mutate."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0
        limit = request.num_tokens - 1
        if max_cache_hit_length is not None:
            limit = min(limit, max_cache_hit_length)
        hashes = self._position_hashes(request, limit // self.block_size)
        match = self.tree.match(hashes, limit // self.block_size, self.window_blocks)
        if self.use_eagle and match.safe_blocks:
            match = self.tree.match(hashes, match.safe_blocks - 1, self.window_blocks)
        self._matches[request.request_id] = match
        hit = match.safe_blocks
        if hit == 0:
            return self.empty_kv_cache_blocks, 0, 0
        return self._blocks_for_hit(match.path, hit), hit * self.block_size, 0

    def _position_hashes(self, request: Any, positions: int) -> Sequence[Any]:
        """The request's block hashes of its first `positions` positions (or fewer, as far as
        hashed): vLLM chains them, so the hash of a position's last hash block names the whole
        prefix up to the position's end. Only as many as asked are copied: this runs per lookup."""
        stride = self._hash_stride
        if stride == 1:
            return request.block_hashes
        return request.block_hashes[stride - 1 : positions * stride : stride]

    def _blocks_for_hit(self, path: list[Node], hit: int) -> KVCacheBlocks:
        start = max(0, hit - self.window_blocks)
        return self._kv_cache_blocks(
            [node.full_blocks for node in path[:hit]], [None] * start + [node.swa_blocks for node in path[start:hit]]
        )

    def _kv_cache_blocks(
        self, full: Sequence[tuple[int, ...]], swa: Sequence[tuple[int, ...] | None]
    ) -> KVCacheBlocks:
        """vLLM's per-group block lists for these positions (an SWA position of None: null blocks)."""
        groups: list[list[KVCacheBlock]] = [[] for _ in range(self.num_kv_cache_groups)]
        for gid, start, stop in self._full_slices:
            groups[gid] = self._group_blocks(full, start, stop)
        for gid, start, stop in self._swa_slices:
            groups[gid] = self._group_blocks(swa, start, stop)
        return KVCacheBlocks(tuple(groups))

    def _group_blocks(self, positions: Sequence[tuple[int, ...] | None], start: int, stop: int) -> list[KVCacheBlock]:
        """One group's blocks: `ids[start:stop]` of each position's ids."""
        kv, null = self._kv_blocks, self.null_block
        if stop == start + 1:
            return [null if ids is None else kv[ids[start]] for ids in positions]
        blocks: list[KVCacheBlock] = []
        for ids in positions:
            blocks.extend([null] * (stop - start) if ids is None else [kv[i] for i in ids[start:stop]])
        return blocks

    # -------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """Slots for `num_new_tokens` (+ lookahead) more tokens; None if the pools can't hold them."""
        if num_new_tokens == 0 and num_new_computed_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no computed tokens to adopt")
        if num_external_computed_tokens:
            raise UnsupportedKVLayout("the hybrid KV manager does not take KV from a KV connector")
        self._tick += 1
        rid = request.request_id
        state = self._requests.get(rid)
        admitting = state is None
        total_computed = min(request.num_computed_tokens + num_new_computed_tokens, self.max_model_len)
        num_slots = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        bs = self.block_size

        hit = num_new_computed_tokens // bs
        if state is not None:
            self._drop_out_of_window(state, max(0, total_computed - request.num_in_flight_tokens))
            hit_path: list[Node] = []
            have_full, have_swa = len(state.full), len(state.swa)
        else:
            hit_path = self._adoptable_path(request, num_new_computed_tokens)
            have_full, have_swa = hit + self._takeover_count(hit_path, hit), hit

        end = cdiv(num_slots, bs)
        full_positions, swa_positions = max(0, end - have_full), max(0, end - have_swa)
        need_full, need_swa = full_positions * self._n_full, swa_positions * self._n_swa
        evictable = self._full_cached_unref + self._swa_retained
        if hit_path:  # adopting these takes them out of the evictable sets
            evictable -= self._n_full * sum(1 for n in hit_path if n.full_refs == 0)
            evictable -= self._n_swa * sum(
                1 for n in hit_path[max(0, hit - self.window_blocks) : hit] if n.swa_refs == 0
            )
        # As upstream: `reserved_blocks` stay free for other in-flight requests, and the
        # watermark applies to waiting and preempted requests while others are scheduled.
        headroom = reserved_blocks
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            headroom += self.watermark_blocks
        # Held shared anchors are kept for the other requests that reach them; with no
        # other request running they may go, or a request that needs nearly every block could
        # never run (vLLM would wait for it forever).
        evict_held = len(self._requests) == (1 if rid in self._requests else 0)
        if full_sequence_must_fit:
            total = cdiv(min(request.num_tokens, self.max_model_len), bs) - have_full
            need = max(need_full, total * self._n_full) + need_swa + headroom
            if not self._fits(need, evictable, hit_path, hit, evict_held):
                return None
        if not self._fits(need_full + need_swa + headroom, evictable, hit_path, hit, evict_held):
            return None

        if state is None:
            state = _RequestBlocks()
            self._adopt(state, hit_path, hit, have_full - hit)
        new_full, new_swa = self._take(need_full, need_swa, evict_held)
        n_full, n_swa = self._n_full, self._n_swa
        full = [tuple(new_full[p * n_full : (p + 1) * n_full]) for p in range(full_positions)]
        swa = [tuple(new_swa[p * n_swa : (p + 1) * n_swa]) for p in range(swa_positions)]
        state.full.extend(full)
        state.swa.extend(swa)
        state.step_blocks = swa_positions
        state.lookahead_blocks = cdiv(num_lookahead_tokens, bs) + 1 if num_lookahead_tokens else 0

        if admitting:
            self._requests[rid] = state
            self._on_admit(request, state, num_new_computed_tokens)
        if not delay_cache_blocks and self.enable_caching:
            self._cache(request, state, min(total_computed + num_new_tokens, request.num_tokens))
        self._enforce_anchor_budget()
        return self._kv_cache_blocks(full, swa) if full_positions or swa_positions else self.empty_kv_cache_blocks

    def _adoptable_path(self, request: Any, num_new_computed_tokens: int) -> list[Node]:
        """The matched Full path of a request being admitted with a hit of that many tokens.

        The lookup's match is reused when it still holds: every node has its Full KV and the
        hit is window-safe. Otherwise (the tree changed, or the caller trimmed the hit) the
        prefix is matched again, and a hit that is no longer window-safe is refused.
        """
        match = self._matches.pop(request.request_id, None)
        hit = num_new_computed_tokens // self.block_size
        if match is not None and self._still_holds(match.path, hit):
            return match.path
        positions = (request.num_tokens - 1) // self.block_size
        match = self.tree.match(self._position_hashes(request, positions), positions, self.window_blocks)
        if hit and not self._still_holds(match.path, hit):
            raise ValueError(
                f"request {request.request_id}: {num_new_computed_tokens} computed tokens passed in, "
                f"but only {match.safe_blocks * self.block_size} are a window-safe hit"
            )
        return match.path if self.enable_caching else []

    def _still_holds(self, path: list[Node], hit: int) -> bool:
        return (
            len(path) >= hit
            and all(node.full_blocks is not None for node in path)
            and window_safe_blocks(path[:hit], self.window_blocks) == hit
        )

    @staticmethod
    def _takeover_count(path: list[Node], hit: int) -> int:
        """Pseudo-hit nodes right after the hit that no running request references."""
        count = 0
        for node in path[hit:]:
            if node.full_refs:
                break
            count += 1
        return count

    def _adopt(self, state: _RequestBlocks, path: list[Node], hit: int, takeover: int) -> None:
        """Take references on a hit: Full blocks of `path[:hit]` and the SWA window before `hit`.

        The rest of the Full path (a pseudo hit) is referenced too, keeping the request's prefix
        in the tree. The request recomputes those tokens: into the nodes' own Full blocks for
        the first `takeover` of them (nobody else is reading them, and vLLM caches blocks at
        schedule time the same way), into blocks of its own for the rest.
        """
        tick = self._tick
        for node in path:
            self._ref_full(node)
            node.last_access = tick
        state.nodes = list(path)
        state.full = [node.full_blocks for node in path[: hit + takeover]]
        start = max(0, hit - self.window_blocks)
        state.swa = [None] * start
        for node in path[start:hit]:
            if node.swa_refs == 0:
                self._swa_retained -= self._n_swa
            node.swa_refs += 1
            state.swa.append(node.swa_blocks)
        state.swa_start = start
        state.num_cached = hit
        anchor = path[hit - 1].anchor if hit else None
        if anchor is not None:
            self.anchors.record_hit(anchor, tick)
            if anchor.kinds <= PASSED_KINDS and len(path) == hit:
                # The next step of a session going on from where the last one ended: that
                # anchor has done its job (this request leaves its own further on).
                self.anchors.demote(anchor)

    def _on_admit(self, request: Any, state: _RequestBlocks, hit_tokens: int) -> None:
        """Metrics, hot-prefix anchors and the anchors this request asks for."""
        bs = self.block_size
        full_tokens = len(state.nodes) * bs
        if request.num_preemptions == 0:
            m = self.metrics
            m.prompt_tokens += request.num_prompt_tokens
            m.hit_tokens += hit_tokens
            m.full_cached_tokens += full_tokens
            m.pseudo_hit_tokens += full_tokens - hit_tokens
            m.recomputed_swa_tokens += full_tokens - hit_tokens
            hashes = self._position_hashes(request, (request.num_prompt_tokens - 1) // bs)
            longest = min(len(hashes), (request.num_prompt_tokens - 1) // bs)
            self.anchors.credit_missed_serve(hashes, hit_tokens // bs, longest)
            if state.nodes:
                # Where this request's cached prefix ends is where it leaves what others
                # computed: a junction. Count the distinct requests that stop at it.
                junction = state.nodes[-1]
                junction.hit_count += 1
                if junction.hit_count >= self.hot_prefix_min_hits:
                    self._add_anchor(junction, AnchorKind.HOT, pinned=False)
        else:
            self.metrics.preempted_hit_tokens += hit_tokens
        positions, pinned = declared_anchors(getattr(request.sampling_params, "extra_args", None))
        ends = {p // bs: (AnchorKind.DECLARED, pinned) for p in positions if p // bs}
        # The longest hit a resend of the same prompt can take (vLLM recomputes the last token).
        if (request.num_prompt_tokens - 1) // bs:
            ends.setdefault((request.num_prompt_tokens - 1) // bs, (AnchorKind.PROMPT_END, False))
        for end, (kind, pin) in ends.items():
            if end <= len(state.nodes):  # already in the tree (hit or pseudo hit)
                self._add_anchor(state.nodes[end - 1], kind, pin)
            else:
                state.anchor_ends[end] = (kind, pin)

    def _fits(self, need: int, evictable: int, hit_path: list[Node], hit: int, evict_held: bool) -> bool:
        """Whether `_take` can find `need` block ids: free ones first, then by evicting.

        `evictable` counts every cached block nobody references, less what a request being
        admitted with `hit_path` (a hit of `hit` blocks) adopts. Unless `evict_held`, the SWA
        windows of held shared anchors are not evictable, and admitting the request may hold more.
        """
        free = self.pools.num_free_total()
        if need <= free or evict_held:
            return need <= free + evictable  # no eviction, or all of it allowed: nothing to count
        return need <= free + evictable - self._held_anchor_swa_blocks(hit_path, hit)

    def _held_anchor_swa_blocks(self, hit_path: list[Node], hit: int) -> int:
        """SWA blocks that only held shared anchors retain once a request with this hit
        path is admitted, outside the window before its hit (which it adopts)."""
        anchors = self.anchors
        held = [
            anchor
            for anchor in anchors.shared()
            if anchors.is_held(anchor)
            or (  # admitting the request takes the first reference on its node: held then
                anchor.node.full_refs == 0
                and anchor.node.depth < len(hit_path)
                and hit_path[anchor.node.depth] is anchor.node
                and anchors.holdable(anchor)
            )
        ]
        if not held:
            return 0
        adopted = {id(node) for node in hit_path[max(0, hit - self.window_blocks) : hit]}
        covered = {
            id(node)
            for anchor in held
            for node in anchor.window
            if node.swa_refs == 0 and node.swa_blocks is not None and id(node) not in adopted
        }
        return len(covered) * self._n_swa

    def _take(self, need_full: int, need_swa: int, evict_held: bool) -> tuple[list[int], list[int]]:
        """Block ids for both pools: evict (LRU) until enough are free, then own free first,
        then borrowed."""
        pools = self.pools
        while pools.num_free_total() < need_full + need_swa:
            if not self._evict_lru(evict_held):
                raise AssertionError("allocation plan and pools disagree")
        return pools.take_many(Pool.FULL, need_full), pools.take_many(Pool.SWA, need_swa)

    # ------------------------------------------------------------ tree updates

    def _cache(self, request: Any, state: _RequestBlocks, num_tokens: int) -> None:
        """Offer the request's newly full blocks to the tree, and place anchors that fall due."""
        block_hashes, stride = request.block_hashes, self._hash_stride
        end = min(num_tokens // self.block_size, len(block_hashes) // stride, len(state.full))
        tree, tick = self.tree, self._tick
        grid, prompt_blocks = self.grid_anchor_blocks, (request.num_prompt_tokens - 1) // self.block_size
        for pos in range(state.num_cached, end):
            if pos < len(state.nodes):
                node = state.nodes[pos]  # from the hit path: Full present, not ours
            else:
                parent = state.nodes[pos - 1] if pos else tree.root
                siblings = len(parent.children)
                node = tree.child(parent, block_hashes[(pos + 1) * stride - 1])
                if node.full_blocks is None:
                    tree.set_full(node, state.full[pos])
                    node.full_refs += 1  # a new node: never counted as cached-unreferenced
                else:
                    self._ref_full(node)
                node.last_access = tick
                state.nodes.append(node)
                if siblings == 1 and len(parent.children) == 2 and parent is not tree.root:
                    self._add_anchor(parent, AnchorKind.BRANCH, pinned=False)
            ids = state.swa[pos]
            if ids is not None and node.swa_blocks is None:
                node.swa_blocks = ids
                node.swa_refs += 1
            due = state.anchor_ends.pop(pos + 1, None)
            if due is not None:
                self._add_anchor(node, due[0], pinned=due[1])
            if grid and (pos + 1) % grid == 0 and pos < prompt_blocks and (node.anchor is None or due is not None):
                # A prompt end on the grid is a grid point too, so it is not demoted as a mere
                # prompt end when the output moves on: later requests may branch there.
                last = due is None and (pos + 1) + grid >= prompt_blocks
                self._add_anchor(node, AnchorKind.PROMPT_TAIL if last else AnchorKind.GRID, pinned=False)
        state.num_cached = max(state.num_cached, end)

    def _drop_out_of_window(self, state: _RequestBlocks, processed_tokens: int) -> None:
        """Release SWA blocks outside the window that ends at the last full block boundary.

        That is at most one block more than the running queries read, and it means the request
        always holds the SWA KV an anchor at its latest block boundary needs.
        """
        bs = self.block_size
        first_needed = max(0, processed_tokens // bs * bs - self.geometry.window + 1) // bs
        first_needed = max(0, first_needed - (self.anchor_window_blocks - self.window_blocks))
        nodes = state.nodes
        for pos in range(state.swa_start, min(first_needed, len(state.swa))):
            ids = state.swa[pos]
            if ids is None:
                continue
            state.swa[pos] = None
            node = nodes[pos] if pos < len(nodes) else None
            if node is not None and node.swa_blocks is ids:
                self._release_swa(node)
            else:
                self.pools.give_back(ids)
        state.swa_start = max(state.swa_start, first_needed)

    def _ref_full(self, node: Node) -> None:
        """A running request takes a reference on a cached node's Full blocks."""
        if node.full_refs == 0:
            self._full_cached_unref -= self._n_full
            if node.anchor is not None:
                self.anchors.hold(node.anchor)
        node.full_refs += 1

    def _unref_full(self, node: Node) -> None:
        node.full_refs -= 1
        if node.full_refs == 0:
            self._full_cached_unref += self._n_full
            if node.anchor is not None:
                self.anchors.release(node.anchor, self._tick)
            self.tree.offer_full_victim(node)

    def _release_swa(self, node: Node) -> None:
        node.swa_refs -= 1
        if node.swa_refs == 0:
            if node.anchor_refs:
                self._swa_retained += self._n_swa
            else:
                self.pools.give_back(node.swa_blocks)
                node.swa_blocks = None
                self.tree.prune(node)

    # ----------------------------------------------------------------- anchors

    def _add_anchor(self, node: Node, kind: AnchorKind, pinned: bool) -> None:
        if self.window_blocks == 0:
            return
        anchor = node.anchor
        if anchor is not None:
            if kind not in anchor.kinds:
                # Counted as an anchor of this kind too, so kept, evicted and usefulness agree.
                self.anchors.add_kind(anchor, kind)
                self.metrics.anchors_kept[kind.value] += 1
            if pinned and not anchor.pinned:
                self.anchors.pin(anchor)
            self.anchors.touch(anchor, self._tick)
            if node.full_refs:
                self.anchors.hold(anchor)
            return
        anchor = Anchor(node, self.tree.window(node, self.anchor_window_blocks), kind, pinned, self._tick)
        node.anchor = anchor
        for covered in anchor.window:
            covered.anchor_refs += 1
        self.anchors.add(anchor)
        if kind in SPECULATIVE_KINDS and self.anchors.usefulness(kind) < _USEFUL_SHARE:
            self.anchors.demote(anchor)
        elif node.full_refs:
            self.anchors.hold(anchor)
        self.metrics.anchors_kept[kind.value] += 1

    def _drop_anchor(self, anchor: Anchor) -> None:
        self.anchors.remove(anchor)
        anchor.node.anchor = None
        for covered in anchor.window:
            covered.anchor_refs -= 1
            if covered.anchor_refs == 0 and covered.swa_refs == 0 and covered.swa_blocks is not None:
                self._swa_retained -= self._n_swa
                self.pools.give_back(covered.swa_blocks)
                self.metrics.evicted_blocks[Pool.SWA] += self._n_swa
                covered.swa_blocks = None
        for covered in anchor.window:
            self.tree.prune(covered)
        self.tree.offer_full_victim(anchor.node)  # its Full KV can no longer end a hit

    def _evict_anchor(self, anchor: Anchor) -> None:
        for kind in anchor.kinds:
            self.metrics.anchors_evicted[kind.value] += 1
        self.anchors.remember_evicted(anchor)
        self._drop_anchor(anchor)

    def _evict_lru(self, evict_held: bool) -> bool:
        """Free cached blocks: unanchored Full leaves first (no hit can end there), then the
        least recently used anchor, pinned anchors last, held shared anchors only if
        `evict_held`. False if nothing is left."""
        if self._evict_full_leaf():
            return True
        anchor = self.anchors.victim(include_held=evict_held)
        if anchor is None:
            return False
        self._evict_anchor(anchor)
        return True

    def _enforce_anchor_budget(self) -> None:
        while self._swa_retained > self.anchor_budget_blocks:
            anchor = self.anchors.victim()
            if anchor is None:
                return
            self._evict_anchor(anchor)

    def _evict_full_leaf(self) -> bool:
        """Evict the least recently used unreferenced, unanchored Full leaf."""
        node = self.tree.pop_full_victim()
        if node is None:
            return False
        self._full_cached_unref -= self._n_full
        self.pools.give_back(node.full_blocks)
        self.metrics.evicted_blocks[Pool.FULL] += self._n_full
        self.tree.set_full(node, None)
        self.tree.prune(node)
        return True

    # -------------------------------------------------------------- lifecycle

    def free(self, request: Any) -> None:
        """Release a finished or preempted request's blocks, leaving an anchor where it ended."""
        state = self._requests.pop(request.request_id, None)
        self._matches.pop(request.request_id, None)
        if state is None:
            return
        if state.num_cached and self.enable_caching:
            end = state.nodes[state.num_cached - 1]
            if request.is_finished():
                self._add_anchor(end, AnchorKind.OUTPUT_END, pinned=False)
                prompt_blocks = min((request.num_prompt_tokens - 1) // self.block_size, state.num_cached)
                prompt_end = state.nodes[prompt_blocks - 1] if prompt_blocks else end
                if prompt_end is not end and prompt_end.anchor is not None and prompt_end.anchor.kinds == {AnchorKind.PROMPT_END}:
                    # The next turn continues from the output's end; the prompt's end now only
                    # serves a retry of the same prompt, so it goes first when memory is short.
                    self.anchors.demote(prompt_end.anchor)
            else:
                # Preempted: it comes back first in line and resumes from its cached KV, as
                # upstream's freed blocks stay cached. The anchor ends where the computed
                # tokens do (the window before that is still held): blocks cached for this
                # step's tokens are not computed if the request is preempted within the step.
                computed = min(state.num_cached, request.num_computed_tokens // self.block_size)
                if computed:
                    self._add_anchor(state.nodes[computed - 1], AnchorKind.RESUME, pinned=False)
        nodes = state.nodes
        for pos in range(state.swa_start, len(state.swa)):
            ids = state.swa[pos]
            if ids is None:
                continue
            node = nodes[pos] if pos < len(nodes) else None
            if node is not None and node.swa_blocks is ids:
                self._release_swa(node)
            else:
                self.pools.give_back(ids)
        for pos, ids in enumerate(state.full):
            if pos >= len(nodes) or nodes[pos].full_blocks is not ids:
                self.pools.give_back(ids)
        for node in reversed(nodes):
            self._unref_full(node)
        self._enforce_anchor_budget()

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        state = self._requests.get(request_id)
        if state is not None:
            self._drop_out_of_window(state, processed_computed_tokens)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; refused (False) while requests hold blocks."""
        if self._requests:
            return False
        self._matches.clear()
        for anchor in list(self.anchors):
            self._drop_anchor(anchor)
        while self._evict_full_leaf():
            pass
        assert not self.tree.nodes, "reset left nodes in the tree"
        self.tree.clear()
        return True

    # ------------------------------------------------------- vLLM's surface

    @property
    def usage(self) -> float:
        """Fraction of KV blocks held by running requests (cached-only blocks count as free)."""
        held = self.pools.used[0] + self.pools.used[1] - self._full_cached_unref - self._swa_retained
        return held / (self.geometry.num_blocks - 1)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        state = self._requests.get(request_id)
        if state is None:
            return self.empty_kv_cache_blocks
        return self._kv_cache_blocks(state.full, state.swa)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is not None and self.enable_caching:
            self._cache(request, state, num_computed_tokens)

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def step_prefill_tokens(self) -> int:
        """An estimate of the prefill tokens one step can add without evicting an anchor that
        is still in the LRU order: free blocks, Full blocks no running request holds (some lie
        under live anchors, so it errs high) and the windows of demoted anchors, at one block
        per KV group per block of tokens (stock attention backends read a prefill chunk's keys
        from the cache, so its SWA blocks are needed during its step)."""
        blocks = (
            self.pools.num_free_total()
            + self._full_cached_unref
            + self.anchors.num_demoted() * self._n_swa * self.anchor_window_blocks
        )
        return blocks * self.block_size // (self._n_full + self._n_swa)

    def step_token_limit(self, running: Iterable[Any], token_budget: int, floor_tokens: int) -> int:
        """A step's token budget: the decode tokens of the `running` requests plus
        `step_prefill_tokens()`, with at least `floor_tokens` for prefill, at most `token_budget`."""
        prefill = max(floor_tokens, self.step_prefill_tokens())
        if prefill >= token_budget:  # memory is ample: no need to walk the running requests
            return token_budget
        decode = sum(
            1 + len(request.spec_token_ids)
            for request in running
            if request.num_computed_tokens >= request.num_prompt_tokens
        )
        return min(token_budget, decode + prefill)

    def record_step(self, limit: int, token_budget: int, scheduled_tokens: int) -> None:
        """Count a step that the cut held back: its limit was below the budget and it used it all."""
        if limit < token_budget and scheduled_tokens >= limit:
            self.metrics.prefill_steps_cut += 1

    @property
    def anchor_blocks(self) -> int:
        """SWA block ids kept only by anchors."""
        return self._swa_retained

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        if self.prefix_cache_stats is None or not self.enable_caching or request.skip_reading_prefix_cache:
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens, num_hits=num_hits, preempted=request.num_preemptions > 0
        )

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """vLLM's prefix-cache stats since the last call (hits are window-safe hits)."""
        if self.prefix_cache_stats is None:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def estimate_cached_tokens(self, request: Any) -> int:
        state = self._requests.get(request.request_id)
        return state.num_cached * self.block_size if state else 0

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        sizes = self.geometry.group_block_sizes
        ids = self.get_block_ids(request_id)
        return tuple(group[: cdiv(num_computed_tokens, sizes[gid])] for gid, group in enumerate(ids))

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Cascade attention is gone from vLLM; kept for the scheduler's interface."""
        return [0] * self.num_kv_cache_groups

    # Channels the plugin's manager never uses: no KV events, copy-on-write copies, block
    # zeroing or Mamba boundary states. The scheduler drains them every step.
    def take_events(self) -> list:
        return []

    def new_step_starts(self) -> None:
        pass

    def take_kv_cache_block_copies(self) -> tuple[list, list]:
        return [], []

    def take_new_block_ids(self) -> list[int]:
        return []

    def take_boundary_state_offloads(self) -> dict:
        return {}

    def anchors_of_kind(self, kind: AnchorKind) -> list[Anchor]:
        """Live anchors that include `kind`."""
        return [a for a in self.anchors if kind in a.kinds]

    # ------------------------------------------------------------- checking

    def check_integrity(self) -> None:
        """Verify every invariant of pools, tree, anchors and requests (slow; for tests)."""
        self.pools.check_integrity()
        self.tree.check_integrity()
        pools, n_full, n_swa = self.pools, self._n_full, self._n_swa
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
                    assert pos < state.swa_start or pos >= len(state.full), (rid, pos)
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
        self.anchors.check_integrity()
        anchor_refs: dict[int, int] = {}
        for anchor in self.anchors:
            assert anchor.node.anchor is anchor
            for node in anchor.window:
                anchor_refs[id(node)] = anchor_refs.get(id(node), 0) + 1
        unref_full = retained = 0
        for node in self.tree.nodes.values():
            assert node.full_refs == full_refs.get(id(node), 0), (node, full_refs.get(id(node), 0))
            assert node.swa_refs == swa_refs.get(id(node), 0), (node, swa_refs.get(id(node), 0))
            assert node.anchor_refs == anchor_refs.get(id(node), 0), node
            if node.full_blocks is not None:
                own(node.full_blocks, f"node {node.depth} full", Pool.FULL)
                unref_full += n_full if node.full_refs == 0 else 0
            if node.swa_blocks is not None:
                own(node.swa_blocks, f"node {node.depth} swa", Pool.SWA)
                retained += n_swa if node.swa_refs == 0 else 0
        assert unref_full == self._full_cached_unref, (unref_full, self._full_cached_unref)
        assert retained == self._swa_retained, (retained, self._swa_retained)
        # Over the budget only while every anchor left is one the budget may not evict (held).
        assert retained <= self.anchor_budget_blocks or self.anchors.victim() is None, "anchor budget exceeded"
        assert len(owner) == pools.used[0] + pools.used[1], (len(owner), pools.used)

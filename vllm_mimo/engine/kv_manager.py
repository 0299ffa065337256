"""HybridKVCacheManager: vLLM's KV cache manager surface over `HybridKVCache`.

vLLM's `Scheduler` (and the replay in `eval/replay.py`) drives either manager through the same
calls. This adapter only translates: vLLM's arguments into the cache's (`base.KVCache`), the
cache's block ids per position into vLLM's `KVCacheBlocks` per KV cache group, and the channels
vLLM drains every step that the plugin's cache never uses into no-ops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_mimo.compat import KVCacheBlock, KVCacheBlocks, PrefixCacheStats, RequestStatus
from vllm_mimo.config import MimoConfig, MimoConfigError
from vllm_mimo.engine.kv_events import KVEventRecorder
from vllm_mimo.kv_cache.anchor_policy import AnchorPlacement
from vllm_mimo.kv_cache.cache import HybridKVCache, SwaPoolTooSmall
from vllm_mimo.kv_cache.contract import AnchorPolicy, CacheObserver
from vllm_mimo.kv_cache.counters import KVManagerMetrics
from vllm_mimo.kv_cache.geometry import KVGeometry, UnsupportedKVLayout, cdiv
from vllm_mimo.kv_cache.node import Blocks
from vllm_mimo.kv_cache.tiers.host import HostTier
from vllm_mimo.kv_cache.tiers.host_copies import Copy, HostMatch, LoadPlan
from vllm_mimo.kv_cache.tiers.l3 import L3Copy, L3Index
from vllm_mimo.layout import kv_geometry


def _group_slices(geometry: KVGeometry, group_ids: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """(group id, start, stop): where each group's block ids lie in a position's id tuple."""
    slices, start = [], 0
    for gid in group_ids:
        stop = start + geometry.blocks_per_position(gid)
        slices.append((gid, start, stop))
        start = stop
    return tuple(slices)


def _check_layout(geometry: KVGeometry, max_model_len: int, scheduler_block_size: int, hash_block_size: int) -> None:
    """Refuse block sizes and a model length the manager cannot serve (`UnsupportedKVLayout`)."""
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
    remaining_blocks: Callable[[str, int], int]
    enable_partial_hash_hits: bool = False

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, **_vllm_kwargs: Any) -> int:
        """Blocks a request still needs to reach `num_tokens` (vLLM reserves them for requests
        whose KV a connector is loading)."""
        return self.remaining_blocks(request_id, num_tokens)


class HybridKVCacheManager:
    """vLLM's KV cache manager surface over `HybridKVCache` (its `cache`)."""

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
        observers: Iterable[CacheObserver] = (),
        window_local: bool = False,
        host_pages: int = 0,
        anchor_policy: Callable[..., AnchorPolicy] = AnchorPlacement,
        host_tier: Callable[..., HostTier] = HostTier,
        enable_kv_cache_events: bool = False,
        **_vllm_kwargs: Any,
    ) -> None:
        """`kv_blocks`: vLLM's block objects for ids 0..N-1 to reuse (block 0 the null block);
        `watermark`: vLLM's `--watermark`, the share of blocks kept free when admitting;
        `observers`: subscribed to the cache's events (after its own metrics);
        `window_local`: the SWA groups' attention is window-local (`HybridKVCache`);
        `host_pages`: the host tier (`HybridKVCache`; in the engine the plugin's connector,
        `vllm_mimo.offload`, moves the bytes);
        `anchor_policy`, `host_tier`: what builds them (`HybridKVCache`); the shared store
        behind the host tier comes later, one way: `attach_l3`;
        `enable_kv_cache_events`: record vLLM's KV cache events (`kv_events`, `take_events`)."""
        geometry = kv_geometry(kv_cache_config)
        _check_layout(geometry, max_model_len, scheduler_block_size, hash_block_size)
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.metrics = KVManagerMetrics(block_size=geometry.block_size)
        self.events = KVEventRecorder(kv_cache_config, geometry, hash_block_size) if enable_kv_cache_events else None
        try:
            self.cache = HybridKVCache(
                geometry, max_model_len, hash_block_size, mimo_config or MimoConfig(),
                enable_caching=enable_caching, use_eagle=use_eagle, max_num_running=max_num_running,
                observers=(self.metrics, *observers, *([self.events] if self.events is not None else [])),
                window_local=window_local, host_pages=host_pages, anchor_policy=anchor_policy, host_tier=host_tier,
            )
        except SwaPoolTooSmall as e:  # a config value the user set
            raise MimoConfigError(str(e)) from None
        self.geometry = geometry
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.block_size = geometry.block_size
        # As upstream: headroom kept for waiting and preempted admissions while others run.
        self.watermark_blocks = int(watermark * geometry.num_blocks)
        self._vllm_surface(kv_cache_config, kv_blocks)
        self._matches: dict[str, Any] = {}  # the latest lookup per request, adopted on admission
        self._extensions: dict[str, HostMatch] = {}  # its host extension, likewise

    def _vllm_surface(self, kv_cache_config: Any, kv_blocks: list[KVCacheBlock] | None) -> None:
        """What vLLM's engine and scheduler read besides the calls: its coordinator's and block
        pool's parts, stats, the per-group slices of a position's block ids."""
        geometry = self.geometry
        self.prefix_cache_stats = PrefixCacheStats() if self.log_stats else None
        self.mamba_shared_prefix_checkpoint = False
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.coordinator = CoordinatorView(
            tuple(
                GroupView(gid, group.kv_cache_spec, group.kv_cache_spec.block_size)
                for gid, group in enumerate(kv_cache_config.kv_cache_groups)
            ),
            self.cache.remaining_blocks,
        )
        self._full_slices = _group_slices(geometry, geometry.full_group_ids)
        self._swa_slices = _group_slices(geometry, geometry.swa_group_ids)
        self._kv_blocks = kv_blocks or [KVCacheBlock(i) for i in range(geometry.num_blocks)]
        self.null_block = self._kv_blocks[0]
        self.null_block.is_null = True
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))

    # ------------------------------------------------------ lookup, allocation

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The window-safe prefix hit: (blocks per group, hit tokens, 0). Does not mutate the cache."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0
        limit = request.num_tokens - 1
        if max_cache_hit_length is not None:
            limit = min(limit, max_cache_hit_length)
        match = self.cache.match(request, limit)
        self._matches[request.request_id] = match
        hit = match.safe_blocks
        if hit == 0:
            return self.empty_kv_cache_blocks, 0, 0
        path = match.path
        start = max(0, hit - self.geometry.window_blocks)
        blocks = self._kv_cache_blocks(
            [node.full_blocks for node in path[:hit]], [None] * start + [node.swa_blocks for node in path[start:hit]]  # type: ignore[misc]
        )
        return blocks, hit * self.block_size, 0

    def host_extension(self, request: Any, max_cache_hit_length: int | None = None) -> int:
        """Tokens past the hit of the latest `get_computed_blocks` that the host tier holds
        (what a KV connector would report as external tokens)."""
        match = self._matches.get(request.request_id)
        if match is None:
            return 0
        limit = request.num_tokens - 1
        if max_cache_hit_length is not None:
            limit = min(limit, max_cache_hit_length)
        extension = self.cache.host_extend(request, match, limit)
        if extension is None:
            return 0
        self._extensions[request.request_id] = extension
        return (extension.blocks - extension.hit) * self.block_size

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
        if num_external_computed_tokens and self.cache.host is None:
            raise UnsupportedKVLayout("the hybrid KV manager takes external tokens only from its host tier")
        # As upstream: `reserved_blocks` stay free for other in-flight requests, and the
        # watermark applies to waiting and preempted requests while others are scheduled.
        headroom = reserved_blocks
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            headroom += self.watermark_blocks
        new = self.cache.allocate(
            request,
            num_new_tokens,
            hit_tokens=num_new_computed_tokens,
            match=self._matches.pop(request.request_id, None),
            num_lookahead_tokens=num_lookahead_tokens,
            headroom=headroom,
            whole_request=full_sequence_must_fit,
            cache=not delay_cache_blocks,
            external_tokens=num_external_computed_tokens,
            extension=self._extensions.pop(request.request_id, None),
        )
        if new is None:
            return None
        return self._kv_cache_blocks(new.full, new.swa) if new.full or new.swa else self.empty_kv_cache_blocks

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        self.cache.cache(request, num_computed_tokens)

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        self.cache.release_window(request_id, processed_computed_tokens)

    def free(self, request: Any) -> None:
        """Release a finished or preempted request's blocks, leaving an anchor where it ended."""
        self._matches.pop(request.request_id, None)
        self._extensions.pop(request.request_id, None)
        self.cache.free(request)

    def pop_blocks_for_free(self, request: Any) -> list[KVCacheBlock]:
        """vLLM defers a request's free while a step may still write its blocks and a consumer
        connector's load into them would not be ordered after that write (async scheduling).
        The plugin's connector copies on the compute stream, ordered after it: free now."""
        self.free(request)
        return []

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        """Partial tail blocks for a producer connector (Mamba align blocks): the plugin's
        manager has none."""
        return []

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; refused (False) while requests hold blocks."""
        if not self.cache.reset():
            return False
        self._matches.clear()
        self._extensions.clear()
        return True

    # ------------------------------------------------------------- the tiers
    #
    # What the plugin's KV connector (`vllm_mimo.offload.connector`) reaches: the host tier's
    # transfers and the L3, through the manager alone.

    @property
    def host_tier(self) -> HostTier | None:
        """The host tier (None without one)."""
        return self.cache.host

    def attach_l3(self, index: L3Index, **l3_tier_kwargs: Any) -> None:
        """The shared store behind the host tier (`HostTier.attach_l3`): the one way an L3 enters."""
        if self.cache.host is None:
            raise ValueError("an L3 needs the host tier (host_pages > 0)")
        self.cache.host.attach_l3(index, **l3_tier_kwargs)

    def detach_l3(self) -> None:
        """No L3 from now on (the store went away)."""
        if self.cache.host is not None:
            self.cache.host.detach_l3()

    def take_load(self, request_id: str) -> LoadPlan | None:
        """The copies the latest admission of this request needs from host and L3."""
        return self.cache.take_load(request_id)

    def finish_load(self, plan: LoadPlan, failed: bool = False) -> None:
        """A load plan's copies are done, or `failed` (the request recomputes)."""
        self.cache.finish_load(plan, failed)

    def take_stores(self) -> list[tuple[str, Copy]]:
        """The device-to-host copies of this step's demotions (once per step)."""
        return self.cache.take_stores()

    def take_puts(self) -> list[L3Copy]:
        """The host-to-L3 copies of this step's host evictions (with `take_stores`)."""
        return self.cache.take_puts()

    # ------------------------------------------------------------ translation

    def host_copies(self, kind: str, copy: Copy) -> list[tuple[int, int, int]]:
        """A position's copy between tiers (`HybridKVCache.take_stores` / `take_load`, kind
        "full" or "swa") as (KV cache group, device block id, host page) per block."""
        slices = self._full_slices if kind == "full" else self._swa_slices
        return [(gid, copy.device[i], copy.host[i]) for gid, start, stop in slices for i in range(start, stop)]

    def _kv_cache_blocks(self, full: Sequence[Blocks], swa: Sequence[Blocks | None]) -> KVCacheBlocks:
        """vLLM's per-group block lists for these positions (an SWA position of None: null blocks)."""
        groups: list[list[KVCacheBlock]] = [[] for _ in range(self.num_kv_cache_groups)]
        for gid, start, stop in self._full_slices:
            groups[gid] = self._group_blocks(full, start, stop)
        for gid, start, stop in self._swa_slices:
            groups[gid] = self._group_blocks(swa, start, stop)
        return KVCacheBlocks(tuple(groups))

    def _group_blocks(self, positions: Sequence[Blocks | None], start: int, stop: int) -> list[KVCacheBlock]:
        """One group's blocks: `ids[start:stop]` of each position's ids."""
        kv, null = self._kv_blocks, self.null_block
        if stop == start + 1:
            return [null if ids is None else kv[ids[start]] for ids in positions]
        nulls = [null] * (stop - start)
        blocks: list[KVCacheBlock] = []
        for ids in positions:
            blocks += nulls if ids is None else [kv[i] for i in ids[start:stop]]
        return blocks

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        state = self.cache.requests.get(request_id)
        if state is None:
            return self.empty_kv_cache_blocks
        return self._kv_cache_blocks(state.full, state.swa)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        sizes = self.geometry.group_block_sizes
        ids = self.get_block_ids(request_id)
        return tuple(group[: cdiv(num_computed_tokens, sizes[gid])] for gid, group in enumerate(ids))

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def estimate_cached_tokens(self, request: Any) -> int:
        state = self.cache.requests.get(request.request_id)
        return state.num_cached * self.block_size if state else 0

    # ------------------------------------------------------------------ stats

    @property
    def usage(self) -> float:
        """Fraction of KV blocks held by running requests (cached-only blocks count as free)."""
        return self.cache.size_info().held / (self.geometry.num_blocks - 1)

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

    def take_events(self) -> list:
        """vLLM's KV cache events since the last call (none unless `enable_kv_cache_events`)."""
        return self.events.take_events() if self.events is not None else []

    def held_block_hashes(self) -> dict[tuple[int, str], set]:
        """What a subscriber replaying `take_events` holds, read from the cache itself: the
        hashes of the blocks held, per (KV cache group, medium) (a walk over the whole tree; for
        tests). Needs `enable_kv_cache_events`."""
        if self.events is None:
            raise RuntimeError("KV cache events are off: build the manager with enable_kv_cache_events=True")
        return self.events.held_block_hashes(self.cache.tree)

    # Channels the plugin's cache never uses: cascade attention's common prefix, copy-on-write
    # copies, block zeroing, Mamba boundary states. The scheduler drains them.
    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_kv_cache_groups

    def new_step_starts(self) -> None:
        pass

    def take_kv_cache_block_copies(self) -> tuple[list, list]:
        return [], []

    def take_new_block_ids(self) -> list[int]:
        return []

    def take_boundary_state_offloads(self) -> dict:
        return {}

    def check_integrity(self) -> None:
        self.cache.check_integrity()


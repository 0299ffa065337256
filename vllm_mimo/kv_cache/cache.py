"""HybridKVCache: the `contract.KVCache` contract over two pools, the prefix tree and SWA anchors.

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
it, anchors are evicted. With a host tier (`tiers/host.py`, whose rules are all written
there), an evicted anchor is demoted to host memory instead of dropped (`HostTier.demote`), and
a request's hit extends into what the host holds (`host_extend`): its
positions past the device's hit get Full blocks like new tokens, SWA blocks only for the window
before the load's end, and are loaded from host (`take_load`), the way vLLM treats a KV
connector's external computed tokens. Loaded positions are not computed, so the SWA KV of the
others is on neither tier: an anchor is placed only where its whole window's SWA KV is on the
device (`_window_on_device`).

This module builds the cache and holds its lookups, release, eviction and sizes; the allocation
path is `allocation.py`, preemption within a step `preemption.py`, the invariants
`integrity.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from vllm_mimo.kv_cache.allocation import NO_MATCH, Allocation
from vllm_mimo.kv_cache.anchor_policy import AnchorPlacement
from vllm_mimo.kv_cache.anchors import AnchorSet
from vllm_mimo.kv_cache.contract import (
    ANCHOR_BUDGET,
    AnchorPolicy,
    CacheObserver,
    CacheRequest,
    EvictionCause,
    Observers,
    RequestBlocks,
    SizeInfo,
)
from vllm_mimo.kv_cache.geometry import KVGeometry, cdiv
from vllm_mimo.kv_cache.integrity import Integrity
from vllm_mimo.kv_cache.node import Anchor, AnchorKind
from vllm_mimo.kv_cache.pools import BlockPools, Pool
from vllm_mimo.kv_cache.preemption import Preemption
from vllm_mimo.kv_cache.prefix_tree import PrefixTree, TreeMatch, position_hashes
from vllm_mimo.kv_cache.tiers.host import HostTier
from vllm_mimo.kv_cache.tiers.host_copies import Copy, HostMatch, LoadPlan
from vllm_mimo.kv_cache.tiers.l3 import L3Copy


class CacheSettings(Protocol):
    """The cache's settings, by the names of the plugin's config keys (`vllm_mimo.config`, where
    each is described and validated; `MimoConfig` is one)."""

    @property
    def swa_pool_fraction(self) -> float | None: ...

    @property
    def anchor_budget_fraction(self) -> float | None: ...

    @property
    def grid_anchor_tokens(self) -> int: ...

    @property
    def chunk_anchor_tokens(self) -> int | None: ...  # null is resolved by `MimoConfig`

    @property
    def hot_prefix_min_hits(self) -> int: ...


class SwaPoolTooSmall(ValueError):
    """`swa_pool_fraction` leaves the SWA pool fewer blocks than one request's window needs."""


def auto_swa_pool_blocks(geometry: KVGeometry, max_running: int, anchor_budget_blocks: int) -> int:
    """SWA pool size: every running request's window, plus the anchor budget, at most half the
    blocks (free blocks move between the pools as either runs out)."""
    running = max_running * geometry.swa_blocks_per_request
    return max(geometry.swa_blocks_per_request, min(running + anchor_budget_blocks, (geometry.num_blocks - 1) // 2))


class HybridKVCache(Allocation, Preemption, Integrity):
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
        config: CacheSettings,
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
        self.anchor_policy: AnchorPolicy = self._anchor_policy(config, anchor_policy)
        self.anchors = AnchorSet(
            self.anchor_window_blocks if self.window_blocks else 0,
            self.anchor_policy.starts_demoted,
            self._anchor_placed,
            self._anchor_demoted,
            worth=self.anchor_policy.worth,
            keeps_full=self.anchor_policy.keeps_full,
        )
        self.subscribe(self.anchor_policy)
        for observer in observers:
            self.subscribe(observer)
        self._requests: dict[str, RequestBlocks] = {}
        self._tick = 0

    def _anchor_policy(self, config: CacheSettings, anchor_policy: Callable[..., AnchorPolicy]) -> AnchorPolicy:
        """The anchor policy, built with `AnchorPlacement`'s arguments."""
        # Evicted anchors are remembered as many as half the blocks (or a smaller cap) hold:
        # what twice that would keep (the size of ARC's ghost lists).
        anchor_blocks = max(1, self._n_swa * self.anchor_window_blocks)
        chunk_tokens = config.chunk_anchor_tokens
        if chunk_tokens is None:
            raise ValueError("chunk_anchor_tokens=None: MimoConfig resolves null to its default")
        return anchor_policy(
            self.block_size,
            config.grid_anchor_tokens,
            config.hot_prefix_min_hits,
            chunk_every=chunk_tokens // config.grid_anchor_tokens if chunk_tokens else 0,
            ghost_capacity=min(self.anchor_budget_blocks, (self.geometry.num_blocks - 1) // 2) // anchor_blocks,
            window_cost=anchor_blocks,
            full_blocks_per_position=self._n_full,
        )

    def _swa_pool_blocks(self, config: CacheSettings, max_num_running: int) -> int:
        """The SWA pool's size: `swa_pool_fraction`, or `auto_swa_pool_blocks`."""
        geometry = self.geometry
        if config.swa_pool_fraction is None:
            swa_blocks = auto_swa_pool_blocks(geometry, max_num_running, self.anchor_budget_blocks)
        else:
            swa_blocks = round(config.swa_pool_fraction * (geometry.num_blocks - 1))
        if swa_blocks < geometry.swa_blocks_per_request:
            raise SwaPoolTooSmall(
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

    def position_hashes(self, request: CacheRequest, positions: int) -> Sequence[Any]:
        """The node keys of the request's first `positions` positions (or fewer, as far as
        hashed)."""
        return position_hashes(request.block_hashes, self.hash_stride, positions)

    def match(self, request: CacheRequest, max_tokens: int) -> TreeMatch:
        if not self.enable_caching:
            return NO_MATCH
        positions = max_tokens // self.block_size
        keys = self.position_hashes(request, positions)
        match = self.tree.match(keys, positions, self.window_blocks)
        if self.use_eagle and match.safe_blocks:
            match = self.tree.match(keys, match.safe_blocks - 1, self.window_blocks)
        return match

    def host_extend(self, request: CacheRequest, match: TreeMatch, max_tokens: int) -> HostMatch | None:
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

    def touch_prefix(self, request: CacheRequest) -> None:
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

    # ------------------------------------------------------------------ release

    def free(self, request: CacheRequest) -> None:
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return
        finished = request.is_finished()
        if not finished:
            self.withdraw_uncomputed(request, state)
        first = max(state.swa_start, state.num_cached - self.anchor_window_blocks)
        self.tree.share_swa(state.nodes, state.swa, first, state.num_cached)
        placement = self.anchor_policy.on_finished if finished else self.anchor_policy.on_preempted
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

    def reset(self) -> bool:
        if self._requests:
            return False
        for anchor in list(self.anchors):
            self._drop_anchor(anchor)
        while self._evict_full_leaves(len(self.tree.nodes), ANCHOR_BUDGET):  # no anchor is left to go
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
            leaves = self._evict_full_leaves(cdiv(short, n_full), cause)
            if leaves:
                short -= leaves * n_full
                continue
            anchor = self.anchor_policy.victim(self.anchors, evict_held)
            if anchor is None:
                return False
            self._evict_anchor(anchor, cause)
            short = num_blocks - pools.num_free_total()
        return True

    def _enforce_anchor_budget(self) -> None:
        while self.tree.retained_swa * self._n_swa > self.anchor_budget_blocks:
            anchor = self.anchor_policy.victim(self.anchors)
            if anchor is None:
                return
            self._evict_anchor(anchor, ANCHOR_BUDGET)

    def _evict_full_leaves(self, positions: int, cause: EvictionCause) -> int:
        """Evict the Full KV of up to `positions` Full leaves, and an anchor that goes with its
        leaf (`PrefixTree.evict_full`); returns how many."""
        dropped = self.tree.evict_full(positions, lambda anchor: self._evict_anchor(anchor, cause, in_order=False))
        if dropped:
            self.pools.give_back([block_id for ids in dropped for block_id in ids])
            for evicted in self._observers.blocks_evicted:
                evicted(Pool.FULL, len(dropped) * self._n_full)
        return len(dropped)

    def _evict_anchor(self, anchor: Anchor, cause: EvictionCause, in_order: bool = True) -> None:
        """Evict `anchor`: chosen by the eviction order (`in_order`), or going with its node's
        Full KV (`AnchorSet.evicted`)."""
        for evicted in self._observers.anchor_evicted:
            evicted(anchor, cause)
        if self.host is not None:
            self.host.demote(anchor, self._tick)
        self.anchors.evicted(anchor, in_order)
        self._free_window(anchor)

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


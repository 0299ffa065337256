"""What the hybrid KV cache offers, what it tells, and the order in which it evicts.

A short contract in the spirit of mini-sglang's `kvcache/base.py`. vLLM's scheduler reaches the
cache through `adapter.HybridKVCacheManager`; eval and tests use only this contract, the
observer interface below, and the plain data the cache shows (tree nodes, anchors, pools).

Units: a *position* is `geometry.block_size` tokens (the least common multiple of the KV cache
groups' block sizes); at each position a request holds block ids in both pools, the Full pool's
for every Full group and, inside its SWA mask, the SWA pool's for every SWA group. Sizes below
are block ids.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vllm_mimo.kv_cache.anchors import AnchorDecision, AnchorSet
    from vllm_mimo.kv_cache.geometry import KVGeometry
    from vllm_mimo.kv_cache.node import Anchor, AnchorKind, Blocks, Node
    from vllm_mimo.kv_cache.pools import BlockPools, Pool
    from vllm_mimo.kv_cache.prefix_tree import PrefixTree, TreeMatch
    from vllm_mimo.kv_cache.tiers.host_copies import HostMatch


@dataclass(slots=True)
class SizeInfo:
    """Where the block ids are (the null block is in none of these)."""

    free: int
    """On the pools' free lists."""
    cached_full: int
    """Full blocks in the tree that no running request holds: evictable."""
    anchor_swa: int
    """SWA blocks that only anchors keep: evictable with their anchors, unless held."""
    held_full: int
    """Full blocks running requests hold."""
    held_swa: int
    """SWA blocks running requests hold (their windows and the latest step's positions)."""
    anchors: int
    """Live anchors."""
    demoted_anchors: int
    """Unpinned demoted anchors: the first to be evicted."""

    @property
    def evictable(self) -> int:
        return self.cached_full + self.anchor_swa

    @property
    def held(self) -> int:
        return self.held_full + self.held_swa


@dataclass(frozen=True)
class EvictionCause:
    """Why cached blocks are evicted: an allocation that needs `full_blocks` + `swa_blocks`
    block ids, or (both None) the anchor cap a user set (`anchor_budget_fraction`)."""

    full_blocks: int | None = None
    swa_blocks: int | None = None

    @property
    def by_budget(self) -> bool:
        return self.full_blocks is None


ANCHOR_BUDGET = EvictionCause()


@dataclass
class RequestBlocks:
    """A running request's blocks, by position."""

    full: list[Blocks] = field(default_factory=list)
    swa: list[Blocks | None] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    """Tree nodes of the prefix, each holding one Full reference for this request."""
    swa_start: int = 0
    """Positions below this hold no SWA blocks."""
    num_cached: int = 0
    """Positions already offered to the tree."""
    adopted_full: int = 0
    """Positions below this use the tree's own Full blocks from admission on (a hit, or a pseudo
    hit taken over); past it, a node's Full blocks that are the request's were given by it."""
    step_blocks: int = 0
    """SWA positions allocated by the latest allocation."""
    lookahead_blocks: int = 0
    """Positions the latest allocation added past its tokens, for speculative tokens."""


class CacheRequest(Protocol):
    """What the cache reads of a request (vLLM's `Request` is one): its id, its tokens' chained
    block hashes (`hash_block_size` tokens each), its lengths and progress, its preemptions, and
    its sampling parameters' `extra_args` (anchor hints)."""

    @property
    def request_id(self) -> str: ...

    @property
    def block_hashes(self) -> Sequence[Any]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_in_flight_tokens(self) -> int:
        """Tokens scheduled whose forward has not returned yet (async scheduling)."""
        ...

    @property
    def num_preemptions(self) -> int: ...

    @property
    def sampling_params(self) -> Any: ...

    def is_finished(self) -> bool: ...


@dataclass(slots=True)
class NewBlocks:
    """The positions an allocation added to a request: Full block ids per position, and SWA
    block ids per position (None: outside the SWA mask)."""

    full: list[Blocks]
    swa: list[Blocks | None]


class CacheObserver:
    """Subscribes to the cache's events (`KVCache.subscribe`); override the ones you need.

    An event comes once the cache's state has changed; an observer reads that state and never
    changes it. Metrics (`metrics.KVManagerMetrics`) and eval's diagnoses are observers."""

    def admitted(self, request: CacheRequest, hit_tokens: int, path: Sequence[Node]) -> None:
        """A request was admitted with a window-safe hit of `hit_tokens`; `path` are the tree
        nodes of its prefix it now references (the hit, then any pseudo hit)."""

    def cached(self, request: CacheRequest, nodes: Sequence[Node]) -> None:
        """These positions of a running request entered the tree (or were found there)."""

    def allocated(self, request: CacheRequest, swa_blocks: int, anchor_window_blocks: int) -> None:
        """An allocation for a running request is done: it holds `swa_blocks` SWA blocks (all
        SWA groups) besides `anchor_window_blocks` kept only for windows of anchors the policy
        may place inside its chunk (a window-local allocation's)."""

    def freed(self, request: CacheRequest) -> None:
        """A finished or preempted request let go of its blocks."""

    def withdrawn(self, request: CacheRequest, positions: int) -> None:
        """A request preempted within the step that scheduled it took `positions` cached
        positions its forward never computed out of the tree (`HybridKVCache.withdraw_uncomputed`)."""

    def anchor_placed(self, anchor: Anchor, kind: AnchorKind) -> None:
        """An anchor of `kind` was placed: a new anchor, or a new kind of a live one."""

    def anchor_demoted(self, anchor: Anchor) -> None:
        """An anchor moved to the front of the eviction order."""

    def anchor_evicted(self, anchor: Anchor, cause: EvictionCause) -> None:
        """An anchor is being evicted (its window still attached)."""

    def blocks_evicted(self, pool: Pool, count: int) -> None:
        """Cached blocks of `pool` were freed: the Full leaves one eviction took, or an
        anchor's window."""

    def caching(self, request: CacheRequest, start: int, end: int) -> None:
        """Positions `start` to `end` of a running request are about to enter the tree (before
        the `stored` events of the nodes they give blocks)."""

    def stored(self, nodes: Sequence[Node], pool: Pool, medium: str) -> None:
        """These nodes now hold their KV of `pool` on `medium` (`DEVICE`: `Node.full_blocks` /
        `swa_blocks` set; `HOST`: the host slot's `full` / `swa`). Each change of a node's KV
        between held and not held is told once, as it happens, by `stored` or `removed`."""

    def removed(self, nodes: Sequence[Node], pool: Pool, medium: str) -> None:
        """These nodes no longer hold their KV of `pool` on `medium`."""

    def cleared(self) -> None:
        """Every cached block on every medium was dropped (`KVCache.reset`)."""


class Observers:
    """The subscribed observers' handlers, per event; a subscriber's handler is listed only
    where it overrides `CacheObserver`'s, so an event nobody wants costs nothing."""

    EVENTS = (
        "admitted",
        "cached",
        "allocated",
        "freed",
        "withdrawn",
        "anchor_placed",
        "anchor_demoted",
        "anchor_evicted",
        "blocks_evicted",
        "caching",
        "stored",
        "removed",
        "cleared",
    )

    def __init__(self) -> None:
        self.admitted: list = []
        self.cached: list = []
        self.allocated: list = []
        self.freed: list = []
        self.withdrawn: list = []
        self.anchor_placed: list = []
        self.anchor_demoted: list = []
        self.anchor_evicted: list = []
        self.blocks_evicted: list = []
        self.caching: list = []
        self.stored: list = []
        self.removed: list = []
        self.cleared: list = []

    def register(self, observer: CacheObserver) -> None:
        for event in self.EVENTS:
            if getattr(type(observer), event) is not getattr(CacheObserver, event):
                getattr(self, event).append(getattr(observer, event))

    def tell_stored(self, nodes: Sequence[Node], pool: Pool, medium: str) -> None:
        """`CacheObserver.stored`, from where the tree and the host tier set a node's KV (the
        tree's `KVListener`)."""
        for stored in self.stored:
            stored(nodes, pool, medium)

    def tell_removed(self, nodes: Sequence[Node], pool: Pool, medium: str) -> None:
        """`CacheObserver.removed`, from where the tree and the host tier clear a node's KV."""
        for removed in self.removed:
            removed(nodes, pool, medium)


class AnchorPolicy(CacheObserver, ABC):
    """Where anchors go: the cache tells it what happened to a request and applies the
    decisions it returns, in order (`AnchorSet.apply`). It is subscribed to the cache's events
    too, for what it learns from them. `placement.AnchorPlacement` is the plugin's."""

    @abstractmethod
    def on_hit(self, anchor: Anchor, goes_on: bool) -> Sequence[AnchorDecision]:
        """A request adopts a hit ending at `anchor` (before the hit is recorded on it);
        `goes_on`: nothing of the request's prefix is in the tree past the hit."""

    @abstractmethod
    def on_admitted(
        self, request: CacheRequest, keys: Sequence[Any], nodes: Sequence[Node], hit_tokens: int
    ) -> Sequence[AnchorDecision]:
        """A request was admitted with a hit of `hit_tokens`; `keys` are the node keys of its
        positions (`prefix_tree.position_hashes`), `nodes` its prefix in the tree (hit and
        pseudo hit)."""

    @abstractmethod
    def on_cached(
        self, request: CacheRequest, nodes: Sequence[Node], start: int, end: int, branched: Sequence[int]
    ) -> Sequence[AnchorDecision]:
        """Positions `start` to `end` of a request (`nodes[start:end]`) are in the tree; at each
        position in `branched`, the parent has just become a branch point."""

    @abstractmethod
    def window_points(self, request: CacheRequest, start: int, end: int, junction: int, branched: Sequence[int]) -> set[int]:
        """Positions in `start`..`end` (exclusive) where the policy may place an anchor while the
        request computes them (a superset); `junction`: where its cached prefix ends (-1: not
        admitted in this allocation), `branched`: positions whose parent will become a branch
        point. A window-local cache keeps SWA KV for the windows ending there."""

    @abstractmethod
    def on_finished(self, request: CacheRequest, nodes: Sequence[Node], num_cached: int) -> Sequence[AnchorDecision]:
        """A request finished with `num_cached` of its positions in the tree."""

    @abstractmethod
    def on_preempted(self, request: CacheRequest, nodes: Sequence[Node], num_cached: int) -> Sequence[AnchorDecision]:
        """A request was preempted with `num_cached` of its positions in the tree."""

    @abstractmethod
    def starts_demoted(self, anchor: Anchor, kind: AnchorKind) -> bool:
        """Whether `anchor`, new and of `kind` (already counted as placed), starts demoted."""

    @abstractmethod
    def worth(self, anchor: Anchor) -> float:
        """What `anchor` is worth per block it keeps, in hit tokens (orders the live anchors:
        `node.AnchorState`)."""

    def keeps_full(self, anchor: Anchor) -> bool:
        """Whether `anchor` keeps its node's Full KV while it lives (`Anchor.keeps_full`): every
        anchor unless the policy says otherwise."""
        return True

    @abstractmethod
    def check_integrity(self, running: Sequence[str]) -> None:
        """Assert the policy's own invariants, given the ids of the running requests (slow;
        `KVCache.check_integrity` calls it)."""

    def victim(self, anchors: AnchorSet, include_held: bool = False) -> Anchor | None:
        """The anchor to evict next: the eviction order's (`AnchorSet.victim`). A policy that
        evicts otherwise (eval's clairvoyant bound) overrides it."""
        return anchors.victim(include_held)


class KVCache(ABC):
    """The hybrid KV cache: two pools, the dual-index prefix tree and SWA anchors.

    A request's life: `match` its prefix, `allocate` (admitting it, adopting the hit), then
    `allocate` again for each step's tokens, `cache` what it computed, and `free` it when it
    finishes or is preempted. The cache keeps, per running request, its Full blocks and the
    SWA blocks of its mask (the window before its latest position boundary, plus the
    positions of its latest step: all of them with stock attention backends, with
    window-local SWA attention only those read after the step); everything else goes to the
    tree, kept while an anchor needs it, freed otherwise.
    """

    geometry: KVGeometry
    pools: BlockPools
    tree: PrefixTree
    anchors: AnchorSet
    anchor_policy: AnchorPolicy
    anchor_window_blocks: int
    """Positions of SWA KV an anchor keeps: the window before a hit at its node."""
    anchor_budget_blocks: int
    """SWA blocks anchors may keep (`anchor_budget_fraction`; all blocks without a cap)."""
    window_local: bool
    """The SWA groups' attention reads a prefill chunk's keys in flight (window-local), so a
    chunk's positions need SWA blocks only where they are read after its step."""

    @property
    @abstractmethod
    def requests(self) -> Mapping[str, RequestBlocks]:
        """The running requests' blocks, by request id (read only)."""

    @abstractmethod
    def match(self, request: CacheRequest, max_tokens: int) -> TreeMatch:
        """The request's prefix in the tree, up to `max_tokens`: the Full hit and the
        window-safe hit (`safe_blocks`). Never mutates anything."""

    @abstractmethod
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
        """Room for `num_new_tokens` more tokens (+ lookahead) of the request, evicting as
        needed; None, changing nothing, if the pools cannot hold them with `headroom` block ids
        left (`whole_request`: nor the whole request).

        A request not running yet is admitted: it adopts a window-safe hit of `hit_tokens` (of
        `match`, or the prefix matched again), taking references on its nodes. With `cache`,
        the positions the new tokens fill are offered to the tree. `external_tokens`: positions
        past the hit that come from another tier (loaded, not computed); they get blocks like
        new tokens and count as computed. `extension`: the host tier's extension of the hit
        that the lookup found (`HostTier.extend`), used while the host tier has not changed
        since (else found again), so an admission asks the store once.
        """

    @abstractmethod
    def touch_prefix(self, request: CacheRequest) -> None:
        """A queued request will come to its prefix: what it would hit now counts as just used
        (the anchor its hit ends at, and its Full path), so eviction spares it for a while.
        Admits, allocates and references nothing."""

    @abstractmethod
    def cache(self, request: CacheRequest, num_tokens: int) -> None:
        """Offer the request's positions filled by its first `num_tokens` tokens to the tree."""

    @abstractmethod
    def release_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Let go of the request's SWA blocks that fell out of its window."""

    @abstractmethod
    def free(self, request: CacheRequest) -> None:
        """A finished or preempted request lets go of every block; the tree keeps what its
        anchors need (anchors are placed where it ended)."""

    @abstractmethod
    def evict(self, num_blocks: int, cause: EvictionCause, evict_held: bool = False) -> bool:
        """Evict cached blocks until `num_blocks` block ids are free; False if nothing
        evictable is left first. The eviction order, the one rule of what goes first:

          1. Full KV past the deepest anchor of its path (no hit can end there), least recently
             used first, and with it an anchor that does not keep its Full KV
             (`AnchorPolicy.keeps_full`);
          2. anchors, each with the Full KV only it made reachable (`AnchorState` order):
             demoted anchors that never served a hit, the latest demoted first; then demoted
             anchors that did; then the others, least worth per block first, aged as anchors
             are evicted or used (GreedyDual over `AnchorPolicy.worth`, its clock the larger of
             inflation and time: `node.AnchorState`); pinned anchors last;
          3. with `evict_held` (for a request that runs alone), held shared anchors.

        Over the anchor cap (`anchor_budget_fraction`, when one is set), anchors go in the order of 2.
        """

    @abstractmethod
    def reset(self) -> bool:
        """Drop every cached block; refused (False) while requests hold blocks."""

    @abstractmethod
    def size_info(self) -> SizeInfo:
        """Where the block ids are now (cheap: no walk over requests or the tree)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert every invariant of pools, tree, anchors and requests (slow; for tests)."""

    @abstractmethod
    def subscribe(self, observer: CacheObserver) -> None:
        """Tell `observer` of every event from now on."""

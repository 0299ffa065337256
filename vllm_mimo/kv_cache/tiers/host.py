"""The host tier (L2): host copies of Full KV and of anchors' SWA windows, indexed per prefix
tree node (`HostSlot`, at `Node.host` while the host holds a copy of that node). This is the
index and the policy; the host memory itself and the copies are the data plane's
(`vllm_mimo.offload`).

Device eviction of an anchor demotes it here instead of dropping it (`demote`): the host takes a
copy of the Full KV of the anchor's path (from the anchor up to the first node the host already
holds) and of the SWA KV of its window only ("mask-only"; eval's `DenseHostTier` keeps every
stored position's SWA KV, the comparison that shows what mask-only buys). A request's hit then
extends past the device's (`extend`); the positions past the device's hit are given blocks
like new tokens and loaded from host (`hold_load`, `plan_load`: vLLM's external computed
tokens); then they enter the tree as computed positions do. Those lookups and loads, and their
rules, are `host_loads.py`'s (`HostLoads`, a part of this class).

The cache calls: `extend` (lookups), `demote` (device anchor eviction), `cached` (positions
cached this step), `take_stores` (once per step), `hold_load` / `plan_load` / `take_load` /
`finish_load` (an admission's host extension), `clear`, `check_integrity`.

The rules of stores and eviction, each written once here:
  * an evicted device anchor is stored unless it is a grid point or a prompt's end demoted
    before it served (`NOT_STORED_WHEN_GIVEN_UP`), or its node was cached in the step being
    scheduled (its KV is not computed yet: `HostStats.uncomputed_stores`);
  * host Full copies form a rooted subtree: a node has one only while its parent has one (a
    store walks up to the first node the host holds; eviction goes leaf first);
  * a host SWA copy is kept while a host anchor's window covers the node (`cover`); one that
    nothing covers goes at the latest with the node's host Full copy;
  * the host evicts the least recently used host anchor first (last stored or hit), with its
    window and the Full copies up its path that no other host anchor or host child needs;
    nodes of a planned load (`hold_load`) and the anchors whose windows cover them are never
    evicted;
  * a store that does not fit once every evictable host anchor is gone is skipped: the anchor
    is dropped, as with no host tier;
  * with an L3 (attached by `attach_l3`; its rules in `vllm_mimo.kv_cache.tiers.l3`): the host
    frees to L3 what it evicts to make room (`L3Tier.put`), but not pages whose store from the
    device is still to be made this step, nor copies dropped by a failed load.

Units: host *pages* of the device's block size in bytes. A position's Full copy takes one page
per Full block id of a position, its SWA copy one page per SWA block id.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from vllm_mimo.kv_cache.node import Anchor, AnchorKind, AnchorState, Blocks, HostAnchor, HostSlot, Node
from vllm_mimo.kv_cache.pools import Pool
from vllm_mimo.kv_cache.prefix_tree import HOST, PrefixTree
from vllm_mimo.kv_cache.tiers.host_copies import Copy, HostStats, LoadPlan, held, host_full, host_swa, slot
from vllm_mimo.kv_cache.tiers.host_loads import HostLoads
from vllm_mimo.kv_cache.tiers.l3 import ANSWER_TTL_S, L3Copy, L3Index, L3Tier

NOT_STORED_WHEN_GIVEN_UP = frozenset({AnchorKind.GRID, AnchorKind.PROMPT_END})
"""Anchor kinds the host does not take from the device once demoted unserved: grid points are
placed everywhere on speculation, a prompt's end is passed by its own output and then serves
only a retry of that prompt, and one the policy gave up on is not worth a window of host memory
(how this was chosen: eval/RESULTS.md, issue 21). Output ends are kept: a next turn that comes
late continues from one."""


class HostTier(HostLoads):
    """Host pages, the host copies of the tree's nodes, and the host anchors' order (see the
    module docstring); its lookups and loads are `HostLoads`'. Its SWA rule is `swa_to_store`, `cover`, `uncover` and
    `check_swa`: what a variant of the tier overrides (eval's `DenseHostTier`)."""

    def __init__(
        self,
        tree: PrefixTree,
        num_pages: int,
        full_pages: int,
        swa_pages: int,
        window_blocks: int,
        block_size: int,
        *,
        back_off: int = 0,
    ) -> None:
        if num_pages < 1 or full_pages < 1 or swa_pages < 1:
            raise ValueError(f"host pages ({num_pages}) and pages per position ({full_pages}, {swa_pages}) must be >= 1")
        self.tree = tree
        self.num_pages = num_pages
        self.full_pages = full_pages
        self.swa_pages = swa_pages
        self.window_blocks = window_blocks
        self.block_size = block_size
        self.back_off = back_off
        self.l3: L3Tier | None = None
        self.stats = HostStats()
        self._free: deque[int] = deque(range(num_pages))
        self._seq = itertools.count()
        self._lru: list[tuple[int, int, HostAnchor]] = []  # (tick, seq, anchor); stale entries skipped
        self._anchors = 0
        self._holds: dict[int, int] = {}  # id(node) -> planned loads holding it
        self._loads: dict[str, LoadPlan] = {}
        self._stores: list[tuple[str, Copy]] = []
        self._store_pages: set[int] = set()  # host pages of `_stores`: not put to L3 before copied
        self._to_l3 = False  # while evicting to make room: freed copies go to L3
        self._scratch: set[int] = set()  # host pages of loads from L3 not finished yet
        # Bumped at every change of what the host holds: an extension found at a lookup holds at
        # the admission that follows while it is unchanged (`HostMatch.generation`).
        self.generation = 0
        # Nodes cached since the last `take_stores` (at schedule time, as vLLM caches blocks):
        # their KV is written by the coming forward, so an anchor on one is not stored yet.
        self._uncomputed: set[int] = set()

    # ------------------------------------------------------------------ sizes

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_anchors(self) -> int:
        return self._anchors

    def usage(self) -> float:
        return self.used_pages / self.num_pages

    # ----------------------------------------------------------------- stores

    def cached(self, nodes: Iterable[Node]) -> None:
        """These nodes were cached in the step being scheduled: not stored before `take_stores`."""
        self._uncomputed.update(id(node) for node in nodes)

    def take_stores(self) -> list[tuple[str, Copy]]:
        """The copies to host that demotions since the last call need ("full" / "swa"). Called
        once per step, when its scheduling is done (the copies run before its forward): the
        positions cached since, computed by that forward, may be stored from then on."""
        stores, self._stores = self._stores, []
        self._uncomputed.clear()
        self._store_pages.clear()
        return stores

    def take_puts(self) -> list[L3Copy]:
        """The copies to L3 that evictions since the last call need (`L3Tier.take_puts`)."""
        return self.l3.take_puts() if self.l3 is not None else []

    def attach_l3(self, index: L3Index, *, answer_ttl_s: float = ANSWER_TTL_S, clock: Any = None) -> None:
        """The shared store behind this tier, from now on (`L3Tier`'s arguments)."""
        extra = {"clock": clock} if clock is not None else {}
        self.l3 = L3Tier(index, self.full_pages, self.swa_pages, self.tree.observers, answer_ttl_s=answer_ttl_s, **extra)

    def detach_l3(self) -> None:
        """No L3 from now on (the store went away): what was put and not copied is dropped."""
        self.l3 = None

    def demote(self, anchor: Anchor, tick: int) -> None:
        """The device evicts `anchor` (its window still attached): stored here unless the
        module docstring's first rule says not."""
        if id(anchor.node) in self._uncomputed:
            self.stats.uncomputed_stores += 1
            return
        if anchor.state is AnchorState.DEMOTED_UNSERVED and anchor.kinds <= NOT_STORED_WHEN_GIVEN_UP:
            return
        stored = self.stats.stored_anchors
        self._stores.extend(self.store(anchor.node, anchor.window, tick))
        if AnchorKind.RESUME in anchor.kinds and self.stats.stored_anchors > stored:
            self.stats.swapped_out_tokens += (anchor.node.depth + 1) * self.block_size

    def store(self, node: Node, window: Sequence[Node], tick: int) -> list[tuple[str, Copy]]:
        """Demote the device anchor at `node` with `window` (its nodes, `node` first) to the host.
        Returns the copies to make, device to host ("full" / "swa", in that order of kinds); none
        if the host held it already or the store was skipped (`stats.skipped_stores`)."""
        if node.host is not None and node.host.anchor is not None:
            self._renew(node.host.anchor, tick)
            return []
        while True:
            path = []
            walk = node
            while walk.depth >= 0 and (walk.host is None or walk.host.full is None):
                path.append(walk)
                walk = walk.parent  # type: ignore[assignment]
            swa = self.swa_to_store(path, window)
            pages = len(path) * self.full_pages + len(swa) * self.swa_pages
            if pages <= len(self._free):
                break
            if not self._make_room():
                self.stats.skipped_stores += 1
                return []
        copies: list[tuple[str, Copy]] = []
        for n in reversed(path):  # top down: each parent holds a copy before its child
            assert n.full_blocks is not None, f"storing {n}: a live anchor's path has no device Full KV"
            pages_full = slot(n).full = self._take(self.full_pages)
            if n.parent is not None and n.parent.depth >= 0:
                held(n.parent).children += 1
            copies.append(("full", Copy(pages_full, n.full_blocks)))
        self.tree.observers.tell_stored(path[::-1], Pool.FULL, HOST)
        for w in swa:
            pages_swa = slot(w).swa = self._take(self.swa_pages)
            copies.append(("swa", Copy(pages_swa, w.swa_blocks or ())))
        self.tree.observers.tell_stored(swa, Pool.SWA, HOST)
        self._store_pages.update(page for _, c in copies for page in c.host)
        self.generation += 1
        anchor = HostAnchor(node, list(window), tick)
        held(node).anchor = anchor
        self.cover(window)
        self._anchors += 1
        heapq.heappush(self._lru, (tick, next(self._seq), anchor))
        self.stats.stored_anchors += 1
        self.stats.stored_full += len(path)
        self.stats.stored_swa += len(swa)
        return copies

    def swa_to_store(self, path: list[Node], window: Sequence[Node]) -> list[Node]:
        """The nodes whose SWA KV a store copies, given the nodes whose Full KV it copies
        (`path`): the window's that the host lacks."""
        return [w for w in window if host_swa(w) is None]

    def cover(self, window: Sequence[Node]) -> None:
        """A new host anchor covers `window`: its SWA copies are kept."""
        for w in window:
            held(w).swa_refs += 1

    def uncover(self, window: Sequence[Node]) -> None:
        """A host anchor that covered `window` is gone: SWA copies nothing keeps are freed."""
        for w in window:
            s = held(w)
            s.swa_refs -= 1
            if s.swa_refs == 0 and s.swa is not None:
                self._release(w, "swa", s.swa)
                s.swa = None
                self._vacate(w)

    def _take(self, count: int) -> Blocks:
        return tuple(self._free.popleft() for _ in range(count))

    def _release(self, node: Node, kind: str, pages: Blocks) -> None:
        """Free a node's host copy of `kind`, to L3 first while making room (module docstring)."""
        self._free.extend(pages)
        self.generation += 1
        if self._to_l3 and self.l3 is not None and not self._store_pages.intersection(pages):
            self.l3.put(node, kind, pages)
        self.tree.observers.tell_removed((node,), Pool.FULL if kind == "full" else Pool.SWA, HOST)

    def _make_room(self) -> bool:
        """Evict the least recently used host anchor nothing holds (to L3, if any); False if
        there is none."""
        victim = self._victim()
        if victim is None:
            return False
        self._to_l3 = True
        try:
            self.evict(victim)
        finally:
            self._to_l3 = False
        return True

    def _renew(self, anchor: HostAnchor, tick: int) -> None:
        anchor.tick = tick
        heapq.heappush(self._lru, (tick, next(self._seq), anchor))

    # ---------------------------------------------------------------- eviction

    def _held(self, node: Node) -> bool:
        return id(node) in self._holds

    def _victim(self) -> HostAnchor | None:
        """The least recently used host anchor none of whose nodes a planned load holds."""
        skipped = []
        victim = None
        while self._lru:
            entry = heapq.heappop(self._lru)
            tick, _, anchor = entry
            if anchor.node.host is None or anchor.node.host.anchor is not anchor or tick != anchor.tick:
                continue  # stale: evicted, or used again since
            if self._held(anchor.node) or any(self._held(w) for w in anchor.window):
                skipped.append(entry)
                continue
            victim = anchor
            break
        for entry in skipped:
            heapq.heappush(self._lru, entry)
        return victim

    def evict(self, anchor: HostAnchor) -> None:
        """Drop a host anchor, its window's SWA copies nothing else keeps, and the Full copies
        up its path that nothing else needs."""
        node = anchor.node
        held(node).anchor = None
        self._anchors -= 1
        self.stats.evicted_anchors += 1
        self.uncover(anchor.window)
        self._prune_up(node)
        for w in anchor.window:
            self._prune(w)

    def _prune_up(self, node: Node) -> None:
        """Free host Full copies from `node` up while no host anchor, host child or load needs
        them (leaf first: the rooted-subtree rule), then drop nodes that hold nothing."""
        while node.depth >= 0 and not self._held(node):
            s = node.host
            if s is None or s.full is None or s.children or s.anchor is not None:
                return
            self._release(node, "full", s.full)
            s.full = None
            if s.swa is not None and not s.swa_refs:  # no host anchor's window keeps it either
                self._release(node, "swa", s.swa)
                s.swa = None
            self._vacate(node)
            parent = node.parent
            if parent is not None and parent.depth >= 0:
                held(parent).children -= 1
            self._prune(node)
            node = parent  # type: ignore[assignment]

    def _vacate(self, node: Node) -> None:
        """Drop the node's slot once it holds no copy (see `HostSlot`)."""
        s = node.host
        if s is not None and s.full is None and s.swa is None:
            node.host = None

    def _prune(self, node: Node) -> None:
        """`PrefixTree.prune` for a node still in the tree (pruning one node can take its
        ancestors with it)."""
        if self.tree.nodes.get(node.block_hash) is node:
            self.tree.prune(node)

    def clear(self) -> None:
        """Drop every host copy (a prefix cache reset)."""
        assert not self._holds, "host tier cleared during a load"
        nodes = list(self.tree.nodes.values())
        for node in nodes:
            node.host = None
        for node in nodes:
            self._prune(node)
        self._free = deque(page for page in range(self.num_pages) if page not in self._scratch)
        self._lru.clear()
        self._anchors = 0
        self._stores.clear()
        if self.l3 is not None:
            self.l3.clear()
        self.generation += 1
        self._store_pages.clear()
        self._uncomputed.clear()

    # -------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        used = len(self._scratch)
        pages: set[int] = set(self._free)
        assert len(pages) == len(self._free), "a host page is free twice"
        assert not pages & self._scratch, "a page of a load from L3 is free"
        pages |= self._scratch
        anchors = 0
        swa_refs: dict[int, int] = {}
        for node in self.tree.nodes.values():
            s = node.host
            if s is not None and s.anchor is not None:
                anchors += 1
                assert s.anchor.node is node, node
                for w in s.anchor.window:
                    swa_refs[id(w)] = swa_refs.get(id(w), 0) + 1
        for node in self.tree.nodes.values():
            s = node.host
            self.check_swa(node, s, swa_refs.get(id(node), 0))
            if s is None:
                continue
            assert s.full is not None or s.swa is not None, f"an empty host slot at {node}"
            parent = node.parent
            if s.full is not None and parent is not None and parent.depth >= 0:
                assert host_full(parent) is not None, f"host Full copy at {node} under a parent without one"
            children = sum(1 for c in node.children.values() if host_full(c) is not None)
            assert s.children == children, (node, children)
            if s.anchor is not None:
                assert s.full is not None, f"host anchor at {node} without its Full copy"
            for ids in (s.full, s.swa):
                for page in ids or ():
                    assert page not in pages, f"host page {page} owned twice (at {node})"
                    pages.add(page)
                    used += 1
        assert used + len(self._free) == self.num_pages, (used, len(self._free), self.num_pages)
        assert anchors == self._anchors, (anchors, self._anchors)
        live = {id(n) for n in self.tree.nodes.values()}
        assert all(key in live for key in self._holds), "a held node left the tree"

    def check_swa(self, node: Node, s: HostSlot | None, covering: int) -> None:
        """The SWA rule at one node (its slot `s`), `covering` host anchors' windows covering it."""
        refs = 0 if s is None else s.swa_refs
        assert refs == covering, (node, covering)
        assert (s is not None and s.swa is not None) == (refs > 0), node

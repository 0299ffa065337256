"""The host tier (L2): host copies of Full KV and of anchors' SWA windows, kept on the prefix
tree's own nodes (`Node.host_full`, `Node.host_swa`). This is the index and the policy; the
host memory itself and the copies are the data plane's (`vllm_mimo.offload`).

Device eviction of an anchor demotes it here instead of dropping it (`store`): the host takes a
copy of the Full KV of the anchor's path (from the anchor up to the first node the host already
holds) and of the SWA KV of its window only ("mask-only"). With `dense`, every stored position's
SWA KV is kept as well: what a tier that stores SWA tails whole would hold, the comparison that
shows what mask-only buys (a replay engine only: the device no longer has the SWA KV of
positions behind a window, so its bytes are counted as if written when computed). A request's
hit then extends past the device's (`extend`): to the deepest position whose Full KV is on
device or host and whose window has SWA KV on device or host. The positions past the device's
hit are given blocks like new tokens and loaded from host (vLLM's external computed tokens);
then they enter the tree as computed positions do.

The rules, each written once here:
  * host Full copies form a rooted subtree: a node has one only while its parent has one (a
    store walks up to the first node the host holds; eviction goes leaf first);
  * a host SWA copy is kept while a host anchor's window covers the node (`dense`: while the
    node's host Full copy is kept);
  * the host evicts the least recently used host anchor first (last stored or hit), with its
    window and the Full copies up its path that no other host anchor or host child needs;
    nodes of a planned load (`hold`) and the anchors whose windows cover them are never
    evicted;
  * a store that does not fit once every evictable host anchor is gone is skipped: the anchor
    is dropped, as with no host tier.

Units: host *pages* of the device's block size in bytes. A position's Full copy takes one page
per Full block id of a position, its SWA copy one page per SWA block id.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_mimo.block_manager.prefix_tree import Blocks, Node, PrefixTree


@dataclass(frozen=True, slots=True)
class Copy:
    """One position's KV of one pool moving between tiers: host pages and device block ids."""

    host: Blocks
    device: Blocks


@dataclass
class HostStats:
    """What the tier did, in positions (multiply by the pages of a position for bytes)."""

    stored_full: int = 0
    stored_swa: int = 0
    loaded_full: int = 0
    loaded_swa: int = 0
    hit_tokens: int = 0
    """Tokens of hits past the device's, loaded from host."""
    stored_anchors: int = 0
    """Anchors demoted to host."""
    skipped_stores: int = 0
    """Anchors dropped because the host could not take them."""
    evicted_anchors: int = 0
    failed_loads: int = 0
    """Loads whose copies failed (`fail_load`): their requests recomputed."""
    uncomputed_stores: int = 0
    """Anchors evicted in the step that cached their node, before its forward computed it:
    dropped, not stored."""
    swapped_out_tokens: int = 0
    """Tokens up to preempted requests' resume anchors demoted to host (preemption as swap)."""
    swapped_in_tokens: int = 0
    """Tokens of preempted requests' hits loaded from host."""


@dataclass(frozen=True)
class HostMatch:
    """A request's hit extended by the host: `path` its nodes from the start (device or host
    Full), `blocks` the hit's positions (>= the device's window-safe hit)."""

    path: list[Node]
    blocks: int


@dataclass
class LoadPlan:
    """The copies an admission with a host extension needs, and the nodes held until they are
    done (`HostTier.finish_load`)."""

    full: list[Copy] = field(default_factory=list)
    swa: list[Copy] = field(default_factory=list)
    held: list[Node] = field(default_factory=list)


class HostAnchor:
    """A demoted anchor: its node and the window of nodes whose host SWA copies it keeps."""

    __slots__ = ("node", "window", "tick")

    def __init__(self, node: Node, window: list[Node], tick: int) -> None:
        self.node = node
        self.window = window
        self.tick = tick

    def __repr__(self) -> str:
        return f"HostAnchor(depth={self.node.depth}, tick={self.tick})"


class HostTier:
    """Host pages, the host copies on the tree's nodes, and the host anchors' order (see the
    module docstring)."""

    def __init__(
        self,
        tree: PrefixTree,
        num_pages: int,
        full_pages: int,
        swa_pages: int,
        window_blocks: int,
        *,
        dense: bool = False,
        back_off: int = 0,
    ) -> None:
        if num_pages < 1 or full_pages < 1 or swa_pages < 1:
            raise ValueError(f"host pages ({num_pages}) and pages per position ({full_pages}, {swa_pages}) must be >= 1")
        self.tree = tree
        self.num_pages = num_pages
        self.full_pages = full_pages
        self.swa_pages = swa_pages
        self.window_blocks = window_blocks
        self.back_off = back_off
        self.dense = dense
        self.stats = HostStats()
        self._free: deque[int] = deque(range(num_pages))
        self._seq = itertools.count()
        self._lru: list[tuple[int, int, HostAnchor]] = []  # (tick, seq, anchor); stale entries skipped
        self._anchors = 0
        self._holds: dict[int, int] = {}  # id(node) -> planned loads holding it

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

    def store(self, node: Node, window: Sequence[Node], tick: int) -> list[tuple[str, Copy]]:
        """Demote the device anchor at `node` with `window` (its nodes, `node` first) to the host.
        Returns the copies to make, device to host ("full" / "swa", in that order of kinds); none
        if the host held it already or the store was skipped (`stats.skipped_stores`)."""
        if node.host_anchor is not None:
            node.host_anchor.tick = tick
            heapq.heappush(self._lru, (tick, next(self._seq), node.host_anchor))
            return []
        while True:
            path = []
            walk = node
            while walk.depth >= 0 and walk.host_full is None:
                path.append(walk)
                walk = walk.parent
            swa = [w for w in window if w.host_swa is None] if not self.dense else [n for n in path if n.host_swa is None]
            pages = len(path) * self.full_pages + len(swa) * self.swa_pages
            if pages <= len(self._free):
                break
            victim = self._victim()
            if victim is None:
                self.stats.skipped_stores += 1
                return []
            self.evict(victim)
        copies: list[tuple[str, Copy]] = []
        for n in reversed(path):  # top down: each parent holds a copy before its child
            assert n.full_blocks is not None, f"storing {n}: a live anchor's path has no device Full KV"
            n.host_full = self._take(self.full_pages)
            if n.parent is not None and n.parent.depth >= 0:
                n.parent.host_children += 1
            copies.append(("full", Copy(n.host_full, n.full_blocks)))
        for w in swa:
            # Dense stores count SWA KV the device no longer has (see the module docstring).
            w.host_swa = self._take(self.swa_pages)
            copies.append(("swa", Copy(w.host_swa, w.swa_blocks or ())))
        anchor = HostAnchor(node, list(window), tick)
        node.host_anchor = anchor
        if not self.dense:
            for w in window:
                w.host_swa_refs += 1
        self._anchors += 1
        heapq.heappush(self._lru, (tick, next(self._seq), anchor))
        self.stats.stored_anchors += 1
        self.stats.stored_full += len(path)
        self.stats.stored_swa += len(swa)
        return copies

    def _take(self, count: int) -> Blocks:
        return tuple(self._free.popleft() for _ in range(count))

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
            if anchor.node.host_anchor is not anchor or tick != anchor.tick:
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
        node.host_anchor = None
        self._anchors -= 1
        self.stats.evicted_anchors += 1
        if not self.dense:
            for w in anchor.window:
                w.host_swa_refs -= 1
                if w.host_swa_refs == 0 and w.host_swa is not None:
                    self._free.extend(w.host_swa)
                    w.host_swa = None
        self._prune_up(node)
        for w in anchor.window:
            self._prune(w)

    def _prune_up(self, node: Node) -> None:
        """Free host Full copies from `node` up while no host anchor, host child or load needs
        them (leaf first: the rooted-subtree rule), then drop nodes that hold nothing."""
        while (
            node.depth >= 0
            and node.host_full is not None
            and node.host_children == 0
            and node.host_anchor is None
            and not self._held(node)
        ):
            self._free.extend(node.host_full)
            node.host_full = None
            if self.dense and node.host_swa is not None:
                self._free.extend(node.host_swa)
                node.host_swa = None
            parent = node.parent
            if parent is not None and parent.depth >= 0:
                parent.host_children -= 1
            self._prune(node)
            node = parent  # type: ignore[assignment]

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
            node.host_full = node.host_swa = node.host_anchor = None
            node.host_children = node.host_swa_refs = 0
        for node in nodes:
            self._prune(node)
        self._free = deque(range(self.num_pages))
        self._lru.clear()
        self._anchors = 0

    # -------------------------------------------------------------- lookups

    def extend(self, keys: Sequence[Any], device_path: Sequence[Node], hit: int, takeover: int, max_blocks: int) -> HostMatch:
        """The hit past the device's window-safe `hit` (positions) that host copies make: the
        deepest end L <= `max_blocks` such that every position in `hit`..L has its Full KV on the
        host or is among the `takeover` unreferenced device positions right after the hit, and
        every position of L's window past `hit` has a host SWA copy (those before `hit` are the
        device hit's own window); with `back_off` (EAGLE/MTP drafting: 1), L is that many
        positions short of such an end, whose window and `back_off` positions more are on host
        (anchor windows are that much longer then), as the device's hits stop a position short
        for the drafter. Does not change anything."""
        path = list(device_path[:max_blocks])
        nodes = self.tree.nodes
        for key in keys[len(path) : max_blocks]:
            node = nodes.get(key)
            if node is None or node.host_full is None:
                break
            path.append(node)
        best = hit
        window = self.window_blocks + self.back_off
        for end in range(hit + 1, len(path) + 1):
            node = path[end - 1]
            if end > hit + takeover and node.host_full is None:
                break
            stop = end - self.back_off
            if stop > hit and all(path[p].host_swa is not None for p in range(max(hit, end - window), end)):
                best = stop
        return HostMatch(path, best)

    # ------------------------------------------------------------------ loads

    def hold(self, nodes: Iterable[Node]) -> list[Node]:
        """Keep these nodes' host copies until `release` (a planned load reads them)."""
        held = list(nodes)
        for node in held:
            self._holds[id(node)] = self._holds.get(id(node), 0) + 1
        return held

    def release(self, nodes: Iterable[Node]) -> None:
        for node in nodes:
            count = self._holds[id(node)] - 1
            if count:
                self._holds[id(node)] = count
            else:
                del self._holds[id(node)]
                if node.host_anchor is None:
                    self._prune_up(node)

    def touch(self, node: Node, tick: int) -> None:
        """A hit ended at the host anchor at `node`: it goes to the back of the order."""
        anchor = node.host_anchor
        if anchor is not None:
            anchor.tick = tick
            heapq.heappush(self._lru, (tick, next(self._seq), anchor))

    def finish_load(self, plan: LoadPlan) -> None:
        """The plan's copies are done: its nodes are no longer held."""
        self.release(plan.held)
        plan.held = []

    def fail_load(self, plan: LoadPlan) -> None:
        """The plan's copies failed: its nodes are released and their host copies dropped,
        with every host anchor at or below them or whose window covers them, so no later
        request is offered the same load."""
        nodes = {id(node) for node in plan.held}
        self.finish_load(plan)
        self.stats.failed_loads += 1
        victims = []
        for node in self.tree.nodes.values():
            anchor = node.host_anchor
            if anchor is None:
                continue
            walk = node
            while walk.depth >= 0 and id(walk) not in nodes:
                walk = walk.parent
            if walk.depth >= 0 or any(id(w) in nodes for w in anchor.window):
                victims.append(anchor)
        for anchor in victims:
            self.evict(anchor)

    # -------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        used = 0
        pages: set[int] = set(self._free)
        assert len(pages) == len(self._free), "a host page is free twice"
        anchors = 0
        swa_refs: dict[int, int] = {}
        for node in self.tree.nodes.values():
            if node.host_anchor is not None:
                anchors += 1
                assert node.host_anchor.node is node, node
                if not self.dense:
                    for w in node.host_anchor.window:
                        swa_refs[id(w)] = swa_refs.get(id(w), 0) + 1
        for node in self.tree.nodes.values():
            parent = node.parent
            if node.host_full is not None and parent is not None and parent.depth >= 0:
                assert parent.host_full is not None, f"host Full copy at {node} under a parent without one"
            children = sum(1 for c in node.children.values() if c.host_full is not None)
            assert node.host_children == children, (node, children)
            if node.host_anchor is not None:
                assert node.host_full is not None, f"host anchor at {node} without its Full copy"
            if self.dense:
                assert (node.host_swa is not None) == (node.host_full is not None), node
            else:
                assert node.host_swa_refs == swa_refs.get(id(node), 0), (node, swa_refs.get(id(node), 0))
                assert (node.host_swa is not None) == (node.host_swa_refs > 0), node
            for ids in (node.host_full, node.host_swa):
                for page in ids or ():
                    assert page not in pages, f"host page {page} owned twice (at {node})"
                    pages.add(page)
                    used += 1
        assert used + len(self._free) == self.num_pages, (used, len(self._free), self.num_pages)
        assert anchors == self._anchors, (anchors, self._anchors)
        live = {id(n) for n in self.tree.nodes.values()}
        assert all(key in live for key in self._holds), "a held node left the tree"

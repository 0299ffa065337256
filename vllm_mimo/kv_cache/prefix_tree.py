"""The dual-index prefix tree: one node per block position, two indexes per node.

A node is one logical sequence position: the block of tokens whose chained hash (vLLM's own
`Request.block_hashes`) is its key, so equal keys mean equal prefixes. It answers two questions
with two fields: where this position's Full KV is (`full_blocks`, the block ids of every Full
group) and where its SWA KV is (`swa_blocks`, likewise for the SWA groups, or None when the
window has moved on). The host tier keeps its copies of the node in a slot of its own
(`host`, a `node.HostSlot` while the host holds a copy); the tree's shape does not change,
and a node holding only host copies stays in the tree.

Reference counts live on nodes, not blocks: `full_refs` / `swa_refs` count the running requests
holding this node's Full / SWA blocks, `anchor_refs` the anchors whose window covers the node
(from an anchor's creation to `Anchor.uncover`). An unreferenced SWA block stays only while some
anchor covers it. Running requests' references change only through the tree's methods, which
keep the two totals the cache's size is derived from: `unreferenced_full` and `retained_swa`
nodes.

Every change of a node's Full or SWA KV between held and not held is told to the cache's
observers where it happens (`KVListener`, the cache's `contract.Observers`: KV cache events
follow the nodes exactly).

Matching never mutates. Full KV past the deepest anchor of its path can never end a hit (a hit
needs the SWA window before it): such unreferenced, unanchored leaves are the tree's Full
eviction candidates, least recently used first (`pop_full_victim`). So is a leaf whose anchor
does not keep its Full KV (`Anchor.keeps_full`): the anchor goes with it (`evict_full`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_mimo.kv_cache.node import Anchor, Blocks, Node
from vllm_mimo.kv_cache.pools import Pool

DEVICE = "GPU"
"""The medium of device blocks in KV cache events: what vLLM's own manager reports for them on
every platform (`vllm.distributed.kv_events.MEDIUM_GPU`)."""
HOST = "CPU"
"""The medium of the host tier's copies in KV cache events: what vLLM's CPU offloading reports
(`MEDIUM_CPU`)."""
L3 = "L3"
"""The medium of pages the host tier put to the shared L3 store: stored events only. The store
evicts on its own and tells no one, so no removal is published: a router reads L3 events as
hints (the engine asks the store itself at each lookup)."""

class KVListener(Protocol):
    """Who is told, where it happens, that nodes now hold (`tell_stored`) or no longer hold
    (`tell_removed`) their KV of `pool` on `medium` (the cache's `contract.Observers`)."""

    def tell_stored(self, nodes: Sequence[Node], pool: Pool, medium: str) -> None: ...

    def tell_removed(self, nodes: Sequence[Node], pool: Pool, medium: str) -> None: ...


class _NoListener:
    """A tree nobody listens to (a tree built alone, in tests)."""

    def tell_stored(self, nodes: Sequence[Node], pool: Pool, medium: str) -> None:
        pass

    def tell_removed(self, nodes: Sequence[Node], pool: Pool, medium: str) -> None:
        pass


@dataclass
class TreeMatch:
    """What the tree holds for a request's prefix, in positions."""

    path: list[Node]
    """Nodes with resident Full KV from the start: the Full hit."""
    safe_blocks: int
    """Longest prefix of `path` whose preceding window has SWA KV: the real hit."""

    @property
    def full_hit(self) -> int:
        """Positions of the Full hit: `len(path)`."""
        return len(self.path)

    @property
    def pseudo_blocks(self) -> int:
        """Positions the Full layers had cached but that must be recomputed for want of SWA KV."""
        return len(self.path) - self.safe_blocks

    @property
    def limiting_node(self) -> Node | None:
        """The first node past the real hit, when the Full hit went further."""
        return self.path[self.safe_blocks] if self.safe_blocks < len(self.path) else None

    def holds(self, hit: int, window_blocks: int) -> bool:
        """Whether every node still has its Full KV and a hit of `hit` positions is still
        window-safe (the tree may have changed since the match)."""
        path = self.path
        return (
            len(path) >= hit
            and all(node.full_blocks is not None for node in path)
            and window_safe_blocks(path[:hit], window_blocks) == hit
        )

    def takeover(self, hit: int) -> int:
        """Pseudo-hit nodes right after a hit of `hit` positions that no running request
        references."""
        count = 0
        for node in self.path[hit:]:
            if node.full_refs:
                break
            count += 1
        return count

    def unreferenced(self, hit: int, window_blocks: int) -> tuple[int, int]:
        """Nodes a request admitted with a hit of `hit` positions would take out of the
        evictable sets: Full nodes of the path no request references, and SWA nodes of the
        window before the hit only anchors keep."""
        path = self.path
        full = sum(1 for node in path if node.full_refs == 0)
        swa = sum(1 for node in path[max(0, hit - window_blocks) : hit] if node.swa_refs == 0)
        return full, swa


def window_safe_blocks(path: list[Node], window_blocks: int) -> int:
    """Largest L <= len(path) such that path[L - window_blocks : L] all hold SWA blocks."""
    end = len(path)
    k = end - 1
    while end > 0:
        low = max(0, end - window_blocks)
        while k >= low and path[k].swa_blocks is not None:
            k -= 1
        if k < low:
            return end
        end = k  # every candidate whose window includes node k fails
        k = end - 1
    return 0


def position_hashes(block_hashes: Sequence[Any], stride: int, positions: int) -> Sequence[Any]:
    """The node keys of the first `positions` positions (or fewer, as far as hashed).

    A position is `stride` hash blocks; vLLM chains the hashes, so the hash of a position's last
    hash block names the whole prefix up to the position's end. Only as many as asked are
    copied: this runs per lookup."""
    if stride == 1:
        return block_hashes
    return block_hashes[stride - 1 : positions * stride : stride]


class PrefixTree:
    """Nodes by chained block hash, their reference counts, and the Full eviction order."""

    def __init__(self, observers: KVListener | None = None) -> None:
        self.observers: KVListener = observers or _NoListener()
        """Told of every node's KV stored or removed (the cache's, shared with its host tier)."""
        self.root = Node(None, None, -1)
        self.nodes: dict[Any, Node] = {}
        self.unreferenced_full = 0
        """Nodes with Full blocks that no running request references (all evictable)."""
        self.retained_swa = 0
        """Nodes with SWA blocks that no running request references (kept by anchors)."""
        self._seq = itertools.count()
        # Unanchored unreferenced Full leaves: (last_access, seq, node); entries go stale and
        # are checked when popped.
        self._garbage: list[tuple[int, int, Node]] = []

    def match(self, keys: Sequence[Any], max_blocks: int, window_blocks: int) -> TreeMatch:
        """The Full and window-safe hit for a prefix; does not change the tree."""
        path: list[Node] = []
        nodes = self.nodes
        for key in keys[:max_blocks]:
            node = nodes.get(key)
            if node is None or node.full_blocks is None:
                break
            path.append(node)
        return TreeMatch(path, window_safe_blocks(path, window_blocks))

    def child(self, parent: Node, block_hash: Any) -> Node:
        """The node for `block_hash` under `parent`, created if missing."""
        node = self.nodes.get(block_hash)
        if node is None:
            node = Node(block_hash, parent, parent.depth + 1)
            parent.children[block_hash] = node
            self.nodes[block_hash] = node
        return node

    # ------------------------------------------------------- running requests

    def add_positions(
        self,
        path: list[Node],
        keys: Sequence[Any],
        full: Sequence[Blocks],
        swa: Sequence[Blocks | None],
        start: int,
        tick: int,
    ) -> tuple[list[int], list[Node]]:
        """A running request's positions `start` to `start + len(keys)` enter the tree: its
        `path` grows by a node per key past its end, each referenced, and the nodes of those
        positions without SWA KV take the request's SWA blocks there (`swa`, by position).

        A position new to the tree (or whose Full KV was evicted) takes the request's Full
        blocks `full[position]`; one the tree already holds is referenced, and the request's
        own blocks stay private to it. Returns the positions whose parent has just become a
        branch point (its second child), and the anchored nodes nobody referenced before."""
        branched: list[int] = []
        root = self.root
        end = start + len(keys)
        first_new = len(path)
        parent = path[-1] if path else root
        for key in keys[first_new - start :]:
            pos = len(path)
            siblings = len(parent.children)
            node = self.child(parent, key)
            if siblings == 1 and len(parent.children) == 2 and parent is not root:
                branched.append(pos)
            if node.full_blocks is None:
                self.set_full(node, full[pos])
                self.unreferenced_full += 1  # until the reference below
            path.append(node)
            parent = node
        anchored = self.ref_full(path[first_new:], tick)
        self.share_swa(path, swa, start, end)
        return branched, anchored

    def share_swa(self, path: Sequence[Node], swa: Sequence[Blocks | None], start: int, end: int) -> None:
        """The nodes of positions `start` to `end` of a running request's `path` without SWA KV
        take its SWA blocks there (`swa`, by position), which it references from then on. A
        request keeps its own copy where another request's was shared; once that other request
        lets go of it, this one's copy is the node's (an anchor there needs it)."""
        shared = []
        for pos in range(start, min(end, len(swa))):
            ids = swa[pos]
            node = path[pos]
            if ids is not None and node.swa_blocks is None:
                node.swa_blocks = ids
                node.swa_refs += 1
                shared.append(node)
        if shared:
            self.observers.tell_stored(shared, Pool.SWA, DEVICE)

    def branch_points(self, path: Sequence[Node], keys: Sequence[Any], start: int) -> list[int]:
        """The positions `add_positions(path, keys, ..., start, ...)` would return as branched,
        without changing the tree: at most one, where the keys first leave the tree below a
        node that has one child (past that, every node is new and has none)."""
        parent = path[-1] if path else self.root
        for offset, key in enumerate(keys[len(path) - start :]):
            node = self.nodes.get(key)
            if node is None:
                return [len(path) + offset] if len(parent.children) == 1 and parent is not self.root else []
            parent = node
        return []

    def adopt(self, path: list[Node], hit: int, window_blocks: int, tick: int) -> tuple[list[Blocks | None], list[Node]]:
        """A request admitted with a hit of `hit` positions references every node of `path`
        (the hit and any pseudo hit) and the SWA blocks of the window before the hit. Returns
        the SWA blocks per position up to the hit (None before the window) and the anchored
        nodes nobody referenced before."""
        anchored = self.ref_full(path, tick)
        start = max(0, hit - window_blocks)
        return [None] * start + self.ref_swa(path[start:hit]), anchored

    def ref_full(self, nodes: Iterable[Node], tick: int) -> list[Node]:
        """A running request references these nodes' Full blocks (and uses them at `tick`).
        Returns the anchored nodes nobody referenced before."""
        anchored = []
        for node in nodes:
            if node.full_refs == 0:
                self.unreferenced_full -= 1
                if node.anchor is not None:
                    anchored.append(node)
            node.full_refs += 1
            node.last_access = tick
        return anchored

    def touch(self, nodes: Iterable[Node], tick: int) -> None:
        """These nodes are used at `tick` without a reference (a queued request will come to
        them): later in the Full eviction order."""
        for node in nodes:
            node.last_access = tick
            self.offer_full_victim(node)

    def unref_full(self, nodes: Iterable[Node]) -> list[Node]:
        """A running request lets go of these nodes (give them leaf first). Returns the anchored
        nodes nobody references any more."""
        anchored = []
        for node in nodes:
            node.full_refs -= 1
            if node.full_refs == 0:
                self.unreferenced_full += 1
                if node.anchor is not None:
                    anchored.append(node)
                self.offer_full_victim(node)
        return anchored

    def ref_swa(self, nodes: Iterable[Node]) -> list[Blocks | None]:
        """A running request references these nodes' SWA blocks; returns them."""
        out = []
        for node in nodes:
            if node.swa_refs == 0:
                self.retained_swa -= 1
            node.swa_refs += 1
            out.append(node.swa_blocks)
        return out

    def unref_swa(self, node: Node) -> Blocks | None:
        """A running request lets go of the node's SWA blocks; returns them if nothing keeps
        them any more (then they are the caller's to free)."""
        node.swa_refs -= 1
        if node.swa_refs:
            return None
        if node.anchor_refs:
            self.retained_swa += 1
            return None
        blocks, node.swa_blocks = node.swa_blocks, None
        self.observers.tell_removed((node,), Pool.SWA, DEVICE)
        self.prune(node)
        return blocks

    # ----------------------------------------------------------------- anchors

    def drop_window(self, node: Node, window: list[Node]) -> list[Blocks]:
        """An anchor that ended at `node` and covered `window` is gone (`Anchor.uncover`);
        returns the SWA blocks nothing keeps any more (the caller's to free). The Full KV past
        the previous anchor on its path is no longer reachable by a hit: the node becomes a
        Full eviction candidate."""
        freed, cleared = [], []
        for covered in window:
            if covered.anchor_refs == 0 and covered.swa_refs == 0 and covered.swa_blocks is not None:
                self.retained_swa -= 1
                freed.append(covered.swa_blocks)
                covered.swa_blocks = None
                cleared.append(covered)
        if cleared:
            self.observers.tell_removed(cleared, Pool.SWA, DEVICE)
        for covered in window:
            self.prune(covered)
        self.offer_full_victim(node)
        return freed

    # ---------------------------------------------------------------- eviction

    def withdraw_swa(self, node: Node, other: Blocks | None) -> None:
        """The one request referencing the node's SWA blocks takes them back (they were never
        computed): `other`, another running request's own copy of the position, replaces them
        with that request's reference; None leaves the node without SWA KV."""
        if other is None:
            assert node.swa_refs == 1 and not node.anchor_refs, node
            node.swa_refs = 0
        node.swa_blocks = other
        if other is None:
            self.observers.tell_removed((node,), Pool.SWA, DEVICE)

    def withdraw_full(self, node: Node, other: Blocks | None) -> None:
        """A request takes back the node's Full blocks it gave (never computed), with its
        reference: `other`, another running request's own copy, replaces them; None removes
        the node (it is a leaf only that request references)."""
        if other is None:
            assert node.full_refs == 1 and not node.full_children, node
            node.full_refs = 0
            self.set_full(node, None)
            self.prune(node)
            return
        self.set_full(node, other)
        node.full_refs -= 1

    def set_full(self, node: Node, blocks: Blocks | None) -> None:
        """Set or clear the node's Full blocks, keeping the parent's child count."""
        was = node.full_blocks is not None
        node.full_blocks = blocks
        now = blocks is not None
        if was != now and node.parent is not None:
            node.parent.full_children += 1 if now else -1
            if not now:
                self.offer_full_victim(node.parent)
        if was != now:
            (self.observers.tell_stored if now else self.observers.tell_removed)((node,), Pool.FULL, DEVICE)

    def _is_garbage(self, node: Node) -> bool:
        return (
            node.full_blocks is not None
            and node.full_refs == 0
            and node.full_children == 0
            and (node.anchor is None or not node.anchor.keeps_full)
            and node is not self.root
        )

    def offer_full_victim(self, node: Node) -> None:
        """Queue `node` for Full eviction if it is an unreferenced Full leaf, unanchored or
        whose anchor does not keep its Full KV."""
        if self._is_garbage(node):
            heapq.heappush(self._garbage, (node.last_access, next(self._seq), node))
            if len(self._garbage) > 2 * len(self.nodes) + 64:
                # Entries go stale as nodes are reused or pruned; drop them now and then.
                live = {id(n): (n.last_access, seq, n) for _, seq, n in self._garbage if self._is_garbage(n)}
                self._garbage = list(live.values())
                heapq.heapify(self._garbage)

    def pop_full_victim(self) -> Node | None:
        """The least recently used Full eviction candidate (`offer_full_victim`), if any."""
        while self._garbage:
            access, _, node = heapq.heappop(self._garbage)
            if self._is_garbage(node) and access == node.last_access and self.nodes.get(node.block_hash) is node:
                return node
        return None

    def evict_full(self, positions: int, drop_anchor: Callable[[Anchor], None]) -> list[Blocks]:
        """Drop the Full KV of the least recently used Full eviction candidate, up to
        `positions` times (a leaf's parent may be the next), its anchor first if it has one
        (`drop_anchor` evicts it); returns the blocks dropped (the caller's to free), fewer
        positions' if no candidate is left."""
        dropped: list[Blocks] = []
        while len(dropped) < positions:
            node = self.pop_full_victim()
            if node is None:
                break
            if node.anchor is not None:
                drop_anchor(node.anchor)
            dropped.append(node.full_blocks)  # type: ignore[arg-type]
            self.unreferenced_full -= 1
            self.set_full(node, None)
            self.prune(node)
        return dropped

    def prune(self, node: Node) -> None:
        """Remove `node` and then its ancestors while they hold nothing and have no children."""
        while (
            node is not self.root
            and not node.children
            and node.full_blocks is None
            and node.swa_blocks is None
            and node.anchor is None
            and node.anchor_refs == 0
            and node.host is None
        ):
            parent = node.parent
            del parent.children[node.block_hash]  # type: ignore[union-attr]
            del self.nodes[node.block_hash]
            node = parent  # type: ignore[assignment]

    def clear(self) -> None:
        self.root.children.clear()
        self.nodes.clear()
        self._garbage.clear()
        self.unreferenced_full = self.retained_swa = 0

    def check_integrity(self) -> None:
        unreferenced = retained = 0
        for key, node in self.nodes.items():
            assert node.block_hash == key
            assert node.parent is not None and node.parent.children.get(key) is node, node
            assert node.depth == node.parent.depth + 1, node
            assert node.full_refs >= 0 and node.swa_refs >= 0 and node.anchor_refs >= 0, node
            assert node.full_refs == 0 or node.full_blocks is not None, node
            assert node.swa_refs == 0 or node.swa_blocks is not None, node
            expected = sum(1 for c in node.children.values() if c.full_blocks is not None)
            assert node.full_children == expected, (node, expected)
            if node.full_blocks is not None and node.parent is not self.root:
                # Chained hashes: a resident Full block is reachable only through resident
                # ancestors; the tree never strands one (eviction is leaf-first).
                assert node.parent.full_blocks is not None, f"stranded Full block at {node}"
            if node.swa_blocks is not None and node.swa_refs == 0:
                assert node.anchor_refs > 0, f"unreferenced SWA blocks with no anchor at {node}"
            unreferenced += node.full_blocks is not None and node.full_refs == 0
            retained += node.swa_blocks is not None and node.swa_refs == 0
        assert unreferenced == self.unreferenced_full, (unreferenced, self.unreferenced_full)
        assert retained == self.retained_swa, (retained, self.retained_swa)
        assert sum(1 for _ in self._walk()) == len(self.nodes)

    def _walk(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

"""The dual-index prefix tree: one node per full block of tokens, two indexes per node.

A node is one logical sequence position: the block of tokens whose chained hash (vLLM's own
`Request.block_hashes`) is its key, so equal keys mean equal prefixes. It answers two questions
with two fields: where this block's Full KV is (`full_blocks`, one block id per Full group) and
where its SWA KV is (`swa_blocks`, one block id per SWA group, or None when the window has moved
on). Another tier (host memory, a shared store) adds its own pair of location fields to the same
node; the tree's shape does not change.

Reference counts live on nodes, not blocks: `full_refs` / `swa_refs` count the running requests
holding this node's Full / SWA blocks. `anchor_refs` counts the anchors whose window covers the
node; an unreferenced SWA block stays only while some anchor covers it.

Matching never mutates. A hit can only end where SWA KV is kept, at an anchor (or inside a
running request's window), so Full KV past the deepest anchor of its path can never be hit:
such unanchored leaves are evicted first, least recently used first. Everything else goes
with its anchor (see `anchors.py`): dropping an anchor turns the Full blocks past the previous
anchor on its path into unanchored leaves.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Any


class Node:
    """One block of tokens in the tree (see the module docstring)."""

    __slots__ = (
        "block_hash",
        "parent",
        "depth",
        "children",
        "full_blocks",
        "swa_blocks",
        "full_refs",
        "swa_refs",
        "full_children",
        "anchor_refs",
        "anchor",
        "last_access",
        "hit_count",
    )

    def __init__(self, block_hash: Any, parent: "Node | None", depth: int) -> None:
        self.block_hash = block_hash
        self.parent = parent
        self.depth = depth  # block index in the sequence; the root is -1
        self.children: dict[Any, Node] = {}
        self.full_blocks: tuple[int, ...] | None = None
        self.swa_blocks: tuple[int, ...] | None = None
        self.full_refs = 0
        self.swa_refs = 0
        self.full_children = 0  # children whose full_blocks are resident
        self.anchor_refs = 0
        self.anchor: Any = None  # the Anchor ending at this node, if any
        self.last_access = 0.0
        self.hit_count = 0  # distinct requests that reused this node

    def __repr__(self) -> str:
        return (
            f"Node(depth={self.depth}, full={self.full_blocks}, swa={self.swa_blocks}, "
            f"refs={self.full_refs}/{self.swa_refs}, anchor_refs={self.anchor_refs})"
        )


@dataclass
class TreeMatch:
    """What the tree holds for a request's prefix, in blocks."""

    path: list[Node]
    """Nodes with resident Full KV from the start: the Full hit."""
    safe_blocks: int
    """Longest prefix of `path` whose preceding window has SWA KV: the real hit."""

    @property
    def full_blocks(self) -> int:
        return len(self.path)

    @property
    def pseudo_blocks(self) -> int:
        """Blocks the Full layers had cached but that must be recomputed for want of SWA KV."""
        return len(self.path) - self.safe_blocks

    @property
    def limiting_node(self) -> Node | None:
        """The first node past the real hit, when the Full hit went further."""
        return self.path[self.safe_blocks] if self.safe_blocks < len(self.path) else None


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


class PrefixTree:
    """Nodes by chained block hash, plus the Full eviction order."""

    def __init__(self) -> None:
        self.root = Node(None, None, -1)
        self.nodes: dict[Any, Node] = {}
        self._seq = itertools.count()
        # Unanchored unreferenced Full leaves: (last_access, seq, node); entries go stale and
        # are checked when popped.
        self._garbage: list[tuple[float, int, Node]] = []

    def match(self, block_hashes: list[Any], max_blocks: int, window_blocks: int) -> TreeMatch:
        """The Full and window-safe hit for a prefix; does not change the tree."""
        path: list[Node] = []
        nodes = self.nodes
        for block_hash in block_hashes[:max_blocks]:
            node = nodes.get(block_hash)
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

    def window(self, node: Node, window_blocks: int) -> list[Node]:
        """`node` and the ancestors whose SWA KV a hit ending at `node` needs."""
        out = []
        while node is not self.root and len(out) < window_blocks:
            out.append(node)
            node = node.parent
        return out

    def set_full(self, node: Node, blocks: tuple[int, ...] | None) -> None:
        """Set or clear the node's Full blocks, keeping the parent's child count."""
        was = node.full_blocks is not None
        node.full_blocks = blocks
        now = blocks is not None
        if was != now and node.parent is not None:
            node.parent.full_children += 1 if now else -1
            if not now:
                self.offer_full_victim(node.parent)

    def _is_garbage(self, node: Node) -> bool:
        return (
            node.full_blocks is not None
            and node.full_refs == 0
            and node.full_children == 0
            and node.anchor is None
            and node is not self.root
        )

    def offer_full_victim(self, node: Node) -> None:
        """Queue `node` for Full eviction if it is an unreferenced, unanchored Full leaf."""
        if self._is_garbage(node):
            heapq.heappush(self._garbage, (node.last_access, next(self._seq), node))
            if len(self._garbage) > 2 * len(self.nodes) + 64:
                # Entries go stale as nodes are reused or pruned; drop them now and then.
                live = {id(n): (n.last_access, seq, n) for _, seq, n in self._garbage if self._is_garbage(n)}
                self._garbage = list(live.values())
                heapq.heapify(self._garbage)

    def pop_full_victim(self) -> Node | None:
        """The least recently used unreferenced, unanchored Full leaf, if any."""
        while self._garbage:
            access, _, node = heapq.heappop(self._garbage)
            if self._is_garbage(node) and access == node.last_access and self.nodes.get(node.block_hash) is node:
                return node
        return None

    def prune(self, node: Node) -> None:
        """Remove `node` and then its ancestors while they hold nothing and have no children."""
        while (
            node is not self.root
            and not node.children
            and node.full_blocks is None
            and node.swa_blocks is None
            and node.anchor is None
            and node.anchor_refs == 0
        ):
            parent = node.parent
            del parent.children[node.block_hash]
            del self.nodes[node.block_hash]
            node = parent

    def clear(self) -> None:
        self.root.children.clear()
        self.nodes.clear()
        self._garbage.clear()

    def check_integrity(self) -> None:
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
        assert sum(1 for _ in self._walk()) == len(self.nodes)

    def _walk(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

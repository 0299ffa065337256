"""Preemption within a step, for `HybridKVCache` (`cache.py`): a request preempted in the step
that scheduled it takes out of the tree what its forward never computed (`withdraw_uncomputed`),
through the tree's own methods (`PrefixTree.withdraw_swa` / `withdraw_full`, which own the
reference counts); and how an anchor is dropped with its window.
"""

from __future__ import annotations

from vllm_mimo.kv_cache.contract import CacheRequest, RequestBlocks
from vllm_mimo.kv_cache.node import Anchor, Blocks, Node
from vllm_mimo.kv_cache.pools import Pool
from vllm_mimo.kv_cache.state import CacheState


class Preemption(CacheState):
    """`HybridKVCache`'s preemption rollback (see the module docstring)."""

    def withdraw_uncomputed(self, request: CacheRequest, state: RequestBlocks) -> None:
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
                tree.withdraw_swa(node, other)
            if pos < state.num_cached and pos >= state.adopted_full and node.full_blocks is full[pos]:
                other = self._own_copy(pos, node, Pool.FULL)
                if other is None and node.anchor is not None:
                    self._drop_anchor(node.anchor)
                tree.withdraw_full(node, other)
                continue
            self.anchors.release_nodes(tree.unref_full([node]))
        for pos in range(computed, len(full)):
            if pos >= len(nodes) or nodes[pos].full_blocks is not full[pos]:
                self.pools.give_back(full[pos])
        for pos in range(max(computed, state.swa_start), len(swa)):
            if swa[pos] is not None:
                self.pools.give_back(swa[pos])  # type: ignore[arg-type]
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

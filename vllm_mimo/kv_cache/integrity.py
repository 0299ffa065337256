"""The invariants of `HybridKVCache` (`cache.py`), checked all at once (`check_integrity`: slow,
for tests and the soak's idle checks): pools, tree, host tier, anchors and the anchor policy, and
every running request's blocks and references.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from vllm_mimo.kv_cache.pools import Pool
from vllm_mimo.kv_cache.state import CacheState


class Integrity(CacheState):
    """`HybridKVCache`'s invariant checks (see the module docstring)."""

    def check_integrity(self) -> None:
        self.pools.check_integrity()
        self.tree.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
        self.anchors.check_integrity()
        self.anchor_policy.check_integrity(list(self._requests))
        pools = self.pools
        owner: dict[int, str] = {}

        def own(ids: Iterable[int], who: str, pool: Pool) -> None:
            for block_id in ids:
                assert block_id != 0, f"{who} holds the null block"
                assert block_id not in owner, f"block {block_id} owned by {owner[block_id]} and {who}"
                assert pools.owner(block_id) == pool, f"{who} holds block {block_id} of the other pool"
                owner[block_id] = who

        full_refs, swa_refs = self._check_requests(own)
        anchor_refs: dict[int, int] = {}
        for anchor in self.anchors:
            assert anchor.node.anchor is anchor
            for node in anchor.window:
                anchor_refs[id(node)] = anchor_refs.get(id(node), 0) + 1
                assert node.swa_blocks is not None, f"{anchor} covers {node}, which has no SWA KV"
        for node in self.tree.nodes.values():
            assert node.full_refs == full_refs.get(id(node), 0), (node, full_refs.get(id(node), 0))
            assert node.swa_refs == swa_refs.get(id(node), 0), (node, swa_refs.get(id(node), 0))
            assert node.anchor_refs == anchor_refs.get(id(node), 0), node
            if node.full_blocks is not None:
                own(node.full_blocks, f"node {node.depth} full", Pool.FULL)
            if node.swa_blocks is not None:
                own(node.swa_blocks, f"node {node.depth} swa", Pool.SWA)
        # Over the budget only while every anchor left is one the budget may not evict (held).
        retained = self.tree.retained_swa * self._n_swa
        assert retained <= self.anchor_budget_blocks or self.anchors.victim() is None, "anchor budget exceeded"
        assert len(owner) == pools.used[0] + pools.used[1], (len(owner), pools.used)

    def _check_requests(self, own: Callable[[Iterable[int], str, Pool], None]) -> tuple[dict[int, int], dict[int, int]]:
        """The running requests' invariants; their blocks go to `own` (those not the tree's).
        Returns the Full and SWA references they hold, by node id."""
        full_refs: dict[int, int] = {}
        swa_refs: dict[int, int] = {}
        for rid, state in self._requests.items():
            for node in state.nodes:
                full_refs[id(node)] = full_refs.get(id(node), 0) + 1
            for pos, ids in enumerate(state.full):
                node = state.nodes[pos] if pos < len(state.nodes) else None  # type: ignore[assignment]
                if node is None or node.full_blocks is not ids:
                    own(ids, f"request {rid} full@{pos}", Pool.FULL)
            live = 0
            for pos, ids in enumerate(state.swa):  # type: ignore[assignment]
                if ids is None:
                    assert self.window_local or pos < state.swa_start or pos >= len(state.full), (rid, pos)
                    continue
                live += 1
                assert pos >= state.swa_start, (rid, pos)
                node = state.nodes[pos] if pos < len(state.nodes) else None  # type: ignore[assignment]
                if node is not None and node.swa_blocks is ids:
                    swa_refs[id(node)] = swa_refs.get(id(node), 0) + 1
                else:
                    own(ids, f"request {rid} swa@{pos}", Pool.SWA)
            bound = self.anchor_window_blocks + 1 + state.step_blocks + state.lookahead_blocks
            assert live <= bound, f"request {rid} holds {live} SWA positions, bound {bound}"
            for i, node in enumerate(state.nodes):
                assert node.depth == i, (rid, i, node)
        return full_refs, swa_refs

"""Unit tests of the hybrid KV manager's pieces: pools, prefix tree, anchors, and the manager."""

from __future__ import annotations

import pytest

from types import SimpleNamespace

from tests.kv_helpers import BLOCK, kv_config, make_request
from vllm_mimo.block_manager.adapter import HybridKVCacheManager
from vllm_mimo.block_manager.anchors import PRIOR_REUSE_GAP, Anchor, AnchorKind, AnchorSet, AnchorState
from vllm_mimo.block_manager.base import ANCHOR_BUDGET, CacheObserver
from vllm_mimo.block_manager.geometry import KVGeometry, UnsupportedKVLayout
from vllm_mimo.block_manager.placement import AnchorHintError, AnchorPlacement, declared_anchors
from vllm_mimo.block_manager.pools import BlockPools, Pool
from vllm_mimo.block_manager.prefix_tree import Node, PrefixTree, window_safe_blocks
from vllm_mimo.compat import RequestStatus
from vllm_mimo.config import MimoConfig, MimoConfigError
from vllm_mimo.engine.step_budget import StepBudget

# ------------------------------------------------------------------------ pools


def test_pools_split_the_ids_and_keep_the_null_block_out():
    pools = BlockPools(num_blocks=10, swa_blocks=3)
    assert pools.home_size == (3, 6)
    swa = pools.take_many(Pool.SWA, 3)
    full = pools.take_many(Pool.FULL, 6)
    assert sorted(swa) == [1, 2, 3] and sorted(full) == [4, 5, 6, 7, 8, 9]
    assert pools.borrowed == [0, 0]
    pools.check_integrity()


def test_an_empty_pool_borrows_the_free_block_nearest_the_boundary_and_it_goes_home():
    pools = BlockPools(num_blocks=10, swa_blocks=3)
    own = pools.take_many(Pool.SWA, 3)
    borrowed = pools.take_many(Pool.SWA, 1)
    assert borrowed == [4] and pools.owner(4) == Pool.SWA and pools.borrowed[Pool.SWA] == 1
    pools.give_back(borrowed + own)
    assert pools.owner(4) == Pool.FULL and pools.num_free(Pool.FULL) == 6 and pools.used == [0, 0]
    with pytest.raises(RuntimeError, match="10 blocks asked of the SWA pool, 9 free"):
        pools.take_many(Pool.SWA, 10)
    pools.check_integrity()


def test_a_pool_split_must_leave_both_pools_a_block():
    with pytest.raises(ValueError, match="between 1 and 8"):
        BlockPools(num_blocks=10, swa_blocks=9)


# ------------------------------------------------------------------------ tree


def _chain(tree: PrefixTree, n: int, swa: set[int] | None = None, prefix: str = "h") -> list[Node]:
    nodes, parent = [], tree.root
    for i in range(n):
        node = tree.child(parent, f"{prefix}{i}")
        tree.set_full(node, (100 + i,))
        if swa is None or i in swa:
            node.swa_blocks = (200 + i,)
        nodes.append(node)
        parent = node
    return nodes


def test_window_safe_length_needs_the_window_before_it():
    tree = PrefixTree()
    path = _chain(tree, 6, swa={0, 1, 3, 4})
    # window of 2 blocks: a hit of L blocks needs SWA on nodes L-2, L-1
    assert window_safe_blocks(path, 2) == 5
    assert window_safe_blocks(path[:4], 2) == 2
    assert window_safe_blocks(path[:3], 2) == 2
    assert window_safe_blocks(path, 0) == 6


def test_match_returns_full_and_window_safe_lengths_without_mutating():
    tree = PrefixTree()
    _chain(tree, 6, swa={4, 5})
    before = [(n.full_refs, n.swa_refs, n.last_access) for n in tree.nodes.values()]
    match = tree.match([f"h{i}" for i in range(8)], max_blocks=10, window_blocks=2)
    assert match.full_blocks == 6 and match.safe_blocks == 6 and match.pseudo_blocks == 0
    match = tree.match([f"h{i}" for i in range(8)], max_blocks=5, window_blocks=2)
    assert match.full_blocks == 5 and match.safe_blocks == 0
    assert match.limiting_node is match.path[0]
    assert before == [(n.full_refs, n.swa_refs, n.last_access) for n in tree.nodes.values()]


def test_match_stops_at_the_first_block_without_full_kv():
    tree = PrefixTree()
    nodes = _chain(tree, 4)
    tree.set_full(nodes[3], None)
    assert tree.match(["h0", "h1", "h2", "h3"], 10, 1).full_blocks == 3


def test_full_eviction_takes_unanchored_leaves_first_least_recently_used():
    tree = PrefixTree()
    a = _chain(tree, 3, prefix="a")
    b = _chain(tree, 3, prefix="b")
    b[1].anchor = "an anchor ends here"  # b0..b1 can end a hit; b2 past it cannot
    for node, access in zip(a + b, (5, 5, 5, 1, 1, 9)):
        node.last_access = access
        tree.offer_full_victim(node)
    order = []
    while (node := tree.pop_full_victim()) is not None:
        order.append(node.block_hash)
        tree.set_full(node, None)
    assert order == ["a2", "a1", "a0", "b2"]  # b1 and b0 go with their anchor


def test_full_eviction_of_several_positions_takes_them_in_the_same_order_in_one_call():
    tree = PrefixTree()
    a = _chain(tree, 3, prefix="a", swa=set())
    b = _chain(tree, 2, prefix="b", swa=set())
    for node, access in zip(a + b, (5, 5, 5, 1, 1)):
        node.last_access = access
        tree.offer_full_victim(node)
    tree.unreferenced_full = 5
    # b1 first (least recently used), then its parent b0, which it leaves a leaf; then a2.
    # (Each chain's blocks are 100, 101, ... by depth.)
    assert tree.evict_full(3) == [(101,), (100,), (102,)]
    assert set(tree.nodes) == {"a0", "a1"} and tree.unreferenced_full == 2
    assert tree.evict_full(5) == [(101,), (100,)]  # fewer than asked: nothing else to evict
    assert tree.evict_full() == [] and tree.nodes == {}
    tree.check_integrity()


def test_prune_removes_empty_leaves_up_the_path():
    tree = PrefixTree()
    nodes = _chain(tree, 3, swa=set())
    for node in reversed(nodes):
        tree.set_full(node, None)
    tree.prune(nodes[2])
    assert tree.nodes == {}
    tree.check_integrity()


# --------------------------------------------------------------------- geometry


def test_geometry_reads_groups_and_window():
    geo = KVGeometry.from_kv_cache_config(kv_config(64, window=40, swa_groups=3))
    assert geo.full_group_ids == (0,) and geo.swa_group_ids == (1, 2, 3)
    assert geo.window_blocks == 3 and geo.swa_blocks_per_request == 3 * 4


def test_geometry_rejects_a_non_hybrid_config():
    with pytest.raises(UnsupportedKVLayout, match="needs Full and SWA groups"):
        KVGeometry.from_kv_cache_config(kv_config(64, swa_groups=0))


def test_geometry_of_groups_with_different_block_sizes():
    """MiMo-V2-Flash below TP 8: vLLM gives the Full group (fewer KV heads) 2x larger blocks."""
    geo = KVGeometry.from_kv_cache_config(kv_config(64, window=40, swa_groups=3, full_block=2 * BLOCK))
    assert geo.block_size == 2 * BLOCK and not geo.uniform
    assert geo.full_ids_per_position == 1 and geo.swa_ids_per_position == 3 * 2
    # W - 1 = 39 tokens before a hit: 2 positions of 32, each 2 SWA blocks of 16 per group.
    assert geo.window_blocks == 2 and geo.swa_blocks_per_request == 6 * 3


# ---------------------------------------------------------------------- manager


def _manager(num_blocks: int = 400, **config) -> HybridKVCacheManager:
    return HybridKVCacheManager(
        kv_config(num_blocks), 4096, BLOCK, BLOCK, max_num_running=4,
        mimo_config=MimoConfig(**{"grid_anchor_tokens": 0, **config}),
    )


def _run(manager, request, output: list[int], chunk: int = 10_000) -> int:
    """Admit, prefill in chunks, decode `output`, finish; return the hit at admission."""
    blocks, hit, _ = manager.get_computed_blocks(request)
    n = min(request.num_tokens - hit, chunk)
    assert manager.allocate_slots(request, n, hit, blocks) is not None
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = hit + n
    manager.check_integrity()
    while request.num_computed_tokens < request.num_tokens:
        n = min(request.num_tokens - request.num_computed_tokens, chunk)
        assert manager.allocate_slots(request, n) is not None
        request.num_computed_tokens += n
        manager.check_integrity()
    for token in output:
        request.append_output_token_ids(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        manager.check_integrity()
    request.status = RequestStatus.FINISHED_STOPPED
    manager.free(request)
    manager.check_integrity()
    return hit


SYSTEM = list(range(1000, 1000 + 10 * BLOCK))  # 10 blocks


def test_next_turn_hits_through_the_previous_output():
    m = _manager()
    first = make_request("t1", SYSTEM + [7] * 20)
    _run(m, first, output=list(range(50, 90)))
    turn2 = make_request("t2", first.all_token_ids[:-1] + [8] * 30)
    blocks, hit, _ = m.get_computed_blocks(turn2)
    assert hit == (first.num_tokens - 1) // BLOCK * BLOCK
    assert m.cache.anchors.of_kind(AnchorKind.OUTPUT_END)


def test_first_sibling_misses_without_an_anchor_and_the_third_hits_the_branch_point():
    m = _manager()
    _run(m, make_request("u1", SYSTEM + [1] * 40), output=[5] * 40)
    second = make_request("u2", SYSTEM + [2] * 40)
    assert _run(m, second, output=[6]) == 0
    assert m.metrics.pseudo_hit_tokens == len(SYSTEM)
    assert m.cache.anchors.of_kind(AnchorKind.BRANCH)
    assert _run(m, make_request("u3", SYSTEM + [3] * 40), output=[7]) == len(SYSTEM)


def test_declared_anchor_makes_the_first_sibling_hit():
    m = _manager()
    extra = {"mimo": {"anchors": [len(SYSTEM)], "pin": True}}
    _run(m, make_request("u1", SYSTEM + [1] * 40, extra_args=extra), output=[5] * 40)
    declared = m.cache.anchors.of_kind(AnchorKind.DECLARED)
    assert len(declared) == 1 and declared[0].pinned
    assert _run(m, make_request("u2", SYSTEM + [2] * 40), output=[6]) == len(SYSTEM)
    assert m.metrics.pseudo_hit_tokens == 0


def test_hot_prefix_anchor_after_enough_distinct_requests_reuse_it():
    m = _manager(hot_prefix_min_hits=3)
    _run(m, make_request("u1", SYSTEM + [1] * 40), output=[5])  # computes the prefix
    _run(m, make_request("u2", SYSTEM + [2] * 40), output=[5])  # reuses it: 1
    _run(m, make_request("u3", SYSTEM + [3] * 40), output=[5])  # 2
    assert not m.cache.anchors.of_kind(AnchorKind.HOT)
    _run(m, make_request("u4", SYSTEM + [4] * 40), output=[5])  # 3
    (hot,) = m.cache.anchors.of_kind(AnchorKind.HOT)
    assert hot.node.depth + 1 == len(SYSTEM) // BLOCK
    # The branch point u2 made is the same node: one anchor of two kinds, counted under both.
    assert hot.kinds == {AnchorKind.BRANCH, AnchorKind.HOT}
    assert m.metrics.anchors_kept["hot"] == m.cache.placement.created[AnchorKind.HOT] == 1
    assert m.metrics.anchors_kept["branch"] == m.cache.placement.created[AnchorKind.BRANCH] == 1


def test_anchor_order_holds_hot_prefixes_while_running_requests_hold_their_node():
    tree = PrefixTree()
    a, b, c = _chain(tree, 3)
    anchors = AnchorSet()
    old = Anchor(a, AnchorKind.PROMPT_END, 1)
    hot = Anchor(b, AnchorKind.HOT, 1)
    grid = Anchor(c, AnchorKind.GRID, 1)
    for anchor in (old, hot, grid):
        anchors.add(anchor, pinned=False)
    assert anchors.victim() is old
    anchors.hold(hot)
    anchors.hold(grid)  # not a hot prefix: a held grid point keeps its place
    assert list(anchors) == [old, grid, hot]
    anchors.remove(old)
    assert anchors.victim() is grid
    anchors.remove(grid)
    assert anchors.victim() is None  # a held hot prefix is in use: never a victim
    anchors.add(grid, pinned=False)
    anchors.release(hot)  # the last holder let go: just used
    assert list(anchors) == [grid, hot] and hot.state is AnchorState.LRU
    anchors.hold(hot)
    anchors.demote(hot)  # demoted: first to go, held or not
    assert anchors.victim() is hot


def test_live_anchors_go_least_worth_per_block_first_and_age_as_anchors_are_evicted():
    """GreedyDual over the LRU state: priority = the clock when last used + worth per block; the
    clock rises to each evicted anchor's priority, so recency wins in the end."""
    tree = PrefixTree()
    a, b, c, d, e = _chain(tree, 5)
    worth = {}
    anchors = AnchorSet(worth=lambda anchor: worth[anchor.node.depth])
    for node, value in ((a, 1.0), (b, 5.0), (c, 2.0)):
        worth[node.depth] = value
        anchors.add(Anchor(node, AnchorKind.GRID, 1), pinned=False)
    assert [x.node for x in anchors] == [a, c, b]  # least worth first, not least recent
    anchors.evicted(a.anchor)
    anchors.evicted(anchors.victim())  # c: the clock is now its priority, about 2
    assert anchors.now() == anchors.clock == pytest.approx(2.0, abs=0.01)
    worth[d.depth], worth[e.depth] = 1.0, 4.0
    for node in (d, e):
        anchors.add(Anchor(node, AnchorKind.GRID, 1), pinned=False)
    # d (2 + 1) now goes before b (0 + 5), which was worth more but used long ago; e (2 + 4) after b.
    assert [x.node for x in anchors] == [d, b, e]
    anchors.touch(b.anchor)  # used again: 2 + 5
    assert [x.node for x in anchors] == [d, e, b]
    anchors.check_integrity()


def test_without_evictions_time_moves_the_clock_by_worth_per_reuse_gap():
    """When nothing is evicted, the clock is time: the worth of all uses so far over the mean
    uses between an anchor's last use and a hit at it. So a worthy anchor left idle goes
    first once others were used for about its worth in reuse gaps; GreedyDual's clock alone
    (no evictions, no inflation) would keep it last for ever."""
    tree = PrefixTree()
    idle, busy, other = _chain(tree, 3)
    worth = {idle.depth: 8.0, busy.depth: 1.0, other.depth: 1.0}
    anchors = AnchorSet(worth=lambda anchor: worth[anchor.node.depth])
    for node in (idle, busy, other):
        anchors.add(Anchor(node, AnchorKind.GRID, 1), pinned=False)
    assert anchors.reuse_gap() == PRIOR_REUSE_GAP
    for _ in range(9):  # a hit at `busy` after every 9 uses of `other`: gaps 10, then 9 (8 times)
        for _ in range(9):
            anchors.touch(other.anchor)
        anchors.record_hit(busy.anchor)
    gap = (PRIOR_REUSE_GAP + 10 + 8 * 9) / 10
    assert anchors.reuse_gap() == pytest.approx(gap)
    assert anchors.clock == 0 and anchors.victim() is not idle.anchor
    uses = 0
    while anchors.victim() is not idle.anchor and uses < 10 * gap:
        anchors.touch(anchors.victim())
        uses += 1
    # Worth used so far 100 (1 per use); the others' priority is the clock + 1, idle's about 8.
    assert uses == pytest.approx(7 * gap - 100, abs=3)
    anchors.check_integrity()


def test_an_anchor_is_worth_the_tokens_it_alone_makes_reachable_per_block_it_keeps():
    tree = PrefixTree()
    nodes = _chain(tree, 40)
    placement = AnchorPlacement(BLOCK, 10 * BLOCK, 2, ghost_capacity=0, window_cost=4, full_blocks_per_position=1)
    grid = Anchor(nodes[19], AnchorKind.GRID, 2)
    first = Anchor(nodes[9], AnchorKind.HOT, 2)
    tail = Anchor(nodes[39], AnchorKind.PROMPT_TAIL, 2)
    share = placement.usefulness(AnchorKind.GRID)  # 1/2 before any evidence
    assert placement.worth(first) == pytest.approx(1.0 * 10 * BLOCK / (4 + 10))  # from the root
    assert placement.worth(grid) == pytest.approx(share * 10 * BLOCK / (4 + 10))  # from the anchor at 9
    assert placement.worth(tail) == pytest.approx(share * 20 * BLOCK / (4 + 20))
    assert placement.worth(tail) > placement.worth(grid)  # the same kind, a longer reach per block
    grid.uncover()  # without the grid point, the tail alone reaches 30 positions
    assert placement.worth(tail) == pytest.approx(share * 30 * BLOCK / (4 + 30))


def test_a_new_speculative_anchor_starts_demoted_when_share_times_reach_is_under_a_quarter_grid():
    """The hit tokens a new anchor is expected to make hittable (its kind's share times the
    positions it reaches back) against a quarter of a grid interval: an output end of a long
    conversation starts live whatever its kind's share, a short one does not; a grid point
    starts demoted once its kind's share is under USEFUL_SHARE; declared anchors never do."""
    from vllm_mimo.block_manager.placement import USEFUL_SHARE

    tree = PrefixTree()
    nodes = _chain(tree, 600)
    grid_blocks = 32
    placement = AnchorPlacement(BLOCK, grid_blocks * BLOCK, 2, ghost_capacity=0, window_cost=4, full_blocks_per_position=1)
    quarter = USEFUL_SHARE * grid_blocks  # 8 positions' worth of hit tokens
    placement.created[AnchorKind.OUTPUT_END] += 48  # share (0 + 1) / (48 + 2) = 0.02
    deep, shallow = (Anchor(nodes[d], AnchorKind.OUTPUT_END, 2) for d in (599, 299))
    assert placement.usefulness(AnchorKind.OUTPUT_END) * 600 >= quarter
    assert not placement.starts_demoted(deep, AnchorKind.OUTPUT_END)
    assert placement.usefulness(AnchorKind.OUTPUT_END) * 300 < quarter
    assert placement.starts_demoted(shallow, AnchorKind.OUTPUT_END)
    grid = Anchor(nodes[63], AnchorKind.GRID, 2)
    assert placement.reach(AnchorKind.GRID, 63) == grid_blocks
    assert not placement.starts_demoted(grid, AnchorKind.GRID)  # share 1/2 before any evidence
    placement.created[AnchorKind.GRID] += 3  # share 1/5
    assert placement.starts_demoted(grid, AnchorKind.GRID)
    placement.created[AnchorKind.DECLARED] += 1000
    assert not placement.starts_demoted(Anchor(nodes[0], AnchorKind.DECLARED, 2), AnchorKind.DECLARED)


def test_a_prompt_tail_looks_back_further_and_is_worth_what_tails_of_its_length_serve():
    """Long prompts' tails serve (a tool loop's next turn), short ones' do not (a last turn):
    the share is learned per depth band, evicted tails a later request passes included; a tail
    looks back up to TAIL_REACH positions."""
    from vllm_mimo.block_manager.placement import BAND_PRIOR, TAIL_REACH

    tree = PrefixTree()
    nodes = _chain(tree, 200)
    placement = AnchorPlacement(BLOCK, 0, 2, ghost_capacity=4, window_cost=4, full_blocks_per_position=1)
    share = placement.usefulness(AnchorKind.PROMPT_TAIL)
    long_tail = Anchor(nodes[199], AnchorKind.PROMPT_TAIL, 2)  # no live anchor above: 200 positions
    assert TAIL_REACH < 200
    assert placement.worth(long_tail) == pytest.approx(share * TAIL_REACH * BLOCK / (4 + TAIL_REACH))
    grid = Anchor(nodes[99], AnchorKind.GRID, 2)  # a grid point stops at WORTH_REACH (64)
    assert placement.worth(grid) == pytest.approx(share * 64 * BLOCK / (4 + 64))
    grid.uncover()

    long_depths, short_depths = (130, 150, 170, 180), (11, 12, 13)  # two depth bands
    tails = {depth: Anchor(nodes[depth], AnchorKind.PROMPT_TAIL, 1) for depth in (*long_depths, *short_depths)}
    for tail in tails.values():
        placement.anchor_placed(tail, AnchorKind.PROMPT_TAIL)
    for depth in long_depths[:3]:
        placement.on_hit(tails[depth], goes_on=True)
    placement.anchor_evicted(tails[180], ANCHOR_BUDGET)  # unserved: remembered
    for tail in tails.values():
        tail.uncover()
    request = SimpleNamespace(request_id="r", num_prompt_tokens=205 * BLOCK, num_preemptions=0, sampling_params=None)
    placement.on_admitted(request, [node.block_hash for node in nodes], [], hit_tokens=0)  # passes it
    assert placement.served[AnchorKind.PROMPT_TAIL] == 4  # of 7
    kind_share = placement.usefulness(AnchorKind.PROMPT_TAIL)
    assert kind_share == pytest.approx(5 / 9)
    assert placement.usefulness(AnchorKind.PROMPT_TAIL, 178) == pytest.approx((4 + BAND_PRIOR * kind_share) / (4 + BAND_PRIOR))
    assert placement.usefulness(AnchorKind.PROMPT_TAIL, 14) == pytest.approx((0 + BAND_PRIOR * kind_share) / (3 + BAND_PRIOR))
    assert placement.usefulness(AnchorKind.PROMPT_TAIL, 60) == pytest.approx(kind_share)  # a band with no evidence
    long_tail, short_tail = Anchor(nodes[178], AnchorKind.PROMPT_TAIL, 1), Anchor(nodes[14], AnchorKind.PROMPT_TAIL, 1)
    assert placement.worth(long_tail) > 2 * placement.worth(short_tail)


def test_a_demoted_shared_anchor_that_serves_again_is_held_while_its_node_is():
    """A prompt tail demoted while a request ran through it, then hit by the next request: no
    longer demoted, and in use while that request holds its node (found by the stateful test)."""
    tree = PrefixTree()
    (node,) = _chain(tree, 1)
    anchors = AnchorSet()
    tail = Anchor(node, AnchorKind.PROMPT_TAIL, 1)
    anchors.add(tail, pinned=False)
    anchors.demote(tail)
    node.full_refs = 1  # the request admitted with the hit holds the node: a demoted anchor is not held
    anchors.hold(tail)
    assert not anchors.is_held(tail)
    anchors.record_hit(tail)
    assert anchors.is_held(tail) and anchors.victim() is None
    anchors.check_integrity()


def test_demoted_anchors_that_never_served_go_before_those_that_did():
    tree = PrefixTree()
    a, b, c, d = _chain(tree, 4)
    anchors = AnchorSet()
    served = Anchor(a, AnchorKind.PROMPT_TAIL, 1)
    idle = Anchor(b, AnchorKind.OUTPUT_END, 1)
    recent = Anchor(c, AnchorKind.GRID, 1)
    live = Anchor(d, AnchorKind.GRID, 1)
    for anchor in (served, idle, recent, live):
        anchors.add(anchor, pinned=False)
    anchors.record_hit(served)
    anchors.demote(idle)
    anchors.demote(served)  # its session moved past it: demoted after the unserved one
    anchors.demote(recent)
    anchors.check_integrity()
    # Unserved demoted first (the latest demoted first), then served demoted, then LRU.
    assert list(anchors) == [recent, idle, served, live]
    assert anchors.num_demoted() == 3
    anchors.remove(recent)
    assert anchors.victim() is idle
    anchors.record_hit(idle)  # a hit takes it out of the demoted anchors
    assert list(anchors) == [served, live, idle] and anchors.num_demoted() == 1
    anchors.check_integrity()
    assert list(anchors.tiers()) == [[served, live, idle], []]


def test_where_a_session_went_on_outlives_demoted_anchors_that_never_served():
    """The anchor a session's next turn went on from is demoted, but behind the anchors that
    never served: a request that forks there later (a retry, a parallel branch) still hits."""
    m = _manager(anchor_budget_fraction=0.05)  # 19 of 399 blocks: 4 windows of 2 blocks x 2 SWA groups
    first = make_request("a1", [8000] * 60)
    _run(m, first, output=[5] * 30)
    for i in range(3):  # one-turn sessions: their prompt ends never serve
        _run(m, make_request(f"s{i}", [9000 + i] * 60), output=[5] * 30)
    prefix = first.all_token_ids[:-1]
    junction = len(prefix) // BLOCK * BLOCK
    assert _run(m, make_request("a2", prefix + [7] * 100), output=[5] * 3) == junction
    assert m.metrics.anchors_evicted["prompt_end"] > 0  # the budget did evict
    assert _run(m, make_request("fork", prefix + [6] * 40), output=[5]) == junction


def test_an_anchor_evicted_before_it_served_counts_when_a_later_request_passes_its_node():
    tree = PrefixTree()
    a, b, c = _chain(tree, 3)
    placement = AnchorPlacement(BLOCK, grid_tokens=0, hot_prefix_min_hits=2, ghost_capacity=2)
    keys = [a.block_hash, b.block_hash, c.block_hash]

    def passes(positions: int) -> None:
        """A request with no hit whose prompt passes the first `positions` nodes is admitted."""
        request = SimpleNamespace(request_id="p", num_prompt_tokens=positions * BLOCK + 1,
                                  num_preemptions=0, sampling_params=None)
        placement.on_admitted(request, keys, [], hit_tokens=0)
        placement.on_finished(request, [], 0)

    for node, kind in ((a, AnchorKind.GRID), (b, AnchorKind.OUTPUT_END), (c, AnchorKind.HOT)):
        placement.anchor_evicted(Anchor(node, kind, 1), ANCHOR_BUDGET)  # a hot prefix is not speculative
    placement.check_integrity(running=[])
    passes(1)  # only up to `a`: the grid point would have served
    assert placement.served == {AnchorKind.GRID: 1}
    passes(3)  # the deepest remembered one counts, once
    passes(3)
    assert placement.served == {AnchorKind.GRID: 1, AnchorKind.OUTPUT_END: 1}
    served, anchors = Anchor(a, AnchorKind.GRID, 1), AnchorSet()
    anchors.add(served, pinned=False)
    placement.on_hit(served, goes_on=False)  # a hit ends at it: learned, then recorded
    anchors.record_hit(served)
    placement.anchor_evicted(served, ANCHOR_BUDGET)  # it served: counted already
    passes(3)
    assert placement.served == {AnchorKind.GRID: 2, AnchorKind.OUTPUT_END: 1}
    for node in _chain(tree, 3, prefix="g"):  # the oldest remembered go first
        placement.anchor_evicted(Anchor(node, AnchorKind.GRID, 1), ANCHOR_BUDGET)
    placement.check_integrity(running=[])


def test_a_next_turn_after_its_sessions_anchor_was_evicted_still_counts_for_the_kind():
    """Demoted kinds go first, so a kind judged seldom useful would stay judged so: the
    anchors the budget evicted before the next turn came count as serves when it comes."""
    m = _manager(anchor_budget_fraction=0.05)  # 19 of 399 blocks: 4 windows of 2 blocks x 2 SWA groups
    first = [make_request(f"s{i}", [9000 + i] * 60) for i in range(12)]
    for request in first:
        _run(m, request, output=[5] * 30)
    useful = m.cache.placement.usefulness(AnchorKind.OUTPUT_END)
    assert m.metrics.anchors_evicted["output_end"] and not m.cache.placement.served[AnchorKind.OUTPUT_END]
    # The latest session's output end was demoted at birth (none has served yet) and evicted.
    turn2 = make_request("s11-2", first[-1].all_token_ids[:-1] + [7] * 20)
    assert _run(m, turn2, output=[5]) == 0
    assert m.cache.placement.served[AnchorKind.OUTPUT_END] == 1
    assert m.cache.placement.usefulness(AnchorKind.OUTPUT_END) > useful


def test_a_hot_prefix_held_by_a_running_request_outlives_older_anchors():
    m = _manager(hot_prefix_min_hits=2, anchor_budget_fraction=0.05)
    for i in range(3):  # u1 computes the prefix; u2 and u3 reuse it: hot
        _run(m, make_request(f"u{i}", SYSTEM + [i + 1] * 40), output=[5])
    (hot,) = m.cache.anchors.of_kind(AnchorKind.HOT)
    holder = make_request("holder", SYSTEM + [9] * (8 * BLOCK))  # its window moves past the prefix
    blocks, hit, _ = m.get_computed_blocks(holder)
    assert hit == len(SYSTEM) and m.allocate_slots(holder, holder.num_tokens - hit, hit, blocks)
    holder.status = RequestStatus.RUNNING
    for i in range(12):  # newer anchors of other sessions overflow the anchor budget
        hints = {"mimo": {"anchors": [3 * BLOCK]}}
        _run(m, make_request(f"s{i}", [9000 + i] * 60, extra_args=hints), output=[5] * 30)
    assert m.metrics.anchors_evicted["declared"] > 0
    assert hot in m.cache.anchors.of_kind(AnchorKind.HOT)
    holder.status = RequestStatus.FINISHED_STOPPED
    m.free(holder)
    m.check_integrity()
    assert list(m.cache.anchors)[-1] is hot  # released to the recent end of the order
    assert _run(m, make_request("late", SYSTEM + [8] * 40), output=[5]) == len(SYSTEM)


def test_a_running_prompts_tail_is_held_and_serves_a_request_branching_there_meanwhile():
    """The last grid point of a running prompt is where a request sharing that prompt branches
    off while the first still runs (a next turn sent at its timestamp): it is in use, as a hot
    prefix is, while the other grid points of the prompt go by the anchor budget."""
    m = _manager(anchor_budget_fraction=0.05, grid_anchor_tokens=4 * BLOCK)
    doc = list(range(5000, 5000 + 18 * BLOCK))
    first = make_request("first", doc + [1] * 5)
    blocks, hit, _ = m.get_computed_blocks(first)
    assert hit == 0 and m.allocate_slots(first, first.num_tokens, 0, blocks)
    first.status = RequestStatus.RUNNING
    first.num_computed_tokens = first.num_tokens
    for token in (5, 6, 7):  # decoding: its window has moved past the tail
        first.append_output_token_ids(token)
        assert m.allocate_slots(first, 1) is not None
        first.num_computed_tokens += 1
    (tail,) = m.cache.anchors.of_kind(AnchorKind.PROMPT_TAIL)
    assert tail.node.depth + 1 == 16 and m.cache.anchors.is_held(tail)
    for i in range(12):  # newer anchors of other sessions overflow the anchor budget
        hints = {"mimo": {"anchors": [3 * BLOCK]}}
        _run(m, make_request(f"s{i}", [9000 + i] * 60, extra_args=hints), output=[5] * 30)
    assert m.metrics.anchors_evicted["declared"] and m.metrics.anchors_evicted["grid"]
    assert tail in m.cache.anchors.of_kind(AnchorKind.PROMPT_TAIL)
    assert _run(m, make_request("branch", doc[: 16 * BLOCK] + [2] * 40), output=[5]) == 16 * BLOCK
    first.status = RequestStatus.FINISHED_STOPPED
    m.free(first)
    m.check_integrity()
    assert not m.cache.anchors.is_held(tail)


def test_an_allocation_fails_rather_than_evict_a_held_hot_prefix():
    m = _manager(num_blocks=120, hot_prefix_min_hits=2)
    for i in range(3):
        _run(m, make_request(f"u{i}", SYSTEM + [i + 1] * 40), output=[5])
    (hot,) = m.cache.anchors.of_kind(AnchorKind.HOT)
    holder = make_request("holder", SYSTEM + [9] * (8 * BLOCK))  # its window moves past the prefix
    blocks, hit, _ = m.get_computed_blocks(holder)
    assert m.allocate_slots(holder, holder.num_tokens - hit, hit, blocks)
    holder.status = RequestStatus.RUNNING
    holder.num_computed_tokens = holder.num_tokens
    m.remove_skipped_blocks("holder", holder.num_computed_tokens)
    held = m.cache.anchors.held_window_nodes() * m.geometry.swa_ids_per_position
    assert held > 0  # the prefix's window is kept by the held anchor alone
    # One block position (1 Full + 2 SWA ids) more than every evictable block but the held
    # window: refused, and the hot prefix survives; with the held window it would have fit.
    evictable = m.cache.pools.num_free_total() + m.cache.size_info().cached_full + m.cache.size_info().anchor_swa - held
    big = make_request("big", list(range(50_000, 50_000 + (evictable // 3 + 1) * BLOCK)))
    assert (evictable // 3 + 1) * 3 <= evictable + held
    assert m.allocate_slots(big, big.num_tokens) is None
    assert hot in m.cache.anchors.of_kind(AnchorKind.HOT)
    m.check_integrity()
    holder.status = RequestStatus.FINISHED_STOPPED
    m.free(holder)  # released: evictable again, least recently used last
    assert m.allocate_slots(big, big.num_tokens) is not None
    m.check_integrity()


def test_a_request_running_alone_may_evict_the_hot_prefix_it_holds():
    """Nobody else runs to share the prefix: refusing would leave the request waiting forever."""
    m = _manager(num_blocks=120, hot_prefix_min_hits=2)
    for i in range(3):
        _run(m, make_request(f"u{i}", SYSTEM + [i + 1] * 40), output=[5])
    (hot,) = m.cache.anchors.of_kind(AnchorKind.HOT)
    alone = make_request("alone", SYSTEM + [9] * (8 * BLOCK) + list(range(70_000, 70_000 + 60 * BLOCK)))
    blocks, hit, _ = m.get_computed_blocks(alone)
    assert m.allocate_slots(alone, 8 * BLOCK, hit, blocks)
    alone.status = RequestStatus.RUNNING
    alone.num_computed_tokens = hit + 8 * BLOCK
    m.remove_skipped_blocks("alone", alone.num_computed_tokens)
    assert m.cache.anchors.is_held(hot)
    held = m.cache.anchors.held_window_nodes() * m.geometry.swa_ids_per_position
    evictable = m.cache.pools.num_free_total() + m.cache.size_info().cached_full + m.cache.size_info().anchor_swa - held
    chunk = (evictable // 3 + 1) * BLOCK  # needs the held window too
    assert m.allocate_slots(alone, chunk) is not None
    assert hot not in m.cache.anchors.of_kind(AnchorKind.HOT)
    m.check_integrity()


def test_admission_counts_the_hot_prefix_it_will_hold_as_unevictable():
    """A next turn hits past a hot prefix nobody holds; admitting it holds the prefix (another
    request runs, so it is kept), and every allocation size either fits or is refused, never
    planned on blocks it can't evict."""
    first = SYSTEM + [1] * 40

    def build() -> tuple[HybridKVCacheManager, Anchor]:
        m = _manager(num_blocks=60, hot_prefix_min_hits=2)
        for i in range(3):
            _run(m, make_request(f"u{i}", SYSTEM + [i + 1] * 40), output=[5] * BLOCK)
        (hot,) = m.cache.anchors.of_kind(AnchorKind.HOT)
        assert not m.cache.anchors.is_held(hot)
        other = make_request("other", [8] * 4)
        assert m.allocate_slots(other, 4) is not None  # keeps running
        return m, hot

    refused = 0
    for extra in range(1, 60):
        m, hot = build()
        turn = make_request("next", first + [5] * BLOCK + list(range(60_000, 60_000 + extra * BLOCK)))
        blocks, hit, _ = m.get_computed_blocks(turn)
        assert hit > len(SYSTEM)  # past the hot prefix, at u0's output end
        if m.allocate_slots(turn, turn.num_tokens - hit, hit, blocks) is None:
            refused += 1
        else:
            assert m.cache.anchors.is_held(hot)
        m.check_integrity()
    assert refused


def test_prompt_end_anchor_serves_a_retry_of_the_same_prompt():
    m = _manager()
    prompt = SYSTEM + [1] * 40
    _run(m, make_request("r1", prompt), output=[5] * 40)
    assert m.cache.anchors.of_kind(AnchorKind.PROMPT_END)
    blocks, hit, _ = m.get_computed_blocks(make_request("r2", prompt))
    assert hit == (len(prompt) - 1) // BLOCK * BLOCK


def test_grid_anchors_every_n_tokens_of_the_prompt():
    m = _manager(grid_anchor_tokens=4 * BLOCK)
    _run(m, make_request("g", SYSTEM + [1] * 40), output=[5])
    grid = sorted(a.node.depth + 1 for a in m.cache.anchors.of_kind(AnchorKind.GRID))
    tail = [a.node.depth + 1 for a in m.cache.anchors.of_kind(AnchorKind.PROMPT_TAIL)]
    assert grid == [4, 12] and tail == [8]  # 12 is the prompt end, and a grid point


def test_a_prompt_end_on_the_grid_stays_a_grid_anchor_when_the_output_moves_on():
    m = _manager(grid_anchor_tokens=4 * BLOCK)
    prompt = list(range(7000, 7000 + 8 * BLOCK)) + [1]  # ends one token past the grid point at 8
    _run(m, make_request("p", prompt), output=[5] * (2 * BLOCK))
    (end,) = m.cache.anchors.of_kind(AnchorKind.PROMPT_END)
    assert end.node.depth + 1 == 8
    assert end.kinds == {AnchorKind.PROMPT_END, AnchorKind.GRID}
    assert not end.demoted  # not demoted behind the output's end
    # A sibling branching at the grid point hits all of it.
    assert _run(m, make_request("q", prompt[: 8 * BLOCK] + [2] * 40), output=[5]) == 8 * BLOCK


def test_anchor_budget_evicts_least_recently_used_anchors_first():
    """Over the budget, live anchors go least recently used first, by creation or latest hit:
    the anchor the session `s0` declared is hit again after `s1` ran, so it outlives s1."""
    m = _manager(anchor_budget_fraction=0.05)  # 19 of 399 blocks: 4 windows of 2 blocks x 2 SWA groups
    evicted: list = []

    class Evictions(CacheObserver):
        def anchor_evicted(self, anchor, cause) -> None:
            assert cause.by_budget or cause.swa_blocks is not None
            if AnchorKind.DECLARED in anchor.kinds:
                evicted.append(anchor.node.block_hash)

    m.cache.subscribe(Evictions())
    declared = {"mimo": {"anchors": [3 * BLOCK]}}
    sessions = [make_request(f"s{i}", [9000 + i] * 60, extra_args=declared) for i in range(12)]
    for i, request in enumerate(sessions):
        _run(m, request, output=[5] * 30)
        if i == 1:  # another request on s0's declared prefix: a hit at s0's anchor
            assert _run(m, make_request("again", [9000] * (3 * BLOCK) + [1] * 20), output=[5]) == 3 * BLOCK
    assert m.cache.size_info().anchor_swa <= m.cache.anchor_budget_blocks
    lru = [sessions[i].block_hashes[2] for i in (1, 0, *range(2, 12))]  # each declared at position 3
    assert len(evicted) >= 4 and evicted == lru[: len(evicted)], evicted
    assert [a.node.block_hash for a in m.cache.anchors.of_kind(AnchorKind.DECLARED)] == lru[len(evicted) :]


def test_step_prefill_estimate_counts_free_unheld_full_and_demoted_windows_only():
    """What a step could prefill without evicting an anchor still in the LRU order."""
    m = _manager()
    budget = StepBudget(m.cache, floor_tokens=512)
    per_block = m.geometry.full_ids_per_position + m.geometry.swa_ids_per_position  # a prefill position takes a block of every group
    assert budget.prefill_tokens() == (m.geometry.num_blocks - 1) * BLOCK // per_block
    first = make_request("t1", SYSTEM + [7] * 20, extra_args={"mimo": {"anchors": [len(SYSTEM)]}})
    _run(m, first, output=[5] * 30)  # a declared anchor: live (not speculative)
    before, demoted = budget.prefill_tokens(), m.cache.anchors.num_demoted()
    in_order = next(a for a in m.cache.anchors if a.state is AnchorState.LRU)
    m.cache.anchors.demote(in_order)
    assert m.cache.anchors.num_demoted() == demoted + 1
    window = m.geometry.swa_ids_per_position * m.cache.anchor_window_blocks
    assert budget.prefill_tokens() - before == pytest.approx(window * BLOCK / per_block, abs=BLOCK)
    # A running request that holds the cached Full blocks takes them out of the estimate.
    before = budget.prefill_tokens()
    second = make_request("t2", SYSTEM + [7] * 20)  # a retry: hits the prompt end
    blocks, hit, _ = m.get_computed_blocks(second)
    assert hit and m.allocate_slots(second, second.num_tokens - hit, hit, blocks) is not None
    assert budget.prefill_tokens() < before - hit // BLOCK * m.geometry.full_ids_per_position * BLOCK // per_block
    # Only a step that was cut and used all of its cut budget counts as held back.
    budget.record(limit=600, token_budget=8192, scheduled_tokens=600)
    budget.record(limit=600, token_budget=8192, scheduled_tokens=300)
    budget.record(limit=8192, token_budget=8192, scheduled_tokens=8192)
    assert budget.steps_cut == 1


def test_chunk_cap_holds_only_while_the_free_lists_cannot_take_a_whole_step():
    """The plugin's prefill chunk cap is lifted while a step's whole prefill fits in free blocks
    (no allocation of the step evicts), and holds once it does not; cached blocks do not count."""
    m = _manager()
    budget = StepBudget(m.cache, floor_tokens=0, chunk_tokens=64)
    per_block = m.geometry.full_ids_per_position + m.geometry.swa_ids_per_position
    free = budget.free_prefill_tokens()
    assert free == (m.geometry.num_blocks - 1) * BLOCK // per_block
    assert budget.chunk_cap(token_budget=free) == 0
    assert budget.chunk_cap(token_budget=free + 1) == 64
    assert StepBudget(m.cache, floor_tokens=0).chunk_cap(token_budget=free + 1) == 0  # no cap configured
    # Finished requests leave their Full blocks cached: no longer free, so the cap comes back
    # at a budget it was lifted for before, although the step cut would count them as room.
    for i in range(6):
        _run(m, make_request(f"c{i}", list(range(20_000 + 1000 * i, 20_000 + 1000 * i + 20 * BLOCK))), output=[5])
    info = m.cache.size_info()
    assert info.cached_full > 0 and budget.free_prefill_tokens() == info.free * BLOCK // per_block < free
    assert budget.chunk_cap(token_budget=free) == 64
    assert budget.chunk_cap(token_budget=budget.free_prefill_tokens()) == 0
    # With the cut off (floor 0), the token budget is never cut, however short memory is.
    assert budget.prefill_tokens() < 10**6
    assert budget.token_limit([], token_budget=10**6) == 10**6


def test_running_request_keeps_only_its_window_of_swa_blocks():
    m = _manager()
    req = make_request("long", list(range(2000, 2000 + 40 * BLOCK)))
    _run(m, req, output=[], chunk=3 * BLOCK)  # check_integrity bounds SWA blocks every step


def test_preempted_request_leaves_a_resume_anchor_and_resumes_from_it():
    m = _manager()
    req = make_request("p", SYSTEM + [1] * 40, max_tokens=64)
    blocks, hit, _ = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens, hit, blocks) is not None
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = req.num_tokens
    for token in range(30):  # decoding past the prompt's end
        req.append_output_token_ids(token)
        assert m.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    m.free(req)  # preemption: the scheduler frees a running request
    m.check_integrity()
    assert not m.cache.anchors.of_kind(AnchorKind.OUTPUT_END)
    (resume,) = m.cache.anchors.of_kind(AnchorKind.RESUME)
    assert resume.node.depth + 1 == req.num_tokens // BLOCK
    assert m.cache.pools.used[Pool.SWA] == m.cache.size_info().anchor_swa
    req.status = RequestStatus.PREEMPTED
    req.num_computed_tokens = 0
    req.num_preemptions += 1
    blocks, hit, _ = m.get_computed_blocks(req)
    assert hit == req.num_tokens // BLOCK * BLOCK  # all its full blocks, window-safe
    assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    m.check_integrity()
    assert resume.demoted  # passed: first to go now
    assert m.metrics.preempted_hit_tokens == hit and m.metrics.hit_tokens == 0


def test_a_request_preempted_within_its_step_resumes_where_its_computed_tokens_end():
    """Blocks are cached when a step is scheduled; a victim preempted in the same step never
    computes them, so its resume anchor stops before them."""
    m = _manager()
    req = make_request("v", list(range(4000, 4000 + 12 * BLOCK)))
    blocks, hit, _ = m.get_computed_blocks(req)
    assert m.allocate_slots(req, 6 * BLOCK, hit, blocks) is not None
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = 6 * BLOCK  # the first chunk ran
    assert m.allocate_slots(req, 6 * BLOCK) is not None  # the second is scheduled, then preempted
    m.free(req)
    m.check_integrity()
    (resume,) = m.cache.anchors.of_kind(AnchorKind.RESUME)
    assert resume.node.depth + 1 == 6


def _preempted_within_its_step(m, withdraw: bool = True):
    """A 12-block prompt: its first chunk of 6 blocks runs, its second (to the prompt's end, where
    a prompt-end anchor falls due) is scheduled and then preempted in the same step."""
    req = make_request("v", list(range(4000, 4000 + 12 * BLOCK + 5)))
    blocks, hit, _ = m.get_computed_blocks(req)
    assert m.allocate_slots(req, 6 * BLOCK, hit, blocks) is not None
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = 6 * BLOCK
    assert m.allocate_slots(req, req.num_tokens - 6 * BLOCK) is not None
    assert any(a.node.depth >= 6 for a in m.cache.anchors), "no anchor was placed on the uncomputed chunk"
    if not withdraw:  # the negative control: what the cache did before `withdraw_uncomputed`
        m.cache.withdraw_uncomputed = lambda request, state: None
    m.free(req)
    m.check_integrity()
    return req


def test_positions_scheduled_but_never_computed_leave_the_tree_when_their_request_is_preempted():
    """vLLM caches a step's blocks when it schedules them; a request preempted within that step
    (its priority policy does it) never computes them, so no anchor or cached Full KV of
    them may stay for a later hit. A retry of the prompt hits only the computed chunk."""
    m = _manager()
    req = _preempted_within_its_step(m)
    assert all(a.node.depth < 6 for a in m.cache.anchors)
    assert max(node.depth for node in m.cache.tree.nodes.values()) == 5
    retry = make_request("retry", list(req.prompt_token_ids))
    assert m.get_computed_blocks(retry)[1] == 6 * BLOCK


def test_without_the_withdrawal_a_retry_would_hit_kv_nobody_computed():
    """Negative control for the test above."""
    m = _manager()
    req = _preempted_within_its_step(m, withdraw=False)
    retry = make_request("retry", list(req.prompt_token_ids))
    assert m.get_computed_blocks(retry)[1] > 6 * BLOCK


def test_a_preempted_requests_uncomputed_positions_go_to_a_twin_that_computes_them():
    """Two requests with the same prompt prefill the same positions in the same step: the
    first one's blocks became the tree's, the second's stayed its own. When the first is
    preempted within the step, the tree takes the second's copy (its forward writes it)."""
    m = _manager()
    prompt = list(range(6000, 6000 + 12 * BLOCK + 5))
    first, twin = make_request("a", prompt), make_request("b", prompt)
    blocks, hit, _ = m.get_computed_blocks(first)
    assert m.allocate_slots(first, 3 * BLOCK, hit, blocks) is not None
    first.status = RequestStatus.RUNNING
    first.num_computed_tokens = 3 * BLOCK
    blocks, hit, _ = m.get_computed_blocks(twin)
    assert hit == 3 * BLOCK and m.allocate_slots(twin, 0, hit, blocks) is not None
    twin.status = RequestStatus.RUNNING
    twin.num_computed_tokens = hit
    assert m.allocate_slots(first, 3 * BLOCK) is not None  # positions 3-5: the tree's are first's
    assert m.allocate_slots(twin, 3 * BLOCK) is not None  # the same positions: twin's own
    twins = m.cache.requests["b"]
    nodes = twins.nodes[3:6]
    assert all(node.full_blocks is not twins.full[pos] for pos, node in enumerate(nodes, 3))
    m.free(first)
    m.check_integrity()
    assert all(node.full_blocks is twins.full[pos] for pos, node in enumerate(nodes, 3))
    twin.num_computed_tokens += 3 * BLOCK
    assert m.allocate_slots(twin, twin.num_tokens - twin.num_computed_tokens) is not None
    twin.num_computed_tokens = twin.num_tokens
    twin.status = RequestStatus.FINISHED_STOPPED
    m.free(twin)
    m.check_integrity()
    assert m.get_computed_blocks(make_request("retry", prompt))[1] == 12 * BLOCK


def test_allocation_fails_cleanly_when_the_pools_cannot_hold_it():
    m = _manager(num_blocks=60)
    req = make_request("big", list(range(3000, 3000 + 80 * BLOCK)))
    blocks, hit, _ = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens, hit, blocks) is None
    m.check_integrity()
    assert m.cache.pools.used == [0, 0]


def test_watermark_and_reserved_blocks_hold_back_admissions_as_upstream():
    """vLLM's `--watermark` and `reserved_blocks`: headroom an admission must leave free."""
    tokens = list(range(5000, 5000 + 4 * BLOCK))  # 4 positions: 4 Full + 8 SWA block ids
    m = HybridKVCacheManager(
        kv_config(40), 4096, BLOCK, BLOCK, max_num_running=4,
        mimo_config=MimoConfig(grid_anchor_tokens=0), watermark=0.75,  # 30 of 40 blocks
    )
    free = m.cache.pools.num_free(Pool.SWA) + m.cache.pools.num_free(Pool.FULL)  # 39
    req = make_request("w", tokens)
    # While others run, a waiting request must leave the watermark free: 12 + 30 > 39.
    assert m.allocate_slots(req, req.num_tokens, has_scheduled_reqs=True) is None
    # Alone it is admitted; reserved blocks count against the free ones the same way.
    assert m.allocate_slots(req, req.num_tokens, reserved_blocks=free - 11, has_scheduled_reqs=False) is None
    assert m.allocate_slots(req, req.num_tokens, reserved_blocks=free - 12, has_scheduled_reqs=False) is not None
    # A running request is not held back by the watermark.
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = req.num_tokens
    req.append_output_token_ids(1)
    assert m.allocate_slots(req, 1, has_scheduled_reqs=True) is not None
    m.check_integrity()
    with pytest.raises(ValueError, match=r"watermark must be in \[0, 1\), got 1.5"):
        HybridKVCacheManager(kv_config(40), 4096, BLOCK, BLOCK, watermark=1.5)


def _mixed_manager(num_blocks: int = 400, max_model_len: int = 4096) -> HybridKVCacheManager:
    """Full blocks of 32 tokens, SWA blocks of 16: positions of 32, hashes of 16."""
    return HybridKVCacheManager(
        kv_config(num_blocks, full_block=2 * BLOCK), max_model_len, 2 * BLOCK, BLOCK, max_num_running=4,
        mimo_config=MimoConfig(grid_anchor_tokens=0),
    )


def test_groups_with_different_block_sizes_get_their_own_blocks_and_hit_window_safe():
    m = _mixed_manager()
    first = make_request("t1", SYSTEM + [7] * 20)  # 180 tokens
    assert _run(m, first, output=list(range(50, 90))) == 0
    turn2 = make_request("t2", first.all_token_ids[:-1] + [8] * 30)
    blocks, hit, _ = m.get_computed_blocks(turn2)
    assert hit == (first.num_tokens - 1) // (2 * BLOCK) * (2 * BLOCK) == 192
    full, *swa = blocks.blocks
    assert len(full) == 192 // (2 * BLOCK)
    for group in swa:  # the W - 1 = 31 tokens before the hit: 2 SWA blocks, nulls before
        assert len(group) == 192 // BLOCK and all(b.block_id for b in group[-2:])
        assert all(b.block_id == 0 for b in group[:-2])
    assert m.allocate_slots(turn2, turn2.num_tokens - hit, hit, blocks) is not None
    m.check_integrity()
    # As vLLM's own managers: each group has cdiv(tokens, its block size) blocks (249 tokens).
    assert [len(ids) for ids in m.get_block_ids(turn2.request_id)] == [8, 16, 16]
    assert [len(ids) for ids in m.get_block_ids_for_computed_tokens(turn2.request_id, 40)] == [2, 3, 3]


def test_groups_with_different_block_sizes_need_a_max_model_len_of_whole_positions():
    with pytest.raises(UnsupportedKVLayout, match="max_model_len 4008 is not a multiple of 32"):
        _mixed_manager(max_model_len=4008)
    with pytest.raises(UnsupportedKVLayout, match=r"scheduler block size 16 must equal .* \(32\)"):
        HybridKVCacheManager(kv_config(400, full_block=2 * BLOCK), 4096, BLOCK, BLOCK)


def test_reset_prefix_cache_empties_the_tree_when_idle():
    m = _manager()
    _run(m, make_request("x", SYSTEM + [1] * 40), output=[5] * 10)
    assert m.reset_prefix_cache()
    assert not m.cache.tree.nodes and len(m.cache.anchors) == 0 and m.cache.pools.used == [0, 0]


def test_split_too_small_for_one_window_is_a_startup_error():
    with pytest.raises(MimoConfigError, match="fewer than one request's window"):
        _manager(num_blocks=400, swa_pool_fraction=0.01)


@pytest.mark.parametrize(
    "hints,message",
    [
        ({"mimo": [1]}, "must be an object"),
        ({"mimo": {"anchor": [1]}}, "unknown keys"),
        ({"mimo": {"anchors": [0]}}, "positive token positions"),
        ({"mimo": {"anchors": [3], "pin": "yes"}}, "true or false"),
    ],
)
def test_bad_anchor_hints_are_rejected(hints, message):
    with pytest.raises(AnchorHintError, match=message):
        declared_anchors(hints)


def test_anchor_hints_parse():
    assert declared_anchors({"mimo": {"anchors": [10, 20], "pin": True}}) == ([10, 20], True)
    assert declared_anchors(None) == ([], False)


def test_a_trimmed_hit_that_is_not_window_safe_is_refused():
    m = _manager()
    first = make_request("a", SYSTEM + [1] * 40)
    _run(m, first, output=[5] * 3)
    again = make_request("b", SYSTEM + [1] * 40)
    blocks, hit, _ = m.get_computed_blocks(again)
    assert hit == (again.num_tokens - 1) // BLOCK * BLOCK
    with pytest.raises(ValueError, match="window-safe hit"):
        m.allocate_slots(again, again.num_tokens - 8 * BLOCK, 8 * BLOCK)  # no window before 8
    m.check_integrity()


# ------------------------------------------------------- window-local allocation


def _local_manager(window_local: bool, num_blocks: int = 400, **config) -> HybridKVCacheManager:
    return HybridKVCacheManager(
        kv_config(num_blocks), 4096, BLOCK, BLOCK, max_num_running=4, window_local=window_local,
        mimo_config=MimoConfig(**{"grid_anchor_tokens": 0, **config}),
    )


def test_window_local_chunk_gets_swa_blocks_only_for_its_tail():
    """W = 32 tokens (2 positions of 16): a 160-token chunk holds SWA blocks for the window at
    its end (what the next chunk reads), not for all 10 positions; the Full blocks are all there."""
    stock, local = _local_manager(False), _local_manager(True)
    for m in (stock, local):
        req = make_request("r", list(range(1, 400)))
        assert m.allocate_slots(req, 160) is not None
        m.check_integrity()
    swa_stock = [ids is not None for ids in stock.cache.requests["r"].swa]
    swa_local = [ids is not None for ids in local.cache.requests["r"].swa]
    assert swa_stock == [True] * 10
    assert swa_local == [False] * 8 + [True] * 2
    assert local.metrics.peak_swa_blocks_per_request == 2 * 2 < stock.metrics.peak_swa_blocks_per_request == 10 * 2
    groups = local.get_block_ids("r")
    assert all(groups[0]) and all(group[:8] == [0] * 8 and all(group[8:]) for group in groups[1:])


def test_window_local_keeps_the_windows_of_anchors_inside_a_chunk():
    """A declared anchor and grid points fall inside one 320-token chunk: their windows keep
    SWA blocks, so a later sibling hits there exactly as with stock attention."""
    prompt = list(range(1, 321)) + list(range(2000, 2040))
    hits = {}
    for window_local in (False, True):
        m = _local_manager(window_local, grid_anchor_tokens=8 * BLOCK)
        first = make_request("a", prompt, extra_args={"mimo": {"anchors": [5 * BLOCK]}})
        _run(m, first, output=[7] * 4, chunk=320)
        if window_local:
            assert m.metrics.peak_anchor_window_blocks_per_request > 0
        hits[window_local] = [
            _run(m, make_request(f"s{k}", prompt[: k * BLOCK] + [9000 + k] * 20), output=[1]) for k in (5, 8, 16)
        ]
    assert hits[True] == hits[False] == [5 * BLOCK, 8 * BLOCK, 16 * BLOCK]


def test_queue_lookahead_keeps_what_a_waiting_request_will_hit():
    """`queue_lookahead_requests`: a queued next turn's prefix counts as just used, so the
    traffic that runs while it waits evicts the other session's KV first; without it (the
    negative control) the older session, the one the queue comes for, is evicted first."""
    from vllm_mimo.engine.lookahead import QueueLookahead

    def next_turn_hit(lookahead: int) -> int:
        m = _manager(num_blocks=200)
        first = make_request("s1", [11] * (12 * BLOCK) + [1] * 5)
        _run(m, first, output=[5] * 20)
        _run(m, make_request("s2", [22] * (12 * BLOCK) + [1] * 5), output=[5] * 20)
        queued = make_request("s1-next", first.all_token_ids[:] + [3] * 40)
        queue = QueueLookahead(m.cache, lookahead)
        for i in range(24):
            queue.step([queued])
            _run(m, make_request(f"other{i}", [1000 + i] * (6 * BLOCK) + [1] * 3), output=[5] * 4)
        return _run(m, queued, output=[5])

    assert next_turn_hit(4) == (12 * BLOCK + 5 + 20) // BLOCK * BLOCK  # the whole first turn, prompt and answer
    assert next_turn_hit(0) == 0


def test_an_output_end_keeps_its_own_window_where_a_next_turn_ahead_of_it_let_go_of_the_trees():
    """Open-loop traffic: a next turn (`ahead`) prefills the previous turn's answer before that
    turn (`behind`) has decoded it, so where `behind` caches those positions the tree's SWA
    blocks are `ahead`'s and its own are private. `ahead` moves on and lets go of them; when
    `behind` finishes, its own copies become the tree's and its output end is anchored there,
    so a later turn hits through the whole answer."""
    m = _manager()
    prompt = list(range(7000, 7000 + 4 * BLOCK + 5))
    answer = list(range(100, 100 + 6 * BLOCK - 5))  # behind ends at 10 whole positions
    behind = make_request("behind", prompt, max_tokens=len(answer))
    ahead = make_request("ahead", prompt + answer + list(range(300, 300 + 8 * BLOCK)))
    blocks, hit, _ = m.get_computed_blocks(behind)
    assert m.allocate_slots(behind, behind.num_tokens, hit, blocks) is not None
    behind.status = RequestStatus.RUNNING
    behind.num_computed_tokens = behind.num_tokens
    end = 10 * BLOCK
    blocks, hit, _ = m.get_computed_blocks(ahead)
    assert m.allocate_slots(ahead, end - hit, hit, blocks) is not None  # its chunk ends where behind will
    ahead.status = RequestStatus.RUNNING
    ahead.num_computed_tokens = end
    for token in answer:
        behind.append_output_token_ids(token)
        assert m.allocate_slots(behind, 1) is not None
        behind.num_computed_tokens += 1
    window = m.cache.requests["behind"].swa[7:10]
    assert any(ids is not None and node.swa_blocks is not ids for ids, node in zip(window, m.cache.requests["behind"].nodes[7:10]))
    assert m.allocate_slots(ahead, ahead.num_tokens - end) is not None
    ahead.num_computed_tokens = ahead.num_tokens
    ahead.status = RequestStatus.FINISHED_STOPPED
    m.free(ahead)
    behind.status = RequestStatus.FINISHED_STOPPED
    m.free(behind)
    m.check_integrity()
    assert 10 in [a.node.depth + 1 for a in m.cache.anchors.of_kind(AnchorKind.OUTPUT_END)]
    later = make_request("later", prompt + answer + list(range(900, 900 + 2 * BLOCK)))
    assert m.get_computed_blocks(later)[1] >= end

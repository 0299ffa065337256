"""The anchor order (`vllm_mimo.kv_cache.anchors.AnchorSet`): held hot prefixes, GreedyDual
worth and its clock, demotion, and holds."""

from __future__ import annotations

import pytest

from tests.kv_helpers import chain
from vllm_mimo.kv_cache.anchors import PRIOR_REUSE_GAP, AnchorSet
from vllm_mimo.kv_cache.node import Anchor, AnchorKind, AnchorState
from vllm_mimo.kv_cache.prefix_tree import PrefixTree


def test_anchor_order_holds_hot_prefixes_while_running_requests_hold_their_node():
    tree = PrefixTree()
    a, b, c = chain(tree, 3)
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
    assert list(anchors) == [grid, hot] and hot.state is AnchorState.GREEDY_DUAL
    anchors.hold(hot)
    anchors.demote(hot)  # demoted: first to go, held or not
    assert anchors.victim() is hot


def test_live_anchors_go_least_worth_per_block_first_and_age_as_anchors_are_evicted():
    """GreedyDual over the GREEDY_DUAL state: priority = the clock when last used + worth per block; the
    clock rises to each evicted anchor's priority, so recency wins in the end."""
    tree = PrefixTree()
    a, b, c, d, e = chain(tree, 5)
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


def test_an_anchor_that_goes_with_its_full_kv_does_not_age_the_others():
    """Only an anchor the order chose (`in_order`) raises the clock to its priority; one that
    went with its node's Full KV (`Anchor.keeps_full` false) was not the least worth."""
    tree = PrefixTree()
    a, b = chain(tree, 2)
    anchors = AnchorSet(worth=lambda anchor: 10.0 * (anchor.node.depth + 1))
    for node in (a, b):
        anchors.add(Anchor(node, AnchorKind.GRID, 1), pinned=False)
    anchors.evicted(b.anchor, in_order=False)  # type: ignore[arg-type]
    assert anchors.clock == 0
    anchors.evicted(a.anchor)  # type: ignore[arg-type]
    assert anchors.clock == pytest.approx(10.0, abs=0.01)


def test_without_evictions_time_moves_the_clock_by_worth_per_reuse_gap():
    """When nothing is evicted, the clock is time: the worth of all uses so far over the mean
    uses between an anchor's last use and a hit at it. So a worthy anchor left idle goes
    first once others were used for about its worth in reuse gaps; GreedyDual's clock alone
    (no evictions, no inflation) would keep it last for ever."""
    tree = PrefixTree()
    idle, busy, other = chain(tree, 3)
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


def test_a_demoted_shared_anchor_that_serves_again_is_held_while_its_node_is():
    """A prompt tail demoted while a request ran through it, then hit by the next request: no
    longer demoted, and in use while that request holds its node (found by the stateful test)."""
    tree = PrefixTree()
    (node,) = chain(tree, 1)
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
    a, b, c, d = chain(tree, 4)
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

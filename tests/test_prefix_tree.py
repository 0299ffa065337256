"""The prefix tree (`vllm_mimo.kv_cache.prefix_tree`): window-safe hit lengths, matching, Full
eviction order, and pruning."""

from __future__ import annotations

import pytest

from tests.kv_helpers import chain
from vllm_mimo.kv_cache.node import Anchor, AnchorKind
from vllm_mimo.kv_cache.prefix_tree import PrefixTree, window_safe_blocks


def no_anchor(anchor: Anchor) -> None:
    raise AssertionError(f"no anchor should go with its Full KV here, but {anchor} did")


def test_window_safe_length_needs_the_window_before_it():
    tree = PrefixTree()
    path = chain(tree, 6, swa={0, 1, 3, 4})
    # window of 2 blocks: a hit of L blocks needs SWA on nodes L-2, L-1
    assert window_safe_blocks(path, 2) == 5
    assert window_safe_blocks(path[:4], 2) == 2
    assert window_safe_blocks(path[:3], 2) == 2
    assert window_safe_blocks(path, 0) == 6


def test_match_returns_full_and_window_safe_lengths_without_mutating():
    tree = PrefixTree()
    chain(tree, 6, swa={4, 5})
    before = [(n.full_refs, n.swa_refs, n.last_access) for n in tree.nodes.values()]
    match = tree.match([f"h{i}" for i in range(8)], max_blocks=10, window_blocks=2)
    assert match.full_hit == 6 and match.safe_blocks == 6 and match.pseudo_blocks == 0
    match = tree.match([f"h{i}" for i in range(8)], max_blocks=5, window_blocks=2)
    assert match.full_hit == 5 and match.safe_blocks == 0
    assert match.limiting_node is match.path[0]
    assert before == [(n.full_refs, n.swa_refs, n.last_access) for n in tree.nodes.values()]


def test_match_stops_at_the_first_block_without_full_kv():
    tree = PrefixTree()
    nodes = chain(tree, 4)
    tree.set_full(nodes[3], None)
    assert tree.match(["h0", "h1", "h2", "h3"], 10, 1).full_hit == 3


def test_full_eviction_takes_unanchored_leaves_first_least_recently_used():
    tree = PrefixTree()
    a = chain(tree, 3, prefix="a")
    b = chain(tree, 3, prefix="b")
    Anchor(b[1], AnchorKind.GRID, 1)  # b0..b1 can end a hit; b2 past it cannot
    for node, access in zip(a + b, (5, 5, 5, 1, 1, 9), strict=True):
        node.last_access = access
        tree.offer_full_victim(node)
    order = []
    while (node := tree.pop_full_victim()) is not None:
        order.append(node.block_hash)
        tree.set_full(node, None)
    assert order == ["a2", "a1", "a0", "b2"]  # b1 and b0 go with their anchor


@pytest.mark.parametrize("keeps_full", [False, True])
def test_a_leaf_whose_anchor_does_not_keep_its_full_kv_goes_in_the_full_order_with_its_anchor(keeps_full: bool):
    """`Anchor.keeps_full` false (a chunk point): the anchored leaf is a Full eviction candidate
    like an unanchored one, and its anchor goes first (`evict_full`'s `drop_anchor`). The negative
    control: the same leaf with an anchor that keeps its Full KV is not evicted."""
    tree = PrefixTree()
    a = chain(tree, 2, prefix="a", swa=set())
    b = chain(tree, 2, prefix="b", swa=set())
    anchor = Anchor(b[1], AnchorKind.GRID, 1)
    anchor.keeps_full = keeps_full
    for node, access in zip(a + b, (5, 5, 1, 1), strict=True):
        node.last_access = access
        tree.offer_full_victim(node)
    tree.unreferenced_full = 4
    dropped: list = []

    def drop(gone: Anchor) -> None:
        dropped.append(gone)
        gone.uncover()

    if keeps_full:
        assert tree.evict_full(4, drop) == [(101,), (100,)] and dropped == []  # only a
        assert set(tree.nodes) == {"b0", "b1"}
    else:  # b first (least recently used), its anchor with it
        assert tree.evict_full(4, drop) == [(101,), (100,), (101,), (100,)] and dropped == [anchor]
        assert tree.nodes == {}


def test_full_eviction_of_several_positions_takes_them_in_the_same_order_in_one_call():
    tree = PrefixTree()
    a = chain(tree, 3, prefix="a", swa=set())
    b = chain(tree, 2, prefix="b", swa=set())
    for node, access in zip(a + b, (5, 5, 5, 1, 1), strict=True):
        node.last_access = access
        tree.offer_full_victim(node)
    tree.unreferenced_full = 5
    # b1 first (least recently used), then its parent b0, which it leaves a leaf; then a2.
    # (Each chain's blocks are 100, 101, ... by depth.)
    assert tree.evict_full(3, no_anchor) == [(101,), (100,), (102,)]
    assert set(tree.nodes) == {"a0", "a1"} and tree.unreferenced_full == 2
    assert tree.evict_full(5, no_anchor) == [(101,), (100,)]  # fewer than asked: nothing else to evict
    assert tree.evict_full(1, no_anchor) == [] and tree.nodes == {}
    tree.check_integrity()


def test_prune_removes_empty_leaves_up_the_path():
    tree = PrefixTree()
    nodes = chain(tree, 3, swa=set())
    for node in reversed(nodes):
        tree.set_full(node, None)
    tree.prune(nodes[2])
    assert tree.nodes == {}
    tree.check_integrity()

"""Anchor placement (`vllm_mimo.kv_cache.anchor_policy`): an anchor's worth and reach, which new
anchors start demoted, what evicted anchors teach, and the parsing of requests' anchor hints."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.kv_helpers import BLOCK, chain
from vllm_mimo.kv_cache.anchor_policy import (
    AnchorHintError,
    AnchorPlacement,
    declared_anchors,
)
from vllm_mimo.kv_cache.anchors import AnchorSet
from vllm_mimo.kv_cache.contract import ANCHOR_BUDGET
from vllm_mimo.kv_cache.node import Anchor, AnchorKind
from vllm_mimo.kv_cache.prefix_tree import PrefixTree


def test_an_anchor_is_worth_the_tokens_it_alone_makes_reachable_per_block_it_keeps():
    tree = PrefixTree()
    nodes = chain(tree, 40)
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
    from vllm_mimo.kv_cache.anchor_policy import USEFUL_SHARE

    tree = PrefixTree()
    nodes = chain(tree, 600)
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


def test_a_chunk_point_learns_its_own_share_reaches_its_whole_prefix_and_pays_for_its_window_only():
    """Every `chunk_every`-th grid point: once the grid points' share is low, the others start
    demoted and a chunk point does not; it does not keep its Full KV, and its worth counts the
    whole prefix above it (to the live anchor there) per block of its window alone. Without chunk
    points (the negative control) the same point starts demoted, keeps its Full KV and is worth a
    grid interval per block of window and Full KV."""
    tree = PrefixTree()
    nodes = chain(tree, 600)
    grid_blocks = 32

    def placement(chunk_every: int) -> AnchorPlacement:
        p = AnchorPlacement(BLOCK, grid_blocks * BLOCK, 2, ghost_capacity=0, window_cost=4,
                            full_blocks_per_position=1, chunk_every=chunk_every)
        p.created[AnchorKind.GRID] += 98  # the grid points' share: (0 + 1) / (98 + 2) = 0.01
        return p

    chunked, plain = placement(4), placement(0)
    at_chunk, off_chunk = nodes[4 * grid_blocks - 1], nodes[5 * grid_blocks - 1]
    assert chunked.chunk_point(AnchorKind.GRID, at_chunk.depth)
    assert not chunked.chunk_point(AnchorKind.GRID, off_chunk.depth)
    assert not chunked.chunk_point(AnchorKind.PROMPT_TAIL, at_chunk.depth)
    assert not plain.chunk_point(AnchorKind.GRID, at_chunk.depth)
    anchor = Anchor(at_chunk, AnchorKind.GRID, 2)
    assert chunked.reach(AnchorKind.GRID, at_chunk.depth) == 4 * grid_blocks
    assert not chunked.starts_demoted(anchor, AnchorKind.GRID)  # its own share: 1/2 before any evidence
    assert chunked.worth(anchor) == pytest.approx(0.5 * 4 * grid_blocks * BLOCK / 4)
    assert not chunked.keeps_full(anchor) and plain.keeps_full(anchor)
    assert chunked.starts_demoted(Anchor(off_chunk, AnchorKind.GRID, 2), AnchorKind.GRID)
    assert chunked.keeps_full(off_chunk.anchor)  # type: ignore[arg-type]
    assert plain.starts_demoted(anchor, AnchorKind.GRID)
    assert plain.worth(anchor) == pytest.approx(0.01 * 64 * BLOCK / (4 + 64))  # WORTH_REACH back
    chunked.anchor_placed(anchor, AnchorKind.GRID)
    assert chunked.usefulness(AnchorKind.GRID, at_chunk.depth) == pytest.approx(1 / 3)
    assert chunked.usefulness(AnchorKind.GRID, off_chunk.depth) == pytest.approx(1 / 101)
    chunked.on_hit(anchor, goes_on=False)  # it served
    assert chunked.usefulness(AnchorKind.GRID, at_chunk.depth) == pytest.approx(2 / 3)
    anchor.kinds.add(AnchorKind.PROMPT_TAIL)  # a prompt's tail there too: it keeps its Full KV
    assert chunked.keeps_full(anchor)


def test_a_prompt_tail_looks_back_further_and_is_worth_what_tails_of_its_length_serve():
    """Long prompts' tails serve (a tool loop's next turn), short ones' do not (a last turn):
    the share is learned per depth band, evicted tails a later request passes included; a tail
    looks back up to TAIL_REACH positions."""
    from vllm_mimo.kv_cache.anchor_policy import BAND_PRIOR, TAIL_REACH

    tree = PrefixTree()
    nodes = chain(tree, 200)
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


def test_an_anchor_evicted_before_it_served_counts_when_a_later_request_passes_its_node():
    tree = PrefixTree()
    a, b, c = chain(tree, 3)
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
    for node in chain(tree, 3, prefix="g"):  # the oldest remembered go first
        placement.anchor_evicted(Anchor(node, AnchorKind.GRID, 1), ANCHOR_BUDGET)
    placement.check_integrity(running=[])


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


def test_anchor_hints_come_as_an_object_or_its_json_text():
    assert declared_anchors({"mimo": {"anchors": [128, 256], "pin": True}}) == ([128, 256], True)
    assert declared_anchors({"mimo": '{"anchors": [128]}'}) == ([128], False)  # HTTP's vllm_xargs
    with pytest.raises(AnchorHintError, match=r'extra_args\["mimo"\] is a string but not JSON'):
        declared_anchors({"mimo": "anchors: 128"})
    with pytest.raises(AnchorHintError, match=r'\["anchors"\] must be a list of positive token positions'):
        declared_anchors({"mimo": '{"anchors": "after the system prompt"}'})


def test_a_band_whose_tails_fell_under_the_bar_learns_again_from_the_tails_it_starts_live(monkeypatch):
    """A prompt tail demoted before it serves is not its depth band's evidence (the first anchor
    to go, it seldom serves whatever the band), and every TAIL_EXPLORE_EVERY-th tail starts live:
    a band whose tails stopped serving falls under the bar, and once its next turns come back
    (a tail that is live when its next turn comes serves; a demoted one is gone by then), the
    tails it starts live serve and its tails start live again. The controls stay under the bar:
    counting the demoted tails as evidence, or starting none live."""
    from vllm_mimo.kv_cache import anchor_policy
    from vllm_mimo.kv_cache.anchor_policy import TAIL_EXPLORE_EVERY, AnchorDecision

    class CountingDemoted(AnchorPlacement):
        def anchor_demoted(self, anchor: Anchor) -> None:
            """The rule before: every tail placed is its band's evidence."""

    def live_starts(placement_class: type[AnchorPlacement]) -> tuple[list[bool], list[bool]]:
        """Which tails start live: 24 whose next turns never come, then 192 whose do."""
        node = chain(PrefixTree(), 200)[-1]  # one depth: one band
        placement = placement_class(BLOCK, 0, 2, ghost_capacity=0, window_cost=4, full_blocks_per_position=1)
        anchors = AnchorSet(1, placement.starts_demoted, placement.anchor_placed, placement.anchor_demoted)
        starts = []
        for comes_back in [False] * 24 + [True] * 192:
            anchors.apply([AnchorDecision(node, AnchorKind.PROMPT_TAIL)])
            tail = node.anchor
            starts.append(not tail.demoted)
            if comes_back and not tail.demoted:
                placement.on_hit(tail, goes_on=False)
                anchors.record_hit(tail)
            anchors.evicted(tail)
            placement.anchor_evicted(tail, ANCHOR_BUDGET)
            tail.uncover()
        return starts[:24], starts[24:]

    never, later = live_starts(AnchorPlacement)
    assert never[0] and not any(never[-16:])  # the band fell under the bar
    explorer = TAIL_EXPLORE_EVERY - len(never) - 1  # the band's first explorer while it comes back
    assert not any(later[:explorer]) and later[explorer]
    assert all(later[-64:])  # then its tails start live again
    for control in (CountingDemoted, None):
        if control is None:
            monkeypatch.setattr(anchor_policy, "TAIL_EXPLORE_EVERY", 10**9)
        _, later = live_starts(control or AnchorPlacement)
        assert not any(later[-64:]) if control is None else sum(later[-64:]) == 2

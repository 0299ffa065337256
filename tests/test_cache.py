"""The hybrid KV manager (`HybridKVCacheManager` in `vllm_mimo.engine.kv_manager`, driving
`HybridKVCache` in `cache.py`) without a model: hits, anchors of every kind, the anchor budget,
holds, preemption, admission limits, groups with different block sizes, and window-local
allocation."""

from __future__ import annotations

import pytest

from tests.kv_helpers import BLOCK, SYSTEM, kv_config, make_request, manager, run
from vllm_mimo.compat import RequestStatus
from vllm_mimo.config import MimoConfig
from vllm_mimo.engine.kv_manager import HybridKVCacheManager
from vllm_mimo.kv_cache.contract import CacheObserver
from vllm_mimo.kv_cache.geometry import UnsupportedKVLayout
from vllm_mimo.kv_cache.node import Anchor, AnchorKind
from vllm_mimo.kv_cache.pools import Pool


def test_next_turn_hits_through_the_previous_output():
    m = manager()
    first = make_request("t1", SYSTEM + [7] * 20)
    run(m, first, output=list(range(50, 90)))
    turn2 = make_request("t2", first.all_token_ids[:-1] + [8] * 30)
    blocks, hit, _ = m.get_computed_blocks(turn2)
    assert hit == (first.num_tokens - 1) // BLOCK * BLOCK
    assert m.cache.anchors.of_kind(AnchorKind.OUTPUT_END)


def test_first_sibling_misses_without_an_anchor_and_the_third_hits_the_branch_point():
    m = manager()
    run(m, make_request("u1", SYSTEM + [1] * 40), output=[5] * 40)
    second = make_request("u2", SYSTEM + [2] * 40)
    assert run(m, second, output=[6]) == 0
    assert m.metrics.pseudo_hit_tokens == len(SYSTEM)
    assert m.cache.anchors.of_kind(AnchorKind.BRANCH)
    assert run(m, make_request("u3", SYSTEM + [3] * 40), output=[7]) == len(SYSTEM)


def test_declared_anchor_makes_the_first_sibling_hit():
    m = manager()
    extra = {"mimo": {"anchors": [len(SYSTEM)], "pin": True}}
    run(m, make_request("u1", SYSTEM + [1] * 40, extra_args=extra), output=[5] * 40)
    declared = m.cache.anchors.of_kind(AnchorKind.DECLARED)
    assert len(declared) == 1 and declared[0].pinned
    assert run(m, make_request("u2", SYSTEM + [2] * 40), output=[6]) == len(SYSTEM)
    assert m.metrics.pseudo_hit_tokens == 0


def test_hot_prefix_anchor_after_enough_distinct_requests_reuse_it():
    m = manager(hot_prefix_min_hits=3)
    run(m, make_request("u1", SYSTEM + [1] * 40), output=[5])  # computes the prefix
    run(m, make_request("u2", SYSTEM + [2] * 40), output=[5])  # reuses it: 1
    run(m, make_request("u3", SYSTEM + [3] * 40), output=[5])  # 2
    assert not m.cache.anchors.of_kind(AnchorKind.HOT)
    run(m, make_request("u4", SYSTEM + [4] * 40), output=[5])  # 3
    (hot,) = m.cache.anchors.of_kind(AnchorKind.HOT)
    assert hot.node.depth + 1 == len(SYSTEM) // BLOCK
    # The branch point u2 made is the same node: one anchor of two kinds, counted under both.
    assert hot.kinds == {AnchorKind.BRANCH, AnchorKind.HOT}
    assert m.metrics.anchors_placed["hot"] == m.cache.anchor_policy.created[AnchorKind.HOT] == 1
    assert m.metrics.anchors_placed["branch"] == m.cache.anchor_policy.created[AnchorKind.BRANCH] == 1


def test_where_a_session_went_on_outlives_demoted_anchors_that_never_served():
    """The anchor a session's next turn went on from is demoted, but behind the anchors that
    never served: a request that forks there later (a retry, a parallel branch) still hits."""
    m = manager(anchor_budget_fraction=0.05)  # 19 of 399 blocks: 4 windows of 2 blocks x 2 SWA groups
    first = make_request("a1", [8000] * 60)
    run(m, first, output=[5] * 30)
    for i in range(3):  # one-turn sessions: their prompt ends never serve
        run(m, make_request(f"s{i}", [9000 + i] * 60), output=[5] * 30)
    prefix = first.all_token_ids[:-1]
    junction = len(prefix) // BLOCK * BLOCK
    assert run(m, make_request("a2", prefix + [7] * 100), output=[5] * 3) == junction
    assert m.metrics.anchors_evicted["prompt_end"] > 0  # the budget did evict
    assert run(m, make_request("fork", prefix + [6] * 40), output=[5]) == junction


def test_a_next_turn_after_its_sessions_anchor_was_evicted_still_counts_for_the_kind():
    """Demoted kinds go first, so a kind judged seldom useful would stay judged so: the
    anchors the budget evicted before the next turn came count as serves when it comes."""
    m = manager(anchor_budget_fraction=0.05)  # 19 of 399 blocks: 4 windows of 2 blocks x 2 SWA groups
    first = [make_request(f"s{i}", [9000 + i] * 60) for i in range(12)]
    for request in first:
        run(m, request, output=[5] * 30)
    useful = m.cache.anchor_policy.usefulness(AnchorKind.OUTPUT_END)
    assert m.metrics.anchors_evicted["output_end"] and not m.cache.anchor_policy.served[AnchorKind.OUTPUT_END]
    # The latest session's output end was demoted at birth (none has served yet) and evicted.
    turn2 = make_request("s11-2", first[-1].all_token_ids[:-1] + [7] * 20)
    assert run(m, turn2, output=[5]) == 0
    assert m.cache.anchor_policy.served[AnchorKind.OUTPUT_END] == 1
    assert m.cache.anchor_policy.usefulness(AnchorKind.OUTPUT_END) > useful


def test_a_hot_prefix_held_by_a_running_request_outlives_older_anchors():
    m = manager(hot_prefix_min_hits=2, anchor_budget_fraction=0.05)
    for i in range(3):  # u1 computes the prefix; u2 and u3 reuse it: hot
        run(m, make_request(f"u{i}", SYSTEM + [i + 1] * 40), output=[5])
    (hot,) = m.cache.anchors.of_kind(AnchorKind.HOT)
    holder = make_request("holder", SYSTEM + [9] * (8 * BLOCK))  # its window moves past the prefix
    blocks, hit, _ = m.get_computed_blocks(holder)
    assert hit == len(SYSTEM) and m.allocate_slots(holder, holder.num_tokens - hit, hit, blocks)
    holder.status = RequestStatus.RUNNING
    for i in range(12):  # newer anchors of other sessions overflow the anchor budget
        hints = {"mimo": {"anchors": [3 * BLOCK]}}
        run(m, make_request(f"s{i}", [9000 + i] * 60, extra_args=hints), output=[5] * 30)
    assert m.metrics.anchors_evicted["declared"] > 0
    assert hot in m.cache.anchors.of_kind(AnchorKind.HOT)
    holder.status = RequestStatus.FINISHED_STOPPED
    m.free(holder)
    m.check_integrity()
    assert list(m.cache.anchors)[-1] is hot  # released to the recent end of the order
    assert run(m, make_request("late", SYSTEM + [8] * 40), output=[5]) == len(SYSTEM)


def test_a_running_prompts_tail_is_held_and_serves_a_request_branching_there_meanwhile():
    """The last grid point of a running prompt is where a request sharing that prompt branches
    off while the first still runs (a next turn sent at its timestamp): it is in use, as a hot
    prefix is, while the other grid points of the prompt go by the anchor budget."""
    m = manager(anchor_budget_fraction=0.05, grid_anchor_tokens=4 * BLOCK)
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
        run(m, make_request(f"s{i}", [9000 + i] * 60, extra_args=hints), output=[5] * 30)
    assert m.metrics.anchors_evicted["declared"] and m.metrics.anchors_evicted["grid"]
    assert tail in m.cache.anchors.of_kind(AnchorKind.PROMPT_TAIL)
    assert run(m, make_request("branch", doc[: 16 * BLOCK] + [2] * 40), output=[5]) == 16 * BLOCK
    first.status = RequestStatus.FINISHED_STOPPED
    m.free(first)
    m.check_integrity()
    assert not m.cache.anchors.is_held(tail)


def test_an_allocation_fails_rather_than_evict_a_held_hot_prefix():
    m = manager(num_blocks=120, hot_prefix_min_hits=2)
    for i in range(3):
        run(m, make_request(f"u{i}", SYSTEM + [i + 1] * 40), output=[5])
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
    m = manager(num_blocks=120, hot_prefix_min_hits=2)
    for i in range(3):
        run(m, make_request(f"u{i}", SYSTEM + [i + 1] * 40), output=[5])
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
        m = manager(num_blocks=60, hot_prefix_min_hits=2)
        for i in range(3):
            run(m, make_request(f"u{i}", SYSTEM + [i + 1] * 40), output=[5] * BLOCK)
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
    m = manager()
    prompt = SYSTEM + [1] * 40
    run(m, make_request("r1", prompt), output=[5] * 40)
    assert m.cache.anchors.of_kind(AnchorKind.PROMPT_END)
    blocks, hit, _ = m.get_computed_blocks(make_request("r2", prompt))
    assert hit == (len(prompt) - 1) // BLOCK * BLOCK


def test_grid_anchors_every_n_tokens_of_the_prompt():
    m = manager(grid_anchor_tokens=4 * BLOCK)
    run(m, make_request("g", SYSTEM + [1] * 40), output=[5])
    grid = sorted(a.node.depth + 1 for a in m.cache.anchors.of_kind(AnchorKind.GRID))
    tail = [a.node.depth + 1 for a in m.cache.anchors.of_kind(AnchorKind.PROMPT_TAIL)]
    assert grid == [4, 12] and tail == [8]  # 12 is the prompt end, and a grid point


def test_a_prompt_end_on_the_grid_stays_a_grid_anchor_when_the_output_moves_on():
    m = manager(grid_anchor_tokens=4 * BLOCK)
    prompt = list(range(7000, 7000 + 8 * BLOCK)) + [1]  # ends one token past the grid point at 8
    run(m, make_request("p", prompt), output=[5] * (2 * BLOCK))
    (end,) = m.cache.anchors.of_kind(AnchorKind.PROMPT_END)
    assert end.node.depth + 1 == 8
    assert end.kinds == {AnchorKind.PROMPT_END, AnchorKind.GRID}
    assert not end.demoted  # not demoted behind the output's end
    # A sibling branching at the grid point hits all of it.
    assert run(m, make_request("q", prompt[: 8 * BLOCK] + [2] * 40), output=[5]) == 8 * BLOCK


def test_anchor_budget_evicts_least_recently_used_anchors_first():
    """Over the budget, live anchors go least recently used first, by creation or latest hit:
    the anchor the session `s0` declared is hit again after `s1` ran, so it outlives s1."""
    m = manager(anchor_budget_fraction=0.05)  # 19 of 399 blocks: 4 windows of 2 blocks x 2 SWA groups
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
        run(m, request, output=[5] * 30)
        if i == 1:  # another request on s0's declared prefix: a hit at s0's anchor
            assert run(m, make_request("again", [9000] * (3 * BLOCK) + [1] * 20), output=[5]) == 3 * BLOCK
    assert m.cache.size_info().anchor_swa <= m.cache.anchor_budget_blocks
    lru = [sessions[i].block_hashes[2] for i in (1, 0, *range(2, 12))]  # each declared at position 3
    assert len(evicted) >= 4 and evicted == lru[: len(evicted)], evicted
    assert [a.node.block_hash for a in m.cache.anchors.of_kind(AnchorKind.DECLARED)] == lru[len(evicted) :]


def test_running_request_keeps_only_its_window_of_swa_blocks():
    m = manager()
    req = make_request("long", list(range(2000, 2000 + 40 * BLOCK)))
    run(m, req, output=[], chunk=3 * BLOCK)  # check_integrity bounds SWA blocks every step


def test_preempted_request_leaves_a_resume_anchor_and_resumes_from_it():
    m = manager()
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
    m = manager()
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
    m = manager()
    req = _preempted_within_its_step(m)
    assert all(a.node.depth < 6 for a in m.cache.anchors)
    assert max(node.depth for node in m.cache.tree.nodes.values()) == 5
    retry = make_request("retry", list(req.prompt_token_ids))
    assert m.get_computed_blocks(retry)[1] == 6 * BLOCK


def test_without_the_withdrawal_a_retry_would_hit_kv_nobody_computed():
    """Negative control for the test above."""
    m = manager()
    req = _preempted_within_its_step(m, withdraw=False)
    retry = make_request("retry", list(req.prompt_token_ids))
    assert m.get_computed_blocks(retry)[1] > 6 * BLOCK


def test_a_preempted_requests_uncomputed_positions_go_to_a_twin_that_computes_them():
    """Two requests with the same prompt prefill the same positions in the same step: the
    first one's blocks became the tree's, the second's stayed its own. When the first is
    preempted within the step, the tree takes the second's copy (its forward writes it)."""
    m = manager()
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
    m = manager(num_blocks=60)
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
    assert run(m, first, output=list(range(50, 90))) == 0
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
    m = manager()
    run(m, make_request("x", SYSTEM + [1] * 40), output=[5] * 10)
    assert m.reset_prefix_cache()
    assert not m.cache.tree.nodes and len(m.cache.anchors) == 0 and m.cache.pools.used == [0, 0]


def test_a_trimmed_hit_that_is_not_window_safe_is_refused():
    m = manager()
    first = make_request("a", SYSTEM + [1] * 40)
    run(m, first, output=[5] * 3)
    again = make_request("b", SYSTEM + [1] * 40)
    blocks, hit, _ = m.get_computed_blocks(again)
    assert hit == (again.num_tokens - 1) // BLOCK * BLOCK
    with pytest.raises(ValueError, match="window-safe hit"):
        m.allocate_slots(again, again.num_tokens - 8 * BLOCK, 8 * BLOCK)  # no window before 8
    m.check_integrity()


def test_window_local_chunk_gets_swa_blocks_only_for_its_tail():
    """W = 32 tokens (2 positions of 16): a 160-token chunk holds SWA blocks for the window at
    its end (what the next chunk reads), not for all 10 positions; the Full blocks are all there."""
    stock, local = manager(window_local=False), manager(window_local=True)
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
        m = manager(window_local=window_local, grid_anchor_tokens=8 * BLOCK)
        first = make_request("a", prompt, extra_args={"mimo": {"anchors": [5 * BLOCK]}})
        run(m, first, output=[7] * 4, chunk=320)
        if window_local:
            assert m.metrics.peak_anchor_window_blocks_per_request > 0
        hits[window_local] = [
            run(m, make_request(f"s{k}", prompt[: k * BLOCK] + [9000 + k] * 20), output=[1]) for k in (5, 8, 16)
        ]
    assert hits[True] == hits[False] == [5 * BLOCK, 8 * BLOCK, 16 * BLOCK]


def test_an_output_end_keeps_its_own_window_where_a_next_turn_ahead_of_it_let_go_of_the_trees():
    """Open-loop traffic: a next turn (`ahead`) prefills the previous turn's answer before that
    turn (`behind`) has decoded it, so where `behind` caches those positions the tree's SWA
    blocks are `ahead`'s and its own are private. `ahead` moves on and lets go of them; when
    `behind` finishes, its own copies become the tree's and its output end is anchored there,
    so a later turn hits through the whole answer."""
    m = manager()
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
    nodes = m.cache.requests["behind"].nodes[7:10]
    assert any(ids is not None and node.swa_blocks is not ids for ids, node in zip(window, nodes, strict=True))
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


def test_anchor_kinds_tell_hints_system_prompts_cache_control_and_pins_apart():
    """The chat APIs' anchors (`system_prompt`, `cache_control`) and pinned prompts
    (`pinned_prompt`, pinned) are kinds of their own, counted apart from a request's own hints."""
    m = manager()
    hints = {"anchors": [BLOCK], "system_prompt": [2 * BLOCK], "cache_control": [3 * BLOCK], "pinned_prompt": [4 * BLOCK]}
    run(m, make_request("u1", SYSTEM + [1] * 40, extra_args={"mimo": hints}), output=[5])
    kinds = {kind: m.cache.anchors.of_kind(kind) for kind in (AnchorKind.DECLARED, AnchorKind.SYSTEM_PROMPT,
                                                              AnchorKind.CACHE_CONTROL, AnchorKind.PINNED_PROMPT)}
    assert all(len(anchors) == 1 for anchors in kinds.values()), kinds
    assert [a.pinned for a in kinds.values() for a in a] == [False, False, False, True]
    assert {k: m.metrics.anchors_placed[k] for k in ("declared", "system_prompt", "cache_control", "pinned_prompt")} == {
        "declared": 1, "system_prompt": 1, "cache_control": 1, "pinned_prompt": 1}


@pytest.mark.parametrize("chunk_tokens", [8 * BLOCK, 0])
def test_a_chunk_point_goes_with_its_full_kv_least_recently_used(chunk_tokens: int):
    """A chunk point (`chunk_anchor_tokens`) does not keep its Full KV: once everything below it
    went, its node is a Full leaf in the least-recently-used order, and its window goes with it,
    while the anchor order would pick another anchor (the grid point above it, worth less). Without
    chunk points (the negative control, 0) the same point keeps its Full KV and goes in the anchor
    order, as every other anchor does."""
    from vllm_mimo.kv_cache.contract import EvictionCause

    m = manager(grid_anchor_tokens=4 * BLOCK, chunk_anchor_tokens=chunk_tokens)
    run(m, make_request("a", list(range(5000, 5000 + 20 * BLOCK)) + [1]), output=[5, 6])
    at_8 = next(a for a in m.cache.anchors if a.node.depth + 1 == 8)
    assert at_8.keeps_full == (not chunk_tokens)
    in_order: dict[int, bool] = {}

    class Evictions(CacheObserver):
        def anchor_evicted(self, anchor, cause) -> None:
            leaf = anchor.node.full_blocks is not None and anchor.node.full_children == 0
            in_order[anchor.node.depth + 1] = m.cache.anchors.victim() is anchor
            assert leaf or anchor.keeps_full

    m.cache.subscribe(Evictions())
    assert not m.cache.evict(10_000, EvictionCause(full_blocks=10_000, swa_blocks=0))
    assert m.cache.tree.nodes == {} and not list(m.cache.anchors)
    m.check_integrity()
    assert in_order.pop(8) == (not chunk_tokens)
    assert all(in_order.values()), in_order

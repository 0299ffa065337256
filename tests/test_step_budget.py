"""The step budget (`vllm_mimo.engine.step_budget`) over a real manager: the prefill estimate, the
steps it cuts, and the prefill chunk cap."""

from __future__ import annotations

import pytest

from tests.kv_helpers import BLOCK, SYSTEM, make_request, manager, run
from vllm_mimo.engine.step_budget import StepBudget
from vllm_mimo.kv_cache.node import AnchorState


def test_step_prefill_estimate_counts_free_unheld_full_and_demoted_windows_only():
    """What a step could prefill without evicting an anchor still in the LRU order."""
    m = manager()
    budget = StepBudget(m.cache, floor_tokens=512)
    per_block = (
        m.geometry.full_ids_per_position + m.geometry.swa_ids_per_position
    )  # a prefill position takes a block of every group
    assert budget.prefill_tokens() == (m.geometry.num_blocks - 1) * BLOCK // per_block
    first = make_request("t1", SYSTEM + [7] * 20, extra_args={"mimo": {"anchors": [len(SYSTEM)]}})
    run(m, first, output=[5] * 30)  # a declared anchor: live (not speculative)
    before, demoted = budget.prefill_tokens(), m.cache.anchors.num_demoted()
    in_order = next(a for a in m.cache.anchors if a.state is AnchorState.GREEDY_DUAL)
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
    m = manager()
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
        run(m, make_request(f"c{i}", list(range(20_000 + 1000 * i, 20_000 + 1000 * i + 20 * BLOCK))), output=[5])
    info = m.cache.size_info()
    assert info.cached_full > 0 and budget.free_prefill_tokens() == info.free * BLOCK // per_block < free
    assert budget.chunk_cap(token_budget=free) == 64
    assert budget.chunk_cap(token_budget=budget.free_prefill_tokens()) == 0
    # With the cut off (floor 0), the token budget is never cut, however short memory is.
    assert budget.prefill_tokens() < 10**6
    assert budget.token_limit([], token_budget=10**6) == 10**6

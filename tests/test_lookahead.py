"""The queue lookahead (`vllm_mimo.engine.lookahead`): a queued next turn's prefix is kept as just used."""

from __future__ import annotations

from tests.kv_helpers import BLOCK, make_request, manager, run


def test_queue_lookahead_keeps_what_a_waiting_request_will_hit():
    """`queue_lookahead_requests`: a queued next turn's prefix counts as just used, so the
    traffic that runs while it waits evicts the other session's KV first; without it (the
    negative control) the older session, the one the queue comes for, is evicted first."""
    from vllm_mimo.engine.lookahead import QueueLookahead

    def next_turn_hit(lookahead: int) -> int:
        m = manager(num_blocks=200)
        first = make_request("s1", [11] * (12 * BLOCK) + [1] * 5)
        run(m, first, output=[5] * 20)
        run(m, make_request("s2", [22] * (12 * BLOCK) + [1] * 5), output=[5] * 20)
        queued = make_request("s1-next", first.all_token_ids[:] + [3] * 40)
        queue = QueueLookahead(m.cache, lookahead)
        for i in range(24):
            queue.step([queued])
            run(m, make_request(f"other{i}", [1000 + i] * (6 * BLOCK) + [1] * 3), output=[5] * 4)
        return run(m, queued, output=[5])

    assert next_turn_hit(4) == (12 * BLOCK + 5 + 20) // BLOCK * BLOCK  # the whole first turn, prompt and answer
    assert next_turn_hit(0) == 0

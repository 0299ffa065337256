"""Hypothesis drives the hybrid KV manager the way vLLM's scheduler does, with random
admissions, chunked prefills, decodes, preemptions and finishes over shared prefixes, and
checks every invariant after every step and every reported hit for window safety."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.kv_helpers import BLOCK, kv_config, make_request
from vllm_mimo.block_manager.manager import HybridKVCacheManager
from vllm_mimo.compat import RequestStatus
from vllm_mimo.config import MimoConfig

WINDOW = 40  # 3 blocks of SWA KV before a hit
PREFIXES = [list(range(k * 1000, k * 1000 + 5 * BLOCK + 7)) for k in range(1, 4)]


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(90, 260),
        budget=st.sampled_from([0.0, 0.1, 0.5]),
        grid=st.sampled_from([0, 2 * BLOCK]),
        eagle=st.booleans(),
        # (Full, SWA) block sizes: one size, or one kind's blocks holding two of the other's
        block_sizes=st.sampled_from([(BLOCK, BLOCK), (2 * BLOCK, BLOCK), (BLOCK, 2 * BLOCK)]),
    )
    def setup(self, num_blocks: int, budget: float, grid: int, eagle: bool, block_sizes: tuple[int, int]) -> None:
        config = MimoConfig(anchor_budget_fraction=budget, grid_anchor_tokens=grid)
        full_block, swa_block = block_sizes
        self.m = HybridKVCacheManager(
            kv_config(num_blocks, window=WINDOW, full_block=full_block, swa_block=swa_block), 4096,
            max(block_sizes), BLOCK, max_num_running=3, mimo_config=config, use_eagle=eagle,
        )
        self.waiting: list = []
        self.running: list = []
        self.finished: list = []
        self.outputs: dict[str, int] = {}
        self.count = 0

    @rule(
        prefix=st.sampled_from(range(len(PREFIXES) + 1)),
        suffix=st.integers(0, 3 * BLOCK),
        out=st.integers(1, 2 * BLOCK),
        anchor=st.booleans(),
        continue_finished=st.booleans(),
    )
    def arrive(self, prefix, suffix, out, anchor, continue_finished) -> None:
        self.count += 1
        rid = f"r{self.count}"
        if continue_finished and self.finished:
            tokens = self.finished[-1].all_token_ids[:-1]  # the next turn of a session
        else:
            tokens = PREFIXES[prefix] if prefix < len(PREFIXES) else []
        tokens = tokens + [7 + self.count + i % 5 for i in range(suffix + 1)]
        extra = {"mimo": {"anchors": [max(1, len(tokens) // 2)], "pin": anchor}} if anchor else None
        self.waiting.append(make_request(rid, tokens, max_tokens=out, extra_args=extra))
        self.outputs[rid] = out

    @precondition(lambda self: self.waiting and len(self.running) < 3)
    @rule(chunk=st.integers(1, 6 * BLOCK))
    def admit(self, chunk) -> None:
        req = self.waiting[0]
        blocks, hit, _ = self.m.get_computed_blocks(req)
        self._check_window_safe(req, blocks, hit)
        n = min(req.num_tokens - hit, chunk)
        if self.m.allocate_slots(req, n, hit, blocks) is None:
            return
        self.waiting.pop(0)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = hit + n
        self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 10), chunk=st.integers(1, 6 * BLOCK))
    def step(self, index, chunk) -> None:
        req = self.running[index % len(self.running)]
        if req.num_computed_tokens >= req.num_tokens:  # decode: sample, then schedule it
            if req.num_output_tokens >= self.outputs[req.request_id]:
                return self._finish(req)
            req.append_output_token_ids(11 + req.num_output_tokens % 7)
        n = min(req.num_tokens - req.num_computed_tokens, chunk)
        if self.m.allocate_slots(req, n) is None:
            self._preempt(self.running[-1])
            return
        req.num_computed_tokens += n

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 10))
    def preempt(self, index) -> None:
        self._preempt(self.running[index % len(self.running)])

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 10))
    def finish(self, index) -> None:
        self._finish(self.running[index % len(self.running)])

    @precondition(lambda self: not self.running)
    @rule()
    def reset(self) -> None:
        assert self.m.reset_prefix_cache()

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "m"):
            self.m.check_integrity()

    def _preempt(self, req) -> None:
        self.running.remove(req)
        self.m.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.insert(0, req)

    def _finish(self, req) -> None:
        self.running.remove(req)
        req.status = RequestStatus.FINISHED_STOPPED
        self.m.free(req)
        self.finished.append(req)

    def _check_window_safe(self, req, blocks, hit: int) -> None:
        """A reported hit has Full KV for every position and SWA KV for the window before it."""
        geo = self.m.geometry
        assert hit % geo.block_size == 0 and hit <= req.num_tokens - 1
        n = hit // geo.block_size
        if n == 0:
            return
        stride = geo.block_size // BLOCK  # hash blocks per position; the last one names the prefix
        for gid in geo.full_group_ids:
            k = geo.blocks_per_position(gid)
            ids = [b.block_id for b in blocks.blocks[gid]]
            assert len(ids) == n * k and 0 not in ids
            for i, block_id in enumerate(ids):
                node = self.m.tree.nodes[req.block_hashes[(i // k + 1) * stride - 1]]
                assert block_id in node.full_blocks
        for gid in geo.swa_group_ids:
            k = geo.blocks_per_position(gid)
            tail = [b.block_id for b in blocks.blocks[gid]][-min(n, geo.window_blocks) * k :]
            assert len(blocks.blocks[gid]) == n * k and 0 not in tail


ManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestManagerStateful = ManagerMachine.TestCase

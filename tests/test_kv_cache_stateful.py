"""Hypothesis drives the hybrid KV manager the way vLLM's scheduler does, with random
admissions, chunked prefills, decodes, preemptions (within the step that scheduled a request
too, as vLLM's priority policy does) and finishes over shared prefixes, and checks every
invariant after every step, every reported hit for window safety and for KV that a forward or
a load wrote, and every running request's block ids against the tree's nodes.

At scale (for a long fuzzing run, not the suite):

    VLLM_MIMO_STATEFUL_OPS=1000000 .venv/bin/python -m pytest tests/test_kv_cache_stateful.py -k at_scale -s

runs the machine until it has made that many manager calls, printing progress and, at the end,
the count of calls, steps and invariant checks (a violation fails the run with its example).
"""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from eval.host_dense import DenseHostTier
from tests.kv_helpers import BLOCK, DictL3, kv_config, make_request, put_to_l3
from vllm_mimo.compat import RequestStatus
from vllm_mimo.config import MimoConfig
from vllm_mimo.engine.kv_manager import HybridKVCacheManager
from vllm_mimo.kv_cache.tiers.host import HostTier

WINDOW = 40  # 3 blocks of SWA KV before a hit
PREFIXES = [list(range(k * 1000, k * 1000 + 5 * BLOCK + 7)) for k in range(1, 4)]
SCALE_ENV = "VLLM_MIMO_STATEFUL_OPS"


class Counted:
    """The manager calls, steps and invariant checks made so far (all machines together)."""

    calls = 0
    steps = 0
    checks = 0
    host_loads = 0  # admissions whose hit the host tier extended
    l3_loads = 0  # those that read from L3


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(90, 260),
        budget=st.sampled_from([0.0, 0.1, 0.5]),
        grid=st.sampled_from([0, 2 * BLOCK]),
        chunk_every=st.sampled_from([0, 1, 2]),  # grid points per chunk point (with a grid)
        eagle=st.booleans(),
        # (Full, SWA) block sizes: one size, or one kind's blocks holding two of the other's
        block_sizes=st.sampled_from([(BLOCK, BLOCK), (2 * BLOCK, BLOCK), (BLOCK, 2 * BLOCK)]),
        window_local=st.booleans(),
        # the host tier: none, one that fills at once, one that holds much more than the device
        host_pages=st.sampled_from([0, 0, 24, 400]),
        host_dense=st.booleans(),
        # an L3 behind the host tier (keys only: the policy's side)
        l3=st.booleans(),
    )
    def setup(
        self, num_blocks: int, budget: float, grid: int, chunk_every: int, eagle: bool, block_sizes: tuple[int, int],
        window_local: bool, host_pages: int, host_dense: bool, l3: bool,
    ) -> None:
        config = MimoConfig(anchor_budget_fraction=budget, grid_anchor_tokens=grid, chunk_anchor_tokens=chunk_every * grid)
        full_block, swa_block = block_sizes
        self.m = HybridKVCacheManager(
            kv_config(num_blocks, window=WINDOW, full_block=full_block, swa_block=swa_block), 4096,
            max(block_sizes), BLOCK, max_num_running=3, mimo_config=config, use_eagle=eagle,
            window_local=window_local, host_pages=host_pages, host_tier=DenseHostTier if host_dense else HostTier,
        )
        if l3 and host_pages:
            self.m.attach_l3(DictL3())
        self.waiting: list = []
        self.running: list = []
        self.finished: list = []
        self.outputs: dict[str, int] = {}
        self.count = 0
        # Block ids whose KV a (modelled) forward or load wrote since they were last handed out.
        self.written: set[int] = set()

    def call(self, method: str, *args, **kwargs):
        Counted.calls += 1
        return getattr(self.m, method)(*args, **kwargs)

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
        blocks, hit, _ = self.call("get_computed_blocks", req)
        self._check_window_safe(req, blocks, hit)
        external = self.call("host_extension", req)
        n = min(req.num_tokens - hit - external, chunk)
        new = self.call("allocate_slots", req, n, hit, blocks, num_external_computed_tokens=external)
        if new is None:
            return
        self._handed_out(new)
        plan = self.m.take_load(req.request_id)
        assert (plan is not None) == (external > 0), (external, plan)
        recomputed = False
        if plan is not None:
            Counted.host_loads += 1
            Counted.l3_loads += bool(plan.fetches)
            self._check_load(req, hit, external, plan)
            self.m.finish_load(plan, failed=plan.failed)
            if plan.failed:  # vLLM's recompute policy: the forward writes the positions instead
                recomputed = True
            else:
                self.written.update(i for copy in [*plan.full, *plan.swa] for i in copy.device)
        self.waiting.pop(0)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = hit + external + n
        self._computed(req, hit if recomputed else hit + external)
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
        new = self.call("allocate_slots", req, n)
        if new is None:
            self._preempt(self.running[-1])
            return
        self._handed_out(new)
        req.num_computed_tokens += n
        self._computed(req, req.num_computed_tokens - n)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 10), chunk=st.integers(1, 6 * BLOCK))
    def preempt_within_its_step(self, index, chunk) -> None:
        """A request is scheduled (its positions cached) and preempted before its forward."""
        req = self.running[index % len(self.running)]
        if req.num_computed_tokens < req.num_tokens:
            n = min(req.num_tokens - req.num_computed_tokens, chunk)
            new = self.call("allocate_slots", req, n)
            if new is not None:
                self._handed_out(new)
        self._preempt(req)

    @rule()
    def forward(self) -> None:
        """A step's scheduling is done: its stores are taken and its forward computes what it
        cached (`HybridKVCache.take_stores`)."""
        for kind, copy in self.m.take_stores():
            if not copy.device:  # a dense tier (a measuring variant) counts SWA KV the device lacks
                assert isinstance(self.m.cache.host, DenseHostTier) and kind == "swa", (kind, copy)
                continue
            assert copy.host and len(self.m.host_copies(kind, copy)) == len(copy.host) == len(copy.device), (kind, copy)
        for put in put_to_l3(self.m):
            assert len(put.keys) == len(put.host), put

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
        assert self.call("reset_prefix_cache")

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "m"):
            Counted.steps += 1
            Counted.checks += 1
            self.m.check_integrity()

    @invariant()
    def running_requests_hold_the_trees_blocks_or_their_own(self) -> None:
        """Per position of a running request, in both pools: the tree node's blocks, or blocks
        no node holds; outside its SWA mask, the null block in every SWA group."""
        if not hasattr(self, "m"):
            return
        Counted.checks += 1
        geo, tree = self.m.geometry, self.m.cache.tree
        owner = {}
        for node in tree.nodes.values():
            for ids in (node.full_blocks, node.swa_blocks):
                owner.update((i, node) for i in ids or ())
        stride = geo.block_size // BLOCK
        for req in self.running:
            ids = self.m.get_block_ids(req.request_id)
            positions = len(ids[geo.full_group_ids[0]]) // geo.blocks_per_position(geo.full_group_ids[0])
            for pos in range(positions):
                key = (pos + 1) * stride - 1
                node = tree.nodes.get(req.block_hashes[key]) if key < len(req.block_hashes) else None
                for groups, kind in ((geo.full_group_ids, "full"), (geo.swa_group_ids, "swa")):
                    blocks = tuple(
                        i
                        for gid in groups
                        for i in ids[gid][pos * geo.blocks_per_position(gid) : (pos + 1) * geo.blocks_per_position(gid)]
                    )
                    if kind == "swa" and not any(blocks):
                        continue  # outside the SWA mask: the null block in every SWA group
                    assert 0 not in blocks, (req.request_id, pos, kind, blocks)
                    holders = {owner[i] for i in blocks if i in owner}
                    if holders:
                        assert holders == {node} and blocks == getattr(node, f"{kind}_blocks"), (
                            f"{req.request_id}@{pos} holds {kind} blocks {blocks} of {holders}, "
                            f"but its position's node is {node}"
                        )

    @invariant()
    def running_requests_hold_the_window_their_next_step_reads(self) -> None:
        """Window-local or not, a running request holds SWA blocks for every position of the
        window its next step reads: the W - 1 tokens before its computed ones."""
        if not hasattr(self, "m"):
            return
        Counted.checks += 1
        cache, bs = self.m.cache, self.m.block_size
        for req in self.running:
            state = cache.requests[req.request_id]
            computed = req.num_computed_tokens
            for pos in range(max(0, computed - WINDOW + 1) // bs, -(-computed // bs)):
                assert state.swa[pos] is not None, (req.request_id, pos, computed)

    def _handed_out(self, new) -> None:
        """An allocation's new blocks hold nothing written yet."""
        self.written.difference_update(i for group in new.get_block_ids() for i in group)

    def _computed(self, req, start: int) -> None:
        """The forward wrote the request's tokens from `start` to its computed tokens."""
        geo = self.m.geometry
        ids = self.m.get_block_ids(req.request_id)
        for pos in range(start // geo.block_size, -(-req.num_computed_tokens // geo.block_size)):
            for gid, group in enumerate(ids):
                per = geo.blocks_per_position(gid)
                self.written.update(i for i in group[pos * per : (pos + 1) * per] if i)

    def _preempt(self, req) -> None:
        self.running.remove(req)
        self.call("free", req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.insert(0, req)

    def _finish(self, req) -> None:
        self.running.remove(req)
        req.status = RequestStatus.FINISHED_STOPPED
        self.call("free", req)
        self.finished.append(req)

    def _check_load(self, req, hit: int, external: int, plan) -> None:
        """A host extension loads, into the request's own new blocks, the host Full copy of every
        position past what it adopts and the host SWA copy of every position of the window
        before its end past the device hit."""
        bs, geo = self.m.block_size, self.m.geometry
        start, end = hit // bs, (hit + external) // bs
        ids = self.m.get_block_ids(req.request_id)
        full_ids = [tuple(i for gid in geo.full_group_ids for i in ids[gid][p * geo.blocks_per_position(gid) : (p + 1) * geo.blocks_per_position(gid)]) for p in range(end)]  # noqa: E501
        swa_ids = [tuple(i for gid in geo.swa_group_ids for i in ids[gid][p * geo.blocks_per_position(gid) : (p + 1) * geo.blocks_per_position(gid)]) for p in range(end)]  # noqa: E501
        assert [c.device for c in plan.swa] == swa_ids[max(start, end - geo.window_blocks) : end]
        assert [c.device for c in plan.full] == full_ids[end - len(plan.full) : end]
        assert not plan.failed or not plan.fetches
        fetched = [page for fetch in plan.fetches for page in fetch.host]
        assert len(fetched) == len(set(fetched)) == len(plan.scratch), plan
        for copy in [*plan.full, *plan.swa]:
            assert (copy.host or plan.failed) and 0 not in copy.device, copy

    def _check_window_safe(self, req, blocks, hit: int) -> None:
        """A reported hit has, at every position, the Full blocks of the tree's node there, and
        for the window before it the node's SWA blocks; null SWA blocks before that."""
        geo = self.m.geometry
        assert hit % geo.block_size == 0 and hit <= req.num_tokens - 1
        n = hit // geo.block_size
        if n == 0:
            return
        stride = geo.block_size // BLOCK  # hash blocks per position; the last one names the prefix
        nodes = [self.m.cache.tree.nodes[req.block_hashes[(pos + 1) * stride - 1]] for pos in range(n)]
        window = min(n, geo.window_blocks)
        for groups, kind in ((geo.full_group_ids, "full"), (geo.swa_group_ids, "swa")):
            for pos, node in enumerate(nodes):
                got = tuple(
                    blocks.blocks[gid][pos * geo.blocks_per_position(gid) + j].block_id
                    for gid in groups
                    for j in range(geo.blocks_per_position(gid))
                )
                if kind == "full" or pos >= n - window:
                    assert got == getattr(node, f"{kind}_blocks"), (req.request_id, pos, kind, got, node)
                else:
                    assert not any(got), (req.request_id, pos, got)
        for gid in (*geo.full_group_ids, *geo.swa_group_ids):
            assert len(blocks.blocks[gid]) == n * geo.blocks_per_position(gid)
        unwritten = [b.block_id for group in blocks.blocks for b in group if b.block_id and b.block_id not in self.written]
        assert not unwritten, f"{req.request_id}'s hit of {n} positions reads blocks no forward or load wrote: {unwritten}"


ManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestManagerStateful = ManagerMachine.TestCase


@pytest.mark.skipif(not os.environ.get(SCALE_ENV), reason=f"set {SCALE_ENV}=N for a fuzzing run of N manager calls")
def test_stateful_at_scale() -> None:
    target = int(os.environ[SCALE_ENV])
    start, t0, last = Counted.calls, time.time(), 0.0
    runs = 0
    # Each run is a fresh Hypothesis search (random seed) of 200 machines of up to 200 steps.
    scale = settings(
        max_examples=200, stateful_step_count=200, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    while Counted.calls - start < target:
        run_state_machine_as_test(ManagerMachine, settings=scale)
        runs += 1
        if time.time() - last > 30:
            last = time.time()
            print(f"[stateful] {Counted.calls - start:,} of {target:,} manager calls, "
                  f"{time.time() - t0:.0f} s", flush=True)
    print(f"[stateful] done: {Counted.calls - start:,} manager calls, {Counted.steps:,} steps, "
          f"{Counted.checks:,} invariant checks, {Counted.host_loads:,} loads from the host tier "
          f"({Counted.l3_loads:,} through L3), "
          f"0 violations, in {runs} Hypothesis runs, "
          f"{time.time() - t0:.0f} s")

"""Replay a workload through upstream vLLM's KVCacheManager and the plugin's, side by side.

    python -m eval.replay (--trace FILE | --workload NAME) --layout LAYOUT --kv-gib G [G ...]
        [--engines upstream-r0,upstream-dense,upstream-r512,swa-free,mimo,mimo-stock-attention]
        [--host-gib H] [--host-gbps B] [--max-requests N] [--max-model-len TOKENS]
        [--prefill-chunk TOKENS] [--json OUT] [--plot OUT.png]

No model is loaded. For each KV budget, every engine gets the `KVCacheConfig` vLLM builds for
the layout at that budget (`swa-free`: the same number of blocks with the SWA groups removed;
`mimo`: the plugin with its defaults, window-local SWA attention; `mimo-stock-attention`: the
plugin on vLLM's stock attention backends, whose prefill chunks need SWA blocks for every
token; with a host tier of `--host-gib` (default 4x the budget), not in the default list:
`mimo-host`, the plugin whose evicted anchors go to host memory (mask-only SWA) and whose hits
extend into it, loaded at `--host-gbps`; `mimo-host-dense`, the same keeping every stored
position's SWA KV; `upstream-offload`, upstream with vLLM's own `OffloadingConnector`, its
scheduler side driven for real, `eval/upstream_offload.py`),
real `Request` objects with vLLM's block hasher, and the same scheduling loop: FCFS, running
requests first, chunked prefill under a token budget, recompute preemption of the newest running
request, a cap on running requests, decode one token per step, blocks freed at the end; for the
plugin, a step's token budget is cut as its scheduler cuts it when memory is short
(`--step-prefill-floor`, the plugin's `step_prefill_floor_tokens`). Time is
simulated: each step costs a fixed decode time plus a prefill cost per computed token, and
requests arrive at their timestamps. A session's next turn, whose prompt holds the previous
turn's answer, is sent at its timestamp or when that answer is complete, whichever is later
(`--open-loop`: at its timestamp even so, as if the answer were known in advance). Mooncake
traces carry no answers, so their requests always arrive at their timestamps.

Reported per (engine, budget): prompt tokens; ideal hit tokens (unlimited memory: the longest
prefix any earlier request computed); hit tokens (prompt tokens no layer recomputes); pseudo-hit
tokens (cached by the Full layers, recomputed for want of SWA KV); recomputed prefill tokens
(every prefill token computed, re-prefills after preemption included); time to first token in
simulated seconds (mean and p90, from sending to the end of the step that completes the prompt);
peak blocks held by running requests per pool; peak SWA blocks one request held (all SWA
groups, beyond the windows a window-local allocation keeps for anchors inside a chunk, which
are reported apart); mean CPU microseconds per manager call
(`get_computed_blocks`, `allocate_slots`, `free`; the plugin's per-step budget call adds its time
but is not counted as a call); steps the plugin's cut held back; requests skipped as longer
than `--max-model-len` (vLLM would reject them), left out of every count. Host-tier engines
also: hit tokens loaded from host (part of the hits), bytes stored to and loaded from host, bytes
loaded per restored token, SWA tokens stored per anchor; a step that loads takes that many
bytes over `--host-gbps` longer; stores run beside the steps (counted, not timed).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import heapq
import json
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eval import sglang_peer
from eval.layouts import (
    BLOCK_SIZE,
    LAYOUTS,
    full_only,
    kv_cache_config,
    model_less_vllm_config,
    with_retention,
)
from eval.workloads import (
    WORKLOADS,
    ReplayRequest,
    make_workload,
    previous_turns,
    read_mooncake,
    segment_tokens,
    tokens,
)
from vllm_mimo.config import MimoConfig, MimoConfigError

DEFAULT_ENGINES = ("upstream-r0", "upstream-dense", "upstream-r512", "swa-free", "mimo", "mimo-stock-attention")
HOST_ENGINES = ("mimo-host", "mimo-host-dense", "upstream-offload")
ENGINES = DEFAULT_ENGINES + HOST_ENGINES
PLUGIN_ENGINES = ("mimo", "mimo-stock-attention", "mimo-host", "mimo-host-dense")
GIB = 1 << 30


@dataclass(frozen=True)
class SimParams:
    max_running: int = 64
    token_budget: int = 8192
    max_model_len: int = 131072
    prefill_s_per_token: float = 1 / 20000
    decode_s_per_step: float = 0.02
    closed_loop: bool = True
    """A next turn waits for the answer its prompt contains."""
    queue_lookahead: int = MimoConfig().queue_lookahead_requests
    """The plugin's `queue_lookahead_requests` (0: off)."""
    step_prefill_floor: int = MimoConfig().step_prefill_floor_tokens
    """The plugin scheduler's `step_prefill_floor_tokens` (0: its steps are never cut)."""
    prefill_chunk: int = MimoConfig().prefill_chunk_tokens
    """The plugin's `prefill_chunk_tokens`: its cap on one request's chunk per step while memory is
    short (0: none; `StepBudget.chunk_cap`)."""
    chunk_anchor_tokens: int = MimoConfig().chunk_anchor_tokens
    """The plugin's `chunk_anchor_tokens` (0: no chunk points)."""
    host_gib: float | None = None
    """Host memory of the host-tier engines (None: 4 x the device budget)."""
    host_gbps: float = 25.0
    """Host-to-device bandwidth of loads from the host tier, GB/s."""


@dataclass
class FirstToken:
    """One request's way to its first token in a replay (its first admission; simulated seconds)."""

    arrival_s: float
    """When it was sent."""
    admitted_s: float
    """The start of the step that first admitted it: the wait before is queueing and the step
    grid (a request sent during a step waits for the next one)."""
    hit_tokens: int
    ttft_s: float = 0.0


@dataclass
class RunResult:
    engine: str
    kv_gib: float
    num_blocks: int
    requests: int = 0
    prompt_tokens: int = 0
    ideal_hit_tokens: int = 0
    hit_tokens: int = 0
    full_hit_tokens: int = 0
    pseudo_hit_tokens: int = 0
    recomputed_prefill_tokens: int = 0
    preemptions: int = 0
    prefill_steps_cut: int = 0
    """The plugin's steps the prefill cut held back (`step_prefill_floor_tokens`)."""
    skipped_too_long: int = 0
    """Requests of the source not replayed: prompt and output longer than `max_model_len`."""
    peak_blocks: dict = field(default_factory=dict)
    peak_swa_blocks_per_request: int = 0
    """The most SWA blocks (all SWA groups) one running request held after a step's allocation,
    besides `peak_anchor_window_blocks_per_request`."""
    peak_anchor_window_blocks_per_request: int = 0
    """The most SWA blocks one window-local allocation kept for anchors inside its chunk."""
    mean_us_per_call: float = 0.0
    sim_seconds: float = 0.0
    ttft_mean_s: float = 0.0
    ttft_p90_s: float = 0.0
    wall_seconds: float = 0.0
    anchors: dict = field(default_factory=dict)
    host_gib: float = 0.0
    """The host tier's memory (host-tier engines)."""
    host_hit_tokens: int = 0
    """Hit tokens loaded from the host tier (part of `hit_tokens`: first admissions)."""
    host_restored_tokens: int = 0
    """Tokens loaded from the host tier, re-admissions after preemption included."""
    host_bytes_stored: int = 0
    host_bytes_loaded: int = 0
    failed_load_tokens: int = 0
    """Tokens of first admissions' host extensions whose load failed (no host pages to read L3
    into): counted by the manager as hits, recomputed, not in `hit_tokens`."""
    host_swa_tokens_per_anchor: float = 0.0
    """The plugin's host tiers: SWA KV stored per anchor demoted to host, in tokens of every SWA
    layer (mask-only: at most the window)."""
    first_tokens: dict[str, FirstToken] = field(default_factory=dict)
    """Per request id (`eval.replay_ttft` reads them; not in `as_dict`)."""

    @property
    def bytes_loaded_per_restored_token(self) -> float:
        return self.host_bytes_loaded / self.host_restored_tokens if self.host_restored_tokens else 0.0

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def fraction_of_ideal(self) -> float:
        return self.hit_tokens / self.ideal_hit_tokens if self.ideal_hit_tokens else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        del out["first_tokens"]
        out["hit_ratio"] = self.hit_ratio
        out["fraction_of_ideal"] = self.fraction_of_ideal
        out["bytes_loaded_per_restored_token"] = self.bytes_loaded_per_restored_token
        return out


def ideal_hits(requests: list[ReplayRequest], block_size: int = BLOCK_SIZE) -> list[int]:
    """Per request: tokens an unlimited cache could serve (prefixes computed by earlier requests)."""
    seen: set[bytes] = set()
    out = []
    for r in requests:
        toks = tokens(r.prompt)
        hashes, prev = [], b""
        full = tokens((*r.prompt, r.output))
        for start in range(0, len(full) - block_size + 1, block_size):
            prev = hashlib.blake2b(prev + repr(full[start : start + block_size]).encode(), digest_size=16).digest()
            hashes.append(prev)
        limit = (len(toks) - 1) // block_size
        hit = 0
        while hit < limit and hashes[hit] in seen:
            hit += 1
        out.append(hit * block_size)
        seen.update(hashes[: (len(full) - 1) // block_size])  # the last token's KV is never computed
    return out


class _Timed:
    """Wraps a manager and accumulates the CPU time of its calls (this thread's CPU time, so
    other load on the machine does not skew the comparison)."""

    def __init__(self, manager) -> None:
        self.manager = manager
        self.calls = 0
        self.seconds = 0.0

    def __call__(self, name: str, *args, **kwargs):
        t0 = time.thread_time()
        out = getattr(self.manager, name)(*args, **kwargs)
        self.seconds += time.thread_time() - t0
        self.calls += 1
        return out

    def uncounted(self, fn: Callable, *args):
        """A call whose time counts but which is not one of the calls the mean is per."""
        t0 = time.thread_time()
        out = fn(*args)
        self.seconds += time.thread_time() - t0
        return out


def make_manager(
    engine: str, layout_name: str, kv_bytes: int, params: SimParams, mimo_factory: Callable | None = None, host_bytes: int = 0
):
    """(manager, number of blocks, hash block size) for one engine at one budget, and for
    `upstream-offload` its `UpstreamOffload` fourth; `mimo_factory`: called as
    `HybridKVCacheManager` is, to build the plugin's engine (with observers, or a measuring
    tool's placement: `eval.replay_diagnose`, `eval.replay_bound`); `host_bytes`: the host tier
    of a host-tier engine."""
    from eval.vllm_names import KVCacheManager, resolve_kv_cache_block_sizes
    from vllm_mimo.engine.kv_manager import HybridKVCacheManager

    vllm_config = model_less_vllm_config(params.max_model_len, params.token_budget, params.max_running)
    config = kv_cache_config(LAYOUTS[layout_name], kv_bytes, vllm_config)
    peer = sglang_peer.parse_engine(engine)
    if peer is not None:  # SGLang's own pools over the same bytes; `blocks` says what vLLM makes of them
        manager = sglang_peer.SGLangPeer(
            LAYOUTS[layout_name], kv_bytes, peer, params.max_running, params.max_model_len, params.token_budget
        )
        return manager, config.num_blocks, BLOCK_SIZE
    if engine not in PLUGIN_ENGINES:
        retention = {"upstream-r0": 0, "upstream-dense": None, "upstream-r512": 512, "swa-free": 0, "upstream-offload": 0}[engine]
        config = full_only(config) if engine == "swa-free" else with_retention(config, retention)
    # As the engine core does: groups with different page sizes get different block sizes.
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(config, vllm_config)
    if engine == "swa-free":  # one group: its own (possibly scaled) block size
        scheduler_block_size = hash_block_size = config.kv_cache_groups[0].kv_cache_spec.block_size
    common = dict(  # noqa: C408
        max_model_len=params.max_model_len,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
    )
    if engine in PLUGIN_ENGINES:
        host = {}
        if engine in HOST_ENGINES:
            host = {"host_pages": host_bytes // page_bytes(config)}
            if engine == "mimo-host-dense":
                from eval.host_dense import DenseHostTier

                host["host_tier"] = DenseHostTier
        manager = (mimo_factory or HybridKVCacheManager)(
            config, max_num_running=params.max_running, window_local=engine != "mimo-stock-attention",
            mimo_config=MimoConfig(chunk_anchor_tokens=params.chunk_anchor_tokens), **host, **common,
        )
    else:
        manager = KVCacheManager(
            config, max_in_flight_tokens=vllm_config.max_in_flight_tokens, enable_caching=True, **common
        )
        if engine == "upstream-offload":
            from eval.upstream_offload import UpstreamOffload

            offload = UpstreamOffload(vllm_config, config, manager, host_bytes, retention, params.max_model_len)
            return manager, config.num_blocks, hash_block_size, offload
    return manager, config.num_blocks, hash_block_size


def page_bytes(config) -> int:
    """Bytes of one block id: a page in each layer of its group (vLLM gives every group of a
    hybrid model pages of one size and the same number of layers)."""
    group = config.kv_cache_groups[0]
    return group.kv_cache_spec.page_size_bytes * len(group.layer_names)


def _full_group_hit(manager, request) -> int:
    """Upstream: tokens the Full group alone holds for this prompt (before window reconciliation)."""
    from eval.vllm_names import FullAttentionManager
    from vllm_mimo.compat import FullAttentionSpec

    coordinator = manager.coordinator
    for gid, group in enumerate(manager.kv_cache_config.kv_cache_groups):
        if type(group.kv_cache_spec) is FullAttentionSpec:
            _, hit = FullAttentionManager.find_longest_cache_hit(
                request.block_hashes,
                request.num_tokens - 1,
                [gid],
                coordinator.block_pool,
                group.kv_cache_spec,
                False,
                group.kv_cache_spec.block_size,
            )
            return hit
    return 0


def make_hasher(hash_block_size: int) -> Callable:
    """vLLM's block hasher for requests (sha256 chained hashes, as the engine core sets up)."""
    from vllm.utils.hashing import sha256

    from eval.vllm_names import init_none_hash
    from vllm_mimo.compat import get_request_block_hasher

    init_none_hash(sha256)
    return get_request_block_hasher(hash_block_size, sha256)


def make_request(requests: list[ReplayRequest], i: int, sent_s: float, hasher: Callable):
    """vLLM's `Request` for request `i` (id `str(i)`), sent at `sent_s`."""
    from vllm.sampling_params import SamplingParams

    from vllm_mimo.compat import Request

    r = requests[i]
    return Request(
        str(i), tokens(r.prompt), SamplingParams(max_tokens=r.output.length), None,
        arrival_time=sent_s, block_hasher=hasher,
    )


class Arrivals:
    """Requests not yet sent, by send time; with `closed_loop`, a next turn joins when its
    previous turn finishes (at its timestamp or then, whichever is later)."""

    def __init__(self, requests: list[ReplayRequest], closed_loop: bool) -> None:
        self.requests = requests
        previous = previous_turns(requests) if closed_loop else [None] * len(requests)
        self.pending = [(r.arrival_s, i) for i, r in enumerate(requests) if previous[i] is None]
        heapq.heapify(self.pending)
        self.next_turns: dict[str, list[int]] = {}
        for i, prev in enumerate(previous):
            if prev is not None:
                self.next_turns.setdefault(str(prev), []).append(i)

    def __bool__(self) -> bool:
        return bool(self.pending)

    @property
    def next_s(self) -> float:
        """When the next request is sent (only while there is one)."""
        return self.pending[0][0]

    def pop(self) -> tuple[float, int]:
        """(sent at, index) of the next request."""
        return heapq.heappop(self.pending)

    def finished(self, request_id: str, now: float) -> None:
        """Request `request_id` finished at `now`: its next turns can be sent."""
        for i in self.next_turns.pop(request_id, ()):
            heapq.heappush(self.pending, (max(self.requests[i].arrival_s, now), i))


class EngineReplay:
    """One engine at one budget, stepped through simulated time: the scheduling loop, one step
    per `step` call, for a driver that owns the arrivals (`simulate`; `eval.replay_cluster`
    runs several on one clock). `requests` and `ideal` are indexed by request id (`str(i)`);
    it serves only those `enqueue`d. `mimo_factory`: see `make_manager`."""

    def __init__(self, engine: str, layout: str, kv_gib: float, requests: list[ReplayRequest], ideal: list[int],
                 params: SimParams, mimo_factory: Callable | None = None) -> None:
        from vllm_mimo.engine.lookahead import QueueLookahead
        from vllm_mimo.engine.step_budget import StepBudget

        self.engine, self.kv_gib, self.requests, self.ideal, self.params = engine, kv_gib, requests, ideal, params
        host_gib = (params.host_gib if params.host_gib is not None else 4 * kv_gib) if engine in HOST_ENGINES else 0.0
        self.is_sglang = sglang_peer.parse_engine(engine) is not None
        made = make_manager(engine, layout, int(kv_gib * GIB), params, mimo_factory, host_bytes=int(host_gib * GIB))
        self.manager, self.num_blocks, hash_block_size = made[:3]
        self.offload = made[3] if len(made) > 3 else None
        # upstream-offload: requests waiting for their load from host; those the connector has seen
        # scheduled; this step's new block ids per running request; this step's preempted ones.
        self.loading: dict[str, Any] = {}
        self.stalled = 0  # steps in a row that scheduled nothing with no transfer in flight
        self.known: set[str] = set()
        self.step_ids: dict[str, tuple] = {}
        self.preempted_ids: set[str] = set()
        self.call = _Timed(self.manager)
        self.hasher = make_hasher(hash_block_size)
        self.result = RunResult(engine, kv_gib, self.num_blocks, requests=len(requests), host_gib=host_gib)
        self.is_mimo = engine in PLUGIN_ENGINES
        self.host = self.manager.cache.host if self.is_mimo and engine in HOST_ENGINES else None
        self.block_bytes = page_bytes(self.manager.kv_cache_config) if self.host else 0
        # Pages a position's Full / SWA copy takes (host pages have a device block's bytes).
        geometry = self.manager.geometry if self.host else None
        self.position_pages = (geometry.full_ids_per_position, geometry.swa_ids_per_position) if geometry else (0, 0)
        # As the plugin's scheduler cuts its steps and caps prefill chunks (MimoConfig.prefill_chunk_tokens,
        # vLLM's long_prefill_token_threshold) when memory is short; upstream's do neither.
        self.step_budget = (
            StepBudget(self.manager.cache, params.step_prefill_floor, params.prefill_chunk)
            if self.is_mimo and (params.step_prefill_floor or params.prefill_chunk)
            else None
        )
        self.lookahead = QueueLookahead(self.manager.cache, params.queue_lookahead) if self.is_mimo else None
        self.peak: dict[str, int] = {}
        self.waiting: deque = deque()
        self.running: list = []
        self.outputs: dict[str, list[int]] = {}
        self.in_prefill: dict[str, bool] = {}
        self.scheduled: dict[str, int] = {}  # this step's tokens per request
        self.now = 0.0
        self.finished = 0
        self.wall0 = time.perf_counter()

    @property
    def busy(self) -> bool:
        """Requests wait, run or load."""
        return bool(self.waiting or self.running or self.loading)

    def make_request(self, i: int, sent_s: float):
        return make_request(self.requests, i, sent_s, self.hasher)

    def enqueue(self, req) -> None:
        """A request (`make_request`) sent now joins the waiting queue."""
        self.outputs[req.request_id] = list(segment_tokens(self.requests[int(req.request_id)].output))
        if self.offload is not None:
            self.offload.on_new_request(req)
        self.waiting.append(req)
        self.in_prefill[req.request_id] = True

    def inflight_reservation(self) -> int:
        """What vLLM keeps free for in-flight prefills when it admits an asynchronous load
        (`Scheduler._inflight_prefill_reserved_blocks`): the blocks each still needs for its
        whole sequence, for running requests still prefilling after this step's chunk and for
        loaded requests waiting to run."""
        from vllm_mimo.compat import RequestStatus

        manager, total = self.manager, 0
        waiting_loaded = (w for w in self.waiting if w.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        for r in [*self.running, *self.loading.values(), *waiting_loaded]:
            if r.status == RequestStatus.RUNNING and r.num_computed_tokens + self.scheduled.get(r.request_id, 0) >= r.num_tokens:
                continue
            n = min(r.num_tokens, self.params.max_model_len)
            total += manager.coordinator.get_num_blocks_to_allocate(
                request_id=r.request_id, num_tokens=n, new_computed_blocks=manager.empty_kv_cache_blocks.blocks,
                num_encoder_tokens=0, total_computed_tokens=r.num_computed_tokens,
                num_local_computed_tokens=r.num_computed_tokens, num_tokens_main_model=n, apply_admission_cap=True,
                prefill_end=max(r.num_prompt_tokens, r.num_tokens - 1),
            )
        return total

    def preempt(self, victim) -> None:
        from vllm_mimo.compat import RequestStatus

        self.preempted_ids.add(victim.request_id)
        self.call("free", victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.in_prefill[victim.request_id] = True
        self.waiting.appendleft(victim)
        self.result.preemptions += 1

    def loading_from_l3(self, fetches: list) -> None:
        """An admission's load reads these pages from L3 (`LoadPlan.fetches`); the cluster
        replay's instances read its simulated store here."""

    def step_seconds(self, prefill_tokens: int, loaded_bytes: int) -> float:
        """Simulated time of a step: decode, the prefill it computes and the bytes it loads from host."""
        params = self.params
        return params.decode_s_per_step + prefill_tokens * params.prefill_s_per_token + loaded_bytes / (params.host_gbps * 1e9)

    def step(self) -> list[str]:
        """Schedule and run one step (only while `busy`); the ids of the requests it finished.
        ValueError: the engine cannot hold the first waiting request even with nothing else running."""
        from vllm_mimo.compat import RequestStatus

        params, manager, call, result = self.params, self.manager, self.call, self.result
        waiting, running, loading = self.waiting, self.running, self.loading
        host, offload, is_mimo, is_sglang = self.host, self.offload, self.is_mimo, self.is_sglang
        position_pages, block_bytes, now = self.position_pages, self.block_bytes, self.now
        if is_sglang:
            manager.begin_step(list(waiting), decoding=bool(running))
        if self.lookahead is not None:
            call.uncounted(self.lookahead.step, waiting)
        budget = params.token_budget
        loaded_bytes = 0  # from the host tier, this step
        host_loaded: list[str] = []  # requests whose load from the plugin's host tier ran this step
        full_budget = budget
        chunk_cap = 0  # vLLM applies it only when another request runs or waits
        if self.step_budget is not None:
            if len(running) + len(waiting) > 1:
                chunk_cap = call.uncounted(self.step_budget.chunk_cap, budget)
            budget = call.uncounted(self.step_budget.token_limit, running, budget)
        limit = budget
        self.scheduled = scheduled = {}
        preempted = False
        idx = 0
        while idx < len(running) and budget > 0:
            req = running[idx]
            n = min(req.num_tokens - req.num_computed_tokens, budget, chunk_cap or budget)
            if is_sglang and n > 1:
                n = manager.chunk_tokens(req, n)
                if not n:  # SGLang's budget defers this chunk to a later step
                    idx += 1
                    continue
            while True:
                new = call("allocate_slots", req, n)
                if new is not None:
                    self.step_ids[req.request_id] = new.get_block_ids(allow_none=True)
                    break
                victim = running.pop()
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)
                self.preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status == RequestStatus.PREEMPTED:
                continue
            scheduled[req.request_id] = n
            budget -= n
            idx += 1
        while waiting and budget > 0 and len(running) < params.max_running and not preempted:
            req = waiting[0]
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # Its load from host is done: as vLLM's `_update_waiting_for_remote_kv`.
                manager.cache_blocks(req, req.num_computed_tokens)
                if req.num_computed_tokens == req.num_tokens:
                    req.num_computed_tokens -= 1
                n = min(req.num_tokens - req.num_computed_tokens, budget, chunk_cap or budget)
                new = call("allocate_slots", req, n)
                # Where vLLM would wait forever (its next chunk does not fit with nothing else
                # running: stock SWA needs blocks for the whole chunk), take the largest that fits.
                while new is None and not running and not scheduled and n > 1:
                    n //= 2
                    new = call("allocate_slots", req, n)
                if new is None:
                    break
                waiting.popleft()
                req.status = RequestStatus.RUNNING
                running.append(req)
                scheduled[req.request_id] = n
                budget -= n
                continue
            full_hit = 0 if is_mimo or is_sglang else _full_group_hit(manager, req)
            blocks, hit, boundary = call("get_computed_blocks", req)
            if is_sglang:
                full_hit = manager.last_full_hit()
            req.shared_prefix_boundary = boundary
            external = call("host_extension", req) if host is not None else 0
            if offload is not None:
                external = offload.lookup(req, hit)
                if external is None:
                    break  # a transfer of its blocks is in flight: next step
            n = min(req.num_tokens - hit - external, budget, chunk_cap or budget)
            if is_sglang:
                n = manager.chunk_tokens(req, n)
            # A load from host, either tier's, runs as vLLM's connectors do: asynchronously, the
            # request waiting that step (WAITING_FOR_REMOTE_KVS) and running from the next.
            new = call(
                "allocate_slots", req, 0 if external else n, num_new_computed_tokens=hit,
                new_computed_blocks=blocks, num_external_computed_tokens=external,
                delay_cache_blocks=external > 0, reserved_blocks=self.inflight_reservation() if external else 0,
                full_sequence_must_fit=True, has_scheduled_reqs=bool(running),
            )
            if new is None:
                break
            waiting.popleft()
            if offload is not None:
                offload.after_alloc(req, external)
            if external:
                if host is not None:  # the plugin's copies (`--host-gbps`), done within the step
                    plan = manager.take_load(req.request_id)
                    self.loading_from_l3(plan.fetches)
                    if plan.failed:  # no host pages to read L3 into: recomputed, as vLLM does a failed load
                        if req.num_preemptions == 0:
                            result.failed_load_tokens += external
                        external = 0
                    else:
                        loaded_bytes += (len(plan.full) * position_pages[0] + len(plan.swa) * position_pages[1]) * block_bytes
                    manager.finish_load(plan, failed=plan.failed)
                    host_loaded.append(req.request_id)
                if req.num_preemptions == 0:
                    result.first_tokens[req.request_id] = FirstToken(req.arrival_time, now, hit + external)
                    result.prompt_tokens += req.num_prompt_tokens
                    result.hit_tokens += hit + external
                    result.host_hit_tokens += external
                    result.ideal_hit_tokens += self.ideal[int(req.request_id)]
                    if not is_mimo:
                        result.full_hit_tokens += max(full_hit, hit + external)
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                req.num_computed_tokens = hit + external
                loading[req.request_id] = req
                continue
            if req.num_preemptions == 0:
                result.first_tokens[req.request_id] = FirstToken(req.arrival_time, now, hit)
                result.prompt_tokens += req.num_prompt_tokens
                result.hit_tokens += hit
                result.ideal_hit_tokens += self.ideal[int(req.request_id)]
                if not is_mimo:
                    result.full_hit_tokens += max(full_hit, hit)
                    result.pseudo_hit_tokens += max(0, full_hit - hit)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = hit
            running.append(req)
            scheduled[req.request_id] = n
            budget -= n

        if offload is not None:
            new_ids, cached_ids, resumed = {}, {}, set()
            for rid in scheduled:
                if rid not in self.known:
                    new_ids[rid] = manager.get_block_ids(rid)
                    self.known.add(rid)
                elif rid not in self.step_ids:  # re-admitted after preemption: all its blocks
                    cached_ids[rid] = manager.get_block_ids(rid)
                    resumed.add(rid)
                else:
                    cached_ids[rid] = self.step_ids[rid]
            done, loaded_bytes = offload.step(new_ids, cached_ids, resumed, dict(scheduled), self.preempted_ids)
            self.step_ids.clear()
            self.preempted_ids.clear()
            for rid in done:
                waiting.appendleft(loading.pop(rid))
        transfers = bool(loading) or (offload is not None and (offload.busy or bool(done)))
        for rid in host_loaded:
            waiting.appendleft(loading.pop(rid))
        self.stalled = 0 if scheduled or transfers else self.stalled + 1
        if self.stalled and self.stalled <= len(waiting) and (offload is not None or host is not None):
            # Loaded requests hold their blocks; one behind a request that cannot fit, with
            # nothing running, would wait forever: it goes first (a stall that outlasts the
            # queue is a deadlock, reported below).
            ready = next((r for r in waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS), None)
            if ready is not None:
                waiting.remove(ready)
                waiting.appendleft(ready)
                transfers = True
        if not scheduled and not transfers:
            req = waiting[0]
            raise ValueError(
                f"{self.kv_gib} GiB ({self.num_blocks} blocks) cannot hold request {req.request_id} "
                f"({req.num_tokens} tokens) even with nothing else running"
            )
        if self.step_budget is not None:
            self.step_budget.record(limit, full_budget, sum(scheduled.values()))
        held = manager.held_pages() if is_sglang else _held_blocks(manager, is_mimo)
        for pool, blocks_held in held.items():
            self.peak[pool] = max(self.peak.get(pool, 0), blocks_held)
        if not is_mimo and not is_sglang:  # the plugin's manager counts its own (`KVManagerMetrics`)
            for rid, n in scheduled.items():
                if n > 1:
                    swa_held = _upstream_swa_blocks(manager, rid)
                    result.peak_swa_blocks_per_request = max(result.peak_swa_blocks_per_request, swa_held)
        prefill_tokens = sum(n for rid, n in scheduled.items() if self.in_prefill[rid])
        result.recomputed_prefill_tokens += prefill_tokens
        self.now = now = now + self.step_seconds(prefill_tokens, loaded_bytes)
        if host is not None:
            manager.take_stores()  # device-to-host copies run beside the steps: counted, not timed
        return self._advance(scheduled, now)

    def _advance(self, scheduled: dict[str, int], now: float) -> list[str]:
        """The step's forward is done at `now`: computed tokens, first tokens, decoded tokens and
        finished requests (their ids)."""
        from vllm_mimo.compat import RequestStatus

        by_id = {req.request_id: req for req in self.running}
        done = []
        for rid, n in scheduled.items():
            req = by_id[rid]
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk that did not reach the end
            self.in_prefill[rid] = False
            first_token = self.result.first_tokens[rid]
            if not first_token.ttft_s:  # a re-prefill after preemption is not a first token
                first_token.ttft_s = now - first_token.arrival_s
            out = self.outputs[rid]
            req.append_output_token_ids(out[req.num_output_tokens])
            if req.num_output_tokens >= len(out):
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                if self.offload is not None:
                    self.offload.finished(req)
                self.call("free", req)
                self.running.remove(req)
                self.finished += 1
                done.append(rid)
        return done

    def finish(self) -> RunResult:
        """The run's result, once nothing is left to send, wait, run or load."""
        manager, result, host = self.manager, self.result, self.host
        if self.is_sglang:
            manager.check_idle()
        if self.is_mimo:
            m = manager.metrics
            result.full_hit_tokens = m.full_cached_tokens
            result.pseudo_hit_tokens = m.pseudo_hit_tokens
            assert m.hit_tokens == result.hit_tokens + result.failed_load_tokens, (m.hit_tokens, result.hit_tokens)
            result.anchors = {"kept": dict(m.anchors_placed), "evicted": dict(m.anchors_evicted)}
            result.prefill_steps_cut = self.step_budget.steps_cut if self.step_budget is not None else 0
            result.peak_swa_blocks_per_request = m.peak_swa_blocks_per_request
            result.peak_anchor_window_blocks_per_request = m.peak_anchor_window_blocks_per_request
        if self.offload is not None:
            result.host_bytes_stored, result.host_bytes_loaded = self.offload.bytes_stored, self.offload.bytes_loaded
            result.host_restored_tokens = self.offload.restored_tokens
        if host is not None:
            full_bytes, swa_bytes = self.position_pages[0] * self.block_bytes, self.position_pages[1] * self.block_bytes
            stats = host.stats
            result.host_bytes_stored = stats.stored_full * full_bytes + stats.stored_swa * swa_bytes
            result.host_bytes_loaded = stats.loaded_full * full_bytes + stats.loaded_swa * swa_bytes
            result.host_restored_tokens = stats.hit_tokens
            if stats.stored_anchors:
                result.host_swa_tokens_per_anchor = stats.stored_swa * manager.block_size / stats.stored_anchors
        result.peak_blocks = self.peak
        result.mean_us_per_call = 1e6 * self.call.seconds / max(self.call.calls, 1)
        result.sim_seconds = self.now
        if result.first_tokens:
            first = sorted(t.ttft_s for t in result.first_tokens.values())
            result.ttft_mean_s = sum(first) / len(first)
            result.ttft_p90_s = first[int(0.9 * (len(first) - 1))]
        result.wall_seconds = time.perf_counter() - self.wall0
        return result


def simulate(engine: str, layout: str, kv_gib: float, requests: list[ReplayRequest], ideal: list[int],
             params: SimParams, progress: bool = True, mimo_factory: Callable | None = None,
             on_step: Callable[[], None] | None = None) -> RunResult:
    """Replay `requests` through one engine at one budget. `mimo_factory`: see `make_manager`;
    `on_step`: called after every simulated step."""
    sim = EngineReplay(engine, layout, kv_gib, requests, ideal, params, mimo_factory)
    arrivals = Arrivals(requests, params.closed_loop)
    last_report = 0.0
    while arrivals or sim.busy:
        while arrivals and arrivals.next_s <= sim.now:
            sent_s, i = arrivals.pop()
            sim.enqueue(sim.make_request(i, sent_s))
        if not sim.busy:
            sim.now = arrivals.next_s
            continue
        for rid in sim.step():
            arrivals.finished(rid, sim.now)
        if on_step is not None:
            on_step()
        if progress and time.perf_counter() - last_report > 5:
            last_report = time.perf_counter()
            print(
                f"\r  {engine:<22} {kv_gib:>7.2f} GiB  {sim.finished}/{len(requests)} done  "
                f"sim {sim.now:8.1f}s  wall {last_report - sim.wall0:6.1f}s",
                end="", file=sys.stderr, flush=True,
            )
    if progress:
        print("\r" + " " * 90 + "\r", end="", file=sys.stderr)
    return sim.finish()


def _held_blocks(manager, is_mimo: bool) -> dict[str, int]:
    """Blocks held by running requests (cached-only blocks not counted), per pool."""
    if is_mimo:
        size = manager.cache.size_info()
        return {"swa": size.held_swa, "full": size.held_full}
    pool = manager.block_pool
    return {"shared": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()}


def _upstream_swa_blocks(manager, request_id: str) -> int:
    """Upstream: the SWA blocks (not the null block) one request holds, over all SWA groups."""
    from vllm_mimo.compat import SlidingWindowSpec

    return sum(
        sum(1 for block in group.req_to_blocks.get(request_id, ()) if not block.is_null)
        for group in manager.coordinator.single_type_managers
        if isinstance(group.kv_cache_spec, SlidingWindowSpec)
    )


def print_table(runs: list[RunResult]) -> None:
    baseline = {r.kv_gib: r for r in runs if r.engine == "upstream-r0"}
    header = (
        f"{'engine':<26}{'KV GiB':>8}{'blocks':>9}{'prompt':>11}{'ideal':>11}{'hit':>11}{'hit %':>7}"
        f"{'of ideal':>9}{'pseudo':>10}{'recomp.':>11}{'preempt':>8}{'TTFT s':>8}{'p90':>8}{'us/call':>9}{'x r0':>7}{'skipped':>8}"  # noqa: E501
        f"{'SWA/req':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in runs:
        base = baseline.get(r.kv_gib)
        ratio = f"{r.hit_tokens / base.hit_tokens:6.2f}" if base and base.hit_tokens else "     -"
        print(
            f"{r.engine:<26}{r.kv_gib:>8.2f}{r.num_blocks:>9}{r.prompt_tokens:>11}{r.ideal_hit_tokens:>11}"
            f"{r.hit_tokens:>11}{100 * r.hit_ratio:>6.1f}%{100 * r.fraction_of_ideal:>8.1f}%"
            f"{r.pseudo_hit_tokens:>10}{r.recomputed_prefill_tokens:>11}{r.preemptions:>8}"
            f"{r.ttft_mean_s:>8.2f}{r.ttft_p90_s:>8.2f}{r.mean_us_per_call:>9.0f} {ratio}{r.skipped_too_long:>8}"
            f"{r.peak_swa_blocks_per_request:>8}"
        )


def plot(runs: list[RunResult], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for engine in dict.fromkeys(r.engine for r in runs):
        points = sorted((r.kv_gib, 100 * r.hit_ratio) for r in runs if r.engine == engine)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=engine)
    ideal = sorted({(r.kv_gib, 100 * r.ideal_hit_tokens / r.prompt_tokens) for r in runs if r.prompt_tokens})
    if ideal:
        ax.axhline(ideal[0][1], color="gray", linestyle=":", label="ideal (unlimited memory)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV cache budget (GiB)")
    ax.set_ylabel("hit ratio (% of prompt tokens)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def add_chunk_anchor_argument(parser: argparse.ArgumentParser) -> None:
    """`--chunk-anchor-tokens`, the plugin's `chunk_anchor_tokens` (checked by
    `check_chunk_anchor_argument`)."""
    parser.add_argument(
        "--chunk-anchor-tokens", type=int, default=SimParams.chunk_anchor_tokens, metavar="TOKENS",
        help="the plugin's chunk_anchor_tokens: every TOKENS prompt tokens (a multiple of its "
        "grid_anchor_tokens, 512) a grid point is a chunk point, whose window starts live and is "
        f"ranked by the prefix a hit there saves (default: {SimParams.chunk_anchor_tokens}, the plugin's; 0: off)",
    )


def check_chunk_anchor_argument(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject a `--chunk-anchor-tokens` the plugin's own config check rejects."""
    try:  # the plugin's own check of the key
        MimoConfig.from_sources({"mimo": {"chunk_anchor_tokens": args.chunk_anchor_tokens}}, environ={})
    except MimoConfigError as e:
        parser.error(f"--chunk-anchor-tokens: {e}")


def add_source_arguments(parser: argparse.ArgumentParser, replay: bool = True) -> None:
    """The arguments that say what to replay (shared with the other replay tools), and with
    `replay` the model layout to replay it on and how sessions are sent."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--trace", type=Path, help="Mooncake-format trace (JSONL: timestamp ms, input_length, output_length, hash_ids)"
    )
    source.add_argument("--workload", choices=sorted(WORKLOADS), help="a generated workload from eval/workloads.py")
    if replay:
        parser.add_argument("--layout", required=True, help=f"model layout: {', '.join(LAYOUTS)}")
    parser.add_argument("--max-requests", type=int, help="replay only the first N requests, N >= 1")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--scale", type=float, default=1.0, help="workload size multiplier, > 0 (default: 1.0)")
    parser.add_argument(
        "--stretch",
        type=float,
        default=1.0,
        metavar="K",
        help="send every request at K times its timestamp, K > 0: a trace recorded on a cluster "
        "replayed at a load one engine keeps up with (default: 1.0, as recorded)",
    )
    if replay:
        parser.add_argument("--open-loop", action="store_true", help="send every request at its timestamp, even a next turn whose previous answer is not complete yet (default: it waits for that answer)")  # noqa: E501
    parser.add_argument(
        "--max-model-len", type=int, default=SimParams.max_model_len, metavar="TOKENS",
        help=f"the engines' max_model_len, a multiple of {BLOCK_SIZE}; a request whose prompt and "
        "output are longer is skipped (as vLLM would reject it) and counted in the table and JSON "
        f"(default: {SimParams.max_model_len})",
    )


@dataclass
class Source:
    """What to replay: the requests kept, and how many of the source's were skipped."""

    name: str
    requests: list[ReplayRequest]
    skipped_too_long: int
    max_model_len: int


def load_source(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Source | None:
    """Check the arguments of `add_source_arguments` and read the requests (the first
    `--max-requests`, less those longer than `--max-model-len`); None (after printing why) if
    the trace is unreadable or malformed, or no request is short enough."""
    from eval.workloads import TraceError

    if hasattr(args, "layout") and args.layout not in LAYOUTS:
        parser.error(f"unknown layout {args.layout!r}; known layouts: {', '.join(LAYOUTS)}")
    if args.max_requests is not None and args.max_requests < 1:
        parser.error(f"--max-requests must be >= 1, got {args.max_requests}")
    if not args.scale > 0:
        parser.error(f"--scale must be > 0, got {args.scale}")
    if not args.stretch > 0:
        parser.error(f"--stretch must be > 0, got {args.stretch}")
    if args.max_model_len < 2 * BLOCK_SIZE or args.max_model_len % BLOCK_SIZE:
        parser.error(
            f"--max-model-len must be a multiple of {BLOCK_SIZE} and >= {2 * BLOCK_SIZE}, got {args.max_model_len}"
        )
    try:
        requests = read_mooncake(args.trace) if args.trace else make_workload(args.workload, args.seed, args.scale)
    except (TraceError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    requests = requests[: args.max_requests]
    if args.stretch != 1.0:
        requests = [dataclasses.replace(r, arrival_s=r.arrival_s * args.stretch) for r in requests]
    kept = [r for r in requests if r.prompt_len + r.output.length <= args.max_model_len]
    skipped = len(requests) - len(kept)
    if not kept:
        print(f"error: all {len(requests)} requests are longer than max_model_len {args.max_model_len}", file=sys.stderr)
        return None
    if skipped:
        print(f"skipping {skipped} of {len(requests)} requests: longer than max_model_len {args.max_model_len}", file=sys.stderr)
    return Source(str(args.trace) if args.trace else args.workload, kept, skipped, args.max_model_len)


def parse_engines(parser: argparse.ArgumentParser, text: str) -> list[str] | None:
    """`--engines`: comma-separated names of `ENGINES` and SGLang's engines, validated (a parser
    error names the unknown ones and the known); SGLang's cache code loaded if one is named
    (None, with the reason printed, if it is not installed)."""
    engines = [e.strip() for e in text.split(",") if e.strip()]
    try:
        unknown = [e for e in engines if e not in ENGINES and sglang_peer.parse_engine(e) is None]
    except ValueError as e:
        parser.error(str(e))
    if unknown or not engines:
        parser.error(
            f"unknown engine(s) {unknown}; known engines: {', '.join(ENGINES)}, and SGLang's "
            "sglang-r<RATIO> (0 < RATIO <= 1) and sglang-unified, each optionally with -norefresh"
        )
    if any(sglang_peer.parse_engine(e) for e in engines):
        try:
            sglang_peer.load()
        except sglang_peer.SGLangUnavailable as e:
            print(f"error: {e}", file=sys.stderr)
            return None
    return engines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.replay", description=__doc__.split("\n\n")[0])
    add_source_arguments(parser)
    parser.add_argument("--kv-gib", type=float, nargs="+", required=True, help="KV cache budgets in GiB, each > 0")
    parser.add_argument(
        "--engines", default=",".join(DEFAULT_ENGINES),
        help=f"comma-separated engines: {','.join(ENGINES)} (default: all but the host-tier engines "
        f"{','.join(HOST_ENGINES)}: the plugin with a host tier that keeps only anchors' SWA windows, "
        "and the same storing every stored position's SWA KV)",
    )
    parser.add_argument(
        "--host-gib", type=float, metavar="GIB",
        help="host memory of the host-tier engines, > 0 (default: 4 x each --kv-gib budget)",
    )
    parser.add_argument(
        "--host-gbps",
        type=float,
        default=SimParams.host_gbps,
        metavar="GB/S",
        help="host-to-device bandwidth of loads from the host tier, added to the step that loads, > 0 "
        f"(default: {SimParams.host_gbps:g}: PCIe 4.0 x16 with pinned memory moves about 25 GB/s; "
        "PCIe 5.0 about twice that)",
    )
    parser.add_argument("--max-running", type=int, default=SimParams.max_running, help=f"cap on running requests (default: {SimParams.max_running})")  # noqa: E501
    parser.add_argument(
        "--step-prefill-floor", type=int, default=SimParams.step_prefill_floor, metavar="TOKENS",
        help="the plugin's step_prefill_floor_tokens: when KV memory is short its scheduler cuts "
        "a step to the decode tokens plus the prefill its pools take without evicting an anchor "
        f"in use, but to no fewer than TOKENS prefill tokens (default: {SimParams.step_prefill_floor}, "
        "the plugin's; 0: never cut; upstream engines are never cut)",
    )
    parser.add_argument(
        "--prefill-chunk", type=int, default=SimParams.prefill_chunk, metavar="TOKENS",
        help="the plugin's prefill_chunk_tokens: its cap on one request's prefill chunk per step "
        "when others wait or run and the free KV blocks cannot take a whole step's prefill "
        f"(default: {SimParams.prefill_chunk}, the plugin's; 0: none; upstream engines have none)",
    )
    parser.add_argument(
        "--queue-lookahead", type=int, default=SimParams.queue_lookahead, metavar="N",
        help="the plugin's queue_lookahead_requests: every 32 steps with a queue, the prefixes the "
        f"first N waiting requests would hit count as just used (default: {SimParams.queue_lookahead}, "
        "the plugin's; 0: off; SGLang's engines do their own)",
    )
    add_chunk_anchor_argument(parser)
    parser.add_argument("--json", type=Path, help="write the runs as JSON here")
    parser.add_argument("--plot", type=Path, help="draw hit ratio against KV budget for all engines (PNG)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)

    engines = parse_engines(parser, args.engines)
    if engines is None:
        return 2
    if any(not g > 0 for g in args.kv_gib):
        parser.error(f"--kv-gib values must be > 0, got {args.kv_gib}")
    if args.max_running < 1:
        parser.error(f"--max-running must be >= 1, got {args.max_running}")
    if args.step_prefill_floor < 0:
        parser.error(f"--step-prefill-floor must be >= 0 tokens (0: off), got {args.step_prefill_floor}")
    check_chunk_anchor_argument(parser, args)
    if args.queue_lookahead < 0:
        parser.error(f"--queue-lookahead must be >= 0 requests (0: off), got {args.queue_lookahead}")
    if args.prefill_chunk < 0:
        parser.error(f"--prefill-chunk must be >= 0 tokens (0: no cap), got {args.prefill_chunk}")
    if args.host_gib is not None and not args.host_gib > 0:
        parser.error(f"--host-gib must be > 0, got {args.host_gib}")
    if not args.host_gbps > 0:
        parser.error(f"--host-gbps must be > 0, got {args.host_gbps}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'vllm-mimo[eval]'")
    source = load_source(parser, args)
    if source is None:
        return 2
    requests, source_name = source.requests, source.name
    params = SimParams(
        max_running=args.max_running, max_model_len=source.max_model_len, closed_loop=not args.open_loop,
        step_prefill_floor=args.step_prefill_floor, prefill_chunk=args.prefill_chunk, queue_lookahead=args.queue_lookahead,
        chunk_anchor_tokens=args.chunk_anchor_tokens, host_gib=args.host_gib, host_gbps=args.host_gbps,
    )
    print(f"replay: {source_name}, {len(requests)} requests, layout {args.layout}, engines {','.join(engines)}", file=sys.stderr)
    ideal = ideal_hits(requests)

    runs, failed = [], []
    for kv_gib in args.kv_gib:
        for engine in engines:
            try:
                runs.append(simulate(engine, args.layout, kv_gib, requests, ideal, params, progress=not args.quiet))
            except ValueError as e:
                # An engine that cannot serve the source at a budget (a request larger than its
                # pools) is a result, not the end of the run: listed in the table and the JSON.
                print(f"error: {engine} at {kv_gib} GiB: {e}", file=sys.stderr)
                failed.append({"engine": engine, "kv_gib": kv_gib, "error": str(e)})
                continue
            runs[-1].skipped_too_long = source.skipped_too_long
    if not runs:
        return 2
    print_table(runs)
    for f in failed:
        print(f"{f['engine']:<26}{f['kv_gib']:>8.2f}  cannot serve this source: {f['error']}")
    if args.json:
        args.json.write_text(json.dumps({
            "source": source_name, "stretch": args.stretch, "layout": args.layout, "params": asdict(params),
            "skipped_too_long": source.skipped_too_long,
            "runs": [r.as_dict() for r in runs],
            "failed": failed,
        }, indent=2) + "\n")
    if args.plot:
        plot(runs, args.plot, f"{source_name} on {args.layout}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Replay a workload on N plugin instances behind a router, with an optional shared L3.

    python -m eval.replay_cluster (--trace FILE | --workload NAME) --layout LAYOUT
        --kv-gib G --host-gib H [--instances 1,4,16] [--routers round-robin,session,kv-aware]
        [--l3 off,on] [--l3-gib S] [--l3-gbps B] [--load-weight W] [--load queued|active] [--json OUT]

Each instance is the plugin with a host tier (`eval.replay`'s engine `mimo-host`: the real
`HybridKVCacheManager`, `--kv-gib` device and `--host-gib` host bytes), stepped as
`eval.replay.simulate` steps one engine; all instances share one simulated clock: a request is
routed when it is sent, to the instance the router picks, and a session's next turn is sent when
its previous answer is complete on whichever instance ran it (closed loop; Mooncake traces carry
no answers, so their requests are sent at their timestamps).

Routers:
  round-robin  the i-th request sent goes to instance i mod N.
  session      a session's requests go to the instance its first request went to; a first
               request goes to the least loaded instance (queued prefill tokens, then requests
               waiting and running, then sessions it has; then the lowest index). A generated
               workload's session is its chain of turns; a Mooncake trace has no session ids,
               so a request continues the latest earlier request whose whole 512-token blocks
               start it, unless prompts of the trace part where those end (a shared prefix).
  kv-aware     per instance, an index of the blocks the instance's KV cache events announced
               (BlockStored / BlockRemoved, device or host medium; `EventIndex`), as a router
               reading the events (llm-d, NVIDIA Dynamo) keeps it. It predicts each instance's
               window-safe hit (Full blocks from the start and the SWA blocks of the window
               before the hit's end) and picks the highest
                   score = predicted hit tokens - W x load
               (`--load-weight` W, default 1; ties: lowest index). The load (`--load`) is the
               instance's queued prefill tokens (default: a queued prefill token delays this
               request as long as a hit token saves it, both one token of prefill compute) or
               its active tokens (all its requests' tokens, the KV they hold: Dynamo's load).

Shared L3 (`--l3 on`): one store of `--l3-gib` for all instances (`SimulatedL3`: the host
tiers' L3 protocol, LRU by put/got recency); each host tier demotes to it what it evicts, and
a hit that runs past device and host memory extends into what L3 holds, loaded at `--l3-gbps`
(added to the step that loads, as host loads are at `--host-gbps`).

Reported per (N, router, L3): hit tokens (window-safe, first admissions), their fraction of
the single-instance ideal, hit tokens loaded from host and L3, L3 bytes put and got, and
simulated TTFT (mean, p90) over all requests. The SINGLE-INSTANCE IDEAL of a row is one
`mimo-host` instance with all the cluster's memory (N x --kv-gib device, N x --host-gib host,
and the same L3 when L3 is on) serving all the traffic with one instance's compute (so its
TTFT is no ideal; only its hits are). The clairvoyant ideal (an infinite cache: the longest
prefix any earlier request computed) is printed for scale.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shlex
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eval.replay import (
    GIB,
    Arrivals,
    EngineReplay,
    SimParams,
    add_source_arguments,
    ideal_hits,
    load_source,
    make_request,
    simulate,
)
from eval.workloads import MOONCAKE_BLOCK, ReplayRequest, previous_turns
from vllm_mimo.kv_cache.contract import CacheObserver
from vllm_mimo.kv_cache.pools import Pool
from vllm_mimo.kv_cache.prefix_tree import L3

ENGINE = "mimo-host"
ROUTERS = ("round-robin", "session", "kv-aware")
DEFAULT_INSTANCES = (1, 4, 16)
DEFAULT_L3_GBPS = 10.0
DEFAULT_LOAD_WEIGHT = 1.0
FULL_KIND, SWA_KIND = "full_attention", "sliding_window"


# ------------------------------------------------------------------ shared L3


@dataclass
class L3Stats:
    """What the store did, in bytes."""

    bytes_put: int = 0
    """Bytes the host tiers demoted into the store (keys it did not hold already)."""
    bytes_got: int = 0
    """Bytes loads read from it."""
    evicted_keys: int = 0


class SimulatedL3:
    """A shared KV store behind every instance's host tier (reached through each instance's
    `L3Client`): one object per key (kind, page index, block hash) of
    `key_bytes` (one host page: a device block's bytes in every layer of its group), at most `capacity_bytes`,
    least recently put or got evicted first. `contains` does not count as a use."""

    def __init__(self, capacity_bytes: int, key_bytes: int) -> None:
        if key_bytes <= 0:
            raise ValueError(f"key_bytes must be > 0, got {key_bytes}")
        self.capacity_keys = capacity_bytes // key_bytes
        self.key_bytes = key_bytes
        self.keys: OrderedDict[Hashable, None] = OrderedDict()
        self.stats = L3Stats()

    def key(self, kind: str, index: int, block_hash: Any) -> Hashable:
        return (kind, index, block_hash)

    def contains(self, keys: Sequence[Hashable]) -> list[bool]:
        return [k in self.keys for k in keys]

    def put(self, keys: Sequence[Hashable]) -> None:
        for k in keys:
            if k in self.keys:
                self.keys.move_to_end(k)
                continue
            if not self.capacity_keys:
                return
            while len(self.keys) >= self.capacity_keys:
                self.keys.popitem(last=False)
                self.stats.evicted_keys += 1
            self.keys[k] = None
            self.stats.bytes_put += self.key_bytes

    def got(self, keys: Sequence[Hashable]) -> None:
        for k in keys:
            if k in self.keys:
                self.keys.move_to_end(k)
        self.stats.bytes_got += len(keys) * self.key_bytes


class L3Client(CacheObserver):
    """One instance's handle on the shared store: the `L3Index` its host tier asks
    (`HybridKVCacheManager.attach_l3`), and what its worker would do: the pages its host tier
    puts (its `stored` events on medium L3, as they happen) go into the store, and the pages its
    loads read (`got`) are counted as bytes since the last `take_got_bytes` (its steps' L3 load
    time)."""

    def __init__(self, store: SimulatedL3, full_pages: int, swa_pages: int) -> None:
        self.store = store
        self.pages = {Pool.FULL: ("full", full_pages), Pool.SWA: ("swa", swa_pages)}
        self.got_bytes = 0

    def key(self, kind: str, index: int, block_hash: Any) -> Hashable:
        return self.store.key(kind, index, block_hash)

    def contains(self, keys: Sequence[Hashable]) -> list[bool]:
        return self.store.contains(keys)

    def stored(self, nodes: Sequence[Any], pool: Pool, medium: str) -> None:
        if medium == L3:
            kind, pages = self.pages[pool]
            self.store.put([self.key(kind, i, node.block_hash) for node in nodes for i in range(pages)])

    def got(self, keys: Sequence[Hashable]) -> None:
        self.store.got(keys)
        self.got_bytes += len(keys) * self.store.key_bytes

    def take_got_bytes(self) -> int:
        got, self.got_bytes = self.got_bytes, 0
        return got


# ------------------------------------------------------------------ KV events


class EventIndex:
    """What a router knows of one instance's KV cache: per (KV cache group, medium), the block
    hashes its KV cache events (`HybridKVCacheManager.take_events`: vLLM's `BlockStored`,
    `BlockRemoved`, `AllBlocksCleared`) announced as stored and not since removed, and each
    group's kind, from its stores."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, str | None], set[Any]] = {}
        self.first_group: dict[str, int] = {}
        """Per kind (Full, SWA), the lowest group index of that kind seen."""

    def apply(self, events: Sequence[Any]) -> None:
        from vllm_mimo.compat import AllBlocksCleared, BlockRemoved, BlockStored

        for event in events:
            if isinstance(event, BlockStored):
                kind = SWA_KIND if event.kv_cache_spec_sliding_window else FULL_KIND
                gid = event.group_idx if event.group_idx is not None else 0
                self.first_group[kind] = min(self.first_group.get(kind, gid), gid)
                self.held.setdefault((gid, event.medium), set()).update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                gid = event.group_idx if event.group_idx is not None else 0
                self.held.get((gid, event.medium), set()).difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.held.clear()

    def predicted_hit(self, keys: Sequence[Any], window_blocks: int) -> int:
        """Positions of the longest window-safe hit on `keys` (a request's position hashes as
        events name them: the hash of a position's last block names it in every group), on
        device or host: the largest L with the Full KV of keys[:L] held and the SWA KV of
        keys[L - window_blocks : L] held. One group of each kind stands for all: the cache
        stores and evicts a position's KV of a pool in every group of that pool at once."""
        if FULL_KIND not in self.first_group:
            return 0
        full = self._sets(FULL_KIND)
        swa = self._sets(SWA_KIND) if SWA_KIND in self.first_group else []
        best = run = 0
        for pos, key in enumerate(keys):
            if not any(key in held for held in full):
                break
            run = run + 1 if any(key in held for held in swa) else 0
            if run >= min(window_blocks, pos + 1):
                best = pos + 1
        return best

    def _sets(self, kind: str) -> list[set[Any]]:
        gid = self.first_group[kind]
        return [held for (g, _), held in self.held.items() if g == gid]


# ------------------------------------------------------------------ instances and routers


class Instance(EngineReplay):
    """One plugin instance of the cluster: `EngineReplay` of `mimo-host`, its steps longer by
    the bytes its loads read from L3 over `l3_gbps`, and with `events` its KV cache events
    indexed after every step (`EventIndex`, for the kv-aware router)."""

    def __init__(self, layout: str, kv_gib: float, requests: list[ReplayRequest], ideal: list[int],
                 params: SimParams, l3: SimulatedL3 | None, l3_gbps: float, events: bool) -> None:
        from vllm_mimo.engine.kv_manager import HybridKVCacheManager

        factory = functools.partial(HybridKVCacheManager, enable_kv_cache_events=events)
        super().__init__(ENGINE, layout, kv_gib, requests, ideal, params, mimo_factory=factory)
        self.l3: L3Client | None = None
        if l3 is not None:
            geometry = self.manager.geometry
            self.l3 = L3Client(l3, geometry.full_ids_per_position, geometry.swa_ids_per_position)
            self.manager.cache.subscribe(self.l3)
            # Asked at every lookup: this store evicts at once, and a stale answer would count a
            # hit whose read the engine would find missing (it recomputes there).
            self.manager.attach_l3(self.l3, answer_ttl_s=0.0)
        self.l3_gbps = l3_gbps
        self.index = EventIndex()
        self.window_blocks = self.manager.geometry.window_blocks

    def step(self) -> list[str]:
        done = super().step()
        self.index.apply(self.manager.take_events())  # as a router subscribed to the events sees them
        self.manager.take_puts()  # host-to-L3 copies run beside the steps: counted, not timed
        return done

    def loading_from_l3(self, fetches: list) -> None:
        if self.l3 is not None:
            self.l3.got([key for fetch in fetches for key in fetch.keys])

    def step_seconds(self, prefill_tokens: int, loaded_bytes: int) -> float:
        seconds = super().step_seconds(prefill_tokens, loaded_bytes)
        if self.l3 is not None:
            seconds += self.l3.take_got_bytes() / (self.l3_gbps * 1e9)
        return seconds

    def queued_tokens(self) -> int:
        """Prompt tokens still to prefill here: waiting requests' and running prefills'."""
        waiting = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        running = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self.running)
        return waiting + running

    def active_tokens(self) -> int:
        """Tokens of the requests waiting, loading and running here: the KV they hold or will
        hold (NVIDIA Dynamo's active blocks, in tokens)."""
        return sum(r.num_tokens for r in (*self.waiting, *self.loading.values(), *self.running))

    def predicted_hit_tokens(self, request: Any) -> int:
        """The window-safe hit this instance's events predict for a request."""
        from vllm_mimo.compat import maybe_convert_block_hash

        positions = (request.num_tokens - 1) // self.manager.block_size
        keys = [maybe_convert_block_hash(h) for h in self.manager.cache.position_hashes(request, positions)]
        return self.index.predicted_hit(keys, self.window_blocks) * self.manager.block_size


class Router:
    """Picks an instance for each request sent."""

    def choose(self, i: int, request: Any, instances: Sequence[Instance]) -> int:
        raise NotImplementedError


class RoundRobin(Router):
    def __init__(self) -> None:
        self.sent = 0

    def choose(self, i: int, request: Any, instances: Sequence[Instance]) -> int:
        self.sent += 1
        return (self.sent - 1) % len(instances)


class SessionAffinity(Router):
    """A session to one instance, its first request to the least loaded: the fewest queued
    prefill tokens, then the fewest requests waiting and running, then the fewest sessions."""

    def __init__(self, session_of: list[int]) -> None:
        self.session_of = session_of
        self.home: dict[int, int] = {}

    def choose(self, i: int, request: Any, instances: Sequence[Instance]) -> int:
        session = self.session_of[i]
        if session not in self.home:
            homed = Counter(self.home.values())

            def load(k: int) -> tuple[int, int, int]:
                x = instances[k]
                return x.queued_tokens(), len(x.waiting) + len(x.running) + len(x.loading), homed[k]

            self.home[session] = min(range(len(instances)), key=load)
        return self.home[session]


class KVAware(Router):
    """The highest predicted hit less `load_weight` x the instance's load: its queued prefill
    tokens (`queued`) or its active tokens (`active`)."""

    def __init__(self, load_weight: float, load: str) -> None:
        self.load_weight = load_weight
        self.load = load

    def choose(self, i: int, request: Any, instances: Sequence[Instance]) -> int:
        def load(x: Instance) -> int:
            return x.queued_tokens() if self.load == "queued" else x.active_tokens()

        scores = [x.predicted_hit_tokens(request) - self.load_weight * load(x) for x in instances]
        return max(range(len(instances)), key=lambda k: (scores[k], -k))


def sessions(requests: list[ReplayRequest]) -> list[int]:
    """Per request, its session (the index of the session's first request): the chain of turns
    (`previous_turns`), or for a trace without answers the latest earlier request whose prompt
    but for its partial last block starts this one (Mooncake block ids are chained, so the id
    of a prompt's last whole block names all of it)."""
    previous = previous_turns(requests)
    if not any(p is not None for p in previous):
        previous = _mooncake_previous(requests)
    out: list[int] = []
    for i, prev in enumerate(previous):
        out.append(out[prev] if prev is not None else i)
    return out


def _mooncake_previous(requests: list[ReplayRequest]) -> list[int | None]:
    """The latest earlier request whose whole blocks start this prompt and end where no two
    prompts of the trace part (an end shared by diverging prompts is a shared prefix, such as a
    system prompt, not a conversation; clients know their session ids in advance, so reading
    the whole trace for them is fair)."""
    wholes = [[s.key for s in r.prompt if s.length == MOONCAKE_BLOCK] for r in requests]
    following: dict[int, set[int]] = {}
    for whole in wholes:
        for key, after in zip(whole, whole[1:], strict=False):
            following.setdefault(key, set()).add(after)
    ends: dict[int, int] = {}  # a prompt's last whole block -> the latest request ending there
    out: list[int | None] = []
    for i, whole in enumerate(wholes):
        out.append(next((ends[k] for k in reversed(whole) if k in ends and len(following.get(k, ())) <= 1), None))
        if whole:
            ends[whole[-1]] = i
    return out


def make_router(name: str, requests: list[ReplayRequest], load_weight: float, load: str = "queued") -> Router:
    if name == "round-robin":
        return RoundRobin()
    if name == "session":
        return SessionAffinity(sessions(requests))
    return KVAware(load_weight, load)


# ------------------------------------------------------------------ the cluster


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster: N instances of `kv_gib` device and `host_gib` host memory, and the L3."""

    layout: str
    instances: int
    kv_gib: float
    host_gib: float
    l3_gib: float = 0.0
    """0: no L3."""
    l3_gbps: float = DEFAULT_L3_GBPS


@dataclass
class ClusterRun:
    """One (N, router, L3) point, or a single-instance ideal (router `single-instance`)."""

    instances: int
    router: str
    l3: bool
    kv_gib: float
    """Per instance."""
    host_gib: float
    l3_gib: float
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    host_hit_tokens: int = 0
    """Hit tokens loaded from host or L3 (part of `hit_tokens`)."""
    l3_hit_tokens: int = 0
    """Hit tokens loaded from L3 (part of `host_hit_tokens`), where the host tier counts them."""
    l3_bytes_put: int = 0
    l3_bytes_got: int = 0
    preemptions: int = 0
    ttft_mean_s: float = 0.0
    ttft_p90_s: float = 0.0
    sim_seconds: float = 0.0
    wall_seconds: float = 0.0
    requests_per_instance: list[int] = field(default_factory=list)
    single_instance_hit_tokens: int = 0
    """The single-instance ideal's hit tokens (N x the memory, the same L3)."""
    clairvoyant_hit_tokens: int = 0
    """An infinite cache's (`eval.replay.ideal_hits`)."""

    @property
    def of_single_instance(self) -> float:
        return self.hit_tokens / self.single_instance_hit_tokens if self.single_instance_hit_tokens else 0.0

    @property
    def of_clairvoyant(self) -> float:
        return self.hit_tokens / self.clairvoyant_hit_tokens if self.clairvoyant_hit_tokens else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {"of_single_instance": self.of_single_instance, "of_clairvoyant": self.of_clairvoyant}


def run_cluster(spec: ClusterSpec, router_name: str, requests: list[ReplayRequest], ideal: list[int],
                params: SimParams, load_weight: float = DEFAULT_LOAD_WEIGHT, progress: bool = True,
                load: str = "queued") -> ClusterRun:
    """Replay `requests` on the cluster behind one router, all instances on one clock."""
    wall0 = time.perf_counter()
    params = SimParams(**{**asdict(params), "host_gib": spec.host_gib})
    l3 = _make_l3(spec, params)
    events = router_name == "kv-aware"
    instances = [
        Instance(spec.layout, spec.kv_gib, requests, ideal, params, l3, spec.l3_gbps, events) for _ in range(spec.instances)
    ]
    router = make_router(router_name, requests, load_weight, load)
    arrivals = Arrivals(requests, params.closed_loop)
    hasher = instances[0].hasher
    sent = [0] * spec.instances
    finished, last_report = 0, 0.0
    while True:
        busy = [x for x in instances if x.busy]
        next_step = min((x.now for x in busy), default=math.inf)
        if arrivals and arrivals.next_s <= next_step:  # sent before the next step starts
            sent_s, i = arrivals.pop()
            request = make_request(requests, i, sent_s, hasher)
            k = router.choose(i, request, instances)
            target = instances[k]
            if not target.busy:
                target.now = max(target.now, sent_s)
            target.enqueue(request)
            sent[k] += 1
            continue
        if not busy:
            break
        stepping = min(busy, key=lambda x: x.now)
        for rid in stepping.step():
            arrivals.finished(rid, stepping.now)
            finished += 1
        if progress and time.perf_counter() - last_report > 5:
            last_report = time.perf_counter()
            print(
                f"\r  N={spec.instances:<3} {router_name:<12} L3 {'on ' if l3 else 'off'}  {finished}/{len(requests)} done  "
                f"sim {stepping.now:8.1f}s  wall {last_report - wall0:6.1f}s",
                end="", file=sys.stderr, flush=True,
            )
    if progress:
        print("\r" + " " * 90 + "\r", end="", file=sys.stderr)
    run = _collect(spec, router_name, [x.finish() for x in instances], [x.host for x in instances], l3)
    run.requests_per_instance = sent
    run.wall_seconds = time.perf_counter() - wall0
    return run


def single_instance(spec: ClusterSpec, requests: list[ReplayRequest], ideal: list[int], params: SimParams,
                    progress: bool = True) -> ClusterRun:
    """The single-instance ideal of a cluster: one `mimo-host` instance with all its memory
    (N x device, N x host, the same L3) serving all the traffic."""
    wall0 = time.perf_counter()
    one = ClusterSpec(spec.layout, 1, spec.instances * spec.kv_gib, spec.instances * spec.host_gib, spec.l3_gib, spec.l3_gbps)
    if not spec.l3_gib:
        params = SimParams(**{**asdict(params), "host_gib": one.host_gib})
        result = simulate(ENGINE, spec.layout, one.kv_gib, requests, ideal, params, progress=progress)
        run = _collect(one, "single-instance", [result], [], None)
    else:
        run = run_cluster(one, "round-robin", requests, ideal, params, progress=progress)
        run.router = "single-instance"
    run.instances, run.kv_gib, run.host_gib = spec.instances, spec.kv_gib, spec.host_gib
    run.requests_per_instance = [len(requests)]
    run.wall_seconds = time.perf_counter() - wall0
    return run


def _make_l3(spec: ClusterSpec, params: SimParams) -> SimulatedL3 | None:
    if not spec.l3_gib:
        return None
    from eval.layouts import LAYOUTS, kv_cache_config, model_less_vllm_config
    from eval.replay import page_bytes

    vllm_config = model_less_vllm_config(params.max_model_len, params.token_budget, params.max_running)
    key_bytes = page_bytes(kv_cache_config(LAYOUTS[spec.layout], int(spec.kv_gib * GIB), vllm_config))
    return SimulatedL3(int(spec.l3_gib * GIB), key_bytes)


def _collect(spec: ClusterSpec, router: str, results: list, hosts: list, l3: SimulatedL3 | None) -> ClusterRun:
    """One row from the instances' results."""
    run = ClusterRun(spec.instances, router, l3 is not None, spec.kv_gib, spec.host_gib, spec.l3_gib)
    first = sorted(t.ttft_s for r in results for t in r.first_tokens.values())
    run.requests = len(first)
    run.prompt_tokens = sum(r.prompt_tokens for r in results)
    run.hit_tokens = sum(r.hit_tokens for r in results)
    run.host_hit_tokens = sum(r.host_hit_tokens for r in results)
    run.preemptions = sum(r.preemptions for r in results)
    run.clairvoyant_hit_tokens = sum(r.ideal_hit_tokens for r in results)
    run.sim_seconds = max(r.sim_seconds for r in results)
    run.l3_hit_tokens = sum(getattr(h.stats, "l3_hit_tokens", 0) for h in hosts if h is not None)
    if l3 is not None:
        run.l3_bytes_put, run.l3_bytes_got = l3.stats.bytes_put, l3.stats.bytes_got
    if first:
        run.ttft_mean_s = sum(first) / len(first)
        run.ttft_p90_s = first[int(0.9 * (len(first) - 1))]
    return run


# ------------------------------------------------------------------ output


def print_table(runs: list[ClusterRun]) -> None:
    header = (
        f"{'N':>3} {'router':<16}{'L3':>4}{'prompt':>11}{'hit':>11}{'of 1-inst':>10}{'of inf':>8}{'host+L3 hit':>12}"
        f"{'L3 hit':>10}{'L3 put GB':>10}{'L3 got GB':>10}{'TTFT s':>9}{'p90':>9}{'preempt':>8}{'req/inst max/min':>18}"
    )
    print(header)
    print("-" * len(header))
    for r in runs:
        share = f"{max(r.requests_per_instance)}/{min(r.requests_per_instance)}" if r.requests_per_instance else "-"
        print(
            f"{r.instances:>3} {r.router:<16}{'on' if r.l3 else 'off':>4}{r.prompt_tokens:>11}{r.hit_tokens:>11}"
            f"{100 * r.of_single_instance:>9.1f}%{100 * r.of_clairvoyant:>7.1f}%{r.host_hit_tokens:>12}{r.l3_hit_tokens:>10}"
            f"{r.l3_bytes_put / 1e9:>10.1f}{r.l3_bytes_got / 1e9:>10.1f}{r.ttft_mean_s:>9.2f}{r.ttft_p90_s:>9.2f}"
            f"{r.preemptions:>8}{share:>18}"
        )


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _choices(allowed: Sequence[str]):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {', '.join(allowed)}")
        return list(dict.fromkeys(values))

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eval.replay_cluster", description=__doc__.split("\n\n", 1)[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_source_arguments(parser)
    parser.add_argument("--kv-gib", type=float, required=True, help="device KV memory of each instance, GiB, > 0")
    parser.add_argument("--host-gib", type=float, required=True, help="host KV memory of each instance, GiB, > 0")
    parser.add_argument(
        "--instances", type=_int_list, default=list(DEFAULT_INSTANCES), metavar="N,N,...",
        help="cluster sizes, each >= 1 (default: 1,4,16); at N = 1 every router is the same, so one row is run",
    )
    parser.add_argument(
        "--routers", type=_choices(ROUTERS), default=list(ROUTERS), metavar="R,R,...",
        help=f"routers: {', '.join(ROUTERS)} (default: all)",
    )
    parser.add_argument("--l3", type=_choices(("off", "on")), default=["off", "on"], metavar="off,on",
                        help="run without and/or with the shared L3 (default: off,on)")
    parser.add_argument(
        "--l3-gib", type=float, metavar="GIB",
        help="the shared L3's size, GiB, > 0, the same at every N (default: the largest N x --host-gib: "
        "as much as all the hosts of the largest cluster)",
    )
    parser.add_argument(
        "--l3-gbps", type=float, default=DEFAULT_L3_GBPS, metavar="GB/S",
        help=f"bandwidth of loads from L3 into an instance, GB/s, > 0, added to the step that loads (default: "
        f"{DEFAULT_L3_GBPS:g}: a shared store over a 100 Gb/s RDMA NIC moves about 12 GB/s at line rate, "
        "10 after protocol overhead)",
    )
    parser.add_argument(
        "--load-weight", type=float, default=DEFAULT_LOAD_WEIGHT, metavar="W",
        help="kv-aware: score = predicted hit tokens - W x load (--load), W >= 0 (default: "
        f"{DEFAULT_LOAD_WEIGHT:g}: a queued prefill token delays the request as long as a hit token saves it)",
    )
    parser.add_argument(
        "--load", choices=("queued", "active"), default="queued",
        help="kv-aware: an instance's load is its queued prefill tokens (queued, the default: what delays a "
        "new request's prefill) or the tokens of all its requests waiting and running (active: the KV they "
        "hold, NVIDIA Dynamo's active blocks)",
    )
    parser.add_argument("--max-running", type=int, default=SimParams.max_running,
                        help=f"cap on running requests per instance (default: {SimParams.max_running})")
    parser.add_argument("--no-single-instance", action="store_true",
                        help="skip the single-instance ideal runs (the fraction column then reads 0)")
    parser.add_argument("--json", type=Path, help="write the runs as JSON here (e.g. eval/results/cluster-<source>.json)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("kv_gib", "host_gib", "l3_gbps"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.l3_gib is not None and not args.l3_gib > 0:
        parser.error(f"--l3-gib must be > 0, got {args.l3_gib}")
    if not args.load_weight >= 0:
        parser.error(f"--load-weight must be >= 0, got {args.load_weight}")
    if args.max_running < 1:
        parser.error(f"--max-running must be >= 1, got {args.max_running}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    source = load_source(parser, args)
    if source is None:
        return 2
    requests = source.requests
    params = SimParams(max_running=args.max_running, max_model_len=source.max_model_len, closed_loop=not args.open_loop)
    l3_gib = args.l3_gib if args.l3_gib is not None else max(args.instances) * args.host_gib
    ideal = ideal_hits(requests)
    print(
        f"replay_cluster: {source.name}, {len(requests)} requests, layout {args.layout}, per instance "
        f"{args.kv_gib:g} GiB device + {args.host_gib:g} GiB host, L3 {l3_gib:g} GiB at {args.l3_gbps:g} GB/s",
        file=sys.stderr,
    )
    runs: list[ClusterRun] = []

    def write_json() -> None:  # after every (N, L3) block: a long run's finished rows are kept
        if not args.json:
            return
        args.json.write_text(json.dumps({
            "commands": ["PYTHONHASHSEED=0 python -m eval.replay_cluster " + shlex.join(sys.argv[1:] if argv is None else argv)],
            "source": source.name, "stretch": args.stretch, "layout": args.layout, "engine": ENGINE,
            "params": asdict(params), "l3_gib": l3_gib, "l3_gbps": args.l3_gbps, "load_weight": args.load_weight,
            "load": args.load,
            "skipped_too_long": source.skipped_too_long, "runs": [r.as_dict() for r in runs],
        }, indent=2) + "\n")

    try:
        for n in args.instances:
            for l3 in args.l3:
                spec = ClusterSpec(args.layout, n, args.kv_gib, args.host_gib, l3_gib if l3 == "on" else 0.0, args.l3_gbps)
                rows = [run_cluster(spec, r, requests, ideal, params, args.load_weight, not args.quiet, args.load)
                        for r in (args.routers[:1] if n == 1 else args.routers)]
                if n == 1:  # one instance: every router sends everything to it, and it is the ideal
                    rows[0].router = "any"
                    single = rows[0]
                elif args.no_single_instance:
                    single = None
                else:
                    single = single_instance(spec, requests, ideal, params, not args.quiet)
                for row in [*([single] if single and n > 1 else []), *rows]:
                    row.single_instance_hit_tokens = single.hit_tokens if single else 0
                    runs.append(row)
                write_json()
                print(f"  N={n} L3 {l3}: done", file=sys.stderr)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        "hit: window-safe hit tokens; of 1-inst: of the single-instance ideal (one instance with N x the "
        "memory and the same L3, all the traffic); of inf: of an infinite cache's (clairvoyant)"
    )
    print_table(runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

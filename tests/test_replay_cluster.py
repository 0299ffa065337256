"""eval/replay_cluster.py: N instances on one clock, routers, the shared L3, bad input."""

from __future__ import annotations

import json

import pytest

from eval import replay, replay_cluster
from eval.replay_cluster import ClusterSpec, EventIndex, SimulatedL3, run_cluster, sessions
from eval.workloads import ReplayRequest, Segment, make_workload

LAYOUT = "mimo-v2.5-pro"


@pytest.fixture(scope="module")
def workload() -> tuple[list[ReplayRequest], list[int]]:
    requests = make_workload("agent-sessions")[:40]
    return requests, replay.ideal_hits(requests)


def _run(workload, n: int, router: str, l3_gib: float = 0.0, host_gib: float = 1.0) -> replay_cluster.ClusterRun:
    requests, ideal = workload
    spec = ClusterSpec(LAYOUT, n, 1.0, host_gib, l3_gib)
    return run_cluster(spec, router, requests, ideal, replay.SimParams(), progress=False)


def test_one_instance_is_the_single_instance_replay(workload):
    requests, ideal = workload
    alone = replay.simulate("mimo-host", LAYOUT, 1.0, requests, ideal, replay.SimParams(host_gib=1.0), progress=False)
    for router in ("round-robin", "kv-aware"):  # kv-aware: the manager records KV events too
        run = _run(workload, 1, router)
        assert (run.hit_tokens, run.prompt_tokens, run.host_hit_tokens) == (
            alone.hit_tokens, alone.prompt_tokens, alone.host_hit_tokens
        )
        assert run.ttft_mean_s == pytest.approx(alone.ttft_mean_s) and run.sim_seconds == pytest.approx(alone.sim_seconds)
        assert run.clairvoyant_hit_tokens == alone.ideal_hit_tokens and run.requests_per_instance == [len(requests)]


def test_kv_aware_routing_hits_at_least_round_robin(workload):
    kv_aware, round_robin = _run(workload, 4, "kv-aware"), _run(workload, 4, "round-robin")
    assert kv_aware.hit_tokens >= round_robin.hit_tokens
    assert round_robin.requests_per_instance == [10, 10, 10, 10]
    assert kv_aware.prompt_tokens == round_robin.prompt_tokens


def test_the_shared_l3_adds_hits(workload):
    off, on = _run(workload, 1, "round-robin", host_gib=0.5), _run(workload, 1, "round-robin", 4.0, host_gib=0.5)
    assert on.hit_tokens >= off.hit_tokens
    assert on.l3_bytes_put > 0 and off.l3_bytes_put == off.l3_bytes_got == 0


def test_simulated_l3_keeps_the_most_recently_used_within_its_capacity():
    store = SimulatedL3(capacity_bytes=3 * 100 + 99, key_bytes=100)
    keys = [store.key("full", 0, h) for h in range(4)]
    store.put(keys[:3])
    store.got(keys[:1])  # 0 is now the most recent
    store.put(keys[3:])  # evicts 1, the least recent
    assert store.contains(keys) == [True, False, True, True]
    store.put(keys[2:3])  # already held: no bytes moved
    assert store.stats.bytes_put == 4 * 100 and store.stats.bytes_got == 100 and store.stats.evicted_keys == 1
    assert len(store.keys) == 3


def test_event_index_predicts_window_safe_hits():
    from vllm_mimo.compat import BlockRemoved, BlockStored

    def stored(hashes: list[int], gid: int, window: int | None, medium: str = "GPU") -> BlockStored:
        return BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16, lora_id=None, medium=medium,
            lora_name=None, group_idx=gid, kv_cache_spec_kind="sliding_window" if window else "full_attention",
            kv_cache_spec_sliding_window=window,
        )

    index = EventIndex()
    index.apply([stored(list(range(10)), 0, None), stored([2, 3], 1, 128), stored([7], 1, 128, "CPU"), stored([6], 1, 128)])
    assert index.predicted_hit(list(range(12)), window_blocks=2) == 8  # keys 6 (device) and 7 (host)
    index.apply([BlockRemoved(block_hashes=[7], medium="CPU", group_idx=1)])
    assert index.predicted_hit(list(range(12)), window_blocks=2) == 4
    index.apply([BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0)])
    assert index.predicted_hit(list(range(12)), window_blocks=2) == 0


def test_a_mooncake_session_continues_the_request_whose_prompt_starts_it():
    block = replay_cluster.MOONCAKE_BLOCK

    def request(t: float, ids: list[int], tail: int) -> ReplayRequest:
        prompt = tuple(Segment(k, block) for k in ids[:-1]) + (Segment(ids[-1], tail),)
        return ReplayRequest(t, prompt, Segment(10_000 + int(t), 5))

    trace = [
        request(0, [1, 2, 3], 100),  # session 0
        request(1, [7, 8], 10),  # session 1
        request(2, [1, 2, 3, 4, 5], 30),  # continues 0: its whole blocks 1, 2 start this prompt
        request(3, [1, 2, 3, 4, 5, 6], 1),  # continues 2
        request(4, [7, 9], 10),  # its block 7 is request 1's last whole block: session 1
    ]
    assert sessions(trace) == [0, 1, 0, 0, 1]
    # Prompts part after block 2 (blocks 3 and 4 follow it): a shared prefix, no session's end.
    shared = [request(0, [1, 2, 3], 100), request(1, [1, 2, 4, 6], 100), request(2, [1, 2, 3, 5], 9)]
    assert sessions(shared) == [0, 1, 2]


def test_bad_values_are_refused(capsys, tmp_path):
    base = ["--workload", "agent-sessions", "--layout", LAYOUT, "--max-requests", "5"]
    for args, message in (
        (["--kv-gib", "0", "--host-gib", "1"], "--kv-gib must be > 0"),
        (["--kv-gib", "1", "--host-gib", "1", "--routers", "random"], "choose from round-robin"),
        (["--kv-gib", "1", "--host-gib", "1", "--instances", "0"], "integers >= 1"),
        (["--kv-gib", "1", "--host-gib", "1", "--l3-gib", "-2"], "--l3-gib must be > 0"),
        (["--kv-gib", "1", "--host-gib", "1", "--load-weight", "-1"], "--load-weight must be >= 0"),
    ):
        with pytest.raises(SystemExit):
            replay_cluster.main([*base, *args])
        assert message in capsys.readouterr().err


def test_the_table_and_json(tmp_path, capsys):
    out = tmp_path / "cluster.json"
    assert replay_cluster.main([
        "--workload", "agent-sessions", "--layout", LAYOUT, "--max-requests", "12", "--kv-gib", "1", "--host-gib", "1",
        "--instances", "1,2", "--l3", "off", "--routers", "round-robin", "--json", str(out), "--quiet",
    ]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["instances"], r["router"]) for r in runs] == [(1, "any"), (2, "single-instance"), (2, "round-robin")]
    assert runs[0]["of_single_instance"] == 1.0 and runs[1]["of_single_instance"] == 1.0
    assert "single-instance" in capsys.readouterr().out

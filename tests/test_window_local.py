"""Window-local SWA attention (`vllm_mimo.attention_backends`).

Fast lane: the plan lays every request's window out in scratch; the torch arithmetic (cached
part and chunk part merged by log-sum-exp, sinks once) against a float64 dense reference,
with window edges, sinks and q/k and v head sizes that differ; vLLM's CPU kernel run over the
plan against the same reference; the CUDA path's split plan run through FlashInfer's mask rule
against it; negative controls for each.

Engine lane (float32, the tiny models): greedy tokens with the plugin off and on with
`window-local` are the same on the `mimo` (MTP drafting on) and `gemma3` layouts (on `mimo`
also on with `stock`: the same tokens, hits and drafts, more SWA blocks), for prompts of 100 to
6,000 tokens (3,000 on `gemma3`) in 1,000-token steps (chunks larger than, equal to and smaller
than W, batches mixing decode and prefill), hits at anchors inside earlier chunks (mid-window:
W = one 128-token block); the manager hands out null blocks inside chunks; a manager that
keeps one position fewer gives different tokens. Preemption with window-local attention (and
with `stock`) is in tests/test_engine_kv_manager.py, and so is `mimo-flash` with window-local
attention (its sessions under preemption and MTP, plugin on against off): its runs here went
to keep `make test` under 30 minutes.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import run_engine
from tests.prompts import corpus_ids
from vllm_mimo.attention_backends.plan import WindowPlan, mask_null_slots, plan_split, window_layout
from vllm_mimo.attention_backends.reference import combine_split, window_local_prefill

# ------------------------------------------------------------------ the plan


def plan_window_local(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, window: int, block_size: int
) -> WindowPlan:
    """One group's step planned on its own (the backend shares one layout between groups)."""
    return window_layout(query_start_loc, seq_lens, window, block_size).plan(block_table)


def _plan_case():
    """Three requests over a 4-token-block cache: a decode, a chunk after a long context, a
    first chunk; W = 6."""
    torch.manual_seed(0)
    bs, window = 4, 6
    q_lens, seq_lens = [1, 7, 5], [13, 20, 5]
    table = torch.randperm(40)[:18].reshape(3, 6).to(torch.int32) + 1
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return bs, window, q_lens, seq_lens, table, qsl


def test_plan_puts_each_requests_window_and_chunk_in_scratch():
    bs, window, q_lens, seq_lens, table, qsl = _plan_case()
    plan = plan_window_local(qsl, torch.tensor(seq_lens, dtype=torch.int32), table, window, bs)
    cache = torch.arange(41 * bs).reshape(41, bs)  # each slot holds its own cache slot id
    scratch = torch.full((plan.num_blocks, bs), -1)
    scratch[plan.copy_dst] = cache[plan.copy_src]
    marker = 10_000
    scratch.view(-1)[plan.token_slots] = marker + torch.arange(int(qsl[-1]))
    for r, (q, n) in enumerate(zip(q_lens, seq_lens, strict=True)):
        context = n - q
        base = int(plan.first_block[r]) * bs
        assert int(plan.seq_lens[r]) == n - base
        for pos in range(max(0, context - (window - 1)), n):
            scratch_slot = int(plan.block_table[r, (pos - base) // bs]) * bs + (pos - base) % bs
            want = marker + int(qsl[r]) + pos - context if pos >= context else int(table[r, pos // bs]) * bs + pos % bs
            assert int(scratch.view(-1)[scratch_slot]) == want, (r, pos)
    # Only blocks inside some window were copied: O(W) per request, not the whole context.
    assert plan.copy_src.numel() <= sum(math.ceil((window - 1) / bs) + 1 for _ in q_lens)


def test_the_swa_groups_of_a_step_share_its_layout_and_plan_their_own_block_tables():
    from vllm_mimo.attention_backends.cpu import step_layout

    bs, window, q_lens, seq_lens, table, qsl = _plan_case()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    other_group = torch.flip(table, dims=[1]) + 100  # the same requests, other block ids
    layout, schedules = step_layout(qsl, lens, window, bs)
    for group_table in (table, other_group):
        again, same_schedules = step_layout(qsl.clone(), lens.clone(), window, bs)
        assert again is layout and same_schedules is schedules
        shared, own = again.plan(group_table), plan_window_local(qsl, lens, group_table, window, bs)
        for name in own.__dataclass_fields__:
            a, b = getattr(shared, name), getattr(own, name)
            assert (torch.equal(a, b) and a.dtype == b.dtype) if isinstance(a, torch.Tensor) else a == b, name
    assert not torch.equal(layout.plan(table).copy_src, layout.plan(other_group).copy_src)
    # Other lengths, or the same buffer refilled in place for the next step, get their own.
    assert step_layout(qsl, lens, window + 1, bs)[0] is not layout
    qsl[1:] += 1
    lens += 1
    refilled, _ = step_layout(qsl, lens, window, bs)
    assert refilled is not layout and int(refilled.token_slots.numel()) == int(qsl[-1])


def test_null_block_writes_are_dropped():
    slots = torch.tensor([0, 5, 15, 16, 40, -1])
    assert mask_null_slots(slots, 16).tolist() == [-1, -1, -1, 16, 40, -1]


# ------------------------------------------------------------ the arithmetic


def dense_reference(query, key, value, context, window, scale, sinks=None):
    """Float64 softmax over every key position 0..context+q-1 with the causal window mask and
    one sink logit per head: what SWA attention is, computed the plain way."""
    q, k, v = query.double(), key.double(), value.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    logits = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(context, context + q.shape[0])[:, None]
    gap = qpos - torch.arange(k.shape[0])[None, :]
    logits = logits.masked_fill(~((gap >= 0) & (gap < window))[None], float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.double()[:, None, None].expand(-1, q.shape[0], 1)], dim=-1)
    weights = torch.softmax(logits, dim=-1)[..., : k.shape[0]]
    return torch.einsum("hqk,khd->qhd", weights, v)


CASES = [
    # heads, kv heads, q/k head size, v head size, W, context, chunk
    (4, 2, 24, 16, 8, 0, 5),  # first chunk, shorter than W; DIFFKV
    (4, 2, 24, 16, 8, 3, 20),  # context shorter than W - 1, chunk longer than W
    (4, 4, 16, 16, 8, 7, 8),  # context exactly W - 1, chunk exactly W
    (6, 2, 32, 24, 5, 40, 11),  # long context, only its last W - 1 read
    (2, 1, 16, 16, 1, 9, 4),  # W = 1: a token attends to itself only
]


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("heads,kv_heads,dqk,dv,window,context,chunk", CASES)
def test_window_local_prefill_matches_the_dense_reference(heads, kv_heads, dqk, dv, window, context, chunk, sinks):
    torch.manual_seed(1)
    n = context + chunk
    key, value = torch.randn(n, kv_heads, dqk), torch.randn(n, kv_heads, dv)
    query = torch.randn(chunk, heads, dqk)
    sink = torch.randn(heads) if sinks else None
    scale = dqk**-0.5
    ours = window_local_prefill(
        query, key[context:], value[context:], key[:context], value[:context], context, window, scale, sink
    )
    want = dense_reference(query, key, value, context, window, scale, sink)
    assert ours.shape == (chunk, heads, dv)
    assert torch.allclose(ours.double(), want, atol=1e-5), (ours.double() - want).abs().max()


def test_dense_reference_comparison_can_fail():
    """Negative control: one cached key fewer than the window needs, or the sink applied twice,
    and the comparison above fails."""
    torch.manual_seed(1)
    heads, kv_heads, d, window, context, chunk = 4, 2, 16, 8, 12, 6
    key, value, query = (
        torch.randn(context + chunk, kv_heads, d),
        torch.randn(context + chunk, kv_heads, d),
        torch.randn(chunk, heads, d),
    )
    sink = torch.randn(heads)
    want = dense_reference(query, key, value, context, window, d**-0.5, sink)
    short = window_local_prefill(
        query,
        key[context:],
        value[context:],
        key[context - window + 2 : context],
        value[context - window + 2 : context],
        context,
        window,
        d**-0.5,
        sink,
    )
    assert not torch.allclose(short.double(), want, atol=1e-5)
    from vllm_mimo.attention_backends.reference import apply_sinks, attend, merge

    pos = torch.arange(context, context + chunk)
    out, lse = merge(
        attend(query, key[:context], value[:context], pos, torch.arange(context), window, d**-0.5),
        attend(query, key[context:], value[context:], pos, pos, window, d**-0.5),
    )
    twice = apply_sinks(apply_sinks(out, lse, sink), lse, sink)
    assert not torch.allclose(twice.double(), want, atol=1e-5)


# ------------------------------------------------- vLLM's CPU kernel over the plan


def _kernel_case(heads=4, kv_heads=2, d=64, bs=32, window=40, sinks=True, null_first_copy=False):
    """Requests with contexts in a real CPU-layout cache, their chunks attended through
    `cpu.attend`; returns (ours, the dense reference per request)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_mimo import compat
    from vllm_mimo.attention_backends.cpu import attend

    torch.manual_seed(2)
    isa = _get_attn_isa(torch.float32, bs, d)
    contexts, chunks = [0, 50, 100, 7], [70, 33, 1, 64]
    num_blocks = 64
    cache = torch.zeros(num_blocks, kv_heads, bs, 2 * d)
    key_cache, value_cache = cache.view(num_blocks, kv_heads, 2 * bs, d).chunk(2, dim=2)
    table = (torch.randperm(num_blocks - 1)[: 4 * 6] + 1).reshape(4, 6).to(torch.int32)
    keys = [torch.randn(c + q, kv_heads, d) for c, q in zip(contexts, chunks, strict=True)]
    values = [torch.randn(c + q, kv_heads, d) for c, q in zip(contexts, chunks, strict=True)]
    for r, c in enumerate(contexts):
        if c:
            slots = torch.tensor([int(table[r, p // bs]) * bs + p % bs for p in range(c)])
            compat.custom_ops.cpu_attn_reshape_and_cache(keys[r][:c], values[r][:c], key_cache, value_cache, slots, isa)
    query = torch.randn(sum(chunks), heads, d)
    qsl = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([c + q for c, q in zip(contexts, chunks, strict=True)], dtype=torch.int32)
    plan = plan_window_local(qsl, seq_lens, table, window, bs)
    if null_first_copy:  # as if the manager had kept no block for that part of a window
        plan = type(plan)(**{**plan.__dict__, "copy_src": torch.cat([plan.copy_src[:1] * 0, plan.copy_src[1:]])})
    schedule = compat.custom_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=4, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, seq_lens=plan.seq_lens, dtype=torch.float32,
        query_start_loc=qsl, causal=True, sliding_window_size=window, isa=isa, enable_kv_split=False,
    )
    sink = torch.randn(heads) if sinks else None
    new_k = torch.cat([k[c:] for k, c in zip(keys, contexts, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(values, contexts, strict=True)])
    output = torch.zeros(sum(chunks), heads, d)
    attend(query, new_k, new_v, cache, output, plan, schedule, qsl, isa=isa, scale=d**-0.5, window=window, sinks=sink)
    want = torch.cat([
        dense_reference(query[qsl[r] : qsl[r + 1]], keys[r], values[r], contexts[r], window, d**-0.5, sink)
        for r in range(4)
    ])
    return output, want


@pytest.mark.parametrize("sinks", [False, True])
def test_cpu_kernel_over_the_plan_matches_the_dense_reference(sinks):
    ours, want = _kernel_case(sinks=sinks)
    assert torch.allclose(ours.double(), want, atol=1e-4), (ours.double() - want).abs().max()


def test_cpu_kernel_comparison_can_fail():
    """Negative control: one block of a window is the (never written) null block, and the
    comparison fails."""
    ours, want = _kernel_case(null_first_copy=True)
    assert not torch.allclose(ours.double(), want, atol=1e-4)


# ------------------------------------- the split plan (the CUDA path's two calls)


def flashinfer_call(query, key, value, scale, causal, window_left):
    """One request of a FlashInfer prefill call computed by its mask rule
    (`include/flashinfer/attention/variants.cuh`, FlashInfer 0.7.2: key j is seen by query row
    i when j + qo_len + window_left >= kv_len + i, window_left -1 meaning no window; causal
    also needs j <= i + kv_len - qo_len), in float64: (output, natural-log LSE)."""
    q, k, v = query.double(), key.double(), value.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    rows, keys = q.shape[0], k.shape[0]
    i, j = torch.arange(rows)[:, None], torch.arange(keys)[None, :]
    seen = j + rows + (window_left if window_left >= 0 else keys) >= keys + i
    if causal:
        seen &= j <= i + keys - rows
    logits = (torch.einsum("qhd,khd->hqk", q, k) * scale).masked_fill(~seen[None], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1).nan_to_num(0.0), v)
    return out, lse.transpose(0, 1)


def _paged_requests():
    """Requests (a decode, a chunk longer than W, a chunk shorter than W - 1, a first chunk,
    contexts shorter than W - 1 and not block-aligned) over a paged cache `[pages, block size,
    kv heads, D]` whose positions outside every window hold large garbage, so a call that
    reads one gives a different result."""
    torch.manual_seed(3)
    heads, kv_heads, dqk, dv, bs, window = 4, 2, 24, 16, 4, 10
    contexts, chunks = [30, 17, 5, 0, 21, 3], [1, 23, 4, 12, 9, 2]
    num_pages = 80
    key_pages = torch.full((num_pages, bs, kv_heads, dqk), 1e4)
    value_pages = torch.full((num_pages, bs, kv_heads, dv), 1e4)
    table = (torch.randperm(num_pages - 1)[: 6 * 12] + 1).reshape(6, 12)
    keys = [torch.randn(c + q, kv_heads, dqk) for c, q in zip(contexts, chunks, strict=True)]
    values = [torch.randn(c + q, kv_heads, dv) for c, q in zip(contexts, chunks, strict=True)]
    for r, c in enumerate(contexts):
        for p in range(max(0, c - (window - 1)), c):  # only the window is ever kept
            key_pages[table[r, p // bs], p % bs] = keys[r][p]
            value_pages[table[r, p // bs], p % bs] = values[r][p]
    qsl = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()])
    return {
        "window": window, "bs": bs, "scale": dqk**-0.5, "sink": torch.randn(heads), "table": table,
        "key_pages": key_pages, "value_pages": value_pages, "qsl": qsl,
        "seq_lens": torch.tensor(contexts) + torch.tensor(chunks), "query": torch.randn(sum(chunks), heads, dqk),
        "new_k": torch.cat([k[c:] for k, c in zip(keys, contexts, strict=True)]),
        "new_v": torch.cat([v[c:] for v, c in zip(values, contexts, strict=True)]),
        "want": lambda query, scale, sink: torch.cat([
            dense_reference(query[qsl[r] : qsl[r + 1]], keys[r], values[r], contexts[r], window, scale, sink)
            for r in range(len(chunks))
        ]),
    }


def _split_case(context_window_left=0, context_causal=False):
    """`_paged_requests` with the two calls run as FlashInfer would run them
    (`flashinfer_call`) on the plan's arrays, merged by `combine_split`. Returns (the plan,
    ours, the dense reference)."""
    case = _paged_requests()
    window, bs, scale, sink, qsl, query = (case[k] for k in ("window", "bs", "scale", "sink", "qsl", "query"))
    new_k, new_v, key_pages, value_pages = (case[k] for k in ("new_k", "new_v", "key_pages", "value_pages"))
    plan = plan_split(qsl, case["seq_lens"], window, bs)
    chunk_out, chunk_lse = [], []
    for r in range(len(qsl) - 1):
        rows = slice(int(qsl[r]), int(qsl[r + 1]))
        out, lse = flashinfer_call(query[rows], new_k[rows], new_v[rows], scale, True, window - 1)
        chunk_out.append(out)
        chunk_lse.append(lse)
    pages = case["table"][plan.page_request, plan.page_column]
    context_out, context_lse = [], []
    for c in range(plan.context_requests.numel()):
        ids = pages[plan.page_indptr[c] : plan.page_indptr[c + 1]]
        n = (ids.numel() - 1) * bs + int(plan.last_page_len[c])
        rows = plan.context_rows[plan.context_qo_indptr[c] : plan.context_qo_indptr[c + 1]]
        out, lse = flashinfer_call(
            query[rows], key_pages[ids].flatten(0, 1)[:n], value_pages[ids].flatten(0, 1)[:n], scale,
            context_causal, context_window_left,
        )
        context_out.append(out)
        context_lse.append(lse)
    ours = combine_split(
        plan, (torch.cat(chunk_out), torch.cat(chunk_lse)), (torch.cat(context_out), torch.cat(context_lse)), sink
    )
    return plan, ours, case["want"](query, scale, sink)


def test_split_plan_computes_the_window_with_flashinfers_masks():
    plan, ours, want = _split_case()
    assert torch.allclose(ours, want, atol=1e-9), (ours - want).abs().max()
    # W - 1 context rows per request with a context, pages of that window only.
    assert plan.context_requests.tolist() == [0, 1, 2, 4, 5]
    assert plan.context_rows.numel() == 5 * 9
    assert int(plan.page_indptr[-1]) <= 5 * (math.ceil(9 / 4) + 1)


@pytest.mark.parametrize("window_left,causal", [(9, False), (0, True)])
def test_split_plan_comparison_can_fail(window_left, causal):
    """Negative control: the context call with the window it would have over the whole
    sequence (W - 1), or causal, and the comparison fails."""
    _, ours, want = _split_case(context_window_left=window_left, context_causal=causal)
    assert not torch.allclose(ours, want, atol=1e-9)


# ------------- the DIFFKV path's two FlashAttention calls (cuda_diffkv, K and V sizes differ)


def flash_attn_call(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                    block_table=None, softmax_scale=None, causal=False, window_size=None, softcap=0.0,
                    return_softmax_lse=False, fa_version=None, bottom_right=True):
    """`flash_attn_varlen_func` computed by its documented mask rule (vLLM's
    `vllm_flash_attn/flash_attn_interface.py`, 0.32 and 0.33: query row i of a sequence of sq
    rows and sk keys sees keys i + sk - sq - left .. i + sk - sq + right, -1 meaning no bound;
    causal also needs j <= i + sk - sq), in float64: keys ragged (`cu_seqlens_k`) or paged
    (`block_table`, `seqused_k`, `k` / `v` as `[blocks, block size, kv heads, D]`).
    `bottom_right=False` aligns the first row with the first key instead: the negative control."""
    assert return_softmax_lse and softcap == 0.0
    left, right = window_size or (-1, -1)
    outs, lses = [], []
    for r in range(len(cu_seqlens_q) - 1):
        qr = q[int(cu_seqlens_q[r]) : int(cu_seqlens_q[r + 1])].double()
        if block_table is None:
            kr, vr = (t[int(cu_seqlens_k[r]) : int(cu_seqlens_k[r + 1])].double() for t in (k, v))
        else:
            n = int(seqused_k[r])
            pages = block_table[r, : -(-n // k.shape[1])].long()
            kr, vr = (t[pages].flatten(0, 1)[:n].double() for t in (k, v))
        sq, sk = qr.shape[0], kr.shape[0]
        shift = sk - sq if bottom_right else 0
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        seen = torch.ones(sq, sk, dtype=torch.bool)
        if left >= 0:
            seen &= j >= i + shift - left
        if right >= 0:
            seen &= j <= i + shift + right
        if causal:
            seen &= j <= i + shift
        groups = qr.shape[1] // kr.shape[1]
        kr, vr = kr.repeat_interleave(groups, 1), vr.repeat_interleave(groups, 1)
        logits = (torch.einsum("qhd,khd->hqk", qr, kr) * softmax_scale).masked_fill(~seen[None], float("-inf"))
        lses.append(torch.logsumexp(logits, dim=-1))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1).nan_to_num(0.0), vr))
    return torch.cat(outs), torch.cat(lses, dim=1)  # [rows, heads, Dv], [heads, rows]


def _diffkv_case(bottom_right=True):
    """`_paged_requests` through `cuda_diffkv`: the plan over the step's block table, the two
    calls as FlashAttention computes them, merged with the sinks once. Returns (the plan,
    ours, the dense reference)."""
    from vllm_mimo.attention_backends.cuda_diffkv import attend, plan_step

    case = _paged_requests()
    plan = plan_step(case["qsl"], case["seq_lens"], case["table"], case["window"], case["bs"])
    ours = attend(
        case["query"], case["new_k"], case["new_v"], case["key_pages"], case["value_pages"], plan,
        scale=case["scale"], softcap=0.0, sinks=case["sink"], fa_version=3,
        varlen=lambda **kwargs: flash_attn_call(**kwargs, bottom_right=bottom_right),
    )
    return plan, ours, case["want"](case["query"], case["scale"], case["sink"])


def test_diffkv_path_computes_the_window_with_flash_attentions_masks():
    plan, ours, want = _diffkv_case()
    # `attend` merges in float32, as on the GPU.
    assert torch.allclose(ours.double(), want, atol=1e-6), (ours - want).abs().max()
    # Each context's pages, from the one holding context - (W - 1) to the one holding
    # context - 1; keys counted from the first page's first slot.
    contexts, bs, window = [30, 17, 5, 21, 3], 4, 10
    first = [max(0, c - (window - 1)) // bs for c in contexts]
    assert plan.context_keys.tolist() == [c - f * bs for c, f in zip(contexts, first, strict=True)]
    table = _paged_requests()["table"]
    for row, (r, c, f) in enumerate(zip([0, 1, 2, 4, 5], contexts, first, strict=True)):
        pages = (c - 1) // bs - f + 1
        assert plan.context_block_table[row, :pages].tolist() == table[r, f : f + pages].tolist()


def test_diffkv_path_with_no_context_makes_one_call():
    """A step of first chunks only: no context call, the chunk call alone, sinks once."""
    from vllm_mimo.attention_backends.cuda_diffkv import attend, plan_step

    torch.manual_seed(5)
    window, bs, scale, sink = 6, 4, 0.3, torch.randn(2)
    query, key, value = torch.randn(9, 2, 8), torch.randn(9, 1, 8), torch.randn(9, 1, 4)
    qsl = torch.tensor([0, 5, 9])
    plan = plan_step(qsl, torch.tensor([5, 4]), torch.zeros(2, 3, dtype=torch.int64), window, bs)
    calls = []

    def varlen(**kwargs):
        calls.append(kwargs)
        return flash_attn_call(**kwargs)

    ours = attend(query, key, value, torch.empty(0), torch.empty(0), plan, scale=scale, softcap=0.0,
                  sinks=sink, fa_version=3, varlen=varlen)
    want = torch.cat([dense_reference(query[a:b], key[a:b], value[a:b], 0, window, scale, sink) for a, b in ((0, 5), (5, 9))])
    assert len(calls) == 1 and plan.context_block_table.shape == (0, 0)
    assert torch.allclose(ours.double(), want, atol=1e-6)


def test_diffkv_path_leaves_decode_steps_to_vllm():
    """A step of at most one new token per request, plus the drafts with MTP, runs vLLM's code
    (the manager keeps every slot it reads), unless the drafts reach the window."""
    from types import SimpleNamespace

    from vllm_mimo.attention_backends.cuda_diffkv import decode_query_len

    assert decode_query_len(SimpleNamespace(speculative_config=None), 128) == 1
    mtp = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3))
    assert decode_query_len(mtp, 128) == 4
    assert decode_query_len(mtp, 4) == 1


def test_diffkv_path_comparison_can_fail():
    """Negative control: a kernel that aligned the first query row with the first key (not
    the last with the last) would read other keys, and the comparison tells."""
    _, ours, want = _diffkv_case(bottom_right=False)
    assert not torch.allclose(ours.double(), want, atol=1e-6)


# ------------------------------------------------------------------ the engine

OFF = {"VLLM_MIMO_ENABLE": "0"}
MODES = {"off": (OFF, None), "stock": ({}, "stock"), "window-local": ({}, "window-local")}
STEP_TOKENS = 1000  # chunks of up to 1,000 tokens; prompt remainders give 128 (= W) and 90
ENGINE = {"dtype": "float32", "max_model_len": 8192, "max_num_batched_tokens": STEP_TOKENS}
MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}


def _batches(ids: list[int], longest: int = 6000) -> list[list]:
    """Batch 1: five prompts of 100 to `longest` tokens at once (one declares an anchor at
    token 1,500, inside its second chunk). Batch 2: hits at the grid anchor at token 512
    (inside the longest prompt's first chunk), at the declared anchor, and at a prompt's end."""
    long = ids[8000 : 8000 + longest]
    declared = {"ids": ids[5000:7500], "extra_args": {"mimo": {"anchors": [1500]}}}
    first = [ids[:100], ids[1000:2128], ids[3000:4090], declared, long]
    second = [long[:600] + ids[20000:20050], ids[5000:6500] + ids[21000:21060], ids[1000:2128]]
    return [first, second]


def keep_one_position_fewer() -> None:
    """The negative control's manager (run in the engine's process): every request's SWA
    window starts one position later than the attention path reads."""
    from vllm_mimo.block_manager.cache import HybridKVCache

    start = HybridKVCache.window_start
    HybridKVCache.window_start = lambda self, processed: start(self, processed) + 1  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def engine_runs(tiny_models):
    """Per layout (on first use): one engine per mode on the same batches (`stock` on `mimo`
    only: each engine start costs the suite half a minute)."""
    done: dict[str, dict] = {}

    def runs(layout: str) -> dict:
        if layout not in done:
            ids = corpus_ids(tiny_models[layout], 22000)
            kwargs = {**ENGINE, **(MTP if layout == "mimo" else {})}
            modes = MODES if layout == "mimo" else {m: MODES[m] for m in ("off", "window-local")}
            done[layout] = {
                mode: run_engine(
                    tiny_models[layout],
                    _batches(ids, 6000 if layout == "mimo" else 3000),  # engine time: the suite's budget
                    env=env,
                    llm_kwargs={**kwargs, **({"additional_config": {"mimo": {"swa_attention": path}}} if path else {})},
                    record_block_ids=True,
                )
                for mode, (env, path) in modes.items()
            }
        return done[layout]

    return runs


def _interior_nulls(run) -> bool:
    """Whether some allocation gave a group the null block before a real one (a chunk position
    the manager keeps no SWA KV for; before a hit's window, nulls come first)."""
    for allocation in run.workers[0]["block_ids"]:
        for group in allocation:
            real = [i for i, block in enumerate(group) if block]
            if real and any(block == 0 for block in group[real[0] :]):
                return True
    return False


@pytest.mark.engine
@pytest.mark.parametrize("layout", ["mimo", "gemma3"])
def test_window_local_gives_the_same_tokens_with_less_swa_memory(engine_runs, layout):
    runs = engine_runs(layout)
    off, local = runs["off"], runs["window-local"]
    assert local.ids() == off.ids()
    (line,) = local.log_lines("SWA attention (swa_attention)")
    assert "window-local" in line and "stock" not in line
    assert "window-local-swa" in local.log_lines("features on")[0]
    # Hits at anchors inside earlier chunks: their windows were kept.
    cached = [o["cached"] for o in local.batches[1]]
    assert min(cached) >= 384, cached  # with MTP a hit stops a position short of the anchor
    assert _interior_nulls(local)
    assert local.mimo["peak_anchor_window_blocks_per_request"] > 0
    if layout != "mimo":
        return
    stock = runs["stock"]
    assert stock.ids() == off.ids()
    assert "stock" in stock.log_lines("SWA attention (swa_attention)")[0]
    assert cached == [o["cached"] for o in stock.batches[1]]
    assert not _interior_nulls(stock)
    peak_local, peak_stock = (r.mimo["peak_swa_blocks_per_request"] for r in (local, stock))
    assert peak_local < peak_stock, (peak_local, peak_stock)  # how they grow with the chunk: eval/bench_window_local.py
    # The drafter's KV is exact too: every draft the same, so every acceptance count.
    assert local.mimo["spec_decode"] == stock.mimo["spec_decode"] and local.mimo["spec_decode"]


@pytest.mark.engine
def test_a_manager_keeping_one_position_fewer_changes_tokens(tiny_models, engine_runs):
    """Negative control for the test above."""
    ids = corpus_ids(tiny_models["mimo"], 22000)
    short = run_engine(
        tiny_models["mimo"],
        _batches(ids),
        llm_kwargs={**ENGINE, **MTP},
        patch="tests.test_window_local:keep_one_position_fewer",
    )
    assert short.ids() != engine_runs("mimo")["off"].ids()

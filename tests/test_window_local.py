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
from vllm_mimo.attention_backends.plan import WindowPlan, mask_null_slots, window_layout
from vllm_mimo.attention_backends.reference import flash_attn_varlen_reference, window_local_prefill

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
    from vllm_mimo.attention_backends.plan import step_layout

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


# ------------------------------ the CUDA path: one paged call over the scratch (scratch.py)


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


def _scratch_step(case, *, sinks=True, kernel_window=None, null_first_copy=False, pages=None, kernel=None):
    """`case` run through the CUDA kernel layer: the step's layout, the group's copies, the
    kernel planned once and run under `no_host_sync`, FlashInfer's kernel replaced by its torch
    stand-in (its mask rule). Returns (ours, the dense reference, the layout)."""
    from vllm_mimo.attention_backends.plan import step_layout
    from vllm_mimo.attention_backends.reference import PagedPrefillReference
    from vllm_mimo.attention_backends.scratch import ScratchPrefill, step_copies
    from vllm_mimo.attention_backends.sync_guard import no_host_sync

    window, bs, scale, query = case["window"], case["bs"], case["scale"], case["query"]
    sink = case["sink"] if sinks else None
    layout, shared = step_layout(case["qsl"], case["seq_lens"], window, bs)
    copies = step_copies(layout, case["table"], shared)
    if null_first_copy:  # one block of a window taken from the null block (garbage), not its own
        copies = type(copies)(torch.cat([copies.src[:1] * 0, copies.src[1:]]), copies.dst, copies.token_slots,
                              copies.num_blocks)
    step = ScratchPrefill(kernel or PagedPrefillReference())
    heads, kv_heads, d = query.shape[1], case["key_pages"].shape[2], query.shape[2]
    step.plan(
        layout, case["qsl"], window=kernel_window or window, num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=d,
        head_dim_v=case["value_pages"].shape[-1], scale=scale, soft_cap=None, dtype=query.dtype,
    )
    out = torch.full((query.shape[0], heads, case["value_pages"].shape[-1]), float("nan"))
    with no_host_sync():
        got = step.run(query, case["new_k"], case["new_v"], pages or (case["key_pages"], case["value_pages"]), copies,
                       sink, out=out)
    assert got is out
    return out, case["want"](query, scale, sink), layout


@pytest.mark.parametrize("sinks", [False, True])
def test_scratch_step_computes_the_window_in_one_paged_call(sinks):
    """Decode, chunks longer and shorter than W, first chunks, contexts shorter than W - 1 and
    not block-aligned, different K and V head sizes, garbage outside every window: one causal
    paged call with window_left W - 1 over the scratch is the dense reference (float32)."""
    ours, want, layout = _scratch_step(_paged_requests(), sinks=sinks)
    assert torch.allclose(ours.double(), want, atol=1e-5), (ours.double() - want).abs().max()
    # O(W + chunk) scratch per request: its window's blocks and its chunk's, nothing more.
    window, bs = 10, 4
    contexts, chunks = [30, 17, 5, 0, 21, 3], [1, 23, 4, 12, 9, 2]
    most = sum(math.ceil((min(c, window - 1) + q) / bs) + 1 for c, q in zip(contexts, chunks, strict=True))
    assert layout.num_blocks <= most


@pytest.mark.parametrize("fault", ["window one key wider", "one window block from the null block"])
def test_scratch_step_comparison_can_fail(fault):
    """Negative controls: the kernel planned with window_left W (off by one), or one cached
    window block copied from the wrong cache block, and the comparison fails."""
    case = _paged_requests()
    ours, want, _ = _scratch_step(
        case, kernel_window=case["window"] + 1 if fault == "window one key wider" else None,
        null_first_copy=fault == "one window block from the null block",
    )
    assert not torch.allclose(ours.double(), want, atol=1e-5)


def test_paged_index_is_the_layouts_scratch_block_table():
    """The kernel's plan arrays list each request's scratch blocks in order and its keys in
    the last one, so they describe the same keys as the layout's block table and lengths."""
    from vllm_mimo.attention_backends.plan import paged_index

    case = _paged_requests()
    layout = window_layout(case["qsl"], case["seq_lens"], case["window"], case["bs"])
    index = paged_index(layout, case["qsl"])
    assert index.qo_indptr.tolist() == case["qsl"].tolist() and index.kv_indices.dtype == torch.int32
    for r in range(len(case["qsl"]) - 1):
        blocks = index.kv_indices[index.kv_indptr[r] : index.kv_indptr[r + 1]]
        assert blocks.tolist() == layout.block_table[r, : blocks.numel()].tolist()
        keys = (blocks.numel() - 1) * case["bs"] + int(index.last_page_len[r])
        assert keys == int(layout.seq_lens[r]) and 1 <= int(index.last_page_len[r]) <= case["bs"]


def _logical_cache(key_pages, value_pages, layout):
    """vLLM's per-layer FlashInfer cache, logical `[blocks, kv heads, block size, K | V]`, laid
    out physically as `layout` ("NHD" or "HND")."""
    nhd = torch.cat([key_pages, value_pages], dim=-1)  # [blocks, block size, kv heads, K | V]
    return nhd.transpose(1, 2) if layout == "NHD" else nhd.transpose(1, 2).contiguous()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_scratch_is_nhd_whatever_the_cache_layout(layout):
    """The scratch, the chunk's keys written into it and the kernel's plan are NHD for a cache of
    either physical layout (SM100 caches are HND): the same result. Negative control: the HND
    cache's memory read as if it were NHD (what giving the cache's layout to an NHD call does)."""
    from vllm_mimo.attention_backends.scratch import nhd_pages

    case = _paged_requests()
    d = case["key_pages"].shape[-1]
    cache = _logical_cache(case["key_pages"], case["value_pages"], layout)
    assert cache.shape[1:3] == (2, 4) and (layout == "HND") == cache.is_contiguous()
    ours, want, _ = _scratch_step(case, pages=nhd_pages(cache, d))
    assert torch.allclose(ours.double(), want, atol=1e-5)
    if layout == "HND":
        misread = cache.view(cache.shape[0], cache.shape[2], cache.shape[1], cache.shape[3])
        wrong, _, _ = _scratch_step(case, pages=(misread[..., :d], misread[..., d:]))
        assert not torch.allclose(wrong.double(), want, atol=1e-3)


def test_one_kv_head_shard_gives_the_kernel_canonical_strides():
    """A one-KV-head cache view (a TP shard's) whose size-1 head dim carries a degenerate
    stride (PyTorch allows it; CUDA TMA needs canonical ones): the kernel gets contiguous K and
    V all the same, and the same result as from a contiguous cache."""
    from vllm_mimo.attention_backends.reference import PagedPrefillReference

    case = _paged_requests()
    keep = slice(0, 1)
    for name in ("key_pages", "value_pages"):
        case[name] = case[name][:, :, keep].contiguous()
    case["new_k"], case["new_v"] = case["new_k"][:, keep], case["new_v"][:, keep]
    k = case["key_pages"]
    odd = k.as_strided(k.shape, (k.stride(0), k.stride(1), 7, 1))  # stride 7 on the size-1 dim
    assert torch.equal(odd, k) and odd.stride(2) == 7
    seen = []

    class Recording(PagedPrefillReference):
        def run(self, q, paged_kv_cache, *args, out=None):
            seen.extend(paged_kv_cache)
            return super().run(q, paged_kv_cache, *args, out=out)

    ours, _, _ = _scratch_step(case, pages=(odd, case["value_pages"]), kernel=Recording())
    assert seen and all(t.is_contiguous() and t.stride(2) == t.shape[3] for t in seen)
    plain, _, _ = _scratch_step(case)
    assert torch.equal(ours, plain)


def test_the_layer_path_makes_no_host_sync_and_the_guard_sees_them():
    """`no_host_sync` (the per-layer path runs under it above) fails on what the old two-call
    merge did per layer (boolean-mask selects) and on every other host read, and on a pageable
    asynchronous copy to a device; host-to-device copies of the plan go through pinned memory."""
    from vllm_mimo.attention_backends.scratch import to_device
    from vllm_mimo.attention_backends.sync_guard import HostSyncError, no_host_sync

    rows, valid = torch.arange(6), torch.tensor([True, False] * 3)
    for sync in (lambda: rows[valid], lambda: rows.nonzero(), lambda: rows[0].item(), lambda: rows.tolist(),
                 lambda: int(rows.sum()), lambda: rows.repeat_interleave(rows),
                 lambda: rows.to("cuda", non_blocking=True)):
        with pytest.raises(HostSyncError), no_host_sync():
            sync()
    assert to_device(rows, torch.device("cpu")) is rows


def test_non_causal_metadata_is_refused():
    """Draft-model (non-causal) attention metadata never reaches the causal window kernel."""
    from vllm_mimo.attention_backends.scratch import check_causal

    check_causal(True, ["model.layers.1.self_attn"])
    with pytest.raises(RuntimeError, match=r"non-causal attention metadata .*model.layers.1.self_attn.*'stock'"):
        check_causal(False, ["model.layers.1.self_attn"])


def test_the_swa_groups_of_a_step_upload_its_layout_once():
    """Each group gathers its own cache blocks; the layout's indices go to the device once."""
    from vllm_mimo.attention_backends.plan import step_layout
    from vllm_mimo.attention_backends.scratch import step_copies

    case = _paged_requests()
    layout, shared = step_layout(case["qsl"], case["seq_lens"], case["window"], case["bs"])
    one = step_copies(layout, case["table"], shared)
    uploads = dict(shared)
    other = step_copies(layout, case["table"] + 100, shared)
    assert shared.keys() == uploads.keys() and all(shared[k] is uploads[k] for k in uploads)
    assert torch.equal(other.src, one.src + 100) and other.dst is one.dst


# ------------- the DIFFKV path: one FlashAttention call over the scratch (K and V sizes differ)


def _diffkv_case(bottom_right=True, sinks=True):
    """`_paged_requests` through `cuda_diffkv`: the plan over the step's block table, the scratch
    filled, one call as FlashAttention computes it, the sinks from its LSE. Returns (ours, the
    dense reference)."""
    from vllm_mimo.attention_backends.cuda_diffkv import attend, plan_step
    from vllm_mimo.attention_backends.plan import step_layout
    from vllm_mimo.attention_backends.sync_guard import host_sync_allowed, no_host_sync

    case = _paged_requests()
    sink = case["sink"] if sinks else None
    layout, shared = step_layout(case["qsl"], case["seq_lens"], case["window"], case["bs"])
    plan = plan_step(layout, case["qsl"], case["table"], case["window"], shared)
    calls = []

    def varlen(**kwargs):
        calls.append(kwargs)
        with host_sync_allowed():  # the kernel's stand-in, on the host
            out, lse = flash_attn_varlen_reference(**{**kwargs, "return_softmax_lse": True}, bottom_right=bottom_right)
        return (out.float(), lse.float()) if kwargs["return_softmax_lse"] else out.float()

    with no_host_sync():
        ours = attend(
            case["query"], case["new_k"], case["new_v"], (case["key_pages"], case["value_pages"]), plan,
            scale=case["scale"], softcap=0.0, sinks=sink, fa_version=3, varlen=varlen,
        )
    assert len(calls) == 1 and calls[0]["causal"] and calls[0]["window_size"] == [case["window"] - 1, 0]
    return ours, case["want"](case["query"], case["scale"], sink)


@pytest.mark.parametrize("sinks", [False, True])
def test_diffkv_path_computes_the_window_in_one_flash_attention_call(sinks):
    ours, want = _diffkv_case(sinks=sinks)
    assert torch.allclose(ours.double(), want, atol=1e-6), (ours.double() - want).abs().max()


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
    ours, want = _diffkv_case(bottom_right=False)
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
    from vllm_mimo.kv_cache.cache import HybridKVCache

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

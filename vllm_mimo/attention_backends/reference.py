"""Window-local SWA attention in plain torch: the reference every backend is checked against
(the cached window and the chunk attended apart, merged by log-sum-exp, the sink applied once),
and stand-ins for the CUDA kernels computed by their documented mask rules, which run the CUDA
paths on CPU (tests, the dry runs of `eval/gpu_check.py` and `eval/gpu_vllm_harness.py`):
`PagedPrefillReference` for FlashInfer's paged prefill wrapper, `flash_attn_varlen_reference`
for FlashAttention's `flash_attn_varlen_func`.

Shapes, for one request: queries `[q, Hq, Dqk]`; keys `[n, Hkv, Dqk]`; values `[n, Hkv, Dv]`
(Dv may differ from Dqk, as in MiMo's 192/128); Hq a multiple of Hkv (grouped queries).
A query at position p attends to keys at positions p-W+1..p; `sinks` (one logit per query
head, as gpt-oss and MiMo's SWA layers have) joins every query's softmax without a value.
"""

from __future__ import annotations

import torch


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    window: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of `query` over the keys inside each query's window: (output
    `[q, Hq, Dv]`, log-sum-exp `[q, Hq]` in natural log). A query with no key in reach gets
    output 0 and log-sum-exp -inf."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    logits = torch.einsum("qhd,khd->hqk", query, k) * scale
    gap = query_pos[:, None] - key_pos[None, :]
    logits = logits.masked_fill(~((gap >= 0) & (gap < window))[None], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.exp(logits - lse[..., None].clamp(min=torch.finfo(logits.dtype).min))
    out = torch.einsum("hqk,khd->qhd", weights.nan_to_num(0.0), v)
    return out, lse.transpose(0, 1)


def merge(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results over disjoint key sets, combined as one softmax over both."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe)[..., None]
    wb = torch.exp(lse_b - safe)[..., None]
    return out_a * wa + out_b * wb, lse


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """A sink logit per head joins the softmax: the output scales by
    sigmoid(lse - sink), the share of mass the keys keep. Applied once, to the final result."""
    return out * torch.sigmoid(lse - sinks.to(lse.dtype)[None, :])[..., None]


def window_local_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cached_key: torch.Tensor,
    cached_value: torch.Tensor,
    context: int,
    window: int,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One request's chunk of new tokens at positions `context..context+q-1` (their own
    keys and values in flight), over the cached keys of the positions just before it
    (`cached_key[i]` at position context - len(cached_key) + i; at most the last W-1 are
    read): the cached part and the chunk part attended apart, merged, sinks applied once."""
    q = query.shape[0]
    cached = min(cached_key.shape[0], window - 1)
    pos = torch.arange(context, context + q, device=query.device)
    cached_pos = torch.arange(context - cached, context, device=query.device)
    start = cached_key.shape[0] - cached
    part = attend(query, cached_key[start:], cached_value[start:], pos, cached_pos, window, scale)
    out, lse = merge(part, attend(query, key, value, pos, pos, window, scale))
    return apply_sinks(out, lse, sinks) if sinks is not None else out


class PagedPrefillReference:
    """FlashInfer's `BatchPrefillWithPagedKVCacheWrapper` (and its attention-sink variant) as
    plain torch, by FlashInfer 0.7.2's mask rule (`include/flashinfer/attention/variants.cuh`):
    key j of a request with `kv_len` keys is seen by its query row i of `qo_len` when
    j + qo_len + window_left >= kv_len + i (window_left -1: no window) and, causal,
    j <= i + kv_len - qo_len. Pages are NHD (`[pages, page size, kv heads, D]`) or HND
    (`[pages, kv heads, page size, D]`), as `kv_layout` says. Same `plan` /
    `run` arguments as the wrapper for what the plugin passes; float32 math, output in the
    query's dtype. Not a kernel: it loops over requests on the host."""

    def __init__(self, kv_layout: str = "NHD") -> None:
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout {kv_layout!r}: NHD or HND")
        self.kv_layout = kv_layout
        self.planned: dict | None = None

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             page_size: int, *, head_dim_vo: int | None = None, causal: bool = False, window_left: int = -1,
             sm_scale: float | None = None, logits_soft_cap: float | None = None, **_: object) -> None:
        if logits_soft_cap:
            raise ValueError("PagedPrefillReference has no soft cap")
        # The planned values under the names FlashInfer's wrappers keep them (vLLM asserts them).
        self._window_left, self._logits_soft_cap, self._sm_scale, self._causal = (
            window_left, logits_soft_cap or 0.0, sm_scale, causal
        )
        self.planned = {
            "qo": qo_indptr.tolist(), "kv": paged_kv_indptr.tolist(), "pages": paged_kv_indices.to(torch.int64),
            "last": paged_kv_last_page_len.tolist(), "page_size": page_size, "causal": causal,
            "window_left": window_left, "scale": sm_scale if sm_scale is not None else head_dim_qk**-0.5,
        }

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor], *args: object,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """The attention output `[T, Hq, Dv]`; `args` as the sink wrapper's: (sinks, sm_scale)."""
        plan = self.planned
        if plan is None:
            raise RuntimeError("PagedPrefillReference.run before plan")
        sinks = args[0] if args else None
        k_pages, v_pages = paged_kv_cache
        if self.kv_layout == "HND":
            k_pages, v_pages = k_pages.transpose(1, 2), v_pages.transpose(1, 2)
        result = out if out is not None else q.new_empty(q.shape[0], q.shape[1], v_pages.shape[-1])
        for r in range(len(plan["qo"]) - 1):
            a, b = plan["qo"][r], plan["qo"][r + 1]
            pages = plan["pages"][plan["kv"][r] : plan["kv"][r + 1]].to(k_pages.device)
            n = (pages.numel() - 1) * plan["page_size"] + plan["last"][r]
            key = k_pages[pages].flatten(0, 1)[:n].float()
            value = v_pages[pages].flatten(0, 1)[:n].float()
            rows = b - a
            i, j = torch.arange(rows)[:, None], torch.arange(n)[None, :]
            left = plan["window_left"] if plan["window_left"] >= 0 else n
            seen = j + rows + left >= n + i
            if plan["causal"]:
                seen &= j <= i + n - rows
            groups = q.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
            logits = torch.einsum("qhd,khd->hqk", q[a:b].float(), key) * plan["scale"]
            logits = logits.masked_fill(~seen.to(logits.device)[None], float("-inf"))
            lse = torch.logsumexp(logits, dim=-1)
            weights = torch.exp(logits - lse[..., None].clamp(min=torch.finfo(logits.dtype).min)).nan_to_num(0.0)
            part = torch.einsum("hqk,khd->qhd", weights, value)
            if sinks is not None:
                part = apply_sinks(part, lse.transpose(0, 1), torch.as_tensor(sinks).float())
            result[a:b] = part.to(result.dtype)
        return result


def flash_attn_varlen_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
    max_seqlen_k: int, cu_seqlens_k: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None, softmax_scale: float | None = None, causal: bool = False,
    window_size: list[int] | None = None, softcap: float = 0.0, return_softmax_lse: bool = False,
    out: torch.Tensor | None = None, s_aux: torch.Tensor | None = None, bottom_right: bool = True, **_: object,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`flash_attn_varlen_func` computed by its documented mask rule (vLLM's
    `vllm_flash_attn/flash_attn_interface.py`, 0.32 and 0.33: query row i of a sequence of sq
    rows and sk keys sees keys i + sk - sq - left .. i + sk - sq + right, -1 meaning no bound;
    causal also needs j <= i + sk - sq), in float64: keys ragged (`cu_seqlens_k`) or paged
    (`block_table`, `seqused_k`, `k` / `v` as `[blocks, block size, kv heads, D]`); `s_aux` one
    sink logit per head. Output `[rows, heads, Dv]` (into `out` when given), and with
    `return_softmax_lse` the natural-log LSE `[heads, rows]` (of the keys, without the sink).
    `bottom_right=False` aligns the first row with the first key instead (a negative control)."""
    if softcap:
        raise ValueError("flash_attn_varlen_reference has no soft cap")
    left, right = window_size or (-1, -1)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    outs, lses = [], []
    for r in range(len(cu_seqlens_q) - 1):
        qr = q[int(cu_seqlens_q[r]) : int(cu_seqlens_q[r + 1])].double()
        if block_table is None:
            assert cu_seqlens_k is not None
            kr, vr = (t[int(cu_seqlens_k[r]) : int(cu_seqlens_k[r + 1])].double() for t in (k, v))
        else:
            assert seqused_k is not None
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
        logits = (torch.einsum("qhd,khd->hqk", qr, kr) * scale).masked_fill(~seen.to(qr.device)[None], float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)
        part = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1).nan_to_num(0.0), vr)
        if s_aux is not None:
            part = apply_sinks(part, lse.transpose(0, 1), s_aux.double())
        outs.append(part)
        lses.append(lse)
    result = torch.cat(outs)
    if out is not None:
        out.copy_(result.view(out.shape).to(out.dtype))
        result = out
    return (result, torch.cat(lses, dim=1)) if return_softmax_lse else result

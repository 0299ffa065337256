"""Window-local SWA attention in plain torch: the reference every backend is checked against,
and the arithmetic of the CUDA path (two partial results merged by log-sum-exp, the sink
applied once at the end), written out so it runs and is tested on CPU.

Shapes, for one request: queries `[q, Hq, Dqk]`; keys `[n, Hkv, Dqk]`; values `[n, Hkv, Dv]`
(Dv may differ from Dqk, as in MiMo's 192/128); Hq a multiple of Hkv (grouped queries).
A query at position p attends to keys at positions p-W+1..p; `sinks` (one logit per query
head, as gpt-oss and MiMo's SWA layers have) joins every query's softmax without a value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm_mimo.attention_backends.plan import SplitPlan


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


def combine_split(
    plan: SplitPlan,
    chunk: tuple[torch.Tensor, torch.Tensor],
    context: tuple[torch.Tensor, torch.Tensor] | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A step's output from the two calls of a `SplitPlan`: `chunk` is (output, natural-log
    LSE) of every new token over the chunk, `context` the same for the plan's context rows
    (None when it has none); each real context row is merged into its token, repeats are
    dropped, sinks applied once. Plain torch: runs on the device of its inputs."""
    out, lse = chunk
    if context is not None and plan.context_rows.numel():
        valid = plan.context_valid
        rows = plan.context_rows[valid]
        context_out = torch.zeros_like(out)
        context_lse = torch.full_like(lse, float("-inf"))
        context_out[rows] = context[0][valid].to(out.dtype)
        context_lse[rows] = context[1][valid].to(lse.dtype)
        out, lse = merge((out, lse), (context_out, context_lse))
    return apply_sinks(out, lse, sinks) if sinks is not None else out

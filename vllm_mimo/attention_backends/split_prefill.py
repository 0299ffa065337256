"""FlashInfer's two calls for a window-local SWA prefill step (`plan.SplitPlan`), merged in
torch: the CUDA path's kernel layer, with no vLLM in it (so `eval/gpu_check.py` runs it on a
GPU that has no vLLM). Run on an H200 (FlashInfer 0.7.2.post1, fa2, bf16) by
`eval/gpu_check.sh` (issue 41): within bf16 tolerance of the torch reference and of FlashInfer's
stock call, but 3-9x the stock call's time, most of it `combine_split` in torch
(`eval/results/gpu-check.json`).

- the chunk: `BatchPrefillWithRaggedKVCacheWrapper` over the new tokens' keys and values in
  flight, causal, `window_left` W-1;
- the cached window: `BatchPrefillWithPagedKVCacheWrapper` over the pages of the W-1 tokens
  before each chunk, read in place, W-1 query rows per request, non-causal, `window_left` 0;
- both return natural-log LSEs; `reference.combine_split` merges them and applies the sinks
  once, in float32. FlashInfer's fa2/fa3 prefill kernels take no sinks (only trtllm-gen does),
  which is why they are applied from the LSE.
Everything the two calls are given is computed and tested on CPU (`plan.plan_split`, the
masks emulated by FlashInfer's rule in tests/test_window_local.py, `combine_split`).
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_mimo.attention_backends.plan import SplitPlan
from vllm_mimo.attention_backends.reference import combine_split


class SplitPrefill:
    """FlashInfer's two calls for a `SplitPlan`, planned once per step and run by every layer
    of one KV cache group (see the module docstring)."""

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", backend: str = "fa2") -> None:
        import flashinfer

        # One workspace for both: the calls run one after the other (as vLLM's DCP wrapper).
        self.chunk = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout, backend=backend)
        self.context = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout, backend=backend)
        self.split: SplitPlan | None = None

    def plan(
        self,
        split: SplitPlan,
        query_start_loc: torch.Tensor,
        page_ids: torch.Tensor,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        scale: float,
        soft_cap: float | None,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
    ) -> None:
        """Plan both calls: `query_start_loc` (host) of the step's new tokens, `page_ids` the
        block ids at `split.page_request` / `split.page_column` (on the device)."""
        device = page_ids.device
        self.chunk.plan(
            query_start_loc, query_start_loc, num_qo_heads, num_kv_heads, head_dim, head_dim,
            causal=True, window_left=split.window - 1, sm_scale=scale, logits_soft_cap=soft_cap,
            q_data_type=q_dtype, kv_data_type=kv_dtype,
        )
        if split.context_requests.numel():
            self.context.plan(
                split.context_qo_indptr.to(torch.int32), split.page_indptr.to(torch.int32),
                page_ids.to(torch.int32), split.last_page_len.to(torch.int32),
                num_qo_heads, num_kv_heads, head_dim, page_size,
                causal=False, window_left=0, sm_scale=scale, logits_soft_cap=soft_cap,
                q_data_type=q_dtype, kv_data_type=kv_dtype,
            )
        self.split = dataclasses.replace(
            split,
            context_rows=split.context_rows.to(device, non_blocking=True),
            context_valid=split.context_valid.to(device, non_blocking=True),
        )

    def run(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        paged_cache: tuple[torch.Tensor, torch.Tensor],
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """The step's window-local SWA output `[T, Hq, D]` (float32) for queries `query` over
        the new tokens' `key` / `value` and the `paged_cache` (K, V) pages."""
        split = self.split
        if split is None:
            raise RuntimeError("vllm-mimo: SplitPrefill.run before plan")
        chunk = self.chunk.run(query, key, value, return_lse=True, lse_base="ln")
        context = None
        if split.context_requests.numel():
            context = self.context.run(query[split.context_rows], paged_cache, return_lse=True, lse_base="ln")
            context = (context[0].float(), context[1])
        return combine_split(split, (chunk[0].float(), chunk[1]), context, None if sinks is None else sinks.float())

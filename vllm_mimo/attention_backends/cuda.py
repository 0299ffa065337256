"""Window-local SWA attention on CUDA: vLLM's FlashInfer backend, with SWA prefill steps run as
two FlashInfer calls merged by log-sum-exp instead of one call over the paged cache.

THIS MODULE HAS NOT RUN ON A GPU (it needs vLLM on CUDA, which the lent machines do not have).
Its kernel layer, `split_prefill.py`, has: `eval/gpu_check.sh` on an H200 (issue 41) found it
within bf16 tolerance of the torch reference and of FlashInfer's stock call, and slower than
the stock call (`eval/RESULTS.md`). So `swa_attention` stays `stock` on CUDA unless set to
`window-local` by hand.

The builder plans a `SplitPrefill` (`plan.plan_split`'s arrays, page ids gathered from the
step's block table) for the prefill requests of a step of a window-local SWA group; the impl
runs it on the step's prefill rows and vLLM's own code on its decode rows; Full layers are
another KV cache group with another backend. Cache writes to the null block are dropped.

Not covered: different K and V head sizes (real MiMo's 192/128 runs vLLM's `*_DIFFKV`
backends, which bypass the per-kind selection; `flash_attn_varlen_func` with `s_aux` would be
the path there), quantized KV caches, decode context parallelism. Each is a startup error.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_mimo import compat
from vllm_mimo.attention_backends.plan import mask_null_slots, plan_split
from vllm_mimo.attention_backends.split_prefill import SplitPrefill

_Backend = compat.FlashInferBackend
_Builder = compat.FlashInferMetadataBuilder
_Impl = compat.FlashInferImpl
_Metadata = compat.FlashInferMetadata


@dataclasses.dataclass
class WindowLocalMetadata(_Metadata):  # type: ignore[misc,valid-type]
    """vLLM's FlashInfer metadata plus the step's planned `SplitPrefill` (prefill rows only)."""

    window_prefill: SplitPrefill | None = None


class WindowLocalBuilder(_Builder):  # type: ignore[misc,valid-type]
    """Builds vLLM's metadata, plus a planned `SplitPrefill` for the prefill requests of a step
    of a window-local SWA group."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any) -> None:
        from vllm_mimo.attention_backends.cpu import window_local_engine

        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.window_local = isinstance(kv_cache_spec, compat.SlidingWindowSpec) and window_local_engine(vllm_config)
        self._split: SplitPrefill | None = None
        if self.window_local and (self.cache_dtype != "auto" or self.use_dcp or self.window_left < 0):
            raise RuntimeError(
                f"vllm-mimo: swa_attention is window-local, but the sliding-window KV cache group of "
                f"{layer_names[:3]}... cannot run it on CUDA (kv cache dtype {self.cache_dtype!r}, decode "
                f"context parallel {self.use_dcp}, window_left {self.window_left}); set swa_attention to 'stock'"
            )

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if not self.window_local or metadata.num_prefills == 0:
            return metadata
        decodes = metadata.num_decodes
        qsl = common_attn_metadata.query_start_loc_cpu[decodes:]
        with compat.gpu_sync_allowed():
            seq_lens = common_attn_metadata.seq_lens[decodes:].cpu()
        split = plan_split(qsl - qsl[0], seq_lens, self.window_left + 1, self.page_size)
        table = common_attn_metadata.block_table_tensor[decodes:]
        page_ids = table[split.page_request.to(table.device), split.page_column.to(table.device)]
        if self._split is None:
            layout = compat.flashinfer_layout_string(self.kv_cache_layout)
            self._split = SplitPrefill(self._get_workspace_buffer(), layout)
        self._split.plan(
            split, (qsl - qsl[0]).to(torch.int32), page_ids,
            num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            page_size=self.page_size, scale=self.sm_scale, soft_cap=self.logits_soft_cap,
            q_dtype=self.q_data_type_prefill, kv_dtype=self.kv_cache_dtype,
        )
        values = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
        return WindowLocalMetadata(**values, window_prefill=self._split)


class WindowLocalImpl(_Impl):  # type: ignore[misc,valid-type]
    """vLLM's FlashInfer attention; the prefill rows of a step with a `SplitPrefill` run it."""

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        split = getattr(attn_metadata, "window_prefill", None)
        if split is None or key is None or value is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            # vLLM's code would read the chunk's keys back from blocks the manager did not keep.
            raise NotImplementedError("vllm-mimo: window-local SWA attention has no fused output quantization")
        first, end = attn_metadata.num_decode_tokens, attn_metadata.num_actual_tokens
        # The pages exactly as vLLM's forward hands them to FlashInfer (its layout's view).
        pages = kv_cache.permute(*attn_metadata.kv_cache_layout.layer_view_order).split(self.head_size, dim=-1)
        out = split.run(query[first:end], key[first:end], value[first:end], pages, self.sinks)
        output[first:end].copy_(out.view_as(output[first:end]))
        if first:
            decode_only = dataclasses.replace(
                attn_metadata, num_actual_tokens=first, num_prefills=0, num_prefill_tokens=0,
                prefill=None, window_prefill=None,
            )
            super().forward(layer, query, key, value, kv_cache, decode_only, output, output_scale, output_block_scale)
        return output

    def do_kv_cache_update(
        self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        if self.window_left >= 0:
            # [blocks, kv heads, block size, 2 x head size]: see vLLM's do_kv_cache_update.
            slot_mapping = mask_null_slots(slot_mapping, kv_cache.shape[2])
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)


class WindowLocalFlashInferBackend(_Backend):  # type: ignore[misc,valid-type]
    """FlashInfer with window-local SWA prefill steps, selected for SWA groups as `CUSTOM`
    through `attention_config.backend_per_kind`."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type:
        return WindowLocalImpl

    @staticmethod
    def get_builder_cls() -> type:
        return WindowLocalBuilder

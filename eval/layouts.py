"""Named hybrid-SWA layouts and the `KVCacheConfig` vLLM would build for them, with no model.

The per-layer specs go through vLLM's own `get_kv_cache_groups` and
`get_kv_cache_config_from_groups`, so groups, page sizes and the number of blocks a KV byte
budget buys are exactly vLLM's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Layout:
    """A model's attention layout: which layers slide, over what window, with what heads."""

    name: str
    num_layers: int
    window: int
    swa_every: tuple[int, int]
    """(period, full-layer offset): layer i is full iff i % period == offset."""
    full_kv_heads: int
    swa_kv_heads: int
    head_size: int
    head_size_v: int
    note: str

    def is_full(self, layer: int) -> bool:
        period, offset = self.swa_every
        return layer % period == offset


LAYOUTS = {
    layout.name: layout
    for layout in (
        # 10 full + 60 SWA, W = 128. Heads as in upstream-baseline-notes.md (8 KV heads of 128
        # for both kinds), which keeps one page size, as vLLM then makes one block size.
        Layout("mimo-v2.5-pro", 70, 128, (7, 0), 8, 8, 128, 128, "10 full + 60 SWA, W=128"),
        # MiMo-V2-Flash: 48 layers, 1 full : 5 SWA; qk 192 / v 128, full 4 KV heads, SWA 8.
        Layout("mimo-v2-flash", 48, 128, (6, 5), 4, 8, 192, 128, "8 full + 40 SWA, W=128, DIFFKV"),
        # gpt-oss-120b: 36 layers alternating (even layers slide), W = 128, 8 KV heads of 64.
        Layout("gpt-oss-120b", 36, 128, (2, 1), 8, 8, 64, 64, "18 full + 18 SWA, W=128"),
        # Gemma 3 27B: 62 layers, 5 local : 1 global, W = 1024, 16 KV heads of 128.
        Layout("gemma3-27b", 62, 1024, (6, 5), 16, 16, 128, 128, "10 full + 52 SWA, W=1024"),
    )
}


def model_less_vllm_config(max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int):
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig

    config = VllmConfig(
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig.default_factory(
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
        ),
    )
    # The engine core resolves this from the attention backend; a GPU backend's is NHD.
    config.cache_config.kv_cache_layout = "NHD"
    return config


def layer_specs(layout: Layout) -> dict:
    import torch

    from vllm_mimo.compat import FullAttentionSpec, SlidingWindowSpec

    specs = {}
    for i in range(layout.num_layers):
        name = f"model.layers.{i}.self_attn.attn"
        if layout.is_full(i):
            specs[name] = FullAttentionSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=layout.full_kv_heads,
                head_size=layout.head_size,
                head_size_v=layout.head_size_v,
                dtype=torch.bfloat16,
            )
        else:
            specs[name] = SlidingWindowSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=layout.swa_kv_heads,
                head_size=layout.head_size,
                head_size_v=layout.head_size_v,
                dtype=torch.bfloat16,
                sliding_window=layout.window,
            )
    return specs


def kv_cache_config(layout: Layout, kv_bytes: int, vllm_config) -> object:
    """The KVCacheConfig vLLM builds for `layout` with `kv_bytes` of KV cache."""
    from eval.vllm_names import get_kv_cache_config_from_groups, get_kv_cache_groups

    groups = get_kv_cache_groups(vllm_config, layer_specs(layout))
    config = get_kv_cache_config_from_groups(vllm_config, groups, kv_bytes)
    if config.num_blocks < 2:
        raise ValueError(
            f"{kv_bytes / 2**30:.3f} GiB buys {config.num_blocks} blocks for {layout.name}; "
            "too small to hold anything"
        )
    return config


def full_only(config, retention: int | None = 0):
    """The same block budget with the SWA groups removed: what the cache reaches if SWA KV
    cost nothing and every hit were window-safe."""
    from vllm_mimo.compat import FullAttentionSpec

    groups = [g for g in config.kv_cache_groups if type(g.kv_cache_spec) is FullAttentionSpec]
    return dataclasses.replace(config, kv_cache_groups=groups, prefix_cache_retention_interval=retention)


def with_retention(config, retention: int | None):
    return dataclasses.replace(config, prefix_cache_retention_interval=retention)

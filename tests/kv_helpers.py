"""Small real vLLM KV cache configs and requests for driving KV managers without a model."""

from __future__ import annotations

import torch

from vllm_mimo.compat import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    Request,
    SlidingWindowSpec,
    get_request_block_hasher,
    init_none_hash,
)

BLOCK = 16


def kv_config(
    num_blocks: int, window: int = 32, swa_groups: int = 2, full_groups: int = 1, full_block: int = BLOCK
) -> KVCacheConfig:
    """Full groups first, then SWA groups, one layer each, all aliasing `num_blocks` blocks.

    `full_block` other than BLOCK: the Full groups' blocks hold that many tokens, as vLLM sizes
    them where Full layers have fewer KV heads than SWA layers (MiMo-V2-Flash), so that every
    group's page has the same bytes."""
    common = dict(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    full = FullAttentionSpec(**{**common, "block_size": full_block})
    groups = [
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], full)
        for i in range(full_groups)
    ] + [
        KVCacheGroupSpec(
            [f"model.layers.{full_groups + i}.self_attn.attn"],
            SlidingWindowSpec(sliding_window=window, **common),
        )
        for i in range(swa_groups)
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


_HASHER = None


def make_request(request_id: str, tokens: list[int], max_tokens: int = 8, extra_args: dict | None = None) -> Request:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256

    global _HASHER
    if _HASHER is None:
        init_none_hash(sha256)
        _HASHER = get_request_block_hasher(BLOCK, sha256)
    params = SamplingParams(max_tokens=max_tokens, extra_args=extra_args)
    return Request(request_id, list(tokens), params, None, block_hasher=_HASHER)

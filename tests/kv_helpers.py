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
    num_blocks: int,
    window: int = 32,
    swa_groups: int = 2,
    full_groups: int = 1,
    full_block: int = BLOCK,
    swa_block: int = BLOCK,
) -> KVCacheConfig:
    """Full groups first, then SWA groups, one layer each, all aliasing `num_blocks` blocks.

    Block sizes other than BLOCK: how vLLM sizes blocks where one kind of layer has fewer KV
    heads (MiMo-V2-Flash's Full layers), so that every group's page has the same bytes."""
    common = dict(num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    groups = [
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], FullAttentionSpec(block_size=full_block, **common))
        for i in range(full_groups)
    ] + [
        KVCacheGroupSpec(
            [f"model.layers.{full_groups + i}.self_attn.attn"],
            SlidingWindowSpec(sliding_window=window, block_size=swa_block, **common),
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

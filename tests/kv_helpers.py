"""Small real vLLM KV cache configs and requests for driving KV managers without a model, and the
helpers the manager tests share (a manager, a request run through it, a path of tree nodes)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from eval.vllm_names import KVCacheGroupSpec, init_none_hash
from vllm_mimo.compat import (
    FullAttentionSpec,
    KVCacheConfig,
    Request,
    RequestStatus,
    SlidingWindowSpec,
    get_request_block_hasher,
)
from vllm_mimo.config import MimoConfig
from vllm_mimo.engine.kv_manager import HybridKVCacheManager
from vllm_mimo.kv_cache.node import Node
from vllm_mimo.kv_cache.prefix_tree import PrefixTree
from vllm_mimo.kv_cache.tiers.host import HostTier

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
    common = {"num_kv_heads": 1, "head_size": 64, "dtype": torch.bfloat16}
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
    """A vLLM request for `tokens` with block hashes of BLOCK tokens (`extra_args`: e.g. anchor hints)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256

    global _HASHER
    if _HASHER is None:
        init_none_hash(sha256)
        _HASHER = get_request_block_hasher(BLOCK, sha256)
    params = SamplingParams(max_tokens=max_tokens, extra_args=extra_args)
    return Request(request_id, list(tokens), params, None, block_hasher=_HASHER)


SYSTEM = list(range(1000, 1000 + 10 * BLOCK))  # 10 blocks
"""A 10-block shared system prompt that the manager tests branch from."""


def manager(
    num_blocks: int = 400, *, window_local: bool = False, host_pages: int = 0, host_tier: type[HostTier] = HostTier, **config
) -> HybridKVCacheManager:
    """A manager over `kv_config(num_blocks)` (two SWA groups, window 32, four running requests)
    with `config` as its MimoConfig fields; grid anchors off unless `grid_anchor_tokens` says."""
    return HybridKVCacheManager(
        kv_config(num_blocks), 4096, BLOCK, BLOCK, max_num_running=4, window_local=window_local,
        host_pages=host_pages, host_tier=host_tier,
        mimo_config=MimoConfig(**{"grid_anchor_tokens": 0, **config}),
    )


def run(manager, request, output: list[int], chunk: int = 10_000) -> int:
    """Admit, prefill in chunks, decode `output`, finish; return the hit at admission."""
    blocks, hit, _ = manager.get_computed_blocks(request)
    n = min(request.num_tokens - hit, chunk)
    assert manager.allocate_slots(request, n, hit, blocks) is not None
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = hit + n
    manager.check_integrity()
    while request.num_computed_tokens < request.num_tokens:
        n = min(request.num_tokens - request.num_computed_tokens, chunk)
        assert manager.allocate_slots(request, n) is not None
        request.num_computed_tokens += n
        manager.check_integrity()
    for token in output:
        request.append_output_token_ids(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        manager.check_integrity()
    request.status = RequestStatus.FINISHED_STOPPED
    manager.free(request)
    manager.check_integrity()
    return hit


def run_with_host(m, request, output: list[int]) -> tuple[int, int, Any]:
    """Admit with the host tier's extension, load (the plan handed back as the connector does,
    failed if it is), prefill, decode `output`, finish, one step per allocation (each step's
    stores and puts taken); returns (device hit, external tokens, the load plan or None)."""
    blocks, hit, _ = m.get_computed_blocks(request)
    external = m.host_extension(request)
    assert m.allocate_slots(request, request.num_tokens - hit - external, hit, blocks,
                            num_external_computed_tokens=external) is not None
    m.take_stores()
    put_to_l3(m)
    plan = m.take_load(request.request_id)
    if plan is not None:
        m.check_integrity()  # scratch pages and held nodes accounted for
        m.finish_load(plan, failed=plan.failed)
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = request.num_tokens
    for token in output:
        request.append_output_token_ids(token)
        assert m.allocate_slots(request, 1) is not None
        m.take_stores()
        put_to_l3(m)
        request.num_computed_tokens += 1
    request.status = RequestStatus.FINISHED_STOPPED
    m.free(request)
    m.check_integrity()
    return hit, external, plan


def chain(tree: PrefixTree, n: int, swa: set[int] | None = None, prefix: str = "h") -> list[Node]:
    """A path of `n` nodes below the root, hashes `{prefix}0`...: Full blocks 100, 101, ... by
    depth, SWA blocks 200, 201, ... on the depths in `swa` (on all of them when None)."""
    nodes, parent = [], tree.root
    for i in range(n):
        node = tree.child(parent, f"{prefix}{i}")
        tree.set_full(node, (100 + i,))
        if swa is None or i in swa:
            node.swa_blocks = (200 + i,)
        nodes.append(node)
        parent = node
    return nodes


def prometheus_samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What the plugin's Prometheus collector reports now (from the snapshots the engines wrote),
    by (sample name, its labels sorted)."""
    from vllm_mimo import metrics

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in metrics.MimoCollector().collect()
        for s in family.samples
    }


class DictL3:
    """An `L3Index` (`vllm_mimo.kv_cache.tiers.l3`) over a set of keys: what the worker put
    (`put_to_l3`); `calls` counts the questions asked."""

    def __init__(self) -> None:
        self.keys: set[Hashable] = set()
        self.calls = 0

    def key(self, kind: str, index: int, block_hash: Any) -> Hashable:
        return (kind, index, block_hash)

    def contains(self, keys: Sequence[Hashable]) -> list[bool]:
        self.calls += 1
        return [k in self.keys for k in keys]


def first_session_through_host(m) -> Any:
    """A session's first turn (8 positions, 4 answer tokens) run through `m` with its tiers."""
    first = make_request("s", list(range(100, 100 + 8 * BLOCK)), max_tokens=4)
    run_with_host(m, first, output=[1, 2, 3, 4])
    return first


def others_through_host(m, count: int, start: int = 0) -> None:
    """`count` other prompts, each asked twice (its end served, so the host takes it): enough
    of them push the first session off the device and then off a 40-page host."""
    for i in range(start, start + count):
        for ask in range(2):
            run_with_host(m, make_request(f"other{i}.{ask}", [5000 + i] * (10 * BLOCK)), output=[3] * 4)


def put_to_l3(m) -> list:
    """The worker's side of a step's puts (`take_puts`): their keys enter the attached
    `DictL3`; returns the puts."""
    puts = m.take_puts()
    l3 = m.host_tier.l3 if m.host_tier is not None else None
    if l3 is not None:
        l3.index.keys.update(key for put in puts for key in put.keys)
    return puts

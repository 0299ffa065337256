"""Host memory for the host tier and the copies between it and the device's paged KV cache
(the worker's half of `MimoHostTierConnector`).

A host *page* holds one device block id's KV across the layers of its KV cache group (vLLM gives
every group's layers the same page size, so one page fits any group): layer i of a group lies at
byte offset i * (the group spec's page size) of the page. Both processes size the tier with
`host_page_bytes` and `host_pages`, so the scheduler's page ids (`HostTier`) index this buffer.

Every page carries a tag, the scheduler's number for the store that wrote it: a load whose pages
do not carry the tags its plan expects (memory lost or overwritten) fails, and the request
recomputes. Copies are per block and layer (`tensor.copy_`, the fastest CPU path measured:
`../shared/research/host-tier.md`); on CUDA they are non-blocking from pinned memory on the
current stream, which orders stores before the step's forward overwrites their blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

GIB = 1 << 30
_ALIGN = 64  # host page rows aligned for any KV dtype's element size


@dataclass(frozen=True, slots=True)
class PageCopy:
    """One device block of one KV cache group and its host page; `tag` names the store that
    wrote (or writes) the page."""

    group: int
    block: int
    page: int
    tag: int


def host_page_bytes(kv_cache_config: Any) -> int:
    """Bytes of one host page: the largest group's layers times its page size, aligned."""
    size = max(len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in kv_cache_config.kv_cache_groups)
    return -(-size // _ALIGN) * _ALIGN


def host_pages(kv_cache_config: Any, host_gib: float) -> int:
    """Host pages `host_gib` GiB hold for this KV cache layout."""
    return int(host_gib * GIB) // host_page_bytes(kv_cache_config)


def _block_dim(tensor: torch.Tensor, num_blocks: int, layer: str) -> int:
    """The dimension of a layer's KV tensor that indexes blocks ((num_blocks, ...) on CPU,
    (2, num_blocks, ...) for some CUDA backends)."""
    for dim in (0, 1):
        if tensor.dim() > dim and tensor.shape[dim] == num_blocks:
            return dim
    raise ValueError(f"KV cache of layer {layer} has shape {tuple(tensor.shape)}: no dimension of {num_blocks} blocks")


class HostKVBuffer:
    """The host pages and the per-layer views the copies use."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], kv_cache_config: Any, num_pages: int) -> None:
        self.num_pages = num_pages
        self.page_bytes = host_page_bytes(kv_cache_config)
        num_blocks = kv_cache_config.num_blocks
        device = next(iter(kv_caches.values())).device
        self.cuda = device.type == "cuda"
        # May raise (RuntimeError / MemoryError): the connector turns the tier off then.
        self.memory = torch.empty((num_pages, self.page_bytes), dtype=torch.uint8, pin_memory=self.cuda)
        self.tags = [-1] * num_pages
        # Per group: (device tensor, its block dimension, host view indexed by page) per layer.
        self.layers: list[list[tuple[torch.Tensor, int, torch.Tensor]]] = []
        for group in kv_cache_config.kv_cache_groups:
            stride = group.kv_cache_spec.page_size_bytes
            views = []
            for i, name in enumerate(group.layer_names):
                kv = kv_caches.get(name)
                if kv is None:
                    continue  # a layer that shares another layer's KV
                dim = _block_dim(kv, num_blocks, name)
                block = kv.select(dim, 0)
                nbytes = block.numel() * block.element_size()
                if nbytes > stride:
                    raise ValueError(f"layer {name}: {nbytes} bytes per block > its group's page size {stride}")
                rows = self.memory[:, i * stride : i * stride + nbytes]
                views.append((kv, dim, rows.view(kv.dtype).view(num_pages, *block.shape)))
            self.layers.append(views)

    def store(self, copies: Iterable[PageCopy]) -> int:
        """Device blocks to host pages; returns bytes copied."""
        copied = 0
        for c in copies:
            for kv, dim, host in self.layers[c.group]:
                host[c.page].copy_(kv.select(dim, c.block), non_blocking=self.cuda)
                copied += host[c.page].numel() * host.element_size()
            self.tags[c.page] = c.tag
        return copied

    def load(self, copies: Sequence[PageCopy]) -> int | None:
        """Host pages to device blocks; None (nothing copied) if a page does not carry its tag."""
        if any(self.tags[c.page] != c.tag for c in copies):
            return None
        copied = 0
        for c in copies:
            for kv, dim, host in self.layers[c.group]:
                kv.select(dim, c.block).copy_(host[c.page], non_blocking=self.cuda)
                copied += host[c.page].numel() * host.element_size()
        return copied

    def synchronize(self) -> None:
        """Wait for the copies issued so far (CUDA; CPU copies are done when issued)."""
        if self.cuda:
            torch.cuda.current_stream().synchronize()

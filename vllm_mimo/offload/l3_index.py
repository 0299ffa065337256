"""The engine's L3 on Mooncake Store: the scheduler's `L3Index` (`MooncakeIndex`: the names of
host pages in the store and which it holds) and the worker's client with the host pages
registered (`connect_l3`). The store client itself is `mooncake_store`.

A page's name is `mooncake_store.l3_key` of: the model, the KV layout (a digest of every KV
cache group's spec and layers, so engines whose bytes differ never share a name), the
tensor-parallel rank (the scheduler asks for rank 0's; each worker reads and writes its own),
the page's kind and KV cache group (with the block's index within the position where a group
has several per position), and the position's chained block hash. Engines share pages only
where they hash alike, as for vLLM's KV cache events: the same `--prefix-caching-hash-algo`,
and the same `PYTHONHASHSEED` where one is set (README, KV cache events).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_mimo.layout import kv_geometry
from vllm_mimo.log import logger
from vllm_mimo.offload.mooncake_store import L3Settings, L3Unavailable, MooncakeL3, l3_key


@dataclass(frozen=True, slots=True)
class L3Page:
    """One host page moving between the host and L3 under `key` (rank 0's name; a worker
    names its own rank's); `tag` the host page's store tag (`HostKVBuffer`)."""

    key: str
    page: int
    tag: int


def layout_digest(kv_cache_config: Any) -> str:
    """A short digest of what decides a page's bytes: each group's spec and layer names."""
    text = "|".join(f"{g.kv_cache_spec!r}:{','.join(g.layer_names)}" for g in kv_cache_config.kv_cache_groups)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class PageNames:
    """Page names for one engine (see the module docstring)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
        self.model = str(vllm_config.model_config.model)
        self.layout = layout_digest(kv_cache_config)
        geometry = kv_geometry(kv_cache_config)
        # Page `index` of a position's copy of a kind: (group, block within the position).
        self.groups = {
            kind: [(gid, sub) for gid in gids for sub in range(geometry.blocks_per_position(gid))]
            for kind, gids in (("full", geometry.full_group_ids), ("swa", geometry.swa_group_ids))
        }

    def key(self, kind: str, index: int, block_hash: Any, tp_rank: int = 0) -> str:
        gid, sub = self.groups[kind][index]
        group = gid if sub == 0 else f"{gid}.{sub}"
        return l3_key(self.model, self.layout, tp_rank, kind, group, block_hash)


class MooncakeIndex:
    """The host tier's `L3Index` on Mooncake Store (the scheduler's own client, contributing no
    memory: the workers' do)."""

    def __init__(self, names: PageNames, client: MooncakeL3) -> None:
        self.names = names
        self.client = client

    @classmethod
    def connect(cls, settings: L3Settings, vllm_config: Any, kv_cache_config: Any) -> MooncakeIndex | None:
        """The index, or None with a warning if the store cannot be reached (the L3 is off)."""
        try:
            client = MooncakeL3(settings, segment_bytes=0)
        except L3Unavailable as e:
            logger.warning("vllm-mimo: the L3 tier is off: %s", e)
            return None
        logger.info("vllm-mimo: L3 on Mooncake Store at %s", settings.master)
        return cls(PageNames(vllm_config, kv_cache_config), client)

    def key(self, kind: str, index: int, block_hash: Any) -> Hashable:
        return self.names.key(kind, index, block_hash)

    def contains(self, keys: Sequence[Hashable]) -> list[bool]:
        return self.client.contains([str(k) for k in keys])


def rank_key(key: str, rank: int) -> str:
    """A page's name for tensor-parallel rank `rank`, given rank 0's (`L3Page.key`)."""
    return key if rank == 0 else key.replace("|tp0|", f"|tp{rank}|", 1)


def connect_l3(settings: L3Settings, memory: Any) -> MooncakeL3 | None:
    """The worker's client with the host pages `memory` registered, or None with a warning."""
    try:
        client = MooncakeL3(settings, segment_bytes=int(settings.gib * (1 << 30)))
        client.register(memory)
    except L3Unavailable as e:
        logger.warning("vllm-mimo: the L3 tier is off: %s", e)
        return None
    return client


class L3Watch:
    """Whether the store's master is up, as a worker finds it: down when it accepts no connection
    (`MooncakeL3.reachable`) before a step's transfers or after a transfer failed, checked again
    every `recheck_s` while down, up once it accepts one (Mooncake's client reconnects by itself;
    a restarted master starts empty, and puts fill it again). Asked before the transfers because
    a transfer to a master that died waits about 4 s before it fails, while a connection to it is
    refused at once."""

    def __init__(self, client: MooncakeL3, recheck_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.recheck_s = recheck_s
        self.clock = clock
        self.up = True
        self._next_check = 0.0

    def failed(self) -> None:
        """A transfer failed: the master is down if it accepts no connection."""
        self._ask_while_up()

    def check(self, transfers: bool = False) -> bool:
        """Whether the master is up (asked again while down, at most every `recheck_s`); with
        `transfers` (the step moves pages), asked while up too."""
        if self.up:
            if transfers:
                self._ask_while_up()
        elif self.clock() >= self._next_check:
            self.up = self.client.reachable()
            self._next_check = self.clock() + self.recheck_s
        return self.up

    def _ask_while_up(self) -> None:
        if self.up and not self.client.reachable():
            self.up = False
            self._next_check = self.clock() + self.recheck_s

"""KV cache events: the hybrid KV manager's stores and evictions as vLLM's `BlockStored`,
`BlockRemoved` and `AllBlocksCleared`, for vLLM's publisher (`--kv-events-config`), batched
per step as vLLM's manager batches them (`batch_events`).

`KVEventRecorder` is a cache observer (`base.CacheObserver`). The prefix tree and the host tier
tell it, where it happens, of every node whose KV of a pool became held or not held on a medium
(`stored` / `removed`), and it records one event per KV cache group of that pool. A subscriber
replaying the events therefore holds, per (group, medium), exactly the hashes of the blocks the
manager holds: for a Full group where the Full KV is, for an SWA group where the SWA KV is (the
windows of anchors and of running requests). So it can tell where a window-safe hit is
possible, not only where Full KV is, with vLLM's own hybrid rule (`tests/test_kv_events.py`).

An event carries what vLLM's own manager puts there for the same blocks: per group, hashes at
the group's own block size (a position holds `KVGeometry.blocks_per_position(gid)` blocks of
group gid, each named by the request's chained hash at the block's end, as
`maybe_convert_block_hash` converts it), the hash before the first of them as parent, the
blocks' token ids and extra keys, the LoRA and session of the request that cached the
position, the group's kind and window, and the medium (`base.DEVICE`, `base.HOST`, `base.L3`: stored only). What a
position's events carry is read from the request as the position is cached (`caching`) and kept
while any medium holds it, so its host copy, stored later, is described the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_mimo.kv_cache.contract import CacheObserver
from vllm_mimo.kv_cache.geometry import KVGeometry
from vllm_mimo.kv_cache.node import Node
from vllm_mimo.kv_cache.pools import Pool
from vllm_mimo.kv_cache.prefix_tree import DEVICE, HOST, L3, PrefixTree
from vllm_mimo.kv_cache.tiers.host import host_full, host_swa


@dataclass(frozen=True, slots=True)
class _Group:
    """A KV cache group as its events name it."""

    gid: int
    block_size: int
    hash_blocks: int
    """Hash blocks per block of the group."""
    kind: str
    sliding_window: int | None


@dataclass(slots=True)
class _Position:
    """What the events of one cached position carry, and where it is held."""

    parent: Any
    """The chained hash before the position (None at the sequence's start)."""
    hashes: tuple[Any, ...]
    """The chained hash at the end of each of its hash blocks."""
    token_ids: tuple[int, ...]
    extra_keys: dict[int, tuple[Any, ...]]
    """By group block size: each block's extra keys (vLLM's `generate_block_hash_extra_keys`)."""
    lora_id: int | None
    lora_name: str | None
    session_id: str | None
    held: set[tuple[Pool, str]] = field(default_factory=set)


_SAME_STORE = ("block_size", "lora_id", "lora_name", "medium", "group_idx", "kv_cache_spec_kind",
               "kv_cache_spec_sliding_window", "locality", "ownership", "session_id")


def batch_events(events: Sequence[Any]) -> list[Any]:
    """`events` as vLLM's manager sends a step's: a store that goes on from the last event of its
    group and medium (the same fields, its parent that event's last block) joins it, and so does
    a removal that follows a removal, so a step gives one event per group and medium for every
    chain it cached or everything it evicted, not one per block. Events of different groups or
    media are independent for a subscriber (each holds its own set of blocks), so only their
    interleaving changes; `AllBlocksCleared` stays where it was, between the others."""
    from vllm_mimo.compat import AllBlocksCleared, BlockStored

    out: list[Any] = []
    last: dict[tuple[Any, Any], Any] = {}  # (group, medium): its latest event in `out`
    for event in events:
        if isinstance(event, AllBlocksCleared):
            out.append(event)
            last.clear()
            continue
        key = (event.group_idx, event.medium)
        before = last.get(key)
        if before is None or type(before) is not type(event):
            pass
        elif not isinstance(event, BlockStored):  # a removal after a removal
            before.block_hashes += event.block_hashes
            continue
        elif event.parent_block_hash == before.block_hashes[-1] and all(
            getattr(event, f) == getattr(before, f) for f in _SAME_STORE
        ):
            if event.extra_keys is not None or before.extra_keys is not None:
                before.extra_keys = (before.extra_keys or [None] * len(before.block_hashes)) + (
                    event.extra_keys or [None] * len(event.block_hashes)
                )
            before.block_hashes += event.block_hashes
            before.token_ids += event.token_ids
            continue
        out.append(event)
        last[key] = event
    return out


class KVEventRecorder(CacheObserver):
    """Records the cache's stores and removals as vLLM KV cache events (see the module
    docstring) until `take_events`."""

    def __init__(self, kv_cache_config: Any, geometry: KVGeometry, hash_block_size: int) -> None:
        from vllm_mimo.compat import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

        def group(gid: int) -> _Group:
            spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
            return _Group(
                gid,
                spec.block_size,
                spec.block_size // hash_block_size,
                get_kv_cache_spec_kind(spec).value,
                get_kv_cache_spec_sliding_window(spec),
            )

        self._groups = {
            Pool.FULL: [group(gid) for gid in geometry.full_group_ids],
            Pool.SWA: [group(gid) for gid in geometry.swa_group_ids],
        }
        self._block_sizes = sorted(set(geometry.group_block_sizes))
        self.block_size = geometry.block_size
        self.hash_stride = geometry.block_size // hash_block_size
        self._positions: dict[Any, _Position] = {}  # by node key (`Node.block_hash`)
        self._events: list[Any] = []

    def take_events(self) -> list[Any]:
        """The events recorded since the last call (vLLM's scheduler takes them once a step),
        batched by `batch_events`."""
        events, self._events = self._events, []
        return batch_events(events)

    # ------------------------------------------------------------ observer

    def caching(self, request: Any, start: int, end: int) -> None:
        from vllm_mimo.compat import generate_block_hash_extra_keys

        bs, stride, hashes, positions = self.block_size, self.hash_stride, request.block_hashes, self._positions
        lora = request.lora_request
        for pos in range(start, end):
            key = hashes[(pos + 1) * stride - 1]
            if key in positions:
                continue
            first = pos * bs
            positions[key] = _Position(
                parent=hashes[pos * stride - 1] if pos else None,
                hashes=tuple(hashes[pos * stride : (pos + 1) * stride]),
                token_ids=tuple(request.all_token_ids[first : first + bs]),
                extra_keys={
                    size: tuple(
                        generate_block_hash_extra_keys(request, block, block + size, 0)[0]
                        for block in range(first, first + bs, size)
                    )
                    for size in self._block_sizes
                },
                lora_id=lora.adapter_id if lora else None,
                lora_name=lora.name if lora else None,
                session_id=getattr(request, "session_id", None),
            )

    def stored(self, nodes: Sequence[Node], pool: Pool, medium: str) -> None:
        from vllm_mimo.compat import BlockStored, maybe_convert_block_hash, to_event_extra_keys

        for run in self._runs(nodes):
            for position in run if medium != L3 else ():  # L3 copies are never removed
                position.held.add((pool, medium))
            first = run[0]
            for g in self._groups[pool]:
                self._events.append(
                    BlockStored(
                        block_hashes=[maybe_convert_block_hash(h) for p in run for h in self._hashes(p, g)],
                        parent_block_hash=None if first.parent is None else maybe_convert_block_hash(first.parent),
                        token_ids=[t for p in run for t in p.token_ids],
                        block_size=g.block_size,
                        lora_id=first.lora_id,
                        medium=medium,
                        lora_name=first.lora_name,
                        extra_keys=to_event_extra_keys([k for p in run for k in p.extra_keys[g.block_size]]),
                        group_idx=g.gid,
                        kv_cache_spec_kind=g.kind,
                        kv_cache_spec_sliding_window=g.sliding_window,
                        session_id=first.session_id,
                    )
                )

    def removed(self, nodes: Sequence[Node], pool: Pool, medium: str) -> None:
        from vllm_mimo.compat import BlockRemoved, maybe_convert_block_hash

        positions = [self._positions[node.block_hash] for node in nodes]
        for g in self._groups[pool] if positions else ():
            hashes = [maybe_convert_block_hash(h) for p in positions for h in self._hashes(p, g)]
            self._events.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=g.gid))
        for node, position in zip(nodes, positions, strict=True):
            position.held.discard((pool, medium))
            if not position.held:
                del self._positions[node.block_hash]

    def cleared(self) -> None:
        from vllm_mimo.compat import AllBlocksCleared

        self._positions.clear()
        self._events.append(AllBlocksCleared())

    # ------------------------------------------------------------- reading

    def held_block_hashes(self, tree: PrefixTree) -> dict[tuple[int, str], set[Any]]:
        """The hashes of the blocks the tree's nodes hold, per (group, medium), as events name
        them, read from the nodes themselves (a walk over the whole tree; for tests)."""
        from vllm_mimo.compat import maybe_convert_block_hash

        held: dict[tuple[int, str], set[Any]] = {}
        for node in tree.nodes.values():
            where = (
                (Pool.FULL, DEVICE, node.full_blocks),
                (Pool.SWA, DEVICE, node.swa_blocks),
                (Pool.FULL, HOST, host_full(node)),
                (Pool.SWA, HOST, host_swa(node)),
            )
            for pool, medium, blocks in where:
                if blocks is None:
                    continue
                position = self._positions[node.block_hash]
                for g in self._groups[pool]:
                    held.setdefault((g.gid, medium), set()).update(
                        maybe_convert_block_hash(h) for h in self._hashes(position, g)
                    )
        return held

    def _hashes(self, position: _Position, group: _Group) -> tuple[Any, ...]:
        """The chained hashes of the group's blocks in `position`."""
        return position.hashes[group.hash_blocks - 1 :: group.hash_blocks]

    def _runs(self, nodes: Sequence[Node]) -> list[list[_Position]]:
        """The nodes' positions in chains, each node's parent the one before it in its chain
        (one event per chain and group, as vLLM's manager sends a request's new blocks), split
        where the session that cached them changes."""
        runs: list[list[_Position]] = []
        previous: Node | None = None
        for node in sorted(nodes, key=lambda n: n.depth):
            position = self._positions[node.block_hash]
            if runs and node.parent is previous and position.session_id == runs[-1][0].session_id:
                runs[-1].append(position)
            else:
                runs.append([position])
            previous = node
        return runs

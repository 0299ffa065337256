"""What the host tier (`host.HostTier`) hands out, as plain data: a request's hit extended by
the host and L3 (`HostMatch`), the copies a load or a store makes (`Copy`, `LoadPlan`), and its
counts; and the reads of its copies on a node (`node.HostSlot`, at `Node.host`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_mimo.kv_cache.node import Blocks, HostSlot, Node
from vllm_mimo.kv_cache.tiers.l3 import L3Copy


@dataclass(frozen=True, slots=True)
class Copy:
    """One position's KV of one pool moving between tiers: host pages and device block ids."""

    host: Blocks
    device: Blocks


@dataclass
class HostStats:
    """What the tier did, in positions (multiply by the pages of a position for bytes)."""

    stored_full: int = 0
    stored_swa: int = 0
    loaded_full: int = 0
    loaded_swa: int = 0
    hit_tokens: int = 0
    """Tokens of hits past the device's, loaded from host."""
    stored_anchors: int = 0
    """Anchors demoted to host."""
    skipped_stores: int = 0
    """Anchors dropped because the host could not take them."""
    evicted_anchors: int = 0
    failed_loads: int = 0
    """Loads whose copies failed (`finish_load` with `failed`): their requests recomputed."""
    uncomputed_stores: int = 0
    """Anchors evicted in the step that cached their node, before its forward computed it:
    dropped, not stored."""
    swapped_out_tokens: int = 0
    """Tokens up to preempted requests' resume anchors demoted to host (preemption as swap)."""
    swapped_in_tokens: int = 0
    """Tokens of preempted requests' hits loaded from host."""
    l3_hit_tokens: int = 0
    """Tokens of hits past the device's and the host's, loaded from L3 (part of `hit_tokens`)."""
    l3_loaded_full: int = 0
    l3_loaded_swa: int = 0
    l3_short_loads: int = 0
    """Loads from L3 for which the host had no free pages: failed at once, their requests recomputed."""


@dataclass(frozen=True)
class HostMatch:
    """A request's hit extended by the host: `path` its nodes from the start (device or host
    Full), `hit` the device's window-safe hit it extends and `blocks` the extended hit's end
    (positions, >= `hit`). Past the host, from L3: the Full KV of positions `l3_from` on and
    the SWA KV of positions `l3_swa`; `keys` the request's node keys."""

    path: list[Node]
    hit: int
    blocks: int
    l3_from: int = 1 << 62
    l3_swa: frozenset[int] = frozenset()
    keys: Sequence[Any] = ()
    generation: int = -1
    """`HostTier.generation` when it was found."""


@dataclass
class LoadPlan:
    """The copies an admission with a host extension needs, and the nodes held until they are
    done (`HostTier.finish_load`)."""

    full: list[Copy] = field(default_factory=list)
    swa: list[Copy] = field(default_factory=list)
    held: list[Node] = field(default_factory=list)
    fetches: list[L3Copy] = field(default_factory=list)
    """Reads from L3 into host pages of the plan's own, made before `full` and `swa`."""
    scratch: list[int] = field(default_factory=list)
    """The host pages `fetches` fill, free again at `HostTier.finish_load`."""
    failed: bool = False
    """The host had no pages for `fetches`: the load fails without a copy (recompute)."""


def slot(node: Node) -> HostSlot:
    """The node's host slot, created if missing."""
    if node.host is None:
        node.host = HostSlot()
    return node.host


def held(node: Node) -> HostSlot:
    """The node's host slot, where the tier's rules say it has one (a host Full copy's parent,
    a host anchor's node and window)."""
    s = node.host
    assert s is not None, f"no host copy at {node}"
    return s


def host_copy(node: Node, kind: str) -> Blocks:
    """The node's host copy of `kind` ("full" / "swa"), where a load plan says it has one."""
    pages = held(node).full if kind == "full" else held(node).swa
    assert pages is not None, f"no host {kind} copy at {node}"
    return pages


def host_full(node: Node) -> Blocks | None:
    """The node's host Full copy, if any."""
    return None if node.host is None else node.host.full


def host_swa(node: Node) -> Blocks | None:
    """The node's host SWA copy, if any."""
    return None if node.host is None else node.host.swa

"""SWA anchors: positions whose preceding window of SWA KV is kept after requests move on.

An anchor ends at a tree node (a block boundary). It covers that node and the ancestors a hit
there needs (`window_blocks` nodes); while it lives, their SWA blocks are not freed. Anchors
are evicted demoted ones first (see `AnchorSet`), then least recently used first, pinned
anchors last, whenever the SWA KV they retain exceeds the anchor budget or the SWA pool needs
the blocks.

A shared anchor whose node running requests hold is in use, as a block held by a running
request is in use for vLLM's LRU: it is not evicted at all while held, and goes back to the
recent end of the order when the last holder lets go. Its Full KV stays resident for the
holders anyway, so evicting it would free only its SWA window, and the next request to reach it
would recompute the whole shared prefix. When nothing else can be evicted an allocation fails
instead, and the scheduler waits or preempts, as it does when upstream's pool is full of blocks
running requests hold. Two kinds are shared: a hot prefix (another session on the same system
prompt), and a prompt tail, the last grid point of a running request's prompt, where a request
that shares the long prompt branches off while the first still runs (a next turn sent at its
timestamp, a second question on the same document). A prompt tail demoted for being seldom
useful is not held. Other kinds are not held: a session holds every grid and branch point of
its own past turns, and keeping all of those for as long as it runs costs more hits than it
saves (measured in eval/RESULTS.md).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from enum import Enum
from typing import Any

from vllm_mimo.block_manager.prefix_tree import Node


class AnchorKind(str, Enum):
    DECLARED = "declared"  # SamplingParams.extra_args["mimo"]["anchors"], or the chat API
    HOT = "hot"  # a node reused by at least `hot_prefix_min_hits` distinct requests
    BRANCH = "branch"  # a node with two or more children: a shared-prefix junction
    PROMPT_END = "prompt_end"  # where a request's prompt ends
    OUTPUT_END = "output_end"  # where a finished request's output ends (the next turn's prefix)
    GRID = "grid"  # every `grid_anchor_tokens` of a prompt, where a later request may branch off
    PROMPT_TAIL = "prompt_tail"  # the last grid point before a prompt's end
    RESUME = "resume"  # where a preempted request's cached KV ends; it resumes there


SHARED_KINDS = frozenset({AnchorKind.HOT, AnchorKind.PROMPT_TAIL})
"""Prefixes that other requests reach while one runs: in use while a running request holds the
node."""

SPECULATIVE_KINDS = frozenset(
    {AnchorKind.GRID, AnchorKind.PROMPT_TAIL, AnchorKind.PROMPT_END, AnchorKind.OUTPUT_END}
)
"""Anchors placed on every request in case a later one branches there; most never serve."""

PASSED_KINDS = SPECULATIVE_KINDS | {AnchorKind.RESUME}
"""Anchors that have done their job once the request continuing from them moves on."""


class Anchor:
    """An anchor ending at `node`; `window` are the nodes whose SWA KV it keeps."""

    __slots__ = ("node", "window", "kinds", "pinned", "last_used", "served")

    def __init__(
        self, node: Node, window: list[Node], kind: AnchorKind, pinned: bool, now: float
    ) -> None:
        self.node = node
        self.window = window
        self.kinds = {kind}
        self.pinned = pinned
        self.last_used = now  # creation or the latest hit that ended at it
        self.served = False  # whether a hit has ended at it

    def __repr__(self) -> str:
        kinds = ",".join(sorted(k.value for k in self.kinds))
        return f"Anchor(depth={self.node.depth}, {kinds}{', pinned' if self.pinned else ''})"


class AnchorSet:
    """Live anchors in eviction order: demoted anchors first, then the others least recently
    used first, pinned anchors after all of them; shared anchors held by running requests are
    kept apart and never evicted.

    Demoted anchors (no longer needed, or of a kind that seldom serves) leave the latest
    demoted first, and those that never served a hit before those that did: a served anchor
    marks a junction requests did come back to, so another may fork there.

    It also learns, per kind, the share of speculative anchors that serve a hit (`usefulness`).
    An anchor demoted for a low share goes first and is often evicted before its request
    comes, which would keep the share low however useful the kind is. So the block hashes of
    the latest `ghost_capacity` speculative anchors evicted before serving are remembered, and
    a later request whose prompt passes one of them past its hit counts as the serve it missed.
    """

    def __init__(self, ghost_capacity: int = 0) -> None:
        # Unpinned anchors, in three queues evicted in this order.
        self._demoted_unserved: OrderedDict[int, Anchor] = OrderedDict()
        self._demoted_served: OrderedDict[int, Anchor] = OrderedDict()
        self._unpinned: OrderedDict[int, Anchor] = OrderedDict()  # not demoted, LRU first
        self._held: OrderedDict[int, Anchor] = OrderedDict()
        self._pinned: OrderedDict[int, Anchor] = OrderedDict()
        self._shared: dict[int, Anchor] = {}  # live anchors of a shared kind, held or not
        self.created: Counter[AnchorKind] = Counter()
        self.served: Counter[AnchorKind] = Counter()
        self.ghost_capacity = ghost_capacity
        # Block hash of the node of a speculative anchor evicted before it served -> its kinds.
        self._ghosts: OrderedDict[Any, frozenset[AnchorKind]] = OrderedDict()

    def usefulness(self, kind: AnchorKind) -> float:
        """Share of this kind's anchors that served a hit so far, or would have had they not
        been evicted (1/2 before any evidence)."""
        return (self.served[kind] + 1) / (self.created[kind] + 2)

    def remember_evicted(self, anchor: Anchor) -> None:
        """`anchor` is being evicted: if it is speculative and never served, remember where."""
        kinds = anchor.kinds & SPECULATIVE_KINDS
        if kinds and not anchor.served and self.ghost_capacity:
            key = anchor.node.block_hash
            self._ghosts[key] = frozenset(kinds)
            self._ghosts.move_to_end(key)
            if len(self._ghosts) > self.ghost_capacity:
                self._ghosts.popitem(last=False)

    def credit_missed_serve(self, block_hashes: Sequence[Any], start: int, end: int) -> None:
        """A new request could hit up to block `end` but hits only `start` blocks: the deepest
        remembered evicted anchor in between would have served it."""
        if not self._ghosts:
            return
        for pos in range(end - 1, start - 1, -1):
            kinds = self._ghosts.pop(block_hashes[pos], None)
            if kinds is not None:
                self.served.update(kinds)
                return

    def record_hit(self, anchor: Anchor, now: float) -> None:
        """A hit ended at `anchor`."""
        if not anchor.served:
            anchor.served = True
            self.served.update(anchor.kinds)
        self.touch(anchor, now)

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues())

    def __iter__(self) -> Iterator[Anchor]:
        """Every live anchor: the evictable ones in eviction order, then the held ones."""
        for queue in self._queues():
            yield from queue.values()

    def _queues(self) -> tuple[OrderedDict[int, Anchor], ...]:
        return self._demoted_unserved, self._demoted_served, self._unpinned, self._pinned, self._held

    def _queue(self, anchor: Anchor) -> OrderedDict[int, Anchor]:
        for queue in self._queues():
            if id(anchor) in queue:
                return queue
        raise KeyError(f"{anchor} is not a live anchor")

    def add(self, anchor: Anchor) -> None:
        (self._pinned if anchor.pinned else self._unpinned)[id(anchor)] = anchor
        self.created.update(anchor.kinds)
        if anchor.kinds & SHARED_KINDS:
            self._shared[id(anchor)] = anchor

    def add_kind(self, anchor: Anchor, kind: AnchorKind) -> None:
        """A live anchor is now also of `kind`."""
        anchor.kinds.add(kind)
        self.created[kind] += 1
        if kind in SHARED_KINDS:
            self._shared[id(anchor)] = anchor

    def remove(self, anchor: Anchor) -> None:
        self._queue(anchor).pop(id(anchor))
        self._shared.pop(id(anchor), None)

    def touch(self, anchor: Anchor, now: float) -> None:
        """Mark as just used: last in its eviction order (no longer demoted, so in use again if
        it is shared and a running request holds its node)."""
        queue = self._queue(anchor)
        anchor.last_used = now
        if queue is self._demoted_unserved or queue is self._demoted_served:
            self._unpinned[id(anchor)] = queue.pop(id(anchor))
            if anchor.node.full_refs:
                self.hold(anchor)
        else:
            queue.move_to_end(id(anchor))

    def demote(self, anchor: Anchor) -> None:
        """Mark as no longer needed: first in its eviction order."""
        anchor.last_used = float("-inf")
        if anchor.pinned:
            self._pinned.move_to_end(id(anchor), last=False)
            return
        demoted = self._demoted_served if anchor.served else self._demoted_unserved
        demoted[id(anchor)] = self._queue(anchor).pop(id(anchor))
        demoted.move_to_end(id(anchor), last=False)

    def holdable(self, anchor: Anchor) -> bool:
        """Whether `hold` would take the anchor out of the eviction order: an unpinned shared
        anchor not demoted (held ones included)."""
        return bool(anchor.kinds & SHARED_KINDS) and not anchor.pinned and anchor.last_used != float("-inf")

    def hold(self, anchor: Anchor) -> None:
        """A running request now holds the anchor's node: a shared anchor is in use."""
        if id(anchor) in self._unpinned and self.holdable(anchor):
            self._held[id(anchor)] = self._unpinned.pop(id(anchor))

    def release(self, anchor: Anchor, now: float) -> None:
        """No running request holds the anchor's node any more: just used."""
        if id(anchor) in self._held:
            self._unpinned[id(anchor)] = self._held.pop(id(anchor))
            anchor.last_used = now

    def pin(self, anchor: Anchor) -> None:
        if not anchor.pinned:
            self._queue(anchor).pop(id(anchor))
            anchor.pinned = True
            self._pinned[id(anchor)] = anchor

    def check_integrity(self) -> None:
        for anchor in self._held.values():
            assert not anchor.pinned and anchor.kinds & SHARED_KINDS, anchor
            assert anchor.node.full_refs > 0, f"{anchor} is held but no running request holds its node"
            assert anchor.last_used != float("-inf"), f"{anchor} is held but demoted"
        for queue, served in ((self._demoted_unserved, False), (self._demoted_served, True)):
            for anchor in queue.values():
                assert not anchor.pinned and anchor.last_used == float("-inf"), f"{anchor} is not demoted"
                assert anchor.served == served, f"{anchor} is in the wrong demoted queue"
        for anchor in self._unpinned.values():
            assert not anchor.pinned, anchor
            assert anchor.last_used != float("-inf"), f"{anchor} is demoted but not in a demoted queue"
            held = anchor.kinds & SHARED_KINDS and anchor.node.full_refs > 0
            assert not held, f"{anchor} is in use but not held"
        assert all(anchor.pinned for anchor in self._pinned.values())
        shared = {id(anchor) for anchor in self if anchor.kinds & SHARED_KINDS}
        assert shared == set(self._shared), "the shared-kind index disagrees with the live anchors"
        assert len(self._ghosts) <= self.ghost_capacity, "more evicted anchors remembered than allowed"

    def tiers(self, include_held: bool = False) -> Iterator[list[Anchor]]:
        """The evictable anchors in tiers, each in eviction order: unpinned (demoted ones
        first), pinned, then held ones if `include_held`. Victims come from the first tier
        that is not empty."""
        yield [anchor for queue in self._queues()[:3] for anchor in queue.values()]
        yield list(self._pinned.values())
        if include_held:
            yield list(self._held.values())

    def victim(self, include_held: bool = False) -> Anchor | None:
        """The anchor to evict next: unpinned, then pinned, then held ones if `include_held`
        (for a request with nobody else running); None if none is left."""
        for queue in self._queues()[: 5 if include_held else 4]:
            if queue:
                return next(iter(queue.values()))
        return None

    def num_demoted(self) -> int:
        """Demoted anchors that are not pinned: they lead the eviction order."""
        return len(self._demoted_unserved) + len(self._demoted_served)

    def is_held(self, anchor: Anchor) -> bool:
        return id(anchor) in self._held

    def shared(self) -> Iterator[Anchor]:
        """Live shared anchors, held or not: the only ones that can be held."""
        return iter(self._shared.values())


class AnchorHintError(ValueError):
    """A request's `extra_args["mimo"]` anchor hints are malformed."""


def declared_anchors(extra_args: dict | None) -> tuple[list[int], bool]:
    """Token positions and pin flag from `SamplingParams.extra_args["mimo"]`, validated."""
    hints = (extra_args or {}).get("mimo")
    if hints is None:
        return [], False
    if not isinstance(hints, dict):
        raise AnchorHintError(f'extra_args["mimo"] must be an object, got {hints!r}')
    unknown = set(hints) - {"anchors", "pin"}
    if unknown:
        raise AnchorHintError(
            f'unknown keys {sorted(unknown)} in extra_args["mimo"]; allowed: anchors, pin'
        )
    positions = hints.get("anchors", [])
    pin = hints.get("pin", False)
    if not isinstance(positions, list) or not all(
        isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in positions
    ):
        raise AnchorHintError(
            f'extra_args["mimo"]["anchors"] must be a list of positive token positions, '
            f"got {positions!r}"
        )
    if not isinstance(pin, bool):
        raise AnchorHintError(f'extra_args["mimo"]["pin"] must be true or false, got {pin!r}')
    return positions, pin

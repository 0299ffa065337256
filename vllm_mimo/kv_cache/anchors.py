"""SWA anchors and the state machine that orders them for eviction.

An anchor ends at a tree node (a position boundary). It covers that node and the ancestors a
hit there needs (its `window`, counted in each node's `anchor_refs`); while it lives, their SWA
blocks are not freed (`node.Anchor`, with its kinds and states). Where anchors are placed is
the anchor policy's business (`anchor_policy.py`); `AnchorSet` applies its decisions. When
anchors go is the cache's eviction order (`contract.KVCache.evict`), whose anchor part is the
order of `AnchorState`.

Why a shared anchor is held: a block a running request holds is in use for vLLM's LRU, and so
is an anchor whose node a running request holds, where other requests come to it while that
one runs (another session on a hot system prompt; a second question on a long prompt, which
branches off at that prompt's last grid point). Its Full KV stays resident for the holders
anyway, so evicting it would free only its SWA window, and the next request to reach it would
recompute the whole shared prefix. Other kinds are not held: a session holds every grid and
branch point of its own past turns, and keeping all of those for as long as it runs costs more
hits than it saves (measured in eval/RESULTS.md).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from vllm_mimo.kv_cache.node import DEMOTED_STATES, Anchor, AnchorKind, AnchorState, Node

SHARED_KINDS = frozenset({AnchorKind.HOT, AnchorKind.PROMPT_TAIL})
"""Prefixes that other requests reach while one runs: held while a running request holds the
node."""

SPECULATIVE_KINDS = frozenset(
    {AnchorKind.GRID, AnchorKind.PROMPT_TAIL, AnchorKind.PROMPT_END, AnchorKind.OUTPUT_END}
)
"""Anchors placed on every request in case a later one branches there; most never serve."""

PASSED_KINDS = SPECULATIVE_KINDS | {AnchorKind.RESUME}
"""Anchors that have done their job once the request continuing from them moves on."""


@dataclass(frozen=True)
class AnchorDecision:
    """An anchor policy's decision (`base.AnchorPolicy`): place an anchor of `kind` at `node`
    (or add the kind to the anchor there; `pinned` pins it), or, with `demote`, demote the
    anchor at `node`."""

    node: Node
    kind: AnchorKind | None = None
    pinned: bool = False
    demote: bool = False


EVICTION_ORDER = (AnchorState.DEMOTED_UNSERVED, AnchorState.DEMOTED_SERVED, AnchorState.GREEDY_DUAL, AnchorState.PINNED)
"""The anchor part of the cache's eviction order (`base.KVCache.evict`)."""

PRIOR_REUSE_GAP = 1000.0
"""Anchor uses between an anchor's last use and a hit at it, assumed before the first hit: one
pseudo-observation in `AnchorSet.reuse_gap`, which the first hits soon outweigh. How the clock
was chosen: eval/RESULTS.md, issue 18."""


class AnchorSet:
    """Live anchors, one queue per `AnchorState`. Transitions:

        add        -> GREEDY_DUAL, or PINNED
        touch      DEMOTED_* -> GREEDY_DUAL (then HELD if `hold` would take it); GREEDY_DUAL: priority
                   renewed; others: to the back
        demote     GREEDY_DUAL, HELD, DEMOTED_* -> the front of DEMOTED_SERVED or DEMOTED_UNSERVED;
                   PINNED -> the front of PINNED
        hold       GREEDY_DUAL -> HELD, for a shared kind; others stay
        release    HELD -> GREEDY_DUAL
        pin        any -> PINNED
        remove     any -> gone (`evicted`: and the clock rises to its priority)

    `apply` carries out an anchor policy's decisions: an anchor covers `window_blocks`
    positions (0: no anchors are placed), a new one starts demoted where `starts_demoted` says
    so (the policy's rule), and `placed` / `demoted` are told of each anchor placed (or given a
    new kind) and demoted. `worth`: the policy's worth per block of an anchor, which orders the
    GREEDY_DUAL state (`AnchorState`); `keeps_full`: the policy's `keeps_full`, set on each
    anchor placed or given a new kind (`Anchor.keeps_full`)."""

    def __init__(
        self,
        window_blocks: int = 1,
        starts_demoted: Callable[[Anchor, AnchorKind], bool] = lambda anchor, kind: False,
        placed: Callable[[Anchor, AnchorKind], None] = lambda anchor, kind: None,
        demoted: Callable[[Anchor], None] = lambda anchor: None,
        worth: Callable[[Anchor], float] = lambda anchor: 0.0,
        keeps_full: Callable[[Anchor], bool] = lambda anchor: True,
    ) -> None:
        self.window_blocks = window_blocks
        self._starts_demoted = starts_demoted
        self._placed = placed
        self._demoted = demoted
        self._queues: dict[AnchorState, OrderedDict[int, Anchor]] = {state: OrderedDict() for state in AnchorState}
        self._shared: dict[int, Anchor] = {}  # live anchors of a shared kind, held or not
        self._worth = worth
        self._keeps_full = keeps_full
        # The GREEDY_DUAL state's order: (priority, entry, id of the anchor); an entry is stale once its
        # anchor left the state or was used again (a newer entry), and is skipped when met. The
        # id, not the anchor: a stale entry must not keep an evicted anchor (and the tree nodes
        # of its window) alive, which made the garbage collector's passes longer.
        self._heap: list[tuple[float, int, int]] = []
        self.uses = 0  # anchor uses so far: the time of the clock
        self.clock = 0.0  # GreedyDual's inflation
        self._worth_used = 0.0  # the worths of all uses so far
        self._gaps = 0.0  # uses between an anchor's last use and a hit at it, summed over hits
        self._hits = 0

    def __len__(self) -> int:
        return sum(map(len, self._queues.values()))

    def __iter__(self) -> Iterator[Anchor]:
        """Every live anchor: the evictable ones in eviction order, then the held ones."""
        for state in (*EVICTION_ORDER, AnchorState.HELD):
            yield from self._in_order(state)

    def _in_order(self, state: AnchorState) -> list[Anchor]:
        queue = self._queues[state]
        if state is AnchorState.GREEDY_DUAL:
            return sorted(queue.values(), key=lambda anchor: (anchor.priority, anchor.entry))
        return list(queue.values())

    def reuse_gap(self) -> float:
        """The mean number of anchor uses between an anchor's last use and a hit at it (with
        `PRIOR_REUSE_GAP` as one observation)."""
        return (self._gaps + PRIOR_REUSE_GAP) / (self._hits + 1)

    def now(self) -> float:
        """The clock (`AnchorState`): the larger of GreedyDual's inflation and time."""
        return max(self.clock, self._worth_used / self.reuse_gap())

    def _used(self, anchor: Anchor) -> None:
        """An anchor in the GREEDY_DUAL state was just used: its priority is the clock plus its worth."""
        worth = self._worth(anchor)
        self._worth_used += worth
        self.uses += 1
        anchor.priority = self.now() + worth
        anchor.entry = self.uses
        heapq.heappush(self._heap, (anchor.priority, anchor.entry, id(anchor)))
        live = self._queues[AnchorState.GREEDY_DUAL]
        if len(self._heap) > 2 * len(live) + 64:
            self._heap = [e for e in self._heap if getattr(live.get(e[2]), "entry", None) == e[1]]
            heapq.heapify(self._heap)

    def _greedy_dual_first(self) -> Anchor | None:
        heap, live = self._heap, self._queues[AnchorState.GREEDY_DUAL]
        while heap:
            _, entry, key = heap[0]
            anchor = live.get(key)
            if anchor is not None and anchor.entry == entry:
                return anchor
            heapq.heappop(heap)
        return None

    def _move(self, anchor: Anchor, state: AnchorState, front: bool = False) -> None:
        self._queues[anchor.state].pop(id(anchor))
        queue = self._queues[state]
        queue[id(anchor)] = anchor
        if front:
            queue.move_to_end(id(anchor), last=False)
        anchor.state = state
        if state is AnchorState.GREEDY_DUAL:
            self._used(anchor)

    def add(self, anchor: Anchor, pinned: bool) -> None:
        anchor.state = AnchorState.PINNED if pinned else AnchorState.GREEDY_DUAL
        self._queues[anchor.state][id(anchor)] = anchor
        if anchor.kinds & SHARED_KINDS:
            self._shared[id(anchor)] = anchor
        if not pinned:
            self._used(anchor)

    def add_kind(self, anchor: Anchor, kind: AnchorKind) -> None:
        """A live anchor is now also of `kind`."""
        anchor.kinds.add(kind)
        if kind in SHARED_KINDS:
            self._shared[id(anchor)] = anchor

    def remove(self, anchor: Anchor) -> None:
        self._queues[anchor.state].pop(id(anchor))
        self._shared.pop(id(anchor), None)
        anchor.entry = 0  # its GREEDY_DUAL heap entry, if any, is stale

    def evicted(self, anchor: Anchor, in_order: bool = True) -> None:
        """`anchor` is evicted: gone, and the clock rises to its priority if it was in the GREEDY_DUAL
        state (GreedyDual's aging: see `AnchorState`) and went `in_order` (as `victim` chose it;
        an anchor that goes with its node's Full KV, `Anchor.keeps_full`, was not the least
        worth, and aging the others by its worth ranked every older anchor below every newer one)."""
        if in_order and anchor.state is AnchorState.GREEDY_DUAL and anchor.priority > self.clock:
            self.clock = anchor.priority
        self.remove(anchor)

    def touch(self, anchor: Anchor) -> None:
        """Just used: a live anchor's priority is renewed, a pinned or held one goes to the
        back of its queue, a demoted one is live again (and in use, if it is shared and a
        running request holds its node)."""
        if anchor.demoted:
            self._move(anchor, AnchorState.GREEDY_DUAL)
            if anchor.node.full_refs:
                self.hold(anchor)
        elif anchor.state is AnchorState.GREEDY_DUAL:
            self._used(anchor)
        else:
            self._queues[anchor.state].move_to_end(id(anchor))

    def record_hit(self, anchor: Anchor) -> None:
        """A hit ended at `anchor`; the uses since its last use in the GREEDY_DUAL state count toward
        `reuse_gap`."""
        if anchor.entry:
            self._gaps += self.uses - anchor.entry
            self._hits += 1
        anchor.served = True
        self.touch(anchor)

    def demote(self, anchor: Anchor) -> None:
        """No longer needed: first in its part of the eviction order."""
        if anchor.pinned:
            self._queues[AnchorState.PINNED].move_to_end(id(anchor), last=False)
        else:
            self._move(anchor, AnchorState.DEMOTED_SERVED if anchor.served else AnchorState.DEMOTED_UNSERVED, front=True)

    def holdable(self, anchor: Anchor) -> bool:
        """Whether `hold` would take the anchor out of the eviction order: a shared anchor that
        is live (GREEDY_DUAL) or held already."""
        return anchor.state in (AnchorState.GREEDY_DUAL, AnchorState.HELD) and bool(anchor.kinds & SHARED_KINDS)

    def hold(self, anchor: Anchor) -> None:
        """A running request now holds the anchor's node: a shared anchor is in use."""
        if anchor.state is AnchorState.GREEDY_DUAL and anchor.kinds & SHARED_KINDS:
            self._move(anchor, AnchorState.HELD)

    def hold_nodes(self, nodes: Iterable[Node]) -> None:
        """Running requests now hold these anchored nodes."""
        for node in nodes:
            assert node.anchor is not None, node
            self.hold(node.anchor)

    def release_nodes(self, nodes: Iterable[Node]) -> None:
        """No running request holds these anchored nodes any more."""
        for node in nodes:
            assert node.anchor is not None, node
            self.release(node.anchor)

    def release(self, anchor: Anchor) -> None:
        """No running request holds the anchor's node any more: just used."""
        if anchor.state is AnchorState.HELD:
            self._move(anchor, AnchorState.GREEDY_DUAL)

    def pin(self, anchor: Anchor) -> None:
        if not anchor.pinned:
            self._move(anchor, AnchorState.PINNED)

    def apply(self, decisions: Iterable[AnchorDecision]) -> None:
        """Carry out an anchor policy's decisions, in order: place an anchor (or add a kind to
        the one there, pin it, and count it as just used), or demote one."""
        for decision in decisions:
            if decision.demote:
                if decision.node.anchor is not None:
                    self._demote(decision.node.anchor)
            elif self.window_blocks:
                self._place(decision.node, decision.kind, decision.pinned)  # type: ignore[arg-type]

    def _place(self, node: Node, kind: AnchorKind, pinned: bool) -> None:
        anchor = node.anchor
        if anchor is not None:
            if kind not in anchor.kinds:
                self.add_kind(anchor, kind)
                self._placed(anchor, kind)
                anchor.keeps_full = self._keeps_full(anchor)
            if pinned:
                self.pin(anchor)
            self.touch(anchor)
        else:
            anchor = Anchor(node, kind, self.window_blocks)
            anchor.keeps_full = self._keeps_full(anchor)
            self.add(anchor, pinned)
            self._placed(anchor, kind)
            if self._starts_demoted(anchor, kind):
                self._demote(anchor)
                return
        if node.full_refs:
            self.hold(anchor)

    def _demote(self, anchor: Anchor) -> None:
        self.demote(anchor)
        self._demoted(anchor)

    def tiers(self, include_held: bool = False) -> Iterator[list[Anchor]]:
        """The evictable anchors in tiers, each in eviction order: unpinned (demoted ones
        first), pinned, then held ones if `include_held`. Victims come from the first tier
        that is not empty."""
        yield [anchor for state in (*DEMOTED_STATES, AnchorState.GREEDY_DUAL) for anchor in self._in_order(state)]
        yield list(self._queues[AnchorState.PINNED].values())
        if include_held:
            yield list(self._queues[AnchorState.HELD].values())

    def victim(self, include_held: bool = False) -> Anchor | None:
        """The anchor to evict next, in `EVICTION_ORDER`, then held ones if `include_held` (for
        a request with nobody else running); None if none is left."""
        for state in EVICTION_ORDER:
            if state is AnchorState.GREEDY_DUAL:
                first = self._greedy_dual_first()
                if first is not None:
                    return first
                continue
            queue = self._queues[state]
            if queue:
                return next(iter(queue.values()))
        held = self._queues[AnchorState.HELD]
        if include_held and held:
            return next(iter(held.values()))
        return None

    def num_demoted(self) -> int:
        """Unpinned demoted anchors: they lead the eviction order."""
        queues = self._queues
        return len(queues[AnchorState.DEMOTED_UNSERVED]) + len(queues[AnchorState.DEMOTED_SERVED])

    def is_held(self, anchor: Anchor) -> bool:
        return anchor.state is AnchorState.HELD

    def held_window_nodes(self, hit_path: Sequence[Node] = (), hit: int = 0, window_blocks: int = 0) -> int:
        """Nodes whose SWA blocks only held shared anchors keep (not evictable while held),
        outside the `window_blocks` before the hit of a request admitted with `hit_path` (a
        hit of `hit` positions), which it adopts; admitting it holds the shared anchors on its
        path too."""
        held = [
            anchor
            for anchor in self._shared.values()
            if anchor.state is AnchorState.HELD
            or (  # admitting the request takes the first reference on its node: held then
                anchor.node.full_refs == 0
                and anchor.node.depth < len(hit_path)
                and hit_path[anchor.node.depth] is anchor.node
                and self.holdable(anchor)
            )
        ]
        if not held:
            return 0
        adopted = {id(node) for node in hit_path[max(0, hit - window_blocks) : hit]}
        covered = {
            id(node)
            for anchor in held
            for node in anchor.window
            if node.swa_refs == 0 and node.swa_blocks is not None and id(node) not in adopted
        }
        return len(covered)

    def of_kind(self, kind: AnchorKind) -> list[Anchor]:
        """Live anchors that include `kind`."""
        return [anchor for anchor in self if kind in anchor.kinds]

    def check_integrity(self) -> None:
        in_heap = {entry for _, entry, _ in self._heap}
        for state, queue in self._queues.items():
            for anchor in queue.values():
                assert anchor.state is state, f"{anchor} is in the {state.name} queue"
                held = bool(anchor.kinds & SHARED_KINDS) and anchor.node.full_refs > 0
                if state is AnchorState.HELD:
                    assert held, f"{anchor} is held, but it is not shared or no running request holds its node"
                elif state is AnchorState.GREEDY_DUAL:
                    assert not held, f"{anchor} is in use but not held"
                    assert anchor.entry in in_heap, f"{anchor} is not in the GREEDY_DUAL order"
                elif state in DEMOTED_STATES:
                    assert anchor.served == (state is AnchorState.DEMOTED_SERVED), f"{anchor} is in the wrong demoted queue"
        shared = {id(anchor) for anchor in self if anchor.kinds & SHARED_KINDS}
        assert shared == set(self._shared), "the shared-kind index disagrees with the live anchors"


"""The host tier's lookups and loads (`HostLoads`, a part of `host.HostTier`): how far host and
L3 copies extend a request's hit (`extend`), and the load of an admission with such an
extension: the host copies it reads held until its plan is made (`hold_load`), the plan
(`plan_load`, with the reads from L3 into host pages of its own: `vllm_mimo.kv_cache.tiers.l3`'s
rules), taken by the data plane (`take_load`) and done or failed (`finish_load`). Each rule is
written once, in the docstring of the method that carries it out; the store and eviction rules
(and why a load's nodes are never evicted) are `host.py`'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from vllm_mimo.kv_cache.node import Blocks, HostAnchor, Node
from vllm_mimo.kv_cache.prefix_tree import PrefixTree, TreeMatch
from vllm_mimo.kv_cache.tiers.host_copies import Copy, HostMatch, HostStats, LoadPlan, host_copy
from vllm_mimo.kv_cache.tiers.l3 import L3Copy, L3Tier


class HostLoads(ABC):
    """The lookups and loads of `host.HostTier` (see the module docstring), over the tier's
    state, which its constructor sets, and the store and eviction steps it defines."""

    tree: PrefixTree
    stats: HostStats
    l3: L3Tier | None
    full_pages: int
    swa_pages: int
    window_blocks: int
    block_size: int
    back_off: int
    generation: int
    _free: deque[int]
    _holds: dict[int, int]
    """id(node) -> planned loads holding it."""
    _loads: dict[str, LoadPlan]
    _scratch: set[int]
    """Host pages of loads from L3 not finished yet."""

    @abstractmethod
    def _take(self, count: int) -> Blocks:
        """`count` free host pages (there are as many)."""

    @abstractmethod
    def _make_room(self) -> bool:
        """Evict the least recently used host anchor nothing holds; False if there is none."""

    @abstractmethod
    def _renew(self, anchor: HostAnchor, tick: int) -> None:
        """The host anchor was used at `tick`."""

    @abstractmethod
    def evict(self, anchor: HostAnchor) -> None:
        """Drop a host anchor and the copies only it needs."""

    @abstractmethod
    def _prune_up(self, node: Node) -> None:
        """Free host Full copies from `node` up while nothing needs them."""

    def extend(self, keys: Sequence[Any], match: TreeMatch, hit: int, max_blocks: int) -> HostMatch:
        """The hit past the device's window-safe `hit` (positions, of `match`) that host copies
        make: the deepest end L <= `max_blocks` such that every position in `hit`..L has its
        Full KV on the host or is among the unreferenced device positions right after the hit
        (`TreeMatch.takeover`), and every position of L's window past `hit` has a host SWA
        copy (those before `hit` are the device hit's own window); with `back_off` (EAGLE/MTP
        drafting: 1), L is that many positions short of such an end, whose window and
        `back_off` positions more are on host (anchor windows are that much longer then), as
        the device's hits stop a position short for the drafter. With an L3, a position's Full
        KV past the host's and its SWA KV may be there instead (the module docstring's last
        rule). Does not change anything."""
        path = list(match.path[:max_blocks])
        takeover = match.takeover(hit)
        nodes = self.tree.nodes
        # The slots are read inline, not through `host_full` / `host_swa`: this runs per lookup.
        for key in keys[len(path) : max_blocks]:
            node = nodes.get(key)
            if node is None or node.host is None or node.host.full is None:
                break
            path.append(node)
        full_end = hit  # Full KV on the device (taken over) or the host up to here
        for end in range(hit + 1, len(path) + 1):
            s = path[end - 1].host
            if end > hit + takeover and (s is None or s.full is None):
                break
            full_end = end
        l3_swa: frozenset[int] = frozenset()
        reach = full_end
        if self.l3 is not None:
            reach, l3_swa = self.l3.reach(keys, path, hit, full_end, min(max_blocks, len(keys)))
        best = hit
        window = self.window_blocks + self.back_off
        missing = hit - 1  # the last position from `hit` on without a host or L3 SWA copy, so far
        for end in range(hit + 1, reach + 1):
            s = path[end - 1].host if end <= len(path) else None
            if (s is None or s.swa is None) and end - 1 not in l3_swa:
                missing = end - 1
            stop = end - self.back_off
            if stop > hit and missing < max(hit, end - window):
                best = stop
        return HostMatch(path, hit, best, full_end, l3_swa, keys, self.generation)

    # ------------------------------------------------------------------ loads

    def _load_sources(self, extension: HostMatch, adopted: int) -> tuple[range, range]:
        """The positions whose host Full / SWA copies a load of `extension` reads, for a request
        that adopts the device's first `adopted` positions (the last rule of the module
        docstring)."""
        hit, end = extension.hit, extension.blocks
        return range(max(hit, adopted), end), range(max(hit, end - self.window_blocks), end)

    def hold_load(self, extension: HostMatch, adopted: int) -> list[Node]:
        """Keep the host copies a load of `extension` reads until `plan_load`'s plan is done;
        returns the nodes held."""
        full, swa = self._load_sources(extension, adopted)
        return self.hold(
            [extension.path[p] for p in full if p < extension.l3_from]
            + [extension.path[p] for p in swa if p not in extension.l3_swa]
        )

    def plan_load(
        self,
        request_id: str,
        extension: HostMatch,
        adopted: int,
        held: list[Node],
        full: Sequence[Blocks],
        swa: Sequence[Blocks | None],
        preempted: bool,
        tick: int,
    ) -> None:
        """The copies from host of an admission with a host extension (`take_load`): into its
        new Full blocks `full` (from position `adopted` on) and SWA blocks `swa` (from the
        device hit on); `held`: what `hold_load` held for it."""
        plan = LoadPlan(held=held)
        path = extension.path
        full_range, swa_range = self._load_sources(extension, adopted)
        from_l3_full = [pos for pos in full_range if pos >= extension.l3_from]
        from_l3_swa = [pos for pos in swa_range if pos in extension.l3_swa]
        pages = len(from_l3_full) * self.full_pages + len(from_l3_swa) * self.swa_pages
        plan.failed = not self._fetch_room(pages)
        if plan.failed:
            self.stats.l3_short_loads += 1
        else:
            plan.fetches = [self._fetch(extension.keys[pos], "full", self.full_pages) for pos in from_l3_full]
            plan.fetches += [self._fetch(extension.keys[pos], "swa", self.swa_pages) for pos in from_l3_swa]
            plan.scratch = [page for fetch in plan.fetches for page in fetch.host]
            self._scratch.update(plan.scratch)
        fetched = iter(fetch.host for fetch in plan.fetches)
        plan.full = [
            Copy(host_copy(path[pos], "full") if pos < extension.l3_from else next(fetched, ()), full[pos - adopted])
            for pos in full_range
        ]
        plan.swa = [
            Copy(host_copy(path[pos], "swa") if pos not in extension.l3_swa else next(fetched, ()), swa[pos - extension.hit])  # type: ignore[arg-type]
            for pos in swa_range
        ]
        stats = self.stats
        stats.loaded_full += len(plan.full)
        stats.loaded_swa += len(plan.swa)
        stats.l3_loaded_full += len(from_l3_full)
        stats.l3_loaded_swa += len(from_l3_swa)
        tokens = (extension.blocks - extension.hit) * self.block_size
        stats.hit_tokens += tokens
        stats.l3_hit_tokens += max(0, extension.blocks - max(extension.hit, extension.l3_from)) * self.block_size
        if preempted:
            stats.swapped_in_tokens += tokens
        if extension.blocks <= len(path):
            self.touch(path[extension.blocks - 1], tick)
        self._loads[request_id] = plan

    def _fetch_room(self, pages: int) -> bool:
        """Free `pages` host pages for a load from L3, evicting host anchors nothing holds."""
        while len(self._free) < pages:
            if not self._make_room():
                return False
        return True

    def _fetch(self, block_hash: Any, kind: str, count: int) -> L3Copy:
        """A read of one position's `kind` pages from L3 into new host pages."""
        assert self.l3 is not None
        return self.l3.fetch(block_hash, kind, self._take(count))

    def take_load(self, request_id: str) -> LoadPlan | None:
        """The copies from host that the latest admission of this request needs, held until
        `finish_load`."""
        return self._loads.pop(request_id, None)

    def hold(self, nodes: Iterable[Node]) -> list[Node]:
        """Keep these nodes' host copies until `release` (a planned load reads them)."""
        held = list(nodes)
        for node in held:
            self._holds[id(node)] = self._holds.get(id(node), 0) + 1
        return held

    def release(self, nodes: Iterable[Node]) -> None:
        for node in nodes:
            count = self._holds[id(node)] - 1
            if count:
                self._holds[id(node)] = count
            else:
                del self._holds[id(node)]
                if node.host is not None and node.host.anchor is None:
                    self._prune_up(node)

    def touch(self, node: Node, tick: int) -> None:
        """A hit ended at the host anchor at `node`: it goes to the back of the order."""
        if node.host is not None and node.host.anchor is not None:
            self._renew(node.host.anchor, tick)

    def finish_load(self, plan: LoadPlan, failed: bool = False) -> None:
        """The plan's copies are done: its nodes are no longer held. With `failed` (the request
        recomputes) their host copies are dropped too, with every host anchor at or below them
        or whose window covers them, so no later request is offered the same load."""
        nodes = {id(node) for node in plan.held}
        self.release(plan.held)
        plan.held = []
        self._free.extend(plan.scratch)
        self._scratch.difference_update(plan.scratch)
        plan.scratch = []
        if not failed:
            return
        if self.l3 is not None:
            self.l3.read_failed(plan.fetches)
        self.stats.failed_loads += 1
        victims = []
        for node in self.tree.nodes.values():
            anchor = None if node.host is None else node.host.anchor
            if anchor is None:
                continue
            walk = node
            while walk.depth >= 0 and id(walk) not in nodes:
                walk = walk.parent  # type: ignore[assignment]
            if walk.depth >= 0 or any(id(w) in nodes for w in anchor.window):
                victims.append(anchor)
        for anchor in victims:
            self.evict(anchor)

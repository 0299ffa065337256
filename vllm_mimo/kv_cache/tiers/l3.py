"""The shared third tier (L3): its policy behind the host tier, and what it asks of the store.

The store is outside this engine (Mooncake Store in the engine, `vllm_mimo.offload.l3_index`; a
simulated one in eval's cluster replay) and holds host pages under names every instance
computes alike. The host tier (`host.HostTier`) enters it one way, `HostTier.attach_l3`, and
calls this module's `L3Tier` at three points; its rules, each written once here:
  * what the host evicts to make room goes to L3 (`put`): the Full copies freed and the
    window's SWA copies, except pages whose store from the device is still to be made this step
    (the host tier decides that) and copies dropped by a failed load;
  * a hit extends past the host's Full copies into positions whose every Full page L3 holds,
    with the window before its end on the host or in L3 (`reach`: two batched questions);
  * L3 pages are read into host pages of the load's own (`fetch`), taken like a store's
    (evicting host anchors), and freed when the load is done; a load without such pages fails
    at once (`HostStats.l3_short_loads`);
  * pages whose read failed are not offered from L3 again until this tier puts them again
    (`read_failed`: a store that holds a page but fails to read it would otherwise have its
    request retry forever);
  * the store's answers are remembered for `answer_ttl_s` (`holds`): a request waiting for room
    asks again only for pages it has not asked about within that time, and this tier's own puts
    and failed reads update the answers at once. What another instance puts, or the store
    evicts, is seen within `answer_ttl_s`; a read of a page the store evicted meanwhile fails
    and the request recomputes.

One object per page: `L3Index.key(kind, index, block_hash)` names the page `index` (0.. the pages
a position's copy of `kind` takes, "full" or "swa") of the position whose chained block hash is
`block_hash`. Equal keys must mean equal bytes, so a key also names what else decides them
(model, KV layout, tensor-parallel rank). The data moves in the worker
(`vllm_mimo.offload.connector`); the scheduler only names it here (`take_puts`, `LoadPlan.fetches`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_mimo.kv_cache.node import Blocks, Node
from vllm_mimo.kv_cache.pools import Pool
from vllm_mimo.kv_cache.prefix_tree import L3, KVListener

ANSWER_TTL_S = 1.0
"""How long the store's answer about a page is trusted (see the module docstring)."""


class L3Index(Protocol):
    """The scheduler's side of the shared store."""

    def key(self, kind: str, index: int, block_hash: Any) -> Hashable:
        """The store's name of one page of one position's copy (see the module docstring)."""
        ...

    def contains(self, keys: Sequence[Hashable]) -> list[bool]:
        """Which of `keys` the store holds now (it evicts on its own: a later read may still
        miss, and then the load fails and the request recomputes)."""
        ...


@dataclass(frozen=True, slots=True)
class L3Copy:
    """One position's KV of one pool moving between the host and L3: the store's `keys`, one
    per host page of `host`."""

    keys: tuple[Hashable, ...]
    host: Blocks


@dataclass
class L3Counts:
    """What the tier did: positions put, and the questions it asked the store."""

    put_full: int = 0
    put_swa: int = 0
    store_calls: int = 0
    """`L3Index.contains` calls (each one round trip to the store)."""


class L3Tier:
    """The L3 policy behind the host tier (see the module docstring). `full_pages` / `swa_pages`:
    host pages per position's copy of each kind; `listener`: told of pages put (medium L3)."""

    def __init__(
        self,
        index: L3Index,
        full_pages: int,
        swa_pages: int,
        listener: KVListener,
        *,
        answer_ttl_s: float = ANSWER_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.pages = {"full": full_pages, "swa": swa_pages}
        self.listener = listener
        self.answer_ttl_s = answer_ttl_s
        self.clock = clock
        self.counts = L3Counts()
        self._puts: list[L3Copy] = []
        self._unreadable: set[Hashable] = set()
        self._answers: dict[Hashable, tuple[bool, float]] = {}  # key -> (held, when asked)
        self._asked_since_prune = 0

    def put(self, node: Node, kind: str, pages: Blocks) -> None:
        """The host frees `node`'s copy of `kind` in `pages` to make room: it goes to L3."""
        keys = tuple(self.index.key(kind, i, node.block_hash) for i in range(len(pages)))
        self._unreadable.difference_update(keys)
        now = self.clock()
        for key in keys:
            self._answers[key] = (True, now)
        self._puts.append(L3Copy(keys, pages))
        self.listener.tell_stored((node,), Pool.FULL if kind == "full" else Pool.SWA, L3)
        if kind == "full":
            self.counts.put_full += 1
        else:
            self.counts.put_swa += 1

    def take_puts(self) -> list[L3Copy]:
        """The copies to L3 that puts since the last call need (the worker makes them this
        step, before the step's stores reuse the pages)."""
        puts, self._puts = self._puts, []
        return puts

    def reach(
        self, keys: Sequence[Any], path: list[Node], hit: int, full_end: int, max_blocks: int
    ) -> tuple[int, frozenset[int]]:
        """How far L3 carries the Full KV past `full_end` (the end of the device's and the
        host's), and which positions from `hit` to there have their SWA pages in L3 but not on
        the host."""
        reach = full_end
        if full_end < max_blocks:
            for whole in self.holds("full", [keys[pos] for pos in range(full_end, max_blocks)]):
                if not whole:
                    break
                reach += 1
        lacking = [
            pos for pos in range(hit, reach) if pos >= len(path) or (s := path[pos].host) is None or s.swa is None
        ]
        if not lacking or reach == hit:
            return reach, frozenset()
        swa = self.holds("swa", [keys[pos] for pos in lacking])
        return reach, frozenset(pos for pos, whole in zip(lacking, swa, strict=True) if whole)

    def holds(self, kind: str, block_hashes: Sequence[Any]) -> list[bool]:
        """Per position: whether L3 holds every page of its `kind` copy (at most one question;
        none when every page's answer is fresh)."""
        pages = self.pages[kind]
        keys = [self.index.key(kind, i, h) for h in block_hashes for i in range(pages)]
        now = self.clock()
        answers = self._answers
        ask = []
        for key in keys:
            known = answers.get(key)
            if known is None or now - known[1] >= self.answer_ttl_s:
                ask.append(key)
        if ask:
            self.counts.store_calls += 1
            for key, held in zip(ask, self.index.contains(ask), strict=True):
                answers[key] = (held, now)
            self._prune(now, len(ask))
        unreadable = self._unreadable
        found = [answers[key][0] and key not in unreadable for key in keys]
        return [all(found[i : i + pages]) for i in range(0, len(found), pages)]

    def _prune(self, now: float, asked: int) -> None:
        """Forget stale answers once as many were asked as are remembered (amortized O(1))."""
        self._asked_since_prune += asked
        if self._asked_since_prune >= len(self._answers):
            self._asked_since_prune = 0
            self._answers = {k: v for k, v in self._answers.items() if now - v[1] < self.answer_ttl_s}

    def fetch(self, block_hash: Any, kind: str, host: Blocks) -> L3Copy:
        """A read of one position's `kind` pages from L3 into the host pages `host`."""
        return L3Copy(tuple(self.index.key(kind, i, block_hash) for i in range(len(host))), host)

    def read_failed(self, fetches: Sequence[L3Copy]) -> None:
        """These reads failed: their pages are not offered again until put again."""
        self._unreadable.update(key for fetch in fetches for key in fetch.keys)

    def clear(self) -> None:
        """Nothing left to put (a prefix cache reset)."""
        self._puts.clear()

"""Two block pools over disjoint id ranges of one KV buffer: SWA `[1, S)` and Full `[S, N)`.

Block 0 is vLLM's null block and belongs to neither pool. Each pool has its own free list and
its own count of blocks in use; eviction of cached blocks is the cache's business (the prefix
tree knows which cached blocks are worth keeping), so a pool only ever hands out free blocks.

Moving across the boundary:
  * a pool takes a block from its own free list first;
  * when it has none, it borrows a free block of the other pool, the one nearest the boundary;
  * a borrowed block goes back to its home pool's free list as soon as it is freed, so the
    ranges heal: a pool lends only blocks it has no use for at the moment.
Only free blocks cross. Cached blocks leave a pool only through the cache's eviction
(`base.KVCache.evict`), whichever pool needs the space; a pool never takes another's cached
block by borrowing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from enum import IntEnum


class Pool(IntEnum):
    SWA = 0
    FULL = 1


class BlockPools:
    """Free lists and usage counters for the SWA and Full pools."""

    def __init__(self, num_blocks: int, swa_blocks: int) -> None:
        if not 1 <= swa_blocks <= num_blocks - 2:
            raise ValueError(
                f"the SWA pool must have between 1 and {num_blocks - 2} of the {num_blocks} "
                f"blocks (block 0 is the null block and the Full pool needs at least one), "
                f"got {swa_blocks}"
            )
        self.num_blocks = num_blocks
        self.boundary = 1 + swa_blocks
        self.home_size = (swa_blocks, num_blocks - self.boundary)
        # Own allocations pop from the right, borrowing pops from the left: the SWA list runs
        # from the boundary down, the Full list from the boundary up, so both pools use their
        # blocks far from the boundary first and lend the ones nearest to it.
        self._free: tuple[deque[int], deque[int]] = (
            deque(range(self.boundary - 1, 0, -1)),
            deque(range(self.boundary, num_blocks)),
        )
        self._owner = bytearray(num_blocks)
        self._owner[self.boundary :] = bytes([Pool.FULL]) * (num_blocks - self.boundary)
        self.used = [0, 0]
        self.peak_used = [0, 0]
        self.borrowed = [0, 0]

    def home(self, block_id: int) -> Pool:
        return Pool.SWA if block_id < self.boundary else Pool.FULL

    def owner(self, block_id: int) -> Pool:
        return Pool(self._owner[block_id])

    def num_free(self, pool: Pool) -> int:
        return len(self._free[pool])

    def take_many(self, pool: Pool, count: int) -> list[int]:
        """`count` free blocks for `pool`: its own first, then the other pool's (borrowed)."""
        own, other = self._free[pool], self._free[1 - pool]
        if count > len(own) + len(other):
            raise RuntimeError(f"{count} blocks asked of the {pool.name} pool, {len(own) + len(other)} free")
        mine = min(count, len(own))
        ids = [own.pop() for _ in range(mine)]
        if mine < count:
            owner = self._owner
            for _ in range(count - mine):
                block_id = other.popleft()
                owner[block_id] = pool
                ids.append(block_id)
            self.borrowed[pool] += count - mine
        used = self.used[pool] = self.used[pool] + count
        if used > self.peak_used[pool]:
            self.peak_used[pool] = used
        return ids

    def give_back(self, block_ids: Iterable[int]) -> None:
        """Return blocks to their home pools' free lists."""
        owner, used, free, boundary = self._owner, self.used, self._free, self.boundary
        for block_id in block_ids:
            used[owner[block_id]] -= 1
            home = Pool.SWA if block_id < boundary else Pool.FULL  # self.home(), inlined: hot loop
            owner[block_id] = home
            free[home].append(block_id)

    def num_free_total(self) -> int:
        return len(self._free[0]) + len(self._free[1])

    def usage(self) -> float:
        """Fraction of all (non-null) blocks in use."""
        return (self.used[0] + self.used[1]) / (self.num_blocks - 1)

    def check_integrity(self) -> None:
        seen: set[int] = set()
        for pool in Pool:
            for block_id in self._free[pool]:
                assert block_id not in seen, f"block {block_id} is on a free list twice"
                assert self.home(block_id) == pool, f"free block {block_id} is not on its home list"
                seen.add(block_id)
        assert 0 not in seen, "the null block is on a free list"
        assert len(seen) + self.used[0] + self.used[1] == self.num_blocks - 1, (
            f"free {len(seen)} + used {self.used} != {self.num_blocks - 1} blocks"
        )

"""The shape of a hybrid KV cache, read from vLLM's `KVCacheConfig`."""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedKVLayout(ValueError):
    """The KV cache groups are not a Full + SWA hybrid the plugin's manager can drive."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGeometry:
    """Block size, window and which KV cache groups are Full and which SWA.

    Every group aliases one backing buffer of `num_blocks` blocks (block 0 is vLLM's null
    block), so a block id is owned by one group at a time.

    The manager works in *positions* of `block_size` tokens: the least common multiple of the
    groups' block sizes, vLLM's scheduler block size. Where every group has the same block size
    a position is one block per group. Where page sizes differ (MiMo-V2-Flash below TP 8: its
    SWA layers have twice the Full layers' KV heads), vLLM gives the groups with smaller pages
    larger blocks, and a position holds `block_size // group_block_sizes[gid]` blocks of group
    `gid`.
    """

    block_size: int
    num_blocks: int
    window: int
    full_group_ids: tuple[int, ...]
    swa_group_ids: tuple[int, ...]
    group_block_sizes: tuple[int, ...]
    """Each group's own block size, by group id."""

    @property
    def uniform(self) -> bool:
        """Whether every group's block is one position."""
        return all(size == self.block_size for size in self.group_block_sizes)

    def blocks_per_position(self, gid: int) -> int:
        return self.block_size // self.group_block_sizes[gid]

    @property
    def full_ids_per_position(self) -> int:
        """Full block ids one position holds, over all Full groups."""
        return sum(self.blocks_per_position(gid) for gid in self.full_group_ids)

    @property
    def swa_ids_per_position(self) -> int:
        """SWA block ids one position holds, over all SWA groups."""
        return sum(self.blocks_per_position(gid) for gid in self.swa_group_ids)

    @property
    def window_blocks(self) -> int:
        """Positions of SWA KV a hit at a position boundary needs before it: the W - 1 previous tokens."""
        return cdiv(self.window - 1, self.block_size)

    @property
    def swa_blocks_per_request(self) -> int:
        """SWA block ids one decoding request holds: its window plus the position being written."""
        return self.swa_ids_per_position * (self.window_blocks + 1)

"""The block pools (`vllm_mimo.kv_cache.pools`): the SWA/Full split of the block ids, borrowing
across it, and its bounds."""

from __future__ import annotations

import pytest

from vllm_mimo.kv_cache.pools import BlockPools, Pool


def test_pools_split_the_ids_and_keep_the_null_block_out():
    pools = BlockPools(num_blocks=10, swa_blocks=3)
    assert pools.home_size == (3, 6)
    swa = pools.take_many(Pool.SWA, 3)
    full = pools.take_many(Pool.FULL, 6)
    assert sorted(swa) == [1, 2, 3] and sorted(full) == [4, 5, 6, 7, 8, 9]
    assert pools.borrowed == [0, 0]
    pools.check_integrity()


def test_an_empty_pool_borrows_the_free_block_nearest_the_boundary_and_it_goes_home():
    pools = BlockPools(num_blocks=10, swa_blocks=3)
    own = pools.take_many(Pool.SWA, 3)
    borrowed = pools.take_many(Pool.SWA, 1)
    assert borrowed == [4] and pools.owner(4) == Pool.SWA and pools.borrowed[Pool.SWA] == 1
    pools.give_back(borrowed + own)
    assert pools.owner(4) == Pool.FULL and pools.num_free(Pool.FULL) == 6 and pools.used == [0, 0]
    with pytest.raises(RuntimeError, match="10 blocks asked of the SWA pool, 9 free"):
        pools.take_many(Pool.SWA, 10)
    pools.check_integrity()


def test_a_pool_split_must_leave_both_pools_a_block():
    with pytest.raises(ValueError, match="between 1 and 8"):
        BlockPools(num_blocks=10, swa_blocks=9)

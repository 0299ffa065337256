"""The KV geometry (`vllm_mimo.kv_cache.geometry`) read from vLLM's KV cache config: groups,
window, and groups with different block sizes."""

from __future__ import annotations

import pytest

from tests.kv_helpers import BLOCK, kv_config
from vllm_mimo.kv_cache.geometry import UnsupportedKVLayout
from vllm_mimo.layout import kv_geometry


def test_geometry_reads_groups_and_window():
    geo = kv_geometry(kv_config(64, window=40, swa_groups=3))
    assert geo.full_group_ids == (0,) and geo.swa_group_ids == (1, 2, 3)
    assert geo.window_blocks == 3 and geo.swa_blocks_per_request == 3 * 4


def test_geometry_rejects_a_non_hybrid_config():
    with pytest.raises(UnsupportedKVLayout, match="needs Full and SWA groups"):
        kv_geometry(kv_config(64, swa_groups=0))


def test_geometry_of_groups_with_different_block_sizes():
    """MiMo-V2-Flash below TP 8: vLLM gives the Full group (fewer KV heads) 2x larger blocks."""
    geo = kv_geometry(kv_config(64, window=40, swa_groups=3, full_block=2 * BLOCK))
    assert geo.block_size == 2 * BLOCK and not geo.uniform
    assert geo.full_ids_per_position == 1 and geo.swa_ids_per_position == 3 * 2
    # W - 1 = 39 tokens before a hit: 2 positions of 32, each 2 SWA blocks of 16 per group.
    assert geo.window_blocks == 2 and geo.swa_blocks_per_request == 6 * 3

"""The served soak (`eval.soak`), bounded: half a minute of four chat sessions on `vllm serve`
with the plugin, a host tier and a pinned prompt, clients that go away and bad input."""

from __future__ import annotations

import pytest

from eval import soak

pytestmark = pytest.mark.engine


def test_a_short_soak_leaves_no_block_held_no_violation_and_the_plugin_off_tokens(tiny_models):
    result = soak.run(str(tiny_models["mimo"]), minutes=0.5, sessions=4, kv_gib=0.01, host_gib=0.02, seed=0)
    soak.print_table(result)
    assert result.failures() == []
    assert result.aborted_mid_stream + result.cancelled > 0 and result.completed > 20
    assert result.integrity_checks > 0 and result.held_blocks_after == 0

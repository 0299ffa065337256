"""The L3 tier's policy (`vllm_mimo.kv_cache.tiers.l3`, in `host_tier.HostTier`) through the
manager, over an in-memory store: what the host evicts goes to L3, a hit runs past the host
into what L3 holds and is loaded through host pages of its own, another instance sharing the
store loads what one demoted, and a store that lost pages or a host without room never gives a
load that reads what is not there. The bytes are the engine's (tests/test_l3_engine.py)."""

from __future__ import annotations

from tests.kv_helpers import (
    BLOCK,
    DictL3,
    first_session_through_host,
    kv_config,
    make_request,
    manager,
    others_through_host,
    run_with_host,
)
from vllm_mimo.compat import maybe_convert_block_hash
from vllm_mimo.config import MimoConfig
from vllm_mimo.engine.kv_manager import HybridKVCacheManager
from vllm_mimo.kv_cache.prefix_tree import HOST, L3


def _manager(l3: DictL3, host_pages: int = 40, num_blocks: int = 40):
    m = manager(num_blocks, host_pages=host_pages)
    m.attach_l3(l3)
    return m


def test_what_the_host_evicts_goes_to_l3_and_a_hit_runs_past_the_host_into_it():
    l3 = DictL3()
    m = _manager(l3)
    first = first_session_through_host(m)
    others_through_host(m, 12)  # the device and then the host (40 pages) give up the first session
    host = m.cache.host
    assert host.stats.evicted_anchors > 0 and host.l3.counts.put_full > 0 and host.l3.counts.put_swa > 0
    assert ("full", 0, first.block_hashes[0]) in l3.keys
    # Mask-only in L3 too: SWA pages only of anchors' windows.
    assert host.l3.counts.put_swa <= m.geometry.window_blocks * host.stats.evicted_anchors < host.l3.counts.put_full
    turn = make_request("s2", first.all_token_ids[:-1] + [9] * 20)
    hit, external, plan = run_with_host(m, turn, output=[1])
    expected = (first.num_tokens - 1) // BLOCK * BLOCK
    assert hit + external == expected and host.stats.l3_hit_tokens > 0, (hit, external, host.stats)
    assert not plan.failed and plan.fetches and {k for f in plan.fetches for k in f.keys} <= l3.keys
    # Each copy to the device reads a page the plan fetched from L3 or a host copy.
    fetched = {page for f in plan.fetches for page in f.host}
    assert {page for c in plan.full + plan.swa for page in c.host} >= fetched


def test_another_instance_sharing_the_store_loads_what_one_demoted():
    l3 = DictL3()
    a, b = _manager(l3), _manager(l3)
    first = first_session_through_host(a)
    others_through_host(a, 12)
    turn = make_request("s2", first.all_token_ids[:-1] + [9] * 20)
    hit, external, plan = run_with_host(b, turn, output=[1])
    assert hit == 0 and external == (first.num_tokens - 1) // BLOCK * BLOCK
    assert b.cache.host.stats.l3_hit_tokens == external and b.cache.host.stats.hit_tokens == external
    assert len(plan.full) == external // BLOCK and len(plan.swa) == b.geometry.window_blocks
    assert b.metrics.hit_tokens == external


def test_no_l3_hit_where_the_store_lost_a_page():
    l3 = DictL3()
    a, b = _manager(l3), _manager(l3)
    first = first_session_through_host(a)
    others_through_host(a, 12)
    l3.keys.discard(("full", 0, first.block_hashes[3]))
    turn = make_request("s2", first.all_token_ids[:-1] + [9] * 20)
    _, external, _ = run_with_host(b, turn, output=[1])
    assert external < 3 * BLOCK  # the Full KV stops at the lost page; no window ends before it here


def test_a_host_without_free_pages_fails_the_l3_load_at_once():
    l3 = DictL3()
    a = _manager(l3)
    first = first_session_through_host(a)
    others_through_host(a, 12)
    b = _manager(l3, host_pages=2)  # fewer pages than the load reads
    turn = make_request("s2", first.all_token_ids[:-1] + [9] * 20)
    _, external, plan = run_with_host(b, turn, output=[1])
    assert external > 0 and plan.failed and not plan.fetches
    assert b.cache.host.stats.l3_short_loads == 1


def test_pages_put_to_l3_are_published_as_kv_cache_events_on_medium_l3():
    """A router learns where L3 holds a prefix from the events (stored only: the store evicts
    silently, `prefix_tree.L3`); the host copies they replace are removed on medium CPU."""

    l3 = DictL3()
    m = HybridKVCacheManager(
        kv_config(40), 4096, BLOCK, BLOCK, max_num_running=4, host_pages=40,
        mimo_config=MimoConfig(grid_anchor_tokens=0), enable_kv_cache_events=True,
    )
    m.attach_l3(l3)
    first = first_session_through_host(m)
    others_through_host(m, 12)
    events = m.take_events()
    put = {h for e in events if type(e).__name__ == "BlockStored" and e.medium == L3 for h in e.block_hashes}
    assert put and not any(type(e).__name__ == "BlockRemoved" and e.medium == L3 for e in events)
    assert any(type(e).__name__ == "BlockRemoved" and e.medium == HOST for e in events)
    assert maybe_convert_block_hash(first.block_hashes[0]) in put
    assert m.cache.host.l3.counts.put_full > 0


def test_pages_whose_read_failed_are_not_offered_again_until_put_again():
    """A store that holds a page but fails to read it: the request recomputes once, and later
    lookups do not send it back to the same read (no retry loop)."""
    l3 = DictL3()
    a, b = _manager(l3), _manager(l3)
    first = first_session_through_host(a)
    others_through_host(a, 12)
    turn = make_request("s2", first.all_token_ids[:-1] + [9] * 20)
    blocks, hit, _ = b.get_computed_blocks(turn)
    external = b.host_extension(turn)
    assert external > 0
    assert b.allocate_slots(turn, 0, hit, blocks, num_external_computed_tokens=external, delay_cache_blocks=True)
    plan = b.take_load(turn.request_id)
    b.finish_load(plan, failed=True)  # the worker's read came back short
    turn.num_computed_tokens = 0
    b.free(turn)
    b.check_integrity()
    retry = make_request("s3", first.all_token_ids[:-1] + [9] * 20)
    b.get_computed_blocks(retry)
    assert b.host_extension(retry) == 0
    # Another instance that reaches the same prefix does read it.
    c = _manager(l3)
    c.get_computed_blocks(retry)
    assert c.host_extension(retry) == external

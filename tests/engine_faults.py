"""Faults and negative controls injected into a vLLM engine that runs in the test's process
(`tests.conftest.run_engine(..., patch="tests.engine_faults:<function>")`; the engine core and
the worker share that process, so a change made here reaches both)."""

from __future__ import annotations

import torch

SCRIBBLE_SEED = 1234


def keep_uncomputed() -> None:
    """The negative control of the priority-preemption test: a request preempted within its
    step leaves what it cached there in the tree, as the cache did before
    `HybridKVCache.withdraw_uncomputed`."""
    from vllm_mimo.kv_cache.cache import HybridKVCache

    HybridKVCache.withdraw_uncomputed = lambda self, request, state: None  # type: ignore[method-assign]


def scribble_new_blocks() -> None:
    """Every block the plugin's cache hands out is filled with noise in the worker before the
    step that got it writes or loads anything, so KV that no forward wrote and no load brought
    is garbage, never zeros or an earlier request's bytes that happen to be right."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_mimo.kv_cache.cache import HybridKVCache

    fresh: list[int] = []
    allocate = HybridKVCache.allocate

    def allocate_and_record(self, *args, **kwargs):
        new = allocate(self, *args, **kwargs)
        if new is not None:
            fresh.extend(i for ids in (*new.full, *new.swa) if ids is not None for i in ids)
        return new

    update_states = GPUModelRunner._update_states
    noise = torch.Generator().manual_seed(SCRIBBLE_SEED)

    def scribble_then_update(runner, scheduler_output, *args, **kwargs):
        # After the connector's stores (they read evicted blocks first), before its loads and
        # the forward: what the step legitimately writes lands on top of the noise.
        if fresh:
            ids = torch.tensor(sorted(set(fresh)))
            fresh.clear()
            num_blocks = runner.kv_cache_config.num_blocks
            for kv in runner.kv_caches:
                dim = 0 if kv.shape[0] == num_blocks else 1
                shape = list(kv.shape)
                shape[dim] = len(ids)
                kv.index_copy_(dim, ids, torch.randn(shape, generator=noise).to(kv.dtype) * 3)
        return update_states(runner, scheduler_output, *args, **kwargs)

    HybridKVCache.allocate = allocate_and_record  # type: ignore[method-assign]
    GPUModelRunner._update_states = scribble_then_update  # type: ignore[method-assign]


def keep_uncomputed_and_scribble() -> None:
    keep_uncomputed()
    scribble_new_blocks()


def _swa_groups() -> set[int]:
    from vllm_mimo.offload.host_buffer import HostKVBuffer

    return getattr(HostKVBuffer, "_test_swa_groups", set())


def _remember_swa_groups() -> None:
    from vllm_mimo.compat import SlidingWindowSpec
    from vllm_mimo.offload.host_buffer import HostKVBuffer

    init = HostKVBuffer.__init__

    def remembering(self, kv_caches, kv_cache_config, num_pages):
        init(self, kv_caches, kv_cache_config, num_pages)
        HostKVBuffer._test_swa_groups = {  # type: ignore[attr-defined]
            gid for gid, g in enumerate(kv_cache_config.kv_cache_groups) if isinstance(g.kv_cache_spec, SlidingWindowSpec)
        }

    HostKVBuffer.__init__ = remembering  # type: ignore[method-assign]


def scribble_and_skip_window_loads() -> None:
    """The negative control of the host-load test: loads copy the Full pages but not the
    window's SWA pages, so the window a host hit reads is the scribbled noise."""
    from vllm_mimo.offload.host_buffer import HostKVBuffer

    scribble_new_blocks()
    _remember_swa_groups()
    load = HostKVBuffer.load

    def without_window(self, copies):
        return load(self, [c for c in copies if c.group not in _swa_groups()])

    HostKVBuffer.load = without_window  # type: ignore[method-assign]


def scribble_and_fail_copies() -> None:
    """Host copies fail: every second load and every third store raises, as a device or
    driver error would (the loads' requests must recompute, a store's pages must not be read)."""
    from vllm_mimo.offload.host_buffer import HostKVBuffer

    scribble_new_blocks()
    load, store = HostKVBuffer.load, HostKVBuffer.store
    calls = {"load": 0, "store": 0}

    def failing_load(self, copies):
        calls["load"] += 1
        if calls["load"] % 2 == 0:
            raise RuntimeError("injected: host-to-device copy failed")
        return load(self, copies)

    def failing_store(self, copies):
        calls["store"] += 1
        if calls["store"] % 3 == 0:
            raise RuntimeError("injected: device-to-host copy failed")
        return store(self, copies)

    HostKVBuffer.load = failing_load  # type: ignore[method-assign]
    HostKVBuffer.store = failing_store  # type: ignore[method-assign]


def no_host_memory() -> None:
    """The host tier's memory cannot be had at startup."""
    from vllm_mimo.offload.host_buffer import HostKVBuffer

    def refuse(self, kv_caches, kv_cache_config, num_pages):
        raise MemoryError(f"injected: cannot allocate {num_pages} host pages")

    HostKVBuffer.__init__ = refuse  # type: ignore[method-assign]

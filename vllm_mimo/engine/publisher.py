"""The engine's side of the plugin's metrics: a snapshot of the KV cache's counters, written for
the front end that serves `/metrics` and `LLM()` users (`vllm_mimo.metrics` reads it)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from vllm_mimo.engine.kv_manager import HybridKVCacheManager
from vllm_mimo.engine.step_budget import StepBudget
from vllm_mimo.kv_cache.node import AnchorKind
from vllm_mimo.log import logger
from vllm_mimo.metrics import snapshot_path
from vllm_mimo.offload.connector import HostTierCounters
from vllm_mimo.spec_decode.acceptance import AcceptanceByBucket

_PUBLISH_INTERVAL_S = 0.25


def host_tier_snapshot(manager: HybridKVCacheManager, counters: HostTierCounters) -> dict:
    """The host tier's part of the snapshot (empty without one)."""
    host = manager.cache.host
    if host is None:
        return {}
    stats = host.stats
    return {
        "pages": host.num_pages,
        "used_pages": host.used_pages,
        "hit_tokens": stats.hit_tokens,
        "stored_anchors": stats.stored_anchors,
        "skipped_stores": stats.skipped_stores,
        "evicted_anchors": stats.evicted_anchors,
        "swapped_out_tokens": stats.swapped_out_tokens,
        "swapped_in_tokens": stats.swapped_in_tokens,
        "loads": counters.loads,
        "failed_loads": counters.failed_loads,
        "failed_stores": counters.failed_stores,
        "stored_bytes": dict(counters.stored_bytes),
        "loaded_bytes": dict(counters.loaded_bytes),
        "load_seconds": counters.load_seconds,
        "store_seconds": counters.store_seconds,
        "l3_on": int(host.l3 is not None),
        "l3_hit_tokens": stats.l3_hit_tokens,
        "l3_put_bytes": counters.l3_put_bytes,
        "l3_fetched_bytes": counters.l3_fetched_bytes,
        "l3_failed_fetches": counters.l3_failed_fetches,
        "l3_failed_puts": counters.l3_failed_puts,
        "l3_outages": counters.l3_outages,
        "l3_short_loads": stats.l3_short_loads,
    }


class IntegrityAtIdle:
    """`check_integrity_at_idle`: the KV manager's invariants checked once each time the engine
    becomes idle, the result logged and counted."""

    def __init__(self) -> None:
        self.checks = 0
        self.violations = 0
        self._due = True

    def step(self, manager: HybridKVCacheManager, idle: bool) -> None:
        """After every step: check if the engine is idle and has run a request since the last check."""
        if not idle:
            self._due = True
            return
        if not self._due:
            return
        self._due = False
        self.checks += 1
        try:
            manager.check_integrity()
        except AssertionError as e:
            self.violations += 1
            logger.error("vllm-mimo: integrity check at idle %d: VIOLATION: %s", self.checks, e)
            return
        logger.info(
            "vllm-mimo: integrity check at idle %d: ok, %d blocks held", self.checks, manager.cache.size_info().held
        )


def manager_snapshot(
    manager: HybridKVCacheManager,
    step_budget: StepBudget | None,
    acceptance: AcceptanceByBucket | None,
    model_name: str,
    engine_index: int,
    host_counters: HostTierCounters | None = None,
    integrity: IntegrityAtIdle | None = None,
) -> dict:
    """Everything `/metrics` shows for one engine."""
    metrics, pools, size = manager.metrics, manager.cache.pools, manager.cache.size_info()
    return {
        "model_name": model_name,
        "engine": engine_index,
        "time": time.time(),
        "prompt_tokens": metrics.prompt_tokens,
        "window_safe_hit_tokens": metrics.hit_tokens,
        "full_cached_tokens": metrics.full_cached_tokens,
        "pseudo_hit_tokens": metrics.pseudo_hit_tokens,
        "recomputed_swa_tokens": metrics.recomputed_swa_tokens,
        "preempted_hit_tokens": metrics.preempted_hit_tokens,
        "withdrawn_positions": metrics.withdrawn_positions,
        "prefill_steps_cut": step_budget.steps_cut if step_budget is not None else 0,
        # Every kind from the start, at zero until it happens.
        "anchors_kept": {kind.value: metrics.anchors_placed[kind.value] for kind in AnchorKind},
        "anchors_evicted": {kind.value: metrics.anchors_evicted[kind.value] for kind in AnchorKind},
        "anchors": size.anchors,
        "anchor_blocks": size.anchor_swa,
        "held_blocks": size.held,
        "integrity_checks": integrity.checks if integrity is not None else 0,
        "integrity_violations": integrity.violations if integrity is not None else 0,
        "peak_swa_blocks_per_request": metrics.peak_swa_blocks_per_request,
        "peak_anchor_window_blocks_per_request": metrics.peak_anchor_window_blocks_per_request,
        "spec_decode": acceptance.snapshot() if acceptance is not None else {},
        "host_tier": host_tier_snapshot(manager, host_counters) if host_counters is not None else {},
        "pools": {
            pool: {
                "blocks": pools.home_size[i],
                "used_blocks": pools.used[i],
                "peak_blocks": pools.peak_used[i],
                "borrowed_blocks": pools.borrowed[i],
                "evicted_blocks": metrics.evicted_blocks[i],
            }
            for i, pool in enumerate(("swa", "full"))
        },
    }


class SnapshotPublisher:
    """Writes an engine's snapshot for its front end, at most every 0.25 s unless forced."""

    def __init__(self, engine_index: int) -> None:
        self.path = snapshot_path(engine_index)
        self._last = 0.0
        self._failed = False

    def publish(self, snapshot_fn: Callable[[], dict], force: bool = False) -> None:
        now = time.monotonic()
        if self._failed or (not force and now - self._last < _PUBLISH_INTERVAL_S):
            return
        self._last = now
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(snapshot_fn(), f)
            os.replace(tmp, self.path)
        except OSError as e:  # metrics must never take the engine down
            self._failed = True
            from vllm_mimo.log import logger

            logger.warning("vllm-mimo: cannot write KV manager metrics to %s (%s); metrics are off", self.path, e)

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)

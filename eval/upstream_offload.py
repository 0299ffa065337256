"""vLLM's own host offloading (`OffloadingConnector`, what `--kv-offloading-size` turns on),
driven for real in the replay: its scheduler side with its CPU manager and LRU, at a given host
budget, beside upstream's `KVCacheManager`. No worker runs (its CPU worker needs CUDA): every
transfer job it issues is reported complete, loads in the step that issues them (a request
whose prefix comes from host waits for that step, as vLLM's `WAITING_FOR_REMOTE_KVS` does),
stores one step later (vLLM's worker issues a store at the start of the next step). What it
stores and loads, and its host eviction, are vLLM's code. Its order depends on Python's hash
seed (it iterates sets of request ids): runs under different `PYTHONHASHSEED`s differ by a few
percent at tight budgets (the trace at 4 GiB: 68.1% and 69.8% of the ideal); the suite script
fixes the seed.

vLLM's policy in short (0.32): every complete block of the prompt, of every KV cache group, is
stored as it is computed (SWA groups: the blocks `reachable_block_mask` keeps, which with the
default retention interval 0 are the window before the prompt's last token; `None`, dense: every
block); one LRU over all groups' blocks; a host hit needs the Full blocks from the device's hit
on and each SWA group's window before its end, and loads only that window.
"""

from __future__ import annotations

import types
from types import SimpleNamespace
from typing import Any


class UpstreamOffload:
    """The connector's scheduler side, and the worker's completions, for one replay run."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, manager: Any, host_bytes: int, retention: int | None,
                 max_model_len: int) -> None:
        """`vllm_config`: a model-less config of the run's own (changed here); `kv_cache_config`
        and `manager`: upstream's, built with the same `retention`; `max_model_len`: the run's."""
        from vllm_mimo.compat import KVConnectorRole, KVTransferConfig, OffloadingConnector

        # The connector reads the retention interval from the cache config (the manager from
        # the KV cache config) and a few model facts no model-less config has.
        vllm_config.cache_config.prefix_cache_retention_interval = retention
        vllm_config.kv_transfer_config = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": host_bytes},
        )
        object.__setattr__(vllm_config, "model_config", types.SimpleNamespace(
            use_mla=False, model="replay", dtype="bfloat16", get_total_num_kv_heads=lambda: 8,
            max_model_len=max_model_len,  # read by vLLM 0.33's connector
        ))
        self.connector = OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        self.connector.bind_kv_cache_manager(manager)
        self.manager = manager
        group = kv_cache_config.kv_cache_groups[0]
        self.block_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
        self.bytes_stored = 0
        self.bytes_loaded = 0
        self.restored_tokens = 0
        self._stores_in_flight: set[int] = set()
        self._loads: dict[int, str] = {}
        self._finished: set[str] = set()

    @property
    def busy(self) -> bool:
        """Transfers still in flight (a step with nothing scheduled still moves time on)."""
        return bool(self._stores_in_flight or self._loads)

    def on_new_request(self, request: Any) -> None:
        self.connector.on_new_request(request)

    def lookup(self, request: Any, hit_tokens: int) -> int | None:
        """Tokens past the device's hit the host holds for `request` (loaded asynchronously);
        None: not now (a transfer of its blocks is still in flight)."""
        external, _ = self.connector.get_num_new_matched_tokens(request, hit_tokens)
        return external

    def after_alloc(self, request: Any, external_tokens: int) -> None:
        self.connector.update_state_after_alloc(request, self.manager.get_blocks(request.request_id), external_tokens)
        self.restored_tokens += external_tokens

    def finished(self, request: Any) -> None:
        """A request finished (before its blocks are freed)."""
        self.connector.request_finished_all_groups(request, self.manager.get_block_ids(request.request_id))
        self._finished.add(request.request_id)

    def step(self, new: dict[str, tuple], cached: dict[str, tuple], resumed: set[str], scheduled: dict[str, int],
             preempted: set[str]) -> tuple[set[str], int]:
        """One scheduler step's metadata, and the worker's report of it: (requests whose loads
        finished, bytes loaded this step). `new` / `cached`: block ids per request scheduled for
        the first time (or after its load) / again (new blocks only, all of them if `resumed`)."""
        from vllm_mimo.compat import KVConnectorOutput, OffloadingWorkerMetadata

        output = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=ids) for rid, ids in new.items()],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=list(cached), new_block_ids=list(cached.values()), resumed_req_ids=resumed
            ),
            num_scheduled_tokens=scheduled,
            finished_req_ids=self._finished,
            preempted_req_ids=preempted,
            kv_cache_block_copies=None,
            kv_connector_block_state=None,
        )
        self._finished = set()
        meta = self.connector.build_connector_meta(output)
        done = set(self._stores_in_flight)
        self._stores_in_flight = set(meta.store_jobs)
        loaded = 0
        for job_id, job in meta.store_jobs.items():  # noqa: B007
            self.bytes_stored += len(job.src_spec.block_ids) * self.block_bytes
        for job_id, job in meta.load_jobs.items():
            loaded += len(job.dst_spec.block_ids) * self.block_bytes
            self._loads[job_id] = job.req_id
            done.add(job_id)
        self.bytes_loaded += loaded
        recving = {self._loads.pop(j) for j in list(done) if j in self._loads}
        self.connector.update_connector_output(KVConnectorOutput(
            finished_recving=recving,
            kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(done, 1)) if done else None,
        ))
        return recving, loaded

"""`MimoHostTierConnector`: the host tier through vLLM's KV connector API.

The plugin installs it by itself (`vllm_mimo.offload.configure`) when `host_tier_gib > 0`; the
plugin's scheduler binds it to the hybrid KV manager, whose host tier (`HostTier`, on the prefix
tree's nodes) is the index and the policy. This connector only carries what the manager decides:

  * scheduler side: a request's external tokens are the host extension of its window-safe
    hit (`HybridKVCacheManager.host_extension`); the load is asynchronous, so the request waits
    one step in vLLM's WAITING_FOR_REMOTE_KVS while the worker copies, and a load that fails is
    reported as failed and the request recomputes (vLLM's `recompute` failure policy), its host
    copies dropped (`HostTier.finish_load`). Each step's metadata carries the stores the
    manager's demotions made and the loads of the requests admitted with external tokens.
  * worker side: stores run before the step's forward (`handle_preemptions`, so evicted blocks
    are read before new tokens overwrite them), loads right after it (`start_load_kv`, into
    blocks only the loading request holds); the bytes move in `HostKVBuffer`.
  * with an L3 (`l3_master`, Mooncake Store: `mooncake_store`): the scheduler asks the store
    which pages it holds (`MooncakeIndex`, the host tier's `L3Index`); the worker puts the host
    pages the host tier evicts before the step's stores reuse them, and reads a load's pages
    from L3 into host pages before copying them to the device. A put whose page does not carry
    its store's tag is not made; a read that misses or comes back short fails the load, and the
    request recomputes. A store that cannot be reached at startup turns the L3 off with a
    warning (the host tier stays).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm_mimo import compat
from vllm_mimo.config import MimoConfig
from vllm_mimo.kv_cache.tiers.host_copies import LoadPlan
from vllm_mimo.log import logger
from vllm_mimo.offload.host_buffer import HostKVBuffer, PageCopy, host_page_bytes, host_pages
from vllm_mimo.offload.l3_index import L3Page, L3Watch, MooncakeIndex, connect_l3, rank_key
from vllm_mimo.offload.mooncake_store import L3Settings


@dataclass
class HostTierMetadata(compat.KVConnectorMetadata):
    """Scheduler to worker, one step: stores (device to host) and loads by request."""

    stores: list[PageCopy] = field(default_factory=list)
    loads: dict[str, list[PageCopy]] = field(default_factory=dict)
    puts: list[L3Page] = field(default_factory=list)
    """Host pages to L3, before `stores`."""
    fetches: dict[str, list[L3Page]] = field(default_factory=dict)
    """L3 to host pages, per loading request, before its `loads`."""
    failed: set[str] = field(default_factory=set)
    """Loads that fail without a copy (the host had no pages for their reads from L3)."""


@dataclass
class HostTierWorkerMeta(compat.KVConnectorWorkerMetadata):
    """Worker to scheduler, one step: copy time, and whether the host memory exists."""

    load_seconds: float = 0.0
    store_seconds: float = 0.0
    available: bool = True
    failed_stores: int = 0
    l3_available: bool = True
    l3_failed_puts: int = 0
    l3_failed_fetches: int = 0
    l3_reachable: bool = True
    """The store's master was up this step (`L3Watch`)."""

    def aggregate(self, other: Any) -> HostTierWorkerMeta:
        return HostTierWorkerMeta(
            max(self.load_seconds, other.load_seconds),
            max(self.store_seconds, other.store_seconds),
            self.available and other.available,
            self.failed_stores + other.failed_stores,
            self.l3_available and other.l3_available,
            self.l3_failed_puts + other.l3_failed_puts,
            self.l3_failed_fetches + other.l3_failed_fetches,
            self.l3_reachable and other.l3_reachable,
        )


@dataclass
class HostTierCounters:
    """What the connector moved, for the metrics (`vllm_mimo.engine.publisher`)."""

    stored_bytes: dict[str, int] = field(default_factory=lambda: {"full": 0, "swa": 0})
    loaded_bytes: dict[str, int] = field(default_factory=lambda: {"full": 0, "swa": 0})
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    loads: int = 0
    failed_loads: int = 0
    failed_stores: int = 0
    """Steps whose stores a worker could not copy (their pages are never loaded: `HostKVBuffer` tags)."""
    l3_put_bytes: int = 0
    l3_fetched_bytes: int = 0
    l3_failed_puts: int = 0
    """Pages a worker did not put to L3 (a failed store's page, or the store refused it)."""
    l3_failed_fetches: int = 0
    """Loads whose reads from L3 missed or came back short (their requests recomputed)."""
    l3_outages: int = 0
    """Times a worker found the store's master down (the L3 off until it was back)."""


class MimoHostTierConnector(compat.KVConnectorBase_V1, compat.SupportsHMA):
    """The plugin's host tier (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.mimo_config = MimoConfig.from_vllm_config(vllm_config)
        self.page_bytes = host_page_bytes(kv_cache_config)
        self.num_pages = host_pages(kv_cache_config, self.mimo_config.host_tier_gib)
        self.l3_settings = L3Settings.of(self.mimo_config)
        # Scheduler side.
        self.manager: Any = None
        self.l3_index: MooncakeIndex | None = None
        if self.l3_settings is not None and role == compat.KVConnectorRole.SCHEDULER:
            self.l3_index = MooncakeIndex.connect(self.l3_settings, vllm_config, kv_cache_config)
        self.available = True
        self.counters = HostTierCounters()
        self._pending: dict[str, LoadPlan] = {}
        self._inflight: dict[str, LoadPlan] = {}
        self._tags: dict[int, int] = {}
        self._next_tag = 0
        # Worker side.
        self.buffer: HostKVBuffer | None = None
        self.l3: Any = None  # the worker's `MooncakeL3` client, with the host buffer registered
        self.l3_watch: L3Watch | None = None
        self.tp_rank = 0
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._worker_meta: HostTierWorkerMeta | None = None

    # ------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """vLLM binds its own manager first; the plugin's scheduler binds the hybrid KV manager
        once it is installed (only that one has a host tier)."""
        self._kv_cache_manager = kv_cache_manager
        self.manager = kv_cache_manager if getattr(kv_cache_manager, "host_tier", None) is not None else None
        if self.manager is not None and self.l3_index is not None:
            self.manager.attach_l3(self.l3_index)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if self.manager is None or not self.available:
            return 0, False
        tokens = self.manager.host_extension(request)
        return tokens, tokens > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens and self.manager is not None:
            plan = self.manager.take_load(request.request_id)
            if plan is not None:
                self._pending[request.request_id] = plan

    def build_connector_meta(self, scheduler_output: Any) -> HostTierMetadata:
        meta = HostTierMetadata()
        if self.manager is None:
            return meta
        counters = self.counters
        # Puts first: a page evicted this step may be stored to again this step (a new tag).
        for copy in self.manager.take_puts():
            for key, page in zip(copy.keys, copy.host, strict=True):
                meta.puts.append(L3Page(str(key), page, self._tags.get(page, -2)))
                counters.l3_put_bytes += self.page_bytes
        for kind, copy in self.manager.take_stores():
            for gid, block, page in self.manager.host_copies(kind, copy):
                self._next_tag += 1
                self._tags[page] = self._next_tag
                meta.stores.append(PageCopy(gid, block, page, self._next_tag))
                counters.stored_bytes[kind] += self.page_bytes
        for request_id, plan in self._pending.items():
            self._inflight[request_id] = plan
            if plan.failed:
                meta.failed.add(request_id)
                continue
            fetches = meta.fetches[request_id] = []
            for fetch in plan.fetches:
                for key, page in zip(fetch.keys, fetch.host, strict=True):
                    self._next_tag += 1
                    self._tags[page] = self._next_tag
                    fetches.append(L3Page(str(key), page, self._next_tag))
                    counters.l3_fetched_bytes += self.page_bytes
            copies = []
            for kind, pool in (("full", plan.full), ("swa", plan.swa)):
                for copy in pool:
                    for gid, block, page in self.manager.host_copies(kind, copy):
                        copies.append(PageCopy(gid, block, page, self._tags.get(page, -2)))
                        counters.loaded_bytes[kind] += self.page_bytes
            meta.loads[request_id] = copies
        self._pending = {}
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        worker = connector_output.kv_connector_worker_meta
        if isinstance(worker, HostTierWorkerMeta):
            self.counters.load_seconds += worker.load_seconds
            self.counters.store_seconds += worker.store_seconds
            self.counters.failed_stores += worker.failed_stores
            self.counters.l3_failed_puts += worker.l3_failed_puts
            self.counters.l3_failed_fetches += worker.l3_failed_fetches
            if not worker.available and self.available:
                self.available = False
                logger.warning("vllm-mimo: the host tier is off: a worker has no host memory for it (see its log)")
            if not worker.l3_available and self.l3_index is not None:
                self.l3_index = None
                if self.manager is not None:
                    self.manager.detach_l3()
                logger.warning("vllm-mimo: the L3 tier is off: a worker cannot reach the store (see its log)")
            self._follow_l3(worker.l3_reachable)
        failed = connector_output.failed_recving or set()
        for request_id in connector_output.finished_recving or ():
            plan = self._inflight.pop(request_id, None)
            if plan is None:
                continue
            self.counters.loads += 1
            if request_id in failed:
                self.counters.failed_loads += 1
                logger.warning("vllm-mimo: host tier load for request %s failed; it recomputes", request_id)
            self.manager.finish_load(plan, failed=request_id in failed)

    def _follow_l3(self, reachable: bool) -> None:
        """The L3 is off while a worker finds the store's master down, and on again once it is
        back (without an engine restart): meanwhile no lookup asks the store and nothing is put
        or read, so requests recompute what they would have read."""
        if self.manager is None or self.l3_index is None or self.l3_settings is None:
            return
        attached = self.manager.host_tier.l3 is not None
        if attached and not reachable:
            self.manager.detach_l3()
            self.counters.l3_outages += 1
            logger.warning(
                "vllm-mimo: the L3 store's master at %s is down: the L3 tier is off until it is back "
                "(requests recompute what they would have read from it)", self.l3_settings.master,
            )
        elif not attached and reachable:
            self.manager.attach_l3(self.l3_index)
            logger.info("vllm-mimo: the L3 store's master at %s is back: the L3 tier is on", self.l3_settings.master)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        # A request whose load is still being copied keeps its blocks until the worker reports it.
        return request.request_id in self._inflight, None

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def on_new_request(self, request: Any) -> None:
        pass

    def take_events(self) -> list:
        return []

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        gib = self.num_pages * self.page_bytes / (1 << 30)
        try:
            self.buffer = HostKVBuffer(kv_caches, self._kv_cache_config, self.num_pages)
        except (RuntimeError, MemoryError) as e:
            self._worker_meta = HostTierWorkerMeta(available=False)
            logger.warning("vllm-mimo: the host tier is off: cannot allocate %.3f GiB of host memory (%s)", gib, e)
            return
        logger.info(
            "vllm-mimo: host tier: %d pages of %d bytes (%.3f GiB%s)",
            self.num_pages,
            self.page_bytes,
            gib,
            ", pinned" if self.buffer.cuda else "",
        )
        if self.l3_settings is not None:
            self.tp_rank = compat.get_tensor_model_parallel_rank()
            self.l3 = connect_l3(self.l3_settings, self.buffer.memory)
            if self.l3 is None:
                self._meta().l3_available = False
            else:
                self.l3_watch = L3Watch(self.l3)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Runs before every step's forward: this step's puts to L3 read their host pages, then
        its stores read their device blocks."""
        if not isinstance(kv_connector_metadata, HostTierMetadata):
            return
        if self.buffer is None:
            return  # the tier is off: nothing is stored, every load fails
        if self.l3_watch is not None:
            meta = kv_connector_metadata
            self._meta().l3_reachable = self.l3_watch.check(transfers=bool(meta.puts or meta.fetches))
        if kv_connector_metadata.puts:
            self._put(kv_connector_metadata.puts)
        if not kv_connector_metadata.stores:
            return
        start = time.perf_counter()
        try:
            self.buffer.store(kv_connector_metadata.stores)
            self.buffer.synchronize()
        except RuntimeError as e:
            # A page the copy did not finish keeps the tag of its previous store, so the load
            # that expects this store's fails and its request recomputes.
            self._meta().failed_stores += 1
            logger.warning(
                "vllm-mimo: host tier store of %d blocks failed (%s); loads of them recompute",
                len(kv_connector_metadata.stores),
                e,
            )
        self._meta().store_seconds += time.perf_counter() - start

    def _put(self, puts: list[L3Page]) -> None:
        """Host pages to L3; a page that no longer holds its store's bytes is not put."""
        assert self.buffer is not None
        good = [p for p in puts if self.buffer.tags[p.page] == p.tag]
        failed = len(puts) - len(good)
        if self.l3 is not None and self.l3_watch is not None and self.l3_watch.up and good:
            keys = [rank_key(p.key, self.tp_rank) for p in good]
            ok = self.l3.put_pages(keys, [p.page for p in good])
            failed += sum(not put for put in ok)
            if not any(ok):
                self.l3_watch.failed()
        elif good:
            failed += len(good)
        self._meta().l3_failed_puts += failed

    def _fetch(self, fetches: list[L3Page]) -> bool:
        """L3 to host pages; True if every page came back whole (then it carries its tag)."""
        if not fetches:
            return True
        if self.l3 is None or self.buffer is None or self.l3_watch is None or not self.l3_watch.up:
            return False
        try:
            ok = self.l3.get_pages([rank_key(f.key, self.tp_rank) for f in fetches], [f.page for f in fetches])
        except RuntimeError as e:
            logger.warning("vllm-mimo: L3 read of %d pages failed (%s)", len(fetches), e)
            return False
        if not all(ok):
            self.l3_watch.failed()
            return False
        for f in fetches:
            self.buffer.tags[f.page] = f.tag
        return True

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, HostTierMetadata) or not (meta.loads or meta.failed):
            return
        start = time.perf_counter()
        self._failed.update(meta.failed)
        for request_id, copies in meta.loads.items():
            if not self._fetch(meta.fetches.get(request_id, [])):
                self._meta().l3_failed_fetches += 1
                logger.warning("vllm-mimo: L3 read for request %s missed or came back short; it recomputes", request_id)
                self._failed.add(request_id)
                continue
            try:
                done = self.buffer.load(copies) if self.buffer is not None else None
                if self.buffer is not None:
                    self.buffer.synchronize()
            except RuntimeError as e:
                # The request's blocks are its own until it is scheduled: it recomputes them.
                done = None
                logger.warning("vllm-mimo: host tier load for request %s failed (%s)", request_id, e)
            (self._failed if done is None else self._finished).add(request_id)
        self._meta().load_seconds += time.perf_counter() - start

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = self._finished | self._failed
        self._finished, self._failed = set(), set()
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Loads done this step; the failed ones also as failed (vLLM then recomputes them)."""
        failed = set(self._failed)
        _, done = self.get_finished(finished_req_ids)
        return compat.KVConnectorTransferResults(finished_recving=set(done or ()), failed_recving=failed)

    def build_connector_worker_meta(self) -> HostTierWorkerMeta | None:
        meta, self._worker_meta = self._worker_meta, None
        return meta

    def _meta(self) -> HostTierWorkerMeta:
        if self._worker_meta is None:
            self._worker_meta = HostTierWorkerMeta()
        return self._worker_meta

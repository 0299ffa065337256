"""vLLM's scheduler with the plugin's KV cache installed (the engine-core process).

vLLM builds its KV cache manager inside `Scheduler.__init__` and offers no factory, so the
plugin owns the scheduler class (installed through `SchedulerConfig.scheduler_cls`, see
`vllm_mimo.hooks`) and swaps in `HybridKVCacheManager` once vLLM's own setup is done. Around
vLLM's scheduling it adds the step cut and the chunk cap (`step_budget`), the pinned prompts
(`pinning`) and the metrics snapshot (`publisher`). This is also the one place, in the engine
process, where the model's KV cache groups are known: the plugin's startup lines and warnings
are logged here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_mimo.attention_backends import swa_attention_mode
from vllm_mimo.compat import AsyncScheduler, Scheduler, SlidingWindowSpec, get_max_concurrency_for_kv_cache_config
from vllm_mimo.config import MimoConfig
from vllm_mimo.doctor import log_startup_warnings
from vllm_mimo.engine.kv_manager import HybridKVCacheManager
from vllm_mimo.engine.lookahead import QueueLookahead
from vllm_mimo.engine.pinning import pin_requests
from vllm_mimo.engine.publisher import IntegrityAtIdle, SnapshotPublisher, manager_snapshot
from vllm_mimo.engine.step_budget import StepBudget
from vllm_mimo.kv_cache.geometry import UnsupportedKVLayout, cdiv
from vllm_mimo.layout import HybridLayout, layout_from_hf_config, layout_from_kv_cache_groups
from vllm_mimo.log import logger
from vllm_mimo.offload.connector import MimoHostTierConnector
from vllm_mimo.spec_decode.acceptance import AcceptanceByBucket

GIB = 1 << 30

# The mixin is only ever mixed into vLLM's Scheduler, so the type checker reads it as one (its
# attributes and super() calls are vLLM's); at run time it must stay a plain mixin.
if TYPE_CHECKING:
    from vllm_mimo.compat import Scheduler as _SchedulerBase
else:
    _SchedulerBase = object


class _MimoSchedulerMixin(_SchedulerBase):
    """Adds the plugin's setup after vLLM's own `Scheduler.__init__`."""

    mimo_config: MimoConfig
    mimo_layout: HybridLayout | None
    mimo_manager: HybridKVCacheManager | None = None
    mimo_step_budget: StepBudget | None = None
    mimo_lookahead: QueueLookahead | None = None
    _mimo_publisher: SnapshotPublisher | None = None
    mimo_acceptance: AcceptanceByBucket | None = None
    mimo_host_connector: MimoHostTierConnector | None = None
    mimo_integrity: IntegrityAtIdle | None = None
    _mimo_pins_due = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        vllm_config = self.vllm_config
        self.mimo_config = MimoConfig.from_vllm_config(vllm_config)
        scheduler_config = vllm_config.scheduler_config
        # prefill_chunk_tokens is vLLM's long_prefill_token_threshold unless the user set that;
        # with the plugin's manager below, it holds only while memory is short (`step_budget`).
        chunk_tokens = 0 if scheduler_config.long_prefill_token_threshold else self.mimo_config.prefill_chunk_tokens
        if chunk_tokens:
            scheduler_config.long_prefill_token_threshold = chunk_tokens
        declared = layout_from_hf_config(vllm_config.model_config.hf_config)
        self.mimo_layout = layout_from_kv_cache_groups(
            self.kv_cache_config.kv_cache_groups,
            mtp_layers=declared.mtp_layers if declared else 0,
        )
        model = vllm_config.model_config.architecture
        if self.mimo_layout is None:
            logger.debug(
                "vllm-mimo: %s has no mix of full and sliding-window KV cache groups; "
                "the scheduler runs as stock vLLM",
                model,
            )
            return
        if vllm_config.speculative_config is not None:
            self.mimo_acceptance = AcceptanceByBucket(vllm_config.speculative_config.num_speculative_tokens)
        self._install_manager(chunk_tokens)
        logger.info(
            "vllm-mimo: hybrid SWA model %s: %s; %d KV cache groups; features on: %s; scheduler %s "
            "(vLLM's %s: async scheduling is %s, so vLLM's 'custom scheduler class' warning costs nothing here)",
            model,
            self.mimo_layout.describe(),
            len(self.kv_cache_config.kv_cache_groups),
            ", ".join(self.mimo_features()) or "none",
            type(self).__name__,
            "AsyncScheduler" if isinstance(self, AsyncScheduler) else "Scheduler",
            "on" if scheduler_config.async_scheduling else "off",
        )
        if self.mimo_manager is not None:
            self._log_pools(self.mimo_manager)
            self._log_capacity(self.mimo_manager)
        swa_path = swa_attention_mode(self.mimo_config)
        logger.info(
            "vllm-mimo: SWA attention (swa_attention): %s",
            "; ".join(
                f"group {gid} ({spec.sliding_window}-token window) {swa_path}"
                for gid, spec in self._mimo_swa_groups()
            ),
        )
        log_startup_warnings(int(self.mimo_config.host_tier_gib * GIB) if self.mimo_host_connector is not None else 0)

    def _mimo_swa_groups(self) -> list[tuple[int, Any]]:
        """(group id, spec) of the KV cache groups of sliding-window layers."""
        groups = self.kv_cache_config.kv_cache_groups
        return [(gid, g.kv_cache_spec) for gid, g in enumerate(groups) if isinstance(g.kv_cache_spec, SlidingWindowSpec)]

    def mimo_features(self) -> list[str]:
        """Names of the plugin features running in this engine."""
        features = ["layout-detection"]
        if self.mimo_manager is not None:
            features += ["hybrid-kv-manager", "separate-pools", "swa-anchors"]
            if self.mimo_step_budget is not None:
                features.append("memory-aware-prefill")
            if self.mimo_manager.cache.window_local:
                features.append("window-local-swa")
            if self.mimo_manager.cache.host is not None:
                features.append("host-tier")
        if self.mimo_layout is not None and self.mimo_layout.draft_layers > 1:
            features.append(f"mtp-all-layers ({self.mimo_layout.draft_layers} layers)")
        if self.mimo_acceptance is not None:
            features.append("acceptance-by-bucket")
        return features

    def _install_manager(self, chunk_tokens: int) -> None:
        """`chunk_tokens`: the plugin's prefill chunk cap (0: none, or the user's own)."""
        connector = self.connector
        host_pages = 0
        if isinstance(connector, MimoHostTierConnector):
            host_pages = connector.num_pages
        elif connector is not None:
            # Refused at startup already, unless this config bypassed the plugin's hook there.
            from vllm_mimo.offload import refuse_other_connector

            refuse_other_connector(self.vllm_config)
            return
        upstream = self.kv_cache_manager  # type: ignore[has-type]
        try:
            self.mimo_manager = HybridKVCacheManager(
                self.kv_cache_config,
                self.max_model_len,
                self.block_size,
                self.hash_block_size,
                enable_caching=self.cache_config.enable_prefix_caching,
                use_eagle=self.use_eagle_block_drop,
                log_stats=self.log_stats,
                mimo_config=self.mimo_config,
                max_num_running=self.max_num_running_reqs,
                kv_blocks=upstream.block_pool.blocks,
                watermark=getattr(self.scheduler_config, "watermark", 0.0),
                window_local=swa_attention_mode(self.mimo_config) == "window-local",
                host_pages=host_pages,
                enable_kv_cache_events=self.enable_kv_cache_events,
            )
        except UnsupportedKVLayout as e:
            logger.warning(
                "vllm-mimo: vLLM's own KV manager stays in place%s: %s",
                " and there is no host tier" if host_pages else "",
                e,
            )
            return
        self.kv_cache_manager = self.mimo_manager
        if connector is not None:
            connector.bind_kv_cache_manager(self.mimo_manager)
            self.mimo_host_connector = connector
        self._install_step_helpers(self.mimo_manager, chunk_tokens)

    def _install_step_helpers(self, manager: HybridKVCacheManager, chunk_tokens: int) -> None:
        """What runs beside the manager every step, as the config asks: the step budget, the
        idle integrity check, the queue lookahead, the snapshot publisher and the pinned prompts."""
        floor = self.mimo_config.step_prefill_floor_tokens
        if not isinstance(getattr(self, "max_num_scheduled_tokens", None), int):
            if floor or chunk_tokens:
                logger.warning(
                    "vllm-mimo: this vLLM's scheduler has no integer max_num_scheduled_tokens, so "
                    "step_prefill_floor_tokens=%d has no effect (steps are not cut when KV memory "
                    "is short) and prefill_chunk_tokens=%d holds at every step",
                    floor,
                    chunk_tokens,
                )
        elif floor or chunk_tokens:
            self.mimo_step_budget = StepBudget(manager.cache, floor, chunk_tokens)
        if self.mimo_config.check_integrity_at_idle:
            self.mimo_integrity = IntegrityAtIdle()
        if self.mimo_config.queue_lookahead_requests:
            self.mimo_lookahead = QueueLookahead(manager.cache, self.mimo_config.queue_lookahead_requests)
        parallel = self.vllm_config.parallel_config
        self._mimo_publisher = SnapshotPublisher(parallel.data_parallel_rank)
        self._mimo_publish(force=True)
        self._mimo_pins_due = bool(
            self.mimo_config.pin_prompts_file and self.cache_config.enable_prefix_caching
        )

    def has_requests(self) -> bool:
        # Pinned prompts are added on the first step, once the engine's block hashing is set
        # up; claiming work until then makes the engine loop take that step without a user.
        return self._mimo_pins_due or super().has_requests()

    def schedule(self, *args: Any, **kwargs: Any):
        if self._mimo_pins_due:
            self._mimo_pins_due = False
            self._add_pinned_prompts()
        if self.mimo_lookahead is not None:
            self.mimo_lookahead.step(self.waiting)
        step_budget = self.mimo_step_budget
        if step_budget is None:
            return super().schedule(*args, **kwargs)
        # vLLM's scheduler reads one token budget for decodes and prefills, in running order,
        # and the chunk cap from its config; setting them for this step is the one way in
        # without copying its loop.
        budget = self.max_num_scheduled_tokens  # type: ignore[has-type]
        limit = step_budget.token_limit(self.running, budget)
        scheduler_config = self.scheduler_config
        cap = scheduler_config.long_prefill_token_threshold
        self.max_num_scheduled_tokens = limit
        if step_budget.chunk_tokens:
            scheduler_config.long_prefill_token_threshold = step_budget.chunk_cap(budget)
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = budget
            scheduler_config.long_prefill_token_threshold = cap
        step_budget.record(limit, budget, output.total_num_scheduled_tokens)
        return output

    def _add_pinned_prompts(self) -> None:
        requests = pin_requests(
            self.vllm_config,
            self.mimo_config.pin_prompts_file,
            self.hash_block_size,
        )
        for request in requests:
            self.add_request(request)
        logger.info(
            "vllm-mimo: prefilling %d pinned prompts from %s (%d tokens)",
            len(requests),
            self.mimo_config.pin_prompts_file,
            sum(r.num_prompt_tokens for r in requests),
        )

    def _log_pools(self, manager: HybridKVCacheManager) -> None:
        cache = manager.cache
        geometry, pools = cache.geometry, cache.pools
        # Every group's tensor aliases the same buffer: the largest one is all the KV memory.
        bytes_per_block = max(
            t.size for t in self.kv_cache_config.kv_cache_tensors
        ) / geometry.num_blocks
        described = []
        for name, blocks, groups, per_position in (
            ("SWA", pools.home_size[0], len(geometry.swa_group_ids), geometry.swa_ids_per_position),
            ("Full", pools.home_size[1], len(geometry.full_group_ids), geometry.full_ids_per_position),
        ):
            described.append(
                f"{name} pool {blocks} blocks = {blocks // per_position * geometry.block_size} tokens "
                f"in {groups} group{'s' if groups > 1 else ''}, "
                f"{blocks * bytes_per_block / GIB:.3f} GiB"
            )
        logger.info(
            "vllm-mimo: KV pools: %s; block size %s, window %d; anchors may hold %d blocks",
            "; ".join(described),
            "/".join(str(size) for size in sorted(set(geometry.group_block_sizes))),
            geometry.window,
            cache.anchor_budget_blocks,
        )

    def _log_capacity(self, manager: HybridKVCacheManager) -> None:
        """The capacity to read beside vLLM's "KV cache size: N tokens" line, which counts how many
        max_model_len-token requests fit when each takes, in every KV cache group, the blocks its
        attention needs at most: for an SWA group under stock attention, the window plus a whole
        prefill chunk (read back from the cache). With window-local SWA attention a request holds
        only its window, so the same blocks hold more requests; with stock attention both agree."""
        vllm_config, cache = self.vllm_config, manager.cache
        length = self.max_model_len
        vllm_concurrency = get_max_concurrency_for_kv_cache_config(vllm_config, self.kv_cache_config)
        vllm_tokens = int(vllm_concurrency * length)
        if not cache.window_local:
            logger.info(
                "vllm-mimo: KV capacity: %s tokens, concurrency %.2fx for %s-token requests, as vLLM's "
                "'KV cache size' line (stock SWA attention: each request holds its window and its prefill chunk)",
                f"{vllm_tokens:,}", vllm_concurrency, f"{length:,}",
            )
            return
        geometry = cache.geometry
        full = cdiv(length, geometry.block_size) * geometry.full_ids_per_position
        swa = geometry.swa_blocks_per_request
        vllm_swa = sum(
            cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes) for _, spec in self._mimo_swa_groups()
        )
        concurrency = self.kv_cache_config.num_blocks / (full + swa)
        logger.info(
            "vllm-mimo: KV capacity: %s tokens, concurrency %.2fx for %s-token requests, each holding %d Full "
            "and %d SWA blocks (window-local SWA attention: its windows only); vLLM's 'KV cache size: %s tokens' "
            "counts %d SWA blocks per request, the prefill chunk its stock SWA attention reads back from the cache",
            f"{int(concurrency * length):,}", concurrency, f"{length:,}", full, swa, f"{vllm_tokens:,}", vllm_swa,
        )

    def _mimo_publish(self, force: bool = False) -> None:
        manager = self.mimo_manager
        if self._mimo_publisher is None or manager is None:  # the publisher comes with the manager
            return
        vllm_config = self.vllm_config
        self._mimo_publisher.publish(
            lambda: manager_snapshot(
                manager,
                self.mimo_step_budget,
                self.mimo_acceptance,
                vllm_config.model_config.served_model_name,
                vllm_config.parallel_config.data_parallel_rank,
                self.mimo_host_connector.counters if self.mimo_host_connector is not None else None,
                self.mimo_integrity,
            ),
            force=force,
        )

    def make_spec_decoding_stats(
        self,
        spec_decoding_stats: Any,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        num_invalid_spec_tokens: dict[str, int] | None,
        request_id: str,
    ) -> Any:
        # vLLM calls this for every step that verified drafts, before the step's tokens are
        # appended: the request's output tokens so far are where the step starts.
        request = self.requests.get(request_id)
        if self.mimo_acceptance is not None and request is not None and num_draft_tokens:
            drafts = num_draft_tokens - (num_invalid_spec_tokens or {}).get(request_id, 0)
            self.mimo_acceptance.observe(request.num_output_tokens, drafts, num_accepted_tokens)
        return super().make_spec_decoding_stats(
            spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens, request_id
        )

    def make_stats(self, *args: Any, **kwargs: Any):
        # Called after every step; also the point where the front end learns our counters.
        idle = not self.running and not self.waiting
        if self.mimo_integrity is not None and self.mimo_manager is not None:
            self.mimo_integrity.step(self.mimo_manager, idle)
        self._mimo_publish(force=idle)
        return super().make_stats(*args, **kwargs)

    def shutdown(self) -> None:
        super().shutdown()
        if self._mimo_publisher is not None:
            self._mimo_publisher.remove()


class MimoScheduler(_MimoSchedulerMixin, Scheduler):
    """vLLM's synchronous scheduler, with the plugin's KV manager."""


class MimoAsyncScheduler(_MimoSchedulerMixin, AsyncScheduler):
    """vLLM's async scheduler (the GPU default), with the plugin's KV manager."""

"""The engine-process side of the plugin: vLLM's scheduler with the plugin's setup added.

vLLM builds its KV cache manager inside `Scheduler.__init__` and offers no factory, so the
plugin owns the scheduler class (installed through `SchedulerConfig.scheduler_cls`, see
`vllm_mimo.hooks`). This is also the one place, in the engine process, where the model's
KV cache groups are known; the plugin's startup line is logged here.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_mimo.config import MimoConfig
from vllm_mimo.doctor import log_startup_warnings
from vllm_mimo.layout import HybridLayout, layout_from_hf_config, layout_from_kv_cache_groups
from vllm_mimo.log import logger


class _MimoSchedulerMixin:
    """Adds the plugin's setup after vLLM's own `Scheduler.__init__`."""

    mimo_config: MimoConfig
    mimo_layout: HybridLayout | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        vllm_config = self.vllm_config  # type: ignore[attr-defined]
        self.mimo_config = MimoConfig.from_vllm_config(vllm_config)
        declared = layout_from_hf_config(vllm_config.model_config.hf_config)
        self.mimo_layout = layout_from_kv_cache_groups(
            self.kv_cache_config.kv_cache_groups,  # type: ignore[attr-defined]
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
        logger.info(
            "vllm-mimo: hybrid SWA model %s: %s; %d KV cache groups; features on: %s",
            model,
            self.mimo_layout.describe(),
            len(self.kv_cache_config.kv_cache_groups),  # type: ignore[attr-defined]
            ", ".join(enabled_features(self.mimo_config)) or "none",
        )
        log_startup_warnings()


def enabled_features(config: MimoConfig) -> list[str]:
    """Names of the plugin features this configuration turns on."""
    return ["layout-detection"] if config.enable else []


class MimoScheduler(_MimoSchedulerMixin, Scheduler):
    """vLLM's synchronous scheduler, with the plugin's setup."""


class MimoAsyncScheduler(_MimoSchedulerMixin, AsyncScheduler):
    """vLLM's async scheduler (the GPU default), with the plugin's setup."""

"""What `register()` installs in each vLLM process.

vLLM calls general plugins with no arguments, before any model config exists, in the
front-end, engine-core and worker processes. The plugin therefore installs one hook, run
after every `VllmConfig` is validated in the front-end process: it reads `MimoConfig` (bad
settings fail here, at startup), finds the model's hybrid layout and, for a hybrid SWA model,
selects the plugin's scheduler unless the user chose one. The engine process then logs the
plugin's startup line from that scheduler.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from vllm_mimo.config import ENV_PREFIX, PLUGIN_SCHEDULERS, MimoConfig, MimoConfigError
from vllm_mimo.log import logger

SCHEDULER_CLS, ASYNC_SCHEDULER_CLS = PLUGIN_SCHEDULERS

_registered_in_pid: int | None = None

HINTS_PARAM = 'extra_args["mimo"]'
"""The request parameter named by HTTP 400s for anchor hints (`vllm_xargs` over HTTP)."""


def registered() -> bool:
    """True once `register()` has installed the plugin in this process."""
    return _registered_in_pid == os.getpid()


def disabled_by_env() -> bool:
    """`VLLM_MIMO_ENABLE` set to a false value (other values are validated with the config)."""
    return os.environ.get(f"{ENV_PREFIX}ENABLE", "").strip().lower() in ("0", "false", "no", "off")


def install() -> None:
    """Install the plugin's hooks in this process, once."""
    global _registered_in_pid
    if registered():
        return
    register_env_names()
    if disabled_by_env():
        logger.debug("vllm-mimo: disabled by %sENABLE", ENV_PREFIX)
        return
    from vllm_mimo.compat import VllmConfig

    original = VllmConfig.__post_init__
    if not getattr(original, "_vllm_mimo_hook", False):

        def __post_init__(self: Any) -> None:
            original(self)
            configure(self)

        __post_init__._vllm_mimo_hook = True  # type: ignore[attr-defined]
        VllmConfig.__post_init__ = __post_init__
    from vllm_mimo import attention_backends
    from vllm_mimo.metrics import register_collector
    from vllm_mimo.spec_decode import cpu_expand, setup

    register_collector()
    attention_backends.install()
    setup.install()
    cpu_expand.install()
    _validate_anchor_hints_on_input()
    _registered_in_pid = os.getpid()


def register_env_names() -> None:
    """Make the plugin's `VLLM_MIMO_<KEY>` variables known to vLLM's check of `VLLM_*` variables
    (`Platform.validate_environ` against `vllm.envs.environment_variables`: a warning per
    unknown name, a ValueError with `--fail-on-environ-validation`). Done even when the plugin
    is disabled, since `VLLM_MIMO_ENABLE=0` is one of them; only the configuration's keys, so a
    misspelled name stays unknown to vLLM as it is to `MimoConfig`."""
    from vllm_mimo.compat import vllm_envs

    for name in MimoConfig.env_names():
        vllm_envs.environment_variables.setdefault(name, functools.partial(os.environ.get, name))


def _validate_anchor_hints_on_input() -> None:
    """Reject malformed `extra_args["mimo"]` hints where vLLM validates SamplingParams, and
    anchor positions past the prompt's end once its tokens are known, so a bad request fails
    alone (HTTP 400 with `param` set, or an error from `LLM.generate`) instead of the engine."""
    from vllm_mimo.compat import InputProcessor, SamplingParams, VLLMValidationError
    from vllm_mimo.kv_cache.anchor_policy import AnchorHintError, declared_anchors

    validate, process = InputProcessor._validate_params, InputProcessor.process_inputs
    if getattr(validate, "_vllm_mimo_hook", False):
        return

    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(params, SamplingParams):
            try:
                declared_anchors(params.extra_args)
            except AnchorHintError as e:
                raise VLLMValidationError(str(e), parameter=HINTS_PARAM) from None
        return validate(self, params, *args, **kwargs)

    def process_inputs(self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        request = process(self, request_id, prompt, params, *args, **kwargs)
        length = len(request.prompt_token_ids) if request.prompt_token_ids is not None else None
        if isinstance(params, SamplingParams) and length is not None:
            past = [p for p in declared_anchors(params.extra_args)[0] if p > length]
            if past:
                raise VLLMValidationError(
                    f'extra_args["mimo"]: anchor position {past[0]} is past the end of the prompt, '
                    f"which has {length} tokens (an anchor keeps the window before a position in the prompt)",
                    parameter=HINTS_PARAM,
                )
        return request

    _validate_params._vllm_mimo_hook = True  # type: ignore[attr-defined]
    InputProcessor._validate_params = _validate_params
    InputProcessor.process_inputs = process_inputs


def configure(vllm_config: Any) -> None:
    """Validate the plugin's settings and, for a hybrid SWA model, select its scheduler."""
    from vllm_mimo.layout import layout_from_hf_config

    model_config = vllm_config.model_config
    if model_config is None or getattr(model_config, "is_submodel_config", False):
        return
    config = MimoConfig.from_vllm_config(vllm_config)
    _check_startup(vllm_config, config)
    if not config.enable:
        logger.debug("vllm-mimo: disabled by configuration (enable=false)")
        return
    layout = layout_from_hf_config(model_config.hf_config)
    if layout is None:
        if config.host_tier_gib:
            logger.warning(
                "vllm-mimo: host_tier_gib=%g is set, but %s is not a hybrid sliding-window model: "
                "the plugin does nothing, so there is no host tier",
                config.host_tier_gib,
                model_config.architecture,
            )
        logger.debug(
            "vllm-mimo: %s is not a hybrid sliding-window model; the plugin does nothing",
            model_config.architecture,
        )
        return
    from vllm_mimo import attention_backends
    from vllm_mimo.spec_decode import setup

    attention_backends.configure(vllm_config, config)
    setup.configure(vllm_config, config.mtp_all_layers)
    if _select_scheduler(vllm_config, config):
        logger.debug(
            "vllm-mimo: %s: %s; scheduler %s",
            model_config.architecture,
            layout.describe(),
            vllm_config.scheduler_config.scheduler_cls,
        )


def _check_startup(vllm_config: Any, config: MimoConfig) -> None:
    """What is checked whether or not the plugin serves this model: the host tier's and L3's
    memory, the pin file; and this process marked as the front end (`metrics`)."""
    from vllm_mimo.metrics import mark_frontend
    from vllm_mimo.offload import check_host_memory

    check_host_memory(config.host_tier_gib, config.l3_gib)
    mark_frontend()
    if config.pin_prompts_file:
        from vllm_mimo.engine.pinning import read_pin_file

        read_pin_file(config.pin_prompts_file)
        if not vllm_config.cache_config.enable_prefix_caching:
            raise MimoConfigError(
                f"pin_prompts_file={config.pin_prompts_file!r} needs prefix caching, which is off "
                "(drop --no-enable-prefix-caching or the pin file)"
            )


def _select_scheduler(vllm_config: Any, config: MimoConfig) -> bool:
    """Select the plugin's scheduler (with its connector and chat anchors) unless the user
    chose another or this config has it already; True if selected now."""
    from vllm_mimo import offload
    from vllm_mimo.offload import refuse_other_connector

    scheduler_config = vllm_config.scheduler_config
    if scheduler_config.scheduler_cls in (None, SCHEDULER_CLS, ASYNC_SCHEDULER_CLS):
        refuse_other_connector(vllm_config)
    if scheduler_config.scheduler_cls in (SCHEDULER_CLS, ASYNC_SCHEDULER_CLS):
        return False  # a config rebuilt from one this hook already configured
    if scheduler_config.scheduler_cls is not None:
        logger.warning(
            "vllm-mimo: --scheduler-cls %s was given, so the plugin's scheduler is not "
            "installed for hybrid SWA model %s%s",
            scheduler_config.scheduler_cls,
            vllm_config.model_config.architecture,
            ", and there is no host tier (host_tier_gib)" if config.host_tier_gib else "",
        )
        return False
    offload.configure(vllm_config, config)
    scheduler_config.scheduler_cls = ASYNC_SCHEDULER_CLS if scheduler_config.async_scheduling else SCHEDULER_CLS
    from vllm_mimo.engine import chat_anchors

    chat_anchors.install(system_anchor=config.system_prompt_anchor)
    return True

"""Where the all-layer MiMo MTP drafter plugs into vLLM.

- Every process (`install`): vLLM's `MiMoV2MTPModel` architecture is built by
  `model.MimoAllLayersMTP`, which runs as many MTP layers as its draft config names (vLLM's
  own draft config names one: then it is vLLM's model); and the V1 model runner's drafter is
  `proposer.MimoMTPProposer` when that count is more than one.
- Per engine (`configure`, from the plugin's config hook): with `mtp_all_layers` on, the draft
  config gets the checkpoint's MTP layer count back (vLLM's `hf_config_override` sets it to 1;
  `n_predict` stays 1, so any `num_speculative_tokens` passes vLLM's checks), and
  `num_speculative_tokens` is checked against it.
"""

from __future__ import annotations

from typing import Any

from vllm_mimo.config import MimoConfigError
from vllm_mimo.log import logger

MTP_ARCH = "MiMoV2MTPModel"
MODEL_CLS = "vllm_mimo.spec_decode.model:MimoAllLayersMTP"


def _draft_hf_config(vllm_config: Any) -> Any | None:
    """The draft model's HF config when the engine drafts with MiMo's MTP module, else None."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or spec.method != "mtp" or spec.draft_model_config is None:
        return None
    hf = spec.draft_model_config.hf_config
    return hf if MTP_ARCH in (getattr(hf, "architectures", None) or []) else None


def configure(vllm_config: Any, all_layers: bool) -> None:
    """Give the draft config the checkpoint's MTP layer count (see the module docstring)."""
    draft = _draft_hf_config(vllm_config)
    if draft is None or not all_layers:
        return
    layers = int(getattr(vllm_config.model_config.hf_config, "num_nextn_predict_layers", 0) or 0)
    if layers <= 1:
        return
    k = vllm_config.speculative_config.num_speculative_tokens
    if k > layers:
        raise MimoConfigError(
            f"num_speculative_tokens={k}: with mtp_all_layers (the default) each draft token is "
            f"one MTP layer, and {vllm_config.model_config.model} has {layers}; use 1..{layers}, "
            "or set mtp_all_layers to false for vLLM's drafter (MTP layer 0 for every token)"
        )
    draft.num_nextn_predict_layers = layers
    logger.debug("vllm-mimo: the MTP drafter runs all %d MTP layers", layers)


def _hook_runner(module: Any) -> None:
    """Wrap the V1 model runner's `__init__`: after vLLM picks its drafter, use ours for a
    MiMo MTP draft config with more than one layer."""
    runner_cls = module.GPUModelRunner
    if getattr(runner_cls.__init__, "_vllm_mimo_hook", False):
        return
    original = runner_cls.__init__

    def __init__(self: Any, vllm_config: Any, device: Any, *args: Any, **kwargs: Any) -> None:
        original(self, vllm_config, device, *args, **kwargs)
        draft = _draft_hf_config(vllm_config)
        if draft is not None and int(getattr(draft, "num_nextn_predict_layers", 1) or 1) > 1:
            from vllm_mimo.spec_decode.proposer import MimoMTPProposer

            self.drafter = MimoMTPProposer(vllm_config, self.device, self)

    __init__._vllm_mimo_hook = True  # type: ignore[attr-defined]
    runner_cls.__init__ = __init__


def install() -> None:
    """Register the model class and the runner hook in this process (idempotent)."""
    from vllm_mimo.compat import ModelRegistry, when_imported

    ModelRegistry.register_model(MTP_ARCH, MODEL_CLS)
    when_imported("vllm.v1.worker.gpu_model_runner", _hook_runner)

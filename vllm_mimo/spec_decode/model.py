"""MiMo-V2's MTP module with every MTP layer of the checkpoint.

vLLM's `MiMoV2MTP` builds MTP layer 0 only and runs it for every draft step. This class is
registered under the same architecture name (`MiMoV2MTPModel`), so vLLM builds it for MiMo's
`method="mtp"`. It builds `num_nextn_predict_layers` layers of the draft config and runs layer
`min(spec_step_idx, layers - 1)`: layer k for draft step k, the last layer past the checkpoint's
count. With one layer (vLLM's own draft config: its `hf_config_override` sets the count to 1)
it is vLLM's model; the plugin restores the checkpoint's count where it runs the all-layer
drafter (`vllm_mimo.spec_decode.setup`).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mimo.compat import (
    LogitsProcessor,
    MiMoV2MTP,
    MiMoV2MTPLayers,
    MiMoV2MultiTokenPredictor,
    ParallelLMHead,
    VocabParallelEmbedding,
    maybe_prefix,
)


class AllLayersPredictor(MiMoV2MultiTokenPredictor):
    """`MiMoV2MultiTokenPredictor` with `num_nextn_predict_layers` layers."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_config
        # The count is the draft config's (vLLM builds this module with the target's model
        # config, whose count is the checkpoint's even when vLLM runs one layer).
        spec = vllm_config.speculative_config
        draft = spec.draft_model_config.hf_config if spec is not None and spec.draft_model_config else config
        self.num_mtp_layers = max(1, int(getattr(draft, "num_nextn_predict_layers", 1) or 1))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.mtp = MiMoV2MTPLayers(
            config=config,
            num_mtp_layers=self.num_mtp_layers,
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=maybe_prefix(prefix, "mtp.layers"),
        )
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        layer = self.mtp.layers[str(min(spec_step_idx, self.num_mtp_layers - 1))]
        return layer(inputs_embeds, positions, previous_hidden_states)


class MimoAllLayersMTP(MiMoV2MTP):
    """vLLM's `MiMoV2MTP` (weights, logits, loading) over `AllLayersPredictor`."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        nn.Module.__init__(self)
        self.config = vllm_config.model_config.hf_config
        self.model = AllLayersPredictor(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            self.config.vocab_size, self.config.hidden_size, prefix=maybe_prefix(prefix, "lm_head")
        )

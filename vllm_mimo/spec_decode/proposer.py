"""The all-layer MiMo MTP drafter on vLLM's V1 model runner, warmed over every prompt token.

As MiMo's MTP layers are trained (`eval.train_tiny`), MTP layer m (0-based) at slot i reads the
embedding of token x_{i+m+1} and the output of layer m-1 at slot i (layer 0: the target's hidden
state h_i), at position i, and predicts x_{i+m+2}; each layer keeps its own KV (its own KV cache
group) at every slot. At a target step that computed positions a..b-1 and sampled x_b:

1. Warm-up (every step, prefill chunks included): layer m runs over the slots whose input token
   is known, [lo, b-m), in order m = 0, 1, ... (each layer's outputs are the next one's inputs).
   `lo = a - (M-1)` for a request that continues from the previous step (M = the MTP layers
   run): the last m slots of layer m were computed from drafts (or not at all, at the end of a
   prefill chunk) and are computed again now that their tokens are known; the drafter keeps
   the last M-1 target hidden states and tokens of each request for that. A request's first
   step (a new request, a prefix hit, a resume) starts at `lo = a`: below a, the cached blocks
   hold drafter KV computed from known tokens, because a hit stops one block short of what was
   cached (the block drop of EAGLE/MTP, `KVCache.match`), which is more than M-1 positions.
2. Drafts: token b+1 from layer 0 at slot b-1; token b+t+1 from layer t at slot b-1, after layer
   t runs over its slots [b-t, b) on the step's drafts (their KV is computed again at the next
   step, as in 1). Every draft step is one MTP layer; positions never pass b-1.

So drafting needs no slots past the target's, and the drafter's KV is exactly what the model
saw in training at every slot whose token is known (`eval.mtp_oracle` computes the same drafts in
plain torch; the tests compare them). On the V2 model runner (CUDA with Triton) vLLM's own
`MultiModuleMTPSpeculator` runs all layers instead; this class is for the V1 runner only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from vllm_mimo.compat import CommonAttentionMetadata, EagleProposer, Step3p5MTPProposer, set_forward_context


@dataclasses.dataclass
class _History:
    """What a request's next step needs from this one: the position it continues at, and the
    tokens at positions [end - len(hidden), end] and target hidden states at [end - len(hidden), end)."""

    end: int
    tokens: list[int]
    hidden: torch.Tensor


@dataclasses.dataclass
class _Span:
    """One request's slots [start, end) in one pass of one MTP layer."""

    row: int  # the request's row in the batch
    start: int
    end: int


class MimoMTPProposer(Step3p5MTPProposer):
    """vLLM's multi-group MTP proposer (`Step3p5MTPProposer`: per-group block tables from the
    runner, one KV cache group per MTP layer) with MiMo's drafting order (module docstring)."""

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
        super().__init__(vllm_config, device, runner)
        self.model_runner = runner  # its input batch (request ids) and live requests
        self.num_mtp_layers = int(vllm_config.speculative_config.draft_model_config.hf_config.num_nextn_predict_layers)
        k = vllm_config.speculative_config.num_speculative_tokens
        if not 1 <= k <= self.num_mtp_layers:
            raise ValueError(
                f"num_speculative_tokens={k}: vllm-mimo's MTP drafter runs one MTP layer per draft "
                f"token, so it must be 1..{self.num_mtp_layers} (the checkpoint's MTP layers)"
            )
        self._history: dict[str, _History] = {}

    # vLLM's MiMo MTP shares the target's lm_head and builds from the base draft config; the
    # Step3.5 parent changes both for its own checkpoints.
    def _maybe_share_lm_head(self, target_language_model: torch.nn.Module) -> None:
        EagleProposer._maybe_share_lm_head(self, target_language_model)

    def _create_draft_vllm_config(self) -> Any:
        return EagleProposer._create_draft_vllm_config(self)

    def _layer_group(self, layer: int) -> Any:
        needle = f"mtp.layers.{layer}."
        for group in self.draft_attn_groups:
            if any(needle in name for name in group.layer_names):
                return group
        raise RuntimeError(f"no KV cache group holds MTP layer {layer}")

    def _run_layer(
        self,
        layer: int,
        spans: Sequence[_Span],
        tokens: Sequence[list[int]],
        prev: Sequence[torch.Tensor],
    ) -> list[torch.Tensor]:
        """MTP `layer` over each span (its tokens and previous-layer states); its outputs per span."""
        group = self._layer_group(layer)
        gid = group.kv_cache_group_id
        lens = [s.end - s.start for s in spans]
        qsl = torch.zeros(len(spans) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
        positions = torch.cat([torch.arange(s.start, s.end) for s in spans]).to(self.device)
        rows = torch.tensor([s.row for s in spans], dtype=torch.long)
        block_table = self._per_group_block_tables[gid].index_select(0, rows.to(self._per_group_block_tables[gid].device))
        bs = group.kv_cache_spec.block_size
        per_row = positions.split(lens)
        slots = torch.cat(
            [block_table[i, (p // bs).long()].long() * bs + p % bs for i, p in enumerate(per_row)]
        )
        seq_lens = torch.tensor([s.end for s in spans], dtype=torch.int32)
        cm = CommonAttentionMetadata(
            query_start_loc=qsl.to(self.device),
            query_start_loc_cpu=qsl,
            seq_lens=seq_lens.to(self.device),
            num_reqs=len(spans),
            num_actual_tokens=int(qsl[-1]),
            max_query_len=max(lens),
            max_seq_len=max(s.end for s in spans),
            block_table_tensor=block_table,
            slot_mapping=slots.to(self.device),
            causal=True,
            positions=positions,
            seq_lens_cpu_upper_bound=seq_lens,
        )
        metadata = group.build_metadata_for_drafting(common_attn_metadata=cm, draft_index=0)
        input_ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long, device=self.device)
        with set_forward_context(
            dict.fromkeys(group.layer_names, metadata),
            self.vllm_config,
            num_tokens=int(qsl[-1]),
            slot_mapping=dict.fromkeys(group.layer_names, cm.slot_mapping),
        ):
            out = self.model(
                input_ids=input_ids,
                positions=positions,
                hidden_states=torch.cat(list(prev)),
                spec_step_idx=layer,
            )
        return list(out.split(lens))

    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: Any,
        sampling_metadata: Any,
        mm_embed_inputs: Any = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings: Any = None,
    ) -> torch.Tensor:
        self.num_speculative_tokens = num_speculative_tokens
        self._last_draft_probs = None
        batch = common_attn_metadata.num_reqs
        qsl = common_attn_metadata.query_start_loc_cpu.tolist()
        if token_indices_to_sample is None:
            last = [qsl[r + 1] - 1 for r in range(batch)]
        else:
            last = token_indices_to_sample.tolist()
        req_ids = self.model_runner.input_batch.req_ids[:batch]
        lo_b, toks, hids = self._inputs(
            req_ids, qsl, last, target_token_ids, target_positions, target_hidden_states, next_token_ids
        )
        warm = self._warm_up(lo_b, toks, hids)
        draft_ids, draft_probs = self._draft(num_speculative_tokens, lo_b, toks, hids, warm, sampling_metadata)
        self._remember(req_ids, lo_b, toks, hids)
        if draft_probs[0] is not None:
            self._last_draft_probs = torch.stack(draft_probs, dim=1).contiguous()
        return torch.stack(draft_ids, dim=1)

    def _inputs(
        self,
        req_ids: Sequence[str],
        qsl: list[int],
        last: list[int],
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
    ) -> tuple[list[tuple[int, int]], list[list[int]], list[torch.Tensor]]:
        """Per request of the batch: where its MTP layers run, lo and b (`_span`), the tokens at
        [lo, b] and the target hidden states at [lo, b)."""
        positions = target_positions.tolist()
        tokens_all = target_token_ids.tolist()
        next_tokens = next_token_ids.tolist()
        lo_b, toks, hids = [], [], []
        for r, req_id in enumerate(req_ids):
            a, b = positions[qsl[r]], positions[last[r]] + 1
            state = self.model_runner.requests[req_id]
            # A partial prefill's next token is the prompt's (vLLM's padded batch passes the
            # prompt's last token there, which would leave wrong drafter KV at every chunk end).
            following = state.get_token_id(b) if b < state.num_prompt_tokens else next_tokens[r]
            seq = tokens_all[qsl[r] : last[r] + 1] + [following]
            hid = target_hidden_states[qsl[r] : last[r] + 1]
            lo, seq, hid = self._span(r, req_id, state, a, b, seq, hid)
            lo_b.append((lo, b))
            toks.append(seq)
            hids.append(hid)
        return lo_b, toks, hids

    def _warm_up(
        self, lo_b: list[tuple[int, int]], toks: list[list[int]], hids: list[torch.Tensor]
    ) -> list[dict[int, torch.Tensor]]:
        """Layer m over [lo, b-m) for every request where that is not empty; per row, each
        layer's outputs from lo."""
        warm: list[dict[int, torch.Tensor]] = [{} for _ in lo_b]
        for m in range(self.num_mtp_layers):
            spans = [_Span(r, lo, b - m) for r, (lo, b) in enumerate(lo_b) if b - m > lo]
            if not spans:
                break
            tokens = [toks[s.row][m + 1 : m + 1 + s.end - s.start] for s in spans]
            prev = [hids[s.row][: s.end - s.start] if m == 0 else warm[s.row][m - 1][: s.end - s.start] for s in spans]
            for s, out in zip(spans, self._run_layer(m, spans, tokens, prev), strict=True):
                warm[s.row][m] = out
        return warm

    def _draft(
        self,
        k: int,
        lo_b: list[tuple[int, int]],
        toks: list[list[int]],
        hids: list[torch.Tensor],
        warm: list[dict[int, torch.Tensor]],
        sampling_metadata: Any,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """`k` draft tokens per request (and their probabilities, if sampled), one MTP layer per
        draft token: layer t runs over [b-t, b) on the drafts, reading layer t-1 below it."""
        ids, probs = self._sample_draft_tokens_for_step(
            torch.stack([warm[r][0][-1] for r in range(len(lo_b))]), sampling_metadata, spec_step_idx=0
        )
        draft_ids, draft_probs = [ids], [probs]
        drafted: list[dict[int, torch.Tensor]] = [{} for _ in lo_b]  # row -> layer -> outputs over its draft slots
        for t in range(1, k):
            spans = [_Span(r, max(lo, b - t), b) for r, (lo, b) in enumerate(lo_b)]
            so_far = torch.stack(draft_ids, dim=1).tolist()
            tokens, prev = [], []
            for s in spans:
                lo, b = lo_b[s.row]
                tokens.append([so_far[s.row][i + t - b] for i in range(s.start, s.end)])
                empty = hids[s.row][:0]
                below = warm[s.row].get(t - 1, empty)[s.start - lo :]  # layer t-1 from s.start up to b-t+1
                prev.append(torch.cat((below, drafted[s.row].get(t - 1, empty)))[-(s.end - s.start) :])
            outs = self._run_layer(t, spans, tokens, prev)
            for s, out in zip(spans, outs, strict=True):
                drafted[s.row][t] = out
            ids, probs = self._sample_draft_tokens_for_step(
                torch.stack([o[-1] for o in outs]), sampling_metadata, spec_step_idx=t
            )
            draft_ids.append(ids)
            draft_probs.append(probs)
        return draft_ids, draft_probs

    def _span(
        self, row: int, req_id: str, state: Any, a: int, b: int, seq: list[int], hid: torch.Tensor
    ) -> tuple[int, list[int], torch.Tensor]:
        """Where a request's MTP layers run from this step, with the tokens and target hidden
        states from there: the step's slots [a, b) (`seq`, `hid`), preceded by what the previous
        step left for it (`_History`: the last slots the layers above the first could not run
        yet) when this step continues where that one ended. `row`: the request's row in the batch."""
        hist = self._history.get(req_id)
        if hist is None or hist.end != a or not len(hist.hidden):
            return a, seq, hid
        return a - len(hist.hidden), hist.tokens[:-1] + seq, torch.cat((hist.hidden.to(hid.dtype), hid))

    def _remember(
        self, req_ids: Sequence[str], lo_b: list[tuple[int, int]], toks: list[list[int]], hids: list[torch.Tensor]
    ) -> None:
        keep = self.num_mtp_layers - 1
        live = set(self.model_runner.requests)
        for rid in [rid for rid in self._history if rid not in live]:
            del self._history[rid]
        for rid, (lo, b), seq, hid in zip(req_ids, lo_b, toks, hids, strict=True):
            n = min(keep, b - lo)
            self._history[rid] = _History(b, seq[len(seq) - 1 - n :], hid[len(hid) - n :].clone())

"""What an MTP drafter drafts, computed in plain torch on a known sequence (the bench's oracle).

`MtpOracle` takes a model (`eval.mimo_reference.MimoReference`) and one token sequence x_0..x_N-1
and answers: at a target step where tokens up to x_n are known (the target has just produced
x_n; its hidden state h_i is known for i < n), which k tokens does the drafter propose for
positions n+1..n+k? Two drafters:

- `distinct` (ours): MTP layer m (0-based) drafts token m+1 of the step. As trained
  (`eval.train_tiny`), layer m at slot i reads the embedding of token x_{i+m+1} and the output of
  layer m-1 at slot i (layer 0: the main model's hidden state h_i), at position i. Every layer
  keeps its own KV at every slot; where x_{i+m+1} is not known yet (i + m + 1 > n) the slot is
  computed from the step's earlier drafts, as a drafter running in an engine must.
- `reuse` (vLLM's MiMo MTP on both model runners before this plugin): layer 0 for every draft
  step; draft step j runs layer 0 at slot n-1+j on the previous draft token, with the previous
  step's output hidden state, at position n-1+j.

`floor` is the first slot whose drafter KV exists: 0 when the drafter ran over the prompt (warm),
P-1 for a prompt of P tokens when it did not (cold: its first slot is the one the first decode step
computes). Keys below the floor are masked exactly: every layer runs on slots from the floor on
only. Two other fills say what a drafter that skipped those slots reads in an engine, where they
still take softmax weight: zero keys and values (a zeroed cache: the engine's cold runs,
`MimoMTPProposer.warm_prompt`), or another sequence's drafter KV (a reused block). An MTP layer is
one SWA block (window W), so the output at slot i depends on the layer's keys at slots i-W+1..i, and
through the previous layer's outputs on the keys of layer m-1 back to i-2W+2: each layer is run over
the slots its result depends on and no more, and the result is exact (the same as running over the
whole sequence).

Consequence (checked by `eval.bench_mtp`): warm and cold drafts agree once draft position t
(1-based) of the distinct drafter sits t*(W-1) slots past the prompt (its chain reaches back t
windows), and from W-1 output tokens on for the reuse drafter (one window).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eval.mimo_reference import MimoReference


class MtpOracle:
    """Drafts of one sequence (`x`: 1-D token ids) under a model, by exact recomputation."""

    def __init__(self, model: MimoReference, x: torch.Tensor) -> None:
        self.model = model
        self.x = x.long()
        self.window = int(model.args.sliding_window_size)
        with torch.no_grad():
            self.h0 = model.hidden(self.x[None])[0]  # main-model hidden states, causal: exact for any n

    def _layer(self, depth: int, tokens: Sequence[int] | torch.Tensor, prev: torch.Tensor, start: int,
               zero_kv: int = 0) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.long)[None]
        positions = torch.arange(start, start + ids.shape[1])[None]
        return self.model.mtp_hidden(depth, ids, prev[None], positions, zero_kv)[0]

    def _argmax(self, hidden: torch.Tensor) -> int:
        return int(self.model.logits(hidden).argmax())

    def _token(self, pos: int, n: int, drafts: list[int]) -> int:
        """x_pos when known at a step that knows tokens up to x_n, else the step's draft for it."""
        return int(self.x[pos]) if pos <= n else drafts[pos - n - 1]

    @torch.no_grad()
    def distinct(self, n: int, k: int, floor: int = 0, below: str | MtpOracle = "mask") -> list[int]:
        """Ours: layer m drafts token n+m+1 at slot n-1 (see the module docstring). Below `floor`
        the drafter's KV is `below`: "mask" (none), "zeros", or another sequence's oracle, whose
        drafter's KV at those slots the cache holds (a block another request left there)."""
        if not 1 <= k <= self.model.num_mtp_layers:
            raise ValueError(f"k={k}: the distinct drafter needs 1 <= k <= {self.model.num_mtp_layers} (MTP layers)")
        if isinstance(below, str) and below not in ("mask", "zeros"):
            raise ValueError(f"below={below!r}: must be 'mask', 'zeros' or an MtpOracle")
        w, drafts, prev_out, prev_start = self.window, [], None, 0
        for m in range(k):
            # Layer m's output at slot n-1 reaches back (k-m) windows through the later layers'
            # inputs; k extra slots cover the draft slots of each layer.
            start = max(floor if below == "mask" else 0, n - (k - m) * w - k)
            cut = max(0, floor - start)  # slots [start, start + cut) are below the floor
            tokens = [self._token(i + m + 1, n, drafts) for i in range(start, n)]
            prev = self.h0[start:n] if m == 0 else prev_out[start - prev_start :]
            if isinstance(below, MtpOracle) and cut:
                # A slot's keys and values depend on its own inputs only: below the floor they
                # are the other sequence's, and so are the outputs there, which feed the next
                # layer's slots below the floor alone.
                tokens[:cut] = [int(below.x[i + m + 1]) for i in range(start, floor)]
                if m == 0:
                    prev = torch.cat((below.h0[start:floor], prev[cut:]))
            # With zeros, the outputs below the floor likewise feed only zeroed slots.
            out = self._layer(m + 1, tokens, prev, start, cut if below == "zeros" else 0)
            drafts.append(self._argmax(out[-1]))
            prev_out, prev_start = out, start
        return drafts

    @torch.no_grad()
    def reuse(self, n: int, k: int, floor: int = 0) -> list[int]:
        """Upstream: layer 0 at slots n-1, n, ..., n+k-2, each on the previous draft."""
        start = max(floor, n - self.window - k)
        tokens = [int(t) for t in self.x[start + 1 : n + 1]]
        prev = self.h0[start:n]
        drafts: list[int] = []
        for _ in range(k):
            out = self._layer(1, tokens, prev, start)
            drafts.append(self._argmax(out[-1]))
            tokens.append(drafts[-1])
            prev = torch.cat((prev, out[-1:]))
        return drafts

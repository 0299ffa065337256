"""What an MTP drafter drafts at every step of a known sequence, from one teacher-forced pass.

`TeacherForced(model, x)` holds one token sequence x_0..x_T-1 under a model
(`eval.mimo_reference.MimoReference`). At a target step that knows tokens up to x_n, a drafter
proposes k tokens for positions n+1..n+k; the step accepts the drafts equal to the text's next
tokens up to the first that is not. Draft t (1-based) of the step depends on drafts 1..t-1, but
only while they are right is it counted: so **accepted drafts at step n = the leading run of
t = 1..k with heads[t-1][n-1] == x[n+t]**, where heads[t-1][i] is what draft t computes at slot
i when every earlier draft is the text's token (teacher-forced). One pass per drafter gives
heads at every slot, hence acceptance at every step (`accepted`).

Drafters:

- `distinct` (ours, `vllm_mimo.spec_decode.proposer`): MTP layer m (0-based) drafts token m+1
  of a step; at slot i it reads x_{i+m+1} and layer m-1's output at slot i (layer 0: the main
  model's hidden state h_i), at position i, and predicts x_{i+m+2} (as `eval.train_tiny` trains
  it). Teacher-forced, that is `MimoReference.all_heads`.
- `reuse` (vLLM's MiMo MTP: layer 0 for every draft step): draft j+1 of step n runs layer 0 at
  slot n-1+j on draft j's token and draft j's output hidden state, attending to layer 0's KV of
  the known slots below n and to the step's own draft slots. Teacher-forced, pass j at slot i
  has its own query, key and value; it attends to the warm keys at slots <= i-j and to passes
  2..j's keys at slots i-j+1..i (the chain's).

The drafter's KV below `floor` (a slot) is what a restore left there (`DrafterKV`):

- "mask": none (exact: the layers' attention never sees those slots), the cold drafter of a hit
  whose target KV came back without the drafter's and whose drafter ran from `floor` on;
- "zeros": zero keys and values there (a zeroed cache: zero keys still take softmax weight);
- another `TeacherForced` (the donor): that sequence's drafter KV at those slots (blocks another
  request left there). A slot's KV depends on its own inputs and the slots below it, so this is
  the donor's tokens and hidden states spliced in below the floor.

floor 0 is warm (the drafter ran over the whole prompt, as in prefill). Every pass is exact
float32 over the whole sequence (T x T scores per head; a few hundred tokens per sequence), so
hundreds of sequences take minutes. `tests/test_mtp.py` checks the passes against the
step-by-step definition and `tests/test_mtp_engine.py` against vLLM's drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eval.mimo_reference import MimoReference, MTPLayer


@dataclass(frozen=True)
class DrafterKV:
    """The drafter's KV below `floor`: "mask", "zeros" or a donor `TeacherForced` (module docstring)."""

    floor: int = 0
    below: object = "mask"

    def __post_init__(self) -> None:
        if self.floor < 0:
            raise ValueError(f"floor={self.floor}: must be >= 0")
        if not isinstance(self.below, TeacherForced) and self.below not in ("mask", "zeros"):
            raise ValueError(f"below={self.below!r}: must be 'mask', 'zeros' or a TeacherForced donor")



def _qkv(layer: MTPLayer, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Query, key and value of an MTP layer's attention ([H, T, D], keys and values repeated to
    the query heads) on its pre-attention state h [T, hidden]."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)[None]
    t = h.shape[0]
    q = attn.q_proj(x).view(1, t, attn.heads, attn.head_dim)
    k = attn.k_proj(x).view(1, t, attn.kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(1, t, attn.kv_heads, attn.v_head_dim)
    cos, sin = attn.rotary.cos_sin(positions[None], q.dtype)
    q, k = attn.rotary.apply(q, cos, sin), attn.rotary.apply(k, cos, sin)
    if attn.v_scale is not None:
        v = v * attn.v_scale
    group = attn.heads // attn.kv_heads
    k, v = k[0].transpose(0, 1).repeat_interleave(group, 0), v[0].transpose(0, 1).repeat_interleave(group, 0)
    return q[0].transpose(0, 1), k, v


def _finish(layer: MTPLayer, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The MTP layer after its attention: `out` [H, T, Dv] -> the layer's output [T, hidden]."""
    attn = layer.self_attn
    h = h + attn.o_proj(out.transpose(0, 1).reshape(h.shape[0], -1))
    h = h + layer.mlp(layer.pre_mlp_layernorm(h))
    return layer.final_layernorm(h)


def _softmax_with_sink(layer: MTPLayer, scores: torch.Tensor) -> torch.Tensor:
    sink_bias = layer.self_attn.attention_sink_bias
    if sink_bias is None:
        return torch.softmax(scores, dim=-1)
    sink = sink_bias.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


class TeacherForced:
    """One sequence (`x`: 1-D token ids) under a model; drafts at every slot (module docstring)."""

    def __init__(self, model: MimoReference, x: torch.Tensor) -> None:
        self.model = model
        self.x = x.long()
        self.window = int(model.args.sliding_window_size)
        with torch.no_grad():
            self.h0 = model.hidden(self.x[None])[0]  # main-model hidden states, causal

    def _inputs(self, m: int, kv: DrafterKV) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer m's input tokens at its slots (x_{i+m+1}), a donor's below the floor."""
        t = len(self.x) - m - 1
        tokens = self.x[m + 1 : m + 1 + t].clone()
        if isinstance(kv.below, TeacherForced) and kv.floor:
            f = min(kv.floor, t)
            tokens[:f] = kv.below.x[m + 1 : m + 1 + f]
        return tokens, torch.arange(t)

    def _allowed(self, t: int, kv: DrafterKV) -> torch.Tensor:
        """[T, T] keys each query sees: causal, the window, nothing below the floor if masked."""
        i = torch.arange(t)
        allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        if kv.below == "mask" and kv.floor:
            # queries at or past the floor lose the keys below it (those below it stay as they are:
            # their outputs feed only slots below the floor)
            allowed &= ~((i[:, None] >= kv.floor) & (i[None, :] < kv.floor))
        return allowed

    def _layer(self, m: int, prev: torch.Tensor, kv: DrafterKV) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """MTP layer m (0-based) over all its slots with the drafter's KV `kv`: its outputs and (h, q, k, v)."""
        layer = self.model.model.mtp.layers[m]
        tokens, positions = self._inputs(m, kv)
        t = len(tokens)
        prev = prev[:t]
        if isinstance(kv.below, TeacherForced) and m == 0 and kv.floor:
            prev = torch.cat((kv.below.h0[: min(kv.floor, t)], prev[kv.floor :]))
        h = layer.eh_proj(torch.cat((layer.enorm(self.model.model.embed_tokens(tokens)), layer.hnorm(prev)), dim=-1))
        q, k, v = _qkv(layer, h, positions)
        if kv.below == "zeros" and kv.floor:
            k, v = k.clone(), v.clone()
            k[:, : kv.floor] = 0
            v[:, : kv.floor] = 0
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * layer.self_attn.scaling
        scores = scores.masked_fill(~self._allowed(t, kv), float("-inf"))
        out = torch.matmul(_softmax_with_sink(layer, scores).to(v.dtype), v)
        return _finish(layer, h, out), (h, q, k, v)

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden).argmax(-1)

    @torch.no_grad()
    def distinct(self, k: int, kv: DrafterKV | None = None) -> list[torch.Tensor]:
        """Ours: heads[t][i] = draft t+1 at slot i (predicts x_{i+t+2}), for t < k."""
        if not 1 <= k <= self.model.num_mtp_layers:
            raise ValueError(f"k={k}: the distinct drafter needs 1 <= k <= {self.model.num_mtp_layers} (MTP layers)")
        kv = kv or DrafterKV()
        heads, prev = [], self.h0
        for m in range(k):
            prev, _ = self._layer(m, prev, kv)
            heads.append(self._argmax(prev))
        return heads

    @torch.no_grad()
    def reuse(self, k: int, kv: DrafterKV | None = None) -> list[torch.Tensor]:
        """vLLM's: heads[j][i] = draft j+1 of the step n = i+1 (predicts x_{i+j+2}), for j < k."""
        if k < 1:
            raise ValueError(f"k={k}: must be >= 1")
        kv = kv or DrafterKV()
        if isinstance(kv.below, TeacherForced) or kv.below == "zeros":
            raise ValueError("the reuse drafter is computed warm or masked only")
        layer = self.model.model.mtp.layers[0]
        out, (_, _, k1, v1) = self._layer(0, self.h0, kv)
        t = out.shape[0]
        heads = [self._argmax(out)]
        allowed = self._allowed(t, kv)
        i = torch.arange(t)
        chain_k: list[torch.Tensor] = []  # pass j's keys and values at each of its slots
        chain_v: list[torch.Tensor] = []
        prev_out = out
        for j in range(1, k):
            # pass j at slot s = n-1+j reads x_{s+1} (draft j) and pass j-1's output at slot s-1
            tokens = self.x[1 : 1 + t]
            prev = torch.cat((prev_out[:1] * 0, prev_out[:-1]))
            h = layer.eh_proj(torch.cat((layer.enorm(self.model.model.embed_tokens(tokens)), layer.hnorm(prev)), dim=-1))
            q, kj, vj = _qkv(layer, h, i)
            # warm keys at slots <= s - j, the chain's at s-j+1 .. s (passes 1..j at their slots)
            base = allowed & (i[None, :] <= i[:, None] - j)
            scores = (torch.matmul(q, k1.transpose(-1, -2)).float() * layer.self_attn.scaling).masked_fill(~base, float("-inf"))
            extra_k = [*chain_k, kj]
            extra_v = [*chain_v, vj]
            extra = []
            for p, ek in enumerate(extra_k):  # pass p+1's key at slot s - (j - 1 - p)
                shift = j - 1 - p
                shifted = torch.roll(ek, shifts=shift, dims=1)
                extra.append((q * shifted).sum(-1, keepdim=True).float() * layer.self_attn.scaling)
            probs = _softmax_with_sink(layer, torch.cat((scores, *extra), dim=-1))
            attn = torch.matmul(probs[..., :t].to(v1.dtype), v1)
            for p, ev in enumerate(extra_v):
                shifted = torch.roll(ev, shifts=j - 1 - p, dims=1)
                attn = attn + probs[..., t + p : t + p + 1].to(ev.dtype) * shifted
            prev_out = _finish(layer, h, attn)
            heads.append(self._argmax(prev_out))
            chain_k.append(kj)
            chain_v.append(vj)
        # pass j's head at slot s belongs to step n = s - j + 1: index it by the step's slot n-1
        return [h if j == 0 else torch.roll(h, shifts=-j) for j, h in enumerate(heads)]


def accepted(x: torch.Tensor, heads: list[torch.Tensor], n: int) -> int:
    """Drafts accepted at the step that knows x_0..x_n: the leading run of right heads at slot n-1."""
    a = 0
    while a < len(heads) and n + a + 1 < len(x) and int(heads[a][n - 1]) == int(x[n + a + 1]):
        a += 1
    return a


def steps(x: torch.Tensor, heads: list[torch.Tensor], prompt: int, end: int | None = None) -> list[tuple[int, int]]:
    """(n, accepted) of each decode step of a request whose prompt is x[:prompt] and whose output
    is x[prompt:end]: the first step knows x_prompt (the prefill's token), each moves on by its
    accepted drafts plus the target's token, and none accepts past the output's end."""
    end = len(x) if end is None else end
    out, n = [], prompt
    while n < end - 1:
        a = min(accepted(x, heads, n), end - 2 - n)
        out.append((n, a))
        n += a + 1
    return out

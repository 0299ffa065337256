"""A plain-torch MiMo-V2 (`MiMoV2FlashForCausalLM`) with its MTP layers: no vLLM needed.

It computes what vLLM's `model_executor/models/mimo_v2.py` and `mimo_v2_mtp.py` compute, with the
checkpoint's own parameter names, so the same `model.safetensors` loads here and in vLLM:

- decoder layer: `input_layernorm` -> attention -> `post_attention_layernorm` (fused residual
  add) -> SiLU-gated MLP; the model ends with `model.norm` (fused residual add) and `lm_head`;
- RMSNorm in float32, `x * rsqrt(mean(x^2) + layernorm_epsilon)`, cast back, times the weight;
- attention: q, k, v projections (GQA, query head h reads kv head h // (heads / kv_heads)),
  scale `head_dim ** -0.5`, v multiplied by `attention_value_scale` when it is set;
- rotary as vLLM's `get_rope(rope_type="default", partial_rotary_factor=...)`: NeoX style
  (rotate halves, not interleaved pairs) on the first `int(head_dim * partial_rotary_factor)`
  dims of each head, the rest passed through; `rope_theta` for full layers, `swa_rope_theta`
  for sliding-window layers and for the MTP layers;
- sliding-window layers (`hybrid_layer_pattern[i] == 1`): query i sees keys j with
  i - window < j <= i (the last `sliding_window_size` keys, itself included);
- attention sink bias (`add_swa_attention_sink_bias`): one extra logit per head in the softmax
  denominator with no value (`s_aux` in vLLM's attention kernels), on SWA and MTP layers;
- MTP layer k (`model.mtp.layers.{k-1}`): `h = eh_proj(cat(enorm(embed(token)), hnorm(prev)))`,
  then `input_layernorm` -> SWA attention -> `pre_mlp_layernorm` (fused add) -> MLP -> add ->
  `final_layernorm`; logits through the shared `lm_head`. `prev` for layer 1 is the main
  model's last hidden state AFTER `model.norm` (what `MiMoV2Model.forward` returns and what
  vLLM's MTP proposer passes on); for layer k > 1 it is layer k-1's output (after its
  `final_layernorm`). At slot i layer k reads `prev[i]` and the embedding of token i + k, sits
  at position i, and predicts token i + k + 1.

Used by `eval/train_tiny.py` (training, in autocast bf16) and by `tests/test_trained_model.py`
(the reference logits vLLM must match, in float32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MimoArgs:
    """The config fields vLLM's MiMo-V2 code reads, with the same defaults it uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    hybrid_layer_pattern: tuple[int, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    v_head_dim: int
    swa_num_attention_heads: int
    swa_num_key_value_heads: int
    swa_head_dim: int
    swa_v_head_dim: int
    sliding_window_size: int
    rope_theta: float
    swa_rope_theta: float
    partial_rotary_factor: float
    layernorm_epsilon: float
    add_swa_attention_sink_bias: bool
    add_full_attention_sink_bias: bool
    attention_value_scale: float | None
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_config(cls, c: dict) -> MimoArgs:
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError("only silu MLPs are supported (as in vLLM's MiMoV2MLP)")
        if c.get("attention_bias", False):
            raise ValueError("attention_bias=true is not supported by this reference")
        freq = c.get("moe_layer_freq")
        if freq is not None and not isinstance(freq, int) and any(freq):
            raise ValueError("MoE layers are not supported by this reference")
        rope_theta = c.get("rope_theta", 1_000_000)
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_hidden_layers=c["num_hidden_layers"],
            hybrid_layer_pattern=tuple(c["hybrid_layer_pattern"]),
            num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c["num_key_value_heads"],
            head_dim=c["head_dim"],
            v_head_dim=c.get("v_head_dim") or c["head_dim"],
            swa_num_attention_heads=c["swa_num_attention_heads"],
            swa_num_key_value_heads=c["swa_num_key_value_heads"],
            swa_head_dim=c["swa_head_dim"],
            swa_v_head_dim=c.get("swa_v_head_dim") or c["swa_head_dim"],
            sliding_window_size=c.get("sliding_window_size", -1),
            rope_theta=rope_theta,
            swa_rope_theta=c.get("swa_rope_theta", rope_theta),
            partial_rotary_factor=c.get("partial_rotary_factor", 1.0),
            layernorm_epsilon=c["layernorm_epsilon"],
            add_swa_attention_sink_bias=bool(c.get("add_swa_attention_sink_bias", False)),
            add_full_attention_sink_bias=bool(c.get("add_full_attention_sink_bias", False)),
            attention_value_scale=c.get("attention_value_scale"),
            num_nextn_predict_layers=c.get("num_nextn_predict_layers", 0),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position_embeddings=c.get("max_position_embeddings", 32768),
        )


class RMSNorm(nn.Module):
    """vLLM's RMSNorm: float32 statistics, `x.to(w.dtype) * w`, result in the input dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.to(self.weight.dtype) * self.weight).to(dtype)


class Rotary:
    """vLLM's default RotaryEmbedding, NeoX style, on the first `rotary_dim` dims of a head."""

    def __init__(self, head_dim: int, partial_rotary_factor: float, base: float) -> None:
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        self.base = base
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (positions.device, dtype, int(positions.max()) + 1)
        if key not in self._cache:
            rd = self.rotary_dim
            inv_freq = 1.0 / (self.base ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
            t = torch.arange(key[2], dtype=torch.float)
            freqs = torch.einsum("i,j -> ij", t, inv_freq)
            self._cache = {key: (freqs.cos().to(dtype), freqs.sin().to(dtype))}
        cos, sin = self._cache[key]
        return cos[positions], sin[positions]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H, D]; cos, sin: [B or 1, T, rotary_dim / 2]."""
        rd = self.rotary_dim
        rot, rest = x[..., :rd], x[..., rd:]
        cos = cos.unsqueeze(-2).to(x.dtype)
        sin = sin.unsqueeze(-2).to(x.dtype)
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((out, rest), dim=-1)


class Attention(nn.Module):
    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        window: int | None,
        sink: bool,
        rope_theta: float,
        partial_rotary_factor: float,
        v_scale: float | None,
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.v_head_dim = heads, kv_heads, head_dim, v_head_dim
        self.window = window
        self.v_scale = v_scale
        self.scaling = head_dim**-0.5
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * v_head_dim, bias=False)
        self.o_proj = nn.Linear(heads * v_head_dim, hidden, bias=False)
        self.attention_sink_bias = nn.Parameter(torch.zeros(heads)) if sink else None
        self.rotary = Rotary(head_dim, partial_rotary_factor, rope_theta)
        self.fast = False

    def forward(self, x: torch.Tensor, positions: torch.Tensor, zero_kv: int = 0) -> torch.Tensor:
        """`zero_kv`: the first that many slots' keys and values are zeros (what a paged cache
        that nothing wrote holds there), not their projections."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.v_head_dim)
        # vLLM keeps the cos/sin cache in the model dtype (the default dtype at build time).
        cos, sin = self.rotary.cos_sin(positions, q.dtype)
        q = self.rotary.apply(q, cos, sin)
        k = self.rotary.apply(k, cos, sin)
        if self.v_scale is not None:
            v = v * self.v_scale
        if zero_kv:
            k, v = k.clone(), v.clone()
            k[:, :zero_kv] = 0
            v[:, :zero_kv] = 0
        group = self.heads // self.kv_heads
        q = q.transpose(1, 2)  # [B, H, T, D]
        k = k.transpose(1, 2).repeat_interleave(group, dim=1)
        v = v.transpose(1, 2).repeat_interleave(group, dim=1)
        if self.fast:
            out = self._fast_attention(q, k, v)
        else:
            out = self._attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.v_head_dim))

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The plain definition: full [T, T] scores, causal (and window) mask, sink column."""
        b, _, t, _ = q.shape
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.scaling  # [B, H, T, T]
        i = torch.arange(t, device=q.device)
        allowed = i[None, :] <= i[:, None]
        if self.window is not None:
            allowed &= i[:, None] - i[None, :] < self.window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if self.attention_sink_bias is not None:
            # The sink is a per-head logit that joins the softmax denominator and has no value.
            sink = self.attention_sink_bias.float().view(1, -1, 1, 1).expand(b, -1, t, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :t]
        else:
            probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs.to(v.dtype), v)  # [B, H, T, Dv]

    def _fast_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The same result for training: SDPA for full layers; SWA layers in chunks of `window`
        queries against the 2 * window keys that can reach them (T * 2W scores, not T * T)."""
        b, h, t, d = q.shape
        if self.window is None:
            if self.attention_sink_bias is not None:
                return self._attention(q, k, v)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
        c = self.window
        n = -(-t // c)
        pad = n * c - t
        qc = F.pad(q, (0, 0, 0, pad)).view(b, h, n, c, d)
        kw = F.pad(k, (0, 0, c, pad)).unfold(2, 2 * c, c).transpose(-1, -2)  # [B, H, n, 2c, D]
        vw = F.pad(v, (0, 0, c, pad)).unfold(2, 2 * c, c).transpose(-1, -2)
        qi = torch.arange(c, device=q.device)[:, None]
        kj = torch.arange(2 * c, device=q.device)[None, :]
        # chunk query qi is at c*m + qi, window key kj at c*m - c + kj: allowed iff qi < kj <= qi + c
        allowed = ((kj > qi) & (kj <= qi + c)).expand(n, c, 2 * c).clone()
        allowed[0, :, :c] = False  # keys before position 0 (padding)
        scores = torch.matmul(qc, kw.transpose(-1, -2)).float() * self.scaling
        scores = scores.masked_fill(~allowed, float("-inf"))
        if self.attention_sink_bias is not None:
            sink = self.attention_sink_bias.float().view(1, -1, 1, 1, 1).expand(b, -1, n, c, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., : 2 * c]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs.to(vw.dtype), vw)  # [B, H, n, c, Dv]
        return out.reshape(b, h, n * c, -1)[:, :, :t]


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _swa_attention(a: MimoArgs) -> Attention:
    return Attention(
        a.hidden_size,
        a.swa_num_attention_heads,
        a.swa_num_key_value_heads,
        a.swa_head_dim,
        a.swa_v_head_dim,
        a.sliding_window_size if a.sliding_window_size > -1 else None,
        a.add_swa_attention_sink_bias,
        a.swa_rope_theta,
        a.partial_rotary_factor,
        a.attention_value_scale,
    )


class DecoderLayer(nn.Module):
    def __init__(self, a: MimoArgs, layer_id: int) -> None:
        super().__init__()
        if a.hybrid_layer_pattern[layer_id] == 1:
            self.self_attn = _swa_attention(a)
        else:
            # vLLM's full-attention MiMoV2Attention gets no sink (add_full_attention_sink_bias
            # is not read by vLLM 0.32).
            self.self_attn = Attention(
                a.hidden_size,
                a.num_attention_heads,
                a.num_key_value_heads,
                a.head_dim,
                a.v_head_dim,
                None,
                False,
                a.rope_theta,
                a.partial_rotary_factor,
                a.attention_value_scale,
            )
        self.mlp = MLP(a.hidden_size, a.intermediate_size)
        self.input_layernorm = RMSNorm(a.hidden_size, a.layernorm_epsilon)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.layernorm_epsilon)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Same as vLLM's fused form (hidden, residual) -> (norm(hidden + residual), sum).
        x = x + self.self_attn(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPLayer(nn.Module):
    def __init__(self, a: MimoArgs) -> None:
        super().__init__()
        self.enorm = RMSNorm(a.hidden_size, a.layernorm_epsilon)
        self.hnorm = RMSNorm(a.hidden_size, a.layernorm_epsilon)
        self.eh_proj = nn.Linear(2 * a.hidden_size, a.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(a.hidden_size, a.layernorm_epsilon)
        self.self_attn = _swa_attention(a)
        self.pre_mlp_layernorm = RMSNorm(a.hidden_size, a.layernorm_epsilon)
        self.mlp = MLP(a.hidden_size, a.intermediate_size)
        self.final_layernorm = RMSNorm(a.hidden_size, a.layernorm_epsilon)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, prev: torch.Tensor, zero_kv: int = 0) -> torch.Tensor:
        h = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(prev)), dim=-1))
        h = h + self.self_attn(self.input_layernorm(h), positions, zero_kv)
        h = h + self.mlp(self.pre_mlp_layernorm(h))
        return self.final_layernorm(h)


class _MTP(nn.Module):
    def __init__(self, a: MimoArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(a) for _ in range(a.num_nextn_predict_layers))


class _Model(nn.Module):
    def __init__(self, a: MimoArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a, i) for i in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.layernorm_epsilon)
        if a.num_nextn_predict_layers:
            self.mtp = _MTP(a)


class MimoReference(nn.Module):
    """`MiMoV2FlashForCausalLM` plus its MTP layers; `state_dict()` names are the checkpoint's."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = dict(config)
        self.args = a = MimoArgs.from_config(config)
        self.model = _Model(a)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_fast_attention(self, fast: bool = True) -> MimoReference:
        """Use the chunked SWA / SDPA attention (same math, for training) or the plain one."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.fast = fast
        return self

    @property
    def num_mtp_layers(self) -> int:
        return self.args.num_nextn_predict_layers

    @staticmethod
    def _positions(input_ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)[None]
        return positions

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Main model: [B, T] token ids -> [B, T, hidden] after `model.norm`."""
        positions = self._positions(input_ids, positions)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions)
        return self.model.norm(x)

    def mtp_hidden(
        self, depth: int, input_ids: torch.Tensor, prev: torch.Tensor, positions: torch.Tensor | None = None,
        zero_kv: int = 0,
    ) -> torch.Tensor:
        """MTP layer `depth` (1-based): slot i reads prev[i] and input_ids[i] (token i + depth);
        the first `zero_kv` slots' keys and values are zeros (`Attention.forward`)."""
        positions = self._positions(input_ids, positions)
        embeds = self.model.embed_tokens(input_ids)
        return self.model.mtp.layers[depth - 1](embeds, positions, prev, zero_kv)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Main-head logits [B, T, vocab]."""
        return self.logits(self.hidden(input_ids, positions))

    def all_heads(self, input_ids: torch.Tensor, num_mtp: int | None = None, detach_trunk: bool = False) -> list[torch.Tensor]:
        """Hidden states of the main model and MTP layers 1..num_mtp on one [B, T] sequence.

        Entry 0 has T slots (slot i predicts token i + 1); entry k has T - k slots (slot i
        predicts token i + k + 1, the last slot has no target inside the sequence).
        `detach_trunk`: the MTP layers read the main model's hidden states without a gradient
        into it (training: the trunk learns from the main head's loss alone).
        """
        num_mtp = self.num_mtp_layers if num_mtp is None else num_mtp
        t = input_ids.shape[1]
        positions = torch.arange(t, device=input_ids.device)[None]
        hs = [self.hidden(input_ids, positions)]
        for k in range(1, num_mtp + 1):
            prev = hs[-1][:, : t - k]
            if k == 1 and detach_trunk:
                prev = prev.detach()
            hs.append(self.mtp_hidden(k, input_ids[:, k:], prev, positions[:, : t - k]))
        return hs


def init_weights(model: MimoReference, seed: int) -> None:
    """A small-init scheme for training from scratch: N(0, 0.02) matrices, output projections
    scaled by 1/sqrt(2 * depth), norms at 1, sink biases at 0."""
    gen = torch.Generator().manual_seed(seed)
    depth = model.args.num_hidden_layers + model.num_mtp_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("attention_sink_bias"):
                p.zero_()
            else:
                std = 0.02
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std /= (2 * depth) ** 0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def load_reference(folder: str | Path, dtype: torch.dtype = torch.float32) -> MimoReference:
    """Load a MiMo-V2 model folder (config.json + model.safetensors) into the reference."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    model = MimoReference(config)
    tensors = load_file(str(folder / "model.safetensors"))
    expected = dict(model.state_dict())
    if model.args.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = set(expected) - set(tensors)
    extra = set(tensors) - set(expected)
    if missing or extra:
        raise ValueError(f"checkpoint names differ: missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}")
    model.load_state_dict(tensors, strict=False)
    return model.to(dtype).eval()


def export_tensors(model: MimoReference, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The model's parameters under their checkpoint names, in `dtype`, ready for safetensors."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.args.tie_word_embeddings:
            continue
        out[name] = t.detach().to(dtype).contiguous().clone()
    return out

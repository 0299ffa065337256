"""Counters the hybrid KV manager keeps (token counts are for first admissions only)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class KVManagerMetrics:
    prompt_tokens: int = 0
    """Prompt tokens of admitted requests."""
    hit_tokens: int = 0
    """Window-safe hits: prompt tokens not recomputed in any layer."""
    full_cached_tokens: int = 0
    """Prompt tokens the Full index held (the hit if SWA KV cost nothing)."""
    pseudo_hit_tokens: int = 0
    """Full-cached tokens recomputed because the SWA window before them was missing."""
    recomputed_swa_tokens: int = 0
    """Tokens whose SWA KV was recomputed while the Full layers had them. vLLM's model runner
    recomputes every layer for a token, so today this equals `pseudo_hit_tokens`."""
    preempted_hit_tokens: int = 0
    """Hits of requests re-admitted after preemption (not in `hit_tokens`)."""
    anchors_kept: Counter = field(default_factory=Counter)
    """Anchors created, by kind."""
    anchors_evicted: Counter = field(default_factory=Counter)
    """Anchors evicted (budget or SWA pool pressure), by kind."""
    prefill_steps_cut: int = 0
    """Steps that scheduled all of a token budget cut to what the pools hold (so the cut held
    prefill back; `step_prefill_floor_tokens`)."""
    evicted_blocks: list[int] = field(default_factory=lambda: [0, 0])
    """Cached blocks evicted, per pool (SWA, Full)."""

    def as_dict(self) -> dict:
        out = asdict(self)
        out["anchors_kept"] = dict(self.anchors_kept)
        out["anchors_evicted"] = dict(self.anchors_evicted)
        out["evicted_blocks"] = {"swa": self.evicted_blocks[0], "full": self.evicted_blocks[1]}
        return out

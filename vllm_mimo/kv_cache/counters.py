"""Counters the hybrid KV cache's events add up to (token counts are for first admissions only)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_mimo.kv_cache.contract import CacheObserver, CacheRequest, EvictionCause
from vllm_mimo.kv_cache.node import Anchor, AnchorKind, Node
from vllm_mimo.kv_cache.pools import Pool


@dataclass
class KVManagerMetrics(CacheObserver):
    block_size: int = 0
    """Tokens per position (set by the cache that this observes)."""
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
    withdrawn_positions: int = 0
    """Positions requests preempted within the step that scheduled them had cached but never
    computed, taken out of the tree (vLLM's priority policy preempts so)."""
    anchors_placed: Counter = field(default_factory=Counter)
    """Anchors placed, by kind: a new anchor, or a new kind of a live one (`anchor_placed`).
    Published as `anchors_kept` (the metric `vllm:mimo_anchors_kept_total`, replay JSON's
    `anchors.kept`), names kept for the dashboards and result files that read them."""
    anchors_evicted: Counter = field(default_factory=Counter)
    """Anchors evicted (budget or pool pressure), by kind."""
    evicted_blocks: list[int] = field(default_factory=lambda: [0, 0])
    """Cached blocks evicted, per pool (SWA, Full)."""
    peak_swa_blocks_per_request: int = 0
    """The most SWA blocks (all SWA groups) one running request held after an allocation,
    besides those kept only for anchor windows inside its chunk: its window, and with stock
    attention its whole prefill chunk."""
    peak_anchor_window_blocks_per_request: int = 0
    """The most SWA blocks one window-local allocation kept for anchor windows inside a chunk."""

    def admitted(self, request: CacheRequest, hit_tokens: int, path: Sequence[Node]) -> None:
        if request.num_preemptions:
            self.preempted_hit_tokens += hit_tokens
            return
        # A hit the host tier extended reaches past the device path `path`.
        full_tokens = max(len(path) * self.block_size, hit_tokens)
        self.prompt_tokens += request.num_prompt_tokens
        self.hit_tokens += hit_tokens
        self.full_cached_tokens += full_tokens
        self.pseudo_hit_tokens += full_tokens - hit_tokens
        self.recomputed_swa_tokens += full_tokens - hit_tokens

    def allocated(self, request: CacheRequest, swa_blocks: int, anchor_window_blocks: int) -> None:
        self.peak_swa_blocks_per_request = max(self.peak_swa_blocks_per_request, swa_blocks)
        self.peak_anchor_window_blocks_per_request = max(self.peak_anchor_window_blocks_per_request, anchor_window_blocks)

    def withdrawn(self, request: CacheRequest, positions: int) -> None:
        self.withdrawn_positions += positions

    def anchor_placed(self, anchor: Anchor, kind: AnchorKind) -> None:
        self.anchors_placed[kind.value] += 1

    def anchor_evicted(self, anchor: Anchor, cause: EvictionCause) -> None:
        for kind in anchor.kinds:
            self.anchors_evicted[kind.value] += 1

    def blocks_evicted(self, pool: Pool, count: int) -> None:
        self.evicted_blocks[pool] += count

"""The plugin's prefill per step when KV memory is short: the step cut
(`step_prefill_floor_tokens`) and the chunk cap (`prefill_chunk_tokens`).

vLLM's stock attention backends read a prefill chunk's keys back from the cache, so every
prefill token needs blocks of every KV group during its step. When memory is short, a step is
cut to its decode tokens plus the prefill the pools can take without evicting an anchor still
in the eviction order's live part, at one position's blocks of every group per position, but
never below the floor: fewer preemptions and lost anchors under pressure, no effect while
memory is ample. With window-local SWA attention a prefill token keeps no SWA blocks past its
step, yet the cut still counts them: they stand for the room the running requests' later
chunks and decodes take, which the cut does not reserve otherwise. Counting Full blocks alone
admitted prefill that the running set could not finish: 3-10x the preemptions and a higher
TTFT at tight budgets (eval/RESULTS.md, issue 19).

The chunk cap holds while the free lists cannot take a whole step's prefill (the token budget
at one position's blocks of every group), and is lifted while they can: then no allocation of
the step evicts anything, so a smaller chunk saves nothing and only spreads a prompt's prefill
over more steps. Over the replay suite lifting it so changed no hit token at any point and
lowered mean TTFT by up to 3% where memory is ample (eval/RESULTS.md, issue 18).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm_mimo.kv_cache.contract import KVCache


class StepBudget:
    """Cuts a step's token budget to what `cache` can take (`floor_tokens` 0: never) and
    decides the step's chunk cap (`chunk_tokens` 0: none); counts the steps it held back."""

    def __init__(self, cache: KVCache, floor_tokens: int, chunk_tokens: int = 0) -> None:
        self.cache = cache
        self.floor_tokens = floor_tokens
        self.chunk_tokens = chunk_tokens
        geometry = cache.geometry
        self._anchor_window_ids = geometry.swa_ids_per_position * cache.anchor_window_blocks
        self._ids_per_position = geometry.full_ids_per_position + geometry.swa_ids_per_position
        self.steps_cut = 0
        """Steps that scheduled all of a budget cut below the full one (so the cut held prefill back)."""

    def prefill_tokens(self) -> int:
        """An estimate of the prefill tokens one step can add without evicting an anchor that
        is not demoted: free blocks, Full blocks no running request holds (some lie under live
        anchors, so it errs high) and the windows of demoted anchors, at one position's blocks
        of every group per position of tokens (see the module docstring)."""
        info = self.cache.size_info()
        blocks = info.free + info.cached_full + info.demoted_anchors * self._anchor_window_ids
        return blocks * self.cache.geometry.block_size // self._ids_per_position

    def free_prefill_tokens(self) -> int:
        """The prefill tokens the free lists take, at one position's blocks of every group per
        position of tokens: what a step can prefill without evicting anything."""
        # size_info().free, without the rest of size_info: this runs every step.
        return self.cache.pools.num_free_total() * self.cache.geometry.block_size // self._ids_per_position

    def chunk_cap(self, token_budget: int) -> int:
        """The cap on one request's prefill chunk this step (0: none): `chunk_tokens` while
        `free_prefill_tokens()` is below `token_budget`, none while it is not (see the module
        docstring)."""
        if self.chunk_tokens and self.free_prefill_tokens() < token_budget:
            return self.chunk_tokens
        return 0

    def token_limit(self, running: Iterable[Any], token_budget: int) -> int:
        """A step's token budget: the decode tokens of the `running` requests plus
        `prefill_tokens()`, with at least `floor_tokens` for prefill, at most `token_budget`;
        `token_budget` itself when `floor_tokens` is 0."""
        # The free lists are part of prefill_tokens(): when they alone take the budget, the
        # rest of size_info need not be read (most steps while memory is ample).
        if not self.floor_tokens or self.free_prefill_tokens() >= token_budget:
            return token_budget
        prefill = max(self.floor_tokens, self.prefill_tokens())
        if prefill >= token_budget:  # memory is ample: no need to walk the running requests
            return token_budget
        decode = sum(
            1 + len(request.spec_token_ids)
            for request in running
            if request.num_computed_tokens >= request.num_prompt_tokens
        )
        return min(token_budget, decode + prefill)

    def record(self, limit: int, token_budget: int, scheduled_tokens: int) -> None:
        """Count a step that the cut held back: its limit was below the budget and it used it all."""
        if limit < token_budget and scheduled_tokens >= limit:
            self.steps_cut += 1

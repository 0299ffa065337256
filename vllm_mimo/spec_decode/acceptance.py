"""Speculative-decoding acceptance by draft position and by output bucket.

vLLM counts accepted draft tokens per draft position over a whole run; early decode, where
warming the drafter in prefill matters and where agentic outputs spend most of their tokens,
is invisible there. A target step that verifies drafts is counted in the bucket of the output
position it starts at (the request's output tokens before the step): `OUTPUT_BUCKETS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OUTPUT_BUCKETS: tuple[tuple[int, int | None], ...] = ((0, 128), (128, 256), (256, None))
"""Output-position buckets [lo, hi) of a target step, by where it starts; hi None: no end."""


def bucket_name(lo: int, hi: int | None) -> str:
    return f"{lo}-{hi}" if hi is not None else f"{lo}+"


def bucket_of(output_position: int) -> str:
    """The `OUTPUT_BUCKETS` name of a step starting after `output_position` output tokens."""
    for lo, hi in OUTPUT_BUCKETS:
        if output_position >= lo and (hi is None or output_position < hi):
            return bucket_name(lo, hi)
    raise ValueError(f"output position {output_position} < 0")


@dataclass
class BucketCounts:
    """Target steps that verified drafts, in one bucket."""

    drafts: int = 0
    """Steps (vLLM's `num_drafts`)."""
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """Steps whose draft token at position t (0-based) was accepted."""

    @property
    def mean_accepted_length(self) -> float:
        """Accepted draft tokens per step, plus the target's own token (vLLM's definition)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0


class AcceptanceByBucket:
    """Counts by `OUTPUT_BUCKETS`; the engine's scheduler feeds it every verified step."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.buckets = {
            bucket_name(lo, hi): BucketCounts(accepted_per_position=[0] * num_speculative_tokens)
            for lo, hi in OUTPUT_BUCKETS
        }

    def observe(self, output_position: int, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """A step that started after `output_position` output tokens verified drafts."""
        counts = self.buckets[bucket_of(output_position)]
        counts.drafts += 1
        counts.draft_tokens += num_draft_tokens
        counts.accepted_tokens += num_accepted_tokens
        for t in range(min(num_accepted_tokens, len(counts.accepted_per_position))):
            counts.accepted_per_position[t] += 1

    def snapshot(self) -> dict[str, dict]:
        return {
            name: {
                "drafts": c.drafts,
                "draft_tokens": c.draft_tokens,
                "accepted_tokens": c.accepted_tokens,
                "accepted_per_position": list(c.accepted_per_position),
                "mean_accepted_length": c.mean_accepted_length,
            }
            for name, c in self.buckets.items()
        }

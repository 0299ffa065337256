"""Where anchors go: every anchor kind is placed here, and nowhere else.

`AnchorPlacement` is the plugin's `base.AnchorPolicy`: the cache tells it what happened to a
request (a hit adopted, admitted, positions cached, finished, preempted), and `AnchorSet.apply`
carries out the `AnchorDecision`s it returns, in order:

  * admitted: a hot prefix where the request's cached prefix ends, once `hot_prefix_min_hits`
    distinct requests stopped there; the positions the request declares
    (`SamplingParams.extra_args["mimo"]`, `declared_anchors`); where its prompt ends (the
    longest hit a resend of the same prompt can take). Positions not in the tree yet fall due
    when they are cached.
  * cached: a branch point where a node gets its second child; declared and prompt ends that
    fall due; a grid point every `grid_anchor_tokens` of the prompt, the last one before the
    prompt's end a prompt tail (where a request sharing the prompt branches off while this
    one runs).
  * a hit adopted: a passed anchor (`PASSED_KINDS`) where a session goes on from it, with
    nothing past it in the tree, is demoted: it has done its job.
  * finished: the end of its output (the next turn's prefix); its prompt's end, when only a
    prompt end, is demoted (the next turn goes on from the output).
  * preempted: where its computed KV ends (it resumes there, first in line).

It also learns, per kind, the share of speculative anchors that serve a hit (`usefulness`); a
new speculative anchor starts demoted (`starts_demoted`: kept when memory is plentiful, first to
go when it is not) when the hit tokens it is expected to make hittable, its share times the
positions it reaches back (`reach`), are fewer than `USEFUL_SHARE` of a grid interval's. So an
output end of a long conversation whose next turns seldom come back still starts live, a grid
point of a kind that seldom serves does not, nor does the output end of a short conversation.
An anchor demoted at birth is often evicted before its request comes, which would keep the
share low however useful the kind is, so the node keys of the latest `ghost_capacity`
speculative anchors evicted before serving are
remembered, and a later request whose prompt passes one of them past its hit counts as the
serve it missed.

What an anchor is worth per block it keeps (`worth`, which orders the anchors' GREEDY_DUAL state): the
tokens a hit at it reaches beyond the live anchor above it on its path (what it alone makes
hittable; a demoted anchor above goes first, so it does not count), times the share of its
kind that serves, per block of its window and of that Full KV. A grid point between two
anchors is worth little; the last anchor of a long conversation is worth more; so a grid thins
out where branches are rare. The look-back is capped (`WORTH_REACH`) except from the anchors
a next turn goes on from: from an output end without a cap (a session's next turn goes on from
its whole conversation, and whether it comes back is what the share says), from a prompt tail
up to `TAIL_REACH`. For a prompt tail the share is learned per depth band (`depth_band`): on
agentic traffic a long prompt is often a tool loop whose next turn comes within seconds, a
short one a conversation's last turn, and one share for both ranked them alike; an uncapped
reach from tails kept the tails of ended conversations over everything (measured in
eval/RESULTS.md, issue 18). A band's share counts only its tails that stayed live until they
served or went: a tail demoted before it serves (at birth, its band's share being low) is the
first anchor to go, so that it seldom serves says nothing of the band, and counted, it kept a
band that fell under the bar there for good. Its serve, where it makes one, still counts, and
every `TAIL_EXPLORE_EVERY`-th tail of a band starts live whatever the share, so a band whose
next turns come back again learns it (measured in eval/notes/branch-points.md, issue 56).

Every `chunk_every`-th grid point of a prompt is a chunk point (`chunk_point`; config
`chunk_anchor_tokens`), as SGLang keeps the SWA windows at its prefill chunks' ends for as long
as their Full KV: a request that forks deep in a long prompt, after the grid windows there went,
hits back to the last chunk point instead of to the live anchor far above. A chunk point learns
its own share, reaches back its whole depth (what a fork below it saves: the grid windows above
start demoted), and does not keep its Full KV (`keeps_full`): its node stays in the Full
eviction order, least recently used first, and its window goes with its Full KV. So it costs its
window alone, and is worth per block of that: it starts live where forks come and outlives the
demoted grid windows around it while its prompt's Full KV stays. (Kept past its Full KV, chunk
points held the Full KV of ended conversations: measured in eval/notes/branch-points.md, issue 56.)
"""

from __future__ import annotations

import json
import math
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from vllm_mimo.kv_cache.anchors import PASSED_KINDS, SPECULATIVE_KINDS, AnchorDecision
from vllm_mimo.kv_cache.contract import AnchorPolicy, CacheRequest, EvictionCause
from vllm_mimo.kv_cache.node import Anchor, AnchorKind, Node

WORTH_REACH = 64
"""Positions `AnchorPlacement.worth` looks back for the anchor above, from any anchor but an
output end or a prompt tail. 64 (1,024 tokens at 16-token blocks) was measured against 128 and
256: eval/RESULTS.md, issue 18."""

TAIL_REACH = 160
"""Positions `AnchorPlacement.worth` looks back from a prompt tail (not an output end too).
160 was measured against 64, 256 and no cap: eval/RESULTS.md, issue 18."""

BAND_PRIOR = 8.0
"""A prompt tail's share per depth band starts from its kind's share, as this many observations
(measured against 2 and 32: eval/RESULTS.md, issue 18)."""

TAIL_EXPLORE_EVERY = 32
"""Every this many prompt tails of a depth band, one starts live whatever the band's share (see
the module docstring); every 8th cost the agent sessions up to 3.5% (eval/notes/branch-points.md,
issue 56)."""

USEFUL_SHARE = 0.25
"""A new speculative anchor starts demoted when its kind's share of anchors that served a hit
(or would have: see the module docstring) times its `reach` is below this share of a grid
interval (`WORTH_REACH` positions without a grid): for a grid point, a share below this.
Measured against the old rule (a share below this, whatever the reach) on the public trace
slice and the suite: eval/RESULTS.md, issue 42."""


_NONE: tuple[AnchorDecision, ...] = ()


def depth_band(depth: int) -> int:
    """The depth band of a node at `depth` (0 for the first position): positions up to it
    within a factor of the square root of 2."""
    return int(2 * math.log2(depth + 1))


class AnchorHintError(ValueError):
    """A request's `extra_args["mimo"]` anchor hints are malformed."""


def mimo_hints(extra_args: dict | None) -> dict | None:
    """`extra_args["mimo"]`: an object, or its JSON text (what an HTTP request's `vllm_xargs`,
    whose values are strings or numbers, can carry)."""
    hints = (extra_args or {}).get("mimo")
    if isinstance(hints, str):
        try:
            hints = json.loads(hints)
        except ValueError as e:
            raise AnchorHintError(f'extra_args["mimo"] is a string but not JSON ({e}): {hints!r}') from None
    return hints


HINT_KINDS = {
    "anchors": AnchorKind.DECLARED,
    "system_prompt": AnchorKind.SYSTEM_PROMPT,
    "cache_control": AnchorKind.CACHE_CONTROL,
    "pinned_prompt": AnchorKind.PINNED_PROMPT,
}
"""The position lists of `extra_args["mimo"]` and the anchor kind each gives: `anchors` is the
user's; the chat APIs fill `system_prompt` and `cache_control`, pinned prompts `pinned_prompt`
(their anchors are pinned). A position in several counts as the first of them here."""


def declared_kinds(extra_args: dict | None) -> tuple[dict[int, AnchorKind], bool]:
    """Token positions with their kinds (`HINT_KINDS`), and the pin flag, from
    `SamplingParams.extra_args["mimo"]` (`mimo_hints`), validated."""
    hints = mimo_hints(extra_args)
    if hints is None:
        return {}, False
    if not isinstance(hints, dict):
        raise AnchorHintError(f'extra_args["mimo"] must be an object, got {hints!r}')
    unknown = set(hints) - {*HINT_KINDS, "pin"}
    if unknown:
        raise AnchorHintError(
            f'unknown keys {sorted(unknown)} in extra_args["mimo"]; allowed: {", ".join([*HINT_KINDS, "pin"])}'
        )
    kinds: dict[int, AnchorKind] = {}
    for key, kind in reversed(HINT_KINDS.items()):
        positions = hints.get(key, [])
        if not isinstance(positions, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in positions
        ):
            raise AnchorHintError(
                f'extra_args["mimo"]["{key}"] must be a list of positive token positions, got {positions!r}'
            )
        kinds.update(dict.fromkeys(positions, kind))
    pin = hints.get("pin", False)
    if not isinstance(pin, bool):
        raise AnchorHintError(f'extra_args["mimo"]["pin"] must be true or false, got {pin!r}')
    return kinds, pin


def declared_anchors(extra_args: dict | None) -> tuple[list[int], bool]:
    """Token positions (sorted) and pin flag from `SamplingParams.extra_args["mimo"]`, validated."""
    kinds, pin = declared_kinds(extra_args)
    return sorted(kinds), pin


class AnchorPlacement(AnchorPolicy):
    """Anchor decisions per request event, and what each kind is worth (see the module
    docstring). It observes the cache for what it learns: anchors placed and evicted."""

    def __init__(
        self,
        block_size: int,
        grid_tokens: int,
        hot_prefix_min_hits: int,
        ghost_capacity: int,
        window_cost: int = 1,
        full_blocks_per_position: int = 1,
        chunk_every: int = 0,
    ) -> None:
        self.block_size = block_size
        self.window_cost = window_cost
        self.full_blocks_per_position = full_blocks_per_position
        self.grid_blocks = grid_tokens // block_size
        self.chunk_blocks = chunk_every * self.grid_blocks  # 0: no chunk points
        self.hot_prefix_min_hits = hot_prefix_min_hits
        self.ghost_capacity = ghost_capacity
        self.created: Counter[AnchorKind] = Counter()
        self.served: Counter[AnchorKind] = Counter()
        # Per depth band: new prompt tails, those of them (and kinds added to live anchors) that
        # are its share's evidence (not demoted before they served), and tails that served.
        self._tails_placed: Counter[int] = Counter()
        self._tails_live: Counter[int] = Counter()
        self._tails_served: Counter[int] = Counter()
        # Chunk points placed and served (a share apart from the other grid points').
        self._chunks = Counter({"created": 0, "served": 0})
        # Node key of a speculative anchor evicted before it served -> its kinds.
        self._ghosts: OrderedDict[Any, frozenset[AnchorKind]] = OrderedDict()
        # Per running request: anchors due when caching reaches these position counts.
        self._due: dict[str, dict[int, tuple[AnchorKind, bool]]] = {}

    # ------------------------------------------------------------- learning

    def chunk_point(self, kind: AnchorKind, depth: int) -> bool:
        """Whether an anchor of `kind` at `depth` is a chunk point (see the module docstring)."""
        return kind is AnchorKind.GRID and bool(self.chunk_blocks) and (depth + 1) % self.chunk_blocks == 0

    def usefulness(self, kind: AnchorKind, depth: int | None = None) -> float:
        """Share of this kind's anchors that served a hit so far, or would have had they not
        been evicted (1/2 before any evidence); for a prompt tail at `depth`, the share of those
        in its `depth_band` that stayed live (the module docstring), starting from the kind's
        (`BAND_PRIOR`); for a chunk point, the
        share of chunk points."""
        if depth is not None and self.chunk_point(kind, depth):
            return (self._chunks["served"] + 1) / (self._chunks["created"] + 2)
        share = (self.served[kind] + 1) / (self.created[kind] + 2)
        if depth is None or kind is not AnchorKind.PROMPT_TAIL:
            return share
        band = depth_band(depth)
        return (self._tails_served[band] + BAND_PRIOR * share) / (self._tails_live[band] + BAND_PRIOR)

    def _count_served(self, kinds: Iterable[AnchorKind], depth: int) -> None:
        self.served.update(kinds)
        if AnchorKind.PROMPT_TAIL in kinds:
            self._tails_served[depth_band(depth)] += 1
        if AnchorKind.GRID in kinds and self.chunk_point(AnchorKind.GRID, depth):
            self._chunks["served"] += 1

    def reach(self, kind: AnchorKind, depth: int) -> int:
        """Positions an anchor of `kind` at `depth` is expected to make hittable at most: from
        an output end and a chunk point its whole prefix, from a prompt tail up to `TAIL_REACH`,
        from a grid point its grid interval, from the others up to `WORTH_REACH`."""
        if kind is AnchorKind.OUTPUT_END or self.chunk_point(kind, depth):
            return depth + 1
        cap = {AnchorKind.PROMPT_TAIL: TAIL_REACH, AnchorKind.GRID: self.grid_blocks or WORTH_REACH}
        return min(depth + 1, cap.get(kind, WORTH_REACH))

    def starts_demoted(self, anchor: Anchor, kind: AnchorKind) -> bool:
        if kind not in SPECULATIVE_KINDS:
            return False
        depth = anchor.node.depth
        if kind is AnchorKind.PROMPT_TAIL and self._tails_placed[depth_band(depth)] % TAIL_EXPLORE_EVERY == 0:
            return False
        return self.usefulness(kind, depth) * self.reach(kind, depth) < USEFUL_SHARE * (self.grid_blocks or WORTH_REACH)

    def worth(self, anchor: Anchor) -> float:
        """Hit tokens per block kept (see the module docstring): a speculative kind's
        `usefulness`, the others 1, times the tokens between the live (not demoted) anchor
        above (looking back at most `WORTH_REACH` positions, `TAIL_REACH` from a prompt tail,
        without a cap from an output end or a chunk point) and this one, per block of window and
        Full KV there (of its window alone where it does not keep its Full KV: `keeps_full`)."""
        depth = anchor.node.depth
        share = max(self.usefulness(kind, depth) if kind in SPECULATIVE_KINDS else 1.0 for kind in anchor.kinds)
        chunk = self.chunk_point(AnchorKind.GRID, depth) and AnchorKind.GRID in anchor.kinds
        if AnchorKind.OUTPUT_END in anchor.kinds or chunk:
            reach = depth + 1
        else:
            reach = TAIL_REACH if AnchorKind.PROMPT_TAIL in anchor.kinds else WORTH_REACH
        node, gain = anchor.node, 0
        while gain < reach:
            node = node.parent  # type: ignore[assignment]
            gain += 1
            if node.depth < 0 or (node.anchor is not None and not node.anchor.demoted):
                break
        if not self.keeps_full(anchor):
            return share * gain * self.block_size / self.window_cost
        return share * gain * self.block_size / (self.window_cost + self.full_blocks_per_position * gain)

    def keeps_full(self, anchor: Anchor) -> bool:
        """Every anchor keeps its node's Full KV but a chunk point's (see the module docstring)."""
        return not (anchor.kinds == {AnchorKind.GRID} and self.chunk_point(AnchorKind.GRID, anchor.node.depth))

    def anchor_placed(self, anchor: Anchor, kind: AnchorKind) -> None:
        self.created[kind] += 1
        if kind is AnchorKind.PROMPT_TAIL:
            band = depth_band(anchor.node.depth)
            self._tails_live[band] += 1  # until `anchor_demoted` says otherwise
            if anchor.kinds == {kind}:  # a new anchor, not a kind added to a live one
                self._tails_placed[band] += 1
        if self.chunk_point(kind, anchor.node.depth):
            self._chunks["created"] += 1

    def anchor_demoted(self, anchor: Anchor) -> None:
        if AnchorKind.PROMPT_TAIL in anchor.kinds and not anchor.served:
            self._tails_live[depth_band(anchor.node.depth)] -= 1

    def anchor_evicted(self, anchor: Anchor, cause: EvictionCause) -> None:
        kinds = anchor.kinds & SPECULATIVE_KINDS
        if kinds and not anchor.served and self.ghost_capacity:
            key = anchor.node.block_hash
            self._ghosts[key] = frozenset(kinds)
            self._ghosts.move_to_end(key)
            if len(self._ghosts) > self.ghost_capacity:
                self._ghosts.popitem(last=False)

    def _credit_missed_serve(self, keys: Sequence[Any], start: int, end: int) -> None:
        """A new request could hit up to position `end` but hits only `start`: the deepest
        remembered evicted anchor in between would have served it."""
        for pos in range(min(end, len(keys)) - 1, start - 1, -1):
            kinds = self._ghosts.pop(keys[pos], None)
            if kinds is not None:
                self._count_served(kinds, pos)
                return

    # ------------------------------------------------------------ decisions

    def keep(self, decisions: list[AnchorDecision]) -> Sequence[AnchorDecision]:
        """The decisions of a request event that are carried out: all of them (a policy that
        places fewer anchors, eval's clairvoyant bound, overrides it)."""
        return decisions

    def _ends(self, request: CacheRequest) -> dict[int, tuple[AnchorKind, bool]]:
        """Anchors a request asks for by where they end (position counts): its declared
        positions and its prompt's end, with their kind and pin flag."""
        kinds, pinned = declared_kinds(getattr(request.sampling_params, "extra_args", None))
        ends = {
            p // self.block_size: (kind, pinned or kind is AnchorKind.PINNED_PROMPT)
            for p, kind in sorted(kinds.items())
            if p // self.block_size
        }
        prompt_blocks = (request.num_prompt_tokens - 1) // self.block_size
        if prompt_blocks:
            ends.setdefault(prompt_blocks, (AnchorKind.PROMPT_END, False))
        return ends

    def _grid_points(self, request: CacheRequest, start: int, end: int) -> range | tuple[()]:
        """Grid points (position counts) caching positions `start`..`end` of the request
        passes: every `grid_anchor_tokens` of its prompt."""
        grid = self.grid_blocks
        if not grid:
            return ()
        prompt_blocks = (request.num_prompt_tokens - 1) // self.block_size
        return range(-(-(start + 1) // grid) * grid, min(end, prompt_blocks) + 1, grid)

    def window_points(self, request: CacheRequest, start: int, end: int, junction: int, branched: Sequence[int]) -> set[int]:
        """Positions in `start`..`end` (exclusive) where this policy may place an anchor while
        the request computes them: its grid points and asked-for ends, `junction` (where its
        cached prefix ends, a hot prefix once enough requests stop there; -1 for none), and
        the nodes before `branched` positions (see `on_cached`). A superset of what
        `on_admitted` and `on_cached` place there; a window-local cache keeps the SWA KV of
        the windows ending at these positions, which it does not keep for other positions a
        prefill chunk passes."""
        points = {p - 1 for p in self._grid_points(request, start, end)}
        points.update(p - 1 for p in self._ends(request) if start < p <= end)
        points.update(p - 1 for p in branched)
        if start <= junction < end:
            points.add(junction)
        return {p for p in points if start <= p < end}

    def on_hit(self, anchor: Anchor, goes_on: bool) -> Sequence[AnchorDecision]:
        if not anchor.served:
            self._count_served(anchor.kinds, anchor.node.depth)
        if goes_on and anchor.kinds <= PASSED_KINDS:
            return (AnchorDecision(anchor.node, demote=True),)
        return _NONE

    def on_admitted(
        self, request: CacheRequest, keys: Sequence[Any], nodes: Sequence[Node], hit_tokens: int
    ) -> Sequence[AnchorDecision]:
        bs = self.block_size
        prompt_blocks = (request.num_prompt_tokens - 1) // bs
        decisions = []
        due: dict[int, tuple[AnchorKind, bool]] = {}
        # In the hit an anchor is placed now; in a pseudo hit (no SWA KV yet) it falls due as
        # the request recomputes it. A host extension's positions may lie past `nodes`.
        hit = min(hit_tokens // bs, len(nodes))
        if request.num_preemptions == 0:
            if self._ghosts:
                self._credit_missed_serve(keys, hit_tokens // bs, prompt_blocks)
            if nodes:
                # Where this request's cached prefix ends is where it leaves what others
                # computed: a junction. Count the distinct requests that stop at it.
                junction = nodes[-1]
                junction.hit_count += 1
                if junction.hit_count >= self.hot_prefix_min_hits:
                    if len(nodes) <= hit:
                        decisions.append(AnchorDecision(junction, AnchorKind.HOT))
                    else:
                        due[len(nodes)] = (AnchorKind.HOT, False)
        for end, (kind, pin) in self._ends(request).items():
            if end <= hit:
                decisions.append(AnchorDecision(nodes[end - 1], kind, pin))
            else:
                due[end] = (kind, pin)
        if due:
            self._due[request.request_id] = due
        return self.keep(decisions)

    def on_cached(
        self, request: CacheRequest, nodes: Sequence[Node], start: int, end: int, branched: Sequence[int]
    ) -> Sequence[AnchorDecision]:
        due = self._due.get(request.request_id)
        grid = self.grid_blocks
        prompt_blocks = (request.num_prompt_tokens - 1) // self.block_size
        grid_points = self._grid_points(request, start, end)
        if not (due or grid_points or branched):
            return _NONE
        branch_at = set(branched)
        decisions = []
        for pos in sorted({*branched, *(p - 1 for p in grid_points), *(p - 1 for p in (due or ()) if start < p <= end)}):
            node = nodes[pos]
            if pos in branch_at:
                decisions.append(AnchorDecision(node.parent, AnchorKind.BRANCH))  # type: ignore[arg-type]
            fell_due = due.pop(pos + 1, None) if due else None
            if fell_due is not None:
                decisions.append(AnchorDecision(node, *fell_due))
            if grid and (pos + 1) % grid == 0 and pos < prompt_blocks and (node.anchor is None or fell_due is not None):
                # A prompt end on the grid is a grid point too, so it is not demoted as a mere
                # prompt end when the output moves on: later requests may branch there.
                last = fell_due is None and (pos + 1) + grid >= prompt_blocks
                decisions.append(AnchorDecision(node, AnchorKind.PROMPT_TAIL if last else AnchorKind.GRID))
        return self.keep(decisions)

    def on_finished(self, request: CacheRequest, nodes: Sequence[Node], num_cached: int) -> Sequence[AnchorDecision]:
        self._due.pop(request.request_id, None)
        if not num_cached:
            return _NONE
        end = nodes[num_cached - 1]
        decisions = [AnchorDecision(end, AnchorKind.OUTPUT_END)]
        prompt_blocks = min((request.num_prompt_tokens - 1) // self.block_size, num_cached)
        prompt_end = nodes[prompt_blocks - 1] if prompt_blocks else end
        if prompt_end is not end and prompt_end.anchor is not None and prompt_end.anchor.kinds == {AnchorKind.PROMPT_END}:
            # The next turn continues from the output's end; the prompt's end now only serves a
            # retry of the same prompt, so it goes first when memory is short.
            decisions.append(AnchorDecision(prompt_end, demote=True))
        return self.keep(decisions)

    def on_preempted(self, request: CacheRequest, nodes: Sequence[Node], num_cached: int) -> Sequence[AnchorDecision]:
        """It comes back first in line and resumes from its cached KV, as upstream's freed blocks
        stay cached. The anchor ends where the computed tokens do (the window before that is
        still held): positions cached for this step's tokens are not computed if the request is
        preempted within the step."""
        self._due.pop(request.request_id, None)
        computed = min(num_cached, request.num_computed_tokens // self.block_size)
        if not computed:
            return _NONE
        return self.keep([AnchorDecision(nodes[computed - 1], AnchorKind.RESUME)])

    def check_integrity(self, running: Sequence[str]) -> None:
        assert len(self._ghosts) <= self.ghost_capacity, "more evicted anchors remembered than allowed"
        assert set(self._due) <= set(running), "anchors due for a request that is not running"

"""A position of the prefix tree (`Node`) and what hangs on it: the SWA anchor ending there
(`Anchor`, of its kinds and in its state), and the host tier's copies of it (`HostSlot`, with
the host anchor ending there, `HostAnchor`).

Why one module: a node and what hangs on it name each other (`Node.anchor` is an `Anchor`,
whose `node` is that node), so their types live together, and the modules that use them
(`prefix_tree`, `anchors`, `tiers.host`) import them from here, below all of them. What a node
means and how the tree keeps it is `prefix_tree`'s docstring; the anchors' states and order,
`anchors`'; the host's copies, `tiers.host`'s.
"""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import Any

Blocks = tuple[int, ...]
"""The block ids of one position in one pool (one or more per group)."""


class Node:
    """One block position in the tree (see `prefix_tree`'s module docstring)."""

    __slots__ = (
        "block_hash",
        "parent",
        "depth",
        "children",
        "full_blocks",
        "swa_blocks",
        "full_refs",
        "swa_refs",
        "full_children",
        "anchor_refs",
        "anchor",
        "last_access",
        "hit_count",
        "host",
    )

    def __init__(self, block_hash: Any, parent: Node | None, depth: int) -> None:
        self.block_hash = block_hash
        self.parent = parent
        self.depth = depth  # position in the sequence; the root is -1
        self.children: dict[Any, Node] = {}
        self.full_blocks: Blocks | None = None
        self.swa_blocks: Blocks | None = None
        self.full_refs = 0
        self.swa_refs = 0
        self.full_children = 0  # children whose full_blocks are resident
        self.anchor_refs = 0
        self.anchor: Anchor | None = None  # the anchor ending at this node, if any
        self.last_access = 0  # the cache's tick of the latest request that referenced it
        self.hit_count = 0  # distinct requests whose cached prefix ended here
        self.host: HostSlot | None = None  # the host tier's copies of this node, if any

    def __repr__(self) -> str:
        return (
            f"Node(depth={self.depth}, full={self.full_blocks}, swa={self.swa_blocks}, "
            f"refs={self.full_refs}/{self.swa_refs}, anchor_refs={self.anchor_refs})"
        )


class AnchorKind(str, Enum):  # noqa: UP042
    DECLARED = "declared"  # SamplingParams.extra_args["mimo"]["anchors"] (vllm_xargs over HTTP)
    SYSTEM_PROMPT = "system_prompt"  # the end of a chat request's system message (system_prompt_anchor)
    CACHE_CONTROL = "cache_control"  # the end of a chat content block marked cache_control
    PINNED_PROMPT = "pinned_prompt"  # the end of a prompt of pin_prompts_file, pinned at startup
    HOT = "hot"  # a node reused by at least `hot_prefix_min_hits` distinct requests
    BRANCH = "branch"  # a node with two or more children: a shared-prefix junction
    PROMPT_END = "prompt_end"  # where a request's prompt ends
    OUTPUT_END = "output_end"  # where a finished request's output ends (the next turn's prefix)
    GRID = "grid"  # every `grid_anchor_tokens` of a prompt, where a later request may branch off
    PROMPT_TAIL = "prompt_tail"  # the last grid point before a prompt's end
    RESUME = "resume"  # where a preempted request's cached KV ends; it resumes there


class AnchorState(IntEnum):
    """Where a live anchor stands. Each state has one queue, oldest first.

    DEMOTED_UNSERVED, DEMOTED_SERVED: no longer needed (a session went on from it) or of a kind
        that seldom serves, and it never served a hit / it did (a junction requests came back
        to, where another may fork). The latest demoted is at the front.
    GREEDY_DUAL: live, least worth first: GreedyDual's order. An anchor's priority is the clock when
        it was last used (created, hit or released by its last holder) plus its worth per block
        (`AnchorSet`'s `worth`). The clock is the larger of two: GreedyDual's inflation, which
        rises to each evicted anchor's priority, and time: the worth of every anchor use so far
        over the mean number of anchor uses between an anchor's last use and a hit at it
        (`AnchorSet.reuse_gap`, learned as hits come). When evictions are frequent,
        inflation drives the clock and worth decides; when they are rare, time drives it, and
        an anchor worth the mean outlives one worth nothing by about one reuse gap. So an
        anchor worth little per block goes before one worth more that was used as long ago,
        and recency still wins in the end (with equal worths this is least recently used).
    PINNED: pinned (declared with `pin`, or a prompt pinned at startup); a demoted pinned
        anchor goes to the front of this queue.
    HELD: a shared anchor whose node a running request holds (see the module docstring).
    """

    DEMOTED_UNSERVED = 0
    DEMOTED_SERVED = 1
    GREEDY_DUAL = 2
    PINNED = 3
    HELD = 4


DEMOTED_STATES = (AnchorState.DEMOTED_UNSERVED, AnchorState.DEMOTED_SERVED)
"""The states of an anchor no longer needed (`Anchor.demoted`)."""


class Anchor:
    """An anchor of `kind` ending at `node`, covering the `window_blocks` nodes up to it."""

    __slots__ = ("node", "window", "kinds", "state", "served", "priority", "entry", "keeps_full")

    def __init__(self, node: Node, kind: AnchorKind, window_blocks: int) -> None:
        self.node = node
        self.window: list[Node] = []
        covered = node
        while covered.depth >= 0 and len(self.window) < window_blocks:
            covered.anchor_refs += 1
            self.window.append(covered)
            covered = covered.parent  # type: ignore[assignment]
        node.anchor = self
        self.kinds = {kind}
        self.state = AnchorState.GREEDY_DUAL  # set by AnchorSet.add
        self.served = False  # whether a hit has ended at it
        self.priority = 0.0  # in the GREEDY_DUAL state: the clock when last used plus its worth per block
        self.entry = 0  # when it was last used in the GREEDY_DUAL state (anchor uses), its GREEDY_DUAL heap entry
        # Whether its node's Full KV stays while it lives (the policy's `keeps_full`); if not,
        # the node stays in the Full eviction order and the anchor goes with its Full KV.
        self.keeps_full = True

    def uncover(self) -> list[Node]:
        """The anchor goes: its node and window are no longer its; returns the window (the
        tree frees the SWA blocks nothing keeps, `PrefixTree.drop_window`)."""
        self.node.anchor = None
        for covered in self.window:
            covered.anchor_refs -= 1
        return self.window

    @property
    def pinned(self) -> bool:
        return self.state is AnchorState.PINNED

    @property
    def demoted(self) -> bool:
        return self.state in DEMOTED_STATES

    def __repr__(self) -> str:
        kinds = ",".join(sorted(k.value for k in self.kinds))
        return f"Anchor(depth={self.node.depth}, {kinds}, {self.state.name})"


class HostAnchor:
    """A demoted anchor: its node and the window of nodes whose host SWA copies it keeps."""

    __slots__ = ("node", "window", "tick")

    def __init__(self, node: Node, window: list[Node], tick: int) -> None:
        self.node = node
        self.window = window
        self.tick = tick

    def __repr__(self) -> str:
        return f"HostAnchor(depth={self.node.depth}, tick={self.tick})"


class HostSlot:
    """The host's copies of one node: `full` / `swa` pages (or None), `children` with a host
    Full copy, `swa_refs` host anchors whose window covers it, the host `anchor` ending here.
    A node has one (`Node.host`) exactly while `full` or `swa` is set, so the tree keeps the
    node (`PrefixTree.prune`) while the host holds anything of it.

    Why a slot on the node and not a dict keyed by node: the host's walks (`extend`, `demote`)
    run per lookup and per eviction, and one attribute read is cheaper than a hash lookup; the
    device-only cache pays one field per node."""

    __slots__ = ("full", "swa", "children", "swa_refs", "anchor")

    def __init__(self) -> None:
        self.full: Blocks | None = None
        self.swa: Blocks | None = None
        self.children = 0
        self.swa_refs = 0
        self.anchor: HostAnchor | None = None

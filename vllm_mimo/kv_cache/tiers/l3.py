"""The shared third tier (L3) as the host tier sees it: a store outside this engine (Mooncake
Store in the engine, `vllm_mimo.offload.mooncake_store`; a simulated one in eval's cluster
replay) that holds host pages under names every instance computes alike.

The host tier (`host_tier.HostTier`) demotes to L3 what the host evicts: the Full pages of the
evicted anchor's path that nothing else on the host needs, and the SWA pages of its window
only. A lookup whose Full KV runs past the device and the host asks L3 (`contains`) for the Full
pages of the positions after them and for the SWA pages of the window before the hit's end; such
a hit is loaded through host pages of its own (`LoadPlan.fetches`), then as a host load. The
data moves in the worker (`vllm_mimo.offload.connector`); the scheduler only names it here.

One object per page: `key(kind, index, block_hash)` names the page `index` (0.. the pages a
position's copy of `kind` takes, "full" or "swa") of the position whose chained block hash is
`block_hash`. Equal keys must mean equal bytes, so a key also names what else decides them
(model, KV layout, tensor-parallel rank).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol


class L3Index(Protocol):
    """The scheduler's side of the shared store."""

    def key(self, kind: str, index: int, block_hash: Any) -> Hashable:
        """The store's name of one page of one position's copy (see the module docstring)."""
        ...

    def contains(self, keys: Sequence[Hashable]) -> list[bool]:
        """Which of `keys` the store holds now (it evicts on its own: a later read may still
        miss, and then the load fails and the request recomputes)."""
        ...

    def put(self, keys: Sequence[Hashable]) -> None:
        """The host demoted these pages (their bytes are copied by the worker this step)."""
        ...

    def got(self, keys: Sequence[Hashable]) -> None:
        """A planned load reads these pages."""
        ...

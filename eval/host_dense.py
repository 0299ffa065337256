"""`DenseHostTier`: the host tier keeping every stored position's SWA KV (`eval.replay`'s
`mimo-host-dense` engine).

What a tier that stores SWA tails whole would hold: the comparison that shows what the plugin's
mask-only tier (`vllm_mimo.kv_cache.tiers.host`) buys. A replay engine only: the device no
longer has the SWA KV of positions behind a window, so its bytes are counted as if written when
computed. Its one rule in place of the mask-only tier's: a host SWA copy is kept while the
node's host Full copy is kept (no host anchor covers a window here, so the tier's own rule frees
an SWA copy with its node's Full copy).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_mimo.kv_cache.node import HostSlot, Node
from vllm_mimo.kv_cache.tiers.host import HostTier
from vllm_mimo.kv_cache.tiers.host_copies import host_swa


class DenseHostTier(HostTier):
    """`HostTier` with every stored position's SWA KV (see the module docstring)."""

    def swa_to_store(self, path: list[Node], window: Sequence[Node]) -> list[Node]:
        return [n for n in path if host_swa(n) is None]

    def cover(self, window: Sequence[Node]) -> None:
        """Host anchors keep no SWA copies here: their Full copies do."""

    def uncover(self, window: Sequence[Node]) -> None:
        """Host anchors keep no SWA copies here: their Full copies do."""

    def check_swa(self, node: Node, s: HostSlot | None, covering: int) -> None:
        if s is not None:
            assert (s.swa is not None) == (s.full is not None), node

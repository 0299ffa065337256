"""Find the hybrid sliding-window layout of a model: which layers are full, which are SWA.

Two views of the same question:
  * `layout_from_hf_config` reads the model's config the way vLLM's model code does (used in the
    front-end process to decide whether to install the plugin's scheduler);
  * `layout_from_kv_cache_groups` reads the KV cache groups vLLM actually built (used in the
    engine process, and the final word: any model whose groups mix full and SWA specs counts).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm_mimo.kv_cache.geometry import KVGeometry, UnsupportedKVLayout

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class HybridLayout:
    """Which decoder layers use full attention and which a sliding window of `window` tokens."""

    source: str
    full_layers: tuple[int, ...]
    swa_layers: tuple[int, ...]
    window: int
    mtp_layers: int = 0
    """MTP layers in the checkpoint (`num_nextn_predict_layers`)."""
    draft_layers: int = 0
    """MTP layers vLLM actually runs as a speculative draft (KV cache groups only)."""

    def describe(self) -> str:
        return (
            f"{len(self.full_layers)} full + {len(self.swa_layers)} SWA layers, "
            f"window {self.window}, {self.mtp_layers} MTP layers in the checkpoint "
            f"({self.draft_layers} running as draft) (from {self.source})"
        )


def _text_config(hf_config: Any) -> Any:
    get_text = getattr(hf_config, "get_text_config", None)
    return get_text() if callable(get_text) else hf_config


def _split(kinds: Iterable[bool]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(full layer indices, SWA layer indices) from per-layer "is SWA" flags."""
    kinds = list(kinds)
    return (
        tuple(i for i, swa in enumerate(kinds) if not swa),
        tuple(i for i, swa in enumerate(kinds) if swa),
    )


def layout_from_hf_config(hf_config: Any) -> HybridLayout | None:
    """The hybrid layout vLLM's model code will build from this config, or None if not hybrid."""
    cfg = _text_config(hf_config)
    model_type = getattr(cfg, "model_type", "")
    mtp = int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)
    if getattr(cfg, "hybrid_layer_pattern", None) is not None:
        # MiMo-V2 family (mimo_v2.py): pattern[i] == 1 means SWA, window `sliding_window_size`.
        pattern = list(cfg.hybrid_layer_pattern)[: cfg.num_hidden_layers]
        window = int(getattr(cfg, "sliding_window_size", -1) or -1)
        full, swa = _split(p == 1 for p in pattern)
        source = "hybrid_layer_pattern"
    elif model_type == "gpt_oss":
        # gpt_oss.py ignores layer_types: even layers slide over `sliding_window`.
        window = int(getattr(cfg, "sliding_window", 0) or 0)
        full, swa = _split(i % 2 == 0 for i in range(cfg.num_hidden_layers))
        source = "gpt_oss"
    elif getattr(cfg, "layer_types", None) is not None:
        # Gemma 3 and every transformers config that lists per-layer attention kinds.
        window = int(getattr(cfg, "sliding_window", 0) or 0)
        types = list(cfg.layer_types)[: cfg.num_hidden_layers]
        full, swa = _split(t == "sliding_attention" for t in types)
        source = "layer_types"
    else:
        return None
    if window <= 0 or not full or not swa:
        return None
    return HybridLayout(source, full, swa, window, mtp)


def _layer_specs(group: Any) -> Iterable[tuple[str, Any]]:
    """(layer name, spec) for each layer of a KV cache group, unpacking uniform-type groups."""
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)
    if isinstance(per_layer, dict):
        yield from per_layer.items()
    else:
        for name in group.layer_names:
            yield name, spec


def layout_from_kv_cache_groups(
    kv_cache_groups: Iterable[Any], mtp_layers: int = 0
) -> HybridLayout | None:
    """The layout in vLLM's KV cache groups, or None unless they mix full and SWA specs.

    Draft (MTP) layers are named `...mtp.layers.N...` and are not counted as decoder layers.
    """
    from vllm_mimo.compat import FullAttentionSpec, RSWASpec, SlidingWindowSpec

    full: set[int] = set()
    swa: set[int] = set()
    windows: set[int] = set()
    draft: set[str] = set()
    for group in kv_cache_groups:
        for name, spec in _layer_specs(group):
            match = _LAYER_INDEX.search(name)
            if "mtp" in name:
                draft.add(name)
                continue
            if match is None:
                continue
            if isinstance(spec, SlidingWindowSpec):
                swa.add(int(match.group(1)))
                windows.add(spec.sliding_window)
            elif isinstance(spec, FullAttentionSpec) and not (
                RSWASpec is not None and isinstance(spec, RSWASpec)
            ):
                full.add(int(match.group(1)))
    if not full or not swa:
        return None
    return HybridLayout(
        "kv_cache_groups",
        tuple(sorted(full)),
        tuple(sorted(swa)),
        max(windows),
        mtp_layers,
        len(draft),
    )


def kv_geometry(kv_cache_config: Any) -> KVGeometry:
    """The hybrid KV cache's geometry of vLLM's `KVCacheConfig`: plain Full and sliding-window
    groups only (`UnsupportedKVLayout` otherwise)."""
    from vllm_mimo.compat import FullAttentionSpec, SlidingWindowSpec

    full: list[int] = []
    swa: list[int] = []
    windows: set[int] = set()
    block_sizes: list[int] = []
    if getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
        raise UnsupportedKVLayout(
            "this KV cache needs new blocks zeroed (mixed-precision pages); the hybrid KV "
            "manager does not zero blocks"
        )
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if type(spec) is SlidingWindowSpec:
            swa.append(gid)
            windows.add(spec.sliding_window)
        elif type(spec) is FullAttentionSpec:
            full.append(gid)
        else:
            raise UnsupportedKVLayout(
                f"KV cache group {gid} has a {type(spec).__name__}; the hybrid KV manager "
                "handles only plain full-attention and sliding-window groups"
            )
        block_sizes.append(spec.block_size)
    if not full or not swa:
        raise UnsupportedKVLayout(
            f"the hybrid KV manager needs Full and SWA groups, got {len(full)} Full and "
            f"{len(swa)} SWA groups"
        )
    return KVGeometry(
        block_size=math.lcm(*block_sizes),
        num_blocks=kv_cache_config.num_blocks,
        window=max(windows),
        full_group_ids=tuple(full),
        swa_group_ids=tuple(swa),
        group_block_sizes=tuple(block_sizes),
    )

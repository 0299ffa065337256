"""The hybrid KV manager's counters, from the engine process to `/metrics` and to `LLM()` users.

The manager lives in the engine-core process; `/metrics` is served by the front-end process
that started it. The engine's scheduler writes a small JSON snapshot (atomically, a few times
a second and whenever it goes idle; `vllm_mimo.engine.publisher`) to a file named after the
front-end's pid, and:

  * `vllm serve`: a Prometheus collector registered in the front-end turns the snapshot into
    `vllm:mimo_*` metrics on `/metrics` (counters also get vLLM's `_total` suffix);
  * `LLM()`: `vllm_mimo.metrics.kv_manager_metrics()` returns the snapshot as a dict; with
    `LLM(..., disable_log_stats=False)` the same numbers also appear in `llm.get_metrics()`.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile

# Set by the process that builds the engine's config (the front end) and inherited by the
# engine and API-server processes it starts, so writer and readers agree on the file name.
FRONTEND_PID_ENV = "_VLLM_MIMO_FRONTEND_PID"


def frontend_pid() -> int:
    return int(os.environ.get(FRONTEND_PID_ENV) or os.getpid())


def mark_frontend() -> None:
    """Called where the engine's config is built: this process is the engine's front end."""
    os.environ.setdefault(FRONTEND_PID_ENV, str(os.getpid()))


def snapshot_path(engine_index: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"vllm-mimo-{frontend_pid()}-engine{engine_index}.json")


def read_snapshots() -> list[dict]:
    """Snapshots of the engines this process's front end started, by engine index. A file older
    than the front end is a dead process's whose pid was reused (an engine that crashed or was
    killed leaves its snapshot behind): ignored."""
    import psutil

    pattern = snapshot_path(0).replace("engine0.json", "engine*.json")
    try:
        born = psutil.Process(frontend_pid()).create_time()
    except psutil.Error:
        return []
    out = []
    for path in sorted(glob.glob(pattern)):
        try:
            if os.path.getmtime(path) < born:
                continue
            with open(path) as f:
                out.append(json.load(f))
        except (OSError, json.JSONDecodeError):
            continue  # replaced or removed while reading: the next scrape sees it
    return out


def kv_manager_metrics() -> dict:
    """The hybrid KV manager's counters for the engine `LLM()` started in this process."""
    snapshots = read_snapshots()
    if not snapshots:
        raise RuntimeError(
            "no vllm-mimo KV manager runs under this process: is the model a hybrid "
            "sliding-window model, the plugin on and the engine started from this process?"
        )
    return snapshots[0]


_COUNTERS = {
    "prompt_tokens": "Prompt tokens of requests admitted by the vllm-mimo KV manager.",
    "window_safe_hit_tokens": "Prompt tokens served from cache in every layer (window-safe hits).",
    "full_cached_tokens": "Prompt tokens the Full-attention index held at admission.",
    "pseudo_hit_tokens": "Full-cached prompt tokens recomputed because their SWA window was missing.",
    "recomputed_swa_tokens": "Tokens whose SWA KV was recomputed while the Full layers had them.",
    "preempted_hit_tokens": "Hits of requests re-admitted after preemption (not in window_safe_hit_tokens).",
    "prefill_steps_cut": "Steps whose prefill was held back to what the KV pools could take.",
    "integrity_checks": "KV manager integrity checks at idle (check_integrity_at_idle).",
    "integrity_violations": "KV manager integrity checks at idle that found a violation (logged).",
    "withdrawn_positions": "Cached positions of requests preempted within their step, never computed, taken out of the cache.",
}
_SPEC_COUNTERS = {
    "drafts": "Target steps that verified drafts, by output bucket (where the step starts).",
    "draft_tokens": "Draft tokens verified, by output bucket.",
    "accepted_tokens": "Draft tokens accepted, by output bucket.",
}
_POOL_GAUGES = {
    "blocks": "KV blocks whose home is this pool.",
    "used_blocks": "KV blocks this pool holds (running requests and cache).",
    "peak_blocks": "Most KV blocks this pool has held.",
}
_POOL_COUNTERS = {
    "borrowed_blocks": "Free blocks this pool borrowed from the other pool.",
    "evicted_blocks": "Cached blocks evicted from this pool.",
}

_HOST_METRICS = (  # (snapshot key, help, counter or gauge): set in _host_families
    ("hit_tokens", "Prompt tokens of hits loaded from the host tier.", "counter"),
    ("loads", "Host tier loads (requests).", "counter"),
    ("failed_loads", "Host tier loads that failed (their requests recomputed).", "counter"),
    ("failed_stores", "Steps whose copies to the host tier failed (never loaded).", "counter"),
    ("evicted_anchors", "Anchors the host tier evicted to make room.", "counter"),
    ("stored_anchors", "SWA anchors demoted from device to the host tier.", "counter"),
    ("skipped_stores", "Anchors dropped because the host tier could not take them.", "counter"),
    ("load_seconds", "Seconds the workers spent loading from the host tier.", "counter"),
    ("swapped_out_tokens", "Tokens up to preempted requests' resume points demoted to the host tier.", "counter"),
    ("swapped_in_tokens", "Tokens of preempted requests' hits loaded from the host tier.", "counter"),
    ("pages", "Host tier pages (each one device block of one KV cache group's layers).", "gauge"),
    ("used_pages", "Host tier pages in use.", "gauge"),
    ("l3_hit_tokens", "Prompt tokens of hits loaded from L3 (part of host_hit_tokens).", "counter"),
    ("l3_put_bytes", "Bytes the host tier demoted to L3.", "counter"),
    ("l3_fetched_bytes", "Bytes read from L3 for loads.", "counter"),
    ("l3_failed_fetches", "Loads whose reads from L3 missed or came back short (recomputed).", "counter"),
    ("l3_failed_puts", "Host pages not put to L3 (a failed store's page, or the store refused it).", "counter"),
    ("l3_short_loads", "Loads from L3 the host had no free pages for (recomputed).", "counter"),
    ("l3_on", "1 while the L3 tier is on (the store reached at startup, its master up now).", "gauge"),
    ("l3_outages", "Times a worker found the L3 store's master down (the L3 tier off until it was back).", "counter"),
)


class MimoCollector:
    """Prometheus collector: the engines' snapshots as `vllm:mimo_*` metrics."""

    def collect(self):
        snapshots = read_snapshots()
        yield from _cache_families(snapshots)
        yield from _spec_decode_families([s for s in snapshots if s.get("spec_decode")])
        yield from _host_families([s for s in snapshots if s.get("host_tier")])
        yield from _pool_families(snapshots)


def _family(kind: str, name: str, doc: str, extra: tuple[str, ...] = ()):
    """An empty `vllm:mimo_{name}` family of `kind` ("counter" or "gauge"), labelled by model,
    engine and `extra`."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return cls(f"vllm:mimo_{name}", doc, labels=["model_name", "engine", *extra])


def _engine(snapshot: dict) -> list[str]:
    """The model and engine labels of one engine's snapshot."""
    return [snapshot["model_name"], str(snapshot["engine"])]


def _cache_families(snapshots: list[dict]):
    """The KV manager's counters and gauges, and its anchors by kind."""
    for name, doc in _COUNTERS.items():
        fam = _family("counter", name, doc)
        for s in snapshots:
            fam.add_metric(_engine(s), s[name])
        yield fam
    for name, doc in (("anchors_kept", "SWA anchors created, by kind."),
                      ("anchors_evicted", "SWA anchors evicted, by kind.")):
        fam = _family("counter", name, doc, ("kind",))
        for s in snapshots:
            for kind, value in s[name].items():
                fam.add_metric([*_engine(s), kind], value)
        yield fam
    for name, doc in (("anchors", "Live SWA anchors."),
                      ("held_blocks", "KV blocks running requests hold (0 when idle)."),
                      ("anchor_blocks", "SWA blocks kept only by anchors."),
                      ("peak_swa_blocks_per_request", "Most SWA blocks one running request held, "
                       "besides windows kept for anchors inside its prefill chunk."),
                      ("peak_anchor_window_blocks_per_request", "Most SWA blocks one allocation kept "
                       "for windows of anchors inside a prefill chunk (window-local SWA attention).")):
        fam = _family("gauge", name, doc)
        for s in snapshots:
            fam.add_metric(_engine(s), s[name])
        yield fam


def _spec_decode_families(with_spec: list[dict]):
    """MTP acceptance by output bucket (and draft position), from engines that draft."""
    if not with_spec:
        return
    for name, doc in _SPEC_COUNTERS.items():
        fam = _family("counter", f"spec_decode_{name}", doc, ("bucket",))
        for s in with_spec:
            for bucket, values in s["spec_decode"].items():
                fam.add_metric([*_engine(s), bucket], values[name])
        yield fam
    fam = _family(
        "counter",
        "spec_decode_accepted_tokens_per_pos",
        "Steps whose draft token at this position was accepted, by output bucket.",
        ("bucket", "position"),
    )
    for s in with_spec:
        for bucket, values in s["spec_decode"].items():
            for pos, n in enumerate(values["accepted_per_position"]):
                fam.add_metric([*_engine(s), bucket, str(pos)], n)
    yield fam
    fam = _family(
        "gauge",
        "spec_decode_mean_accepted_length",
        "Tokens per verified step (accepted drafts + 1), by output bucket.",
        ("bucket",),
    )
    for s in with_spec:
        for bucket, values in s["spec_decode"].items():
            fam.add_metric([*_engine(s), bucket], values["mean_accepted_length"])
    yield fam


def _host_families(with_host: list[dict]):
    """The host tier's (and L3's) counters and gauges, from engines with one."""
    if not with_host:
        return
    for name, doc, kind in _HOST_METRICS:
        fam = _family(kind, f"host_{name}", doc)
        for s in with_host:
            fam.add_metric(_engine(s), s["host_tier"][name])
        yield fam
    for name, doc in (("stored_bytes", "Bytes copied to the host tier, by pool."),
                      ("loaded_bytes", "Bytes loaded from the host tier, by pool.")):
        fam = _family("counter", f"host_{name}", doc, ("pool",))
        for s in with_host:
            for pool, value in s["host_tier"][name].items():
                fam.add_metric([*_engine(s), pool], value)
        yield fam


def _pool_families(snapshots: list[dict]):
    """Each pool's gauges and counters."""
    for table, kind in ((_POOL_GAUGES, "gauge"), (_POOL_COUNTERS, "counter")):
        for name, doc in table.items():
            fam = _family(kind, f"pool_{name}", doc, ("pool",))
            for s in snapshots:
                for pool, values in s["pools"].items():
                    fam.add_metric([*_engine(s), pool], values[name])
            yield fam


_collector: MimoCollector | None = None


def register_collector() -> None:
    """Add the collector to prometheus_client's default registry (once per process)."""
    global _collector
    if _collector is not None:
        return
    from prometheus_client import REGISTRY

    _collector = MimoCollector()
    REGISTRY.register(_collector)

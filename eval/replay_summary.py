"""Summarize `eval.replay` JSON files as one Markdown table: the plugin against upstream.

    python -m eval.replay_summary eval/results/replay-*.json
    python -m eval.replay_summary --host eval/results/host-*[!x].json

Per (source, budget): ideal hit tokens, upstream's default (retention 0), the best upstream
setting, swa-free, the plugin, and the ratios the issue asks about: plugin / upstream default,
plugin / best upstream, plugin / swa-free, pseudo hits as a share of the plugin's hits, mean
simulated time to first token (plugin / upstream default), manager CPU microseconds per call
(plugin / upstream default); and, where the file has the plugin on vLLM's stock attention
backends (`mimo-stock-attention`), the plugin's hits and mean TTFT over that, and the peak SWA
blocks one request held (plugin / stock attention).

`--host`: the files of `eval/run_replay_suite.sh --host`, each with its `-swa-free-5x.json`
beside it. Per (source, budget): the host memory, the ideal, the plugin without a host tier,
with its host tier (`mimo-host`), storing SWA tails whole (`mimo-host-dense`), vLLM's
`OffloadingConnector` (`upstream-offload`); the host tier over the other two; the host tier's
and `swa-free`'s (at device + host bytes) fractions of the ideal; SWA tokens stored per anchor;
bytes loaded per restored token and mean TTFT (host tier / upstream-offload).

`--peers`: the plugin against both peers, per (source, budget) of each file and the
`-sglang.json` that `eval/run_replay_suite.sh` writes beside it: the best upstream setting,
SGLang as it ships at each ratio and with its unified pool (and its best without the
waiting-prefix refresh), `swa-free`, the plugin, its ratios to the best of each peer and to
`swa-free`, and whether the point meets issue 42's targets (>= both peers' best, and >= 0.8 of
`swa-free` where `swa-free` reaches half the ideal).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

UPSTREAM = ("upstream-r0", "upstream-dense", "upstream-r512")
SGLANG = ("sglang-r0.8", "sglang-r0.2", "sglang-r0.05", "sglang-unified")
"""SGLang as it ships (waiting-prefix refresh on): its best of these is the peer's best."""
SGLANG_NOREFRESH = ("sglang-r0.05-norefresh", "sglang-unified-norefresh")
FREE_SHARE = 0.8
"""The plugin's target share of `swa-free`, where `swa-free` reaches half the ideal."""


def summary_rows(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    source = Path(data["source"]).stem
    by_budget: dict[float, dict[str, dict]] = {}
    for run in data["runs"]:
        by_budget.setdefault(run["kv_gib"], {})[run["engine"]] = run
    rows = []
    for gib in sorted(by_budget):
        runs = by_budget[gib]
        if "mimo" not in runs:
            continue
        mimo, r0, free = runs["mimo"], runs.get("upstream-r0"), runs.get("swa-free")
        stock = runs.get("mimo-stock-attention")
        best_name = max((e for e in UPSTREAM if e in runs), key=lambda e: runs[e]["hit_tokens"])
        best = runs[best_name]

        def ratio(a: float, b: float | None) -> str:
            return f"{a / b:.2f}" if b else "-"

        rows.append(
            f"| {source} | {gib:g} | {mimo['ideal_hit_tokens']:,} | {r0['hit_tokens']:,} | "
            f"{best['hit_tokens']:,} ({best_name.removeprefix('upstream-')}) | {free['hit_tokens']:,} | "
            f"{mimo['hit_tokens']:,} | {ratio(mimo['hit_tokens'], r0['hit_tokens'])} | "
            f"{ratio(mimo['hit_tokens'], best['hit_tokens'])} | {ratio(mimo['hit_tokens'], free['hit_tokens'])} | "
            f"{100 * mimo['pseudo_hit_tokens'] / max(mimo['hit_tokens'], 1):.1f}% | "
            f"{mimo['ttft_mean_s']:.2f} / {r0['ttft_mean_s']:.2f} | "
            f"{mimo['mean_us_per_call']:.0f} / {r0['mean_us_per_call']:.0f} | "
            + (
                f"{ratio(mimo['hit_tokens'], stock['hit_tokens'])} | {ratio(mimo['ttft_mean_s'], stock['ttft_mean_s'])} | "
                f"{mimo['peak_swa_blocks_per_request']:,} / {stock['peak_swa_blocks_per_request']:,} |"
                if stock else "- | - | - |"
            )
        )
    return rows


def host_rows(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    source = Path(data["source"]).stem
    reference = json.loads(path.with_name(path.stem + "-swa-free-5x.json").read_text())
    free = {run["kv_gib"]: run for run in reference["runs"]}
    by_budget: dict[float, dict[str, dict]] = {}
    for run in data["runs"]:
        by_budget.setdefault(run["kv_gib"], {})[run["engine"]] = run
    rows = []
    for gib in sorted(by_budget):
        runs = by_budget[gib]
        mimo, host, dense, offload = (runs[e] for e in ("mimo", "mimo-host", "mimo-host-dense", "upstream-offload"))
        ideal = host["ideal_hit_tokens"]
        reference_run = free[round(5 * gib, 6)]
        rows.append(
            f"| {source} | {gib:g} | {host['host_gib']:g} | {ideal:,} | {mimo['hit_tokens']:,} | {host['hit_tokens']:,} | "
            f"{dense['hit_tokens']:,} | {offload['hit_tokens']:,} | {host['hit_tokens'] / max(offload['hit_tokens'], 1):.3f} | "
            f"{host['hit_tokens'] / max(dense['hit_tokens'], 1):.3f} | {host['hit_tokens'] / ideal:.3f} | "
            f"{reference_run['hit_tokens'] / ideal:.3f} | {host['host_swa_tokens_per_anchor']:.0f} / {dense['host_swa_tokens_per_anchor']:.0f} | "
            f"{host['bytes_loaded_per_restored_token'] / 1024:.0f} / {offload['bytes_loaded_per_restored_token'] / 1024:.0f} | "
            f"{host['ttft_mean_s']:.2f} / {offload['ttft_mean_s']:.2f} / {mimo['ttft_mean_s']:.2f} |"
        )
    return rows


def _runs_by_budget(path: Path) -> dict[float, dict[str, dict]]:
    by_budget: dict[float, dict[str, dict]] = {}
    for run in json.loads(path.read_text())["runs"]:
        by_budget.setdefault(run["kv_gib"], {})[run["engine"]] = run
    return by_budget


def peer_rows(path: Path) -> list[str]:
    """One row per budget of `path` (a plugin-side replay file) with its `-sglang.json`."""
    source = Path(json.loads(path.read_text())["source"]).stem
    ours = _runs_by_budget(path)
    sglang_path = path.with_name(path.stem + "-sglang.json")
    theirs = _runs_by_budget(sglang_path) if sglang_path.exists() else {}
    rows = []
    for gib in sorted(ours):
        runs = {**theirs.get(gib, {}), **ours[gib]}
        if "mimo" not in runs:
            continue
        mimo, free = runs["mimo"], runs.get("swa-free")
        hits = {engine: run["hit_tokens"] for engine, run in runs.items()}
        best_up = max((e for e in UPSTREAM if e in hits), key=hits.__getitem__, default=None)
        best_sg = max((e for e in SGLANG if e in hits), key=hits.__getitem__, default=None)

        def cell(engine: str) -> str:
            return f"{hits[engine]:,}" if engine in hits else "-"

        def ratio(engine: str | None) -> str:
            return f"{mimo['hit_tokens'] / hits[engine]:.2f}" if engine and hits[engine] else "-"

        ideal = mimo["ideal_hit_tokens"]
        free_counts = free is not None and free["hit_tokens"] >= ideal / 2
        met = all(
            [
                best_up is None or mimo["hit_tokens"] >= hits[best_up],
                best_sg is None or mimo["hit_tokens"] >= hits[best_sg],
                not free_counts or mimo["hit_tokens"] >= FREE_SHARE * free["hit_tokens"],
            ]
        )
        sg_ttft = f"{runs[best_sg]['ttft_mean_s']:.2f}" if best_sg else "-"
        rows.append(
            f"| {source} | {gib:g} | {ideal:,} | "
            + (f"{hits[best_up]:,} ({best_up.removeprefix('upstream-')}) | " if best_up else "- | ")
            + " | ".join(cell(e) for e in SGLANG)
            + f" | {' / '.join(cell(e) for e in SGLANG_NOREFRESH)} | {cell('swa-free')} | {mimo['hit_tokens']:,} | "
            f"{ratio(best_up)} | {ratio(best_sg)} | {ratio('swa-free' if free else None)} | "
            f"{free['hit_tokens'] / ideal:.2f} | " if free else "- | "
        )
        rows[-1] += f"{mimo['ttft_mean_s']:.2f} / {sg_ttft} | {'yes' if met else '**no**'} |"
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.replay_summary", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="JSON files written by `eval.replay --json`")
    parser.add_argument("--host", action="store_true", help="the host tier's table (files of `eval/run_replay_suite.sh --host`)")
    parser.add_argument(
        "--peers", action="store_true",
        help="the plugin against the best upstream setting, SGLang (each file's -sglang.json beside it) and swa-free",
    )
    args = parser.parse_args(argv)
    if args.host and args.peers:
        parser.error("--host and --peers are different tables: give one")
    if args.peers:
        print(
            "| workload | KV GiB | ideal | best upstream | SGLang r0.8 | SGLang r0.2 | SGLang r0.05 | SGLang unified | "
            "SGLang r0.05 / unified, refresh off | swa-free | plugin | ÷ best upstream | ÷ SGLang best | ÷ swa-free | "
            "swa-free ÷ ideal | TTFT s (plugin / SGLang best) | targets met |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for path in args.files:
            if path.stem.endswith("-sglang"):
                continue
            for row in peer_rows(path):
                print(row)
        return 0
    if args.host:
        print(
            "| workload | KV GiB | host GiB | ideal | plugin | host tier | host tier, dense SWA | upstream-offload | "
            "÷ upstream-offload | ÷ dense | host tier ÷ ideal | swa-free (device + host) ÷ ideal | "
            "SWA tokens per stored anchor (mask-only / dense) | KiB loaded per restored token (host tier / "
            "upstream-offload) | TTFT s (host tier / upstream-offload / plugin) |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for path in args.files:
            for row in host_rows(path):
                print(row)
        return 0
    print(
        "| workload | KV GiB | ideal | upstream r0 | best upstream | swa-free | plugin | ÷ r0 | "
        "÷ best upstream | ÷ swa-free | pseudo / hits | TTFT s (plugin / r0) | µs per call (plugin / r0) | "
        "hits ÷ stock attention | TTFT ÷ stock attention | SWA blocks per request (plugin / stock attention) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for path in args.files:
        for row in summary_rows(path):
            print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Summarize `eval.replay` JSON files as one Markdown table: the plugin against upstream.

    python -m eval.replay_summary eval/results/replay-*.json

Per (source, budget): ideal hit tokens, upstream's default (retention 0), the best upstream
setting, swa-free, the plugin, and the ratios the issue asks about: plugin / upstream default,
plugin / best upstream, plugin / swa-free, pseudo hits as a share of the plugin's hits, mean
simulated time to first token (plugin / upstream default), manager CPU microseconds per call
(plugin / upstream default); and, where the file has the plugin on vLLM's stock attention
backends (`mimo-stock-attention`), the plugin's hits and mean TTFT over that, and the peak SWA
blocks one request held (plugin / stock attention).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

UPSTREAM = ("upstream-r0", "upstream-dense", "upstream-r512")


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.replay_summary", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="JSON files written by `eval.replay --json`")
    args = parser.parse_args(argv)
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

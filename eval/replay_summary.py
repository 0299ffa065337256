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

`--peers`: the plugin against both peers, per (source, budget) of each file, with the
`-sglang.json` that `eval/run_replay_suite.sh` writes beside it and a `-mimo.json` (the plugin's
rows rerun alone, which replace the file's own) merged over it: the best upstream setting,
SGLang as it ships at each ratio and with its unified pool (and its best without the
waiting-prefix refresh), `swa-free`, the plugin, its ratios to the best of each peer and to
`swa-free`, and whether the point meets issue 42's targets (>= both peers' best, and >= 0.8 of
`swa-free` where `swa-free` reaches half the ideal).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

UPSTREAM = ("upstream-r0", "upstream-dense", "upstream-r512")
SGLANG = ("sglang-r0.8", "sglang-r0.2", "sglang-r0.05", "sglang-unified")
"""SGLang as it ships (waiting-prefix refresh on): its best of these is the peer's best."""
SGLANG_NOREFRESH = ("sglang-r0.05-norefresh", "sglang-unified-norefresh")
FREE_SHARE = 0.8
"""The plugin's target share of `swa-free`, where `swa-free` reaches half the ideal."""


def runs_by_budget(*paths: Path) -> dict[float, dict[str, dict]]:
    """The runs of `paths` by budget and engine, read in order: a later file's run replaces an
    earlier one's with the same (kv_gib, engine), so a rerun of one engine overrides its rows."""
    by_budget: dict[float, dict[str, dict]] = {}
    for path in paths:
        for run in json.loads(path.read_text())["runs"]:
            by_budget.setdefault(run["kv_gib"], {})[run["engine"]] = run
    return by_budget


def summary_rows(path: Path) -> list[str]:
    source = Path(json.loads(path.read_text())["source"]).stem
    by_budget = runs_by_budget(path)
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
    source = Path(json.loads(path.read_text())["source"]).stem
    reference = json.loads(path.with_name(path.stem + "-swa-free-5x.json").read_text())
    free = {run["kv_gib"]: run for run in reference["runs"]}
    by_budget = runs_by_budget(path)
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
            f"{reference_run['hit_tokens'] / ideal:.3f} | "
            f"{host['host_swa_tokens_per_anchor']:.0f} / {dense['host_swa_tokens_per_anchor']:.0f} | "
            f"{host['bytes_loaded_per_restored_token'] / 1024:.0f} / {offload['bytes_loaded_per_restored_token'] / 1024:.0f} | "
            f"{host['ttft_mean_s']:.2f} / {offload['ttft_mean_s']:.2f} / {mimo['ttft_mean_s']:.2f} |"
        )
    return rows


def peer_files(path: Path) -> list[Path]:
    """`path` (a plugin-side replay file) and the files merged over it, in merge order: its
    `-sglang.json` (SGLang's engines) and its `-mimo.json` (a rerun of the plugin's rows alone,
    which replaces the plugin's rows of `path`), where they exist."""
    beside = [path.with_name(f"{path.stem}-{suffix}.json") for suffix in ("sglang", "mimo")]
    return [path, *(p for p in beside if p.exists())]


@dataclass(frozen=True)
class PeerPoint:
    """One (source, budget) of the plugin against upstream, SGLang and `swa-free`."""

    source: str
    stretch: float
    kv_gib: float
    ideal: int
    plugin: dict
    hits: dict[str, int]
    """Hit tokens of every engine run at this point."""
    best_upstream: str | None
    best_sglang: str | None
    free: dict | None
    runs: dict[str, dict]
    """Every engine's run at this point, the merged files' included."""

    def over(self, engine: str | None) -> float | None:
        """The plugin's hit tokens over `engine`'s, None where it did not run or hit nothing."""
        return self.plugin["hit_tokens"] / self.hits[engine] if engine and self.hits.get(engine) else None

    @property
    def free_counts(self) -> bool:
        """Whether issue 42's share-of-`swa-free` target applies: `swa-free` reaches half the ideal."""
        return self.free is not None and self.free["hit_tokens"] >= self.ideal / 2

    @property
    def met(self) -> bool:
        """Issue 42's targets: >= both peers' best, and >= 0.8 of `swa-free` where it counts."""
        mine = self.plugin["hit_tokens"]
        return all(
            [
                self.best_upstream is None or mine >= self.hits[self.best_upstream],
                self.best_sglang is None or mine >= self.hits[self.best_sglang],
                not self.free_counts or mine >= FREE_SHARE * self.free["hit_tokens"],
            ]
        )


def peer_points(path: Path, runs: dict[float, dict[str, dict]] | None = None) -> list[PeerPoint]:
    """One point per budget of `path` where the plugin ran, with the files of `peer_files` merged
    (or `runs`, already merged)."""
    data = json.loads(path.read_text())
    source, stretch = Path(data["source"]).stem, data.get("stretch", 1.0)
    runs = runs if runs is not None else runs_by_budget(*peer_files(path))
    points = []
    for gib in sorted(runs):
        at = runs[gib]
        if "mimo" not in at:
            continue
        hits = {engine: run["hit_tokens"] for engine, run in at.items()}
        points.append(
            PeerPoint(
                source=source,
                stretch=stretch,
                kv_gib=gib,
                ideal=at["mimo"]["ideal_hit_tokens"],
                plugin=at["mimo"],
                hits=hits,
                best_upstream=max((e for e in UPSTREAM if e in hits), key=hits.__getitem__, default=None),
                best_sglang=max((e for e in SGLANG if e in hits), key=hits.__getitem__, default=None),
                free=at.get("swa-free"),
                runs=at,
            )
        )
    return points


def peer_rows(path: Path) -> list[str]:
    """One row per budget of `path` (a plugin-side replay file) with the files of `peer_files`."""
    rows = []
    for point in peer_points(path):
        hits, at = point.hits, point.runs

        def cell(engine: str, hits: dict[str, int] = hits) -> str:
            return f"{hits[engine]:,}" if engine in hits else "-"

        def ratio(engine: str | None, point: PeerPoint = point) -> str:
            value = point.over(engine)
            return f"{value:.2f}" if value is not None else "-"

        up, sg, free = point.best_upstream, point.best_sglang, point.free
        rows.append(
            f"| {point.source} | {point.kv_gib:g} | {point.ideal:,} | "
            + (f"{hits[up]:,} ({up.removeprefix('upstream-')}) | " if up else "- | ")
            + " | ".join(cell(e) for e in SGLANG)
            + f" | {' / '.join(cell(e) for e in SGLANG_NOREFRESH)} | {cell('swa-free')} | {point.plugin['hit_tokens']:,} | "
            f"{ratio(up)} | {ratio(sg)} | {ratio('swa-free' if free else None)} | "
            + (f"{free['hit_tokens'] / point.ideal:.2f} | " if free else "- | ")
            + f"{point.plugin['ttft_mean_s']:.2f} / "
            + (f"{at[sg]['ttft_mean_s']:.2f}" if sg else "-")
            + f" | {'yes' if point.met else '**no**'} |"
        )
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
            if path.stem.endswith(("-sglang", "-mimo")):
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

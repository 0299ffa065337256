"""Served side by side: `vllm serve` with the plugin on and off, the same chat workload, the same KV bytes.

    python -m eval.bench_serve --workload NAME [--model DIR] [--kv-gib G] [--clients N]
        [--duration S] [--host-gib H] [--json OUT]

With `--host-gib H` the two sides are the plugin without and with an H GiB host tier
(`host_tier_gib`), on the same device KV bytes.

Each side starts its own `vllm serve` on 127.0.0.1 and replays the same seeded chat sessions
(`eval.workloads.chat_sessions`) through `/v1/chat/completions` with streaming, at most
`--clients` requests in flight; a session's next turn carries the answer the server actually
generated. No new turn starts after `--duration` seconds. Reported per side, from vLLM's own
`/metrics` and the clients' clocks: prompt tokens computed (prompt tokens minus prefix-cache
hits, local and from a host tier), hit tokens, pseudo-hit tokens (the plugin's counter; upstream
exposes no Full-vs-SWA split, so null there), time to first token p50/p90, and output tokens per second; plus the
on/off ratios, how many turns got the same answer on both sides, and one answer from each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eval.workloads import WORKLOADS, ChatSession, chat_sessions

GIB = 1 << 30


@dataclass
class SideResult:
    prompt_tokens: int
    hit_tokens: int
    prompt_tokens_computed: int
    pseudo_hit_tokens: int | None
    ttft_p50_s: float
    ttft_p90_s: float
    output_tokens_per_s: float
    requests: int
    output_tokens: int
    wall_s: float


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[k]


async def _drive(
    url: str, model: str, sessions: list[ChatSession], clients: int, duration_s: float, progress
) -> tuple[list[float], int, float, dict]:
    """Replay the sessions; return TTFTs, output tokens, wall time and the answers by (session, turn)."""
    import httpx

    limit = asyncio.Semaphore(clients)
    ttfts: list[float] = []
    answers: dict[tuple[int, int], str] = {}
    output_tokens = 0
    t0 = time.monotonic()

    async def turn(client, messages: list[dict], max_tokens: int) -> str:
        nonlocal output_tokens
        async with limit:
            start = time.monotonic()
            first, text = None, []
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        output_tokens += chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        delta = choice.get("delta", {}).get("content")
                        if delta:
                            if first is None:
                                first = time.monotonic() - start
                            text.append(delta)
            ttfts.append(first if first is not None else time.monotonic() - start)
            progress.update(1)
            return "".join(text)

    async def session(client, index: int, s: ChatSession) -> None:
        await asyncio.sleep(max(0.0, s.start_s - (time.monotonic() - t0)))
        messages = [{"role": "system", "content": s.system}]
        for turn_index, (user, max_tokens) in enumerate(s.turns):
            if time.monotonic() - t0 > duration_s:
                progress.update(1)
                continue
            messages.append({"role": "user", "content": user})
            answer = answers[index, turn_index] = await turn(client, messages, max_tokens)
            messages.append({"role": "assistant", "content": answer})

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(session(client, i, s) for i, s in enumerate(sessions)))
    return ttfts, output_tokens, time.monotonic() - t0, answers


SIDES = {"off": "plugin off", "on": "plugin on", "host": "host tier"}


def run_side(
    side: str,
    model: str,
    kv_bytes: int,
    block_size: int,
    dtype: str,
    sessions: list[ChatSession],
    clients: int,
    duration_s: float,
    host_gib: float = 0.0,
) -> tuple[SideResult, dict]:
    """One side's results ("off", "on", or "host": the plugin with a `host_gib` host tier), and
    its answers by (session, turn)."""
    from tqdm import tqdm

    from vllm_mimo.testing.server import VllmServer

    env = {"VLLM_MIMO_ENABLE": "0" if side == "off" else "1"}
    host = ("--additional-config", json.dumps({"mimo": {"host_tier_gib": host_gib}})) if side == "host" else ()
    server = VllmServer(model, "--enforce-eager", "--max-model-len", "4096", "--kv-cache-memory-bytes",
                        str(kv_bytes), "--block-size", str(block_size), "--dtype", dtype, "--served-model-name", "bench",
                        *host, env=env)
    print(f"[bench_serve] {SIDES[side]}: starting vllm serve (about 30 s) ...", file=sys.stderr, flush=True)
    with server:
        before = server.metrics()
        total = sum(len(s.turns) for s in sessions)
        with tqdm(total=total, desc=SIDES[side], unit="turn", file=sys.stderr) as progress:
            ttfts, out_tokens, wall, answers = asyncio.run(_drive(server.url, "bench", sessions, clients, duration_s, progress))
        time.sleep(1.0)  # let the engine publish its last counters
        after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompt = int(delta("vllm:prompt_tokens_total"))
    hits = int(delta("vllm:prefix_cache_hits_total") + delta("vllm:external_prefix_cache_hits_total"))
    return SideResult(
        prompt_tokens=prompt,
        hit_tokens=hits,
        prompt_tokens_computed=prompt - hits,
        pseudo_hit_tokens=int(delta("vllm:mimo_pseudo_hit_tokens_total")) if side != "off" else None,
        ttft_p50_s=_percentile(ttfts, 0.5),
        ttft_p90_s=_percentile(ttfts, 0.9),
        output_tokens_per_s=out_tokens / wall if wall else 0.0,
        requests=len(ttfts),
        output_tokens=out_tokens,
        wall_s=wall,
    ), answers


def print_table(on: SideResult, off: SideResult, ratios: dict, names: tuple[str, str] = ("plugin off", "plugin on")) -> None:
    """`off`: the reference side, `on`: the side measured; `names` in that order."""
    rows = [
        ("requests", off.requests, on.requests, None),
        ("prompt tokens", off.prompt_tokens, on.prompt_tokens, None),
        ("prompt tokens computed", off.prompt_tokens_computed, on.prompt_tokens_computed, ratios["prompt_tokens_computed"]),
        ("hit tokens", off.hit_tokens, on.hit_tokens, ratios["hit_tokens"]),
        ("pseudo-hit tokens", "n/a" if off.pseudo_hit_tokens is None else off.pseudo_hit_tokens, on.pseudo_hit_tokens, None),
        ("TTFT p50 (s)", f"{off.ttft_p50_s:.3f}", f"{on.ttft_p50_s:.3f}", ratios["ttft_p50"]),
        ("TTFT p90 (s)", f"{off.ttft_p90_s:.3f}", f"{on.ttft_p90_s:.3f}", ratios["ttft_p90"]),
        ("output tokens/s", f"{off.output_tokens_per_s:.1f}", f"{on.output_tokens_per_s:.1f}", ratios["output_tokens_per_s"]),
    ]
    print(f"{'':<24}{names[0]:>14}{names[1]:>14}{'ratio':>10}")
    for name, off_v, on_v, ratio in rows:
        print(f"{name:<24}{str(off_v):>14}{str(on_v):>14}{(f'{ratio:.2f}' if ratio is not None else ''):>10}")


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_serve", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workload", required=True, choices=sorted(WORKLOADS), help="chat workload (eval/workloads.py chat_sessions)"
    )
    parser.add_argument("--model", help="model folder (default: the trained tiny MiMo if present, else a fresh tiny mimo model)")
    parser.add_argument(
        "--kv-gib",
        type=float,
        default=0.015,
        help="KV cache size in GiB for both sides, > 0 (default: 0.015, tight for the bundled model so that caching "
             "decisions matter)",
    )
    parser.add_argument("--clients", type=int, default=4, help="requests in flight at most, >= 1 (default: 4)")
    parser.add_argument("--duration", type=float, default=120.0, help="no new turn after this many seconds, > 0 (default: 120)")
    parser.add_argument("--sessions", type=int, default=16, help="chat sessions to replay, >= 1 (default: 16)")
    parser.add_argument(
        "--block-size",
        type=int,
        default=32,
        help="KV block size for both sides, a multiple of 32 on CPU (default: 32; vLLM's CPU default is 128)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="model dtype for both sides (default: auto, the checkpoint's bf16; float32 makes greedy answers "
             "independent of which prefix was cached, and needs twice the KV bytes, e.g. --kv-gib 0.03)",
    )
    parser.add_argument(
        "--host-gib",
        type=float,
        default=0.0,
        help="compare the plugin without and with a host tier of this many GiB (host_tier_gib), >= 0 (default: 0, "
             "compare the plugin off and on)",
    )
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    for name, value, ok, allowed in (
        ("--kv-gib", args.kv_gib, args.kv_gib > 0, "> 0"),
        ("--clients", args.clients, args.clients >= 1, ">= 1"),
        ("--duration", args.duration, args.duration > 0, "> 0"),
        ("--sessions", args.sessions, args.sessions >= 1, ">= 1"),
        ("--block-size", args.block_size, args.block_size >= 1 and args.block_size % 16 == 0, "a positive multiple of 16"),
        ("--host-gib", args.host_gib, args.host_gib >= 0, ">= 0"),
    ):
        if not ok:
            parser.error(f"{name} {value} is out of range; allowed: {allowed}")

    model = args.model or str(bundled_model())
    sessions = chat_sessions(args.workload, args.seed, args.sessions)
    kv_bytes = int(args.kv_gib * GIB)
    # The reference side first, then the side measured against it.
    base_side, test_side = ("on", "host") if args.host_gib else ("off", "on")
    off, off_answers = run_side(
        base_side, model, kv_bytes, args.block_size, args.dtype, sessions, args.clients, args.duration, args.host_gib
    )
    on, on_answers = run_side(
        test_side, model, kv_bytes, args.block_size, args.dtype, sessions, args.clients, args.duration, args.host_gib
    )
    names = (SIDES[base_side], SIDES[test_side])
    both = sorted(set(on_answers) & set(off_answers))
    same = sum(on_answers[k] == off_answers[k] for k in both)
    ratios = {
        "prompt_tokens_computed": _ratio(on.prompt_tokens_computed, off.prompt_tokens_computed),
        "hit_tokens": _ratio(on.hit_tokens, off.hit_tokens),
        "ttft_p50": _ratio(on.ttft_p50_s, off.ttft_p50_s),
        "ttft_p90": _ratio(on.ttft_p90_s, off.ttft_p90_s),
        "output_tokens_per_s": _ratio(on.output_tokens_per_s, off.output_tokens_per_s),
    }
    print(f"\nbench_serve: {args.workload}, {len(sessions)} sessions, {args.clients} clients, "
          f"{args.kv_gib} GiB KV{f', {args.host_gib} GiB host tier' if args.host_gib else ''}, "
          f"block size {args.block_size}, model {model}")
    print_table(on, off, ratios, names)
    if both:
        first = both[0]
        print(f"\nsame answer, {names[0]} and {names[1]}: {same} of {len(both)} turns (greedy; in bf16 a "
              f"prefix read from the cache and one computed in the same step round differently, upstream "
              f"too; with --dtype float32 the answers match)")
        print(f"session {first[0]}, turn {first[1]}, {names[0]}: {off_answers[first]!r}")
        print(f"session {first[0]}, turn {first[1]}, {names[1]}: {on_answers[first]!r}")
    if args.json:
        args.json.write_text(json.dumps({
            "workload": args.workload, "model": model, "kv_gib": args.kv_gib, "clients": args.clients,
            "block_size": args.block_size, "dtype": args.dtype,
            "host_gib": args.host_gib, "sides": [base_side, test_side],
            "sessions": len(sessions), test_side: asdict(on), base_side: asdict(off), "ratios": ratios,
            "turns_compared": len(both), "same_answers": same,
        }, indent=2) + "\n")
    return 0


def bundled_model() -> Path:
    """The trained tiny MiMo shipped in the repo, or a random-weight tiny mimo made now."""
    trained = Path(__file__).parents[1] / "checkpoints" / "tiny-mimo-trained"
    if (trained / "config.json").exists():
        return trained
    from vllm_mimo.testing.tiny_model import make_tiny_model

    made = Path("models") / "tiny-mimo"
    if not (made / "config.json").exists():
        print(f"[bench_serve] making the tiny mimo model in {made} ...", file=sys.stderr, flush=True)
        make_tiny_model(made, "mimo")
    return made


if __name__ == "__main__":
    raise SystemExit(main())

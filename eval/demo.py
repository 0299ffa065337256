"""The `make demo` job: serve the bundled tiny MiMo model with the plugin on and show prefix hits.

Makes the tiny `mimo` model (unless --model is given), starts `vllm serve` on 127.0.0.1 with
the plugin on, sends chat requests from several users who share one system prompt through the
OpenAI-compatible API, prints each reply and vLLM's prefix-cache counters from /metrics, and
stops the server.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

SYSTEM_PROMPT = (
    "You are a careful coding assistant working inside a large Python repository. "
    "Follow the project's style guide: type hints on public functions, small modules, "
    "docstrings where a name is not enough, and tests for every change. "
) * 8
QUESTIONS = [
    "How do I read a JSON file into a dict?",
    "Write a function that reverses a linked list.",
    "What does functools.lru_cache do?",
    "Explain the difference between a list and a tuple.",
    "How can I run a subprocess and capture its output?",
    "Show me how to parse command line flags with argparse.",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder (default: make the tiny mimo model in --models-dir)")
    parser.add_argument("--models-dir", default="models", help="where the tiny model is made (default: models)")
    parser.add_argument("--requests", type=int, default=len(QUESTIONS), help=f"chat requests to send, 1..{len(QUESTIONS)} (default: all)")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per reply, 1..512 (default: 24)")
    parser.add_argument("--kv-gib", type=float, default=0.25, help="KV cache size in GiB, > 0 (default: 0.25)")
    args = parser.parse_args(argv)
    if not 1 <= args.requests <= len(QUESTIONS):
        parser.error(f"--requests {args.requests} is out of range; allowed: 1..{len(QUESTIONS)}")
    if not 1 <= args.max_tokens <= 512:
        parser.error(f"--max-tokens {args.max_tokens} is out of range; allowed: 1..512")
    if not args.kv_gib > 0:
        parser.error(f"--kv-gib {args.kv_gib} must be > 0")

    from openai import OpenAI

    from vllm_mimo.testing.server import VllmServer
    from vllm_mimo.testing.tiny_model import make_tiny_model

    model = Path(args.model) if args.model else Path(args.models_dir) / "tiny-mimo"
    if not args.model and not (model / "config.json").exists():
        print(f"[demo] making the tiny mimo model in {model} ...", flush=True)
        make_tiny_model(model, "mimo")
    print(f"[demo] starting vllm serve {model} with the plugin on (about 30 s) ...", flush=True)
    server = VllmServer(
        model,
        "--enforce-eager",
        "--max-model-len", "2048",
        "--kv-cache-memory-bytes", str(int(args.kv_gib * (1 << 30))),
        "--served-model-name", "tiny-mimo",
        env={"VLLM_MIMO_ENABLE": "1"},
    )
    with server:
        print(f"[demo] server up at {server.url}; log: {server.log_path}", flush=True)
        startup = [line for line in server.log_text().splitlines() if "vllm-mimo:" in line]
        for line in startup:
            print("[demo] " + line.split("] ", 1)[-1])
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        before = server.metrics()
        for i, question in enumerate(QUESTIONS[: args.requests], 1):
            t0 = time.perf_counter()
            reply = client.chat.completions.create(
                model="tiny-mimo",
                messages=[
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": question},
                ],
                max_tokens=args.max_tokens,
                temperature=0,
            )
            text = reply.choices[0].message.content or ""
            print(
                f"[demo] user {i}/{args.requests} ({time.perf_counter() - t0:.2f} s, "
                f"{reply.usage.prompt_tokens} prompt tokens): {question!r}\n"
                f"       reply: {text[:70]!r}",
                flush=True,
            )
        after = server.metrics()
    queries = after.get("vllm:prefix_cache_queries_total", 0) - before.get("vllm:prefix_cache_queries_total", 0)
    hits = after.get("vllm:prefix_cache_hits_total", 0) - before.get("vllm:prefix_cache_hits_total", 0)
    print("\nvLLM prefix cache (from /metrics, this run):")
    print(f"  {'prompt tokens queried':<24}{queries:>10.0f}")
    print(f"  {'prompt tokens hit':<24}{hits:>10.0f}")
    print(f"  {'hit ratio':<24}{(hits / queries if queries else 0):>10.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

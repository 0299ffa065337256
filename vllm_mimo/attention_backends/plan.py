"""The plan of a window-local SWA step: which cached blocks each request reads, where its
chunk's keys go, and the shifted lengths a stock kernel sees.

A request with `context` computed tokens and `q` new ones reads keys from positions
`[context - (W-1), context + q)`. The plan lays that span out, for every request of the step,
in a per-step scratch space of whole blocks: from the block holding `context - (W-1)` to the
block holding the last new token. The cached part (positions before `context`) is copied in
block by block (a block's interior layout is the kernel's business, so whole blocks are copied
unchanged); the new tokens' keys and values are written in at `token_slots`. A stock paged
kernel run over the scratch block table with `seq_lens` shifted by the span's first position
computes the same attention as over the real cache (causal masks and windows depend only on
differences of positions). Memory: O(W + chunk) per request for one layer at a time, instead
of O(chunk) per SWA layer held in the pool. All of it but which cache blocks to copy depends
on the step's lengths alone (`window_layout`), so the SWA groups of a step share one
`WindowLayout` and each plans only its own block table (`WindowLayout.plan`).

The SWA groups of a step share its layout (`step_layout`, once per step); `paged_index` gives
it as the arrays of a stock paged prefill kernel's plan (FlashInfer's, once per step for every
group of a shape), which is all the CUDA path adds: one kernel call per layer over the scratch,
no merge.

Everything here is plain torch on the host: the CPU backend runs `WindowPlan` with vLLM's CPU
kernel, the CUDA backends hand `PagedIndex` to FlashInfer's plan (or the layout's block table
to FlashAttention) and the copy indices to the device once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WindowPlan:
    """A step's window-local layout (see the module docstring); R requests, T new tokens.

    first_block: [R] the first logical block each request reads (of `context - (W-1)`)
    block_table: [R, max blocks] scratch block ids, request r's blocks in order
    seq_lens:    [R] key positions each request reads in scratch (its seq_len less
                 `first_block * block_size`)
    copy_src:    [M] cache block ids holding context positions inside some window
    copy_dst:    [M] the scratch block each is copied to
    token_slots: [T] the scratch slot of each new token's key and value
    num_blocks:  scratch blocks the step needs
    block_size:  tokens per block, of the cache and the scratch
    """

    first_block: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    copy_src: torch.Tensor
    copy_dst: torch.Tensor
    token_slots: torch.Tensor
    num_blocks: int
    block_size: int


def _step_lengths(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, window: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query offsets, key lengths, new tokens, context) per request, int64; checks W and the
    block size."""
    if window < 1 or block_size < 1:
        raise ValueError(f"window ({window}) and block_size ({block_size}) must be >= 1")
    qsl = query_start_loc.to(torch.int64)
    lens = seq_lens.to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    return qsl, lens, q_lens, lens - q_lens


@dataclass(frozen=True)
class WindowLayout:
    """The part of a step's `WindowPlan` its lengths alone decide: every SWA group of the step
    with the same window and block size shares it (their block tables differ). M copied blocks.

    copy_rows:    [M] the request (block table row) of each cached block to copy
    copy_columns: [M] its logical block (block table column)
    The other fields are `WindowPlan`'s.
    """

    first_block: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    copy_rows: torch.Tensor
    copy_columns: torch.Tensor
    copy_dst: torch.Tensor
    token_slots: torch.Tensor
    num_blocks: int
    block_size: int

    def plan(self, block_table: torch.Tensor) -> WindowPlan:
        """The plan over one group's `block_table` (its rows the step's requests)."""
        return WindowPlan(
            first_block=self.first_block,
            block_table=self.block_table.to(block_table.dtype),
            seq_lens=self.seq_lens,
            copy_src=block_table[self.copy_rows, self.copy_columns].to(torch.int64),
            copy_dst=self.copy_dst,
            token_slots=self.token_slots,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
        )


def window_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, window: int, block_size: int) -> WindowLayout:
    """The layout for requests whose new tokens start at `query_start_loc` (R+1 offsets) and
    whose key lengths are `seq_lens` (context + new); `window` is W (a query at position p
    reads keys p-W+1..p)."""
    qsl, lens, q_lens, context = _step_lengths(query_start_loc, seq_lens, window, block_size)
    first = (context - (window - 1)).clamp(min=0) // block_size
    end = (lens + block_size - 1) // block_size
    counts = end - first
    offsets = torch.cumsum(counts, 0) - counts
    total = int(counts.sum()) if counts.numel() else 0
    width = int(counts.max()) if counts.numel() else 0
    j = torch.arange(width, dtype=torch.int64)
    table = offsets[:, None] + j[None, :]
    table = torch.where(j[None, :] < counts[:, None], table, torch.zeros_like(table))

    cached = ((context + block_size - 1) // block_size - first).clamp(min=0)
    copy = j[None, :] < cached[:, None]
    rows, cols = copy.nonzero(as_tuple=True)

    num_tokens = int(qsl[-1]) if qsl.numel() else 0
    request = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens, output_size=num_tokens)
    position = context[request] + torch.arange(num_tokens) - qsl[request]
    token_slots = (offsets[request] + position // block_size - first[request]) * block_size + position % block_size
    return WindowLayout(
        first_block=first,
        block_table=table,
        seq_lens=(lens - first * block_size).to(seq_lens.dtype),
        copy_rows=rows,
        copy_columns=first[rows] + cols,
        copy_dst=table[rows, cols],
        token_slots=token_slots,
        num_blocks=total,
        block_size=block_size,
    )


_step: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, WindowLayout, dict]] = {}
"""Per (window, block size): the lengths of the latest step laid out, copied (vLLM refills its
buffers in place), their layout and what the backends made for it. The SWA groups of a step
are built one after another from the same lengths; each reuses these and plans only its own
block table."""


def step_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, window: int, block_size: int) -> tuple[WindowLayout, dict]:
    """`window_layout` of these lengths (host tensors), and a dict for what a backend makes
    for it once per step (kernel schedules and plans, device copies): the ones of the group
    built before when the lengths are the same, else new ones."""
    last = _step.get((window, block_size))
    if (last is not None and last[1].dtype == seq_lens.dtype and torch.equal(last[0], query_start_loc)
            and torch.equal(last[1], seq_lens)):
        return last[2], last[3]
    layout = window_layout(query_start_loc, seq_lens, window, block_size)
    _step[(window, block_size)] = (query_start_loc.clone(), seq_lens.clone(), layout, {})
    return layout, _step[(window, block_size)][3]


@dataclass(frozen=True)
class PagedIndex:
    """A `WindowLayout` as the arrays a stock paged prefill kernel is planned with (FlashInfer's
    `BatchPrefillWithPagedKVCacheWrapper.plan`); int32, host. R requests over N scratch blocks.

    qo_indptr:     [R+1] the new tokens' offsets (the step's query_start_loc, from 0)
    kv_indptr:     [R+1] offsets into `kv_indices`
    kv_indices:    [N] the scratch blocks of each request in order (0..N-1: a request's blocks
                   are consecutive in scratch)
    last_page_len: [R] keys in each request's last scratch block (1..block size)

    Run causal with `window_left` = W-1: the kernel aligns each request's last query row with
    its last key, so row i of a request with q new tokens and n scratch keys sees keys
    n-q+i-(W-1) .. n-q+i, which are the positions p-(W-1) .. p of its token at p shifted by
    the same `first_block * block_size`: the window, exactly.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor


def paged_index(layout: WindowLayout, query_start_loc: torch.Tensor) -> PagedIndex:
    """`layout`'s arrays for a paged prefill kernel (see `PagedIndex`)."""
    bs = layout.block_size
    lens = layout.seq_lens.to(torch.int64)
    counts = (lens + bs - 1) // bs
    kv_indptr = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    kv_indptr[1:] = torch.cumsum(counts, 0)
    qsl = query_start_loc.to(torch.int64)
    return PagedIndex(
        qo_indptr=(qsl - qsl[:1]).to(torch.int32),
        kv_indptr=kv_indptr.to(torch.int32),
        kv_indices=torch.arange(layout.num_blocks, dtype=torch.int32),
        last_page_len=(lens - (counts - 1) * bs).to(torch.int32),
    )


def mask_null_slots(slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """`slot_mapping` with every slot in the null block (id 0) set to -1, which cache writers
    skip: positions the manager keeps no SWA KV for get the null block, and their keys must
    not be written there (the null block stays clean; two tokens would also race onto one
    slot). No device sync."""
    return slot_mapping.masked_fill(slot_mapping < block_size, -1)

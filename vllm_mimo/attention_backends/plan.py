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
of O(chunk) per SWA layer held in the pool.

Everything here is plain torch on the host: the CPU backend uses it, and a CUDA backend uses
the same arrays (on its device) as its FlashInfer plan inputs.
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


def plan_window_local(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    window: int,
    block_size: int,
) -> WindowPlan:
    """The plan for requests whose new tokens start at `query_start_loc` (R+1 offsets) and
    whose key lengths are `seq_lens` (context + new), over their `block_table` rows; `window`
    is W (a query at position p reads keys p-W+1..p)."""
    if window < 1 or block_size < 1:
        raise ValueError(f"window ({window}) and block_size ({block_size}) must be >= 1")
    qsl = query_start_loc.to(torch.int64)
    lens = seq_lens.to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    context = lens - q_lens
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
    columns = (first[:, None] + j[None, :]).clamp(max=max(block_table.shape[1] - 1, 0))
    copy_src = block_table.to(torch.int64).gather(1, columns)[copy] if width else torch.zeros(0, dtype=torch.int64)
    copy_dst = table[copy]

    num_tokens = int(qsl[-1]) if qsl.numel() else 0
    request = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens, output_size=num_tokens)
    position = context[request] + torch.arange(num_tokens) - qsl[request]
    token_slots = (offsets[request] + position // block_size - first[request]) * block_size + position % block_size
    return WindowPlan(
        first_block=first,
        block_table=table.to(block_table.dtype),
        seq_lens=(lens - first * block_size).to(seq_lens.dtype),
        copy_src=copy_src,
        copy_dst=copy_dst,
        token_slots=token_slots,
        num_blocks=total,
        block_size=block_size,
    )


def mask_null_slots(slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """`slot_mapping` with every slot in the null block (id 0) set to -1, which cache writers
    skip: positions the manager keeps no SWA KV for get the null block, and their keys must
    not be written there (the null block stays clean; two tokens would also race onto one
    slot). No device sync."""
    return slot_mapping.masked_fill(slot_mapping < block_size, -1)

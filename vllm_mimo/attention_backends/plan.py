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

`plan_split` lays the same step out as two attention calls with no scratch (the FlashInfer
shape of the CUDA path): the chunk over its own keys in flight, and the cached window read from
the paged cache in place; `reference.combine_split` merges them.

Everything here is plain torch on the host: the CPU backend runs `WindowPlan`, the CUDA
backend passes `SplitPlan`'s arrays (moved to its device) to FlashInfer's plan calls.
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


@dataclass(frozen=True)
class SplitPlan:
    """A window-local step as two calls merged by log-sum-exp; R requests, T new tokens, C of
    the requests with cached tokens (`context > 0`), W the window.

    The chunk call: queries and keys are the step's new tokens (`query_start_loc` as both
    indptrs), causal, a window of W-1 keys to the left.

    The context call reads, for each of the C requests, the cache pages from the one holding
    `context - (W-1)` to the one holding `context - 1` (n keys), with exactly W-1 query rows:
    row i is the request's new token i (rows past its last new token repeat it and are thrown
    away). Non-causal with a left window of 0 keys, a kernel that aligns the last query row to
    the last key (FlashInfer's rule: key j is seen by row i when j >= i + n - rows - window_left)
    gives row i the keys at positions >= context + i - (W-1): the window, exactly. Each of the W-1
    rows has at least one key in reach, so no row is empty. The cost is W-1 rows per request
    with a context: O(W), whatever the chunk.

    context_requests:   [C] which requests have a context part
    context_qo_indptr:  [C+1] 0, W-1, 2(W-1), ...
    context_rows:       [C(W-1)] the step's query row each context row reads
    context_valid:      [C(W-1)] whether that row is a real new token (not a repeat)
    page_indptr:        [C+1] offsets into the page lists
    page_request:       [P] the request (row of the step's block table) of each page
    page_column:        [P] the page's logical block: its id is block_table[request, column]
    last_page_len:      [C] keys in each request's last page
    window:             W
    """

    context_requests: torch.Tensor
    context_qo_indptr: torch.Tensor
    context_rows: torch.Tensor
    context_valid: torch.Tensor
    page_indptr: torch.Tensor
    page_request: torch.Tensor
    page_column: torch.Tensor
    last_page_len: torch.Tensor
    window: int


def plan_split(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, window: int, block_size: int) -> SplitPlan:
    """The split layout (see `SplitPlan`) for requests whose new tokens start at
    `query_start_loc` (R+1 offsets, host) with key lengths `seq_lens` (host); page ids are
    left to the caller (`page_request`, `page_column` index its block table), so the plan reads
    no device memory."""
    qsl, _, q_lens, context = _step_lengths(query_start_loc, seq_lens, window, block_size)
    rows = window - 1
    requests = torch.nonzero(context > 0).flatten() if rows else torch.zeros(0, dtype=torch.int64)
    ctx, q = context[requests], q_lens[requests]
    first = (ctx - rows).clamp(min=0) // block_size
    last = (ctx - 1) // block_size
    pages = last - first + 1
    c = requests.numel()
    i = torch.arange(rows, dtype=torch.int64).repeat(c)
    owner = torch.arange(c, dtype=torch.int64).repeat_interleave(rows)
    page_owner = torch.arange(c, dtype=torch.int64).repeat_interleave(pages)
    page_indptr = torch.zeros(c + 1, dtype=torch.int64)
    page_indptr[1:] = torch.cumsum(pages, 0)
    return SplitPlan(
        context_requests=requests,
        context_qo_indptr=torch.arange(c + 1, dtype=torch.int64) * rows,
        context_rows=qsl[requests][owner] + torch.minimum(i, q[owner] - 1),
        context_valid=i < q[owner],
        page_indptr=page_indptr,
        page_request=requests[page_owner],
        page_column=first[page_owner] + torch.arange(int(pages.sum())) - page_indptr[page_owner],
        last_page_len=ctx - last * block_size,
        window=window,
    )


def context_pages(split: SplitPlan, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The context call's pages as a block table, for kernels that take one (FlashAttention):
    `[C, P]` logical blocks (columns of the step's block table, rows `split.context_requests`;
    a shorter list repeats its last page, which the kernel never reads) and `[C]` keys from the
    first page's first slot to the context's end."""
    pages = split.page_indptr[1:] - split.page_indptr[:-1]
    if not pages.numel():
        return torch.zeros((0, 0), dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    first = split.page_column[split.page_indptr[:-1]]
    j = torch.arange(int(pages.max()), dtype=torch.int64)
    columns = first[:, None] + torch.minimum(j[None, :], pages[:, None] - 1)
    return columns, (pages - 1) * block_size + split.last_page_len


def mask_null_slots(slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """`slot_mapping` with every slot in the null block (id 0) set to -1, which cache writers
    skip: positions the manager keeps no SWA KV for get the null block, and their keys must
    not be written there (the null block stays clean; two tokens would also race onto one
    slot). No device sync."""
    return slot_mapping.masked_fill(slot_mapping < block_size, -1)

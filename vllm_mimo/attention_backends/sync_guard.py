"""A guard that fails on host syncs in code that must not make them: the per-layer path of the
CUDA backends (a sync per SWA layer is a pipeline bubble per layer).

`no_host_sync()` is a torch function mode: inside it, every torch call that reads a tensor's
values on the host or produces a shape from them (`item`, `tolist`, `nonzero`, a boolean-mask
index, `bool(t)`, `int(t)`, a `repeat_interleave` without `output_size`, a copy to the host) and
every `non_blocking` copy from pageable host memory to a device raises `HostSyncError`, on any
device, so tests catch them on CPU. On a GPU, `eval/gpu_check.py` runs the same code under
torch's own `torch.cuda.set_sync_debug_mode("error")` as well, which sees what the kernels do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

Tensor = torch.Tensor


class HostSyncError(RuntimeError):
    """A host sync (or a pageable asynchronous copy) where none may be."""


_READS_VALUES = {
    Tensor.item, Tensor.tolist, Tensor.numpy, Tensor.cpu, Tensor.nonzero, torch.nonzero, torch.argwhere,
    Tensor.__bool__, Tensor.__int__, Tensor.__float__, Tensor.__index__, torch.masked_select, Tensor.masked_select,
    torch.unique, Tensor.unique, torch.unique_consecutive, Tensor.any, Tensor.all, torch.equal, Tensor.equal,
}
_INDEXES = {Tensor.__getitem__, Tensor.__setitem__, Tensor.index_put_, Tensor.index_put, torch.index_put}


def _bool_index(index: Any) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, Tensor) and i.dtype == torch.bool for i in items)


def _pageable_async(func: Any, args: tuple, kwargs: dict) -> bool:
    """A `non_blocking` copy between host memory that is not pinned and a device."""
    if not kwargs.get("non_blocking", False):
        return False
    if func is Tensor.copy_:
        dst, src = args[0], args[1]
        host, device = (src, dst) if dst.device.type != "cpu" else (dst, src)
        return device.device.type != "cpu" and host.device.type == "cpu" and not host.is_pinned()
    if func is Tensor.to:
        source, target = args[0], kwargs.get("device", args[1] if len(args) > 1 else None)
        target_type = torch.device(target).type if isinstance(target, (str, torch.device)) else source.device.type
        return source.device.type == "cpu" and target_type != "cpu" and not source.is_pinned()
    return False


_allowed = [0]
"""Depth of `host_sync_allowed` blocks open."""


class _NoHostSync(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _allowed[0]:
            return func(*args, **kwargs)
        name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
        if func in _READS_VALUES:
            raise HostSyncError(f"host sync in a no-sync region: {name}")
        if func in _INDEXES and len(args) > 1 and _bool_index(args[1]):
            raise HostSyncError(f"host sync in a no-sync region: {name} with a boolean mask")
        if func is torch.where and len(args) == 1:
            raise HostSyncError("host sync in a no-sync region: torch.where(condition)")
        if func in (torch.repeat_interleave, Tensor.repeat_interleave) and "output_size" not in kwargs and (
            len(args) > 1 and isinstance(args[1], Tensor)
        ):
            raise HostSyncError(f"host sync in a no-sync region: {name} without output_size")
        if func in (Tensor.to, Tensor.copy_) and _pageable_async(func, args, kwargs):
            raise HostSyncError(f"non_blocking copy from pageable host memory in a no-sync region: {name}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Fail (`HostSyncError`) on any host sync made through torch inside the block."""
    with _NoHostSync():
        yield


@contextlib.contextmanager
def host_sync_allowed() -> Iterator[None]:
    """Inside `no_host_sync`, a block that may read values on the host: a torch stand-in for a
    device kernel (tests' emulations of FlashAttention's), which is not the code under test."""
    _allowed[0] += 1
    try:
        yield
    finally:
        _allowed[0] -= 1

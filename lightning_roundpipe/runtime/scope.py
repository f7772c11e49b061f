"""What runs inside a stage: values its layers share, and a guard against host syncs.

While a worker runs a stage for one micro-batch, :func:`stage_cached` lets its
layers share values that are the same for all of them (a decoder's attention
mask and rotary tables: built by the stage's first layer, reused by the rest)
instead of rebuilding them per layer. Outside a stage (a plain forward of the
user's model) every call builds its own.

:func:`forbid_host_sync` fails on any call that would make the host wait for a
device (``.item()``, ``bool()``, ``.tolist()``, ``.cpu()``, boolean-mask
indexing, ...): a stage's work must be queued without the worker thread
waiting, or the device idles. On a GPU it also turns on
``torch.cuda.set_sync_debug_mode("error")``, which catches every synchronizing
call; on CPU workers it catches the Python-level calls listed in
:data:`SYNC_CALLS`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["SYNC_CALLS", "HostSyncError", "forbid_host_sync", "stage_cached", "stage_scope"]

T = TypeVar("T")

_local = threading.local()


@contextlib.contextmanager
def stage_scope() -> Iterator[dict]:
    """A fresh cache for one stage on one micro-batch (per thread)."""
    prev = getattr(_local, "cache", None)
    cache: dict = {}
    _local.cache = cache
    try:
        yield cache
    finally:
        _local.cache = prev


def stage_cached(key: Any, make: Callable[[], T]) -> T:
    """``make()`` once per stage and micro-batch (keyed by ``key``); outside a
    stage, ``make()`` every time."""
    cache = getattr(_local, "cache", None)
    if cache is None:
        return make()
    if key not in cache:
        cache[key] = make()
    return cache[key]


class HostSyncError(RuntimeError):
    """A call that makes the host wait for the device ran inside a stage."""


SYNC_CALLS = frozenset(
    {
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
        torch.Tensor.cpu,
        torch.Tensor.numpy,
        torch.Tensor.nonzero,
        torch.nonzero,
        torch.equal,
        torch.Tensor.equal,
        torch.is_nonzero,
        torch.Tensor.is_nonzero,
        torch.unique,
        torch.Tensor.unique,
        torch.masked_select,
        torch.Tensor.masked_select,
        torch.allclose,
        torch.Tensor.allclose,
    }
)


def _mask_index(args: tuple) -> bool:
    """Indexing with a boolean tensor (its result's size depends on the data)."""
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class _Guard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNC_CALLS or (
            func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _mask_index(args)
        ):
            name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
            raise HostSyncError(
                f"{name} makes the host wait for the device inside a pipeline stage; keep "
                "values on the device (torch.where, masks as tensors) instead"
            )
        return func(*args, **(kwargs or {}))


_cuda_lock = threading.Lock()
_cuda_users = 0
_cuda_saved: Any = None


@contextlib.contextmanager
def _cuda_sync_errors() -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode("error")`` while any thread is inside:
    the mode is process-wide, so it is counted, set by the first thread in and
    restored by the last one out (meanwhile it also applies to other threads)."""
    global _cuda_users, _cuda_saved
    with _cuda_lock:
        if _cuda_users == 0:
            _cuda_saved = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        _cuda_users += 1
    try:
        yield
    finally:
        with _cuda_lock:
            _cuda_users -= 1
            if _cuda_users == 0:
                torch.cuda.set_sync_debug_mode(_cuda_saved)


@contextlib.contextmanager
def forbid_host_sync(device: torch.device | None = None) -> Iterator[None]:
    """Raise :class:`HostSyncError` on any call that waits for the device
    (on this thread; on a GPU also CUDA's own check, process-wide while any
    thread is inside)."""
    cuda = device is not None and device.type == "cuda"
    with _cuda_sync_errors() if cuda else contextlib.nullcontext(), _Guard():
        yield

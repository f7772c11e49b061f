"""Host-resident model state: the three copies of every weight.

* the **optimizer copy**: the user's own parameters, on the host, untouched in
  name, dtype and identity (``state_dict`` keys do not change);
* the **master copy**: the weights in the compute dtype in host memory that
  devices upload from (pinned when CUDA is present);
* per trainable parameter an fp32 **gradient buffer** on the host that devices
  accumulate into. Frozen parameters have none and never cause gradient traffic.

Workers never touch the user's modules: each keeps a *replica* of every layer,
a structural copy whose parameters are placeholders that are pointed at
uploaded device tensors for the duration of a stage.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["HostState", "LayerReplica", "pinned_bytes"]

log = logging.getLogger(__name__)


_registered_lock = threading.Lock()
_registered_bytes = 0


def pinned_bytes() -> int:
    """Bytes of host memory this process has page-locked for master copies and
    not yet released (all engines together; 0 once every engine is closed)."""
    return _registered_bytes


def _count_registered(delta: int) -> None:
    global _registered_bytes
    with _registered_lock:
        _registered_bytes += delta


class _PinnedArena:
    """Page-locked host memory for the master copies, without rounding waste.

    ``pin_memory()`` goes through the caching host allocator, which rounds each
    block up to a power of two (a 300 MB layer would take 512 MB). Here every
    master copy is a view into one flat buffer of exactly the bytes needed
    (each tensor 512-byte aligned), registered once with the CUDA driver
    (``cudaHostRegister``) and unregistered on :meth:`release`. If registration
    fails the buffer stays pageable: transfers are slower but correct."""

    ALIGN = 512

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and torch.cuda.is_available()
        self._buffer: torch.Tensor | None = None
        self.registered = False

    def build(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """Copies of ``tensors`` in ``dtype``: views into one buffer when
        page-locking, else separate tensors. (Views share one autograd version
        counter; CPU workers compute on the master copies themselves, so there
        a copy into one master would look like a change to all of them.)"""
        if not self.enabled:
            return [t.detach().to(dtype, copy=True) for t in tensors]
        size = torch.empty(0, dtype=dtype).element_size()
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            nbytes = t.numel() * size
            total += -(-nbytes // self.ALIGN) * self.ALIGN
        buf = torch.empty(max(total, self.ALIGN), dtype=torch.uint8)
        if self.enabled:
            # register from a short-lived thread: a failed CUDA runtime call leaves a
            # per-thread error flag that would surface at the caller's next kernel
            result: list = []
            helper = threading.Thread(
                target=lambda: result.append(
                    torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
                ),
                name="roundpipe-pin",
            )
            helper.start()
            helper.join()
            err = result[0] if result else -1
            self.registered = int(err) == 0
            if self.registered:
                _count_registered(buf.numel())
            else:
                log.warning(
                    "cudaHostRegister of %d bytes failed (%s); master copies stay in pageable "
                    "memory and uploads will be slower",
                    buf.numel(),
                    err,
                )
        self._buffer = buf
        out = []
        for t, off in zip(tensors, offsets, strict=True):
            view = buf[off : off + t.numel() * size].view(dtype).view(t.shape)
            view.copy_(t)
            out.append(view)
        return out

    @property
    def nbytes(self) -> int:
        return self._buffer.numel() if self._buffer is not None and self.registered else 0

    def free(self) -> None:
        self.release()
        self._buffer = None

    def release(self) -> None:
        if self.registered and self._buffer is not None:
            err = torch.cuda.cudart().cudaHostUnregister(self._buffer.data_ptr())
            if int(err) != 0:  # pragma: no cover - needs a GPU
                log.warning("cudaHostUnregister failed: %s", err)
            self.registered = False
            _count_registered(-self._buffer.numel())


@dataclass
class _Param:
    """One distinct parameter of the model (tied parameters appear once)."""

    index: int
    param: nn.Parameter
    master: torch.Tensor
    grad: torch.Tensor | None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def trainable(self) -> bool:
        return self.grad is not None


@dataclass
class _Slot:
    """Where a tensor sits inside a layer: ``layer.get_submodule(path).attr``."""

    path: str
    attr: str
    index: int  # parameter index, or buffer index within the layer


def _split_name(name: str) -> tuple[str, str]:
    path, _, attr = name.rpartition(".")
    return path, attr


class _LayerInfo:
    def __init__(self, index: int, module: nn.Module, params: dict[int, int]) -> None:
        self.index = index
        self.module = module
        self.param_slots = [
            _Slot(*_split_name(n), params[id(p)])
            for n, p in module.named_parameters(remove_duplicate=False)
        ]
        self.param_ids = list(dict.fromkeys(s.index for s in self.param_slots))
        self.buffers: list[torch.Tensor] = []
        self.persistent: list[bool] = []
        self.buffer_slots: list[_Slot] = []
        seen: dict[int, int] = {}
        for n, b in module.named_buffers(remove_duplicate=False):
            if b is None:
                continue
            path, attr = _split_name(n)
            owner = module.get_submodule(path)
            if id(b) not in seen:
                seen[id(b)] = len(self.buffers)
                self.buffers.append(b)
                self.persistent.append(attr not in owner._non_persistent_buffers_set)
            self.buffer_slots.append(_Slot(path, attr, seen[id(b)]))

    @property
    def has_state(self) -> bool:
        """Whether the layer has persistent buffers (e.g. running statistics)
        whose updates must come back to the host."""
        return any(self.persistent)


class LayerReplica:
    """A worker's private structural copy of one layer.

    ``bind`` points its parameters and buffers at device tensors; ``unbind``
    drops them again so the device memory can be reused."""

    def __init__(self, info: _LayerInfo, params: Sequence[_Param]) -> None:
        memo: dict[int, object] = {}
        for s in info.param_slots:
            p = params[s.index].param
            memo[id(p)] = nn.Parameter(torch.empty(0), requires_grad=p.requires_grad)
        for b in info.buffers:
            memo[id(b)] = torch.empty(0)
        self.module = copy.deepcopy(info.module, memo)
        self.info = info
        self._param_owners = [
            (self.module.get_submodule(s.path), s.attr, s.index) for s in info.param_slots
        ]
        self._buffer_owners = [
            (self.module.get_submodule(s.path), s.attr, s.index) for s in info.buffer_slots
        ]
        self._placeholders = [(m, a, m._parameters[a]) for m, a, _ in self._param_owners]
        # train/eval mode follows the user's modules (dropout, batch norm)
        self._modes = list(zip(info.module.modules(), self.module.modules(), strict=True))

    def bind(self, weights: dict[int, nn.Parameter], buffers: Sequence[torch.Tensor]) -> None:
        for original, replica in self._modes:
            replica.training = original.training
        for owner, attr, idx in self._param_owners:
            owner._parameters[attr] = weights[idx]
        for owner, attr, idx in self._buffer_owners:
            owner._buffers[attr] = buffers[idx]

    def current_buffers(self) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(self.info.buffers)
        for owner, attr, idx in self._buffer_owners:
            out[idx] = owner._buffers[attr]
        return out  # type: ignore[return-value]

    def unbind(self) -> None:
        for owner, attr, placeholder in self._placeholders:
            owner._parameters[attr] = placeholder
        for owner, attr, _ in self._buffer_owners:
            owner._buffers[attr] = None


class HostState:
    """Master copies, gradient buffers and layer bookkeeping for a layer list.

    Args:
        layers: the model's layers, in pipeline order; moved to the host.
        compute_dtype: dtype of the master copy (the dtype devices compute in).
    """

    def __init__(
        self, layers: Sequence[nn.Module], compute_dtype: torch.dtype, pinned: bool = False
    ) -> None:
        self.compute_dtype = compute_dtype
        self.pool = _PinnedArena(pinned)
        unique: list[nn.Parameter] = []
        index: dict[int, int] = {}
        for layer in layers:
            layer.to("cpu")
            for p in layer.parameters():
                if id(p) not in index:
                    index[id(p)] = len(unique)
                    unique.append(p)
        masters = self.pool.build([p.detach() for p in unique], compute_dtype)
        self.params: list[_Param] = [
            _Param(i, p, m, torch.zeros(p.shape, dtype=torch.float32) if p.requires_grad else None)
            for i, (p, m) in enumerate(zip(unique, masters, strict=True))
        ]
        self.layers = [_LayerInfo(i, m, index) for i, m in enumerate(layers)]

    # ------------------------------------------------------------- queries
    def stage_params(self, start: int, stop: int) -> list[_Param]:
        """Distinct parameters of layers ``[start, stop)``."""
        ids = dict.fromkeys(i for info in self.layers[start:stop] for i in info.param_ids)
        return [self.params[i] for i in ids]

    def stage_has_state(self, start: int, stop: int) -> bool:
        return any(info.has_state for info in self.layers[start:stop])

    def weight_bytes(self, layer: int) -> int:
        """Bytes of a layer's weights in the compute dtype."""
        size = torch.empty(0, dtype=self.compute_dtype).element_size()
        return sum(self.params[i].param.numel() for i in self.layers[layer].param_ids) * size

    @property
    def trainable(self) -> list[_Param]:
        return [p for p in self.params if p.trainable]

    # ----------------------------------------------------------- gradients
    def accumulate(self, p: _Param, grad: torch.Tensor) -> None:
        """Add a downloaded gradient into the fp32 buffer (thread-safe)."""
        assert p.grad is not None
        with p.lock:
            p.grad.add_(grad)

    def expose_grads(self) -> None:
        """Point every trainable parameter's ``.grad`` at its accumulated gradient."""
        for p in self.params:
            if p.grad is None:
                continue
            if p.param.dtype == torch.float32:
                p.param.grad = p.grad
            else:
                p.param.grad = p.grad.to(p.param.dtype)

    def zero_grads(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    def detach_grads(self) -> None:
        """``.grad = None`` on every trainable parameter (as between steps)."""
        for p in self.params:
            if p.trainable:
                p.param.grad = None

    def refresh_masters(self) -> None:
        """Copy the optimizer copy into the master copy (after a step)."""
        with torch.no_grad():
            for p in self.params:
                p.master.copy_(p.param.detach())

    def host_bytes(self) -> dict[str, int]:
        """Host memory held by the engine, by kind (for reports)."""
        masters = sum(p.master.numel() * p.master.element_size() for p in self.params)
        grads = sum(p.grad.numel() * 4 for p in self.params if p.grad is not None)
        return {"master": masters, "grad": grads, "pinned": self.pool.nbytes}

    def release(self) -> None:
        self.pool.release()

    def free(self) -> None:
        """Unpin and drop the master copies and gradient buffers (the engine is
        closed and its workers joined): a closed engine that something still
        refers to (an autograd graph, an exception's traceback) no longer holds
        a copy of the model. The user's parameters are untouched."""
        for p in self.params:
            p.master = p.master.new_empty(0)
            if p.grad is not None:
                p.grad = p.grad.new_empty(0)
        self.pool.free()

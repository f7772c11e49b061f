"""Host-resident model state: the three copies of every weight.

* the **optimizer copy**: the user's own parameters, on the host, untouched in
  name, dtype and identity (``state_dict`` keys do not change);
* the **master copy**: the weights in the compute dtype in host memory that
  devices upload from: views into flat buffers in layer order (page-locked
  when CUDA is present), one for the frozen weights and one for the trainable
  ones, so a stage's weights go up in at most two copies. A frozen
  parameter already in the compute dtype (the base model of LoRA loaded in
  bf16) is its own master copy: its data moves into the flat buffer instead of
  being copied there, so the host holds such weights once, not twice. With
  ``copies=2`` (the asynchronous optimizer's default) the trainable weights
  have two master copies, one per parity of the weights' *version* (the
  number of updates they include): an update writes the copy no running
  window reads, so its weight copies need not wait for the next window;
* per trainable parameter an fp32 **gradient buffer** on the host that device
  gradients are added into (also one flat buffer). The
  buffers live as long as the engine: the first gradient of a window is
  copied in, later ones added, so nothing is allocated or zero-filled per
  step. Frozen parameters have none and never cause gradient traffic.

Workers never touch the user's modules: each keeps a *replica* of every layer,
a structural copy whose parameters are placeholders that are pointed at
uploaded device tensors for the duration of a stage.
"""

from __future__ import annotations

import copy
import logging
import math
import mmap
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from ..plan import LayerCosts, StagePlan

__all__ = [
    "HostState",
    "LayerReplica",
    "LayoutChanged",
    "gradient_bytes",
    "host_available",
    "pinned_bytes",
    "plan_staging_bytes",
    "staging_bytes",
    "state_bytes",
    "within_staging",
]

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


def _anonymous(nbytes: int) -> mmap.mmap:
    """``nbytes`` of private anonymous memory (as malloc would map; Python's
    default is a shared mapping, whose pages ``MADV_DONTNEED`` does not free)."""
    private = getattr(mmap, "MAP_PRIVATE", None)
    if private is None:  # Windows: no flags
        return mmap.mmap(-1, nbytes)
    return mmap.mmap(-1, nbytes, flags=private | mmap.MAP_ANONYMOUS)


class _Arena:
    """One flat host buffer holding many tensors, without rounding waste.

    ``pin_memory()`` goes through the caching host allocator, which rounds each
    block up to a power of two (a 300 MB layer would take 512 MB). Here every
    tensor is a view into one flat buffer of exactly the bytes needed (each
    tensor 512-byte aligned), registered once with the CUDA driver
    (``cudaHostRegister``) when ``pinned`` and unregistered on :meth:`release`.
    If registration fails the buffer stays pageable: transfers are slower but
    correct. Contiguous tensors are one contiguous byte range, so a run of
    them is copied with one ``copy_``.

    The buffer is an anonymous memory map (zero-filled by the OS on first
    touch) rather than a torch allocation, for two reasons: :meth:`own` can hand
    out tensors with a storage of their own inside it (what a user's parameter
    living here needs: ``torch.save`` and safetensors see one tensor per
    storage), and :meth:`free` can return the pages nothing lives in any more
    while such tensors keep the mapping."""

    ALIGN = 512

    def __init__(self, pinned: bool) -> None:
        self.enabled = pinned and torch.cuda.is_available()
        self.buffer: torch.Tensor | None = None
        self.offsets: list[int] = []
        self.registered = False
        self._map: mmap.mmap | None = None

    def allocate(self, shapes: Sequence[torch.Size], dtype: torch.dtype) -> list[torch.Tensor]:
        """Zero-filled tensors of ``shapes`` in ``dtype``, as views into one buffer."""
        size = torch.empty(0, dtype=dtype).element_size()
        offsets, total = [], 0
        for shape in shapes:
            offsets.append(total)
            nbytes = math.prod(shape) * size
            total += -(-nbytes // self.ALIGN) * self.ALIGN
        self._map = _anonymous(max(total, self.ALIGN))
        buf = torch.frombuffer(self._map, dtype=torch.uint8)
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
                    "cudaHostRegister of %d bytes failed (%s); host copies stay in pageable "
                    "memory and transfers will be slower",
                    buf.numel(),
                    err,
                )
        self.buffer = buf
        self.offsets = offsets
        return [
            buf[off : off + math.prod(shape) * size].view(dtype).view(shape)
            for shape, off in zip(shapes, offsets, strict=True)
        ]

    def own(self, view: torch.Tensor) -> torch.Tensor:
        """The same memory as ``view`` (a contiguous view into the buffer), as a
        tensor with a storage of its own: it keeps the mapping alive, and
        saving it writes its bytes only, not the whole buffer."""
        assert self._map is not None and self.buffer is not None and view.numel() > 0
        start = view.data_ptr() - self.buffer.data_ptr()
        nbytes = view.numel() * view.element_size()
        memory = memoryview(self._map)[start : start + nbytes]
        return torch.frombuffer(memory, dtype=torch.uint8).view(view.dtype).view(view.shape)

    @property
    def nbytes(self) -> int:
        """Page-locked bytes held (0 when pageable)."""
        return self.buffer.numel() if self.buffer is not None and self.registered else 0

    def free(self, keep: Sequence[tuple[int, int]] = ()) -> None:
        """Unpin and drop the buffer. ``keep``: byte ranges ``(offset, nbytes)``
        of tensors from :meth:`own` that outlive it (a user's parameters): the
        mapping stays as long as they do, so the whole pages outside them are
        given back to the OS now."""
        self.release()
        advise = getattr(mmap, "MADV_DONTNEED", None)
        if keep and self._map is not None and advise is not None:
            page, start = mmap.PAGESIZE, 0
            for offset, nbytes in [*sorted(keep), (len(self._map), 0)]:
                lo, hi = -(-start // page) * page, offset // page * page
                if hi > lo:
                    self._map.madvise(advise, lo, hi - lo)
                start = max(start, offset + nbytes)
        self.buffer = None
        self._map = None

    def release(self) -> None:
        if self.registered and self.buffer is not None:
            err = torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            if int(err) != 0:  # pragma: no cover - needs a GPU
                log.warning("cudaHostUnregister failed: %s", err)
            self.registered = False
            _count_registered(-self.buffer.numel())


@dataclass
class _Param:
    """One distinct parameter of the model (tied parameters appear once).

    ``masters``: its master copies, one per version parity for a trainable
    parameter with two copies, else one (``master`` is the first); ``offset``
    is their byte offset in their arenas (the frozen one, or each trainable
    one: the same layout); ``filled`` says whether ``grad`` holds gradients of
    the current window (the first one is copied in, so the buffer is never
    zero-filled); ``shared``: the parameter's data is its master copy (frozen,
    in the compute dtype)."""

    index: int
    param: nn.Parameter
    masters: tuple[torch.Tensor, ...]
    grad: torch.Tensor | None
    offset: int = 0
    filled: bool = False
    shared: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def master(self) -> torch.Tensor:
        """The (first) master copy: shape, dtype, and the weights of even versions."""
        return self.masters[0]

    def master_for(self, version: int) -> torch.Tensor:
        """The master copy that holds the weights after ``version`` updates."""
        return self.masters[version % len(self.masters)]

    @property
    def trainable(self) -> bool:
        return self.grad is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the master copy."""
        return self.master.numel() * self.master.element_size()


@dataclass(frozen=True)
class Span:
    """The master copies of a stage's parameters as they go up: one device
    buffer of ``nbytes`` filled from two byte ranges, ``frozen`` (offset and
    length in the frozen arena, at the buffer's start) and ``trained``
    (offset and length in a trainable arena, at ``trained_at`` in the buffer),
    holding ``inside`` (each parameter with its offset in the buffer), plus
    ``outside``: parameters first used by an earlier layer (tied weights),
    uploaded on their own."""

    nbytes: int
    frozen: tuple[int, int]
    trained: tuple[int, int]
    trained_at: int
    inside: tuple[tuple[_Param, int], ...]
    outside: tuple[_Param, ...]

    def views(self, flat: torch.Tensor, dtype: torch.dtype) -> dict[int, torch.Tensor]:
        """Each inside parameter as a view of ``flat``, a copy of the range."""
        typed = flat.view(dtype)
        size = typed.element_size()
        out = {}
        for p, off in self.inside:
            shape = p.master.shape
            out[p.index] = typed.as_strided(shape, p.master.stride(), off // size)
        return out


@dataclass
class _Slot:
    """Where a tensor sits inside a layer: ``layer.get_submodule(path).attr``."""

    path: str
    attr: str
    index: int  # parameter index, or buffer index within the layer


def _tensors(layer: nn.Module):
    yield from layer.parameters()
    yield from (b for b in layer.buffers() if b is not None)


def _storage(t: torch.Tensor) -> int | None:
    """Where a plain strided tensor's storage starts (None for others: sparse,
    subclasses, whose storage is not one buffer; they are never moved)."""
    if t.layout != torch.strided or type(t.data) is not torch.Tensor:
        return None
    return t.untyped_storage().data_ptr()


def _shareable(p: nn.Parameter, dtype: torch.dtype, storages: Counter) -> bool:
    """Whether the parameter's data can move into the arena as its own master
    copy: frozen (nothing writes it), already in the compute dtype, a plain
    tensor, and alone in its storage (no other tensor of the model sees it, so
    no aliasing is broken when its data moves)."""
    return (
        not p.requires_grad
        and p.dtype == dtype
        and p.numel() > 0
        and type(p) is nn.Parameter
        and type(p.data) is torch.Tensor
        and (at := _storage(p)) is not None
        and storages[at] == 1
    )


def _split_name(name: str) -> tuple[str, str]:
    path, _, attr = name.rpartition(".")
    return path, attr


class LayoutChanged(ValueError):
    """A pipeline layer's parameters or buffers are not those it had when the
    engine was built (added, removed, renamed, or a parameter replaced by a
    new one): the engine's master copies and gradient buffers no longer
    match it. Build a new engine (RoundPipeStrategy does so between steps)."""


class _LayerInfo:
    def __init__(
        self,
        index: int,
        module: nn.Module,
        params: dict[int, int],
        owners: Sequence[nn.Module] = (),
    ) -> None:
        self.index = index
        self.module = module
        #: modules that hold the layers (see RoundPipeEngine's ``owners``)
        self.owners = owners
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
        self._layout = self._layout_now()
        # the states of the layer's modules seen so far, the current one first
        self._structures = [_Structure(self)]

    def _layout_now(self) -> tuple[list[tuple[str, int]], list[str]]:
        """The layer's parameters (name and identity) and buffers (names)."""
        m = self.module
        return (
            [(n, id(p)) for n, p in m.named_parameters(remove_duplicate=False)],
            [n for n, b in m.named_buffers(remove_duplicate=False) if b is not None],
        )

    def structure(self) -> _Structure:
        """The state of the layer's modules now (their attributes, hooks and
        buffer tensors), for a call submitted now: the current one while
        nothing changed (one comparison per module), an earlier one the layer
        went back to (an adapter switched off and on again), else a new one.
        Raises :class:`LayoutChanged` when the parameters or buffers changed."""
        current = self._structures[0]
        if current.holds():
            return current
        for k, earlier in enumerate(self._structures[1:], 1):
            if earlier.holds():
                self._structures.insert(0, self._structures.pop(k))
                return earlier
        self.check_layout()
        new = _Structure(self)
        log.debug("pipeline layer %d changed outside the pipeline: new replicas", self.index)
        self._structures = [new, *self._structures[: _STRUCTURES - 1]]
        return new

    def layout_change(self) -> str | None:
        """What changed in the layer's parameters or buffers since the engine
        was built, or None."""
        if self._structures[0].same_tables():
            return None
        (params, buffers), (params_now, buffers_now) = self._layout, self._layout_now()
        if params == params_now and buffers == buffers_now:
            return None
        was, now = dict(params), dict(params_now)
        gone = [n for n in was if n not in now] + [n for n in buffers if n not in buffers_now]
        new = [n for n in now if n not in was] + [n for n in buffers_now if n not in buffers]
        replaced = [n for n, i in now.items() if n in was and was[n] != i]
        parts = [
            f"{what} {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
            for what, names in (("added", new), ("removed", gone), ("replaced", replaced))
            if names
        ]
        return "; ".join(parts) or "their order changed"

    def forget_structures(self) -> None:
        """New replicas from the layer as it is now (an attribute object
        changed in place, which the comparison of attributes cannot see)."""
        self._structures = [_Structure(self)]

    def check_layout(self) -> None:
        change = self.layout_change()
        if change is not None:
            raise LayoutChanged(
                f"the parameters or buffers of pipeline layer {self.index} "
                f"({type(self.module).__name__}) changed after the engine was built ({change}); "
                "close it and build a new engine (RoundPipeStrategy does so itself between "
                "steps)"
            )

    @property
    def has_state(self) -> bool:
        """Whether the layer has persistent buffers (e.g. running statistics)
        whose updates must come back to the host."""
        return any(self.persistent)


_STRUCTURES = 4  # states of a layer kept with their replicas (a toggled adapter: 2)


def _refers_to(hook: object, modules: set[int]) -> bool:
    """Whether a hook is one of the layer's modules, a method of one, or a
    ``functools.partial`` holding one: such a hook belongs to the layer and
    is copied with it (it must run on the replica, not on the host module)."""
    held = [hook, getattr(hook, "__self__", None)]
    held += [*getattr(hook, "args", ()), *getattr(hook, "keywords", {}).values()]
    return any(id(x) in modules for x in held if x is not None)


def _derived_attribute(hook: object) -> str | None:
    """The attribute a forward pre-hook of torch's sets from the module's
    weights on every call (pruning, the old-style ``weight_norm``), or None."""
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.weight_norm import WeightNorm

    if isinstance(hook, BasePruningMethod):
        return hook._tensor_name
    if isinstance(hook, WeightNorm):
        return hook.name
    return None


# PEFT's hooks that hand every adapted layer per-sample values of the whole
# batch (mixed-adapter batches: adapter_names=; activated LoRA's offsets)
_WHOLE_BATCH_HOOKS = {
    "_adapter_names_pre_forward_hook": "adapter_names= (a different adapter per sample)",
    "_alora_offsets_pre_forward_hook": "activated LoRA (alora_invocation_tokens)",
}


def _refuse_whole_batch_hook(hook: object, info: _LayerInfo, module: nn.Module) -> None:
    """Refuse a hook that passes a layer per-sample values of the whole batch:
    the pipeline runs each layer once per micro-batch."""
    name = getattr(getattr(hook, "func", hook), "__name__", "")
    what = _WHOLE_BATCH_HOOKS.get(name)
    if what is not None:
        raise ValueError(
            f"PEFT's {what} is not supported with RoundPipe: PEFT hands every adapted "
            f"layer (here {type(module).__name__} in pipeline layer {info.index}) values "
            "for each sample of the whole batch, and the pipeline runs layers once per "
            "micro-batch. Use one adapter per call (model.set_adapter) and a plain LoRA "
            "config, or strategy='auto' for this model"
        )


def _attributes(module: nn.Module) -> dict[str, object]:
    """A module's attributes as they are now, containers copied one level
    (hook tables, parameter, buffer and submodule tables, an adapter's
    per-adapter settings), so that a change inside one shows."""
    return {
        k: copy.copy(v) if isinstance(v, (dict, list, set)) else v
        for k, v in module.__dict__.items()
    }


def _equal(now: dict[str, object], seen: dict[str, object]) -> bool:
    """Dict equality, values by identity first (a C-level loop); a tensor
    replaced by another is compared elementwise, which has no truth value:
    unequal then."""
    try:
        return now == seen
    except Exception:
        return False


def _refuse_special_parameters(index: int, layer: nn.Module) -> None:
    """Master copies hold a parameter's values in the compute dtype and the
    workers rebind them as plain ``nn.Parameter``s: a parameter subclass
    carrying more than its values (a quantized weight's scales and packing,
    a lazy module's placeholder) or an integer parameter would compute
    something else on the workers. Refused, naming it."""
    for name, p in layer.named_parameters():
        kind = type(p)
        if kind is nn.Parameter and (p.is_floating_point() or p.is_complex()):
            continue
        what = (
            f"of type {kind.__module__}.{kind.__name__}"
            if kind is not nn.Parameter
            else f"of dtype {p.dtype}"
        )
        hint = (
            "a lazy module's parameter: run one forward (or build the module with its sizes) "
            "before training"
            if isinstance(p, nn.parameter.UninitializedParameter)
            else "quantized bases (bitsandbytes 4-/8-bit as in QLoRA, torchao, GPTQ, AWQ) are "
            "not supported: load the base model in bf16 (torch_dtype=torch.bfloat16) for LoRA"
        )
        raise TypeError(
            f"pipeline layer {index} ({type(layer).__name__}) has parameter {name!r} {what}; "
            f"RoundPipe keeps plain floating-point nn.Parameters only ({hint})"
        )


def _apart(module: nn.Module, own: set[int]) -> bool:
    """Whether ``module`` holds none of a layer's modules (``own``) and no
    trainable weight."""
    return not any(id(m) in own for m in module.modules()) and not any(
        p.requires_grad for p in module.parameters()
    )


def _copy_layer(info: _LayerInfo, memo: dict[int, object]) -> nn.Module:
    """``copy.deepcopy`` of the layer with ``memo``; an attribute that cannot
    be copied (a lock, an open file) is refused with what to change."""
    try:
        return copy.deepcopy(info.module, memo)
    except Exception as exc:
        raise TypeError(
            f"pipeline layer {info.index} ({type(info.module).__name__}) cannot be copied "
            f"for the workers: {type(exc).__name__}: {exc}. Each worker runs a private copy "
            "of every pipeline layer (copy.deepcopy, weights aside); keep objects that cannot "
            "be deep-copied (locks, open files, sockets) out of the layers' attributes, e.g. "
            "on the LightningModule"
        ) from exc


class _Structure:
    """One state of a layer's modules, as replicas copy it: attributes, hooks,
    submodules and buffer tensors. A worker's replica is made from
    ``template``, a copy of the layer taken on the submitting thread with
    empty stand-ins for its weights and buffers."""

    def __init__(self, info: _LayerInfo) -> None:
        module = info.module
        self.modules = list(module.modules())
        self._seen = [_attributes(m) for m in self.modules]
        # attributes a forward pre-hook computes from the weights on every call
        # (pruning's masked weight, weight_norm's weight): the host module never
        # runs, so each call computes them there too (see refresh)
        self._derived = [
            (seen, m, hook, name)
            for m, seen in zip(self.modules, self._seen, strict=True)
            for hook in m._forward_pre_hooks.values()
            if (name := _derived_attribute(hook)) is not None
        ]
        #: the host tensors of the layer's buffers now (a replaced buffer's new one)
        self.buffers: list[torch.Tensor] = list(info.buffers)
        for s in info.buffer_slots:
            self.buffers[s.index] = module.get_submodule(s.path)._buffers[s.attr]
        #: what replicas share with the host instead of copying (see below)
        self.shared: dict[int, object] = {}
        fixed: dict[int, object] = {}
        for p in module.parameters():
            fixed[id(p)] = nn.Parameter(torch.empty(0), requires_grad=p.requires_grad)
        for b in self.buffers:
            fixed[id(b)] = torch.empty(0)
        # hooks are shared, not copied: one registered by a method of the
        # user's objects (a callback, the LightningModule) runs on those
        # objects, as it would without the pipeline, not on copies of them
        own = {id(m) for m in self.modules}
        for m in self.modules:
            for name, value in m.__dict__.items():
                if "hooks" in name and isinstance(value, dict):
                    for hook in value.values():
                        _refuse_whole_batch_hook(hook, info, m)
                        if callable(hook) and not _refers_to(hook, own):
                            self.shared[id(hook)] = hook
                # a tensor attribute computed with autograd (pruning's masked
                # weight, which its pre-hook computes again on every call) has
                # no deep copy: its value is shared
                elif isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    fixed[id(value)] = value.detach()
        # the modules that hold the layers (the LightningModule, the model)
        # are shared, never copied: a back-reference to one would copy all it
        # holds (every other layer, the Trainer) per template and per worker,
        # and the layer would act on the copy
        self.shared.update({id(o): o for o in info.owners if id(o) not in own})
        memo = {**fixed, **self.shared}
        self.template = _copy_layer(info, memo)
        # so is any other module an attribute refers to that has nothing the
        # layer trains or is made of (a helper wrapping one of the layer's own
        # modules, or holding trainable weights, is the layer's state: copied)
        outside = {
            id(o): o
            for o in memo.get(id(memo), ())  # (deepcopy keeps the originals it copied there)
            if isinstance(o, nn.Module) and id(o) not in own and _apart(o, own)
        }
        if outside:
            self.shared.update(outside)
            self.template = _copy_layer(info, {**fixed, **self.shared})

    def holds(self) -> bool:
        """Whether every module's attributes are still what they were (the
        train/eval flag aside: each call takes it with :meth:`modes`)."""
        for seen, m, _, name in self._derived:
            seen[name] = m.__dict__.get(name)
        for m, seen in zip(self.modules, self._seen, strict=True):
            now = m.__dict__
            seen["training"] = now.get("training")
            if not _equal(now, seen):
                return False
        return True

    def same_tables(self) -> bool:
        """Whether every module's parameter, buffer and submodule tables are
        still what they were (the cheap part of :meth:`holds`: the layout)."""
        tables = ("_parameters", "_buffers", "_modules")
        return all(
            _equal(m.__dict__[t], seen[t])
            for m, seen in zip(self.modules, self._seen, strict=True)
            for t in tables
        )

    def refresh(self) -> None:
        """Compute the attributes the layer's forward pre-hooks derive from its
        weights on the host module too, as its own forward would now (a
        reader such as global pruning's importance sees the current value)."""
        for _, m, hook, _ in self._derived:
            hook(m, ())

    def modes(self) -> tuple[bool, ...]:
        """The train/eval flag of each of the layer's modules now. A call takes
        them when it is submitted, so its tasks run in the mode the caller was
        in, however late they start (the training loop may switch to ``eval()``
        for validation while backward stages are still queued)."""
        return tuple(m.training for m in self.modules)


def _running_statistic(owner: nn.Module, attr: str) -> bool:
    """A normalization's running statistics: updated by a training forward
    that does not read them (so a recompute reading the update is harmless)."""
    return isinstance(owner, nn.modules.batchnorm._NormBase) and attr in (
        "running_mean",
        "running_var",
        "num_batches_tracked",
    )


def _chosen_from_inputs(owner: nn.Module, attr: str) -> bool:
    """Hugging Face's LongRoPE frequencies: every forward copies the long or
    the short set into ``inv_freq`` (``{layer_type}_inv_freq``) before
    reading it, chosen by the call's positions alone, so a recompute reads
    what its forward read (Phi-3, Phi-3.5, Phi-4-mini)."""
    kinds = getattr(owner, "rope_type", None)
    kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
    return attr.endswith("inv_freq") and "longrope" in kinds


def _rope_type(owner: nn.Module) -> str:
    """A rotary embedding's ``rope_type`` for an error message ('' elsewhere)."""
    kind = getattr(owner, "rope_type", None)
    return f", rope_type={kind!r}" if isinstance(kind, (str, dict)) else ""


def _batch_norm_in_fp32(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A replica's batch norm under a 16-bit compute dtype: in fp32 (its
    weights cast up, its input too, its output back), so its fp32 running
    statistics are updated in fp32, as under torch's autocast and FSDP's
    mixed precision (in the compute dtype it failed on them)."""
    forward = type(module).forward
    params = module._parameters

    def run(x: torch.Tensor) -> torch.Tensor:
        saved = {k: p for k in ("weight", "bias") if (p := params.get(k)) is not None}
        try:
            for k, p in saved.items():
                params[k] = p.float()  # (differentiable: the gradient reaches the weight)
            return forward(module, x.float()).to(x.dtype)
        finally:
            params.update(saved)

    return run


class LayerReplica:
    """A worker's private structural copy of one layer, in one state of its
    modules (:class:`_Structure`).

    ``bind`` points its parameters and buffers at device tensors; ``unbind``
    drops them again so the device memory can be reused."""

    def __init__(
        self, info: _LayerInfo, structure: _Structure, compute_dtype: torch.dtype = torch.float32
    ) -> None:
        self.module = copy.deepcopy(structure.template, dict(structure.shared))
        if compute_dtype != torch.float32:
            for m in self.module.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.forward = _batch_norm_in_fp32(m)
        self.info = info
        self.structure = structure
        self._param_owners = [
            (self.module.get_submodule(s.path), s.attr, s.index) for s in info.param_slots
        ]
        self._buffer_owners = [
            (self.module.get_submodule(s.path), s.attr, s.index) for s in info.buffer_slots
        ]
        self._placeholders = [(m, a, m._parameters[a]) for m, a, _ in self._param_owners]
        self._modules = list(self.module.modules())
        #: recomputes part of itself in its backward when training (transformers'
        #: gradient checkpointing), which restores the generator's state for it
        self.checkpointed = any(
            getattr(m, "gradient_checkpointing", False) is True for m in self._modules
        )

    def bind(
        self,
        weights: dict[int, nn.Parameter],
        buffers: Sequence[torch.Tensor],
        modes: Sequence[bool],
    ) -> None:
        """Point the replica at device tensors; ``modes``: the train/eval flag of
        each submodule (:meth:`_Structure.modes`) when the call was submitted."""
        for replica, training in zip(self._modules, modes, strict=True):
            replica.training = training
        for owner, attr, idx in self._param_owners:
            owner._parameters[attr] = weights[idx]
        for owner, attr, idx in self._buffer_owners:
            owner._buffers[attr] = buffers[idx]
        self._watch()

    def _watch(self) -> None:
        """Note the bound buffers and their version counters (see
        :meth:`state_change`)."""
        self._bound = [
            (owner._buffers[attr], owner._buffers[attr]._version)
            for owner, attr, _ in self._buffer_owners
        ]

    def state_change(self, recomputed: bool) -> str | None:
        """What the layer's calls since the buffers were bound changed that
        the pipeline cannot follow, or None: a buffer replaced by a new tensor
        (the replica would keep state the host never sees, as dynamic RoPE's
        rescaled frequencies), or, when the layer is computed again for its
        backward (``recomputed``), a buffer changed in place other than a
        normalization's running statistics (the recompute would read the
        updated state, so the gradient would belong to another forward than
        the loss: spectral norm's power iteration, a counter; not LongRoPE's
        frequencies, set from the call's positions before they are read)."""
        for (owner, attr, _), slot, (bound, version) in zip(
            self._buffer_owners, self.info.buffer_slots, self._bound, strict=True
        ):
            now = owner._buffers[attr]
            name = f"{slot.path}.{attr}" if slot.path else attr
            what = f"{type(owner).__name__}{_rope_type(owner)}"
            if now is not bound:
                return f"replaced its buffer {name} ({what}) with a new tensor"
            if (
                recomputed
                and now._version != version
                and not _running_statistic(owner, attr)
                and not _chosen_from_inputs(owner, attr)
            ):
                return f"changed its buffer {name} ({what}) in place"
        return None

    def current_buffers(self) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(self.structure.buffers)
        for owner, attr, idx in self._buffer_owners:
            out[idx] = owner._buffers[attr]
        return out  # type: ignore[return-value]

    def restore_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Point the replica's buffers at ``buffers`` again (copies taken with
        :meth:`current_buffers` before a call whose updates must not count)."""
        for owner, attr, idx in self._buffer_owners:
            owner._buffers[attr] = buffers[idx]
        self._watch()

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
        pinned: page-lock the master copies (CUDA).
        copies: master copies of each trainable weight: 1, or 2 (one per
            version parity, for the asynchronous optimizer's overlapped weight
            copies; costs the trainable weights once more in the compute dtype).
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        compute_dtype: torch.dtype,
        pinned: bool = False,
        copies: int = 1,
        owners: Sequence[nn.Module] = (),
    ) -> None:
        if copies not in (1, 2):
            raise ValueError(f"copies must be 1 or 2, got {copies!r}")
        self.compute_dtype = compute_dtype
        self.copies = copies
        self.pool = _Arena(pinned)  # the frozen weights' master copies
        # the trainable weights' master copies, one arena per version parity
        self.train_pools = [_Arena(pinned) for _ in range(copies)]
        # gradients come down into pinned staging and are added here on the host:
        # these buffers are never a copy's target, so they stay pageable
        self.grad_pool = _Arena(False)
        unique: list[nn.Parameter] = []
        index: dict[int, int] = {}
        self._first: list[int] = []  # first parameter index introduced by each layer
        for k, layer in enumerate(layers):
            _refuse_special_parameters(k, layer)
        for layer in layers:
            layer.to("cpu")
            self._first.append(len(unique))
            for p in layer.parameters():
                if id(p) not in index:
                    index[id(p)] = len(unique)
                    unique.append(p)
        self._first.append(len(unique))
        distinct = {id(t): t for layer in layers for t in _tensors(layer)}
        storages = Counter(_storage(t) for t in distinct.values())
        del distinct
        frozen = [p for p in unique if not p.requires_grad]
        trainable = [p for p in unique if p.requires_grad]
        # the arenas' pages are committed as they are written: one parameter at
        # a time, a frozen one in the compute dtype moved (its master is its
        # data; its old storage is freed as it goes), so the host never holds
        # such weights twice
        fixed = iter(self.pool.allocate([p.shape for p in frozen], compute_dtype))
        fixed_at = iter(self.pool.offsets)
        arenas = [a.allocate([p.shape for p in trainable], compute_dtype) for a in self.train_pools]
        trained = iter(zip(*arenas, strict=True))
        trained_at = iter(self.train_pools[0].offsets)
        grads = iter(self.grad_pool.allocate([p.shape for p in trainable], torch.float32))
        self.params: list[_Param] = []
        with torch.no_grad():
            for i, p in enumerate(unique):
                if p.requires_grad:
                    masters = next(trained)
                    for m in masters:
                        m.copy_(p.detach())
                    # zero-filled once here; later windows copy their first gradient in
                    hp = _Param(i, p, masters, next(grads), offset=next(trained_at))
                else:
                    m = next(fixed)
                    m.copy_(p.detach())
                    hp = _Param(i, p, (m,), None, offset=next(fixed_at))
                    if _shareable(p, compute_dtype, storages):
                        hp.masters = (self.pool.own(m),)
                        p.data = hp.master
                        hp.shared = True
                self.params.append(hp)
        self.layers = [_LayerInfo(i, m, index, owners) for i, m in enumerate(layers)]
        self._spans: dict[tuple[int, int], Span] = {}
        self._stage_params: dict[tuple[int, int], list[_Param]] = {}

    # ------------------------------------------------------------- queries
    def stage_params(self, start: int, stop: int) -> list[_Param]:
        """Distinct parameters of layers ``[start, stop)`` (cached: asked per task)."""
        key = (start, stop)
        got = self._stage_params.get(key)
        if got is None:
            ids = dict.fromkeys(i for info in self.layers[start:stop] for i in info.param_ids)
            got = self._stage_params[key] = [self.params[i] for i in ids]
        return got

    def span(self, start: int, stop: int) -> Span:
        """Where the master copies of layers ``[start, stop)`` lie in the arena
        (cached: asked per task).

        Parameters are stored in the order layers first use them, so those a
        stage introduces are one contiguous range."""
        key = (start, stop)
        got = self._spans.get(key)
        if got is None:
            got = self._spans[key] = self._span(start, stop)
        return got

    def _span(self, start: int, stop: int) -> Span:
        a, b = self._first[start], self._first[stop]
        introduced = self.params[a:b]
        ranges, placed, at = [], [], 0
        # the frozen weights first, then the trainable ones (aligned)
        for trainable in (False, True):
            group = [p for p in introduced if p.trainable == trainable]
            offset = group[0].offset if group else 0
            nbytes = group[-1].offset + group[-1].nbytes - offset if group else 0
            ranges.append((offset, nbytes, at))
            placed += [(p, at + p.offset - offset) for p in group]
            at += -(-nbytes // _Arena.ALIGN) * _Arena.ALIGN
        (f_off, f_len, _), (t_off, t_len, t_at) = ranges
        outside = tuple(p for p in self.stage_params(start, stop) if not a <= p.index < b)
        return Span(t_at + t_len, (f_off, f_len), (t_off, t_len), t_at, tuple(placed), outside)

    def sources(self, span: Span, version: int) -> list[tuple[int, torch.Tensor]]:
        """The host byte ranges a stage's device buffer is filled from for the
        weights after ``version`` updates: ``(offset in the buffer, bytes)``
        pairs (one or two; empty ranges left out)."""
        out = []
        f_off, f_len = span.frozen
        if f_len:
            assert self.pool.buffer is not None
            out.append((0, self.pool.buffer[f_off : f_off + f_len]))
        t_off, t_len = span.trained
        if t_len:
            arena = self.train_pools[version % self.copies].buffer
            assert arena is not None
            out.append((span.trained_at, arena[t_off : t_off + t_len]))
        return out

    @property
    def first_params(self) -> list[int]:
        """Index of the first parameter each layer introduces (plus one past
        the last): layer ``i`` introduces ``params[first[i]:first[i + 1]]``."""
        return self._first

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
    def accumulate(self, p: _Param, grad: torch.Tensor, factor: float = 1.0) -> None:
        """Add ``factor * grad`` into the fp32 buffer (thread-safe): the window's
        first is copied in, later ones added."""
        assert p.grad is not None
        with p.lock:
            if p.filled:
                p.grad.add_(grad, alpha=factor)
            elif factor == 1.0:
                p.grad.copy_(grad)
            else:
                torch.mul(grad, factor, out=p.grad)
            p.filled = True

    def window_grad(self, p: _Param) -> torch.Tensor | None:
        """The window's gradient of ``p``, or None when nothing was added (no
        backward reached the parameter: autograd would leave ``.grad`` None,
        and optimizers skip such parameters, weight decay included)."""
        assert p.grad is not None
        with p.lock:
            return p.grad if p.filled else None

    def expose_grads(self) -> None:
        """Point every trainable parameter's ``.grad`` at its accumulated gradient."""
        for p in self.params:
            if p.grad is None:
                continue
            g = self.window_grad(p)
            if g is not None:
                p.param.grad = g if p.param.dtype == torch.float32 else g.to(p.param.dtype)

    def zero_grads(self) -> None:
        """Empty every buffer (the next gradient is copied in)."""
        for p in self.params:
            with p.lock:
                p.filled = False

    def detach_grads(self) -> None:
        """``.grad = None`` on every trainable parameter (as between steps)."""
        for p in self.params:
            if p.trainable:
                p.param.grad = None

    def refresh_masters(self, params: Iterable[_Param] | None = None) -> None:
        """Copy the optimizer copy into every master copy of ``params`` (default
        all: the parameters were changed outside a step; a parameter whose
        data is its master has nothing to copy)."""
        with torch.no_grad():
            for p in self.params if params is None else params:
                for m in p.masters:
                    if m.data_ptr() != p.param.data_ptr():
                        m.copy_(p.param.detach())

    def host_bytes(self) -> dict[str, int]:
        """Host memory held by the engine, by kind (for reports): ``master``
        the master copies, ``shared`` those that are the parameters' own data
        (not an extra copy: part of ``master``), ``grad`` the gradient
        buffers, ``pinned`` how much of it is page-locked."""
        return {
            "master": sum(p.nbytes * len(p.masters) for p in self.params),
            "shared": sum(p.nbytes for p in self.params if p.shared),
            "grad": sum(p.grad.numel() * 4 for p in self.params if p.grad is not None),
            "pinned": sum(a.nbytes for a in self._arenas()),
        }

    def _arenas(self) -> list[_Arena]:
        return [self.pool, *self.train_pools, self.grad_pool]

    def release(self) -> None:
        for arena in self._arenas():
            arena.release()

    def free(self) -> None:
        """Unpin and drop the master copies and gradient buffers (the engine is
        closed and its workers joined): a closed engine that something still
        refers to (an autograd graph, an exception's traceback) no longer holds
        a copy of the model. The user's parameters keep their values: those
        that are their own master copy keep their part of the buffer."""
        keep = [(p.offset, p.nbytes) for p in self.params if p.shared]
        for p in self.params:
            p.masters = tuple(m.new_empty(0) for m in p.masters)
            if p.grad is not None:
                p.grad = p.grad.new_empty(0)
        self.pool.free(keep)
        for arena in [*self.train_pools, self.grad_pool]:
            arena.free()


def state_bytes(
    params: Iterable[tuple[int, torch.dtype, bool]],
    compute_dtype: torch.dtype,
    copies: int = 1,
    *,
    include_params: bool = True,
    moments: bool = True,
) -> int:
    """Host bytes of the training state for distinct parameters given as
    ``(numel, dtype, trainable)``: the parameter itself (``include_params``);
    per trainable one ``copies`` master copies in ``compute_dtype``, the fp32
    gradient buffer and (``moments``) two Adam moments in its dtype; per
    frozen one a master copy unless it is in ``compute_dtype`` (then it is its
    own). One accounting for the engine's budgets and ``plan estimate``."""
    size = compute_dtype.itemsize
    total = 0
    for numel, dtype, trainable in params:
        own = dtype.itemsize
        per = own if include_params else 0
        if trainable:
            per += size * copies + 4 + (2 * own if moments else 0)
        elif dtype != compute_dtype:
            per += size
        total += numel * per
    return total


def staging_bytes(stage_grad_bytes: Sequence[int], devices: int) -> int:
    """Page-locked host bytes that CUDA gradient downloads keep, for stages
    whose fp32 gradients take ``stage_grad_bytes`` (those with none left out)
    on ``devices`` GPUs. Each stage's gradients come down in one buffer from
    torch's caching host allocator, which rounds it up to a power of two and
    keeps it for the next download of that size class; the courier adds a
    download into the host buffers and drops it soon after it lands, so each
    GPU's worker holds about one block of each class its stages use (at most
    one per such stage). An estimate: gradients held back by the ordering
    rules (a slow update) can take more for a while."""
    classes: Counter[int] = Counter(1 << (n - 1).bit_length() for n in stage_grad_bytes if n > 0)
    return sum(size * min(devices, count) for size, count in classes.items())


def gradient_bytes(layers: Sequence[nn.Module]) -> list[int]:
    """fp32 gradient bytes of each layer's trainable parameters, a parameter
    shared by several layers (tied weights) counted in the first that uses it,
    as the host keeps one gradient buffer for it."""
    seen: set[int] = set()
    out = []
    for layer in layers:
        n = 0
        for p in layer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel() * 4 if p.requires_grad else 0
        out.append(n)
    return out


def plan_staging_bytes(plan: StagePlan, layer_grad_bytes: Sequence[int], devices: int) -> int:
    """:func:`staging_bytes` of a plan's stages that compute gradients, from
    each layer's fp32 gradient bytes (:func:`gradient_bytes`)."""
    return staging_bytes(
        [sum(layer_grad_bytes[st.start : st.stop]) for st in plan.stages if st.kind != "forward"],
        devices,
    )


def within_staging(
    first: StagePlan,
    plan_for: Callable[[float], StagePlan],
    estimates: LayerCosts,
    layer_grad_bytes: Sequence[int],
    devices: int,
    room: float,
) -> tuple[StagePlan, float | None]:
    """A plan whose gradient staging (:func:`plan_staging_bytes`) fits
    ``room`` host bytes, and the stage-size cap it was planned within (None:
    ``first`` fits, or no smaller stages fit either; ``first`` is kept then).

    Larger stages stage more (a power of two per stage's gradients), so a
    short sequence, whose activations let the stages be large, can need more
    host memory than a long one. Where ``first`` stages too much, the cap on
    a stage's size (its size-based memory in ``estimates``, which
    ``plan_for(cap)`` plans within) falls by a factor of sqrt(2) from its largest stage's
    until the plan's staging fits, or ``plan_for`` finds no plan
    (:class:`PlanError`: the cap is below a layer)."""
    from ..plan import PlanError

    staged = plan_staging_bytes(first, layer_grad_bytes, devices)
    if staged <= room:
        return first, None
    cap = max(first.stage_memory(estimates))
    for _ in range(128):  # (a cap below every layer raises well before)
        cap /= math.sqrt(2)
        try:
            plan = plan_for(cap)
        except PlanError:
            break
        if plan_staging_bytes(plan, layer_grad_bytes, devices) <= room:
            return plan, cap
    return first, None


#: of the host memory available when an engine starts, less the training
#: state it and the optimizer will still allocate, what one micro-batch's
#: stage-boundary activations may take by default before a plan with fewer
#: boundaries is chosen (the rest: pinned staging buffers, the data
#: pipeline, the allocator's slack)
HOST_ACTIVATION_SHARE = 0.8


#: where a container's memory limit, usage and statistics are (cgroup v2, then v1)
CGROUP_MEMORY = (
    (
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory.current",
        "/sys/fs/cgroup/memory.stat",
    ),
    (
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        "/sys/fs/cgroup/memory/memory.stat",
    ),
)


def _inactive_file(stat_path: str) -> int:
    """Bytes of inactive file cache a cgroup's usage counts (the kernel gives
    them back under pressure; 0 where unknown)."""
    try:
        with open(stat_path, encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in ("inactive_file", "total_inactive_file"):
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def host_available(
    meminfo: str = "/proc/meminfo", cgroups: Sequence[tuple[str, str, str]] = CGROUP_MEMORY
) -> int | None:
    """Host memory this process can still use, in bytes (None where the OS does
    not say): Linux's ``MemAvailable`` (free memory plus what the page cache
    can give back; else the free pages), and no more than a container's
    memory limit (cgroup v2 or v1) leaves, its inactive file cache counted as
    free (as Kubernetes' working set does)."""
    found = None
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            found = None
    for limit_path, usage_path, stat_path in cgroups:
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is None or usage is None:
            continue
        if limit < 2**60:  # v1 writes a huge number for "no limit"
            room = max(limit - max(usage - _inactive_file(stat_path), 0), 0)
            found = room if found is None else min(found, room)
        break
    return found

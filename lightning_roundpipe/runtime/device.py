"""Per-device execution context: streams, events, RNG and pinned memory.

A CUDA worker owns a compute stream and four copy streams: activations up and
down at high priority (they are on the critical path), weights up and
gradients down at low priority. A CPU worker runs the same code with
:class:`_NullStream` and :class:`_NullEvent`, which do nothing: every CPU
operation is synchronous on the worker's thread.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import threading
from collections.abc import Iterator
from functools import cache
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..plan import LayerCosts, PlanError

__all__ = [
    "DeviceContext",
    "LayerRandomness",
    "as_device",
    "check_uniform",
    "holding_generator",
    "host_to_device_bandwidth",
    "layer_seed",
    "own_checkpoints",
    "pin",
    "seeded",
    "stage_memory_limit",
]

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64 finaliser: a well-spread 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def layer_seed(seed: int, iteration: int, layer: int, microbatch: int) -> int:
    """The RNG seed for one layer's forward on one micro-batch.

    Randomness (dropout) depends only on these four numbers, never on the device
    or the order in which workers ran, so results do not change with the
    number of devices and recompute reproduces the forward's masks."""
    h = _mix(seed & _MASK64)
    for v in (iteration, layer, microbatch):
        h = _mix(h ^ (v & _MASK64))
    return h & ((1 << 63) - 1)


_RNG_LOCKS: dict[tuple[str, int], Any] = {}
_RNG_LOCKS_GUARD = threading.Lock()


def _rng_lock(device: torch.device) -> threading.RLock:
    """The lock of a device's default generator (reentrant: a backward holds
    it while a checkpointed layer's recompute draws, see
    :func:`holding_generator`)."""
    key = (device.type, device.index or 0)
    with _RNG_LOCKS_GUARD:
        lock = _RNG_LOCKS.get(key)
        if lock is None:
            lock = _RNG_LOCKS[key] = threading.RLock()
        return lock


def holding_generator(device: torch.device) -> Any:
    """Hold ``device``'s default generator for a backward that recomputes
    checkpointed layers: ``torch.utils.checkpoint`` sets the generator's
    state for the recompute, which must not interleave with another worker's
    seeded layer (:func:`seeded`)."""
    return _rng_lock(device)


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[idx]
    return torch.default_generator


def generator_state(gen: torch.Generator) -> torch.Tensor:
    """``gen.get_state()`` without a deadlock between threads.

    PyTorch's binding holds the generator's mutex while it wraps the state
    in a Python tensor; that allocation may run the garbage collector, whose
    finalizers may release the GIL, so a second thread calling it meanwhile
    (holding the GIL, waiting for the mutex) deadlocks the process, the
    watchdog included. Hence callers hold the device's RNG lock (one of
    RoundPipe's threads at a time) and the collector waits for the call
    (the mutex is never held without the GIL)."""
    with _rng_lock(gen.device):
        collecting = gc.isenabled()
        gc.disable()
        try:
            return gen.get_state()
        finally:
            if collecting:
                gc.enable()


@contextlib.contextmanager
def seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Run a block with the device's default generator seeded to ``seed``.

    Workers sharing a physical device share its default generator, so the
    block holds that device's RNG lock; the generator's previous state is
    restored afterwards, so the caller's own random stream is left as it was.
    On CUDA the RNG is consumed when kernels are launched, so the lock covers
    launches only, not execution. CPU workers use :class:`LayerRandomness`
    instead, which holds no lock around compute."""
    gen = _generator(device)
    with _rng_lock(device):
        state = generator_state(gen)
        gen.manual_seed(seed)
        try:
            yield
        finally:
            gen.set_state(state)


@cache
def _takes_generator(func: Any) -> bool:
    """Whether an aten overload has a keyword ``generator`` argument."""
    return any(a.name == "generator" and a.kwarg_only for a in func._schema.arguments)


_DROPOUTS = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


def draws_random(module: nn.Module, any_mode: bool = False) -> bool:
    """Whether ``module`` would draw dropout masks in its current mode (with
    ``any_mode``: in training): an active dropout module, or a module in
    training with a positive float ``*dropout*`` attribute (a rate its
    forward gives ``F.dropout`` or an attention kernel, as Seed-OSS's and
    Starcoder2's MLPs and Hugging Face attention do)."""
    for m in module.modules():
        if not (m.training or any_mode):
            continue
        if isinstance(m, _DROPOUTS):
            if m.p > 0:
                return True
            continue
        for name, value in vars(m).items():
            if "dropout" in name and isinstance(value, float) and value > 0:
                return True
    return False


@cache
def _dropout_argument(func: Any) -> int | None:
    """The position of an aten overload's ``dropout_p`` argument (the
    attention kernels), or None."""
    names = [a.name for a in func._schema.arguments]
    return names.index("dropout_p") if "dropout_p" in names else None


def _draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a call of an op tagged as random may draw: an attention kernel
    is tagged so even without dropout."""
    at = _dropout_argument(func)
    if at is None:
        return True
    p = kwargs["dropout_p"] if "dropout_p" in kwargs else args[at] if at < len(args) else 0.0
    return bool(p)


class _SeededOps(TorchDispatchMode):
    """Every random op in the block draws from ``gen``, in order: as if the
    process's default generator had been seeded with ``gen``'s seed before the
    block, but without touching it (dispatch modes are per thread)."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.gen = gen
        self.used = False  # an op that draws ran
        self.tagged = False  # an op tagged random ran (perhaps drawing nothing)

    def __enter__(self) -> _SeededOps:
        # (in the block, torch.get_rng_state and the like see ``gen`` too:
        # see _install_streams)
        super().__enter__()
        _streams().append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _streams().pop()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        self.tagged = True
        if not _draws(func, args, kwargs):
            return func(*args, **kwargs)
        if getattr(_THREAD, "lent", False):
            # an inner mode (a fork in the block) lent its state for this op
            return func(*args, **kwargs)
        self.used = True
        if _takes_generator(func) and kwargs.get("generator") is None:
            return func(*args, **kwargs, generator=self.gen)
        # an op without a generator argument draws from the default generator:
        # lend it our state for this one op only
        shared = torch.default_generator
        with _rng_lock(torch.device("cpu")):
            saved = generator_state(shared)
            shared.set_state(generator_state(self.gen))
            _THREAD.lent = True
            try:
                return func(*args, **kwargs)
            finally:
                _THREAD.lent = False
                self.gen.set_state(generator_state(shared))
                shared.set_state(saved)


# -------------------------------------------- the default generator, per thread
#
# A layer on a CPU worker draws from its own generator (_SeededOps), not from
# the process's default one. Code in the layer that keeps and puts back "the"
# generator's state must see that generator too: torch.utils.checkpoint
# (reentrant or not, called by the user's layer itself) keeps
# ``torch.get_rng_state()`` in its forward and recomputes the forward in the
# backward under ``torch.random.fork_rng()`` after ``torch.set_rng_state()``
# of what it kept. With the process's generator the recompute drew other
# dropout masks than its forward (silently wrong gradients) and rewound the
# training loop's thread's random numbers drawn meanwhile. So, on a thread
# inside such a block, those three functions work on the block's own
# generator; the state a layer's block hands out is marked, and a fork whose
# state is set to a marked one (a checkpoint's recompute, in the backward,
# outside any layer) runs in a _SeededOps mode over a private generator that
# starts from it: the forward's random numbers again, the process's generator
# untouched. Anywhere else they are torch's own.

_THREAD = threading.local()
_MARK = "_roundpipe_layer_stream"  # attribute of a state a layer's block handed out


def _streams() -> list[Any]:
    """This thread's blocks that own the default generator, innermost last:
    :class:`_SeededOps` (its ``gen``), :class:`_ProcessStream` (a layer
    that draws from the process's generator) or :class:`_Fork` (a fork
    outside any layer, not yet given a marked state)."""
    stack = getattr(_THREAD, "streams", None)
    if stack is None:
        stack = _THREAD.streams = []
    return stack


class _ProcessStream:
    """A layer on a CPU worker that runs without a dispatch mode (it draws
    nothing): the process's generator, whose state it hands out marked, so
    that a checkpoint's recompute does not set and put back the process's
    generator (the loop's thread's numbers drawn meanwhile)."""

    __slots__ = ("drew",)

    def __init__(self) -> None:
        self.drew = False  # a fork in the layer drew (from a copy of the state)

    def __enter__(self) -> _ProcessStream:
        _streams().append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _streams().pop()


class _Fork:
    """A ``fork_rng`` outside any layer: torch's, unless a marked state is
    set in it (:meth:`take`)."""

    __slots__ = ("depth", "exits", "taken")

    def __init__(self) -> None:
        self.depth = torch._C._len_torch_dispatch_stack()
        self.exits = contextlib.ExitStack()
        self.taken = False  # the process's generator was left alone

    def take(self, state: torch.Tensor) -> bool:
        """The rest of the fork draws from a generator that starts at
        ``state``; False where a dispatch mode entered in the fork since
        would be left out of order."""
        if torch._C._len_torch_dispatch_stack() != self.depth:
            return False
        gen = torch.Generator()
        gen.set_state(state)
        self.exits.enter_context(_SeededOps(gen))
        self.taken = True
        return True


def _marked(state: torch.Tensor) -> torch.Tensor:
    setattr(state, _MARK, True)
    return state


_TORCH: dict[str, Any] = {}  # torch's own functions
_INSTALL_GUARD = threading.Lock()


def _get_rng_state() -> torch.Tensor:
    stack = _streams()
    top = stack[-1] if stack else None
    if isinstance(top, _SeededOps):
        return _marked(top.gen.get_state())
    if isinstance(top, _ProcessStream):
        return _marked(generator_state(torch.default_generator))
    if isinstance(top, _Fork):  # (perhaps a worker's thread: see generator_state)
        return generator_state(torch.default_generator)
    return _TORCH["get_rng_state"]()


def _set_rng_state(new_state: torch.Tensor) -> None:
    stack = _streams()
    top = stack[-1] if stack else None
    if isinstance(top, _SeededOps):
        top.gen.set_state(new_state)
        return
    if isinstance(top, _Fork):
        if top.taken:
            return  # (the fork's own restore: the process's generator was not set)
        if getattr(new_state, _MARK, False) and top.take(new_state):
            return
    _TORCH["set_rng_state"](new_state)


@contextlib.contextmanager
def _fork_rng(*args: Any, **kwargs: Any) -> Iterator[None]:
    bound = _TORCH["fork_signature"].bind(*args, **kwargs)
    bound.apply_defaults()
    fork = _TORCH["fork_rng"]
    stack = _streams()
    top = stack[-1] if stack else None
    if not bound.arguments["enabled"]:
        with fork(*args, **kwargs):
            yield
    elif top is not None and not isinstance(top, _Fork):
        # inside a layer: the fork draws from a copy of the layer's stream
        gen = torch.Generator()
        gen.set_state(_get_rng_state())
        inner = _SeededOps(gen)
        try:
            with inner, fork(*args, **kwargs):
                yield
        finally:  # (what the layer drew, for LayerRandomness)
            if isinstance(top, _SeededOps):
                top.used = top.used or inner.used
                top.tagged = top.tagged or inner.tagged
            else:
                top.drew = top.drew or inner.used
    else:
        frame = _Fork()
        stack.append(frame)
        try:
            with fork(*args, **kwargs), frame.exits:
                yield
        finally:
            stack.remove(frame)


def _install_streams() -> None:
    """Route ``torch.get_rng_state``, ``torch.set_rng_state`` and
    ``torch.random.fork_rng`` through this thread's blocks (see above); the
    same as torch's on a thread in none of them. Once per process."""
    import inspect

    with _INSTALL_GUARD:
        if _TORCH:
            return
        _TORCH["get_rng_state"] = torch.random.get_rng_state
        _TORCH["set_rng_state"] = torch.random.set_rng_state
        _TORCH["fork_rng"] = torch.random.fork_rng
        _TORCH["fork_signature"] = inspect.signature(torch.random.fork_rng)
        for fn, name in (
            (_get_rng_state, "get_rng_state"),
            (_set_rng_state, "set_rng_state"),
            (_fork_rng, "fork_rng"),
        ):
            functools.update_wrapper(fn, _TORCH[name])
            setattr(torch.random, name, fn)
            if getattr(torch, name, None) is _TORCH[name]:
                setattr(torch, name, fn)


# the generator of the checkpointed layer a CPU worker's thread is running
_ACTIVE = threading.local()


def own_checkpoints(module: nn.Module, device: torch.device) -> None:
    """Make the gradient checkpointing of a worker's copy of a layer
    (transformers' ``_gradient_checkpointing_func`` on its blocks) replay the
    layer's own random stream, not the process's: ``torch.utils.checkpoint``
    keeps the default CPU generator's state for the recompute
    (``preserve_rng_state``) and puts it back after it, so the training
    loop's thread, drawing meanwhile (a random mask in ``training_step``),
    drew the layer's numbers and had its own rewound. Here the checkpoint
    preserves nothing and runs its forward and recompute in contexts that
    start the layer's generator (a CPU worker's private one, a GPU's default
    one, under its lock) from the same state (non-reentrant checkpointing,
    whatever ``use_reentrant`` said: the same gradients)."""
    for m in module.modules():
        original = m.__dict__.get("_gradient_checkpointing_func")
        if original is None or getattr(original, "_roundpipe", False):
            continue
        keywords = getattr(original, "keywords", None) or {}
        user = keywords.get("context_fn")

        def checkpoint(function: Any, *args: Any, _fn: Any = original, _user: Any = user) -> Any:
            return _fn(
                function,
                *args,
                use_reentrant=False,
                preserve_rng_state=False,
                context_fn=functools.partial(_checkpoint_contexts, device, _user),
            )

        checkpoint._roundpipe = True  # type: ignore[attr-defined]
        m._gradient_checkpointing_func = checkpoint


def _checkpoint_contexts(device: torch.device, user: Any) -> tuple[Any, Any]:
    """The forward's and the recompute's contexts of one checkpoint call (the
    user's own ``context_fn``'s inside them)."""
    theirs = user() if user is not None else (contextlib.nullcontext(), contextlib.nullcontext())
    start: list[torch.Tensor] = []

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        gen = _generator(device) if device.type != "cpu" else getattr(_ACTIVE, "gen", None)
        if gen is not None:
            start.append(generator_state(gen) if device.type != "cpu" else gen.get_state())
        with theirs[0]:
            yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if start and device.type == "cpu":
                gen = torch.Generator()
                gen.set_state(start[0])
                stack.enter_context(_SeededOps(gen))
            elif start:
                # (no lock taken here: on CUDA autograd runs the recompute on
                # its own device thread while the worker that called backward
                # holds the device's RNG lock for it, see holding_generator)
                shared = _generator(device)
                saved = shared.get_state()
                shared.set_state(start[0])
                stack.callback(shared.set_state, saved)
            stack.enter_context(theirs[1])
            yield

    return forward(), recompute()


class LayerRandomness:
    """Reproducible random numbers for one worker's replica of one layer.

    A layer call draws its random numbers (dropout) from a generator seeded
    with its :func:`layer_seed`, exactly as ``torch.manual_seed(seed)`` before
    the call would in plain PyTorch, whichever device runs it and whatever
    runs beside it.

    CPU workers share one default generator, so seeding it would need a lock
    around every layer and CPU workers would never compute concurrently.
    Instead the first call in each mode (train/eval) runs under a per-thread
    dispatch mode that gives every random op the layer's own generator, and
    notes whether the layer drew any random numbers. Layers that did keep
    that mode (only their random ops touch shared state, briefly); the others
    run untouched (a layer whose randomness depends on its data, seen only
    later, is caught by a check that the default generator did not move, and
    seeded from then on). In the layer, ``torch.get_rng_state``,
    ``torch.set_rng_state`` and ``torch.random.fork_rng`` work on the
    layer's generator, so that a ``torch.utils.checkpoint`` the layer calls
    itself recomputes with the forward's random numbers (see
    :func:`_install_streams`). CUDA workers seed the device's
    generator under a lock that covers kernel launches only (:func:`seeded`)."""

    def __init__(
        self,
        device: torch.device,
        name: str,
        rated: bool = True,
        seen: dict[bool, bool] | None = None,
    ) -> None:
        self.device = device
        self.name = name
        #: the layer has a dropout rate (:func:`draws_random` in any mode)
        self.rated = rated
        self.random: dict[bool, bool] = {}  # training flag -> draws random numbers
        # shared by the workers' objects for this layer on this device: a mode
        # in which any of them saw the layer draw (each worker's own first call
        # in a mode still runs in the dispatch mode, whatever another's drew)
        self.seen: dict[bool, bool] = {} if seen is None else seen
        _install_streams()

    @contextlib.contextmanager
    def __call__(self, seed: int, training: bool, checkpointed: bool = False) -> Iterator[None]:
        """``checkpointed``: the layer recomputes part of itself in its backward
        (transformers' gradient checkpointing, made to replay this layer's
        own random stream by :func:`own_checkpoints`): on a CPU worker it
        always draws from its own generator, which the recompute starts again
        from where the checkpoint's forward started."""
        if self.device.type != "cpu":
            with seeded(self.device, seed):
                yield
            return
        if checkpointed and training:
            gen = torch.Generator()
            gen.manual_seed(seed)
            _ACTIVE.gen = gen
            try:
                with _SeededOps(gen):
                    yield
            finally:
                _ACTIVE.gen = None
            return
        if self.random.get(training) is False and not self.seen.get(training):
            gen = torch.default_generator
            before = generator_state(gen).numpy().tobytes()
            with _ProcessStream() as stream:
                yield
            if stream.drew or before != generator_state(gen).numpy().tobytes():
                # this layer, or another thread (the training loop drawing random
                # numbers while workers compute), moved the default generator:
                # seed this layer from now on, on every worker, to be safe
                self.random[training] = self.seen[training] = True
                log.debug("%s: default generator moved; seeding its calls from now on", self.name)
            return
        gen = torch.Generator()
        gen.manual_seed(seed)
        mode = _SeededOps(gen)
        with mode:
            yield
        # an attention kernel is tagged random even without dropout: in a
        # layer with no dropout rate it does not count (CPU attention in every
        # Hugging Face block kept each in this mode for good, at about twice
        # its compute time); in one with a rate it does, whatever this call
        # drew (a call may draw nothing, a later one will)
        drew = mode.used or (self.rated and mode.tagged)
        self.random[training] = drew or self.random.get(training, False)
        if drew:
            self.seen[training] = True


class _NullEvent:
    """Stands in for ``torch.cuda.Event`` on CPU devices."""

    __slots__ = ()

    def record(self, stream: object = None) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` on CPU devices."""

    __slots__ = ()

    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


_NULL_EVENT = _NullEvent()
_NULL_STREAM = _NullStream()


def pin(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of ``t`` (only when CUDA is available); made
    contiguous first: an expanded tensor (several elements on one memory
    location, as ``position_ids.expand(...)``) cannot be pinned as it is."""
    if torch.cuda.is_available() and not t.is_pinned():
        return t.contiguous().pin_memory()
    return t


class DeviceContext:
    """Streams and events of one worker on one device.

    Attributes:
        device: the torch device.
        compute: stream for layer compute.
        act_up, act_down: activation copies (high priority).
        weight_up, grad_down: weight uploads and gradient downloads (low priority).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            hi, lo = -100, 0  # clamped by CUDA to its greatest / least priority
            self.compute = torch.cuda.Stream(device)
            self.act_up = torch.cuda.Stream(device, priority=hi)
            self.act_down = torch.cuda.Stream(device, priority=hi)
            self.weight_up = torch.cuda.Stream(device, priority=lo)
            self.grad_down = torch.cuda.Stream(device, priority=lo)
        else:
            self.compute = self.act_up = self.act_down = _NULL_STREAM
            self.weight_up = self.grad_down = _NULL_STREAM

    def synchronize(self) -> None:
        """Wait until every stream of the device is idle, so no copy still reads
        or writes host memory (before the engine frees its page-locked memory;
        no-op on CPU, whose copies are synchronous)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def on(self, stream) -> contextlib.AbstractContextManager:
        """Context that makes ``stream`` current (no-op on CPU)."""
        if self.is_cuda:
            return torch.cuda.stream(stream)
        return contextlib.nullcontext()

    def event(self):
        """A new event (a shared no-op on CPU)."""
        if self.is_cuda:
            # blocking: a host thread waiting on it sleeps instead of spinning
            return torch.cuda.Event(blocking=True)
        return _NULL_EVENT

    def record(self, stream):
        """Record and return an event on ``stream``."""
        ev = self.event()
        ev.record(stream)
        return ev

    def upload(
        self, t: torch.Tensor, stream, dtype: torch.dtype | None = None, fresh: bool = False
    ) -> torch.Tensor:
        """Copy a host tensor to the device on ``stream`` (asynchronous from
        pinned memory). The result is marked as used by the compute stream so
        the caching allocator does not reuse it early. On CPU the host tensor
        itself is returned (cast if ``dtype`` differs), or a copy of it with
        ``fresh=True`` (for values a layer might modify in place)."""
        if not self.is_cuda:
            if dtype is not None and t.dtype != dtype:
                return t.to(dtype)
            return t.clone() if fresh else t
        if t.device.type == "cpu":
            # from pageable memory a non_blocking copy is staged and blocks this
            # thread; a page-locked copy (torch's caching host allocator) does not
            t = pin(t)
        with torch.cuda.stream(stream):
            out = t.to(self.device, non_blocking=True)
            if dtype is not None and out.dtype != dtype:
                out = out.to(dtype)
        out.record_stream(self.compute)
        return out

    def download(self, t: torch.Tensor, stream) -> torch.Tensor:
        """Copy a device tensor to (pinned) host memory on ``stream``; the copy
        is complete once an event recorded on ``stream`` afterwards is."""
        if not self.is_cuda:
            return t
        with torch.cuda.stream(stream):
            # a sparse gradient (nn.Embedding(sparse=True)) is made dense on the
            # copy stream, after whatever the caller made that stream wait for
            src = t.to_dense() if t.is_sparse else t
            out = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            out.copy_(src, non_blocking=True)
        for part in (t._indices(), t._values()) if t.is_sparse else (t,):
            part.record_stream(stream)
        return out


#: what CUDA libraries say when their own allocation fails: cuBLAS and cuDNN
#: report it as a RuntimeError, not as torch.OutOfMemoryError
_OUT_OF_MEMORY = (
    "out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "cudaErrorMemoryAllocation",
    "CUDA_ERROR_OUT_OF_MEMORY",
)


def is_out_of_memory(exc: BaseException | None) -> bool:
    """Whether ``exc`` says a device ran out of memory: torch's
    ``OutOfMemoryError``, or a library's allocation failure raised as a
    ``RuntimeError`` (cuBLAS's handle or workspace, cuDNN's workspace)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower() if isinstance(exc, RuntimeError) else ""
    return any(marker.lower() in text for marker in _OUT_OF_MEMORY)


def as_device(d: torch.device | str | int) -> torch.device:
    """A worker's device from ``torch.device``, ``"cuda:0"``, ``0`` or ``"cpu"``
    (``"cuda"`` means the current CUDA device)."""
    if isinstance(d, int):
        d = torch.device("cuda", d)
    elif not isinstance(d, torch.device):
        d = torch.device(d)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def check_uniform(devs: list[torch.device]) -> None:
    """All workers must draw the same dropout masks for the same seed: a layer's
    forward and its recompute may run on different devices."""
    kinds = sorted({d.type for d in devs})
    if len(kinds) > 1:
        raise ValueError(
            f"devices mix {' and '.join(kinds)}; random numbers (dropout) differ between "
            "device types, so a recompute would not match its forward. Use one device type"
        )
    if kinds == ["cuda"]:
        models = {}
        for d in devs:
            prop = torch.cuda.get_device_properties(d)
            models[(prop.name, prop.multi_processor_count)] = d
        if len(models) > 1:
            raise ValueError(
                f"devices are different GPU models ({', '.join(n for n, _ in models)}); "
                "their dropout masks differ for the same seed. Use identical GPUs"
            )


def host_to_device_bandwidth(
    device: torch.device, nbytes: int = 64 << 20, repeat: int = 3
) -> float:
    """Host-to-device bytes per second from page-locked memory (CUDA)."""
    with torch.cuda.device(device):  # events and copies on the same device
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst.copy_(src, non_blocking=True)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()  # note: a CPU-GPU sync point, once, at re-planning time
        ms = start.elapsed_time(end)
    return nbytes * repeat / max(ms / 1e3, 1e-9)


def stage_memory_limit(
    devs: list[torch.device], costs: LayerCosts, limit: int | None
) -> int | None:
    """Bytes a stage may use on a device: ``limit`` if given, else half the free
    memory of the emptiest CUDA device shared among its workers (a worker
    holds a stage and the prefetched next one); None for CPU workers. Refused
    when even one layer does not fit."""
    cuda = sorted({d for d in devs if d.type == "cuda"}, key=str)
    if not cuda and limit is None:
        return None  # CPU workers: no limit unless one is given
    if limit is None:
        # each worker holds a stage and the prefetched next one; workers
        # sharing a GPU share its free memory
        limit = min(torch.cuda.mem_get_info(d)[0] // (2 * devs.count(d)) for d in cuda)
    assert costs.memory is not None
    for i, need in enumerate(costs.memory):
        if need > limit:
            raise PlanError(
                f"layer {i} needs about {int(need)} bytes of device memory (weights and "
                f"gradients) but a stage may use {limit} bytes on "
                f"{cuda[0] if cuda else devs[0]}; even one layer "
                "at a time does not fit. Raise device_memory_limit or free device memory"
            )
    return limit

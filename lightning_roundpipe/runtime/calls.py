"""What the controller hands the device workers, and what they share.

A :class:`Call` is one ``forward`` / ``forward_backward`` call (its labels,
loss, seed, lowered schedule); a :class:`Job` is one of its tasks on one
worker; a :class:`Gain` is a call's gradient factor when it is known only
later; :class:`Runtime` is the state the controller, the workers and their
couriers share (no reference to the engine, so a dropped engine is collected).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..plan.schedule import Schedule, Task
from .host import HostState, _Structure
from .optimizer import Protocol
from .profiler import Profiler, TraceRecorder, Traffic
from .store import EngineClosedError, Key, Kind, Store

if TYPE_CHECKING:
    from .worker import Worker

__all__ = ["Call", "Gain", "Job", "Runtime"]


class Gain:
    """The factor a call's weight gradients are added into the host buffers
    with, when it is known only after the call returned: autograd reaching the
    returned loss gives it (``0.5 * loss``, Lightning's accumulation factor). Until
    then the call's gradients wait on the host, held by the couriers. Guarded by
    the store's lock."""

    __slots__ = ("dropped", "iteration", "parked", "value", "window")

    def __init__(self, iteration: int, window: int) -> None:
        self.iteration = iteration
        self.window = window
        self.value: float | None = None  # None: not known yet
        self.dropped = False  # never backpropagated: its gradients are not added at all
        self.parked = 0  # gradients held for it by the couriers


@dataclass
class Call:
    """What one ``forward`` / ``forward_backward`` call asks of its tasks."""

    iteration: int
    window: int
    serial: int  # unique per call: keys of its jobs
    labels: list[Any]
    weights: list[float]
    loss_fn: Callable[..., torch.Tensor] | None
    scale: float
    seed: int
    schedule: Schedule
    train: bool  # a training pass: gradients, running statistics written back
    modes: list[tuple[bool, ...]]  # train/eval flags of each layer's modules at submission
    structures: list[_Structure]  # each layer's attributes, hooks and buffers at submission
    profiler: Profiler | None = None  # set while this iteration is being profiled
    gain: Gain | None = None  # a factor for the weight gradients given later; None: 1
    input_grad: bool = False  # the first layer's input gradient is wanted too
    # loss_fn returns (loss, output): the output comes back with the loss
    with_outputs: bool = False
    version: int = 0  # its tasks read the weights after this many updates
    # its forward stages write running statistics back to the host (training
    # calls, unless an earlier forward-only pass of the iteration did; forward-
    # only calls with a stateful layer in training mode), in micro-batch order
    writes_state: bool = False
    # a forward-only pass of a reserved iteration: computed again for its backward
    again: bool = False
    # trainable weights that required no gradient when the call was submitted
    # (PEFT's disable_adapter() with trainable biases): it gives them none
    frozen: frozenset[int] = frozenset()


@dataclass(eq=False)
class Job:
    """One lowered task of one call, as a worker runs it."""

    call: Call
    task: Task
    index: int  # position in the call's schedule
    after: tuple | None = None  # job whose running statistics must be written first
    key: tuple = field(init=False)
    outstanding: int = 0  # gradients the courier still holds (guarded by the store lock)
    finished: bool = False  # the courier reached the job's end
    queued: int = 0  # items handed to the courier (worker thread only)
    grads_last: bool = False  # its gradients are its last courier item (worker thread only)
    # each trainable parameter's turn among its window's gradient adds
    turns: dict[int, int] = field(default_factory=dict)
    names: dict[str, tuple[Kind, int]] = field(init=False)  # "act12" -> ("act", 12)

    def __post_init__(self) -> None:
        self.key = (self.call.serial, self.index)
        self.names = {n: _parse(n) for n in (*self.task.reads, *self.task.writes)}

    def store_key(self, name: str, mb: int) -> Key:
        """Store key of one of the task's reads or writes for micro-batch ``mb``."""
        kind, layer = self.names[name]
        return Key(self.call.iteration, kind, layer, mb)


def _parse(name: str) -> tuple[Kind, int]:
    """A plan read/write such as ``"act12"``, ``"grad15"``, ``"loss"``."""
    if name == "loss":
        return ("loss", 0)
    kind = name.rstrip("0123456789")
    if kind not in ("act", "grad"):
        raise ValueError(f"a plan names the store value {name!r}; expected act<n>, grad<n> or loss")
    return (kind, int(name[len(kind) :]))


class Runtime:
    """What the controller and the workers share (no reference to the engine,
    so a dropped engine is garbage collected and its finalizer stops the
    threads)."""

    def __init__(self, host: HostState, store: Store, protocol: Protocol) -> None:
        self.host = host
        self.store = store
        self.protocol = protocol
        self.traffic = Traffic()
        self.trace: TraceRecorder | None = None
        self.workers: list[Worker] = []
        self.optimizer: Any = None
        self.reducer: Any = None  # replicas: the cross-server gradient reducer
        self.submitted = 0
        self.done = 0
        self.done_keys: set[tuple] = set()
        self.written: set[tuple] = set()  # jobs whose running statistics are on the host
        self.kept: dict[int, int] = {}  # iteration -> bytes of boundary values written
        # bytes of training boundary values on the host now, and the most so far
        self.held = 0
        self.held_peak = 0
        self.forbid_host_sync = False
        # a tuple value is a layer's positional arguments, a dict its keywords
        # (False: the value is the one argument, as nn.Sequential passes it)
        self.spread_values = True
        # upload the next stage's weights and the next micro-batch's input
        # while a stage computes (False: the device's room is all the stage's)
        self.prefetch = True
        self.hooks: list[Any] = []  # on the user's parameters; removed at close
        # (device, layer) -> the modes (training flag) in which a worker saw
        # the layer draw random numbers, shared by that device's workers
        self.randomness: dict[tuple[str, int], dict[bool, bool]] = {}
        self.closed = False

    def job_done(self, job: Job) -> None:
        with self.store.lock:
            self.done += 1
            self.done_keys.add(job.key)
            self.store.lock.notify_all()

    def hold(self, nbytes: int) -> None:
        """Boundary values of ``nbytes`` bytes are now kept on the host (negative:
        released by their last reader). Caller holds the store's lock."""
        self.held += nbytes
        self.held_peak = max(self.held_peak, self.held)

    def mark_written(self, job: Job) -> None:
        with self.store.lock:
            self.written.add(job.key)
            self.store.lock.notify_all()

    def forget(self, before_serial: int, before_iteration: int, keep: set[tuple]) -> None:
        """Drop bookkeeping of calls older than ``before_serial`` and of
        iterations before ``before_iteration``, except the jobs in ``keep``
        (the last task of each ordered slot: the next one waits for it, however
        many evaluation calls ran in between)."""
        with self.store.lock:
            self.done_keys = {k for k in self.done_keys if k[0] >= before_serial}
            self.written = {k for k in self.written if k[0] >= before_serial or k in keep}
            self.kept = {k: v for k, v in self.kept.items() if k >= before_iteration}

    def shutdown(self, join_timeout: float = 30.0) -> list[str]:
        """Stop and join every thread; returns the names of threads that did not
        stop. (The engine's finalizer calls it: it must not refer to the engine.)"""
        if self.closed:
            return []
        self.closed = True
        for handle in self.hooks:  # the parameters outlive the engine
            handle.remove()
        self.hooks.clear()
        self.store.fail(EngineClosedError("the RoundPipe engine was closed"))
        threads = []
        for w in self.workers:
            w.stop()
            w.wake()
            w.courier.stop()
            threads.extend(w.threads)
        if self.optimizer is not None and self.optimizer.thread is not None:
            self.optimizer.stop()
            threads.append(self.optimizer.thread)
        if self.reducer is not None and self.reducer.thread is not None:
            self.reducer.stop()
            threads.append(self.reducer.thread)
        stuck = []
        deadline = time.monotonic() + join_timeout
        for t in threads:
            if t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                stuck.append(t.name)
        self.store.clear()
        if not stuck:  # a stuck worker may still be copying from page-locked memory
            self.host.free()
            if self.optimizer is not None:
                self.optimizer.forget()
        return stuck

"""The optimizer side: weight/gradient hand-offs per parameter, loss scaling,
and the asynchronous CPU optimizer worker.

Windows. The ``forward_backward`` calls between two ``step`` calls form a
*window* (one optimizer step's worth of gradient accumulation); windows and
the updates they feed are numbered from 0. In synchronous mode window ``k``
computes with the weights after ``k`` updates. In asynchronous mode (staleness
1) window ``k`` computes with the weights after ``k - 1`` updates (windows 0
and 1 both see the initial weights) while the CPU applies update ``k - 1``.

Each parameter has three copies (see :mod:`.host`). Five ordering rules keep
them consistent, enforced per parameter so that the first layers of the next
window start while deep layers are still being copied:

1. the P copy of update ``w`` (fp32 weights -> master copy) waits until every
   task of window ``w + 1`` that uses the parameter is done with it
   (``uses``, counted down by workers). With two master copies (asynchronous
   mode's default, see :mod:`.host`) update ``w`` writes version ``w + 1``
   into the copy that holds version ``w - 1``, which window ``w`` reads
   (and window 0 for ``w = 1``, and an evaluation with the newest weights
   during window ``w - 1``), not the one window ``w + 1`` reads (version
   ``w``): it waits for the uses of windows ``w - 1`` and ``w`` only, which
   its own G copies (rule 3) already waited for as far as training tasks
   go, so the weight copies overlap window ``w + 1`` instead of following it;
2. a task of window ``k`` reads the master copy only once P copies of updates
   ``0 .. k-2`` are done (``p_done``; sync mode: ``0 .. k-1``): it reads the
   weights of *version* ``k - 1`` (sync mode: ``k``; an evaluation with the
   newest weights: the number of closed windows);
3. the G copy of update ``w`` (the gradient buffer lent to the step as
   ``.grad``) waits until every task of window ``w`` has added its gradient
   (``grads``, counted down);
4. a gradient of window ``k`` is added into the buffer only once update
   ``k - 1`` has released it (``g_done``; the step is done with ``.grad``).
   Device threads never wait for this: their gradients are handed to the
   worker's courier thread, which holds them until the buffer is free;
5. the worker runs each update's G copies, step and P copies in order, and
   updates in order.

Rules 1-4 are :class:`Protocol` counters and waits whose conditions are the
methods of :class:`Rules`; rule 5 is the order of the :class:`OptimizerWorker`
queue and of its steps (``Rules.copies_after_step``). The tests that show each
rule is needed inject a ``Rules`` with one rule removed.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .host import HostState, _Param
from .options import NonFinite
from .profiler import named
from .store import EngineFailure, Store

__all__ = [
    "Chaos",
    "LossScaler",
    "NonFiniteError",
    "OptimizerWorker",
    "Protocol",
    "Rules",
    "StepHandle",
    "all_finite",
    "use_fused",
]


log = logging.getLogger(__name__)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite, in one min/max pass: a NaN
    makes both NaN and an infinity shows in one. ``isfinite(t).all()`` first
    writes a mask as large as ``t``: about 20x slower on a host gradient
    (333 vs 17 ms for 50M fp32 values on 2 cores), every step and parameter."""
    if t.layout == torch.sparse_coo:  # (nn.Embedding(sparse=True) gradients)
        return all_finite(t._values())
    if t.layout != torch.strided:
        return all_finite(t.values())
    if t.is_complex():  # (no aminmax)
        return bool(torch.isfinite(t).all())
    if not t.is_floating_point():  # integers
        return True
    if t.numel() == 0:
        return True
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low) & torch.isfinite(high))


class Chaos:
    """Seeded random delays at named hand-off points (tests only).

    ``points`` maps a point name to the largest delay in seconds. Workers call
    ``"upload"``, ``"forward"``, ``"backward"``, ``"grad"``, ``"download"`` and
    ``"store"``; the optimizer thread ``"g_copy"``, ``"step"``, ``"p_copy"`` and
    ``"call"`` (queued zero_grad)."""

    def __init__(self, seed: int, points: dict[str, float]) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.points = dict(points)

    def __call__(self, point: str) -> None:
        top = self.points.get(point)
        if not top:
            return
        with self._lock:
            delay = self._rng.uniform(0, top)
        time.sleep(delay)


def _no_chaos(point: str) -> None:
    pass


class Rules:
    """The ordering rules' conditions, read by :class:`Protocol` and the
    optimizer worker. This class is the protocol; tests inject a subclass that
    removes one rule to show what breaks without it (our own: the rules are
    this project's, see the module docstring)."""

    #: rule 5: an update's weight copies (P copies) run after its step
    copies_after_step = True

    def weights_ready(self, proto: Protocol, need: int, params: Sequence[_Param]) -> bool:
        """Rule 2: the P copies of updates ``0 .. need - 1`` are done."""
        return all(proto.p_done[p.index] >= need for p in params)

    def buffer_free(self, proto: Protocol, window: int, p: _Param) -> bool:
        """Rule 4: update ``window - 1`` released ``p``'s gradient buffer."""
        return proto.g_done[p.index] >= window

    def grads_added(self, proto: Protocol, window: int, p: _Param) -> bool:
        """Rule 3, this replica: the window is closed and every task of it added
        its gradient."""
        return proto.closed >= window and proto.grads.get((p.index, window), 0) <= 0

    def grads_complete(self, proto: Protocol, window: int, p: _Param) -> bool:
        """Rule 3: every gradient of the window is in the buffer; with replicas
        (servers), averaged over them too (:mod:`.replicas`)."""
        if not self.grads_added(proto, window, p):
            return False
        return not proto.replicated or proto.reduced[p.index] > window

    def uses_done(self, proto: Protocol, window: int, p: _Param) -> bool:
        """Rule 1: no task of ``window`` or ``window + 1`` reads ``p``'s master
        copy any more and window ``window + 1`` is closed (synchronous mode:
        nothing of the next window runs yet). With two master copies: no task
        of ``window - 1`` or ``window`` reads it (the copy of the version the
        update writes) and ``window`` is closed."""
        if not proto.async_mode:
            return True
        if proto.double_buffer:
            return (
                proto.closed >= window
                and proto.uses.get((p.index, window), 0) <= 0
                and proto.uses.get((p.index, window - 1), 0) <= 0
            )
        nxt = window + 1
        return (
            proto.closed >= nxt
            and proto.uses.get((p.index, nxt), 0) <= 0
            and proto.uses.get((p.index, window), 0) <= 0
        )


class Protocol:
    """Per-parameter counters and waits for the ordering rules 1-4 (their
    conditions: ``rules``, default :class:`Rules`)."""

    def __init__(
        self, host: HostState, store: Store, async_mode: bool, rules: Rules | None = None
    ) -> None:
        self.host = host
        self.store = store
        self.async_mode = async_mode
        # two master copies of the trainable weights (rule 1 then waits less)
        self.double_buffer = async_mode and host.copies == 2
        self.cond = store.lock  # one condition: failures and timeouts wake every wait
        n = len(host.params)
        self.p_done = [0] * n  # rule 2: P copies finished, per parameter
        self.g_done = [0] * n  # rule 4: G copies finished, per parameter
        self.uses: dict[tuple[int, int], int] = defaultdict(int)  # rule 1: (param, window)
        self.grads: dict[tuple[int, int], int] = defaultdict(int)  # rule 3: (param, window)
        # the order a window's gradients of a parameter are added in (float
        # addition is not associative), so the sum never depends on which
        # device finished first: the turns given at registration, in
        # micro-batch order (each its call's gradient factor when that is given
        # later, else None), and the next turn to add
        self.turn_gains: dict[tuple[int, int], list[Any]] = defaultdict(list)
        self.turn: dict[tuple[int, int], int] = defaultdict(int)
        self.turn_waiting = False  # a courier holds a gradient whose turn has not come
        self.closed = -1  # highest window whose step() was called
        # replicas (servers): windows whose gradients are averaged over them, per
        # parameter, and whether each window's step is skipped on every replica
        self.replicated = False
        self.reduced = [0] * n
        self.verdicts: dict[int, bool] = {}
        # seconds the optimizer waited for the average after this replica's own
        # gradients were in: the reduction's exposed time
        self.reduction_wait = 0.0
        self.rules = rules if rules is not None else Rules()
        self.on_release: list[Callable[[], None]] = []  # couriers holding gradients
        self.chaos: Callable[[str], None] = _no_chaos

    # ------------------------------------------------------------- helpers
    def _wait(self, ok: Callable[[], bool], what: str) -> None:
        self.store.wait_until(ok, what)

    def _notify(self) -> None:
        self.cond.notify_all()

    # --------------------------------------------------- controller side
    def register(
        self, window: int, params: Sequence[_Param], grads: bool, gain: Any = None
    ) -> dict[int, int]:
        """A task of ``window`` will use ``params`` (and add their gradients,
        of a call whose factor ``gain`` is given later if not None): each
        trainable parameter's turn, its adds happening in the order tasks are
        registered (:meth:`in_turn`)."""
        turns = {}
        with self.cond:
            for p in params:
                key = (p.index, window)
                self.uses[key] += 1
                if grads and p.trainable:
                    self.grads[key] += 1
                    turns[p.index] = len(self.turn_gains[key])
                    self.turn_gains[key].append(gain)
        return turns

    def factor_before(self, window: int, p: _Param, turn: int) -> Any:
        """The first earlier turn's factor not known yet (a :class:`Gain`
        whose loss autograd has not reached), or None (call under ``cond``):
        a gradient behind it waits for that factor, not for a task."""
        key = (p.index, window)
        gains = self.turn_gains[key]
        for gain in gains[self.turn[key] : turn]:
            if gain is not None and gain.value is None:
                return gain
        return None

    def in_turn(self, window: int, p: _Param, turn: int) -> bool:
        """Whether every gradient of ``p`` from ``window`` with an earlier turn
        was added (call under ``cond``); else the courier will be woken."""
        if self.turn[(p.index, window)] == turn:
            return True
        self.turn_waiting = True
        return False

    def resume_after_window_zero(self) -> None:
        """Numbering as if a window 0 had run (an asynchronous run resumed from
        a checkpoint): its G copies are done, update 0's P copies are not."""
        with self.cond:
            n = len(self.host.params)
            self.closed = 0
            self.g_done = [1] * n
            self.reduced = [1] * n
            self.p_done = [0] * n
            self._notify()

    def close_window(self, window: int) -> None:
        with self.cond:
            self.closed = max(self.closed, window)
            self._notify()

    # ------------------------------------------------------- worker side
    def before_upload(
        self, window: int, version: int, params: Sequence[_Param], block: bool = True
    ) -> bool:
        """Rule 2: the master copies hold the weights after ``version`` updates,
        those a task of ``window`` reads (:meth:`read_version`). With
        ``block=False`` only report whether they do."""

        def ok() -> bool:
            return self.rules.weights_ready(self, version, params)

        if not block:
            with self.cond:
                return ok()
        self._wait(ok, f"the weight copies (P copies) of update {version - 1} for window {window}")
        self.chaos("upload")
        return True

    def after_use(self, window: int, params: Sequence[_Param]) -> None:
        """Rule 1 producer: this task no longer reads these master copies."""
        with self.cond:
            for p in params:
                self.uses[(p.index, window)] -= 1
            self._notify()

    def before_add(self, window: int, p: _Param) -> None:
        """Rule 4 consumer: a gradient of ``window`` is about to be added into
        ``p``'s buffer (the courier checked :meth:`grad_ready`)."""
        self.chaos("grad")

    def grad_ready(self, window: int, p: _Param) -> bool:
        """Rule 4: the buffer was released by the step of the previous window
        (call under ``cond``)."""
        return self.rules.buffer_free(self, window, p)

    def after_grad(self, window: int, p: _Param) -> None:
        """Rule 3 producer: this task's gradient of ``p`` is in the buffer (the
        next turn's may be added)."""
        with self.cond:
            self.grads[(p.index, window)] -= 1
            self.turn[(p.index, window)] += 1
            waiting, self.turn_waiting = self.turn_waiting, False
            self._notify()
        if waiting:  # (a courier holding a later turn looks again)
            for wake in list(self.on_release):
                wake()

    # ---------------------------------------------------- optimizer side
    def wait_grads(self, window: int, p: _Param) -> None:
        """Rule 3: every gradient of ``p`` from ``window`` is in the buffer."""
        what = f"gradients of parameter {p.index} from window {window}"
        if self.replicated:  # this replica's part, then the replicas' average
            self._wait(lambda: self.rules.grads_added(self, window, p), what)
            # the reducer bounds its collectives by the watchdog itself and fails
            # the store, with the replica to blame, when one never completes
            t0 = time.perf_counter()
            self.store.wait_until(
                lambda: self.rules.grads_complete(self, window, p),
                f"{what}, averaged over the replicas",
                timeout=2 * self.store.timeout + 30.0,
            )
            self.reduction_wait += time.perf_counter() - t0
            return
        self._wait(lambda: self.rules.grads_complete(self, window, p), what)

    def agreed_skip(self, window: int) -> bool:
        """With replicas: whether every replica skips ``window``'s step (one
        replica's non-finite input gradient skips it everywhere)."""
        key = f"the replicas' verdict on step {window}"
        self._wait(lambda: window in self.verdicts, key)
        with self.cond:
            return self.verdicts.pop(window)

    def g_copied(self, window: int, p: _Param) -> None:
        with self.cond:
            self.grads.pop((p.index, window), None)
            self.turn.pop((p.index, window), None)
            self.turn_gains.pop((p.index, window), None)
            self._notify()

    def released(self, window: int, params: Sequence[_Param]) -> None:
        """Rule 4 producer: update ``window`` is done with these buffers."""
        with self.cond:
            for p in params:
                self.g_done[p.index] = window + 1
            self._notify()
        for wake in list(self.on_release):
            wake()

    def uses_done(self, window: int, p: _Param) -> bool:
        """Rule 1 (see :meth:`Rules.uses_done`). Call under ``cond``."""
        return self.rules.uses_done(self, window, p)

    def read_version(self, window: int, newest: bool = False) -> int:
        """The weights' version (updates they include) that tasks of ``window``
        read (rule 2). ``newest``: an evaluation after every closed window's
        update, which reads them where a master copy holds them (two copies;
        with one, the engine puts them into the older version's copy)."""
        if not self.async_mode or (newest and self.double_buffer):
            return window
        return max(window - 1, 0)

    def p_copied(self, window: int, p: _Param) -> None:
        with self.cond:
            self.p_done[p.index] = window + 1
            # the windows rule 1 waited for: no later update asks about them
            behind = window - 1 if self.double_buffer else window + 1
            self.uses.pop((p.index, behind), None)
            self.uses.pop((p.index, window), None)
            self._notify()


#: below this a loss scale cannot keep an fp16 gradient (fp16's smallest
#: subnormal): overflows have more than one cause then
_SMALLEST_SCALE = 2.0**-24


class LossScaler:
    """Dynamic loss scaling for fp16 (the scale that produced a gradient is the
    one that unscales it; overflow skips the step and halves the scale; the
    scale doubles after ``growth_interval`` good steps)."""

    def __init__(
        self,
        enabled: bool,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._good = 0
        #: the scale after each recent update, by its window (asynchronous
        #: windows start with the one after the last update their weights hold)
        self.after: dict[int, float] = {}

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale *= self.backoff_factor
            self._good = 0
            if self.scale < _SMALLEST_SCALE:
                raise NonFiniteError(
                    f"fp16 loss scaling: overflows in a row brought the loss scale to "
                    f"{self.scale:.3g}, below 2^-24: the loss or the gradients are not finite "
                    "at any scale (a weight or the data holds NaN or inf); the last steps were "
                    "skipped"
                )
        else:
            self._good += 1
            if self._good >= self.growth_interval:
                self.scale *= self.growth_factor
                self._good = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self._good}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self._good = int(state["good_steps"])


@dataclass
class StepHandle:
    """What an optimizer step produced; waits for the step where needed.

    Attributes (valid once :meth:`done`): ``grad_norm`` (total fp32 gradient
    norm before clipping, or None when not computed), ``skipped`` (overflow or
    non-finite gradients), ``result`` (what ``fn`` returned), ``window``."""

    window: int
    _event: threading.Event = field(default_factory=threading.Event, repr=False)
    _store: Store | None = field(default=None, repr=False)
    grad_norm: float | None = None
    skipped: bool = False
    result: Any = None
    error: BaseException | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def finish(self) -> None:
        """Mark the step (or call) as over: :meth:`wait` returns."""
        self._event.set()

    def wait(self, timeout: float | None = None) -> StepHandle:
        """Wait for the step (raises the step's error, if any)."""
        limit = timeout if timeout is not None else (self._store.timeout if self._store else 600.0)
        deadline = time.monotonic() + limit
        while not self._event.wait(0.2):
            if self._store is not None and self._store.failure is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"optimizer step {self.window} did not finish in {limit:g} s")
        if self._store is not None and (self.error is not None or not self._event.is_set()):
            self._store.raised = True  # (raised to the caller below)
        if self.error is not None:
            raise self.error
        if not self._event.is_set() and self._store is not None:
            # the optimizer thread failed outside this job (an earlier update's
            # weight copies, which run between jobs): its own error, unchanged
            failure = self._store.failure
            if isinstance(failure, OptimizerStepError | NonFiniteError):
                raise failure
            self._store.check()
        return self


@dataclass
class _Job:
    window: int
    fn: Callable[[], Any] | None
    scale: float
    clip_norm: float | None
    clip_value: float | None
    handle: StepHandle
    # called with the window's gradients in .grad, before clipping; may return
    # clipping options (the strategy runs Lightning's pre-step hooks here)
    prepare: Callable[[], dict[str, Any] | None] | None = None
    skip: bool = False  # a non-finite gradient outside the buffers (input gradients)
    # synchronous mode: the step failed after taking its gradients and was
    # counted as a skipped one (weight copies done): the engine is whole
    settled: bool = False


class NonFiniteError(FloatingPointError):
    """A loss or gradient was inf or NaN (and ``nonfinite="raise"``)."""


class OptimizerStepError(RuntimeError):
    """An exception inside an optimizer step, a G copy or a P copy."""


class HookError(Exception):
    """Carries an exception raised by a step's ``prepare`` callable (user hooks)
    to the engine, which re-raises the original unchanged."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__}: {original}")
        self.original = original


class OptimizerWorker:
    """Runs updates in order: G copies, clipping, ``fn``, P copies.

    In synchronous mode :meth:`run` is called inline by the caller's thread;
    in asynchronous mode :meth:`submit` queues the job for the worker thread."""

    def __init__(
        self,
        host: HostState,
        store: Store,
        protocol: Protocol,
        scaler: LossScaler,
        threads: int | None = None,
        nonfinite: NonFinite = "raise",
        names: dict[int, str] | None = None,
    ) -> None:
        self.nonfinite = nonfinite
        self.names = names or {}
        self.host = host
        self.store = store
        self.protocol = protocol
        self.scaler = scaler
        self.threads = threads
        # jobs, guarded by the protocol's condition so that one wait wakes for a
        # new job and for a pending weight copy becoming possible alike
        self._queue: deque[_Job | None] = deque()
        self.applied = 0  # updates whose fn has run (or was skipped)
        self.calls_done = 0  # ordered calls (engine.call: zero_grad, ...) that have run
        self._pending: tuple[int, list[_Param]] | None = None  # P copies still to do
        self.thread: threading.Thread | None = None
        self._grads: dict[int, torch.Tensor] = {}

    def pending_copies(self) -> list[_Param]:
        """Parameters whose copy into the master copy (P copy) is still due."""
        with self.protocol.cond:
            return [] if self._pending is None else list(self._pending[1])

    def resume_pending(self, window: int) -> None:
        """Update ``window``'s P copies are due (an asynchronous run resumed
        from a checkpoint, whose masters hold the weights one update behind)."""
        with self.protocol.cond:
            self._pending = (window, list(self.host.params))

    def forget(self) -> None:
        """Drop the gradients lent to a step (the engine is closed)."""
        self._grads.clear()

    # --------------------------------------------------------------- thread
    def start(self) -> None:
        self.thread = threading.Thread(target=self._main, name="roundpipe-optimizer", daemon=True)
        self.thread.start()

    def submit(self, job: _Job | None) -> None:
        with self.protocol.cond:
            self._queue.append(job)
            self.protocol.cond.notify_all()

    def stop(self) -> None:
        self.submit(None)

    def _main(self) -> None:
        previous = torch.get_num_threads()
        if self.threads is not None:
            # (torch's intra-op count is shared by every thread but the main
            # one: the device workers get it too; put back when the thread ends)
            torch.set_num_threads(self.threads)
        try:
            self._loop()
        finally:
            if self.threads is not None:
                torch.set_num_threads(previous)

    def _loop(self) -> None:
        job: _Job | None = None
        try:
            while True:
                # P copies of the last update go out as soon as the next window
                # stops reading each parameter (rule 1), between other work
                self._copy_ready()
                with self.protocol.cond:
                    if not self._queue and not self._copy_possible():
                        # woken by submit() and by every protocol hand-off
                        self.protocol.cond.wait(0.5)
                    if not self._queue:
                        if self.store.failure is not None:
                            return
                        continue
                    job = self._queue.popleft()
                if job is None or self.store.failure is not None:
                    return
                if job.window < 0:  # an ordered call (engine.call: zero_grad, ...)
                    self.protocol.chaos("call")
                    job.handle.result = job.fn()
                    with self.protocol.cond:
                        self.calls_done += 1
                        self.protocol.cond.notify_all()
                    job.handle.finish()
                    continue
                self._copy_ready(block=True)  # rule 5: copies before the next step
                self.run(job)
        except EngineFailure:
            if job is not None:  # the step never ran: its handle says why
                job.handle.error = self.store.failure
                job.handle.finish()
        except BaseException as exc:  # every failure must reach the caller
            if isinstance(exc, HookError):
                exc = exc.original
            step = (
                "a queued call (engine.call, e.g. zero_grad)"
                if job is None or job.window < 0
                else f"step {job.window}"
            )
            err: BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit, NonFiniteError)):
                # an interrupt stays one (Lightning shuts down gracefully on it);
                # a non-finite gradient is reported as in synchronous mode
                err = exc
            else:
                err = OptimizerStepError(f"optimizer {step} failed: {type(exc).__name__}: {exc}")
                err.__cause__ = exc
            if job is not None:
                job.handle.error = err
                job.handle.finish()
            self.store.fail(err)

    # ----------------------------------------------------------------- work
    def run(self, job: _Job) -> None:
        """One update: G copies, unscale, overflow check, clipping, ``fn``, P
        copies; on the caller's thread (synchronous mode) with the optimizer's
        intra-op thread count there too, put back after."""
        if self.threads is None or threading.current_thread() is self.thread:
            self._run(job)
            return
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            self._run(job)
        finally:
            torch.set_num_threads(previous)

    def _run(self, job: _Job) -> None:
        proto, w = self.protocol, job.window
        trainable = self.host.trainable
        chaos = proto.chaos
        inv = 1.0 / job.scale if job.scale != 1.0 else None
        finite = not job.skip
        bad: _Param | None = None
        # G copies, per parameter as its gradients complete (rule 3): the buffer
        # itself is lent to the step as .grad (nothing is allocated or copied);
        # the next window's gradients wait for its release (rule 4)
        try:
            for p in trainable:
                proto.wait_grads(w, p)
                try:
                    chaos("g_copy")
                except Exception as exc:
                    raise RuntimeError(
                        f"gradient copy (G copy) of {self.names.get(p.index, p.index)} failed"
                    ) from exc
                g = self.host.window_grad(p)
                self._grads[p.index] = g
                proto.g_copied(w, p)
                if g is None:  # no backward reached it: .grad stays None
                    continue
                if inv is not None:
                    g.mul_(inv)
                if (
                    finite
                    and (self.scaler.enabled or self.nonfinite != "ignore")
                    and not all_finite(g)
                ):
                    finite = False
                    bad = p
            if proto.replicated and proto.agreed_skip(w) and finite:
                finite, bad = False, None  # a replica's input gradient was not finite
            if not finite and not self.scaler.enabled and self.nonfinite == "raise":
                where = (
                    "the inputs' gradient on another replica"
                    if bad is None
                    else self.names.get(bad.index, bad.index)
                )
                raise NonFiniteError(
                    f"non-finite gradient (inf or NaN) in {where} "
                    f"in optimizer step {w}; the weights were not updated. Set nonfinite='skip' to "
                    "skip such steps, or look for the cause (learning rate, data, precision)"
                )
        except NonFiniteError:
            self._release(w, trainable)
            self._settle_failed(job)
            raise
        except BaseException:
            self._release(w, trainable)  # a failed step holds no gradients either
            raise
        norm = None
        after = proto.rules.copies_after_step
        try:
            if not after:  # rule 5 removed (tests): the weight copies run first
                self._p_copies(job)
            for p in trainable:
                g = self._grads[p.index]
                if g is None:
                    p.param.grad = None
                else:
                    p.param.grad = g if p.param.dtype == torch.float32 else g.to(p.param.dtype)
            clip_norm, clip_value = job.clip_norm, job.clip_value
            if job.prepare is not None:
                try:
                    clip = job.prepare() or {}
                except BaseException as exc:
                    raise HookError(exc) from exc
                clip_norm = clip.get("clip_grad_norm", clip_norm)
                clip_value = clip.get("clip_grad_value", clip_value)
                outside = clip.get("nonfinite")  # (a parameter outside the pipeline)
                if (
                    outside is not None
                    and finite
                    and (self.scaler.enabled or self.nonfinite != "ignore")
                ):
                    finite = False
                    if not self.scaler.enabled and self.nonfinite == "raise":
                        raise NonFiniteError(
                            f"non-finite gradient (inf or NaN) in {outside} in optimizer step "
                            f"{w}; the weights were not updated. Set nonfinite='skip' to skip "
                            "such steps, or look for the cause (learning rate, data, precision)"
                        )
            if finite:
                params = [p.param for p in trainable if p.param.grad is not None]
                if clip_norm is not None:
                    norm = float(torch.nn.utils.clip_grad_norm_(params, clip_norm))
                elif clip_value is not None:
                    norm = grad_norm_of([p.grad for p in params])
                    torch.nn.utils.clip_grad_value_(params, clip_value)
                chaos("step")
                with named(f"RP optimizer step {w}"):  # (a range in profiler traces)
                    job.handle.result = job.fn() if job.fn is not None else None
            elif self.scaler.enabled:
                log.info(
                    "fp16 overflow in window %d: step skipped, loss scale %g -> %g",
                    w,
                    self.scaler.scale,
                    self.scaler.scale * self.scaler.backoff_factor,
                )
            else:
                log.warning("non-finite gradient in step %d: step skipped (nonfinite='skip')", w)
        except BaseException:
            self._release(w, trainable)
            self._settle_failed(job)
            raise
        self._release(w, trainable)
        self.scaler.update(overflow=not finite)
        job.handle.grad_norm = norm
        job.handle.skipped = not finite
        self._applied(w)
        job.handle.finish()

    def _applied(self, w: int) -> None:
        """Step ``w`` counts as applied; its weight copies follow (in
        synchronous mode before this returns)."""
        proto = self.protocol
        after = proto.rules.copies_after_step
        with proto.cond:
            self.scaler.after[w] = self.scaler.scale
            self.scaler.after.pop(w - 4, None)
            # the weight copies are due before anyone sees the step as applied
            if after:
                self._pending = (w, list(self.host.params))
            self.applied += 1
            proto.cond.notify_all()
        if after and not proto.async_mode:
            self._copy_ready(block=True)

    def _settle_failed(self, job: _Job) -> None:
        """Synchronous mode: a step that failed after taking its gradients (a
        user hook, a non-finite gradient with ``nonfinite="raise"``, the
        optimizer's own step) counts as a skipped step, its weights copied as
        they are, so the engine stays whole for what Lightning does next (an
        ``OnExceptionCheckpoint`` saving the weights, as the default strategy
        would). The loss scale is left as it was. In asynchronous mode the
        thread stops and the engine fails."""
        if self.protocol.async_mode:
            return
        try:
            job.handle.skipped = True
            self._applied(job.window)
        except BaseException:
            return  # (the copies failed too: the engine fails with the error)
        job.settled = True
        job.handle.finish()

    def _release(self, w: int, trainable: list[_Param]) -> None:
        """The step's gradients are released as soon as it is done (as zero_grad
        with set_to_none would), and when it fails: the buffers are emptied (the
        next window's first gradient is copied in) and handed back (rule 4)."""
        self.host.detach_grads()
        self.host.zero_grads()
        self._grads.clear()
        self.protocol.released(w, trainable)

    def _p_copies(self, job: _Job) -> None:
        """Rule 5 removed (tests only): copy every weight now, out of order."""
        for p in self.host.params:
            self._p_copy(job.window, p)

    def _p_copy(self, w: int, p: _Param) -> None:
        if p.trainable:  # frozen weights never change: nothing to copy
            try:
                self.protocol.chaos("p_copy")
                with torch.no_grad():
                    p.master_for(w + 1).copy_(p.param.detach())
            except Exception as exc:
                raise RuntimeError(
                    f"weight copy (P copy) of {self.names.get(p.index, p.index)} after step {w} "
                    "failed"
                ) from exc
        self.protocol.p_copied(w, p)

    def _copy_possible(self) -> bool:
        """Whether a pending weight copy could run now (call under ``cond``)."""
        if self._pending is None:
            return False
        w, left = self._pending
        return any(self.protocol.uses_done(w, p) for p in left)

    def _copy_ready(self, block: bool = False) -> None:
        """P copies of the pending update whose parameters the next window no
        longer reads; with ``block`` wait for all of them. The wait has no
        watchdog: it may last until the user closes the next window."""
        if self._pending is None:
            return
        w, left = self._pending
        proto = self.protocol
        while left:
            with proto.cond:
                while True:
                    self.store.check()
                    ready = [p for p in left if proto.uses_done(w, p)]
                    if ready or not block:
                        break
                    proto.cond.wait(0.5)
            with named(f"RP optimizer weight copies {w}"):
                for p in ready:
                    self._p_copy(w, p)
            done = {p.index for p in ready}
            left = [p for p in left if p.index not in done]
            if not block:
                break
        with proto.cond:
            self._pending = None if not left else (w, left)
            proto.cond.notify_all()

    def copies_done(self) -> bool:
        """Whether no weight copy is pending (call under the protocol's ``cond``)."""
        return self._pending is None


def use_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Switch a host ``Adam``/``AdamW`` to torch's fused CPU kernel.

    The default per-tensor and multi-tensor paths are ~10x slower on the host
    (``benchmarks/optimizer.py``); the fused kernel computes the same update.
    Optimizers that are not Adam/AdamW, use ``differentiable``/``capturable``,
    or whose parameters are not fp32/fp64 CPU tensors are left alone. Returns
    whether the optimizer now runs fused."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    # (bf16/fp16 parameters: the fused kernel rounds differently from the
    # default path, so it would not be the same update)
    ok_dtypes = (torch.float32, torch.float64)
    for group in optimizer.param_groups:
        if group.get("differentiable") or group.get("capturable"):
            return False
        for p in group["params"]:
            if p.device.type != "cpu" or p.dtype not in ok_dtypes or p.is_sparse:
                return False
    for group in optimizer.param_groups:
        group["fused"] = True
        group["foreach"] = False
    optimizer.defaults["fused"] = True
    optimizer.defaults["foreach"] = False
    return True


def grad_norm_of(grads: Sequence[torch.Tensor]) -> float:
    """Total 2-norm of ``grads`` (for logging)."""
    if not grads:
        return 0.0
    return math.sqrt(sum(float(torch.linalg.vector_norm(g.float())) ** 2 for g in grads))

"""A device worker's courier: the thread that completes its transfers.

The worker thread never waits for the host; its courier waits for each copy
to complete and then publishes the value, adds gradients into the host
buffers (holding them while ordering rule 4 or an unknown gradient factor
says so), signals rule 1 and finishes jobs. See :class:`Courier`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .calls import Gain, Job
from .host import _Param
from .store import EngineFailure

if TYPE_CHECKING:
    from .worker import Worker

__all__ = ["Courier"]


@dataclass(eq=False)
class _Held:
    """A downloaded gradient the courier has not added yet."""

    job: Job
    param: _Param
    # None: no backward of the task reached the parameter (nothing is added,
    # but the add is signalled, as the optimizer's protocol counts it)
    grad: torch.Tensor | None
    # the factor it waits for (its call's, or an earlier turn's: it is added
    # after that one), counted there and no longer by its job; None: not parked
    parked: Gain | None = None


class Courier:
    """Completes one worker's transfers off its thread, in order.

    Items are ``(event, fn, job)``: wait for the copy's event, then run ``fn``
    (publish a value, signal rule 1, write running statistics back, finish a
    job). Gradients wait, in addition, until the previous step has released
    the host buffer (rule 4) and until their call's :class:`Gain` is known;
    they are held meanwhile, and nothing behind them waits; and a window's
    gradients of a parameter are added in their tasks' micro-batch order (the
    turns given at submission), so the fp32 sum does not depend on which device
    finished first. A job is done once
    its gradients are added or held for an unknown gain (its compute and copies
    are over; the window's step waits for those gradients by rule 3). The
    courier sleeps on its own condition, woken by its worker, by a release of
    gradient buffers, by a gain becoming known and by a failure, never by
    unrelated hand-offs."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.store = worker.rt.store
        self._cond = threading.Condition()
        self._items: deque[tuple[Any, Callable[[], None] | None, Job | None]] = deque()
        self._grads: list[_Held] = []  # held by rule 4 or for their call's gain
        self._stop = False
        self._poke = False  # a buffer was released: look at the held gradients again
        self._adding: Job | None = None  # whose gradient is being added (a failure names it)
        worker.rt.protocol.on_release.append(self.wake)
        self.store.on_fail.append(self.wake)
        self.thread = threading.Thread(
            target=self._main, name=f"roundpipe-courier-{worker.index}", daemon=True
        )

    def wake(self) -> None:
        with self._cond:
            self._poke = True
            self._cond.notify()

    def put(self, event: Any, fn: Callable[[], None] | None, job: Job | None) -> None:
        if job is not None:
            job.queued += 1
        with self._cond:
            self._items.append((event, fn, job))
            self._cond.notify()

    def grads(self, event: Any, job: Job, items: list[tuple[_Param, torch.Tensor | None]]) -> None:
        """Add ``items`` (parameter, fp32 host gradient or None where no
        backward reached it) once ``event`` is done; the job's last item: it is
        done once they are all in."""

        def hold() -> None:
            with self.store.lock:
                job.outstanding += len(items)
                job.finished = True
            self._grads.extend(_Held(job, p, g) for p, g in items)
            self._poke = True

        job.grads_last = True
        self.put(event, hold, job)

    def finish(self, job: Job) -> None:
        """The job's work is all queued: done at once when nothing of it is with
        the courier, else once the courier reaches this point."""
        if job.grads_last:  # its gradients carry the end
            return
        if job.queued == 0:
            self.worker.rt.job_done(job)
            return

        def end() -> None:
            self.worker.rt.job_done(job)

        self.put(None, end, job)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def _ready_grads(self) -> list[_Held]:
        """Held gradients whose buffer is free, whose gain is known and whose
        turn came now (this thread only). Those waiting for a gain (their
        call's, or an earlier turn's) no longer keep their job from being
        done: only autograd reaching a loss gives it."""
        if not self._grads:
            return []
        rt = self.worker.rt
        proto = rt.protocol
        ready, waiting, finished = [], [], []
        with proto.cond:
            for h in self._grads:
                window, p = h.job.call.window, h.param
                turn = h.job.turns[p.index]
                gain = h.job.call.gain
                if gain is not None and gain.value is None:
                    factor = gain
                elif not proto.grad_ready(window, p):
                    factor = None
                elif proto.in_turn(window, p, turn):
                    ready.append(h)
                    continue
                else:
                    factor = proto.factor_before(window, p, turn)
                if factor is not None and h.parked is not factor:
                    if h.parked is None:
                        h.job.outstanding -= 1
                        if h.job.outstanding == 0:
                            finished.append(h.job)
                    else:  # (its own factor came; an earlier turn's has not)
                        h.parked.parked -= 1
                        proto.cond.notify_all()
                    h.parked = factor
                    factor.parked += 1
                waiting.append(h)
        self._grads = waiting
        for job in finished:
            rt.job_done(job)
        return ready

    def _main(self) -> None:
        job: Job | None = None
        try:
            while True:
                with self._cond:
                    while not self._items and not self._poke:
                        if self.store.failure is not None or self._stop:
                            break
                        self._cond.wait(1.0)
                    if self.store.failure is not None:
                        return
                    poke, self._poke = self._poke, False
                    item = self._items.popleft() if self._items else None
                    if item is None and not poke and self._stop:
                        return
                if poke:
                    self._add_ready()
                if item is not None:
                    job = item[2]
                    self._complete(item)
                # (in methods, and dropped here: a finished item or gradient must
                # not stay referenced from this frame while the courier sleeps, or
                # the page-locked buffer its gradients came down into outlives
                # their add, and the next download pins a second one)
                item = job = None
        except EngineFailure:
            pass
        except BaseException as exc:  # every failure must reach the caller
            job = job or self._adding
            self.store.fail(self.worker.reported(exc, job, None, courier=True))

    def _add_ready(self) -> None:
        """Add the held gradients that may be added now (an add may make the
        next turn of a gradient this courier holds come)."""
        while self._add_some():
            pass

    def _add_some(self) -> bool:
        """Add the held gradients ready now; whether there were any."""
        rt = self.worker.rt
        ready = deque(self._ready_grads())
        if not ready:
            return False
        while ready:
            # taken off the list, so each gradient is released once added
            h = ready.popleft()
            job, window, p = h.job, h.job.call.window, h.param
            self._adding = job
            gain = job.call.gain
            factor = 1.0 if gain is None else gain.value
            rt.protocol.before_add(window, p)
            # dropped: autograd never reached the call's loss (an explicit
            # factor of 0 adds zeros, as autograd would)
            if h.grad is not None and (gain is None or not gain.dropped):
                rt.host.accumulate(p, h.grad, factor)
            rt.protocol.after_grad(window, p)  # rule 3 producer
            with self.store.lock:
                if h.parked is not None:
                    h.parked.parked -= 1
                    last = False
                    self.store.lock.notify_all()
                else:
                    job.outstanding -= 1
                    last = job.finished and job.outstanding == 0
            h = None
            if last:
                rt.job_done(job)
        self._adding = None
        return True

    @staticmethod
    def _complete(item: tuple[Any, Callable[[], None] | None, Job | None]) -> None:
        """Wait for the item's copy, then run its function."""
        event, fn, _ = item
        if event is not None:
            event.synchronize()  # the copy is complete (this thread only)
        if fn is not None:
            fn()

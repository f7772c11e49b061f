"""The optimizer thread's own ``param_groups`` (asynchronous optimizer).

Lightning and user code read and write ``optimizer.param_groups`` on the
training loop's thread: a learning-rate scheduler steps there after each
optimizer step, ``LearningRateMonitor`` reads the rate when a batch starts, a
callback may set a momentum. With the asynchronous optimizer the update of
batch ``k`` runs later, on the optimizer thread, while the loop goes on. Were
both threads to share the group dicts, what the loop reads would depend on how
far the thread had got, and an update could see a rate set for a later batch.

So the thread steps with dicts of its own (:class:`ThreadGroups`): each queued
step carries the values the loop changed since the step queued before it, so
the update of batch ``k`` uses what the loop saw when it queued it (the rate
the scheduler gave batch ``k``, as in ordinary training), and the loop reads
what it wrote itself. Values the optimizer changes while stepping (methods
that keep an estimate in the group) go back into the loop's dicts whenever
the steps have drained (checkpoints, evaluation, the end of a fit), as do
attributes a step rebinds on the optimizer. Written here because torch has no
notion of an optimizer stepping on another thread than its schedulers.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer

__all__ = ["ThreadGroups"]

_MISSING = object()


def _values(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


class ThreadGroups:
    """The optimizer thread's copy of ``optimizer.param_groups``; see the
    module's docstring. ``queued_step`` runs on the loop's thread, the
    function it returns on the optimizer thread, ``merge`` on the loop's
    thread once the queued steps have run."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self._groups: list[dict[str, Any]] = []  # the thread's (changed there only)
        # the loop's values as of the last queued step, and its group dicts then
        self._baseline: list[dict[str, Any]] | None = None
        self._layout: list[int] = []
        # (group, key) -> newest value the optimizer's own step gave it
        self._own: dict[tuple[int, str], Any] = {}
        # the loop's changes queued with each step, in order, until a step runs
        # (one skipped for a non-finite gradient leaves its changes to the next)
        self._pending: deque[tuple[int, Any, Any]] = deque()
        self._queued = 0
        self._lock = threading.Lock()

    def queued_step(self, **kwargs: Any) -> Callable[[], Any]:
        """What the optimizer thread runs for the step queued now:
        ``optimizer.step(**kwargs)`` on the thread's groups, brought up to
        the loop's values as they are now."""
        opt = self.optimizer
        loop = opt.param_groups
        values = [_values(g) for g in loop]
        layout = [id(g) for g in loop]
        reset: list[tuple[list[Any], dict[str, Any]]] | None = None
        delta: list[dict[str, Any]] = []
        if self._baseline is None or layout != self._layout:
            # the first step, a loaded state dict or an added group: take them whole
            reset = [(g["params"], dict(v)) for g, v in zip(loop, values, strict=True)]
        else:
            delta = [
                {k: v for k, v in new.items() if old.get(k, _MISSING) is not v}
                for new, old in zip(values, self._baseline, strict=True)
            ]
        self._baseline, self._layout = values, layout
        with self._lock:
            self._queued += 1
            number = self._queued
            self._pending.append((number, reset, delta))
        # (a learning-rate scheduler warns when it steps before the optimizer did)
        opt._opt_called = True  # type: ignore[attr-defined]
        step = type(opt).step  # (not an instance wrapper: a scheduler's refers to ``opt``)

        def run() -> Any:
            self._catch_up(number)
            # the optimizer with the thread's groups: every other attribute
            # (state, defaults, hooks) is the optimizer's own
            shadow = object.__new__(type(opt))
            shadow.__dict__.update(opt.__dict__)
            shadow.__dict__.pop("step", None)
            shadow.param_groups = self._groups
            before = [dict(g) for g in self._groups]
            attributes = dict(shadow.__dict__)
            try:
                return step(shadow, **kwargs)
            finally:
                with self._lock:
                    for i, (group, old) in enumerate(zip(self._groups, before, strict=True)):
                        for k, v in group.items():
                            if old.get(k, _MISSING) is not v:
                                self._own[(i, k)] = v
                for k, v in shadow.__dict__.items():
                    if k != "param_groups" and attributes.get(k, _MISSING) is not v:
                        setattr(opt, k, v)  # (an optimizer's own counters)

        return run

    def _catch_up(self, number: int) -> None:
        """On the optimizer thread: the loop's changes queued with the steps up
        to ``number`` (this one and any skipped before it), in order."""
        while True:
            with self._lock:
                if not self._pending or self._pending[0][0] > number:
                    return
                _, reset, delta = self._pending.popleft()
                if reset is not None:
                    self._own.clear()
            if reset is not None:
                self._groups = [{**v, "params": params} for params, v in reset]
            else:
                for group, changed in zip(self._groups, delta, strict=True):
                    group.update(changed)

    def merge(self) -> None:
        """Once the queued steps have run: the values the optimizer changed
        itself go into the loop's groups (unless those were replaced since,
        by a loaded state dict)."""
        with self._lock:
            own, self._own = self._own, {}
        loop = self.optimizer.param_groups
        if self._baseline is None or [id(g) for g in loop] != self._layout:
            return
        for (i, k), v in own.items():
            loop[i][k] = v
            self._baseline[i][k] = v

"""The optimizer thread's own ``param_groups`` (asynchronous optimizer).

Lightning and user code read and write ``optimizer.param_groups`` on the
training loop's thread: a learning-rate scheduler steps there after each
optimizer step, ``LearningRateMonitor`` reads the rate when a batch starts, a
callback may set a momentum. With the asynchronous optimizer the update of
batch ``k`` runs later, on the optimizer thread, while the loop goes on. Were
both threads to share the group dicts, what the loop reads would depend on how
far the thread had got, and an update could see a rate set for a later batch.

So the thread steps with dicts of its own (:class:`ThreadGroups`): each queued
step carries the values the loop changed since the step queued before it
(tensor values copied: schedulers change a tensor rate in place), so the
update of batch ``k`` uses what the loop saw when it queued it (the rate the
scheduler gave batch ``k``, as in ordinary training), and the loop reads what
it wrote itself. Values the optimizer changes while stepping (methods that
keep an estimate in the group) go back into the loop's dicts whenever the
steps have drained (checkpoints, evaluation, the end of a fit), unless the
loop has set them since; attributes a step rebinds go back to the optimizer.
A wrapper optimizer sharing its base's groups (Lookahead) has the base step
with the thread's groups too. The step runs on a shallow copy of the
optimizer holding the thread's groups, so step hooks receive that copy (its
state, defaults and hooks are the optimizer's own). Written here because
torch has no notion of an optimizer stepping on another thread than its
schedulers.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["ThreadGroups"]

_MISSING = object()

Group = dict[str, Any]


def _copy(value: Any) -> Any:
    """A value as it is now (a tensor's contents are copied)."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return a is b


def _values(group: Group) -> dict[str, Any]:
    return {k: _copy(v) for k, v in group.items() if k != "params"}


def _shadow(opt: Optimizer, groups: list[Group]) -> Optimizer:
    """``opt`` with ``groups`` for its param_groups and every other attribute
    its own (state, defaults, hooks), stepping through its class's ``step``
    (an instance-level wrapper, such as a scheduler's, refers to ``opt``)."""
    shadow = object.__new__(type(opt))
    shadow.__dict__.update(opt.__dict__)
    shadow.__dict__.pop("step", None)
    shadow.param_groups = groups
    return shadow


class ThreadGroups:
    """The optimizer thread's copy of ``optimizer.param_groups``; see the
    module's docstring. ``queued_step`` runs on the loop's thread, the
    function it returns on the optimizer thread, ``merge`` on the loop's
    thread once the queued steps have run."""

    def __init__(self, optimizer: Optimizer) -> None:
        if isinstance(type(optimizer).__dict__.get("param_groups"), property):
            raise ValueError(
                f"{type(optimizer).__name__} exposes param_groups as a property: the "
                "asynchronous optimizer steps with param_groups of its own, so that the training "
                "loop's schedulers never race it; use strategy='roundpipe_sync' "
                "(async_optimizer=False) with this optimizer"
            )
        self.optimizer = optimizer
        # loop: each of its group dicts with its values as of the last queued step
        self._seen: list[tuple[Group, dict[str, Any]]] = []
        # thread: each loop group dict with the thread's own dict for it
        self._pairs: list[tuple[Group, Group]] = []
        # (id of a loop group, key) -> (that group, key, newest value the
        # optimizer's own step gave it)
        self._own: dict[tuple[int, str], tuple[Group, str, Any]] = {}
        # the loop's changes queued with each step, in order, until a step runs
        # (one skipped for a non-finite gradient leaves its changes to the next)
        self._pending: deque[tuple[int, list[tuple[Group, Any, dict[str, Any]]]]] = deque()
        self._queued = 0
        self._lock = threading.Lock()

    def queued_step(self, **kwargs: Any) -> Callable[[], Any]:
        """What the optimizer thread runs for the step queued now:
        ``optimizer.step(**kwargs)`` on the thread's groups, brought up to
        the loop's values as they are now."""
        opt = self.optimizer
        entries: list[tuple[Group, Any, dict[str, Any]]] = []
        seen = []
        for group in opt.param_groups:
            values = _values(group)
            old = next((v for g, v in self._seen if g is group), None)
            if old is None:  # a new group (the first step, a loaded state, an added group)
                entries.append((group, group["params"], values))
            else:
                changed = {k: v for k, v in values.items() if not _same(old.get(k, _MISSING), v)}
                entries.append((group, None, changed))
            seen.append((group, values))
        self._seen = seen
        with self._lock:
            self._queued += 1
            number = self._queued
            self._pending.append((number, entries))
        # (a learning-rate scheduler warns when it steps before the optimizer did)
        opt._opt_called = True  # type: ignore[attr-defined]
        step = type(opt).step

        def run() -> Any:
            self._catch_up(number)
            groups = [mine for _, mine in self._pairs]
            shadow = _shadow(opt, groups)
            # a wrapper sharing its base optimizer's groups (Lookahead): the base too
            bases = {
                k: v
                for k, v in opt.__dict__.items()
                if isinstance(v, Optimizer) and v.param_groups is opt.param_groups
            }
            shadows = [(opt, shadow)]
            for k, base in bases.items():
                shadow.__dict__[k] = _shadow(base, groups)
                shadows.append((base, shadow.__dict__[k]))
            before = [{k: _copy(v) for k, v in g.items() if k != "params"} for g in groups]
            attributes = [dict(s.__dict__) for _, s in shadows]
            try:
                return step(shadow, **kwargs)
            finally:
                with self._lock:
                    for (loop, mine), old in zip(self._pairs, before, strict=True):
                        for k, v in mine.items():
                            if k != "params" and not _same(old.get(k, _MISSING), v):
                                self._own[(id(loop), k)] = (loop, k, _copy(v))
                # attributes a step rebound (an optimizer's own counters) are the
                # optimizer's (not the groups, nor the base shadows themselves)
                for (original, copy), had in zip(shadows, attributes, strict=True):
                    for k, v in copy.__dict__.items():
                        if k != "param_groups" and k not in bases and had.get(k) is not v:
                            setattr(original, k, v)

        return run

    def _catch_up(self, number: int) -> None:
        """On the optimizer thread: the loop's changes queued with the steps up
        to ``number`` (this one and any skipped before it), in order."""
        while True:
            with self._lock:
                if not self._pending or self._pending[0][0] > number:
                    return
                _, entries = self._pending.popleft()
            pairs = []
            for loop, params, values in entries:
                mine = next((m for g, m in self._pairs if g is loop), None)
                if params is not None or mine is None:  # (a new group)
                    mine = {**values, "params": loop["params"]}
                else:
                    mine.update(values)
                pairs.append((loop, mine))
            self._pairs = pairs

    def merge(self) -> None:
        """Once the queued steps have run: the values the optimizer changed
        itself go into the loop's groups that are still there, unless the
        loop has set them since it queued the last step."""
        with self._lock:
            own, self._own = self._own, {}
        for loop, k, v in own.values():
            seen = next((s for g, s in self._seen if g is loop), None)
            if seen is None or not _same(loop.get(k, _MISSING), seen.get(k, _MISSING)):
                continue  # (replaced, or set by the loop: the loop's value wins)
            loop[k] = v
            seen[k] = _copy(v)

"""The activation store: stage-boundary values in host memory, and the hand-offs.

Keys are :class:`Key` ``(iteration, kind, layer, microbatch)``: kind ``"act"`` is the input
of ``layer`` (written by the stage that produced it, read by every stage that
starts there), ``"grad"`` the gradient with respect to that input (written by
the backward stage that starts there, read by the backward stage below it),
``"loss"`` a micro-batch's loss. Each entry is freed once its known number of
readers have taken it.

Every wait is bounded: it is woken when a value arrives, when any worker fails
(:meth:`fail`), or when the watchdog timeout passes, and then raises with what
it was waiting for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

__all__ = ["EngineClosedError", "EngineFailure", "HandoffTimeout", "Key", "Store"]

Kind = Literal["act", "grad", "loss"]


class Key(NamedTuple):
    """Where a stage-boundary value lives: of ``iteration``, the ``kind`` of
    value at pipeline layer ``layer`` (0 for a loss) for ``microbatch``."""

    iteration: int
    kind: Kind
    layer: int
    microbatch: int

    def __str__(self) -> str:
        return (
            f"{self.kind}{self.layer} of micro-batch {self.microbatch} (iteration {self.iteration})"
        )


class EngineFailure(RuntimeError):
    """Raised by every wait once a worker has failed; carries the first failure."""


class EngineClosedError(RuntimeError):
    """The engine was closed; create a new one."""


class HandoffTimeout(TimeoutError):
    """A value did not arrive within the watchdog timeout.

    Attributes:
        optimizer: the optimizer step that produces the value (its weight
            copies) has not finished: the wait is the optimizer's, not a
            device worker's (None: a stage's).
    """

    def __init__(self, message: str, optimizer: int | None = None) -> None:
        super().__init__(message)
        self.optimizer = optimizer


class _Entry:
    __slots__ = ("event", "readers", "value")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = None
        self.readers = 0


class Store:
    """Thread-safe keyed hand-off of host values between workers and the controller.

    Each key has its own event, so publishing a value wakes only the thread
    waiting for it; a failure sets every event so that all waiters return."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._cond = threading.Condition()
        self._entries: dict[Key, _Entry] = {}
        self._failure: BaseException | None = None
        #: the failure reached the caller's thread (an error raised to it), so
        #: a caller that went on from it knows it (see RoundPipeStrategy._recover)
        self.raised = False
        self.on_fail: list = []  # callables woken by a failure (threads with their own waits)

    # ------------------------------------------------------------ failures
    def fail(self, exc: BaseException) -> None:
        """Record the first failure and wake every waiter."""
        with self._cond:
            if self._failure is None:
                self._failure = exc
            for entry in self._entries.values():
                entry.event.set()
            self._cond.notify_all()
        for wake in list(self.on_fail):
            wake()

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def check(self) -> None:
        if self._failure is not None:
            raise EngineFailure(str(self._failure)) from self._failure

    # -------------------------------------------------------------- values
    def _entry(self, key: Key) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
            if self._failure is not None:
                entry.event.set()
        return entry

    def put(self, key: Key, value: Any, readers: int = 1) -> None:
        """Publish ``value`` for ``readers`` takes."""
        with self._cond:
            entry = self._entry(key)
            entry.value = value
            entry.readers = readers
            entry.event.set()

    def take(
        self, key: Key, what: str = "", copy: Callable[[Any], Any] | None = None
    ) -> tuple[Any, bool]:
        """Wait for ``key`` and take one read of it. Returns ``(value, last)``;
        ``last`` is true for the final reader, after which the entry is dropped
        (so that reader may use the value in place; earlier readers must not).
        ``copy``: what a reader before the last gets instead of the value,
        made before the last reader can take it (and write it in place)."""
        with self._cond:
            entry = self._entry(key)
        if not entry.event.is_set():
            deadline = time.monotonic() + self.timeout
            while not entry.event.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
                self.check()
                if time.monotonic() >= deadline:
                    raise HandoffTimeout(
                        f"waited {self.timeout:g} s for {what or key} ({key!r}); it never "
                        "arrived: the stage that produces it is slow or stuck, or waits in turn; "
                        "raise watchdog_timeout if stages are this slow"
                    )
        self.check()
        with self._cond:
            value = entry.value
            entry.readers -= 1
            last = entry.readers <= 0
            if last:
                del self._entries[key]
            elif copy is not None and value is not None:
                value = copy(value)
            return value, last

    def ready(self, key: Key) -> bool:
        with self._cond:
            entry = self._entries.get(key)
            return entry is not None and entry.event.is_set()

    def wait_until(self, predicate, what: str, timeout: float | None = None) -> None:
        """Wait until ``predicate()`` (called under the lock) is true; whoever
        makes it true must call :meth:`notify`. ``timeout``: seconds before
        failing (default: the watchdog timeout)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._cond:
            while not predicate():
                self.check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HandoffTimeout(
                        f"waited {self.timeout if timeout is None else timeout:g} s for {what}; "
                        "raise watchdog_timeout if stages are this slow"
                    )
                self._cond.wait(min(left, 1.0))
            self.check()

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    @property
    def lock(self) -> threading.Condition:
        return self._cond

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)

    def clear(self) -> None:
        with self._cond:
            self._entries.clear()

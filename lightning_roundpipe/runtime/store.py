"""The activation store: stage-boundary values in host memory, and the hand-offs.

Keys are ``(iteration, kind, layer, micro-batch)``: kind ``"act"`` is the input
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
from typing import Any

__all__ = ["EngineFailure", "HandoffTimeout", "Store"]

Key = tuple[int, str, int, int]


class EngineFailure(RuntimeError):
    """Raised by every wait once a worker has failed; carries the first failure."""


class HandoffTimeout(TimeoutError):
    """A value did not arrive within the watchdog timeout."""


class Store:
    """Thread-safe keyed hand-off of host values between workers and the controller."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._cond = threading.Condition()
        self._values: dict[Key, Any] = {}
        self._readers: dict[Key, int] = {}
        self._failure: BaseException | None = None

    # ------------------------------------------------------------ failures
    def fail(self, exc: BaseException) -> None:
        """Record the first failure and wake every waiter."""
        with self._cond:
            if self._failure is None:
                self._failure = exc
            self._cond.notify_all()

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def check(self) -> None:
        if self._failure is not None:
            raise EngineFailure(str(self._failure)) from self._failure

    # -------------------------------------------------------------- values
    def put(self, key: Key, value: Any, readers: int = 1) -> None:
        """Publish ``value`` for ``readers`` takes."""
        with self._cond:
            self._values[key] = value
            self._readers[key] = readers
            self._cond.notify_all()

    def take(self, key: Key, what: str = "") -> Any:
        """Wait for ``key`` and take one read of it; the entry is dropped after
        its last reader."""
        with self._cond:
            value = self._wait(key, what)
            left = self._readers[key] - 1
            if left <= 0:
                del self._values[key]
                del self._readers[key]
            else:
                self._readers[key] = left
            return value

    def ready(self, key: Key) -> bool:
        with self._cond:
            return key in self._values

    def _wait(self, key: Key, what: str) -> Any:
        deadline = time.monotonic() + self.timeout
        while key not in self._values:
            self.check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise HandoffTimeout(
                    f"waited {self.timeout:g} s for {what or key} (key {key}); it never arrived. "
                    "A worker may be stuck; raise watchdog_timeout if stages are this slow"
                )
            self._cond.wait(min(left, 1.0))
        self.check()
        return self._values[key]

    def wait_until(self, predicate, what: str) -> None:
        """Wait until ``predicate()`` (called under the lock) is true."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while not predicate():
                self.check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HandoffTimeout(
                        f"waited {self.timeout:g} s for {what}; raise watchdog_timeout if "
                        "stages are this slow"
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
            return len(self._values)

    def clear(self) -> None:
        with self._cond:
            self._values.clear()
            self._readers.clear()

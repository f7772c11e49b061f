"""Data parallelism across servers: each window's gradients summed over the replicas.

One RoundPipe replica runs per server; the replicas are the ranks of a
torch.distributed process group. After a window closes (``engine.step``), the
:class:`GradientReducer` thread averages the window's fp32 gradients over the
replicas in host memory, in place in the gradient arena, bucket by bucket in a
fixed order (from the last pipeline layer to the first: the order backward
completes them, and the same order on every replica, as collectives need). A
bucket goes out as soon as every gradient of its layers is in the buffers
(ordering rule 3 of :mod:`.optimizer`), while earlier layers are still running
backward; the optimizer's G copy of a parameter waits for its bucket
(:meth:`Rules.grads_complete <lightning_roundpipe.runtime.optimizer.Rules.grads_complete>`).
The backend is gloo: the gradients live in host memory, so gloo sums them
where they are, with no device staging buffer competing with the pipeline for
GPU memory and copy engines.

Each bucket also carries one flag per parameter (whether any replica's
backward reached it: a parameter no replica reached keeps ``.grad = None``)
and the window's skip flag (a non-finite input gradient on one replica skips
the step on all), so every replica applies the same update.

Failures: a replica that raises writes its error into the rendezvous store
(:meth:`Replicas.report_failure`); every reducer beats a heartbeat there. When
a collective fails or a replica's failure appears, the others fail with a
:class:`ReplicaError` that names the rank and what it reported, or the ranks
whose heartbeat stopped (a killed or hung process), within the watchdog
timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .host import HostState, _Param
from .store import EngineFailure, HandoffTimeout, Store

__all__ = ["GradientReducer", "ReplicaError", "Replicas"]

log = logging.getLogger(__name__)

# seconds between looks at the all-reduces in flight: small next to a bucket's
# transfer (25 MiB take ~20 ms even at 10 Gb/s)
_POLL = 0.002


class ReplicaError(RuntimeError):
    """Another replica (server) failed, stopped, or the reduction with it did."""


class Replicas:
    """This process's place among the replicas, and the rendezvous store they
    share for failure reports and heartbeats.

    Args:
        group: the process group gradients are reduced on (gloo, its own group:
            collectives of the training loop's thread use another one, so the
            two threads never interleave calls on one group).
        rank: this replica's rank in ``group`` (the server's rank).
        world_size: number of replicas.
        store: the rendezvous key-value store (``torch.distributed.Store``), for
            failure reports and heartbeats; None: failures are reported with
            what the collective says alone.
        bucket_bytes: gradient bytes per all-reduce (whole layers; a larger
            layer is one bucket).
        heartbeat: seconds between heartbeats.
        prefix: the store keys' prefix: the same on every replica, and new
            for every joining (a failure reported in an earlier fit of the
            same processes, or before a restart, stays under its own).
    """

    def __init__(
        self,
        group: Any,
        rank: int,
        world_size: int,
        *,
        store: Any = None,
        bucket_bytes: int = 25 * 2**20,
        heartbeat: float = 1.0,
        prefix: str = "roundpipe/",
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not a rank of {world_size} replicas")
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.bucket_bytes = bucket_bytes
        self.heartbeat = heartbeat
        self.prefix = prefix
        self._beats = 0
        self._last_beat = 0.0
        self._last_poll = 0.0

    # ------------------------------------------------------------- reports
    def _call(self, fn: Callable[[], Any]) -> Any:
        """A store operation, or None when the store is unreachable."""
        if self.store is None:
            return None
        try:
            return fn()
        except Exception:  # the store's host stopped: nothing more to learn from it
            return None

    def beat(self) -> None:
        """Tell the others this replica is alive (at most once per ``heartbeat``)."""
        now = time.monotonic()
        if now - self._last_beat < self.heartbeat:
            return
        self._last_beat = now
        self._beats += 1
        self._call(lambda: self.store.set(f"{self.prefix}alive/{self.rank}", str(self._beats)))

    def progress(self, window: int) -> None:
        """Tell the others this replica closed ``window`` (for diagnoses)."""
        self._call(lambda: self.store.set(f"{self.prefix}window/{self.rank}", str(window)))

    def _read(self, kind: str, others: bool = True) -> dict[int, bytes | None]:
        """Each rank's ``kind`` key (``alive``, ``window``, ``failed``), None
        where it was never set; without this rank when ``others``."""
        out = {}
        for r in range(self.world_size):
            if others and r == self.rank:
                continue
            key = f"{self.prefix}{kind}/{r}"
            has = self._call(lambda key=key: self.store.check([key]))
            out[r] = self._call(lambda key=key: self.store.get(key)) if has else None
        return out

    def report_failure(self, message: str) -> None:
        """Record why this replica stopped, for the others' errors (first
        report per rank wins)."""
        key = f"{self.prefix}failed/{self.rank}"
        if self._call(lambda: self.store.check([key])):
            return
        order = self._call(lambda: self.store.add(f"{self.prefix}failures", 1))
        self._call(lambda: self.store.set(key, f"{order or 0}|{message}"))

    def report_finished(self) -> None:
        """Record that this replica's fit ended (for the others' errors, when
        they go on: the servers took different numbers of steps)."""
        self._call(lambda: self.store.set(f"{self.prefix}finished/{self.rank}", "1"))

    def failures(self) -> dict[int, str]:
        """What other replicas reported, first failure first, by rank."""
        if not self._call(lambda: self.store.add(f"{self.prefix}failures", 0)):
            return {}
        found = []
        for r, raw in self._read("failed").items():
            if raw is not None:
                order, _, message = raw.decode().partition("|")
                found.append((int(order or 0), r, message))
        return {r: message for _, r, message in sorted(found)}

    def _finished(self) -> str:
        ranks = [r for r, raw in self._read("finished").items() if raw is not None]
        if not ranks:
            return ""
        return (
            f"replica rank {', '.join(map(str, ranks))} finished its fit while this one goes "
            "on: the servers took different numbers of optimizer steps (max_steps, epochs, or "
            "uneven data per server; every server must take the same steps)"
        )

    def reported(self) -> str:
        """The failures the others reported, first first ("" for none)."""
        return "; ".join(f"replica rank {r} failed: {m}" for r, m in self.failures().items())

    def poll(self) -> str | None:
        """A peer's failure report, if one appeared (checked at most once per
        ``heartbeat``)."""
        now = time.monotonic()
        if now - self._last_poll < self.heartbeat:
            return None
        self._last_poll = now
        failed = self.failures()
        if not failed:
            return None
        rank, message = next(iter(failed.items()))
        return f"replica rank {rank} failed: {message}"

    def error(self, what: str, exc: BaseException) -> ReplicaError:
        """``what`` (a collective with the other replicas) failed with ``exc``:
        the error to raise, naming the replica to blame where the store knows."""
        err = ReplicaError(
            f"replica rank {self.rank} of {self.world_size}: {what} with the other replicas "
            f"failed ({type(exc).__name__}: {str(exc).strip()[:500]}); {self.diagnose()}"
        )
        err.__cause__ = exc
        return err

    def diagnose(self) -> str:
        """Which replica is to blame, as far as the store tells: a reported
        failure, or the ranks whose heartbeat stands still (this waits a few
        heartbeats)."""
        if self.store is None:
            return "(no rendezvous store to ask which replica stopped)"
        reported = self.reported()
        if reported:
            return reported
        if self._call(lambda: self.store.add(f"{self.prefix}failures", 0)) is None:
            return (
                "the rendezvous store is unreachable: the server hosting it (rank 0's, or "
                "its launcher) stopped, or finished its fit (if it ended normally, the servers "
                "took different numbers of steps)"
            )
        finished = self._finished()
        if finished:
            return finished
        before = self._read("alive")
        time.sleep(3 * self.heartbeat + 0.5)
        after = self._read("alive")
        reported = self.reported() or self._finished()
        if reported:
            return reported
        still = [r for r in before if before[r] == after.get(r)]
        if still:
            ranks = ", ".join(map(str, still))
            return (
                f"replica rank {ranks} stopped responding (no heartbeat for "
                f"{3 * self.heartbeat + 0.5:g} s: the process died or hangs)"
            )
        windows = {
            r: -1 if raw is None else int(raw)
            for r, raw in self._read("window", others=False).items()
        }
        ahead = max(windows.values())
        behind = [r for r, w in windows.items() if w < ahead]
        if behind:
            return "; ".join(
                f"replica rank {r} is alive but has not closed optimizer window {ahead} (its "
                f"last: {windows[r]}): its training loop is stuck or slower than "
                "watchdog_timeout allows"
                for r in behind
            )
        return "every other replica is alive; one of them is slower than watchdog_timeout allows"


@dataclass
class _Bucket:
    """Whole layers' gradients: one contiguous range of the gradient arena."""

    layers: tuple[int, int]
    params: list[_Param]
    view: torch.Tensor  # fp32 view of the arena range (padding included)


@dataclass
class _Flight:
    window: int
    bucket: int
    flags: torch.Tensor
    works: list[Any]  # torch.distributed Work handles, polled (see _POLL)
    started: float


def gradient_layer_bytes(host: HostState) -> list[int]:
    """fp32 gradient bytes each layer introduces (its trainable parameters
    not used by an earlier layer), the sizes buckets are formed from."""
    out = []
    for start, stop in zip(host.first_params[:-1], host.first_params[1:], strict=True):
        out.append(sum(p.grad.numel() * 4 for p in host.params[start:stop] if p.trainable))
    return out


class GradientReducer:
    """The thread that averages each closed window's gradients over the replicas.

    ``buckets`` are layer ranges ``[start, stop)`` in reduction order (see
    :func:`lightning_roundpipe.plan.replicas.gradient_buckets`)."""

    def __init__(
        self,
        host: HostState,
        store: Store,
        protocol: Any,
        replicas: Replicas,
        buckets: Sequence[tuple[int, int]],
    ) -> None:
        self.host = host
        self.store = store
        self.protocol = protocol
        self.replicas = replicas
        self.buckets = self._build(buckets)
        self._jobs: deque[tuple[int, bool] | None] = deque()
        self._flights: deque[_Flight] = deque()
        self.thread: threading.Thread | None = None
        self.seconds = 0.0  # time with a collective in flight, for reports
        self._busy_until = 0.0
        self.bytes = 0  # gradient bytes reduced (this replica's contribution)
        self.windows = 0  # windows whose reduction is complete

    def _build(self, ranges: Sequence[tuple[int, int]]) -> list[_Bucket]:
        host = self.host
        arena = host.grad_pool
        position = {p.index: k for k, p in enumerate(host.trainable)}
        out = []
        for start, stop in ranges:
            params = [
                p
                for p in host.params[host.first_params[start] : host.first_params[stop]]
                if p.trainable
            ]
            if not params:
                continue
            first, last = position[params[0].index], position[params[-1].index]
            assert last - first + 1 == len(params), "a layer's gradients are one arena range"
            begin = arena.offsets[first]
            end = arena.offsets[last] + params[-1].grad.numel() * 4
            assert arena.buffer is not None
            out.append(_Bucket((start, stop), params, arena.buffer[begin:end].view(torch.float32)))
        if not out:  # no trainable parameter: the skip flag still needs agreeing on
            out.append(_Bucket((0, 0), [], torch.zeros(0, dtype=torch.float32)))
        return out

    # --------------------------------------------------------------- thread
    def start(self) -> None:
        self.thread = threading.Thread(target=self._main, name="roundpipe-reducer", daemon=True)
        self.thread.start()

    def submit(self, window: int, skip: bool) -> None:
        """Reduce ``window`` once its gradients are in (``skip``: this replica
        must skip the step; the replicas agree on it)."""
        with self.protocol.cond:
            self._jobs.append((window, skip))
            self.protocol.cond.notify_all()

    def stop(self) -> None:
        with self.protocol.cond:
            self._jobs.append(None)
            self.protocol.cond.notify_all()

    def _main(self) -> None:
        window = None
        try:
            while True:
                self._wait_for(lambda: bool(self._jobs), None, "")
                with self.protocol.cond:
                    window, skip = self._jobs.popleft()
                self.replicas.progress(window)
                self._reduce(window, skip)
        except _Stopped:
            return
        except EngineFailure:
            return  # another thread failed first: its error is the one to raise
        except BaseException as exc:
            err = exc if isinstance(exc, ReplicaError) else self._error(window, exc)
            self.store.fail(err)

    def _error(self, window: int | None, exc: BaseException) -> ReplicaError:
        what = f"window {window}'s" if window is not None else "the"
        return self.replicas.error(f"reducing {what} gradients", exc)

    # ----------------------------------------------------------------- work
    def _wait_for(self, ready: Callable[[], bool], deadline: float | None, what: str) -> None:
        """Finish completed all-reduces, beat the heartbeat and watch for a
        peer's failure until ``ready()`` (called under the lock); past
        ``deadline`` (None: no limit) fail with ``what`` was awaited."""
        cond = self.protocol.cond
        while True:
            self._finish_completed()
            with cond:
                if self._jobs and self._jobs[0] is None:
                    raise _Stopped
                if self.store.failure is not None:
                    raise EngineFailure(str(self.store.failure))
                if ready():
                    return
                # polled while all-reduces are in flight: a Python callback on
                # gloo's thread would run during interpreter shutdown when a
                # failed run leaves one behind, and abort the process
                cond.wait(_POLL if self._flights else self.replicas.heartbeat / 2)
            self.replicas.beat()
            peer = self.replicas.poll()
            if peer is not None:
                raise ReplicaError(
                    f"replica rank {self.replicas.rank} of {self.replicas.world_size} stops: {peer}"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise HandoffTimeout(
                    f"waited {self.store.timeout:g} s for {what}; raise watchdog_timeout if "
                    "stages are this slow"
                )

    def _reduce(self, window: int, skip: bool) -> None:
        proto, rules = self.protocol, self.protocol.rules
        timeout = self.store.timeout
        for i, bucket in enumerate(self.buckets):
            params = bucket.params
            self._wait_for(
                lambda params=params: all(rules.grads_added(proto, window, p) for p in params),
                time.monotonic() + timeout,
                f"the gradients of layers {bucket.layers[0]}-{bucket.layers[1] - 1} in window "
                f"{window}",
            )
            self._launch(window, i, skip)
        # the window is done once its last bucket is; each all-reduce in flight
        # carries its own watchdog deadline (from its launch), so no second one
        # here that could race it with a vaguer message
        self._wait_for(lambda: not self._flights, None, f"window {window}'s reduction")

    def _launch(self, window: int, index: int, skip: bool) -> None:
        bucket = self.buckets[index]
        flags = torch.zeros(1 + len(bucket.params), dtype=torch.float32)  # (any default dtype)
        flags[0] = float(skip)
        for k, p in enumerate(bucket.params):
            with p.lock:
                if p.filled:
                    flags[k + 1] = 1.0
                else:  # stale values of an earlier window: this replica adds nothing
                    p.grad.zero_()
        group = self.replicas.group
        works = [dist.all_reduce(t, group=group, async_op=True) for t in (bucket.view, flags)]
        flight = _Flight(window, index, flags, works, time.monotonic())
        with self.protocol.cond:
            self._flights.append(flight)
        self.bytes += bucket.view.numel() * 4

    def _finish_completed(self) -> None:
        """Collectives complete in the order they were issued: finish those done."""
        while True:
            with self.protocol.cond:
                if not self._flights or not all(w.is_completed() for w in self._flights[0].works):
                    flight = self._flights[0] if self._flights else None
                    if flight is not None and time.monotonic() - flight.started > (
                        self.store.timeout
                    ):
                        raise TimeoutError(
                            f"the all-reduce of window {flight.window}'s bucket {flight.bucket} "
                            f"took more than {self.store.timeout:g} s (watchdog_timeout)"
                        )
                    return
                flight = self._flights.popleft()
            for w in flight.works:
                w.wait()  # raises the collective's error
            self._finish(flight)

    def _finish(self, flight: _Flight) -> None:
        bucket = self.buckets[flight.bucket]
        world = self.replicas.world_size
        bucket.view.div_(world)
        for k, p in enumerate(bucket.params):
            with p.lock:
                p.filled = bool(flight.flags[k + 1] > 0)
        now = time.monotonic()  # busy time: the union of the flights' intervals
        self.seconds += now - max(flight.started, self._busy_until)
        self._busy_until = now
        last = flight.bucket == len(self.buckets) - 1
        with self.protocol.cond:
            for p in bucket.params:
                self.protocol.reduced[p.index] = flight.window + 1
            if last:
                self.protocol.verdicts[flight.window] = bool(flight.flags[0] > 0)
                self.windows += 1
            self.protocol.cond.notify_all()


class _Stopped(Exception):
    """The reducer was asked to stop."""

"""Event-driven schedule simulator: RoundPipe against stage-bound pipeline schedules.

Every schedule is turned into the same thing: for each device an ordered list
of operations (a stage for one micro-batch: forward, recompute, backward
parts), each depending on the operations whose outputs it consumes. The
engine starts each device's next operation as soon as the device is free and
its inputs have arrived; an input produced on another device arrives
``comm_time`` later (the copy overlaps compute on both devices).

Schedules (``schedule=``):

* ``"roundpipe"``: asymmetric forward/fused/backward slots dispatched
  round-robin (:mod:`.dispatch`); any device runs any stage.
* ``"gpipe"``: one stage per device; all forwards, then all backwards.
* ``"1f1b"``: one stage per device; warm-up forwards, then one forward / one
  backward alternately (PipeDream-Flush).
* ``"interleaved-1f1b"``: ``v`` stages per device (stage ``s`` on device
  ``s mod N``), Megatron-LM's interleaved order; needs ``M`` divisible by ``N``.
* ``"looped-bfs"``: ``v`` stages per device, breadth first: every micro-batch
  through one local stage before the next.

Baselines use activation checkpointing at stage granularity by default
(``recompute=True``): a backward op recomputes its stage, then runs backward,
except the model's last layer (the LM head and loss), whose activations are
kept from its forward as in RoundPipe's fused stage: the head's forward runs
once per micro-batch in every schedule. This is how the paper's simulator
models the baselines (it reproduces the reference's 20 baseline cases
exactly); recomputing the head too would charge the baselines ``M`` extra head
forwards that RoundPipe does not pay.

Bubble ratio = idle device time / (makespan x N), split into *fill* (before a
device's first op), *drain* (after its last op) and *steady* (idle time in
between). For RoundPipe with ``async_optimizer=True`` the result also carries
``async_bubble_ratio``: the idle fraction per iteration in the steady state of
back-to-back iterations, when one iteration's drain overlaps the next one's
fill (the optimizer runs one step behind, so no flush separates them).
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .costs import LayerCosts, PlanError
from .partition import balanced_partition
from .schedule import Clock, Copies, Placement, Schedule, Segment, SegmentKind, lower
from .stages import StagePlan

__all__ = [
    "SCHEDULES",
    "ScheduleName",
    "Segment",
    "SimulationResult",
    "check_within_limit",
    "result_from_segments",
    "simulate",
    "simulate_schedules",
    "steady_async_bubble",
]

ScheduleName = Literal["roundpipe", "gpipe", "1f1b", "interleaved-1f1b", "looped-bfs"]
SCHEDULES: tuple[str, ...] = ("roundpipe", "gpipe", "1f1b", "interleaved-1f1b", "looped-bfs")


@dataclass(frozen=True)
class SimulationResult:
    """Outcome of :func:`simulate`.

    Attributes:
        schedule: the schedule's name.
        num_devices, num_microbatches, iterations: the simulated setting.
        makespan: time from the first op's start to the last op's end.
        busy: busy time of each device.
        bubble_ratio: idle time / (makespan x N).
        fill_ratio, drain_ratio, steady_ratio: the bubble split by where idle
            time falls (they add up to ``bubble_ratio``).
        async_bubble_ratio: RoundPipe with the asynchronous optimizer only: the
            steady-state idle fraction when iterations run back to back.
        timeline: every busy segment, by start time.
        plan: RoundPipe's stage plan; ``stages``: a baseline's layers per stage.
        copy_wait: RoundPipe with ``copies`` only: device time spent waiting
            for exposed host-device copies (part of the idle time).
    """

    schedule: str
    num_devices: int
    num_microbatches: int
    iterations: int
    makespan: float
    busy: tuple[float, ...]
    bubble_ratio: float
    fill_ratio: float
    drain_ratio: float
    steady_ratio: float
    timeline: tuple[Segment, ...]
    plan: StagePlan | None = None
    stages: tuple[int, ...] | None = None
    async_bubble_ratio: float | None = None
    copy_wait: float = 0.0

    def device_timeline(self, device: int) -> list[Segment]:
        """The segments one device ran, in time order."""
        return [s for s in self.timeline if s.device == device]

    @property
    def work(self) -> float:
        """Total busy device time."""
        return sum(self.busy)


# ---------------------------------------------------------------- the engine
@dataclass
class _Op:
    key: tuple
    device: int
    parts: list[tuple[SegmentKind, float]]
    stage: str
    microbatch: int
    iteration: int = 0
    deps: list[tuple] = field(default_factory=list)


def _run(queues: list[list[_Op]], comm_time: float) -> dict[tuple, tuple[float, float]]:
    """List-schedule each device's queue in order; returns ``key -> (start, end)``."""
    device_of: dict[tuple, int] = {op.key: op.device for q in queues for op in q}
    done: dict[tuple, tuple[float, float]] = {}
    free = [0.0] * len(queues)
    pos = [0] * len(queues)
    remaining = sum(len(q) for q in queues)
    while remaining:
        progress = False
        for d, q in enumerate(queues):
            while pos[d] < len(q):
                op = q[pos[d]]
                ready = free[d]
                for dep in op.deps:
                    fin = done.get(dep)
                    if fin is None:
                        break
                    arrive = fin[1] + (comm_time if device_of[dep] != d else 0.0)
                    ready = max(ready, arrive)
                else:
                    end = ready + sum(t for _, t in op.parts)
                    done[op.key] = (ready, end)
                    free[d] = end
                    pos[d] += 1
                    remaining -= 1
                    progress = True
                    continue
                break
        if not progress:
            stuck = [q[pos[d]] for d, q in enumerate(queues) if pos[d] < len(q)]
            raise PlanError(
                "schedule deadlocks; waiting ops: "
                + ", ".join(f"dev {op.device} {op.stage} mb {op.microbatch}" for op in stuck)
            )
    return done


def _result(
    name: str,
    queues: list[list[_Op]],
    done: dict[tuple, tuple[float, float]],
    num_microbatches: int,
    iterations: int,
    **extra,
) -> SimulationResult:
    segments: list[Segment] = []
    for d, q in enumerate(queues):
        for op in q:
            t = done[op.key][0]
            for kind, dur in op.parts:
                if dur > 0:
                    segments.append(
                        Segment(d, t, t + dur, kind, op.stage, op.microbatch, op.iteration)
                    )
                t += dur
    return result_from_segments(name, segments, len(queues), num_microbatches, iterations, **extra)


# ----------------------------------------------------------------- RoundPipe
def _lowerings(
    costs: LayerCosts,
    plan: StagePlan,
    num_devices: int,
    num_microbatches: int,
    *,
    async_optimizer: bool,
    round_size: int | None = None,
    comm_time: float = 0.0,
    optimizer_time: float = 0.0,
    placement: Placement = "free-first",
    double_buffer: bool = True,
    copies: Copies | None = None,
    record: bool = True,
) -> tuple[Clock, Iterator[tuple[Schedule, float]]]:
    """A clock and an endless generator of training iterations lowered on it
    back to back, exactly as the runtime lowers them: each iteration's
    schedule and the predicted end of its optimizer step. ``record``: the
    clock keeps every segment (each schedule carries its own either way)."""
    clock = Clock(
        costs,
        num_devices,
        async_optimizer=async_optimizer,
        comm_time=comm_time,
        optimizer_time=optimizer_time,
        double_buffer=double_buffer,
        record=record,
        copies=copies,
    )

    def iterations() -> Iterator[tuple[Schedule, float]]:
        prev: Schedule | None = None
        it = 0
        while True:
            sched = lower(
                plan,
                num_devices,
                num_microbatches,
                round_size=round_size,
                clock=clock,
                iteration=it,
                placement=placement,
                # a fixed rotation carries on after the previous iteration's last slot
                start_device=(prev.tasks[-1].device + 1) % num_devices
                if prev is not None and placement == "rotate"
                else 0,
            )
            yield sched, clock.step(it)
            prev, it = sched, it + 1

    return clock, iterations()


def simulate_schedules(
    costs: LayerCosts,
    plan: StagePlan,
    num_devices: int,
    num_microbatches: int,
    iterations: int,
    *,
    async_optimizer: bool,
    round_size: int | None = None,
    comm_time: float = 0.0,
    optimizer_time: float = 0.0,
    placement: Placement = "free-first",
    double_buffer: bool = True,
    copies: Copies | None = None,
) -> tuple[list[Schedule], Clock]:
    """Lower ``iterations`` training iterations back to back (one optimizer
    step each) on one clock, exactly as the runtime lowers them; the clock
    holds every predicted segment. ``double_buffer``: the trainable weights
    have two master copies (the runtime's default with the asynchronous
    optimizer; see :class:`Clock`); ``copies``: the host-device copies
    devices wait for (:class:`~.schedule.Copies`)."""
    clock, lowered = _lowerings(
        costs,
        plan,
        num_devices,
        num_microbatches,
        async_optimizer=async_optimizer,
        round_size=round_size,
        comm_time=comm_time,
        optimizer_time=optimizer_time,
        placement=placement,
        double_buffer=double_buffer,
        copies=copies,
    )
    return [sched for sched, _ in itertools.islice(lowered, iterations)], clock


def result_from_segments(
    name: str,
    segments: Sequence[Segment],
    n: int,
    num_microbatches: int,
    iterations: int,
    **extra,
) -> SimulationResult:
    """A :class:`SimulationResult` of busy ``segments`` on ``n`` devices (also
    for measured ones: the runtime's trace, for :func:`plot_timeline`)."""
    busy = [0.0] * n
    first: list[float | None] = [None] * n
    last = [0.0] * n
    for s in segments:
        busy[s.device] += s.duration
        if s.end > s.start:
            f = first[s.device]
            first[s.device] = s.start if f is None else min(f, s.start)
            last[s.device] = max(last[s.device], s.end)
    makespan = max(last, default=0.0)
    if makespan <= 0:
        ratios = (0.0, 0.0, 0.0, 0.0)
    else:
        total = makespan * n
        fill = sum(makespan if f is None else f for f in first)
        drain = sum(0.0 if f is None else makespan - e for f, e in zip(first, last))
        idle = max(0.0, total - sum(busy))  # (never below zero by rounding)
        steady = max(0.0, idle - fill - drain)
        ratios = (idle / total, fill / total, drain / total, steady / total)
    return SimulationResult(
        schedule=name,
        num_devices=n,
        num_microbatches=num_microbatches,
        iterations=iterations,
        makespan=makespan,
        busy=tuple(busy),
        bubble_ratio=ratios[0],
        fill_ratio=ratios[1],
        drain_ratio=ratios[2],
        steady_ratio=ratios[3],
        timeline=tuple(sorted(segments, key=lambda s: (s.start, s.device))),
        **extra,
    )


def _simulate_roundpipe(
    costs: LayerCosts,
    n: int,
    m: int,
    comm_time: float,
    plan: StagePlan | None,
    mr: int | None,
    async_optimizer: bool,
    iterations: int,
    memory_limit: float | None,
    optimizer_time: float,
    placement: Placement,
    copies: Copies | None,
) -> SimulationResult:
    if plan is None:  # the plan the runtime would run
        from .policy import choose_plan  # the policy simulates: imported here, not at the top

        plan = choose_plan(
            costs,
            n,
            m,
            async_optimizer=async_optimizer,
            memory_limit=memory_limit,
            round_size=mr,
            comm_time=comm_time,
            placement=placement,
        )
    plan.validate(costs.num_layers)
    check_within_limit(plan, costs, memory_limit)
    kw = dict(
        round_size=mr,
        comm_time=comm_time,
        optimizer_time=optimizer_time,
        placement=placement,
        copies=copies,
    )
    _, clock = simulate_schedules(
        costs, plan, n, m, iterations, async_optimizer=async_optimizer, **kw
    )
    extra: dict = {"plan": plan, "copy_wait": clock.copy_wait}
    if async_optimizer:
        extra["async_bubble_ratio"] = steady_async_bubble(costs, plan, n, m, **kw)
    return result_from_segments("roundpipe", clock.segments, n, m, iterations, **extra)


#: iterations :func:`steady_async_bubble` always simulates before it may stop
#: on a settled estimate: the full default count up to 8 devices
_SETTLE_AFTER = 18
#: how many consecutive settled estimates it compares
_SETTLE_SPAN = 9
#: at most this many iterations per repeating block (:func:`_repeat`)
_MAX_CYCLE = 8


def check_within_limit(
    plan: StagePlan,
    costs: LayerCosts,
    memory_limit: float | None,
    *,
    plan_option: str = "plan",
    limit_option: str = "memory_limit",
    chosen: str = "plan=None",
) -> None:
    """Refuse ``plan`` when a stage's device memory for one micro-batch
    exceeds ``memory_limit`` (nothing to check without the limit or the
    layers' memory), naming the first such stage; the options are named as
    the caller takes them (``chosen``: how to get the plan chosen instead)."""
    if memory_limit is None or costs.memory is None:
        return
    for st, need in zip(plan.stages, plan.stage_memory(costs)):
        if need > memory_limit:
            raise PlanError(
                f"{plan_option} {plan} does not fit {limit_option} {memory_limit:g}: stage "
                f"{st.label} (layers {st.start}-{st.stop - 1}) needs {need:g} of device memory "
                f"for one micro-batch; give a {plan_option} whose stages fit, {chosen} (the "
                f"plan chosen within the limit), or raise {limit_option}"
            )


def steady_async_bubble(
    costs: LayerCosts,
    plan: StagePlan,
    n: int,
    m: int,
    *,
    iterations: int | None = None,
    tolerance: float = 5e-4,
    **kw,
) -> float:
    """Idle fraction of the devices once iterations run back to back with the
    asynchronous optimizer.

    Measures ``iterations`` (default ``max(8, 2N + 2)``) iterations: how busy
    the devices are between the end of the second iteration (the first ones
    start on idle devices) and the start of the last one (after it no more
    work follows): ``1 - busy / (N * window)``.

    Iterations are lowered one at a time; of each only its busy intervals
    are kept (no segments on the clock). It stops early in two ways:

    * exactly: once a block of ``q`` iterations (``q <= 8``) repeats, shifted
      by one period, with the devices rotated alike and the optimizer step
      shifted too, the clock's state repeats, so every later block is the
      last one shifted again: those are placed, not simulated, and the
      answer is the full simulation's;
    * with the default count (``iterations`` not given) past 18 iterations
      (more than 8 devices): once the idle fraction over the second half of
      the iterations so far (the first half is the warm-up) has stayed
      within ``tolerance`` for 9 iterations in a row; that estimate is
      returned. With many devices the per-iteration period keeps changing
      (the round's first device walks around the devices, and a round that
      wraps past the last device runs longer), so "two equal periods in a
      row" is not a steady state; the half-window estimate settles within
      a few dozen iterations where the full count is ``2N + 2``.
      ``tolerance=0`` simulates the full count.

    ``kw``: as for :func:`simulate_schedules`."""
    k = iterations if iterations is not None else max(8, 2 * n + 2)
    if k < 4:
        raise PlanError(f"iterations must be >= 4 to reach a steady state, got {k}")
    if not (tolerance >= 0 and math.isfinite(tolerance)):
        raise PlanError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    settle = iterations is None and tolerance > 0
    _, lowered = _lowerings(costs, plan, n, m, async_optimizer=True, record=False, **kw)
    its: list[_Busy] = []
    estimates: list[float] = []
    for sched, step_end in itertools.islice(lowered, k):
        its.append(_Busy.of(sched, step_end))
        if len(its) == k:
            break
        rep = _repeat(its, n)
        if rep is not None:
            return _window_bubble(its, n, 1, k, rep)
        if settle and len(its) > _SETTLE_AFTER - _SETTLE_SPAN:
            est = _window_bubble(its, n, len(its) // 2, len(its))
            if est is None:
                continue
            estimates.append(est)
            last = estimates[-_SETTLE_SPAN:]
            if (
                len(its) >= _SETTLE_AFTER
                and len(last) == _SETTLE_SPAN
                and max(last) - min(last) <= tolerance
            ):
                return est
    result = _window_bubble(its, n, 1, k)
    assert result is not None
    return result


@dataclass(frozen=True)
class _Busy:
    """One simulated iteration, as :func:`steady_async_bubble` keeps it."""

    start: float  # its first segment's start
    end: float  # its last segment's end
    work: float  # busy device time
    intervals: array  # start, end, start, end, ... of its segments, in task order
    devices: tuple[int, ...]  # each task's device
    step_end: float  # the end of its optimizer step

    @classmethod
    def of(cls, sched: Schedule, step_end: float) -> _Busy:
        iv = array("d")
        for seg in sched.predicted:
            iv.append(seg.start)
            iv.append(seg.end)
        starts, ends = iv[0::2], iv[1::2]
        return cls(
            min(starts),
            max(ends),
            math.fsum(b - a for a, b in zip(starts, ends)),
            iv,
            tuple(t.device for t in sched.tasks),
            step_end,
        )


def _repeat(its: Sequence[_Busy], n: int) -> tuple[int, float] | None:
    """``(q, period)`` when the last ``q + 1`` iterations each repeat the one
    ``q`` earlier shifted by ``period`` (intervals, optimizer step), on
    devices rotated by one offset, and none of them is the first iteration;
    else None. Then the clock's state repeats too, and so does every later
    block of ``q`` iterations."""
    j = len(its) - 1
    for q in range(1, _MAX_CYCLE + 1):
        if j - 2 * q < 1:
            break
        a, b = its[j - q], its[j]
        period = b.start - a.start
        tol = 1e-9 * max(1.0, abs(b.end))
        offset = (b.devices[0] - a.devices[0]) % n
        pairs = [(its[i - q], its[i]) for i in range(j - q, j + 1)]
        # cheap checks first, then interval by interval
        if any(
            abs(y.start - x.start - period) > tol
            or abs(y.end - x.end - period) > tol
            or abs(y.step_end - x.step_end - period) > tol
            or abs(y.work - x.work) > tol
            or len(y.intervals) != len(x.intervals)
            for x, y in pairs
        ):
            continue
        if all(
            all((dy - dx) % n == offset for dx, dy in zip(x.devices, y.devices))
            and all(abs(v - u - period) <= tol for u, v in zip(x.intervals, y.intervals))
            for x, y in pairs
        ):
            return q, period
    return None


def _window_bubble(
    its: Sequence[_Busy], n: int, first: int, k: int, rep: tuple[int, float] | None = None
) -> float | None:
    """``1 - busy / (N * window)`` over the window from the end of iteration
    ``first`` to the start of iteration ``k - 1``. Iterations past the
    simulated ones repeat the last block of ``rep = (q, period)``. A window
    that is empty: with ``first == 1`` one iteration's period instead (from
    the start of iteration 1 to that of iteration 2); else None."""
    last = len(its) - 1

    def at(v: int) -> tuple[_Busy, float]:  # iteration v: a simulated one, and a shift
        if v <= last:
            return its[v], 0.0
        assert rep is not None, "iterations past the simulated ones need a repeating block"
        q, period = rep
        r = v - last - 1
        return its[last - q + 1 + r % q], (r // q + 1) * period

    def bounds(v: int) -> tuple[float, float]:
        it, shift = at(v)
        return it.start + shift, it.end + shift

    t1, t2 = bounds(first)[1], bounds(k - 1)[0]
    if t2 <= t1:
        if first != 1:
            return None
        # iterations barely overlap: one iteration's period instead
        t1, t2 = bounds(1)[0], bounds(2)[0]
        if t2 <= t1:
            return 0.0
    busy = 0.0
    for v in range(k):
        it, shift = at(v)
        lo, hi = it.start + shift, it.end + shift
        if hi <= t1 or lo >= t2:
            continue
        if lo >= t1 and hi <= t2:
            busy += it.work
            continue
        iv = it.intervals
        busy += sum(
            max(0.0, min(iv[i + 1] + shift, t2) - max(iv[i] + shift, t1))
            for i in range(0, len(iv), 2)
        )
    return max(0.0, 1.0 - busy / (n * (t2 - t1)))


# ----------------------------------------------------------------- baselines
def _baseline_order(name: str, n: int, m: int, v: int, d: int) -> list[tuple[str, int, int]]:
    """``(F|B, stage, micro-batch)`` in the order device ``d`` runs them."""
    local = [c * n + d for c in range(v)]
    if name == "gpipe":
        s = local[0]
        return [("F", s, mb) for mb in range(m)] + [("B", s, mb) for mb in range(m)]
    if name == "1f1b":
        s = local[0]
        warm = min(n - d - 1, m)
        order = [("F", s, mb) for mb in range(warm)]
        for i in range(m - warm):
            order.append(("F", s, warm + i))
            order.append(("B", s, i))
        order += [("B", s, mb) for mb in range(m - warm, m)]
        return order
    if name == "looped-bfs":
        order = [("F", s, mb) for s in local for mb in range(m)]
        order += [("B", s, mb) for s in reversed(local) for mb in range(m)]
        return order
    # interleaved-1f1b (Megatron-LM): forward k runs chunk (k // N) % v on
    # micro-batch (k // (N v)) N + k % N; backwards walk the chunks in reverse.
    total = v * m

    def fwd(k: int) -> tuple[str, int, int]:
        return ("F", local[(k // n) % v], (k // (n * v)) * n + k % n)

    def bwd(k: int) -> tuple[str, int, int]:
        return ("B", local[v - 1 - (k // n) % v], (k // (n * v)) * n + k % n)

    warm = min((n - d - 1) * 2 + (v - 1) * n, total)
    order = [fwd(k) for k in range(warm)]
    for i in range(total - warm):
        order.append(fwd(warm + i))
        order.append(bwd(i))
    order += [bwd(k) for k in range(total - warm, total)]
    return order


def _simulate_baseline(
    name: str,
    costs: LayerCosts,
    n: int,
    m: int,
    comm_time: float,
    stages: Sequence[int] | None,
    stages_per_device: int | None,
    recompute: bool,
) -> SimulationResult:
    bound = name in ("gpipe", "1f1b")
    if stages is None:
        v = 1 if bound else (2 if stages_per_device is None else stages_per_device)
        if v < 1:
            raise PlanError(f"stages_per_device must be >= 1, got {v}")
        weights = [(2 * f if recompute else f) + b for f, b in zip(costs.forward, costs.backward)]
        if recompute:  # (the head is not recomputed: see below)
            weights[-1] -= costs.forward[-1]
        stages = balanced_partition(weights, v * n)
    stages = tuple(stages)
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in stages):
        raise PlanError(f"stages must be layer counts >= 0, got {list(stages)}")
    if sum(stages) != costs.num_layers:
        raise PlanError(
            f"stages {list(stages)} hold {sum(stages)} layers but the model has "
            f"{costs.num_layers}; the counts must add up to the number of layers"
        )
    if bound and len(stages) != n:
        raise PlanError(
            f"{name} binds one stage to each device: got {len(stages)} stages for {n} devices"
        )
    if len(stages) % n:
        raise PlanError(f"{name} needs a multiple of num_devices ({n}) stages, got {len(stages)}")
    v = len(stages) // n
    if stages_per_device is not None and not bound and stages_per_device != v:
        raise PlanError(
            f"stages_per_device ({stages_per_device}) does not match {len(stages)} stages "
            f"on {n} devices"
        )
    if name == "interleaved-1f1b" and m % n:
        raise PlanError(
            f"interleaved-1f1b needs num_microbatches ({m}) to be a multiple of num_devices ({n})"
        )
    bounds = [0]
    for c in stages:
        bounds.append(bounds[-1] + c)
    last = len(stages) - 1
    head = costs.num_layers - 1
    queues: list[list[_Op]] = []
    for d in range(n):
        q = []
        for kind, s, mb in _baseline_order(name, n, m, v, d):
            a, b = bounds[s], bounds[s + 1]
            fwd, bwd = costs.forward_time(a, b), costs.backward_time(a, b)
            # the recompute skips the model's last layer (LM head and loss): its
            # activations are kept from the forward, as in RoundPipe's fused
            # stage and the paper's simulator (like for like with RoundPipe)
            redo = costs.forward_time(a, max(a, min(b, head)))
            # each operation's own host work, as in RoundPipe's (an empty stage: none)
            o = costs.task_overhead if b > a else 0.0
            if kind == "F":
                op = _Op(("F", s, mb), d, [("F", fwd + o)], f"S{s}", mb)
                if s > 0:
                    op.deps.append(("F", s - 1, mb))
            else:
                parts: list[tuple[SegmentKind, float]] = (
                    [("R", redo + o), ("B", bwd)] if recompute else [("B", bwd + o)]
                )
                op = _Op(("B", s, mb), d, parts, f"S{s}", mb)
                op.deps.append(("B", s + 1, mb) if s < last else ("F", s, mb))
            q.append(op)
        queues.append(q)
    done = _run(queues, comm_time)
    return _result(name, queues, done, m, 1, stages=stages)


# -------------------------------------------------------------------- public
def simulate(
    schedule: ScheduleName,
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    comm_time: float = 0.0,
    plan: StagePlan | str | None = None,
    async_optimizer: bool = False,
    stages: Sequence[int] | None = None,
    *,
    microbatches_per_round: int | None = None,
    stages_per_device: int | None = None,
    recompute: bool = True,
    memory_limit: float | None = None,
    iterations: int = 1,
    optimizer_time: float = 0.0,
    placement: Placement = "free-first",
    copies: Copies | None = None,
) -> SimulationResult:
    """Simulate one schedule on ``num_devices`` devices.

    Args:
        schedule: one of ``"roundpipe"``, ``"gpipe"``, ``"1f1b"``,
            ``"interleaved-1f1b"``, ``"looped-bfs"``.
        costs: per-layer costs.
        num_devices: ``N``.
        num_microbatches: ``M`` per iteration.
        comm_time: time for an activation (or its gradient) to move between two
            devices; charged when consecutive stages of a micro-batch run on
            different devices, overlapped with compute.
        plan: RoundPipe only: a stage plan (or its compact text); default the
            plan the runtime would run (:func:`~lightning_roundpipe.plan.choose_plan`).
        async_optimizer: RoundPipe only: iterations overlap (staleness-1
            optimizer) and ``async_bubble_ratio`` is reported.
        stages: baselines only: layers per stage (zero allowed), stage ``s``
            bound to device ``s mod N``; default a min-max balanced cut.
        microbatches_per_round: RoundPipe only: ``M_R`` (default ``M``, one
            round per iteration; the runtime, and ``plan simulate`` without
            ``--round-size``, choose it with
            :func:`~lightning_roundpipe.plan.choose_round`).
        stages_per_device: looped baselines: stages per device when ``stages``
            is not given (default 2).
        recompute: baselines only: backward ops recompute their stage first
            (activation checkpointing), as RoundPipe's backward stages do;
            the model's last layer (the head) is not recomputed, as in
            RoundPipe's fused stage.
        memory_limit: RoundPipe only: passed to the partitioner; a given
            ``plan`` must fit it (:func:`check_within_limit`).
        iterations: RoundPipe only: iterations to simulate back to back.
        optimizer_time: RoundPipe only: time of one host optimizer step.
        placement: RoundPipe only: ``"free-first"`` (rounds start on the
            device free first, as the runtime places them) or ``"rotate"``.
        copies: RoundPipe only: the host-device copies devices wait for
            (:class:`~.schedule.Copies`: with nothing prefetched, and a
            rewalked stage's uploads again); default none.
    """
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    for name, val in (
        ("num_devices", num_devices),
        ("num_microbatches", num_microbatches),
        ("iterations", iterations),
    ):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise PlanError(f"{name} must be an integer >= 1, got {val!r}")
    if not (comm_time >= 0 and math.isfinite(comm_time)):
        raise PlanError(f"comm_time must be finite and >= 0, got {comm_time!r}")
    if isinstance(plan, str):
        plan = StagePlan.parse(plan, costs.num_layers)
    if schedule == "roundpipe":
        if stages is not None:
            raise PlanError("stages= is for the stage-bound baselines; RoundPipe takes plan=")
        return _simulate_roundpipe(
            costs,
            num_devices,
            num_microbatches,
            comm_time,
            plan,
            microbatches_per_round,
            async_optimizer,
            iterations,
            memory_limit,
            optimizer_time,
            placement,
            copies,
        )
    if plan is not None:
        raise PlanError(f"plan= is for RoundPipe; {schedule} takes stages=")
    if iterations != 1:
        raise PlanError(f"{schedule} is simulated for one iteration; iterations must be 1")
    return _simulate_baseline(
        schedule,
        costs,
        num_devices,
        num_microbatches,
        comm_time,
        stages,
        stages_per_device,
        recompute,
    )


def choose_microbatches(
    costs: LayerCosts,
    num_devices: int,
    *,
    async_optimizer: bool,
    plan: StagePlan | str | None = None,
    target_bubble: float = 0.05,
    max_factor: int = 8,
    memory_limit: float | None = None,
) -> int:
    """The fewest micro-batches per batch whose simulated bubble is small.

    Fewer micro-batches mean larger ones: fuller matmuls on the device, fewer
    tasks to dispatch, and, since a stage's weights are uploaded once per
    round, the same compute per round to hide them behind. More micro-batches
    shrink the fill-and-drain bubble (``N(N-1)/(MS + N(N-1))`` without the
    asynchronous optimizer). The answer is the smallest ``M`` in
    ``N, 2N, 4N, ...`` (at most ``max_factor * N``) whose bubble (the
    steady-state one with ``async_optimizer``) is at most ``target_bubble``,
    else the candidate with the smallest bubble, a larger one taken only for
    a tenth less (a bubble that more micro-batches hardly shrink, as a
    heavy head's, is not worth micro-batches half the size). ``plan``:
    a fixed stage plan; default the partitioner's plan for each candidate.
    """
    if num_devices < 1:
        raise PlanError(f"num_devices must be >= 1, got {num_devices}")
    if not 0 <= target_bubble < 1:
        raise PlanError(f"target_bubble must be in [0, 1), got {target_bubble!r}")
    best: tuple[float, int] | None = None
    factor = 1
    while factor <= max(1, max_factor):
        m = factor * num_devices
        res = simulate(
            "roundpipe",
            costs,
            num_devices,
            m,
            plan=plan,
            async_optimizer=async_optimizer,
            memory_limit=memory_limit,
        )
        ratio = res.async_bubble_ratio if async_optimizer else res.bubble_ratio
        assert ratio is not None
        if ratio <= target_bubble:
            return m
        if best is None or ratio < 0.9 * best[0]:
            best = (ratio, m)
        factor *= 2
    assert best is not None
    return best[1]

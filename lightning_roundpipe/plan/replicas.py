"""Data parallelism across servers: the cost of all-reducing gradients.

With several servers, each runs one RoundPipe replica on its own share of the
batch, and the replicas are joined by ``torch.distributed``. After each
optimizer window every replica holds the fp32 gradients of the trainable
parameters in host memory; they are summed across servers before the
optimizer steps. This module models that reduction, before anything runs:

* **what goes on the link**: the gradients are reduced in *buckets* of whole
  layers, walked from the last pipeline layer to the first (the order in
  which the backward completes them); :func:`gradient_buckets` is the rule,
  and the runtime forms its buckets with the same function;
* **how long a bucket takes**: a ring all-reduce over one link per server
  (gloo), in which each server sends and receives ``2 (N - 1) / N`` of the
  bucket's bytes (:func:`allreduce_seconds`);
* **when a bucket can go**: once the window's last backward has produced the
  gradients of all its layers (:func:`gradient_ready_times`, read from the
  simulator's timeline of one training iteration); buckets go one after
  another on the link;
* **what it costs the step**: synchronous optimizer: the step waits for the
  whole reduction, so whatever outlasts the backward is added to the step
  time. Asynchronous optimizer (the step runs one window behind on a host
  thread): the step of window ``w`` waits for window ``w``'s reduction, while
  window ``w + 1`` needs update ``w - 1`` only, so the reduction is hidden as
  long as the part after the backward plus the optimizer step fits in the
  next window's compute. Both are what the reduction *adds* to a step of one
  server: the optimizer step itself (all of it in synchronous mode, what of
  it exceeds a window in asynchronous mode) costs one server as much.

:func:`estimate_reduction` puts the three together. Everything here is pure
arithmetic on numbers the caller gives (bytes, seconds): no torch, no CUDA,
no threads. Not modelled: the host-side summation of gloo (memory-bound,
assumed to keep up with the link), the time to copy a stage's gradients down
to the host after its backward, and contention with other traffic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .costs import PlanError
from .schedule import Schedule, Segment
from .simulate import SimulationResult
from .stages import Stage, StagePlan

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "GradientTimes",
    "ReductionEstimate",
    "allreduce_seconds",
    "estimate_reduction",
    "gradient_buckets",
    "gradient_ready_times",
    "overlap_reduction",
]

#: the bucket cap: 25 MiB, as ``DistributedDataParallel(bucket_cap_mb=25)``
DEFAULT_BUCKET_BYTES = 25 * 2**20


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PlanError(f"{name} must be a number > 0, got {value!r}")
    if not math.isfinite(value):
        raise PlanError(f"{name} must be finite, got {value!r}")
    return float(value)


def _non_negative(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise PlanError(f"{name} must be a number >= 0, got {value!r}")
    if not math.isfinite(value):
        raise PlanError(f"{name} must be finite, got {value!r}")
    return float(value)


def _sizes(name: str, values: Sequence[float]) -> tuple[float, ...]:
    if isinstance(values, (str, bytes)):
        raise PlanError(f"{name} must be a sequence of numbers, got a string")
    return tuple(_non_negative(f"{name}[{i}]", v) for i, v in enumerate(values))


def _size(nbytes: float) -> str:
    """``nbytes`` in readable binary units."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


# ------------------------------------------------------------------ the link
def allreduce_seconds(
    nbytes: float, servers: int, link_gbps: float, *, latency: float = 0.0
) -> float:
    """Seconds a ring all-reduce of ``nbytes`` takes across ``servers`` servers.

    Each server sends (and receives) ``2 (N - 1) / N * nbytes`` over its link
    of ``link_gbps`` gigabits per second: ``N - 1`` reduce-scatter steps and
    ``N - 1`` all-gather steps, each moving ``nbytes / N``. ``latency`` is
    added per step (``2 (N - 1)`` of them); it defaults to 0 because a bucket
    of megabytes takes milliseconds on the wire, against tens of microseconds
    of per-message latency, so the model is bandwidth-bound. One server
    reduces nothing: 0.
    """
    n = _count("servers", servers)
    size = _non_negative("nbytes", nbytes)
    gbps = _positive("link_gbps", link_gbps)
    lat = _non_negative("latency", latency)
    if n == 1 or size == 0:
        return 0.0
    steps = 2 * (n - 1)
    return steps / n * size / (gbps * 1e9 / 8) + steps * lat


def gradient_buckets(
    layer_bytes: Sequence[float], cap: float = DEFAULT_BUCKET_BYTES
) -> list[tuple[int, int]]:
    """The reduction's buckets: layer ranges ``[start, stop)`` in the order
    they go on the link (from the last layer down to the first).

    Layers are walked from last to first; each layer's gradient bytes join the
    current bucket, which is closed once it holds ``cap`` bytes or more (a
    bucket therefore exceeds ``cap`` by less than its lowest layer, and a layer
    is never split). A layer without trainable bytes adds nothing: it neither
    opens nor extends a bucket, so a bucket's range starts and stops at layers
    with gradients (zero-byte layers inside it are carried along harmlessly)
    and zero-byte layers outside every bucket are in none.

    Args:
        layer_bytes: gradient bytes of each layer (trainable parameters only,
            a parameter shared by several layers counted in one of them).
        cap: bytes at which a bucket is closed (> 0).
    """
    sizes = _sizes("layer_bytes", layer_bytes)
    limit = _positive("cap", cap)
    out: list[tuple[int, int]] = []
    stop: int | None = None  # the open bucket's top layer + 1
    held = 0.0
    start = 0
    for layer in range(len(sizes) - 1, -1, -1):
        if sizes[layer] == 0:
            continue
        if stop is None:
            stop = layer + 1
        held += sizes[layer]
        start = layer
        if held >= limit:
            out.append((start, stop))
            stop, held = None, 0.0
    if stop is not None:
        out.append((start, stop))
    return out


# ------------------------------------------------------- when gradients exist
@dataclass(frozen=True)
class GradientTimes:
    """When each layer's gradient of one training iteration is complete.

    Attributes:
        ready: per layer, the end of the last backward segment that covers it
            (the fused stage's backward counts), relative to the window's start
            (the iteration's first segment).
        backward_end: the end of the iteration's last backward segment.
        makespan: the end of the iteration's last segment of any kind.
    """

    ready: tuple[float, ...]
    backward_end: float
    makespan: float


def _layer_ranges(
    source: SimulationResult | Schedule | Sequence[Segment],
    stages: StagePlan | Sequence[Stage] | Sequence[int] | None,
) -> dict[str, tuple[int, int]]:
    """Stage label -> layer range, from ``stages`` or from ``source``."""
    if stages is None:
        if isinstance(source, Schedule):
            stages = source.stages
        elif isinstance(source, SimulationResult):
            stages = source.plan if source.plan is not None else source.stages
    if stages is None:
        raise PlanError(
            "which layers each stage covers is unknown: pass stages= (the StagePlan, "
            "the stage slots, or a baseline's layers per stage)"
        )
    if isinstance(stages, StagePlan):
        stages = stages.stages
    ranges: dict[str, tuple[int, int]] = {}
    pos = 0
    for i, st in enumerate(stages):
        if isinstance(st, Stage):
            ranges[st.label] = (st.start, st.stop)
        else:  # a baseline's layers per stage: stage ``s`` is labelled ``S<s>``
            ranges[f"S{i}"] = (pos, pos + int(st))
            pos += int(st)
    return ranges


def gradient_ready_times(
    source: SimulationResult | Schedule | Sequence[Segment],
    stages: StagePlan | Sequence[Stage] | Sequence[int] | None = None,
    *,
    iteration: int | None = None,
) -> GradientTimes:
    """When each layer's gradient is complete within one training iteration.

    Args:
        source: the timeline: a :class:`~.simulate.SimulationResult` (its
            ``timeline``), a lowered :class:`~.schedule.Schedule` (its
            ``predicted`` segments) or the segments themselves.
        stages: which layers each segment's stage covers; default the plan of
            the result (RoundPipe), its baseline stages, or the schedule's
            slots. Pass the :class:`~.stages.StagePlan` (or its slots) with bare
            segments.
        iteration: the iteration to read when the timeline holds several
            (default the first one in it).

    A layer that no backward segment covers (its stage took no time) counts as
    ready at the window's start.
    """
    if isinstance(source, SimulationResult):
        segments: Sequence[Segment] = source.timeline
    elif isinstance(source, Schedule):
        segments = source.predicted
    else:
        segments = tuple(source)
    ranges = _layer_ranges(source, stages)
    if not segments:
        raise PlanError(
            "the timeline is empty; give the segments of one training iteration "
            "(a Schedule must be lowered with a clock and predict=True)"
        )
    which = min(s.iteration for s in segments) if iteration is None else iteration
    mine = [s for s in segments if s.iteration == which]
    if not mine:
        raise PlanError(f"the timeline has no segment of iteration {which}")
    backwards = [s for s in mine if s.kind == "B"]
    if not backwards:
        raise PlanError(
            f"iteration {which} has no backward segment; give the timeline of a training "
            "iteration, not a forward-only pass"
        )
    origin = min(s.start for s in mine)
    num_layers = max(stop for _, stop in ranges.values())
    ready = [0.0] * num_layers
    for s in backwards:
        got = ranges.get(s.stage)
        if got is None:
            raise PlanError(
                f"segment of stage {s.stage!r} matches no stage of the plan "
                f"({', '.join(ranges)}); pass the plan the timeline was made with"
            )
        end = s.end - origin
        for layer in range(*got):
            ready[layer] = max(ready[layer], end)
    return GradientTimes(
        ready=tuple(ready),
        backward_end=max(s.end for s in backwards) - origin,
        makespan=max(s.end for s in mine) - origin,
    )


# ------------------------------------------------------------ the reduction
@dataclass(frozen=True)
class Bucket:
    """One all-reduce: layers ``[start, stop)``, ``nbytes`` of gradients per
    replica, ready at ``ready`` (its layers' gradients are complete), on the
    link from ``begin`` to ``end`` (seconds from the window's start)."""

    start: int
    stop: int
    nbytes: float
    ready: float
    begin: float
    end: float


@dataclass(frozen=True)
class ReductionEstimate:
    """The gradient all-reduce of one optimizer window (see the module docs).

    Attributes:
        servers: ``N`` replicas.
        link_gbps: each server's link, gigabits per second.
        gradient_bytes: fp32 gradient bytes of one replica (trainable only).
        bytes_sent: bytes each server sends (and receives) per step,
            ``2 (N - 1) / N * gradient_bytes``.
        buckets: the all-reduces, in the order they go on the link.
        link_seconds: time the link is busy per step (all buckets).
        finish: when the last bucket is reduced (from the window's start; 0
            without gradients).
        backward_end: when the window's last backward ends.
        window_seconds: compute time of a window (what the asynchronous
            optimizer can hide the reduction behind).
        optimizer_seconds: one optimizer step on the host.
        exposed_sync: seconds the reduction adds to each step with the
            synchronous optimizer: ``max(0, finish - backward_end)`` (the
            optimizer step follows on one server too).
        exposed_async: seconds the reduction adds to each step with the
            asynchronous optimizer: ``max(0, finish - backward_end +
            optimizer_seconds - max(window_seconds, optimizer_seconds))``. An
            optimizer step longer than a window paces the iterations by itself
            (on one server too), so the window it hides behind is at least the
            step: the reduction then adds all of its tail.
        async_optimizer: which of the two :attr:`exposed` reports.
        bottleneck: the link alone needs longer than a window's compute, so no
            overlap can hide the reduction.
        advice: what to change when the reduction is the bottleneck or exposes
            more than 1% of a window ("" otherwise).
    """

    servers: int
    link_gbps: float
    gradient_bytes: float
    bytes_sent: float
    buckets: tuple[Bucket, ...]
    link_seconds: float
    finish: float
    backward_end: float
    window_seconds: float
    optimizer_seconds: float
    exposed_sync: float
    exposed_async: float
    async_optimizer: bool
    bottleneck: bool
    advice: str

    @property
    def exposed(self) -> float:
        """Seconds the reduction adds to a step in the selected optimizer mode."""
        return self.exposed_async if self.async_optimizer else self.exposed_sync

    def throughput(self, step_seconds: float) -> float:
        """Steps per second of the whole cluster relative to one replica's:
        ``N * step / (step + exposed)`` (multiply a replica's tokens/s by it)."""
        step = _positive("step_seconds", step_seconds)
        return self.servers * step / (step + self.exposed)


def _advice(
    servers: int,
    link_gbps: float,
    gradient_bytes: float,
    link_seconds: float,
    window: float,
    exposed: float,
    exposed_sync: float,
    exposed_async: float,
    async_optimizer: bool,
) -> tuple[bool, str]:
    cures = (
        "fewer servers, a faster network, more tokens per server and step (larger or more "
        "micro-batches), or fewer trainable parameters (LoRA: only the adapters' gradients "
        "are reduced)"
    )
    if servers == 1:  # nothing to reduce
        return False, ""
    if link_seconds > window:
        return True, (
            f"the network is the bottleneck: all-reducing {_size(gradient_bytes)} of gradients "
            f"across {servers} servers takes {link_seconds:.3g} s per step on a {link_gbps:g} "
            f"Gb/s link, longer than a window's compute ({window:.3g} s), so no overlap can "
            f"hide it; use {cures}"
        )
    if exposed > 0.01 * window:  # (less is noise next to the model's own error)
        text = f"{exposed:.3g} s per step of the gradient all-reduce is not hidden behind compute"
        if not async_optimizer and exposed_async < exposed_sync:
            text += "; the asynchronous optimizer (async_optimizer=True) would " + (
                f"leave {exposed_async:.3g} s" if exposed_async > 0 else "hide it"
            )
        return False, text + f"; to hide it: {cures}"
    return False, ""


def overlap_reduction(
    layer_bytes: Sequence[float],
    ready: Sequence[float],
    backward_end: float,
    servers: int,
    link_gbps: float,
    *,
    window_seconds: float | None = None,
    optimizer_seconds: float = 0.0,
    async_optimizer: bool = False,
    bucket_bytes: float = DEFAULT_BUCKET_BYTES,
    latency: float = 0.0,
) -> ReductionEstimate:
    """Time the reduction of one window's gradients against its backward.

    Buckets come from :func:`gradient_buckets`; a bucket goes on the link once
    it is ready (the latest ``ready`` time of its layers with gradients) and
    the previous bucket is done, and takes :func:`allreduce_seconds`.

    Args:
        layer_bytes: fp32 gradient bytes of each layer (trainable only).
        ready: per layer, when its gradient is complete (seconds from the
            window's start; :attr:`GradientTimes.ready`).
        backward_end: when the window's last backward ends.
        servers: ``N`` replicas (one per server).
        link_gbps: each server's link in gigabits per second.
        window_seconds: a window's compute time, what the asynchronous
            optimizer hides the reduction behind (default ``backward_end``).
        optimizer_seconds: one optimizer step on the host.
        async_optimizer: which mode :attr:`ReductionEstimate.exposed` and the
            advice are about.
        bucket_bytes: the bucket cap (default 25 MiB).
        latency: per-message latency (see :func:`allreduce_seconds`).
    """
    sizes = _sizes("layer_bytes", layer_bytes)
    times = _sizes("ready", ready)
    if len(times) != len(sizes):
        raise PlanError(
            f"ready has {len(times)} entries but layer_bytes has {len(sizes)}; "
            "give one of each per layer"
        )
    n = _count("servers", servers)
    gbps = _positive("link_gbps", link_gbps)
    end = _non_negative("backward_end", backward_end)
    window = end if window_seconds is None else _non_negative("window_seconds", window_seconds)
    opt = _non_negative("optimizer_seconds", optimizer_seconds)
    buckets: list[Bucket] = []
    free = 0.0
    for a, b in gradient_buckets(sizes, bucket_bytes):
        nbytes = sum(sizes[a:b])
        at = max(times[i] for i in range(a, b) if sizes[i] > 0)
        begin = max(at, free)
        free = begin + allreduce_seconds(nbytes, n, gbps, latency=latency)
        buckets.append(Bucket(a, b, nbytes, at, begin, free))
    total = sum(sizes)
    link = sum(bk.end - bk.begin for bk in buckets)
    finish = free  # (one server: when the last bucket's gradients are complete)
    tail = max(0.0, finish - end)
    exposed_sync = tail
    exposed_async = max(0.0, tail + opt - max(window, opt))
    exposed = exposed_async if async_optimizer else exposed_sync
    bottleneck, advice = _advice(
        n, gbps, total, link, window, exposed, exposed_sync, exposed_async, async_optimizer
    )
    return ReductionEstimate(
        servers=n,
        link_gbps=gbps,
        gradient_bytes=total,
        bytes_sent=2 * (n - 1) / n * total,
        buckets=tuple(buckets),
        link_seconds=link,
        finish=finish,
        backward_end=end,
        window_seconds=window,
        optimizer_seconds=opt,
        exposed_sync=exposed_sync,
        exposed_async=exposed_async,
        async_optimizer=async_optimizer,
        bottleneck=bottleneck,
        advice=advice,
    )


def estimate_reduction(
    source: SimulationResult | Schedule | Sequence[Segment],
    layer_grad_bytes: Sequence[float],
    servers: int,
    link_gbps: float,
    *,
    optimizer_seconds: float = 0.0,
    async_optimizer: bool = False,
    window_seconds: float | None = None,
    bucket_bytes: float = DEFAULT_BUCKET_BYTES,
    latency: float = 0.0,
    stages: StagePlan | Sequence[Stage] | Sequence[int] | None = None,
    iteration: int | None = None,
) -> ReductionEstimate:
    """The all-reduce of one window's gradients, timed against a simulated
    (or lowered) training iteration.

    Reads when each layer's gradient is complete from ``source``
    (:func:`gradient_ready_times`) and times the buckets against it
    (:func:`overlap_reduction`). ``window_seconds`` defaults to the iteration's
    makespan; with the asynchronous optimizer, where iterations overlap, pass
    the steady-state time per iteration instead. The timeline's time unit must
    be seconds, like the link's.

    Args:
        source: the timeline of one training iteration (see
            :func:`gradient_ready_times`).
        layer_grad_bytes: fp32 gradient bytes of each layer (trainable only).
        servers, link_gbps: ``N`` replicas and each one's link (Gb/s).
        optimizer_seconds, async_optimizer, window_seconds, bucket_bytes,
            latency: see :func:`overlap_reduction`.
        stages, iteration: see :func:`gradient_ready_times`.
    """
    times = gradient_ready_times(source, stages, iteration=iteration)
    if len(layer_grad_bytes) != len(times.ready):
        raise PlanError(
            f"layer_grad_bytes has {len(layer_grad_bytes)} entries but the plan covers "
            f"{len(times.ready)} layers; give one per layer"
        )
    return overlap_reduction(
        layer_grad_bytes,
        times.ready,
        times.backward_end,
        servers,
        link_gbps,
        window_seconds=times.makespan if window_seconds is None else window_seconds,
        optimizer_seconds=optimizer_seconds,
        async_optimizer=async_optimizer,
        bucket_bytes=bucket_bytes,
        latency=latency,
    )

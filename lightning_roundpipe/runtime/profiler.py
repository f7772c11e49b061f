"""Per-layer timing, measured while training, for the partitioner.

Workers time every layer's forward (in forward stages, the fused stage and
recomputes) and backward for one micro-batch: wall-clock on CPU devices, CUDA
events on GPUs (recorded on the compute stream, read once the task's work is
known complete). Backward times come from gradient hooks at layer boundaries:
the gradient reaching a layer's output marks the start of its backward, the
gradient reaching its input the end.

While profiling, the bytes each layer's forward saves for its backward (its
activations for one micro-batch, on the device that ran it) are counted too and
added to the size-based memory of weights and gradients, so a re-plan keeps
stages within the device memory limit including activations.

The first profiled iteration is discarded (allocator and kernel warm-up); the
remaining samples of each layer are reduced to their median, which shrugs off
the odd slow micro-batch. :meth:`Profiler.costs` turns them into
:class:`~lightning_roundpipe.plan.LayerCosts` for the partitioner.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..plan import LayerCosts
from ..plan.policy import ExposedUpload, RoundChoice

__all__ = [
    "LayerTimer",
    "Profiler",
    "Stopwatch",
    "TraceRecorder",
    "Traffic",
    "TrafficReport",
    "estimate_costs",
    "named",
    "saved_bytes",
    "write_trace",
]


try:  # torch's C++ range (what torch.compile uses): ~0.2 us against ~5 us
    from torch._C._profiler import _RecordFunctionFast as _Range
except ImportError:  # pragma: no cover - older torch
    _Range = torch.profiler.record_function


class _Named:
    """torch's fast range, tolerating a profiler that starts inside it: the
    fast path then refuses to close a range it never opened (an internal
    assert), which must not fail the task that happened to be running."""

    __slots__ = ("_range",)

    def __init__(self, name: str) -> None:
        self._range = _Range(name)

    def __enter__(self) -> _Named:
        self._range.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._range.__exit__(*exc)
        except RuntimeError as err:
            if "no guard is set" not in str(err):
                raise


def named(name: str) -> Any:
    """A profiler range called ``name`` (what ``torch.profiler.record_function``
    records). Workers' ranges are recorded by a profiler started with
    ``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)``;
    there is no cheap way to ask from a worker whether one runs, so the ranges
    are always opened, with torch's C++ fast path where there is one."""
    return _Named(name)


class LayerTimer:
    """Timing of one micro-batch through one stage: forward marks per layer,
    backward boundary marks (gradient arrival at each layer's input/output) or
    a layer's own backward marks, and the bytes each layer's forward saved for
    its backward."""

    def __init__(self, watch: Stopwatch) -> None:
        self.watch = watch
        self.forward: dict[int, tuple[int, int]] = {}
        self.boundary: dict[int, int] = {}
        # a layer's backward marked on its own (a layered stage recomputes the
        # layer below between two layers' backward): preferred to the boundaries
        self.backward: dict[int, tuple[int, int]] = {}
        self.saved: dict[int, int] = {}

    def hook(self, boundary: int):
        def mark(grad: torch.Tensor) -> None:
            self.boundary.setdefault(boundary, self.watch.mark())

        return mark

    def samples(
        self, start: int, stop: int, elapsed: Callable[[int, int], float] | None = None
    ) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        """Each layer's forward and backward time between its marks, by
        ``elapsed`` (default: the stopwatch's time)."""
        span = self.watch.elapsed if elapsed is None else elapsed
        fwd = [(layer, span(a, b)) for layer, (a, b) in self.forward.items()]
        bwd = []
        for layer in range(start, stop):
            if layer in self.backward:
                bwd.append((layer, span(*self.backward[layer])))
                continue
            top, bottom = self.boundary.get(layer + 1), self.boundary.get(layer)
            if top is not None and bottom is not None:
                bwd.append((layer, span(top, bottom)))
        return fwd, bwd

    def layers_cpu(self, start: int, stop: int) -> float:
        """CPU time of the calling thread inside the layers' marks (CPU
        devices): what is left of a task's is its own host work."""
        fwd, bwd = self.samples(start, stop, self.watch.cpu_elapsed)
        return sum(t for _, t in fwd) + sum(t for _, t in bwd)


def _footprint(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage address, data address, bytes) of a tensor, or None where it has
    no plain storage to ask about (wrapper subclasses, sparse or meta tensors):
    counting must never fail a step."""
    try:
        return t.untyped_storage().data_ptr(), t.data_ptr(), t.nbytes
    except Exception:
        return None


@contextmanager
def saved_bytes(module: torch.nn.Module, into: dict[int, int], key: int) -> Iterator[None]:
    """Count the bytes autograd keeps for backward from what the block saves
    while it runs (the activation memory a layer holds per micro-batch until
    its backward), each tensor once and the module's own parameters (and
    views of them) not at all; the total goes to ``into[key]``. A tensor
    counts only if it is still alive when the block returns: a node whose
    output nothing used is gone by then, and so is what it saved (a tiled
    norm whose readers recompute it, :mod:`~..models.layers`). Saved-tensor
    hooks are per thread, so workers do not mix. Tensors without plain
    storage are not counted."""
    skip = {f[0] for p in module.parameters() if (f := _footprint(p)) is not None}
    # (data address, bytes) -> the storage saved there: a tensor saved twice
    # counts once, and one that died has its address reused by the next
    packed: dict[tuple[int, int], StorageWeakRef] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        f = _footprint(t)
        # a view counts its own bytes (a micro-batch is a view of the batch on CPU)
        if f is not None and f[0] not in skip:
            known = packed.get(f[1:])
            if known is None or known.expired():
                packed[f[1:]] = StorageWeakRef(t.untyped_storage())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
    into[key] = sum(nbytes for (_, nbytes), ref in packed.items() if not ref.expired())


class Stopwatch:
    """Marks on one device; ``elapsed(a, b)`` in seconds once resolved. On a
    CPU device each mark also notes the marking thread's CPU time
    (``cpu_elapsed``)."""

    def __init__(self, cuda: bool, stream: Any = None) -> None:
        self.cuda = cuda
        self.stream = stream
        self.marks: list[Any] = []
        self.cpu: list[float] = []

    def mark(self) -> int:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())
            self.cpu.append(time.thread_time())
        return len(self.marks) - 1

    def cpu_elapsed(self, a: int, b: int) -> float:
        """The marking thread's CPU seconds between two marks (CPU devices)."""
        return self.cpu[b] - self.cpu[a]

    def elapsed(self, a: int, b: int) -> float:
        if self.cuda:
            self.marks[a].synchronize()
            self.marks[b].synchronize()
            return self.marks[a].elapsed_time(self.marks[b]) / 1e3
        return self.marks[b] - self.marks[a]


class Profiler:
    """Collects per-layer forward/backward samples from all workers.

    Args:
        num_layers: layers in the pipeline.
        iterations: iterations to profile after the discarded first one.
    """

    def __init__(self, num_layers: int, iterations: int) -> None:
        self.num_layers = num_layers
        self.iterations = iterations
        self._lock = threading.Lock()
        self._fwd: dict[int, list[float]] = defaultdict(list)
        self._bwd: dict[int, list[float]] = defaultdict(list)
        self._saved: dict[int, int] = {}
        self._seen: set[int] = set()
        self._overhead: list[float] = []

    def wants(self, iteration: int) -> bool:
        """Whether this (non-negative) iteration is being profiled; the first is
        warm-up and is timed but dropped."""
        return 0 <= iteration <= self.iterations

    def add(
        self,
        iteration: int,
        forward: list[tuple[int, float]],
        backward: list[tuple[int, float]],
        saved: dict[int, int] | None = None,
    ) -> None:
        """Samples ``(layer, seconds)`` of one task and the bytes each layer saved
        for backward (``saved``); iteration 0 is warm-up."""
        if iteration == 0:
            return
        with self._lock:
            self._seen.add(iteration)
            for layer, nbytes in (saved or {}).items():
                self._saved[layer] = max(self._saved.get(layer, 0), nbytes)
            for layer, t in forward:
                self._fwd[layer].append(t)
            for layer, t in backward:
                self._bwd[layer].append(t)

    def add_overhead(self, iteration: int, seconds: float) -> None:
        """One task's own host work per micro-batch (see
        :attr:`~lightning_roundpipe.plan.LayerCosts.task_overhead`); iteration
        0 is warm-up."""
        if iteration == 0:
            return
        with self._lock:
            self._overhead.append(max(0.0, seconds))

    @property
    def complete(self) -> bool:
        with self._lock:
            return len(self._seen) >= self.iterations and all(
                self._fwd.get(i) and self._bwd.get(i) for i in range(self.num_layers)
            )

    def activation_bytes(self) -> list[int]:
        """Largest number of bytes each layer saved for backward for one
        micro-batch (0 where nothing was measured)."""
        with self._lock:
            return [self._saved.get(i, 0) for i in range(self.num_layers)]

    def costs(
        self, memory: list[float] | None = None, weight_bytes: list[float] | None = None
    ) -> LayerCosts:
        """Median forward and backward time of each layer for one micro-batch
        and median task overhead (0 where none was measured: GPU workers, whose
        host work overlaps the device's); ``memory`` (weights and gradients)
        gets the measured activation bytes added."""
        with self._lock:
            missing = [
                i for i in range(self.num_layers) if not self._fwd.get(i) or not self._bwd.get(i)
            ]
            if missing:
                raise RuntimeError(f"no timing yet for layers {missing}")
            fwd = [statistics.median(self._fwd[i]) for i in range(self.num_layers)]
            bwd = [max(0.0, statistics.median(self._bwd[i])) for i in range(self.num_layers)]
            overhead = statistics.median(self._overhead) if self._overhead else 0.0
        if memory is not None:
            memory = [m + a for m, a in zip(memory, self.activation_bytes(), strict=True)]
        return LayerCosts(
            fwd, bwd, memory=memory, weight_bytes=weight_bytes, task_overhead=overhead
        )


TRAFFIC_KINDS = ("weights_up", "grads_down", "acts_up", "acts_down", "buffers")


class Traffic:
    """Bytes moved between host and devices, per iteration and kind.

    Workers count every copy as the bytes a device would move, also on CPU
    workers (where a "copy" may be the host tensor itself), so the numbers say
    what a GPU run of the same schedule moves. Kinds: ``weights_up``,
    ``grads_down`` (fp32 gradients, once per task), ``acts_up`` and
    ``acts_down`` (stage-boundary values, gradients of boundaries and losses)
    and ``buffers`` (module buffers, both ways)."""

    def __init__(self, keep: int = 64) -> None:
        self._lock = threading.Lock()
        self._by_iteration: dict[int, dict[str, int]] = {}
        self.total: dict[str, int] = dict.fromkeys(TRAFFIC_KINDS, 0)
        self.keep = keep

    def add(self, iteration: int, kind: str, nbytes: int) -> None:
        with self._lock:
            row = self._by_iteration.get(iteration)
            if row is None:
                row = self._by_iteration[iteration] = dict.fromkeys(TRAFFIC_KINDS, 0)
                while len(self._by_iteration) > self.keep:
                    del self._by_iteration[min(self._by_iteration)]
            row[kind] += nbytes
            self.total[kind] += nbytes

    def of(self, iteration: int) -> dict[str, int]:
        """Bytes of one (recent) iteration by kind (zeros when unknown)."""
        with self._lock:
            return dict(self._by_iteration.get(iteration, dict.fromkeys(TRAFFIC_KINDS, 0)))

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(self.total.values())


class TraceRecorder:
    """Real start and end times of every operation (a stage for one
    micro-batch: ``F``, ``R`` or ``B``), per device, for the timeline picture
    and a Chrome/Perfetto trace. CPU workers read the wall clock; CUDA workers
    record timing events on their compute stream, resolved when the trace is
    read (no synchronization while recording). Keeps the last ``keep``
    training iterations and the last ``keep`` evaluation calls."""

    def __init__(self, keep: int = 8) -> None:
        self._lock = threading.Lock()
        # iteration (negative: an evaluation call) -> its operations, oldest first
        self._ops: dict[int, list[tuple]] = {}
        self.schedules: dict[int, Any] = {}  # training iteration -> its lowered Schedule
        self.keep = keep
        self._t0 = time.perf_counter()
        self._bases: dict[Any, tuple[Any, float]] = {}  # cuda device -> (event, host time)

    def mark(self, device: torch.device, stream: Any = None) -> Any:
        if device.type != "cuda":
            return time.perf_counter()
        if device not in self._bases:
            with self._lock:
                if device not in self._bases:
                    base = torch.cuda.Event(enable_timing=True)
                    base.record(stream)
                    base.synchronize()  # note: a CPU-GPU sync point, once per device
                    self._bases[device] = (base, time.perf_counter())
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def add(
        self,
        device_index: int,
        device: torch.device,
        iteration: int,
        label: str,
        stage: str,
        microbatch: int,
        kind: str,
        start: Any,
        end: Any,
    ) -> None:
        op = (device_index, device, iteration, label, stage, microbatch, kind, start, end)
        with self._lock:
            ops = self._ops.get(iteration)
            if ops is not None:
                ops.append(op)
                return
            self._ops[iteration] = [op]
            # a new iteration: drop the oldest of its kind beyond `keep` (training
            # iterations count up, evaluation calls down; both arrive in order)
            kind_of = [it for it in self._ops if (it >= 0) == (iteration >= 0)]
            for it in sorted(kind_of, key=abs)[: -self.keep]:
                del self._ops[it]

    def add_schedule(self, schedule: Any) -> None:
        """Keep a training iteration's lowered schedule (with its prediction)."""
        with self._lock:
            self.schedules[schedule.iteration] = schedule
            for it in sorted(self.schedules)[: -self.keep]:
                del self.schedules[it]

    def _seconds(self, device: torch.device, mark: Any) -> float:
        if isinstance(mark, float):
            return mark - self._t0
        base, host = self._bases[device]
        mark.synchronize()
        return host - self._t0 + base.elapsed_time(mark) / 1e3

    def operations(self) -> list[dict[str, Any]]:
        """Every recorded operation: ``device`` (worker index), ``iteration``,
        ``task`` (``"0.F2@1:0-3"``), ``stage``, ``microbatch``, ``kind`` and
        ``start``/``end`` in seconds since the recorder started."""
        with self._lock:
            ops = [op for group in self._ops.values() for op in group]
        out = []
        for idx, dev, it, label, stage, mb, kind, a, b in ops:
            out.append(
                {
                    "device": idx,
                    "iteration": it,
                    "task": label,
                    "stage": stage,
                    "microbatch": mb,
                    "kind": kind,
                    "start": self._seconds(dev, a),
                    "end": self._seconds(dev, b),
                }
            )
        return sorted(out, key=lambda o: (o["start"], o["device"]))

    def chrome_trace(self) -> dict[str, Any]:
        """The operations as a Chrome/Perfetto trace (``chrome://tracing``,
        ui.perfetto.dev): one track per device, times in microseconds."""
        names = {"F": "forward", "R": "recompute", "B": "backward"}
        events = []
        for op in self.operations():
            what = names.get(op["kind"], op["kind"])
            events.append(
                {
                    "name": f"{op['stage']} {what} mb{op['microbatch']}",
                    "cat": op["kind"],
                    "ph": "X",
                    "ts": op["start"] * 1e6,
                    "dur": max(0.0, op["end"] - op["start"]) * 1e6,
                    "pid": 0,
                    "tid": op["device"],
                    "args": {"task": f"RP {op['iteration']}:{op['task']}"},
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(
    recorder: TraceRecorder,
    directory: str | Path,
    iterations: int = 3,
    measured_costs: bool = False,
) -> list[Path]:
    """Write the last ``iterations`` traced training iterations as pictures of
    the measured timeline (``timeline-measured.png``) and of the same lowered
    schedules as the clock predicted them (``timeline-simulated.png``), in the
    style of :func:`~lightning_roundpipe.plan.plot_timeline`, and every
    recorded operation as a Chrome/Perfetto trace (``trace.json``).
    ``measured_costs``: the clock predicted from measured per-layer times (its
    time axis is then in seconds). Returns the paths written (the pictures
    need matplotlib)."""
    from ..plan.plot import plot_timeline
    from ..plan.schedule import Segment
    from ..plan.simulate import result_from_segments

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    trace_path = out / "trace.json"
    trace_path.write_text(json.dumps(recorder.chrome_trace()), encoding="utf-8")
    written = [trace_path]
    ops = recorder.operations()
    with recorder._lock:
        schedules = dict(recorder.schedules)
    its = sorted(it for it in {o["iteration"] for o in ops} if it in schedules)[-iterations:]
    if not its:
        return written
    n = schedules[its[0]].num_devices
    m = schedules[its[-1]].num_microbatches
    chosen = [o for o in ops if o["iteration"] in its]
    t0 = min(o["start"] for o in chosen)
    measured = [
        Segment(
            o["device"],
            o["start"] - t0,
            o["end"] - t0,
            o["kind"],
            o["stage"],
            o["microbatch"],
            o["iteration"],
        )
        for o in chosen
    ]
    predicted = [s for it in its for s in schedules[it].predicted]
    p0 = min(s.start for s in predicted)
    predicted = [
        Segment(s.device, s.start - p0, s.end - p0, s.kind, s.stage, s.microbatch, s.iteration)
        for s in predicted
    ]
    what = f"iterations {its[0]}-{its[-1]}, {n} devices, {m} micro-batches"
    # the clock predicts in seconds once per-layer times are measured, before
    # that in the size-based estimates' unit
    unit = "seconds" if measured_costs else "estimated cost units"
    for name, segs, title, axis in (
        ("measured", measured, f"measured: {what}", "seconds"),
        ("simulated", predicted, f"simulated (the clock's prediction): {what}", unit),
    ):
        res = result_from_segments(f"roundpipe ({name})", segs, n, m, len(its))
        path = out / f"timeline-{name}.png"
        written.append(plot_timeline(res, path, title=title, time_unit=axis))
    return written


def _experts(module: nn.Module) -> list[tuple[nn.Module, int]]:
    """Mixture-of-Experts containers in ``module`` and how many experts each
    token visits: a module with ``num_experts`` whose own parameters are
    stacked per expert (transformers' fused experts), next to a router with
    ``top_k`` (the router's own weight is not an expert's)."""
    found = []
    for parent in module.modules():
        children = list(parent.children())
        top_k = [c.top_k for c in children if isinstance(getattr(c, "top_k", None), int)]
        if isinstance(getattr(parent, "top_k", None), int):
            top_k.append(parent.top_k)
        for child in children:
            e = getattr(child, "num_experts", None)
            if not isinstance(e, int) or isinstance(getattr(child, "top_k", None), int):
                continue
            own = list(child.parameters(recurse=False))
            if top_k and own and all(p.dim() >= 2 and p.shape[0] == e for p in own):
                found.append((child, min(top_k[0], e)))
    return found


def active_parameters(layer: nn.Module) -> float:
    """Parameters one token's forward multiplies with: every parameter, except
    that each token visits only ``top_k`` of a Mixture-of-Experts layer's
    ``num_experts`` experts (our own count: torch has no per-token FLOP
    estimate that knows routing)."""
    total = float(sum(p.numel() for p in layer.parameters()))
    for experts, top_k in _experts(layer):
        n = sum(p.numel() for p in experts.parameters(recurse=False))
        total -= n * (1 - top_k / experts.num_experts)
    return total


def estimate_costs(layers: Sequence[nn.Module], compute_dtype: torch.dtype) -> LayerCosts:
    """Size-based layer costs used until measurements exist.

    Forward time is taken proportional to the parameters a token computes
    with (matmul FLOPs per token are ~2 x those; a Mixture-of-Experts layer
    counts ``top_k / num_experts`` of its experts, see :func:`active_parameters`)
    with a small floor so parameter-free layers still cost something; backward
    is twice the forward for layers with trainable weights (input and weight
    gradients) and equal to it otherwise. Memory is all the weights in the
    compute dtype plus, for trainable weights, the fp32 gradient accumulator;
    ``weight_bytes`` all the weights (every expert goes up)."""
    size = torch.empty(0, dtype=compute_dtype).element_size()
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    active = [active_parameters(layer) for layer in layers]
    floor = max(1.0, 1e-3 * max(active, default=1))
    fwd, bwd, mem = [], [], []
    for layer, n, a in zip(layers, counts, active, strict=True):
        f = a + floor
        trainable = any(p.requires_grad for p in layer.parameters())
        fwd.append(f)
        bwd.append(2 * f if trainable else f)
        grads = sum(p.numel() for p in layer.parameters() if p.requires_grad)
        mem.append(n * size + grads * 4)
    return LayerCosts(fwd, bwd, memory=mem, weight_bytes=[n * size for n in counts])


@dataclass(frozen=True)
class TrafficReport:
    """Bytes one training iteration moved between host and devices, against
    the least its schedule could move.

    Attributes:
        iteration: the iteration measured.
        moved: bytes by kind (``weights_up``, ``grads_down``, ``acts_up``,
            ``acts_down``, ``buffers``); on CPU workers, the bytes a device
            would have moved.
        weights_minimum, grads_minimum: each stage's weights up once, its fp32
            gradients down once: the least any round size moves per iteration.
        rounds: rounds of the iteration (each moves every stage's weights
            and gradients once).
        round: the round choice in use, with its reason.
        uploads_hidden: whether each round's compute hides its weight uploads
            at the measured host-to-device bandwidth (None: not known, e.g. on
            CPU workers or before per-layer times are measured).
        exposed: the stages whose uploads it does not hide (times in seconds).
    """

    iteration: int
    moved: dict[str, int]
    weights_minimum: int
    grads_minimum: int
    rounds: int
    round: RoundChoice
    uploads_hidden: bool | None
    exposed: tuple[ExposedUpload, ...] = ()

    @property
    def weights_ratio(self) -> float:
        """Weight bytes moved over the least any round size moves (the rounds)."""
        return self.moved["weights_up"] / self.weights_minimum if self.weights_minimum else 0.0

    def __str__(self) -> str:
        m = self.moved
        g = m["grads_down"] / self.grads_minimum if self.grads_minimum else 0.0
        hidden = {None: "not measured", True: "yes", False: "no"}[self.uploads_hidden]
        return (
            f"iteration {self.iteration}: weights up {_size(m['weights_up'])} "
            f"({self.weights_ratio:.2f}x the minimum), gradients down "
            f"{_size(m['grads_down'])} ({g:.2f}x), activations up {_size(m['acts_up'])}, "
            f"down {_size(m['acts_down'])}, buffers {_size(m['buffers'])}; {self.rounds} "
            f"round(s): {self.round.reason}; uploads hidden behind compute: {hidden}"
            + _exposed(self.exposed)
        )


def _exposed(exposed: Sequence[ExposedUpload]) -> str:
    if not exposed:
        return ""
    shown = "; ".join(f"{e} (seconds)" for e in exposed[:3])
    more = f"; and {len(exposed) - 3} more" if len(exposed) > 3 else ""
    return (
        f" (not hidden: {shown}{more}. Raise microbatches_per_round or num_microbatches so a "
        "round computes longer)"
    )


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError  # unreachable

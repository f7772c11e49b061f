"""Lowering: one iteration of a stage plan as the explicit list of tasks that runs.

An iteration of ``M`` micro-batches is processed in rounds of ``M_R`` (default:
the whole batch, one round). In a round the stage slots ``S_0..S_{S-1}`` go,
in order, to devices ``g0, g0+1, ...`` (mod ``N``); a device runs its slot for
every micro-batch of the round before it is free. :func:`lower` turns this
into a :class:`Schedule`: a tuple of :class:`Task` s, each saying which device
runs which stage for which micro-batches, what it reads (``act12``: the input
of layer 12, ``grad15``: the gradient of that input) and what it writes.

Both the runtime and the simulator execute this list: the runtime hands each
task to its device's worker in order, the simulator times it with
:class:`Clock`. The same clock decides placement while lowering, so the two
cannot drift apart.

Placement (``placement=``):

* ``"free-first"`` (default): every round starts on the device the clock
  predicts to become free first (from the costs in use), as RoundPipe's
  reference does. Only *where* work runs depends on this, never what is
  computed: randomness depends on (seed, iteration, layer, micro-batch) only.
* ``"rotate"``: a fixed rotation, ``g0 <- g0 + S (mod N)`` per round (for
  comparison; needs no costs).

Text forms: a task is ``"0.F2@1:0-3"`` (round 0, stage F2, device 1,
micro-batches 0 to 3); :meth:`Task.describe` adds the layers, reads, writes
and ordering; :meth:`Schedule.grid` draws devices as rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .costs import LayerCosts, PlanError
from .stages import Stage, StageKind, StagePlan, extra_forward_time

__all__ = ["Clock", "Copies", "Placement", "Schedule", "Segment", "Task", "lower", "readers_of"]

Placement = Literal["free-first", "rotate"]
SegmentKind = Literal["F", "R", "B"]

_TASK_RE = re.compile(r"^(\d+)\.([FB]\w*)@(\d+):(\d+)-(\d+)$")


@dataclass(frozen=True)
class Segment:
    """A busy interval of one device: ``kind`` is ``"F"`` (forward), ``"R"``
    (recompute) or ``"B"`` (backward) of ``stage`` for ``microbatch``."""

    device: int
    start: float
    end: float
    kind: SegmentKind
    stage: str
    microbatch: int
    iteration: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Task:
    """One device runs one stage for the micro-batches of one round.

    Attributes:
        round, slot, stage, kind: where in the iteration (``stage`` is the
            label, ``"F2"``, ``"B1"`` for the fused stage, ``"B4"``).
        device: the device (worker) index.
        mb_start, mb_stop: micro-batches ``[mb_start, mb_stop)``.
        start, stop: the layers ``[start, stop)``.
        reads: what each micro-batch reads, in order: ``"act<l>"`` (the input
            of layer ``l``) and, for a backward stage, ``"grad<l>"`` (the
            gradient of its output). A backward stage recomputes as soon as
            its ``act`` is there and waits for ``grad`` only to run backward.
        writes: what each micro-batch writes: ``"act<l>"`` (forward stages:
            boundaries that later stages read), ``"grad<l>"`` (the gradient
            of the stage's input), ``"loss"`` (the fused stage).
        ordered: the task waits for the previous task of the same slot (an
            earlier round, or the previous iteration), so updates of running
            statistics arrive in micro-batch order.
        layered: a backward or fused stage of a layered plan: it recomputes and
            differentiates one layer at a time
            (:class:`~lightning_roundpipe.plan.stages.StagePlan`).
        rewalk: such a stage that computes each layer's input again from the
            stage input instead of keeping it.
    """

    round: int
    slot: int
    stage: str
    kind: StageKind
    device: int
    mb_start: int
    mb_stop: int
    start: int
    stop: int
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    ordered: bool = False
    layered: bool = False
    rewalk: bool = False

    @property
    def microbatches(self) -> range:
        return range(self.mb_start, self.mb_stop)

    @property
    def needs_grad(self) -> bool:
        """Whether the task runs backward (and so produces weight gradients)."""
        return self.kind != "forward"

    def __str__(self) -> str:
        return f"{self.round}.{self.stage}@{self.device}:{self.mb_start}-{self.mb_stop - 1}"

    def describe(self) -> str:
        """The task with its layers, reads, writes and ordering."""
        layers = (
            f"L{self.start}" if self.stop - self.start == 1 else f"L{self.start}-{self.stop - 1}"
        )
        out = f"{self} {layers} reads {','.join(self.reads) or '-'}"
        out += f" writes {','.join(self.writes) or '-'}"
        out += " ordered" if self.ordered else ""
        if self.layered and self.stop - self.start > 1:
            out += " rewalk" if self.rewalk else " layered"
        return out

    @staticmethod
    def parse_short(text: str) -> tuple[int, str, int, int, int]:
        """``"0.F2@1:0-3"`` -> ``(round, stage, device, mb_start, mb_stop)``."""
        m = _TASK_RE.match(text.strip())
        if m is None:
            raise PlanError(
                f"cannot parse task {text!r}: expected 'round.stage@device:first-last' "
                "such as '0.F2@1:0-3'"
            )
        r, stage, dev, a, b = m.groups()
        return int(r), stage, int(dev), int(a), int(b) + 1


def readers_of(stages: Sequence[Stage], output_readers: int = 0) -> dict[int, int]:
    """How many stages read each layer's input ``act<l>`` per micro-batch
    (``output_readers`` extra readers of the last layer's output, e.g. the
    controller of a forward-only pass)."""
    readers: dict[int, int] = {}
    for st in stages:
        readers[st.start] = readers.get(st.start, 0) + 1
    if output_readers:
        top = max(st.stop for st in stages)
        readers[top] = readers.get(top, 0) + output_readers
    return readers


def _io(st: Stage, readers: dict[int, int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if st.kind == "forward":
        inner = [f"act{i}" for i in range(st.start + 1, st.stop) if i in readers]
        out = [f"act{st.stop}"] if readers.get(st.stop) else []
        return (f"act{st.start}",), tuple(inner + out)
    writes = [f"grad{st.start}"] if st.start > 0 else []
    if st.kind == "fused":
        return (f"act{st.start}",), (*writes, "loss")
    return (f"act{st.start}", f"grad{st.stop}"), tuple(writes)


@dataclass(frozen=True)
class Schedule:
    """One lowered iteration.

    Attributes:
        tasks: in dispatch order (round-major, then slot order); each device
            runs its tasks in this order.
        iteration, window: the iteration's number and its optimizer window
            (the ``step`` it feeds).
        num_devices, num_microbatches, round_size: ``N``, ``M``, ``M_R``.
        stages: the slots lowered.
        readers: readers per micro-batch of each ``act<l>`` key.
        predicted: the clock's predicted busy segments of this iteration (in
            the clock's time unit), empty when lowered without costs or
            ``predict``.
    """

    tasks: tuple[Task, ...]
    iteration: int
    window: int
    num_devices: int
    num_microbatches: int
    round_size: int
    stages: tuple[Stage, ...]
    readers: dict[int, int]
    predicted: tuple[Segment, ...] = ()

    def __iter__(self):
        return iter(self.tasks)

    def __len__(self) -> int:
        return len(self.tasks)

    def as_strings(self) -> list[str]:
        return [str(t) for t in self.tasks]

    def describe(self) -> list[str]:
        return [t.describe() for t in self.tasks]

    def device_tasks(self, device: int) -> list[Task]:
        """The tasks one device runs, in order."""
        return [t for t in self.tasks if t.device == device]

    @property
    def num_rounds(self) -> int:
        return 1 + max((t.round for t in self.tasks), default=-1)

    def grid(self, mark: int | Task | None = None) -> str:
        """Devices as rows, dispatch order as columns; ``mark`` (a task or its
        index) is drawn in brackets and pointed at."""
        if isinstance(mark, Task):
            mark = self.tasks.index(mark)
        cells = []
        for i, t in enumerate(self.tasks):
            text = f"{t.round}.{t.stage}"
            cells.append(f"[{text}]" if i == mark else text)
        width = max((len(c) for c in cells), default=1)
        label_w = len(f"dev {self.num_devices - 1}")
        lines = []
        for d in range(self.num_devices):
            row = [
                cells[i].center(width) if t.device == d else ".".center(width)
                for i, t in enumerate(self.tasks)
            ]
            lines.append(f"{f'dev {d}':<{label_w}} | " + " ".join(row))
        if mark is not None:
            col = label_w + 3 + mark * (width + 1) + width // 2
            lines.append(" " * col + "^ " + str(self.tasks[mark]))
        return "\n".join(lines)

    def weight_uploads(self) -> dict[str, int]:
        """How many times each stage's weights go up in this iteration (once
        per task: the number of rounds)."""
        out: dict[str, int] = {}
        for t in self.tasks:
            out[t.stage] = out.get(t.stage, 0) + 1
        return out


# ------------------------------------------------------------------ the clock
@dataclass
class _Iter:
    """What the clock remembers of the iteration being lowered."""

    window: int
    training: bool
    submitted: float  # when the controller hands the iteration to the workers
    avail: dict[tuple[str, int], tuple[float, int]] = field(default_factory=dict)
    losses_known: float = 0.0  # when the controller has every micro-batch's loss
    end: float = 0.0


@dataclass(frozen=True)
class Copies:
    """The host-device copies a device waits for, for :class:`Clock`.

    With prefetching (the default) a worker uploads the next stage's
    weights and the next micro-batch's input while a stage computes, and
    the clock treats those copies as hidden. Where a stage has all of the
    device's usable memory (``prefetch=False``, long sequences) they are
    exposed: a task's weights go up once the device is free (hidden while
    it waits for its first input anyway), each micro-batch's input once the
    one before is done. Whatever the prefetching, a backward stage's
    gradient from above goes up once it has arrived and the recompute has
    started, overlapping it, and a rewalked stage uploads its input once
    more for each layer but the first (each walk starts from it, and there
    is no room to keep it on the device). Copies are taken to use the whole
    link one after another: a bound on what the worker, which issues them
    on streams and never waits for the device itself, exposes.

    Attributes:
        bandwidth: host-to-device bytes per unit of the costs' time.
        boundary: bytes of one boundary value of a micro-batch (a layer's
            input, or its gradient; a model's first input, token ids, is
            counted as nothing).
        prefetch: whether workers prefetch.
    """

    bandwidth: float
    boundary: float
    prefetch: bool = True

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise PlanError(f"bandwidth must be > 0, got {self.bandwidth!r}")
        if not self.boundary >= 0:
            raise PlanError(f"boundary must be >= 0 bytes, got {self.boundary!r}")

    def waits(self, task: Task, costs: LayerCosts) -> tuple[float, float, float, float]:
        """The copy times of ``task`` a device may wait for: its weights
        (once, before its first micro-batch), then per micro-batch its input,
        its gradient from above (a backward stage) and a rewalked stage's
        uploads again."""
        value = self.boundary / self.bandwidth if task.start > 0 else 0.0
        grad = self.boundary / self.bandwidth if task.kind == "backward" else 0.0
        again = 0.0
        if task.rewalk and task.kind != "forward":
            again = (task.stop - task.start - 1) * value
        if self.prefetch:
            return 0.0, 0.0, grad, again
        weights = costs.stage_weight_bytes(task.start, task.stop) / self.bandwidth
        return weights, value, grad, again


class Clock:
    """Predicted device timelines: the timing model that placement and the
    simulator share.

    Each device runs its tasks in order, one operation at a time, appending to
    its timeline. An operation (one stage for one micro-batch) starts when its
    device is free and its inputs are there: an input produced on another
    device arrives ``comm_time`` later. A backward stage is two operations,
    the recompute (waiting only for its saved input) and the backward (waiting
    for the gradient from above). On top of the data, the clock models what
    the runtime enforces:

    * the controller submits an iteration once the previous one's losses (or,
      for a forward-only pass, its outputs) are known: it returns them to the
      training loop first;
    * the optimizer runs one step at a time, ``optimizer_time`` each, once all
      of its window's gradients are in (synchronous mode: once every task of
      the window is done) and the previous step is done;
    * weights: synchronous mode: window ``k`` waits for step ``k - 1``;
      asynchronous mode (staleness 1): a task of window ``k`` reads a layer
      once update ``k - 2`` is copied into it, which happens after that step
      and, with one master copy, after every task of window ``k - 1`` has read
      the layer (ordering rules 1 and 2; with two copies, ``double_buffer``,
      the update writes the copy window ``k - 1`` does not read);
    * an ``ordered`` task waits for the previous task of its slot.

    Args:
        costs: per-layer forward and backward times.
        num_devices: ``N``.
        async_optimizer: staleness-1 weights (see above).
        comm_time: time for a value to move between two devices.
        optimizer_time: time of one optimizer step on the host.
        double_buffer: two master copies of the trainable weights (the
            runtime's default with the asynchronous optimizer).
        record: keep every busy :class:`Segment` in :attr:`segments` (the
            simulator does); a schedule always carries its own.
        copies: the host-device copies a device waits for (:class:`Copies`);
            None: none (every copy hidden behind compute).

    Attributes:
        copy_wait: device time spent waiting for such copies so far.
    """

    def __init__(
        self,
        costs: LayerCosts,
        num_devices: int,
        *,
        async_optimizer: bool = True,
        comm_time: float = 0.0,
        optimizer_time: float = 0.0,
        double_buffer: bool = True,
        record: bool = False,
        copies: Copies | None = None,
    ) -> None:
        if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
            raise PlanError(f"num_devices must be an integer >= 1, got {num_devices!r}")
        if not (comm_time >= 0 and math.isfinite(comm_time)):
            raise PlanError(f"comm_time must be finite and >= 0, got {comm_time!r}")
        if not optimizer_time >= 0:
            raise PlanError(f"optimizer_time must be >= 0, got {optimizer_time!r}")
        self.costs = costs
        self.num_devices = num_devices
        self.async_optimizer = async_optimizer
        self.comm_time = comm_time
        self.optimizer_time = optimizer_time
        self.double_buffer = double_buffer
        self.record = record
        self.copies = copies
        self.copy_wait = 0.0
        self.free = [0.0] * num_devices
        self.segments: list[Segment] = []
        self._prev: _Iter | None = None  # the iteration lowered last
        self._reads: dict[tuple[int, int], float] = {}  # (window, layer) -> last weight read
        self._grads: dict[int, float] = {}  # window -> end of its last backward
        self._ends: dict[int, float] = {}  # window -> end of its last task
        self._steps: dict[int, float] = {}  # window -> end of its optimizer step
        self._slot_end: dict[int, float] = {}  # slot -> end of its last ordered task
        self.first_window = 0  # no step before this window (a resumed run starts later)

    # ------------------------------------------------------------ windows
    def step(self, window: int) -> float:
        """Window ``window`` is closed and its optimizer step queued; returns
        the predicted end of the step."""
        ready = self._grads.get(window, 0.0)
        if not self.async_optimizer:  # the step waits for every task of its window
            ready = max(ready, self._ends.get(window, 0.0))
        end = max(self._steps.get(window - 1, 0.0), ready) + self.optimizer_time
        self._steps[window] = end
        for key in [k for k in self._steps if k < window - 2]:
            del self._steps[key]
        for key in [k for k in self._reads if k[0] < window - 1]:
            del self._reads[key]
        for d in (self._grads, self._ends):
            for key in [k for k in d if k < window - 2]:
                del d[key]
        return end

    def _weights_ready(self, window: int, start: int, stop: int) -> float:
        if not self.async_optimizer:
            return self._steps.get(window - 1, 0.0)
        update = window - 2  # the update whose weights this window computes with
        if update < self.first_window:
            return 0.0
        if self.double_buffer:
            return self._steps.get(update, 0.0)
        reads = self._reads
        return max(
            [self._steps.get(update, 0.0)]
            + [reads.get((window - 1, layer), 0.0) for layer in range(start, stop)]
        )

    def reset_slots(self) -> None:
        """Forget the order of slots (a new stage plan is installed)."""
        self._slot_end.clear()

    # --------------------------------------------------------- operations
    def _arrival(self, it: _Iter, key: str, mb: int, device: int) -> float:
        got = it.avail.get((key, mb))
        if got is None:  # the batch's own input: there once submitted
            return it.submitted
        t, dev = got
        return t + (self.comm_time if dev != device else 0.0)

    def _time(self, it: _Iter, task: Task, out: list[Segment] | None, iteration: int) -> None:
        """Time ``task``: advance its device, make its writes available and,
        with ``out``, append its busy segments there."""
        costs, d, free = self.costs, task.device, self.free
        # a task's own host work (task_overhead) opens each micro-batch's first part
        fwd = costs.forward_time(task.start, task.stop) + costs.task_overhead
        bwd = costs.backward_time(task.start, task.stop)
        if task.layered and task.kind != "forward":  # the extra forwards, layer by layer
            bwd += extra_forward_time(costs, task.start, task.stop, task.rewalk)
        ready = max(it.submitted, self._weights_ready(it.window, task.start, task.stop))
        if task.ordered:
            ready = max(ready, self._slot_end.get(task.slot, 0.0))
        first = max(free[d], ready)
        end = first
        # exposed copies: the weights before the first micro-batch, then per
        # micro-batch the input, the gradient from above, the rewalk's uploads
        w_up, x_up, g_up, again = (
            self.copies.waits(task, costs) if self.copies is not None else (0.0,) * 4
        )
        for mb in task.microbatches:
            arrival = self._arrival(it, task.reads[0], mb, d)
            begin = max(free[d], ready, arrival)
            if w_up:  # the weights from when the device is free, before the first input
                begin, waited = max(max(free[d], ready) + w_up, arrival), begin
                self.copy_wait += begin - waited
                w_up = 0.0
            start = begin + x_up
            if task.kind == "forward":
                parts: list[tuple[SegmentKind, float, float]] = [("F", start, start + fwd)]
            elif task.kind == "fused":
                b0 = start + fwd + again
                parts = [("F", start, start + fwd), ("B", b0, b0 + bwd)]
            else:
                # the recompute needs only the saved input; the backward waits for
                # the gradient, uploaded once it arrived, during the recompute
                grad = self._arrival(it, task.reads[1], mb, d)
                b0 = max(start + fwd, grad + g_up)
                self.copy_wait += b0 - max(start + fwd, grad)
                b0 += again
                parts = [("R", start, start + fwd), ("B", b0, b0 + bwd)]
            self.copy_wait += x_up + again
            end = free[d] = parts[-1][2]
            for key in task.writes:
                it.avail[(key, mb)] = (end, d)
            if task.kind == "fused":
                it.losses_known = max(it.losses_known, end)
            if out is not None:
                out.extend(Segment(d, a, b, k, task.stage, mb, iteration) for k, a, b in parts)
        if task.ordered:
            self._slot_end[task.slot] = end
        for layer in range(task.start, task.stop):
            key = (it.window, layer)
            self._reads[key] = max(self._reads.get(key, 0.0), first)
        if it.training:
            if task.needs_grad:
                self._grads[it.window] = max(self._grads.get(it.window, 0.0), end)
            self._ends[it.window] = max(self._ends.get(it.window, 0.0), end)
        it.end = max(it.end, end)

    def _begin(self, window: int, training: bool) -> _Iter:
        prev = self._prev
        # the controller learns the previous iteration's losses (or outputs)
        # before it submits this one
        gate = 0.0 if prev is None else (prev.losses_known if prev.training else prev.end)
        it = self._prev = _Iter(window, training, gate, losses_known=gate)
        return it


# ------------------------------------------------------------------ lowering
def _check_counts(num_devices: int, num_microbatches: int, round_size: int | None) -> int:
    for name, v in (("num_devices", num_devices), ("num_microbatches", num_microbatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"{name} must be an integer >= 1, got {v!r}")
    mr = num_microbatches if round_size is None else round_size
    if isinstance(mr, bool) or not isinstance(mr, int) or mr < 1:
        raise PlanError(
            f"microbatches_per_round must be an integer >= 1, got {round_size!r}; "
            "leave it unset for one round per batch"
        )
    return min(mr, num_microbatches)


def lower(
    plan: StagePlan | Sequence[Stage],
    num_devices: int,
    num_microbatches: int,
    *,
    round_size: int | None = None,
    clock: Clock | None = None,
    iteration: int = 0,
    window: int | None = None,
    training: bool = True,
    ordered_slots: Collection[int] = (),
    output_readers: int = 0,
    placement: Placement = "free-first",
    start_device: int = 0,
    predict: bool = True,
) -> Schedule:
    """Lower one iteration to its tasks.

    Args:
        plan: the stage plan (or its slots, e.g. forward-only slots).
        num_devices: ``N``.
        num_microbatches: ``M``; any number ``>= 1`` (fewer than ``N`` leaves
            some devices idle in a round).
        round_size: ``M_R``, micro-batches per round (default ``M``: each
            stage's weights go up once per iteration); the last round holds the
            remainder.
        clock: the timing model that predicts when devices become free; it
            is advanced by this iteration. Without one, ``placement`` must be
            ``"rotate"`` and nothing is timed.
        iteration: the number of this iteration.
        window: the number of the optimizer window it feeds (default
            ``window = iteration``).
        training: a training iteration (reads weights under the optimizer's
            ordering rules, produces gradients); ``False`` for forward-only
            passes (evaluation).
        ordered_slots: slots whose tasks must run in micro-batch order across
            rounds (layers with running statistics).
        output_readers: readers of the last layer's output (forward-only).
        placement: ``"free-first"`` or ``"rotate"`` (see the module docs).
        start_device: the first round's device with ``"rotate"`` or without a
            clock.
        predict: keep the clock's predicted segments in the schedule (the
            runtime asks only while it records a trace).
    """
    n, m = num_devices, num_microbatches
    mr = _check_counts(n, m, round_size)
    if placement not in ("free-first", "rotate"):
        raise PlanError(f"placement must be 'free-first' or 'rotate', got {placement!r}")
    if placement == "free-first" and clock is None:
        raise PlanError("placement='free-first' needs a clock (the costs that predict it)")
    if clock is not None and clock.num_devices != n:
        raise PlanError(f"the clock models {clock.num_devices} devices, not {n}")
    if not 0 <= start_device < n:
        raise PlanError(f"start_device ({start_device}) must be in [0, {n})")
    stages = tuple(plan.stages) if isinstance(plan, StagePlan) else tuple(plan)
    if not stages:
        raise PlanError("nothing to lower: the plan has no stage slots")
    if clock is not None:
        top = max(st.stop for st in stages)
        if top != clock.costs.num_layers:
            raise PlanError(
                f"the stages cover {top} layers but the clock's costs have "
                f"{clock.costs.num_layers}; give costs of the same model"
            )
    window = iteration if window is None else window
    readers = readers_of(stages, output_readers)
    io = [_io(st, readers) for st in stages]
    ordered = set(ordered_slots)
    it = clock._begin(window, training) if clock is not None else None
    keep = predict or (clock is not None and clock.record)
    predicted: list[Segment] | None = [] if keep else None
    tasks: list[Task] = []
    nxt = start_device
    for r, first in enumerate(range(0, m, mr)):
        last = min(first + mr, m)

        def round_tasks(g0: int, r=r, first=first, last=last) -> list[Task]:
            return [
                Task(
                    r,
                    st.index,
                    st.label,
                    st.kind,
                    (g0 + i) % n,
                    first,
                    last,
                    st.start,
                    st.stop,
                    *io[i],
                    ordered=st.index in ordered,
                    layered=st.layered,
                    rewalk=st.rewalk,
                )
                for i, st in enumerate(stages)
            ]

        g0 = nxt
        if placement == "free-first":
            assert clock is not None
            # the device free first; among equals, the one the rotation reaches first
            g0 = min(range(n), key=lambda d: (clock.free[d], (d - nxt) % n))
        chosen = round_tasks(g0)
        if clock is not None:
            assert it is not None
            for task in chosen:
                clock._time(it, task, predicted, iteration)
        tasks.extend(chosen)
        nxt = (g0 + len(stages)) % n
    if clock is not None and clock.record:
        clock.segments.extend(predicted or ())
    shown = tuple(predicted) if predict and predicted else ()
    return Schedule(tuple(tasks), iteration, window, n, m, mr, stages, readers, shown)

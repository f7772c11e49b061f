"""Round-robin dispatch: which device runs which stage slot for which micro-batches.

``M`` micro-batches are processed in rounds of ``M_R >= N`` (the last round
may be shorter). In a round the ``S`` slots of the stage plan are dispatched in
order; slot ``i`` goes to device ``(g0 + i) mod N``, which runs it for every
micro-batch of the round. The next round, and the next iteration, continue
the rotation: ``g0 <- (g0 + S) mod N``.

A :class:`DispatchPlan` is plain data. Each step has a round-trippable string
form, ``"0.F2@1:0-3"`` (round 0, slot F2, device 1, micro-batches 0 to 3), so
tests are written as lists of strings, and :meth:`DispatchPlan.grid` draws the
plan with devices as rows, optionally marking one step for error messages.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .costs import PlanError
from .stages import Stage, StagePlan

__all__ = ["DispatchPlan", "DispatchStep", "dispatch"]

_STEP_RE = re.compile(r"^(\d+)\.([FB]\d+)@(\d+):(\d+)-(\d+)$")


@dataclass(frozen=True)
class DispatchStep:
    """One dispatched slot: a device runs ``stage`` for micro-batches
    ``mb_start..mb_stop-1`` of ``round``."""

    round: int
    slot: int
    stage: str
    device: int
    mb_start: int
    mb_stop: int

    @property
    def microbatches(self) -> range:
        return range(self.mb_start, self.mb_stop)

    def __str__(self) -> str:
        return f"{self.round}.{self.stage}@{self.device}:{self.mb_start}-{self.mb_stop - 1}"

    @classmethod
    def parse(cls, text: str, slot: int = -1) -> DispatchStep:
        """Parse ``"round.stage@device:first-last"``; ``slot`` is not part of the
        text form (it follows from the stage label and the plan)."""
        m = _STEP_RE.match(text.strip())
        if m is None:
            raise PlanError(
                f"cannot parse dispatch step {text!r}: expected 'round.stage@device:first-last' "
                "such as '0.F2@1:0-3'"
            )
        r, stage, dev, a, b = m.groups()
        return cls(int(r), slot, stage, int(dev), int(a), int(b) + 1)


@dataclass(frozen=True)
class DispatchPlan:
    """The ordered dispatch of one iteration.

    Attributes:
        steps: dispatch order (round-major, then slot order).
        num_devices: ``N``.
        start_device: ``g0`` of the first round.
        next_device: ``g0`` for the next iteration (pass it as ``start_device``).
        stages: the plan's slots, for looking up layer ranges by ``step.slot``.
    """

    steps: tuple[DispatchStep, ...]
    num_devices: int
    start_device: int
    next_device: int
    stages: tuple[Stage, ...]

    def __iter__(self):
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def as_strings(self) -> list[str]:
        return [str(s) for s in self.steps]

    def device_steps(self, device: int) -> list[DispatchStep]:
        """The steps one device runs, in order."""
        return [s for s in self.steps if s.device == device]

    def grid(self, mark: int | DispatchStep | None = None) -> str:
        """Devices as rows, dispatch order as columns; ``mark`` (a step or its
        index) is drawn in brackets and pointed at."""
        if isinstance(mark, DispatchStep):
            mark = self.steps.index(mark)
        cells = []
        for i, s in enumerate(self.steps):
            text = f"{s.round}.{s.stage}"
            cells.append(f"[{text}]" if i == mark else text)
        width = max((len(c) for c in cells), default=1)
        label_w = len(f"dev {self.num_devices - 1}")
        lines = []
        for d in range(self.num_devices):
            row = [
                cells[i].center(width) if s.device == d else ".".center(width)
                for i, s in enumerate(self.steps)
            ]
            lines.append(f"{f'dev {d}':<{label_w}} | " + " ".join(row))
        if mark is not None:
            col = label_w + 3 + mark * (width + 1) + width // 2
            lines.append(" " * col + "^ " + str(self.steps[mark]))
        return "\n".join(lines)


def dispatch(
    plan: StagePlan | Sequence[Stage],
    num_devices: int,
    num_microbatches: int,
    microbatches_per_round: int | None = None,
    start_device: int = 0,
) -> DispatchPlan:
    """The round-robin dispatch of one iteration.

    Args:
        plan: the stage plan whose slots are dispatched (or the slots
            themselves, e.g. the forward-only slots used for evaluation).
        num_devices: ``N``.
        num_microbatches: ``M``; must be ``>= N``.
        microbatches_per_round: ``M_R`` (default ``N``); must be ``>= N``. The
            last round holds the remainder when ``M_R`` does not divide ``M``.
        start_device: ``g0`` of the first round; carry ``next_device`` of the
            previous iteration here so the rotation never restarts.
    """
    n, m = num_devices, num_microbatches
    for name, v in (("num_devices", n), ("num_microbatches", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"{name} must be an integer >= 1, got {v!r}")
    if m < n:
        raise PlanError(
            f"num_microbatches ({m}) must be >= number of devices ({n}); "
            "raise num_microbatches or lower devices"
        )
    mr = n if microbatches_per_round is None else microbatches_per_round
    if isinstance(mr, bool) or not isinstance(mr, int) or mr < n:
        raise PlanError(
            f"microbatches_per_round ({mr!r}) must be an integer >= number of devices ({n}); "
            "raise microbatches_per_round or lower devices"
        )
    if not 0 <= start_device < n:
        raise PlanError(f"start_device ({start_device}) must be in [0, {n})")
    stages = tuple(plan.stages) if isinstance(plan, StagePlan) else tuple(plan)
    if not stages:
        raise PlanError("nothing to dispatch: the plan has no stage slots")
    steps = []
    g0 = start_device
    for r, first in enumerate(range(0, m, mr)):
        last = min(first + mr, m)
        for st in stages:
            steps.append(DispatchStep(r, st.index, st.label, (g0 + st.index) % n, first, last))
        g0 = (g0 + len(stages)) % n
    return DispatchPlan(tuple(steps), n, start_device, g0, stages)

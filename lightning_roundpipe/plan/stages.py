"""Stage plans: how the layers are cut into forward, fused and backward stages.

A RoundPipe iteration runs, for every micro-batch, the *stage slots*
``F1..F_Sf, B1, B2..B_Sb`` in that order:

* forward stages ``F1..F_Sf`` cover layers ``[0, L - fused)`` bottom-up;
* the fused stage ``B1`` covers the last ``fused`` layers ``[L - fused, L)`` and
  runs forward, loss and backward in one go (its forward is the recompute);
* backward stages ``B2..B_Sb`` cover ``[0, L - fused)`` again, top-down; each
  recomputes its layers from its saved input, then runs their backward.

Forward and backward cuts are independent ("asymmetric"). The compact text
form lists forward counts, the fused count and the backward counts from the
top: ``"7,7,7,7|1|3,3,3,3,3,3,3,3,2,2"``.

A *layered* plan (text form ending in ``"|layered"``) trades compute for host
memory at long sequences: each backward stage (and the fused one) first runs
its layers but the top one forward without autograd, keeping every layer's
input on the device, then recomputes and differentiates one layer at a time
from the top. Multi-layer backward stages then fit the device, so the host
keeps one boundary value per backward stage instead of one per layer, at the
price of a second forward of every layer of such a stage but its top one;
the device holds the stage's layer inputs and one layer's autograd state
(not every layer's).

A *rewalked* plan (``"|rewalk"``) is a layered plan whose backward and fused
stages keep no layer inputs on the device either: when a layer's turn
comes, its input is computed again from the stage input, which the host
still holds and uploads again. The device then holds one layer's autograd
state and nothing per layer of the stage, so at sequences where even one
layer input per layer is too much for the device, multi-layer stages (and
so few boundary values on the host) still fit. The price grows with the
square of a stage's layers: a stage of ``k`` layers runs ``k (k - 1) / 2``
layer forwards more than a plain one (a layered one: ``k - 1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .costs import LayerCosts, PlanError

__all__ = ["Stage", "StageKind", "StagePlan", "extra_forward_time"]

StageKind = Literal["forward", "fused", "backward"]

#: the text form's last part for each kind of layered plan
_SUFFIXES = {"layered": (True, False), "rewalk": (True, True)}


def extra_forward_time(costs: LayerCosts, start: int, stop: int, rewalk: bool) -> float:
    """Layer forwards a layered backward or fused stage over ``[start, stop)``
    runs on top of a plain one's: every layer but the top once (its inputs
    kept), or, ``rewalk``, the layers below each layer but the first, once
    for each (each layer's input computed again from the stage input)."""
    if not rewalk:
        return costs.forward_time(start, stop - 1)
    return sum(costs.forward_time(start, top) for top in range(start + 1, stop))


@dataclass(frozen=True)
class Stage:
    """One stage slot of a plan, in dispatch order.

    Attributes:
        index: position in the slot sequence (0-based).
        label: ``"F3"``, ``"B1"`` (the fused stage) or ``"B4"``.
        kind: ``"forward"``, ``"fused"`` or ``"backward"``.
        start, stop: the layer range ``[start, stop)``.
        layered: a backward or fused stage that recomputes and
            differentiates one layer at a time (see the module's text).
        rewalk: such a stage that keeps no layer inputs but computes each
            again from the stage input (see the module's text).
    """

    index: int
    label: str
    kind: StageKind
    start: int
    stop: int
    layered: bool = False
    rewalk: bool = False

    @property
    def num_layers(self) -> int:
        return self.stop - self.start

    def time(self, costs: LayerCosts) -> float:
        """Time of this stage for one micro-batch (its layers and the
        ``task_overhead``)."""
        if self.kind == "forward":
            return costs.forward_time(self.start, self.stop) + costs.task_overhead
        return (
            costs.recompute_backward_time(self.start, self.stop)
            + self.extra_forward(costs)
            + costs.task_overhead
        )

    def extra_forward(self, costs: LayerCosts) -> float:
        """The extra forwards a layered backward or fused stage runs
        (:func:`extra_forward_time`; 0 for other stages)."""
        if self.kind == "forward" or not self.layered:
            return 0.0
        return extra_forward_time(costs, self.start, self.stop, self.rewalk)

    def memory(self, costs: LayerCosts) -> float:
        """Device memory of this stage for one micro-batch (0 when unknown)."""
        return costs.stage_memory(self.start, self.stop)


def _counts(name: str, values: Sequence[int]) -> tuple[int, ...]:
    out = tuple(values)
    for i, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, int):
            raise PlanError(f"{name} stage {i + 1} has a layer count of {v!r}; counts are integers")
        if v < 1:
            raise PlanError(
                f"{name} stage {i + 1} has {v} layers; every stage needs at least one layer"
            )
    return out


@dataclass(frozen=True)
class StagePlan:
    """Forward / fused / backward cut of ``L`` layers.

    Args:
        forward: layer counts of the forward stages, bottom-up.
        fused: number of layers in the fused stage (the top ``fused`` layers).
        backward: layer counts of the backward stages after the fused one,
            from the top down.
        layered: backward stages and the fused one recompute and
            differentiate one layer at a time (see the module's text).
        rewalk: layered stages that keep no layer inputs but compute each
            again from the stage input (requires ``layered``; see the
            module's text).

    The plan is validated on construction: counts are positive and both the
    forward and the backward counts cover the layers below the fused stage.
    """

    forward: tuple[int, ...]
    fused: int
    backward: tuple[int, ...]
    layered: bool = False
    rewalk: bool = False

    def __post_init__(self) -> None:
        for name in ("layered", "rewalk"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.rewalk and not self.layered:
            raise PlanError(
                "rewalk=True needs layered=True: only a layered plan's stages can compute "
                "their layer inputs again (text form: '...|rewalk')"
            )
        object.__setattr__(self, "forward", _counts("forward", self.forward))
        object.__setattr__(self, "backward", _counts("backward", self.backward))
        if isinstance(self.fused, bool) or not isinstance(self.fused, int) or self.fused < 1:
            raise PlanError(
                f"the fused stage has {self.fused!r} layers; it needs at least one layer "
                "(the last layer, which computes the loss)"
            )
        below_f, below_b = sum(self.forward), sum(self.backward)
        if below_f != below_b:
            raise PlanError(
                f"forward stages cover {below_f} layers but backward stages cover {below_b}; "
                "both must cover exactly the layers below the fused stage "
                f"({self}: forward {list(self.forward)}, backward {list(self.backward)})"
            )

    # ------------------------------------------------------------- text form
    def __str__(self) -> str:
        fwd, bwd = ",".join(map(str, self.forward)), ",".join(map(str, self.backward))
        suffix = "|rewalk" if self.rewalk else "|layered" if self.layered else ""
        return f"{fwd}|{self.fused}|{bwd}{suffix}"

    @classmethod
    def parse(cls, text: str, num_layers: int | None = None) -> StagePlan:
        """Parse the compact form ``"forward counts|fused count|backward counts"``
        (with ``"|layered"`` or ``"|rewalk"`` appended: a layered or a
        rewalked plan).

        If ``num_layers`` is given the plan is also checked against it.
        """
        parts = text.strip().split("|")
        layered, rewalk = False, False
        if len(parts) == 4 and parts[3].strip() in _SUFFIXES:
            layered, rewalk = _SUFFIXES[parts[3].strip()]
            parts = parts[:3]
        if len(parts) != 3:
            raise PlanError(
                f"cannot parse plan {text!r}: expected three '|'-separated parts "
                "'forward counts|fused count|backward counts', e.g. '3,3|1|2,2,2', "
                "optionally followed by '|layered' or '|rewalk'"
            )

        def ints(part: str, what: str) -> list[int]:
            part = part.strip()
            if not part:
                return []
            try:
                return [int(tok) for tok in part.split(",")]
            except ValueError:
                raise PlanError(
                    f"cannot parse plan {text!r}: {what} part {part!r} is not a "
                    "comma-separated list of integers"
                ) from None

        fused = ints(parts[1], "fused")
        if len(fused) != 1:
            raise PlanError(f"cannot parse plan {text!r}: the fused part must be one integer")
        plan = cls(
            tuple(ints(parts[0], "forward")),
            fused[0],
            tuple(ints(parts[2], "backward")),
            layered,
            rewalk,
        )
        if num_layers is not None:
            plan.validate(num_layers)
        return plan

    @classmethod
    def from_ranges(
        cls,
        forward: Sequence[tuple[int, int]],
        fused: tuple[int, int],
        backward: Sequence[tuple[int, int]],
        num_layers: int | None = None,
    ) -> StagePlan:
        """Build from explicit ``(start, stop)`` layer ranges, checking that they
        are contiguous and cover the model (forward bottom-up from layer 0,
        the fused stage up to the last layer, backward top-down to layer 0)."""
        total = fused[1] if num_layers is None else num_layers
        if fused[1] != total:
            raise PlanError(
                f"the fused stage must end at the last layer ({total}), but it is {fused}"
            )
        pos = 0
        for i, (a, b) in enumerate(forward):
            if a != pos:
                raise PlanError(
                    f"forward stage {i + 1} starts at layer {a} but the previous stage ends at "
                    f"{pos}; forward stages must be contiguous from layer 0"
                )
            if b <= a:
                raise PlanError(f"forward stage {i + 1} has an empty range ({a}, {b})")
            pos = b
        if fused[0] != pos:
            raise PlanError(
                f"the fused stage starts at layer {fused[0]} but the forward stages end at "
                f"{pos}; they must meet"
            )
        top = fused[0]
        for j, (a, b) in enumerate(backward):
            if b != top:
                raise PlanError(
                    f"backward stage B{j + 2} ends at layer {b} but the stage above it starts at "
                    f"{top}; backward stages must be contiguous from the fused stage down"
                )
            if b <= a:
                raise PlanError(f"backward stage B{j + 2} has an empty range ({a}, {b})")
            top = a
        if top != 0:
            raise PlanError(f"backward stages stop at layer {top}; they must reach layer 0")
        return cls(
            tuple(b - a for a, b in forward),
            fused[1] - fused[0],
            tuple(b - a for a, b in backward),
        )

    # ------------------------------------------------------------ structure
    @property
    def num_layers(self) -> int:
        """Number of layers ``L`` covered by the plan."""
        return sum(self.forward) + self.fused

    @property
    def num_slots(self) -> int:
        """Number of stage slots ``S`` (forward + fused + backward stages)."""
        return len(self.forward) + 1 + len(self.backward)

    @property
    def forward_stages(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of each forward stage, bottom-up."""
        out, pos = [], 0
        for n in self.forward:
            out.append((pos, pos + n))
            pos += n
        return out

    @property
    def fused_stage(self) -> tuple[int, int]:
        """``(start, stop)`` of the fused stage."""
        n = self.num_layers
        return (n - self.fused, n)

    @property
    def backward_stages(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of each backward stage after the fused one, top-down."""
        out, top = [], self.num_layers - self.fused
        for n in self.backward:
            out.append((top - n, top))
            top -= n
        return out

    @property
    def stages(self) -> list[Stage]:
        """All stage slots in dispatch order."""
        out: list[Stage] = []
        for i, (a, b) in enumerate(self.forward_stages):
            out.append(Stage(len(out), f"F{i + 1}", "forward", a, b))
        a, b = self.fused_stage
        out.append(Stage(len(out), "B1", "fused", a, b, self.layered, self.rewalk))
        for j, (a, b) in enumerate(self.backward_stages):
            out.append(Stage(len(out), f"B{j + 2}", "backward", a, b, self.layered, self.rewalk))
        return out

    def kept_boundaries(self) -> list[int]:
        """The layers whose input a micro-batch keeps on the host from its
        forward until a backward (or the fused) stage reads it: every such
        stage's first layer but layer 0 (the batch's own input)."""
        return sorted({st.start for st in self.stages if st.kind != "forward" and st.start > 0})

    def boundaries_per_microbatch(self) -> int:
        """Boundary values one micro-batch holds on the host at most: the
        :meth:`kept_boundaries` until its backward and, while its forward
        runs, the input of a forward stage that no backward stage reads and
        the next one being written."""
        kept = set(self.kept_boundaries())
        forward_only = {st.start for st in self.stages if st.start > 0} - kept
        return len(kept) + min(2, len(forward_only))

    def validate(self, num_layers: int) -> None:
        """Raise :class:`PlanError` unless the plan covers exactly ``num_layers``."""
        if self.num_layers != num_layers:
            raise PlanError(
                f"plan {self} covers {self.num_layers} layers (forward {sum(self.forward)} + "
                f"fused {self.fused}) but the model has {num_layers}; the forward and fused "
                "counts must add up to the number of layers"
            )

    # -------------------------------------------------------------- metrics
    def stage_times(self, costs: LayerCosts) -> list[float]:
        """Time of each slot for one micro-batch, in dispatch order."""
        self.validate(costs.num_layers)
        return [s.time(costs) for s in self.stages]

    def max_stage_time(self, costs: LayerCosts) -> float:
        """``t_max``: the slowest slot's time for one micro-batch."""
        return max(self.stage_times(costs))

    def stage_memory(self, costs: LayerCosts) -> list[float]:
        """Device memory of each slot, in dispatch order (zeros when unknown)."""
        self.validate(costs.num_layers)
        return [s.memory(costs) for s in self.stages]

    def objective(self, costs: LayerCosts, num_devices: int, num_microbatches: int) -> float:
        """Round-robin pipeline time ``(M*S + N*(N-1)) * t_max`` that the
        partitioner minimises."""
        n, m = num_devices, num_microbatches
        return (m * self.num_slots + n * (n - 1)) * self.max_stage_time(costs)

    def describe(self, costs: LayerCosts | None = None) -> str:
        """A readable multi-line form with layer ranges (and times with ``costs``)."""
        lines = [f"StagePlan {self}  ({self.num_layers} layers, {self.num_slots} slots)"]
        for st in self.stages:
            rng = f"layer {st.start}" if st.num_layers == 1 else f"layers {st.start}-{st.stop - 1}"
            what = {
                "forward": "forward",
                "fused": "forward+loss+backward",
                "backward": "recompute+backward",
            }[st.kind]
            if st.layered and st.num_layers > 1:
                what += " by layer, rewalked" if st.rewalk else " by layer"
            line = f"  {st.label:>4}  {what:<22} {rng}"
            if costs is not None:
                line += f"  time {st.time(costs):.4g}"
                if costs.memory is not None:
                    line += f"  memory {st.memory(costs):.4g}"
            lines.append(line)
        return "\n".join(lines)

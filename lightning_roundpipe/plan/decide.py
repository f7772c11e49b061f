"""Plan decisions: the plan to start with, after measurement, after running out of memory.

Every change of plan is a function of (costs, limits, options) that returns
what to do and why; the engine only installs a plan between iterations and
the strategy only asks. Pure Python: the device memory limit and the
measured costs come in as numbers.

* :func:`initial_plan`: the given plan checked against the memory limit, or
  the plan with the shortest simulated step within it (:func:`choose_plan`).
* :func:`plan_for_activations`: once the first training call's shape is
  known, the predicted activation memory (saved for backward, plus the largest
  transient) is added to each stage; a plan that would not fit is replaced
  before anything runs.
* :func:`after_measurement`: once per-layer times and activation bytes are
  measured, switch to the measured best plan when it is faster by more than a
  margin or when the current plan no longer fits the limit.
* :func:`after_out_of_memory`: a stage ran out of device memory in the first
  batch: where its activations were predicted, count them larger than
  predicted (the re-plan of :func:`plan_for_activations` then cuts, layers
  or rewalks the stages that need it, or stops prefetching); else cap stage
  sizes at half the failed stage (never below the largest layer), or, where
  the stage cannot be cut and the micro-batch count is automatic, double the
  micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .costs import LayerCosts, PlanError
from .partition import frontier, partition
from .policy import choose_plan, simulated_period
from .stages import StagePlan

__all__ = [
    "Measured",
    "OutOfMemory",
    "after_measurement",
    "after_out_of_memory",
    "host_need",
    "initial_plan",
    "plan_for_activations",
    "plan_for_measured",
    "stage_peaks",
    "tightest",
]


def tightest(*limits: float | None) -> float | None:
    """The smallest of the memory limits that are set (None when none is)."""
    given = [x for x in limits if x is not None]
    return min(given) if given else None


def initial_plan(
    estimates: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    *,
    given: StagePlan | None,
    async_optimizer: bool,
    memory_limit: int | None,
    size_limit: int | None = None,
    round_size: int | None = None,
) -> StagePlan:
    """The plan to start with: ``given`` if its largest stage fits
    ``memory_limit`` (else :class:`PlanError` naming the stage), otherwise the
    plan with the shortest simulated step within both limits (the estimates
    hold no activations, so both bound the same numbers), with rounds of
    ``round_size`` micro-batches when that is fixed."""
    if given is None:
        return choose_plan(
            estimates,
            num_devices,
            num_microbatches,
            async_optimizer=async_optimizer,
            memory_limit=tightest(memory_limit, size_limit),
            round_size=round_size,
        )
    if memory_limit is not None:
        need = given.stage_memory(estimates)
        worst = max(range(given.num_slots), key=need.__getitem__)
        if need[worst] > memory_limit:
            raise PlanError(
                f"stage {given.stages[worst].label} of plan {given} needs about {need[worst]} "
                f"bytes of device memory but the limit is {memory_limit}; give a plan with "
                "smaller stages, or plan=None to let the partitioner respect the limit"
            )
    return given


def plan_for_measured(
    measured: LayerCosts,
    estimates: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    *,
    async_optimizer: bool,
    round_size: int | None,
    memory_limit: int | None,
    size_limit: int | None,
) -> StagePlan:
    """The chosen plan for measured costs: within ``memory_limit`` with the
    measured activations and, if set, within ``size_limit`` for the size-based
    ``estimates`` (a cap learned from an out-of-memory failure)."""
    n, m, limit, cap = num_devices, num_microbatches, memory_limit, size_limit
    kw = {"async_optimizer": async_optimizer, "round_size": round_size}
    plan = choose_plan(measured, n, m, memory_limit=limit, **kw)
    if cap is None or max(plan.stage_memory(estimates)) <= cap:
        return plan

    def fits(p: StagePlan) -> bool:
        return max(p.stage_memory(estimates)) <= cap and (
            limit is None or max(p.stage_memory(measured)) <= limit
        )

    # the measured times with stages no larger than the cap; if that packs
    # too many activations together, a figure that bounds both at once:
    # within `limit` by max(measured, estimate * limit / cap) means within
    # `limit` measured and within `cap` estimated
    assert estimates.memory is not None and measured.memory is not None
    memories = [estimates.memory]
    if limit is not None:
        memories.append(
            [
                max(a, b * limit / cap)
                for a, b in zip(measured.memory, estimates.memory, strict=True)
            ]
        )
    for memory, bound in zip(memories, (cap, limit), strict=False):
        sized = replace(measured, memory=memory)
        try:
            plan = choose_plan(sized, n, m, memory_limit=bound, **kw)
        except PlanError:
            continue
        if fits(plan):
            return plan
    raise PlanError(
        f"no plan keeps every stage within size_limit {cap} (weights and gradients) "
        f"and within {limit} bytes with its measured activations"
    )


def stage_peaks(
    plan: StagePlan,
    estimates: LayerCosts,
    saved: Sequence[float],
    transient: Sequence[float],
    boundary: float | None = None,
) -> list[float]:
    """Predicted peak device memory of each slot of ``plan``: its weights and
    gradients (``estimates.memory``), for a stage that runs backward (a
    backward or the fused stage) everything its layers ``saved``, and the
    largest ``transient`` among its layers (one layer works at a time). A
    layered backward or fused stage keeps the inputs of its layers above the
    first instead (``boundary`` bytes each), and one layer's saved and
    transient bytes at a time (``boundary`` unknown: counted like a stage
    that is not layered, whose layers' saved bytes include what they keep of
    their inputs). A rewalked stage keeps no inputs: one layer's saved and
    transient bytes, or, while it computes a layer's input again from the
    stage input, the two values in hand (:func:`rewalk_work`)."""
    out = []
    for st, size in zip(plan.stages, plan.stage_memory(estimates), strict=True):
        a, b = st.start, st.stop
        if st.layered and st.kind != "forward" and boundary is not None:
            if st.rewalk:
                out.append(size + rewalk_work(saved[a:b], transient[a:b], boundary))
                continue
            work = max((saved[i] + transient[i] for i in range(a, b)), default=0.0)
            out.append(size + (b - a - 1) * boundary + work)
            continue
        kept = sum(saved[a:b]) if st.kind != "forward" else 0.0
        out.append(size + kept + max(transient[a:b], default=0.0))
    return out


def rewalk_work(saved: Sequence[float], transient: Sequence[float], boundary: float) -> float:
    """The activation bytes a rewalked stage of layers with these ``saved``
    and ``transient`` bytes needs at its peak: one layer's backward (what it
    saved and its transient), or a walk, the forward without autograd that
    computes a layer's input again: it runs the layers below the top one,
    each holding its input and output (two ``boundary`` values) beside its
    transient (taken for the gradient from above and the forward's own
    intermediates)."""
    work = max((a + t for a, t in zip(saved, transient, strict=True)), default=0.0)
    walked = transient[: len(transient) - 1]
    return max(work, 2 * boundary + max(walked)) if walked else work


def host_need(plan: StagePlan, boundary: float) -> float:
    """Host bytes of one micro-batch's boundary values under ``plan``, each
    ``boundary`` bytes (:meth:`~.stages.StagePlan.boundaries_per_microbatch`)."""
    return plan.boundaries_per_microbatch() * boundary


@dataclass(frozen=True)
class Predicted:
    """The plan for predicted activation memory.

    Attributes:
        plan: the plan to run (the current one when kept).
        peaks: predicted peak device memory of each of its slots.
        reason: what was decided and why, for the log.
        warning: whether the reason is worth a warning (a plan predicted not
            to fit that is kept).
        memory_limit: the bytes a stage may use from now on: the one given,
            or, with a ``device_budget``, a larger one that leaves room for
            the next stage's weights only.
        weight_cap: with such a limit, the weight bytes no stage may exceed
            (the room left for the prefetched next stage); None otherwise.
        prefetch: whether a worker uploads the next stage's weights and the
            next micro-batch's input while a stage runs; False: nothing is
            left for them (``memory_limit`` is all of the usable budget),
            they go up once the stage is done.
    """

    plan: StagePlan
    peaks: list[float]
    reason: str
    warning: bool = False
    memory_limit: float | None = None
    weight_cap: float | None = None
    prefetch: bool = True


#: fractions of the device budget kept for the next stage's prefetched weights
#: when a stage's activations need more than half of it (by default a stage
#: and its successor have half each)
_RESERVES = (1 / 4, 1 / 8, 1 / 16)
#: of the device budget, what a stage with a smaller reserve may use at most:
#: a margin for what the prediction does not model (allocator fragmentation,
#: kernel workspaces)
_USABLE = 0.9


def _layer_weights(estimates: LayerCosts) -> list[float]:
    """Each layer's weight bytes (weights and gradients where unknown)."""
    assert estimates.memory is not None
    return list(estimates.weight_bytes or estimates.memory)


def _within(
    costs: LayerCosts, limit: float, caps: Sequence[tuple[Sequence[float], float | None]]
) -> LayerCosts:
    """``costs`` with a per-layer memory figure that also bounds other sums:
    stages within ``limit`` by ``max(memory, value * limit / cap)`` keep each
    ``(values, cap)`` pair's values within its cap too (unset caps ignored)."""
    assert costs.memory is not None
    memory = list(costs.memory)
    for values, cap in caps:
        if cap is not None:
            memory = [max(a, v * limit / cap) for a, v in zip(memory, values, strict=True)]
    return replace(costs, memory=memory)


def _max_weights(plan: StagePlan, estimates: LayerCosts) -> float:
    """The largest stage's weight bytes (its weights and gradients where
    weights are unknown)."""
    weights = _layer_weights(estimates)
    return max((sum(weights[st.start : st.stop]) for st in plan.stages), default=0.0)


def _fits(
    plan: StagePlan, peaks: Sequence[float], estimates: LayerCosts, limit: float, cap: float | None
) -> bool:
    """Every slot's peak within ``limit`` and, with a ``cap``, every stage's
    weights within it."""
    return max(peaks) <= limit and (cap is None or _max_weights(plan, estimates) <= cap)


def _host_fits(plan: StagePlan, boundary: float | None, host_limit: float | None) -> bool:
    return boundary is None or host_limit is None or host_need(plan, boundary) <= host_limit


def _plan_within_host(
    estimates: LayerCosts,
    saved: Sequence[float],
    transient: Sequence[float],
    boundary: float,
    host_limit: float,
    num_devices: int,
    num_microbatches: int,
    *,
    async_optimizer: bool,
    limit: float,
    cap: float | None,
    size_limit: float | None,
) -> StagePlan | None:
    """The plan with the shortest simulated step whose stages fit ``limit``
    (weights within ``cap`` and the size cap) and whose boundary values of
    one micro-batch fit ``host_limit``, among the partitioner's frontier
    (one plan per slot count, fewer slots: fewer boundary values) of plain
    plans and of layered ones, or None.

    Layered plans are partitioned with a per-layer figure that bounds their
    peaks: a layered stage of ``k`` layers keeps ``k - 1`` layer inputs and
    one layer's saved and transient bytes, so a stage whose layers' weights
    and inputs add up to at most ``limit`` less the largest layer's working
    set plus one input fits. Its backward time is charged a second
    forward of every layer (the exact times, one layer less per stage, rank
    the candidates). Rewalked plans, whose stages keep no layer inputs,
    are partitioned with the layers' weights against ``limit`` less that
    working set, charged the same second forward (their exact extra
    forwards, quadratic in a stage's layers, rank them), are candidates
    only where no plain or layered plan fits: they need more compute than a
    layered plan of the same cuts (and upload their stage inputs again). A
    plan that fails to fit as one-layer plain stages has no layered
    alternative either: a layered stage needs at least what each of its
    layers needs alone."""
    assert estimates.memory is not None
    n, m = num_devices, num_microbatches
    weights = _layer_weights(estimates)
    caps = [(weights, cap), (list(estimates.memory), size_limit)]
    plain = replace(
        estimates,
        memory=[w + a + t for w, a, t in zip(estimates.memory, saved, transient, strict=True)],
    )
    # the same plans bounded the other way: every layer's saved bytes and the
    # largest transient of all (tighter for stages of several layers, where
    # one layer works at a time; the sum above is tighter for one-layer ones)
    kept = replace(estimates, memory=[w + a for w, a in zip(estimates.memory, saved, strict=True)])
    work = max(a + t for a, t in zip(saved, transient, strict=True))
    layered = replace(
        estimates,
        backward=[b + f for b, f in zip(estimates.backward, estimates.forward, strict=True)],
        memory=[w + boundary for w in estimates.memory],
    )
    rewalked = replace(layered, memory=list(estimates.memory))
    # a layered stage of k layers keeps k - 1 inputs: the sum of k figures
    # overcounts one, which the room gives back
    families = (
        (plain, limit, False, False),
        (kept, limit - max(transient), False, False),
        (layered, limit - work + boundary, True, False),
        (rewalked, limit - rewalk_work(saved, transient, boundary), True, True),
    )
    fitting: list[StagePlan] = []
    for costs, room, flag, rewalk in families:
        if rewalk and fitting:  # (only where no plain or layered plan fits)
            break
        if room <= 0:
            continue
        try:
            found = frontier(_within(costs, room, caps), room)
        except PlanError:
            continue
        plans = [StagePlan(q.forward, q.fused, q.backward, flag, rewalk) for q in found]
        peaks = {p: stage_peaks(p, estimates, saved, transient, boundary) for p in plans}
        fitting += [
            p
            for p in plans
            if p not in fitting
            and host_need(p, boundary) <= host_limit
            and _fits(p, peaks[p], estimates, limit, cap)
        ]
    if not fitting:
        return None
    # the formula's best few (as choose_plan does), then the simulated step
    ranked = sorted(
        fitting,
        key=lambda p: ((m * p.num_slots + n * (n - 1)) * p.max_stage_time(estimates), str(p)),
    )[:6]
    kw = {"async_optimizer": async_optimizer}
    return min(ranked, key=lambda p: simulated_period(estimates, p, n, m, **kw))


def plan_for_activations(
    current: StagePlan,
    estimates: LayerCosts,
    saved: Sequence[float],
    transient: Sequence[float],
    num_devices: int,
    num_microbatches: int,
    *,
    user_plan: bool,
    async_optimizer: bool,
    memory_limit: float | None,
    size_limit: float | None = None,
    device_budget: float | None = None,
    weight_cap: float | None = None,
    boundary: float | None = None,
    host_limit: float | None = None,
    prefetch: bool = True,
) -> Predicted:
    """Keep ``current`` if every slot's predicted peak (:func:`stage_peaks`)
    fits ``memory_limit``; otherwise, unless the plan was given, the best plan
    whose stages fit with each layer's saved and transient activations added
    up (a bound on every stage's peak).

    ``device_budget``: the device bytes a worker has in all (``memory_limit``
    is then its half: a stage and the next one, prefetched while it runs).
    Long sequences make a stage's activations large and its weights small in
    comparison, so when nothing fits half the budget a stage may take more of
    it, leaving the next stage's weights a smaller share (a quarter, an
    eighth, a sixteenth of it, then the largest layer's weights: one-layer
    stages; the plan's stages must then keep their weights within that
    share); the result says which limit and cap hold from then on. Last,
    a stage may take all of the usable budget, with nothing prefetched: the
    next stage's weights and the next micro-batch's input go up once the
    stage is done (their copies are then exposed, a small price where a
    stage computes for seconds on sequences this long).
    ``weight_cap``: the cap that holds now (from such an earlier decision),
    and ``prefetch``: whether a worker prefetches now (False from such a
    decision).

    ``boundary``: bytes of one layer-input value of a micro-batch (a causal
    LM's hidden states and positions: the same at every layer), and
    ``host_limit``: the host bytes one micro-batch's boundary values may
    take. A plan that keeps more is replaced too: by the best plan with fewer
    boundary values, whose backward stages are larger and, where their
    activations would not fit the device, layered (each recomputes and
    differentiates one layer at a time, keeping its layers' inputs;
    :class:`~.stages.StagePlan`)."""
    peaks = stage_peaks(current, estimates, saved, transient, boundary)
    host_ok = _host_fits(current, boundary, host_limit)
    if memory_limit is None or (
        _fits(current, peaks, estimates, memory_limit, weight_cap) and host_ok
    ):
        return Predicted(
            current,
            peaks,
            f"plan {current} fits the predicted activations",
            False,
            memory_limit,
            weight_cap,
            prefetch,
        )
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    label = current.stages[worst].label
    assert estimates.memory is not None
    if peaks[worst] > memory_limit or host_ok:
        why = (
            f"stage {label} of plan {current} is predicted to need {peaks[worst]:.4g} bytes "
            f"with its activations, over the {memory_limit:.4g} a stage may use"
        )
    else:
        assert boundary is not None and host_limit is not None
        why = (
            f"plan {current} keeps {current.boundaries_per_microbatch()} boundary values of "
            f"{boundary:.4g} bytes per micro-batch on the host, over the {host_limit:.4g} "
            "they may take (activation_memory)"
        )
    # every layer counted with its own transient: a bound on any stage's peak
    # (exact for one-layer stages), which the partitioner can add up
    bounded = replace(
        estimates,
        memory=[m + a + t for m, a, t in zip(estimates.memory, saved, transient, strict=True)],
    )
    splits: list[tuple[float, float | None, bool]] = [(memory_limit, weight_cap, prefetch)]
    if device_budget is not None and prefetch:
        # a share below the largest layer's weights holds no next stage; at
        # the end, as little as one does: that layer's weights; then none
        usable = _USABLE * device_budget
        one = max(_layer_weights(estimates), default=0.0)
        reserves = [r * device_budget for r in _RESERVES if r * device_budget > one] + [one]
        splits += [
            (usable - r, r, True)
            for r in reserves
            if (weight_cap is None or r < weight_cap) and usable - r > memory_limit
        ]
        if usable > memory_limit:
            splits.append((usable, None, False))
    for limit, cap, fetch in splits:
        if fetch:
            where = f"the next stage's weights need at most {cap:.4g}" if cap is not None else ""
        else:
            where = "nothing prefetched: the next stage's weights go up once a stage is done"
        where = f" with stages of up to {limit:.4g} bytes ({where})" if where else ""
        changed = (cap, fetch) != (weight_cap, prefetch)
        if changed and host_ok and _fits(current, peaks, estimates, limit, cap):
            return Predicted(current, peaks, f"{why}; kept,{where}", False, limit, cap, fetch)
        if user_plan:
            continue
        # the partitioner sees one figure per layer that keeps the stages
        # within the weight cap and the size cap learned from an out-of-memory
        # error (weights and gradients) as well
        sized = _within(
            bounded,
            limit,
            [(_layer_weights(estimates), cap), (list(estimates.memory), size_limit)],
        )
        try:
            plan: StagePlan | None = choose_plan(
                sized,
                num_devices,
                num_microbatches,
                async_optimizer=async_optimizer,
                memory_limit=limit,
            )
        except PlanError:
            plan = None
        host = ""
        if plan is None or not _host_fits(plan, boundary, host_limit):
            if plan is None or boundary is None or host_limit is None:
                continue
            # fewer boundary values: larger backward stages, layered where
            # their activations would not fit the device otherwise
            plan = _plan_within_host(
                estimates,
                saved,
                transient,
                boundary,
                host_limit,
                num_devices,
                num_microbatches,
                async_optimizer=async_optimizer,
                limit=limit,
                cap=cap,
                size_limit=size_limit,
            )
            if plan is None:
                continue
            host = (
                f" ({plan.boundaries_per_microbatch()} boundary values per micro-batch on the "
                f"host, within {host_limit:.4g} bytes"
                + (
                    "; backward stages recompute one layer at a time, each layer's input "
                    "again from the stage's"
                    if plan.rewalk
                    else "; backward stages recompute one layer at a time"
                    if plan.layered
                    else ""
                )
                + ")"
            )
        new = stage_peaks(plan, estimates, saved, transient, boundary)
        return Predicted(
            plan,
            new,
            f"{why}; re-planned to {plan}{where}{host} before the first step",
            False,
            limit,
            cap,
            fetch,
        )
    if user_plan:
        fix = "kept as given: give a plan with smaller stages or plan=None"
    else:
        fix = (
            "no plan fits: raise num_microbatches, shorten the sequences, lower tile_memory "
            "or raise device_memory_limit"
        )
        if not host_ok:
            fix += " or activation_memory (host memory)"
    return Predicted(current, peaks, f"{why}; {fix}", True, memory_limit, weight_cap, prefetch)


@dataclass(frozen=True)
class Measured:
    """What to do once per-layer costs are measured.

    Attributes:
        plan: the plan to run from now on (the current one when kept).
        changed: whether it differs from the current plan.
        reason: why, for the log.
        warning: say it as a warning (the plan may run out of memory).
    """

    plan: StagePlan
    changed: bool
    reason: str
    warning: bool = False


def after_measurement(
    current: StagePlan,
    measured: LayerCosts,
    estimates: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    *,
    user_plan: bool,
    async_optimizer: bool,
    round_size: int | None,
    memory_limit: int | None,
    size_limit: int | None,
    margin: float,
    weight_cap: float | None = None,
    boundary: float | None = None,
    host_limit: float | None = None,
) -> Measured:
    """Keep ``current`` or switch to the measured best plan: switch when the
    current plan's stages exceed ``memory_limit`` with their measured
    activations, or when the best plan's simulated step is shorter by more
    than ``margin``. A plan the user gave is never changed (only warned about).
    ``weight_cap``: no stage's weights may exceed it (the room a limit past
    half the device leaves for the next stage, :func:`plan_for_activations`);
    a best plan over it is not taken. Nor is one whose boundary values of a
    micro-batch (``boundary`` bytes each) exceed ``host_limit``; a layered
    plan (chosen for host memory, :func:`plan_for_activations`) is kept: the
    measured costs do not model its layer-by-layer backward."""
    n, m, limit = num_devices, num_microbatches, memory_limit
    if current.layered:
        # (measured memory adds up every layer's activations: not what a
        # layered stage holds, so no over-limit verdict either)
        return Measured(
            current,
            False,
            f"kept the layered plan {current} after measuring (re-partitioning from "
            "measurements does not model stages that recompute one layer at a time)",
        )
    over = None
    if limit is not None and measured.memory is not None:
        need = current.stage_memory(measured)
        worst = max(range(len(need)), key=need.__getitem__)
        if need[worst] > limit:
            over = (current.stages[worst].label, int(need[worst]))
    if user_plan:
        if over is None:
            return Measured(current, False, f"kept the given plan {current}")
        return Measured(
            current,
            False,
            f"stage {over[0]} of the given plan {current} needs about {over[1]} bytes with its "
            f"measured activations, over the device memory limit of {limit}; expect an "
            "out-of-memory error: give a plan with smaller stages or raise num_microbatches",
            warning=True,
        )
    # with a weight cap, a figure per layer that keeps the stages within it too
    sized = measured
    if weight_cap is not None and limit is not None and measured.memory is not None:
        sized = _within(measured, limit, [(_layer_weights(estimates), weight_cap)])
    try:
        best = plan_for_measured(
            sized,
            estimates,
            n,
            m,
            async_optimizer=async_optimizer,
            round_size=round_size,
            memory_limit=limit,
            size_limit=size_limit,
        )
    except PlanError as exc:
        return Measured(
            current,
            False,
            f"kept plan {current}: no plan fits the device memory limit with the measured "
            f"activations ({exc}); raise num_microbatches (smaller micro-batches) or "
            "device_memory_limit",
            warning=True,
        )
    if not _host_fits(best, boundary, host_limit):
        assert boundary is not None
        return Measured(
            current,
            False,
            f"kept plan {current} after measuring: the best plan {best} keeps "
            f"{host_need(best, boundary):.4g} bytes of boundary values per micro-batch on the "
            f"host, over the {host_limit:.4g} they may take (activation_memory)"
            + (
                ""
                if over is None
                else f"; stage {over[0]} needs about {over[1]} bytes with its "
                f"measured activations, over the limit of {limit}: expect an out-of-memory error"
            ),
            warning=over is not None,
        )
    if weight_cap is not None and _max_weights(best, estimates) > weight_cap:
        return Measured(
            current,
            False,
            f"kept plan {current} after measuring: the best plan {best} has a stage whose "
            f"weights exceed the {weight_cap:.4g} bytes left for the next stage's"
            + (
                ""
                if over is None
                else f"; stage {over[0]} needs about {over[1]} bytes with its "
                f"measured activations, over the limit of {limit}: expect an out-of-memory error"
            ),
            warning=over is not None,
        )
    kw = {"async_optimizer": async_optimizer, "round_size": round_size}
    old_t = simulated_period(measured, current, n, m, **kw)
    new_t = simulated_period(measured, best, n, m, **kw)
    if best != current and (over is not None or new_t < (1 - margin) * old_t):
        why = (
            f"stage {over[0]} needs about {over[1]} bytes with its measured activations, "
            f"over the limit of {limit}"
            if over is not None
            else f"simulated time per iteration {old_t:.4g} -> {new_t:.4g} s"
        )
        return Measured(
            best, True, f"re-partitioned from measurements: {current} -> {best} ({why})"
        )
    return Measured(
        current,
        False,
        f"kept plan {current} after measuring (best {best}, simulated time per iteration "
        f"{old_t:.4g} vs {new_t:.4g} s)",
    )


@dataclass(frozen=True)
class OutOfMemory:
    """How to re-plan after a stage ran out of device memory.

    Attributes:
        size_limit: a cap on each stage's weights and gradients (size-estimate
            bytes), or None.
        microbatches: a new micro-batch count, or None.
        change: what changes, for the warning.
        activation_scale: the factor predicted activations are to be counted
            with from now on (saved and transient bytes), or None: unchanged.
        plan: with ``activation_scale``, the plan for activations that
            large (a new engine plans it once it is told the activations).
    """

    size_limit: int | None
    microbatches: int | None
    change: str
    activation_scale: float | None = None
    plan: StagePlan | None = None


#: after an out-of-memory error, predicted activations count at least this
#: much more than before, and at most this much more in one re-plan
_SCALE_STEP = (1.25, 16.0)


def after_out_of_memory(
    estimates: LayerCosts,
    current: StagePlan,
    num_devices: int,
    failed: tuple[int, int],
    failed_stage: str,
    *,
    plan_given: bool,
    microbatches_for: Callable[[int], int],
    num_microbatches: int,
    auto_microbatches: bool,
    batch_size: int | None,
    batch_microbatches: int | None,
    predicted_peaks: Sequence[float] | None = None,
    memory_limit: float | None = None,
    prefetch: bool = True,
    activation_scale: float = 1.0,
    with_activations: Callable[[float], Predicted | None] | None = None,
) -> OutOfMemory | None:
    """What to change after stage ``failed_stage`` (layers ``failed``) ran out
    of memory, or None when nothing smaller can be tried.

    First, where the stage's activations were predicted (``predicted_peaks``:
    each slot's of ``current``, within ``memory_limit``, the bytes a stage
    may use, with activations counted ``activation_scale`` times their
    prediction),
    the prediction was short: they count larger from now on, by the
    smallest of a few steps (a twentieth more than what the stage had room
    for, its limit beyond its weights over what was predicted for its
    activations, at least a quarter more; then a quarter more each time, at
    most sixteen times in one re-plan) at which the plan for activations that
    large (``with_activations(scale)``: what :func:`plan_for_activations`
    decides for them on a new engine) fits and differs from the current
    one in its stages, the memory a stage may use or whether the next stage
    is prefetched (``prefetch``: whether it is now). A plan for activations
    goes on choosing between cut, layered and rewalked stages and how much
    of the device a stage takes, where halving the stages' weights would
    not touch what filled the device.

    Else stages at most half the failed one's size when the plan is not
    given, the stage has more than one layer and the partitioner then finds
    a different plan (``microbatches_for(limit)``: the micro-batch count it
    would use); else, with an automatic count and micro-batches of more than
    one sample (``batch_microbatches`` of a batch of ``batch_size``), twice
    the micro-batches."""
    start, stop = failed
    slots = [i for i, st in enumerate(current.stages) if st.label == failed_stage]
    if with_activations is not None and predicted_peaks and slots and memory_limit is not None:
        slot = slots[0]
        weights = current.stage_memory(estimates)[slot]
        predicted_peak = predicted_peaks[slot]
        predicted = predicted_peak - weights  # (already times activation_scale)
        low, high = _SCALE_STEP
        # at least what the stage had room for, a little more (at exactly
        # that a plain stage fits again), then larger steps up to the cap
        # while the plan stays (kept inputs of layered stages do not scale)
        step = (
            high
            if predicted <= 0
            else min(high, max(low, 1.05 * (memory_limit - weights) / predicted))
        )
        while predicted > 0:
            scale = activation_scale * step
            new = with_activations(scale)
            if new is None or new.warning:  # (no plan fits activations this large)
                break
            if (str(new.plan), new.memory_limit, new.prefetch) != (
                str(current),
                memory_limit,
                prefetch,
            ):
                return OutOfMemory(
                    None,
                    None,
                    f"activations counted {scale:.3g}x their prediction (stage {failed_stage} "
                    f"was predicted to need {predicted_peak:.4g} bytes of the {memory_limit:.4g} "
                    f"a stage may use)"
                    + ("" if new.prefetch or not prefetch else ", nothing prefetched"),
                    activation_scale=scale,
                    plan=new.plan,
                )
            if step >= high:
                break
            step = min(high, step * low)
    if not plan_given and stop - start > 1 and estimates.memory is not None:
        stage = estimates.stage_memory(start, stop)
        # never below the largest layer anywhere in the model: one layer per
        # stage must still be possible
        limit = max(int(max(estimates.memory)), int(stage // 2))
        if limit < stage:
            try:
                new_plan = partition(
                    estimates, num_devices, microbatches_for(limit), memory_limit=limit
                )
            except PlanError:
                new_plan = None
            if new_plan is not None and str(new_plan) != str(current):
                return OutOfMemory(
                    limit,
                    None,
                    f"stages of at most {limit} bytes of weights and gradients (stage "
                    f"{failed_stage} had {stage:.0f})",
                )
    if (
        auto_microbatches
        and batch_size is not None
        and batch_microbatches is not None
        and batch_microbatches < batch_size
    ):
        # more micro-batches help while this batch's are larger than one sample
        return OutOfMemory(None, 2 * num_microbatches, f"num_microbatches={2 * num_microbatches}")
    return None

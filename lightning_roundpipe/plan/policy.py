"""Plan policy: which stage plan, round size and micro-batch count to run.

:func:`~lightning_roundpipe.plan.partition` minimises a formula,
``(M*S + N(N-1)) * t_max``, exactly. The formula counts every slot as if it
took ``t_max`` and charges a fill and drain per iteration; with the
asynchronous optimizer iterations run back to back, the drain of one overlaps
the fill of the next, and slack of a short slot is absorbed by devices still
busy with earlier work, so the formula can prefer a plan that runs slower.
:func:`choose_plan` therefore takes the formula's best few plans (one per slot
count, see :func:`~lightning_roundpipe.plan.partition.frontier`) and keeps the
one whose simulated period, as the runtime would lower and run it, is
shortest.

:func:`choose_round` picks the round size: the largest round whose
stage-boundary activations fit a host-memory budget (the whole batch: each
stage's weights go up once per iteration), unless a smaller multiple of the
device count gives a clearly shorter simulated step (a heavy stage such as
the LM head then runs on several devices at once instead of taking every
micro-batch on one) and its compute still hides the weight uploads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .costs import LayerCosts, PlanError
from .partition import _check_counts, frontier
from .schedule import Placement
from .simulate import simulate, steady_async_bubble
from .stages import Stage, StagePlan

__all__ = [
    "ExposedUpload",
    "RoundChoice",
    "choose_plan",
    "choose_round",
    "exposed_uploads",
    "hides_uploads",
    "simulated_period",
]


def simulated_period(
    costs: LayerCosts,
    plan: StagePlan,
    num_devices: int,
    num_microbatches: int,
    *,
    async_optimizer: bool = True,
    round_size: int | None = None,
    comm_time: float = 0.0,
    placement: Placement = "free-first",
) -> float:
    """Simulated time per iteration, as the runtime lowers and runs it: the
    steady-state period of back-to-back iterations with the asynchronous
    optimizer, one iteration's makespan without (in the unit of ``costs``)."""
    n, m = num_devices, num_microbatches
    kw = {"round_size": round_size, "comm_time": comm_time, "placement": placement}
    if async_optimizer:
        bubble = steady_async_bubble(costs, plan, n, m, **kw)
        work = m * sum(plan.stage_times(costs))
        return work / (n * (1.0 - bubble)) if bubble < 1 else math.inf
    res = simulate(
        "roundpipe",
        costs,
        n,
        m,
        plan=plan,
        microbatches_per_round=round_size,
        comm_time=comm_time,
        placement=placement,
    )
    return res.makespan


@functools.lru_cache(maxsize=64)  # setup asks again for the same costs (micro-batch choice, engine)
def choose_plan(
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    *,
    async_optimizer: bool = True,
    memory_limit: float | None = None,
    round_size: int | None = None,
    comm_time: float = 0.0,
    candidates: int = 6,
    placement: Placement = "free-first",
) -> StagePlan:
    """The stage plan with the shortest simulated time per iteration among the
    ``candidates`` plans with the best partitioner objective, then the best
    one's stages in other orders (:func:`_arrangements`), timed, without the
    asynchronous optimizer and a fixed ``round_size``, with the round
    :func:`choose_round` would pick for each.

    Args:
        costs: per-layer costs.
        num_devices: ``N``.
        num_microbatches: ``M``.
        async_optimizer: rank by the steady-state period of back-to-back
            iterations (``True``) or by one iteration's makespan.
        memory_limit: as for :func:`~lightning_roundpipe.plan.partition`.
        round_size: ``M_R`` the plan will run with (default ``M``).
        comm_time: time of one activation hop between devices.
        candidates: how many plans to simulate (1: the formula's choice).
    """
    if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
        raise PlanError(f"candidates must be an integer >= 1, got {candidates!r}")
    _check_counts(num_devices, num_microbatches)
    n, m = num_devices, num_microbatches
    c = n * (n - 1)
    plans = frontier(costs, memory_limit)
    ranked = sorted(
        plans,
        key=lambda p: ((m * p.num_slots + c) * p.max_stage_time(costs), p.max_stage_time(costs)),
    )[:candidates]
    if len(ranked) == 1:
        return ranked[0]
    kw = {
        "async_optimizer": async_optimizer,
        "round_size": round_size,
        "comm_time": comm_time,
        "placement": placement,
    }
    best, best_t = ranked[0], simulated_period(costs, ranked[0], n, m, **kw)
    for plan in ranked[1:]:
        t = simulated_period(costs, plan, n, m, **kw)
        if t < best_t * (1 - 1e-9):
            best, best_t = plan, t

    # one iteration at a time with rounds still to choose: time each
    # arrangement with the round choose_round would pick for it
    rounds_open = not async_optimizer and round_size is None and m > n

    def step(plan: StagePlan) -> float:
        if not rounds_open:
            return simulated_period(costs, plan, n, m, **kw)
        periods: dict[int, float] = {}

        def period(g: int) -> float:
            if g not in periods:
                periods[g] = simulated_period(costs, plan, n, m, **{**kw, "round_size": g})
            return periods[g]

        return period(choose_round(m, num_devices=n, period=period).round_size)

    # the best plan's stages in other orders: the same slots and slowest
    # slot, so nothing far from the best with whole-batch rounds either
    # (which the runtime keeps where smaller ones would expose uploads). Only
    # the best plan's: each is a simulation, and the asynchronous steady
    # state of a large model takes a good part of a second
    others = _arrangements(best, costs, memory_limit)[1:]
    if others and rounds_open:
        best_t = step(best)  # (compared with its own round too)
    for plan in others:
        t = step(plan)
        if t < best_t * (1 - 1e-9):
            best, best_t = plan, t
    return best


def _arrangements(
    plan: StagePlan, costs: LayerCosts, memory_limit: float | None
) -> list[StagePlan]:
    """``plan`` and its stage counts in other orders that keep its ``t_max``
    and memory: forward stages shortest first (a shorter fill) and backward
    stages longest first (a shorter drain). The balanced cut spreads its
    lighter stages (``3,3,2,3,2``), which leaves a later stage waiting on the
    last ones of the iteration; on the paper's Qwen3-1.7B case ``...,3,3,2,2``
    meets the reference's single-iteration bubble (19.1% against 20.6%)."""
    t_max = plan.max_stage_time(costs) * (1 + 1e-9)
    out = [plan]
    for fwd in (plan.forward, tuple(sorted(plan.forward))):
        for bwd in (plan.backward, tuple(sorted(plan.backward, reverse=True))):
            q = dataclasses.replace(plan, forward=fwd, backward=bwd)
            if q in out or q.max_stage_time(costs) > t_max:
                continue
            limited = memory_limit is not None and costs.memory is not None
            if limited and max(q.stage_memory(costs)) > memory_limit:
                continue
            out.append(q)
    return out


@dataclass(frozen=True)
class RoundChoice:
    """A round size and why.

    Attributes:
        round_size: micro-batches per round.
        activation_bytes: host bytes of one round's stage-boundary activations
            (None when the size of a micro-batch's activations is unknown).
        budget: the host-memory budget it was chosen against (None: none).
        reason: one line for logs and reports.
    """

    round_size: int
    activation_bytes: int | None
    budget: int | None
    reason: str


def choose_round(
    num_microbatches: int,
    *,
    boundary_bytes: int | None = None,
    budget: int | None = None,
    num_devices: int | None = None,
    period: Callable[[int], float] | None = None,
    hidden: Callable[[int], bool] | None = None,
    gain: float = 0.01,
) -> RoundChoice:
    """The round size: the largest round whose stage-boundary activations fit
    ``budget``, or a smaller multiple of ``num_devices`` that is faster.

    Args:
        num_microbatches: ``M``.
        boundary_bytes: host bytes of one micro-batch's stage-boundary
            activations kept for the backward stages (None: unknown).
        budget: host bytes a round's activations may take (None: no limit).
        num_devices: ``N``; with ``period``, rounds of ``N, 2N, 4N, ...`` below
            the largest that fits are candidates too.
        period: simulated time per iteration for a round size.
        hidden: whether a round size's compute hides every stage's weight
            upload (None: assumed, as on CPU workers); a smaller round that
            does not is never taken.
        gain: how much shorter (a fraction) a smaller round's step must be.

    The whole batch when it fits (or nothing is known): each stage's weights
    then go up once per iteration; else the largest round that fits, at least
    one micro-batch. Then, with ``period``, the smallest step among the
    candidates, the larger round winning within ``gain`` (fewer uploads).
    """
    _check_counts(1 if num_devices is None else num_devices, num_microbatches)
    largest = _largest_round(num_microbatches, boundary_bytes, budget)
    n, mr = num_devices, largest.round_size
    if period is None or n is None or mr <= n:
        return largest
    base_t = period(mr)
    best, best_t = mr, base_t
    # N, 2N, 4N, ...: each a simulation (the asynchronous steady state of
    # a large batch takes a good fraction of a second)
    sizes = [n << k for k in range(mr.bit_length()) if n << k < mr]
    for g in reversed(sizes):
        if hidden is not None and not hidden(g):
            continue
        t = period(g)
        if t < best_t * (1 - gain):
            best, best_t = g, t
    if best == mr:
        return largest
    return RoundChoice(
        best,
        None if boundary_bytes is None else best * boundary_bytes,
        budget,
        f"{best} of {num_microbatches} micro-batches per round: a simulated step "
        f"{1 - best_t / base_t:.0%} shorter than with rounds of {mr} ({largest.reason})",
    )


def _largest_round(m: int, boundary_bytes: int | None, budget: int | None) -> RoundChoice:
    """The largest round whose activations fit ``budget`` (:func:`choose_round`)."""
    if boundary_bytes is None or budget is None:
        why = "no activation budget" if budget is None else "activation size not known yet"
        return RoundChoice(
            m,
            None if boundary_bytes is None else m * boundary_bytes,
            budget,
            f"whole batch ({why})",
        )
    if budget <= 0:
        raise PlanError(f"the activation memory budget must be > 0 bytes, got {budget}")
    need = m * boundary_bytes
    if need <= budget:
        return RoundChoice(m, need, budget, "whole batch: its activations fit the budget")
    mr = int(max(1, budget // max(1, boundary_bytes)))
    return RoundChoice(
        mr,
        int(mr * boundary_bytes),
        budget,
        f"{mr} of {m} micro-batches per round: a whole batch's activations "
        f"({need / 2**30:.2f} GiB) exceed the budget ({budget / 2**30:.2f} GiB)",
    )


@dataclass(frozen=True)
class ExposedUpload:
    """A stage whose weight upload a round's compute does not hide."""

    stage: Stage
    weight_bytes: float
    upload_time: float  # weight_bytes / bandwidth, in the unit of the costs' times
    round_time: float  # round_size x the stage's time per micro-batch

    def __str__(self) -> str:
        st = self.stage
        return (
            f"{st.label} (layers {st.start}-{st.stop - 1}): {self.weight_bytes / 2**30:.2f} GiB "
            f"of weights take {self.upload_time:.3g} to upload, its round computes "
            f"{self.round_time:.3g}"
        )


def exposed_uploads(
    plan: StagePlan | Sequence[Stage],
    costs: LayerCosts,
    round_size: int,
    bandwidth: float,
    prefetch: bool = True,
) -> list[ExposedUpload]:
    """The stages whose weight upload a round's compute does not hide: a device
    runs a stage for the ``round_size`` micro-batches of a round while the next
    stage's weights stream in, so every stage needs ``round_size * t_stage >=
    weight_bytes / bandwidth`` (stage time per micro-batch from ``costs``,
    weights from ``costs.weight_bytes``; ``bandwidth`` in bytes per unit of
    ``costs`` time). Mixture-of-Experts stages are the usual ones: all their
    experts go up, while each token computes with only a few. Without
    ``prefetch`` (long sequences: a stage has the device to itself) no
    upload overlaps compute, and every stage's is exposed."""
    if not bandwidth > 0:
        raise PlanError(f"bandwidth must be > 0, got {bandwidth!r}")
    if costs.weight_bytes is None:
        raise PlanError("exposed_uploads needs costs with weight_bytes")
    stages = plan.stages if isinstance(plan, StagePlan) else plan
    out = []
    for st in stages:
        nbytes = costs.stage_weight_bytes(st.start, st.stop)
        upload, compute = nbytes / bandwidth, round_size * st.time(costs) if prefetch else 0.0
        if compute < upload or not prefetch:
            out.append(ExposedUpload(st, nbytes, upload, compute))
    return out


def hides_uploads(
    plan: StagePlan | Sequence[Stage], costs: LayerCosts, round_size: int, bandwidth: float
) -> bool:
    """Whether a round's compute hides every stage's weight upload (see
    :func:`exposed_uploads`)."""
    return not exposed_uploads(plan, costs, round_size, bandwidth)

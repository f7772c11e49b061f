"""The automatic partitioner: the stage plan that minimises round-robin pipeline time.

For ``N`` devices and ``M`` micro-batches, a plan with ``S`` stage slots whose
slowest slot takes ``t_max`` per micro-batch keeps the devices busy for about
``(M*S + N*(N-1)) * t_max`` (work plus fill and drain). :func:`partition`
returns a plan minimising exactly that, with every stage's memory within
``memory_limit``.

Why it is exact. The slowest slot of any plan is a contiguous sum of forward
times (a forward stage) or of forward+backward times (the fused stage or a
backward stage). For a fixed bound ``T`` on the slot time, the fewest slots is
found greedily: the fused stage takes as many top layers as fit (fewer layers
below it can only need fewer stages), then forward stages are packed from the
bottom and backward stages from the top, each as full as fits. So the optimum
is ``min over candidates T of (M*S(T) + N*(N-1)) * T`` where ``S(T)`` is
non-increasing in ``T``.

Why it is fast. The research code packs greedily for every one of the
``O(L^2)`` candidates, ``O(L^3)`` in all. Here candidates are sorted once and a
divide-and-conquer over them evaluates ``S(T)`` only where the step function
can still beat the best objective found so far: an interval whose two ends
need the same number of slots cannot contain anything better than its left
end, and an interval whose lower bound ``(M*S(right) + N*(N-1)) * T(left)``
is not below the best is skipped. Each ``S(T)`` costs ``O(S log L)`` with
binary searches over prefix sums.

Task overhead. A stage pays ``costs.task_overhead`` per micro-batch on top of
its layers, so every slot time above is a sum plus that constant: the
greedy packing checks ``sum + overhead <= T`` and the candidates are the sums
plus it. With a large overhead against small layers the optimum has few
stages (each slot carries the overhead once).

Ties. Among plans with the same objective the one with the smaller ``t_max``
wins (more balanced stages, less memory per stage); for a given ``t_max`` the
greedy packing fixes the plan, so the result is deterministic.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import accumulate

from .costs import LayerCosts, PlanError
from .stages import StagePlan

__all__ = ["balanced_partition", "frontier", "partition"]


def _check_counts(num_devices: int, num_microbatches: int) -> None:
    for name, v in (("num_devices", num_devices), ("num_microbatches", num_microbatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"{name} must be an integer >= 1, got {v!r}")


def _fmt(x: float) -> str:
    if isinstance(x, int) or float(x).is_integer():
        x = int(x)
        if x >= 1 << 20:
            return f"{x} ({x / (1 << 30):.2f} GiB)"
        return str(x)
    return f"{x:.6g}"


class LayerTooLarge(PlanError):
    """One layer alone needs more than the memory limit: no stage can hold it.
    The message says what to change in the strategy's options;
    :meth:`advice` words it for another caller (the planner command line)."""

    def __init__(self, layer: int, need: float, limit: float) -> None:
        self.layer, self.need, self.limit = layer, need, limit
        super().__init__(
            self.advice(
                "Raise the memory limit (device_memory_limit) or shrink the micro-batch "
                "(raise num_microbatches)"
            )
        )

    def advice(self, fix: str) -> str:
        return (
            f"layer {self.layer} needs {_fmt(self.need)} of device memory for one micro-batch, "
            f"more than memory_limit {_fmt(self.limit)}; no stage can hold it. {fix}"
        )


def check_memory(costs: LayerCosts, memory_limit: float | None) -> None:
    """Raise :class:`LayerTooLarge` naming the first layer that alone exceeds
    ``memory_limit`` (no stage could hold it)."""
    if memory_limit is None or costs.memory is None:
        return
    if not (memory_limit > 0):
        raise PlanError(f"memory_limit must be > 0, got {memory_limit!r}")
    for i, m in enumerate(costs.memory):
        if m > memory_limit:
            raise LayerTooLarge(i, m, memory_limit)


# ---------------------------------------------------------------- greedy steps
def _furthest(p: Sequence[float], i: int, limit: float, hi: int, extra: float = 0.0) -> int:
    """Largest ``j`` in ``[i, hi]`` with ``p[j] - p[i] + extra <= limit``
    (``extra``: a stage's task overhead on top of its layers).

    The bisection finds it up to rounding of ``p[i] + limit - extra``; the two
    loops settle it with the exact expression the rest of the code uses."""
    j = max(i, bisect_right(p, p[i] + (limit - extra), i, hi + 1) - 1)
    while j > i and p[j] - p[i] + extra > limit:
        j -= 1
    while j < hi and p[j + 1] - p[i] + extra <= limit:
        j += 1
    return j


def _nearest(p: Sequence[float], i: int, limit: float, lo: int, extra: float = 0.0) -> int:
    """Smallest ``j`` in ``[lo, i]`` with ``p[i] - p[j] + extra <= limit``."""
    j = min(i, bisect_left(p, p[i] - (limit - extra), lo, i + 1))
    while j < i and p[i] - p[j] + extra > limit:
        j += 1
    while j > lo and p[i] - p[j - 1] + extra <= limit:
        j -= 1
    return j


def _memory_furthest(mem: Sequence[float], i: int, limit: float, hi: int) -> int:
    """:func:`_furthest` over a memory prefix, taking at least one layer:
    :func:`check_memory` saw each layer fit alone, and a prefix difference
    can round a layer whose figure equals the limit to just above it."""
    return max(min(i + 1, hi), _furthest(mem, i, limit, hi))


def _memory_nearest(mem: Sequence[float], i: int, limit: float, lo: int) -> int:
    """:func:`_nearest` over a memory prefix, leaving at least one layer (see
    :func:`_memory_furthest`)."""
    return min(max(i - 1, lo), _nearest(mem, i, limit, lo))


def _pack(costs: LayerCosts, t: float, limit: float | None) -> tuple[int, int, int] | None:
    """Fewest slots with every slot time ``<= t`` (and memory ``<= limit``).

    Returns ``(forward stages, first fused layer, backward stages)``, or None
    if ``t`` is below some single layer's cost."""
    pre = costs.prefix
    both, fwd, mem = pre.both, pre.fwd, pre.mem
    n, o = costs.num_layers, costs.task_overhead
    top = _nearest(both, n, t, 0, o)
    if limit is not None:
        top = max(top, _memory_nearest(mem, n, limit, 0))
    if top == n:
        return None
    nf, i = 0, 0
    while i < top:
        j = _furthest(fwd, i, t, top, o)
        if limit is not None:
            j = min(j, _memory_furthest(mem, i, limit, top))
        if j == i:
            return None
        nf += 1
        i = j
    nb, i = 0, top
    while i > 0:
        j = _nearest(both, i, t, 0, o)
        if limit is not None:
            j = max(j, _memory_nearest(mem, i, limit, 0))
        if j == i:
            return None
        nb += 1
        i = j
    return nf, top, nb


def _plan_at(costs: LayerCosts, t: float, limit: float | None) -> StagePlan:
    """The greedy plan for slot-time bound ``t`` (which must be feasible)."""
    pre = costs.prefix
    both, fwd, mem = pre.both, pre.fwd, pre.mem
    n, o = costs.num_layers, costs.task_overhead
    top = _nearest(both, n, t, 0, o)
    if limit is not None:
        top = max(top, _memory_nearest(mem, n, limit, 0))
    forward, i = [], 0
    while i < top:
        j = _furthest(fwd, i, t, top, o)
        if limit is not None:
            j = min(j, _memory_furthest(mem, i, limit, top))
        forward.append(j - i)
        i = j
    backward, i = [], top
    while i > 0:
        j = _nearest(both, i, t, 0, o)
        if limit is not None:
            j = max(j, _memory_nearest(mem, i, limit, 0))
        backward.append(i - j)
        i = j
    return StagePlan(tuple(forward), n - top, tuple(backward))


def _candidates(costs: LayerCosts) -> list[float]:
    """Sorted distinct slot times a plan's ``t_max`` can take (contiguous sums of
    forward times and of forward+backward times, each plus the task overhead),
    from the cheapest feasible one (the costliest single layer's
    forward+backward) to running everything fused."""
    pre = costs.prefix
    n, o = costs.num_layers, costs.task_overhead
    both, fwd = pre.both, pre.fwd
    # a forward stage is measured on the forward prefix sums, whose one-layer
    # difference can round a step above the forward+backward one (a layer
    # with no backward time): the cheapest feasible slot time covers both
    lo = max(max(both[i + 1] - both[i] + o, fwd[i + 1] - fwd[i] + o) for i in range(n))
    hi = both[n] - both[0] + o
    seen: set[float] = set()
    for p in (pre.fwd, both):
        for i in range(n):
            pi = p[i]
            seen.update([x - pi + o for x in p[i + 1 :]])
    return sorted(c for c in seen if lo <= c <= hi)


def _slot_counter(costs: LayerCosts, cands: list[float], limit: float | None):
    """``S(k)``: the fewest slots with slot time ``<= cands[k]``, cached."""
    slots: dict[int, int] = {}

    def s_at(k: int) -> int:
        s = slots.get(k)
        if s is None:
            packed = _pack(costs, cands[k], limit)
            if packed is None:  # (the candidates start at a feasible slot time)
                raise PlanError(f"internal: no plan with slot time {cands[k]!r}; please report")
            s = slots[k] = packed[0] + 1 + packed[2]
        return s

    return s_at


def partition(
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    memory_limit: float | None = None,
) -> StagePlan:
    """The stage plan minimising ``(M*S + N*(N-1)) * t_max`` within ``memory_limit``.

    Args:
        costs: per-layer costs (see :class:`LayerCosts`).
        num_devices: ``N``, the number of devices in the pool.
        num_microbatches: ``M``, micro-batches per iteration.
        memory_limit: device memory available to one stage for one micro-batch,
            in the unit of ``costs.memory``; ``None`` for no limit.

    Raises:
        PlanError: bad arguments, or a single layer that exceeds ``memory_limit``.
    """
    _check_counts(num_devices, num_microbatches)
    check_memory(costs, memory_limit)
    limit = memory_limit if costs.memory is not None else None
    cands = _candidates(costs)
    m, c = num_microbatches, num_devices * (num_devices - 1)

    s_at = _slot_counter(costs, cands, limit)

    best_k = 0
    best_g = (m * s_at(0) + c) * cands[0]

    def consider(k: int) -> None:
        nonlocal best_k, best_g
        g = (m * s_at(k) + c) * cands[k]
        if g < best_g or (g == best_g and cands[k] < cands[best_k]):
            best_k, best_g = k, g

    last = len(cands) - 1
    consider(last)
    # Intervals (lo, hi) of candidate indices whose interior is still open.
    stack = [(0, last)]
    while stack:
        lo, hi = stack.pop()
        if hi - lo <= 1 or s_at(lo) == s_at(hi):
            continue  # equal ends: the interior needs as many slots, at a larger t
        bound = (m * s_at(hi) + c) * cands[lo + 1]
        if bound > best_g or (bound == best_g and cands[lo + 1] >= cands[best_k]):
            continue
        mid = (lo + hi) // 2
        consider(mid)
        stack.append((mid, hi))
        stack.append((lo, mid))  # popped first: smaller t_max explored first
    return _rebalance(costs, _plan_at(costs, cands[best_k], limit), limit)


def frontier(costs: LayerCosts, memory_limit: float | None = None) -> list[StagePlan]:
    """Every plan the partitioner could pick, one per slot count: for each
    number of slots ``S`` reachable within ``memory_limit``, the balanced plan
    with the smallest ``t_max`` (most slots first). :func:`partition` picks
    one of these by its formula; :func:`~lightning_roundpipe.plan.choose_plan`
    by simulating the best few."""
    check_memory(costs, memory_limit)
    limit = memory_limit if costs.memory is not None else None
    cands = _candidates(costs)
    s_at = _slot_counter(costs, cands, limit)

    # S(t) is a non-increasing step function of the sorted candidates: bisect
    # each interval whose ends differ down to the steps
    first: dict[int, int] = {s_at(0): 0}
    stack = [(0, len(cands) - 1)]
    while stack:
        lo, hi = stack.pop()
        if s_at(lo) == s_at(hi):
            continue
        if hi - lo == 1:
            first.setdefault(s_at(hi), hi)
            continue
        mid = (lo + hi) // 2
        stack.append((mid, hi))
        stack.append((lo, mid))
    plans = [
        _rebalance(costs, _plan_at(costs, cands[k], limit), limit)
        for _, k in sorted(first.items(), key=lambda sk: sk[0])
    ]
    # keep a plan only if its slots buy a smaller t_max than every plan with
    # fewer slots (sums of equal layers differ in their last bits, which makes
    # spurious steps)
    out: list[StagePlan] = []
    for p in plans:
        t = p.max_stage_time(costs)
        if not out or t < out[-1].max_stage_time(costs) * (1 - 1e-9):
            out.append(p)
    return out[::-1]


# ------------------------------------------------------- reference (research)
def _pack_linear(costs: LayerCosts, t: float, limit: float | None) -> StagePlan | None:
    """Greedy packing by a layer-by-layer scan, the way the research code does it."""
    pre = costs.prefix
    both, fwd, mem = pre.both, pre.fwd, pre.mem
    n, o = costs.num_layers, costs.task_overhead
    lim = math.inf if limit is None else limit

    def fits(p: Sequence[float], a: int, b: int, bound: float) -> bool:
        return p[b] - p[a] + o <= bound

    def held(a: int, b: int) -> bool:
        # one layer always fits (check_memory saw it alone; a prefix difference
        # can round a layer equal to the limit just above it)
        return b - a == 1 or mem[b] - mem[a] <= lim

    top = n
    while top > 0 and fits(both, top - 1, n, t) and held(top - 1, n):
        top -= 1
    if top == n:
        return None
    forward, i = [], 0
    while i < top:
        j = i
        while j < top and fits(fwd, i, j + 1, t) and held(i, j + 1):
            j += 1
        if j == i:
            return None
        forward.append(j - i)
        i = j
    backward, i = [], top
    while i > 0:
        j = i
        while j > 0 and fits(both, j - 1, i, t) and held(j - 1, i):
            j -= 1
        if j == i:
            return None
        backward.append(i - j)
        i = j
    return StagePlan(tuple(forward), n - top, tuple(backward))


def partition_exhaustive(
    costs: LayerCosts,
    num_devices: int,
    num_microbatches: int,
    memory_limit: float | None = None,
) -> StagePlan:
    """Reference partitioner: greedy packing for every contiguous sum, ``O(L^3)``.

    Same objective and tie rule as :func:`partition`; kept as the baseline
    that tests and ``benchmarks/partition.py`` compare against."""
    _check_counts(num_devices, num_microbatches)
    check_memory(costs, memory_limit)
    limit = memory_limit if costs.memory is not None else None
    pre = costs.prefix
    n = costs.num_layers
    m, c = num_microbatches, num_devices * (num_devices - 1)
    best: tuple[float, float, StagePlan] | None = None
    for p in (pre.fwd, pre.both):
        for i in range(n):
            for j in range(i + 1, n + 1):
                t = p[j] - p[i] + costs.task_overhead
                plan = _pack_linear(costs, t, limit)
                if plan is None:
                    continue
                g = (m * plan.num_slots + c) * t
                if best is None or (g, t) < (best[0], best[1]):
                    best = (g, t, plan)
    assert best is not None
    return _rebalance(costs, best[2], limit)


# ------------------------------------------------------------ min-max cuts
def _min_max_cut(
    values: Sequence[float],
    num_parts: int,
    memory: Sequence[float] | None = None,
    limit: float | None = None,
) -> list[int]:
    """Cut ``values`` into exactly ``num_parts`` non-empty contiguous parts
    (``num_parts <= len(values)``) minimising the heaviest part, each part's
    memory within ``limit``. Layer counts, in order."""
    n = len(values)
    pre = [0.0, *accumulate(values)]
    mem = None if memory is None or limit is None else [0.0, *accumulate(memory)]
    lo = max(pre[i + 1] - pre[i] for i in range(n))

    def greedy(t: float) -> list[int]:
        out, i = [], 0
        while i < n:
            j = _furthest(pre, i, t, n)
            if mem is not None:
                j = min(j, _memory_furthest(mem, i, limit, n))
            out.append(j - i)
            i = j
        return out

    # the smallest t with at most num_parts parts, bisected down to adjacent
    # floats: feasibility changes at a part's sum (a float), so this is the
    # optimum exactly, without listing the O(n^2) contiguous sums (which made
    # the frontier cubic in the layer count)
    a, b = lo, pre[n]
    if len(greedy(a)) <= num_parts:
        b = a
    while a < b:
        mid = a + (b - a) / 2
        if mid <= a or mid >= b:
            break
        if len(greedy(mid)) <= num_parts:
            b = mid
        else:
            a = mid
    counts = greedy(b)
    while len(counts) < num_parts:  # splitting a part never makes anything worse
        k = max(range(len(counts)), key=lambda i: (counts[i], -i))
        half = counts[k] // 2
        counts[k : k + 1] = [counts[k] - half, half]
    return counts


def _rebalance(costs: LayerCosts, plan: StagePlan, limit: float | None) -> StagePlan:
    """Same stage counts and fused stage, forward and backward cuts balanced.

    Greedy packing leaves a light last stage (``9,3``); evening it out
    (``6,6``) keeps the objective and shortens the real pipeline, since a
    round-robin slot that finishes early still hands over sooner. The
    result is checked with the plan's own arithmetic and dropped if it is
    not at least as good."""
    top = plan.num_layers - plan.fused
    if top == 0:
        return plan
    f = costs.forward[:top]
    fb = [a + b for a, b in zip(costs.forward[:top], costs.backward[:top])]
    mem = None if costs.memory is None else list(costs.memory[:top])
    forward = _min_max_cut(f, len(plan.forward), mem, limit)
    backward = _min_max_cut(fb[::-1], len(plan.backward), None if mem is None else mem[::-1], limit)
    t_max = plan.max_stage_time(costs)
    # sums of the same numbers in another order differ in the last bits: a cut
    # is no worse when it is within rounding of the greedy plan's t_max
    tol = t_max * 1e-9

    def ok(p: StagePlan) -> bool:
        # (a cut on prefix sums taken the other way round can round one part
        # over the memory limit into two: as many slots, or the objective grows)
        same = p.num_slots == plan.num_slots
        fits = limit is None or max(p.stage_memory(costs)) <= limit
        return same and fits and p.max_stage_time(costs) <= t_max + tol

    fwd = (
        tuple(forward) if ok(StagePlan(tuple(forward), plan.fused, plan.backward)) else plan.forward
    )
    bwd = tuple(backward) if ok(StagePlan(fwd, plan.fused, tuple(backward))) else plan.backward
    return StagePlan(fwd, plan.fused, bwd)


def balanced_partition(weights: Sequence[float], num_parts: int) -> list[int]:
    """Cut ``weights`` into exactly ``num_parts`` contiguous parts minimising the
    heaviest part; returns the layer count of each part.

    Used for the stage-bound baselines (GPipe, 1F1B, looped schedules). When
    there are more parts than layers the surplus parts hold zero layers."""
    if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
        raise PlanError(f"num_parts must be an integer >= 1, got {num_parts!r}")
    n = len(weights)
    counts = _min_max_cut(weights, min(num_parts, n)) if n else []
    return counts + [0] * (num_parts - len(counts))

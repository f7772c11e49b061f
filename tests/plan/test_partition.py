"""The partitioner is exactly optimal (against brute force), deterministic and
agrees with the O(L^3) reference on larger inputs."""

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_roundpipe.plan import (
    LayerCosts,
    PlanError,
    StagePlan,
    balanced_partition,
    frontier,
    partition,
    partition_exhaustive,
)


def compositions(n):
    """All ordered ways to write n as a sum of positive integers."""
    if n == 0:
        yield ()
        return
    for cuts in itertools.product((False, True), repeat=n - 1):
        out, run = [], 1
        for cut in cuts:
            if cut:
                out.append(run)
                run = 1
            else:
                run += 1
        out.append(run)
        yield tuple(out)


def all_plans(num_layers):
    for fused in range(1, num_layers + 1):
        below = num_layers - fused
        backs = list(compositions(below))
        for fwd in compositions(below):
            for bwd in backs:
                yield StagePlan(fwd, fused, bwd)


def brute_force(costs, n, m, limit):
    """(best objective, smallest t_max among plans with that objective)."""
    best = None
    for plan in all_plans(costs.num_layers):
        if limit is not None and max(plan.stage_memory(costs)) > limit:
            continue
        key = (plan.objective(costs, n, m), plan.max_stage_time(costs))
        if best is None or key < best:
            best = key
    return best


def test_brute_force_enumerates_every_plan():
    assert len(list(compositions(4))) == 8
    # sum over fused of (2^(below-1))^2, with one plan when nothing is below
    assert len(list(all_plans(4))) == 1 + 1 + 4 + 16


costs_strategy = st.integers(1, 7).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 9), min_size=n, max_size=n),
        st.lists(st.integers(0, 9), min_size=n, max_size=n),
        st.lists(st.integers(1, 6), min_size=n, max_size=n),
    )
)


@settings(max_examples=250, deadline=None)
@given(
    data=costs_strategy,
    n=st.integers(1, 5),
    m=st.integers(1, 9),
    use_limit=st.booleans(),
    extra=st.integers(0, 8),
    overhead=st.sampled_from([0, 0, 1, 3, 20]),
)
def test_partition_is_optimal_integer_costs(data, n, m, use_limit, extra, overhead):
    fwd, bwd, mem = data
    costs = LayerCosts(fwd, bwd, memory=mem, task_overhead=overhead)
    limit = max(mem) + extra if use_limit else None
    plan = partition(costs, n, m, memory_limit=limit)
    plan.validate(costs.num_layers)
    if limit is not None:
        assert max(plan.stage_memory(costs)) <= limit
    best_obj, best_t = brute_force(costs, n, m, limit)
    assert plan.objective(costs, n, m) == best_obj
    assert plan.max_stage_time(costs) == best_t  # ties go to the smaller t_max
    assert partition(costs, n, m, memory_limit=limit) == plan  # deterministic


@settings(max_examples=150, deadline=None)
@given(
    n_layers=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 8),
    m=st.integers(1, 16),
    overhead=st.sampled_from([0.0, 0.1, 0.7, 9.0]),
)
def test_partition_is_optimal_float_costs(n_layers, seed, n, m, overhead):
    rng = random.Random(seed)
    fwd = [rng.uniform(0.01, 3.0) for _ in range(n_layers)]
    bwd = [rng.uniform(0.0, 6.0) for _ in range(n_layers)]
    costs = LayerCosts(fwd, bwd, task_overhead=overhead * rng.random())
    plan = partition(costs, n, m)
    best_obj, best_t = brute_force(costs, n, m, None)
    assert plan.objective(costs, n, m) == best_obj
    assert plan.max_stage_time(costs) == best_t


@pytest.mark.parametrize("num_layers", [12, 29, 40])
@pytest.mark.parametrize("seed", range(4))
def test_fast_partition_matches_exhaustive_reference(num_layers, seed):
    rng = random.Random(seed * 100 + num_layers)
    fwd = [rng.uniform(0.5, 1.5) for _ in range(num_layers)]
    bwd = [2 * f * rng.uniform(0.8, 1.2) for f in fwd]
    fwd[-1] *= 3
    bwd[-1] *= 3
    mem = [rng.randint(1, 10) for _ in range(num_layers)]
    for n, m, limit in [(1, 4, None), (4, 8, None), (8, 16, 25), (3, 7, 12)]:
        for overhead in (0.0, 0.37, 4.0):
            costs = LayerCosts(fwd, bwd, memory=mem, task_overhead=overhead)
            fast = partition(costs, n, m, memory_limit=limit)
            ref = partition_exhaustive(costs, n, m, memory_limit=limit)
            assert fast.objective(costs, n, m) == ref.objective(costs, n, m)
            assert fast == ref


def test_rebalancing_never_adds_a_slot():
    """The backward cuts are balanced on prefix sums taken from the top: one
    part's memory can round over the limit there (10.3 - 6.3 > 4) and split,
    which gave 8 slots where the optimum has 7."""
    costs = LayerCosts(
        [1] * 6, [2] * 6, memory=[2, 2, 0.3, 3, 3, 3], task_overhead=10
    )  # fmt: skip
    plan = partition(costs, 2, 4, memory_limit=4)
    assert str(plan) == "2,2,1|1|1,2,2" and plan.objective(costs, 2, 4) == 480
    assert brute_force(costs, 2, 4, 4) == (480, plan.max_stage_time(costs))


def test_task_overhead_makes_fewer_stages():
    # 64 small layers: without overhead the best plan has one-layer backward
    # stages; when each stage pays a host overhead of a few layers' worth, the
    # optimum has far fewer slots, and each slot's time carries the overhead
    fwd, bwd = [1.0] * 64, [2.0] * 64
    bare = partition(LayerCosts(fwd, bwd), 4, 8)
    assert bare.num_slots == 85  # (3-layer forward stages, one-layer backward ones)
    costs = LayerCosts(fwd, bwd, task_overhead=3.0)
    plan = partition(costs, 4, 8)
    assert str(plan) == "48|16|16,16,16"
    assert plan.max_stage_time(costs) == 16 * 3.0 + 3.0
    # the objective counts the overhead: the plan chosen without it is worse with it
    assert plan.objective(costs, 4, 8) < bare.objective(costs, 4, 8)
    assert partition_exhaustive(costs, 4, 8) == plan


def test_single_device_fuses_everything():
    costs = LayerCosts.uniform(10)
    assert str(partition(costs, 1, 8)) == "|10|"


def test_memory_limit_shapes_the_plan():
    costs = LayerCosts.uniform(8, memory=2)
    plan = partition(costs, 2, 4, memory_limit=4)
    assert all(mem <= 4 for mem in plan.stage_memory(costs))
    assert plan.fused <= 2


def test_a_layer_whose_memory_is_the_limit_fits_whatever_the_prefix_sums_round_to():
    # 0.1 + 0.2 - 0.1 is 0.20000000000000004: read from the prefix sums, the
    # second layer is just over a limit it equals (stage weights capped at
    # exactly the largest layer's make such figures). Partitioning used to
    # fail an assertion here (or loop forever while rebalancing)
    costs = LayerCosts([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], memory=[0.1, 0.2, 0.1])
    assert str(partition(costs, 2, 4, memory_limit=0.2)) == "1,1|1|1,1"
    assert [str(p) for p in frontier(costs, 0.2)] == ["1,1|1|1,1"]
    rng = random.Random(1)
    for _ in range(100):
        n = rng.randint(2, 40)
        memory = [rng.uniform(0.1, 1.0) * 1e9 for _ in range(n)]
        costs = LayerCosts(
            [rng.uniform(1, 2) for _ in range(n)], [rng.uniform(2, 4) for _ in range(n)], memory
        )
        limit = max(memory)
        for plan in (partition(costs, 2, 4, memory_limit=limit), *frontier(costs, limit)):
            assert max(plan.stage_memory(costs)) <= limit * (1 + 1e-12)


def test_the_reference_partitioner_takes_a_layer_equal_to_the_limit_too():
    costs = LayerCosts([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], memory=[0.1, 0.2, 0.1])
    # (it failed an assertion: its scan had no one-layer rule)
    assert str(partition_exhaustive(costs, 2, 4, memory_limit=0.2)) == "1,1|1|1,1"


def test_layers_without_backward_time_partition_optimally():
    """A forward stage is measured on the forward prefix sums, whose one-layer
    difference rounds above the forward+backward one when a layer has no
    backward time: the cheapest slot time was taken from the latter alone
    and the partitioner failed an assertion."""
    costs = LayerCosts([0.1, 0.2, 0.0], [0.1, 0.0, 0.1])
    assert costs.prefix.fwd[2] - costs.prefix.fwd[1] > costs.prefix.both[2] - costs.prefix.both[1]
    rng = random.Random(3)
    cases = [(costs, 2, 4)]
    for _ in range(300):
        layers = rng.randint(1, 6)
        f = [rng.choice([0.0, rng.uniform(0.1, 3)]) for _ in range(layers)]
        b = [rng.choice([0.0, rng.uniform(0.1, 6)]) for _ in range(layers)]
        cases.append((LayerCosts(f, b), rng.randint(1, 4), rng.randint(1, 8)))
    for c, n, m in cases:
        plan = partition(c, n, m)
        key = (plan.objective(c, n, m), plan.max_stage_time(c))
        best = brute_force(c, n, m, None)
        assert key[0] <= best[0] * (1 + 1e-9) + 1e-12
        frontier(c)


def test_figure1_case_balances_forward_stages():
    costs = LayerCosts.uniform(13, head_forward=3, head_backward=6)
    plan = partition(costs, 4, 8)
    # the LM head alone is the slowest slot (3 + 6); everything else packs to <= 9
    assert str(plan) == "6,6|1|3,3,3,3"
    assert plan.max_stage_time(costs) == 9


def test_layer_that_cannot_fit_is_named():
    costs = LayerCosts([1, 1, 1], [2, 2, 2], memory=[4, 30, 4])
    with pytest.raises(
        PlanError,
        match=r"layer 1 needs 30 of device memory for one micro-batch, more than memory_limit "
        r"24; no stage can hold it\. Raise the memory limit \(device_memory_limit\)",
    ):
        partition(costs, 2, 4, memory_limit=24)


def test_byte_sizes_are_shown_in_gib():
    gib = 1 << 30
    costs = LayerCosts([1, 1], [1, 1], memory=[2 * gib, 30 * gib])
    with pytest.raises(PlanError, match=r"layer 1 needs 32212254720 \(30\.00 GiB\)"):
        partition(costs, 1, 1, memory_limit=24 * gib)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_devices": 0, "num_microbatches": 4}, "num_devices must be an integer >= 1, got 0"),
        ({"num_devices": 2, "num_microbatches": 1.5}, "num_microbatches must be an integer"),
        ({"num_devices": 2, "num_microbatches": 4, "memory_limit": 0}, "memory_limit must be > 0"),
    ],
)
def test_argument_errors(kwargs, match):
    with pytest.raises(PlanError, match=match):
        partition(LayerCosts([1], [1], memory=[1]), **kwargs)


@pytest.mark.parametrize(
    ("weights", "parts", "expected"),
    [
        ([1, 1, 1, 1], 2, [2, 2]),
        ([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3], 4, [4, 4, 4, 1]),
        ([5, 1, 1, 1], 2, [1, 3]),
        ([1, 1], 4, [1, 1, 0, 0]),
        ([1, 1, 1, 1], 3, [1, 1, 2]),
    ],
)
def test_balanced_partition(weights, parts, expected):
    assert balanced_partition(weights, parts) == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=8), st.integers(1, 6))
def test_balanced_partition_is_min_max(weights, parts):
    counts = balanced_partition(weights, parts)
    assert len(counts) == parts and sum(counts) == len(weights)

    def heaviest(cs):
        pos, worst = 0, 0
        for c in cs:
            worst = max(worst, sum(weights[pos : pos + c]))
            pos += c
        return worst

    best = min(
        heaviest(cs)
        for k in range(1, min(parts, len(weights)) + 1)
        for cs in compositions(len(weights))
        if len(cs) == k
    )
    assert heaviest(counts) == best

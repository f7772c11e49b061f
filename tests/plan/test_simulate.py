import itertools
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_roundpipe.plan import (
    SCHEDULES,
    Copies,
    LayerCosts,
    PlanError,
    StagePlan,
    choose_microbatches,
    lower,
    partition,
    simulate,
)

PAPER_CASES = (
    Path(__file__).resolve().parents[3] / "shared" / "reference" / "paper_bubble_cases.json"
)


def balanced_roundpipe(n_blocks):
    """Blocks with f=1, b=2 and a plan whose every slot takes 3: forward stages
    of 3 layers, backward stages of 1 layer, a one-layer fused stage."""
    costs = LayerCosts.uniform(3 * n_blocks + 1)
    plan = StagePlan((3,) * n_blocks, 1, (1,) * (3 * n_blocks))
    assert set(plan.stage_times(costs)) == {3}
    return costs, plan


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_roundpipe_bubble_formula(n, rounds):
    """Rounds of N micro-batches: the textbook round-robin bubble."""
    costs, plan = balanced_roundpipe(4)
    m, s = n * rounds, plan.num_slots
    res = simulate(
        "roundpipe", costs, n, m, plan=plan, microbatches_per_round=n, placement="rotate"
    )
    assert res.bubble_ratio == pytest.approx(n * (n - 1) / (m * s + n * (n - 1)))
    # starting each round on the device free first is never worse
    free = simulate("roundpipe", costs, n, m, plan=plan, microbatches_per_round=n)
    assert free.makespan <= res.makespan + 1e-9
    # (a backward stage recomputes as soon as its input is there and then waits
    # for its gradient, so part of the idle time sits between operations)
    assert res.bubble_ratio == pytest.approx(res.fill_ratio + res.drain_ratio + res.steady_ratio)
    assert res.makespan == pytest.approx((m * s + n * (n - 1)) * 3 / n)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_roundpipe_async_overlaps_fill_and_drain(n):
    costs, plan = balanced_roundpipe(4)
    res = simulate("roundpipe", costs, n, 2 * n, plan=plan, async_optimizer=True)
    assert res.bubble_ratio > 0.0
    assert res.async_bubble_ratio == pytest.approx(0.0, abs=1e-3)
    sync = simulate("roundpipe", costs, n, 2 * n, plan=plan)
    assert sync.async_bubble_ratio is None


def test_sync_iterations_flush_and_async_iterations_overlap():
    costs, plan = balanced_roundpipe(2)
    one = simulate("roundpipe", costs, 4, 4, plan=plan)
    sync3 = simulate("roundpipe", costs, 4, 4, plan=plan, iterations=3)
    async3 = simulate("roundpipe", costs, 4, 4, plan=plan, iterations=3, async_optimizer=True)
    assert sync3.makespan == pytest.approx(3 * one.makespan)
    assert async3.makespan < sync3.makespan
    assert {s.iteration for s in async3.timeline} == {0, 1, 2}


BASELINE_CASES = [
    (name, v, n, m)
    for name, v in [
        ("gpipe", 1),
        ("1f1b", 1),
        ("interleaved-1f1b", 2),
        ("interleaved-1f1b", 3),
        ("looped-bfs", 2),
        ("looped-bfs", 3),
    ]
    for n in (2, 3, 4)
    for m in (4, 8, 12)
    if name != "interleaved-1f1b" or m % n == 0  # Megatron's interleaving needs N | M
]


@pytest.mark.parametrize(("name", "v", "n", "m"), BASELINE_CASES)
def test_baselines_match_textbook_bubbles(name, v, n, m):
    # one layer per stage, balanced: the head is not recomputed, so its
    # backward alone (3) takes what a block's recompute and backward take
    costs = LayerCosts.uniform(v * n, head_backward=3.0)
    res = simulate(name, costs, n, m, stages=[1] * (v * n))
    # (N-1)/(v*M + N-1) == N(N-1)/(S*M + N(N-1)) with S = v*N stages
    assert res.bubble_ratio == pytest.approx((n - 1) / (v * m + n - 1))


def test_roundpipe_beats_looped_bfs_with_a_heavy_lm_head():
    costs = LayerCosts.uniform(13, head_forward=3, head_backward=6)
    for n, m in [(4, 8), (4, 16), (8, 16)]:
        rp = simulate("roundpipe", costs, n, m)
        bfs = simulate("looped-bfs", costs, n, m)
        assert rp.makespan < bfs.makespan
        # (4 devices, 8 micro-batches: RoundPipe's plan, 10|3|5,5, skips more
        # recompute in its fused stage, so it does less work in less time at a
        # slightly higher idle fraction: 26.7% against 25.0%)
        if (n, m) != (4, 8):
            assert rp.bubble_ratio < bfs.bubble_ratio


def test_work_is_conserved_and_devices_never_overlap():
    costs = LayerCosts.uniform(13, head_forward=3, head_backward=6)
    n, m = 4, 8
    per_mb = sum(costs.forward) * 2 + sum(costs.backward)
    for name in SCHEDULES:
        res = simulate(name, costs, n, m, comm_time=0.5)
        if name == "roundpipe":
            fused = res.plan.fused_stage
            expected = m * (per_mb - costs.forward_time(*fused))  # the fused stage skips recompute
        else:  # the head is not recomputed either (as in the paper's simulator)
            expected = m * (per_mb - costs.forward[-1])
        assert res.work == pytest.approx(expected)
        for d in range(n):
            segs = res.device_timeline(d)
            for a, b in itertools.pairwise(segs):
                assert b.start >= a.end - 1e-9
        assert res.bubble_ratio == pytest.approx(
            res.fill_ratio + res.drain_ratio + res.steady_ratio
        )


def test_baselines_reproduce_the_papers_simulator():
    """The reference's 20 baseline cases (GPipe, 1F1B, Interleaved 1F1B,
    Looped BFS on the paper's five models, its stage partitions): same
    makespan and bubble split. Like for like with RoundPipe: the head's
    forward is not recomputed in the backward (as in RoundPipe's fused stage);
    recomputing it would add ``M`` head forwards to a heavy-head last stage."""
    if not PAPER_CASES.exists():
        pytest.skip("the paper's reference cases are not beside the checkout")
    cases = [c for c in json.loads(PAPER_CASES.read_text()) if c["scheduler"] != "roundpipe"]
    assert len(cases) == 20
    for c in cases:
        k = c["num_layers"]
        costs = LayerCosts(
            [c["fwd_time_per_layer"]] * k + [c["lmhead_fwd_time"]],
            [c["bwd_time_per_layer"]] * k + [c["lmhead_bwd_time"]],
        )
        stages = [int(x) for x in c["stage_partition"].split(",")]
        stages[-1] += 1  # (the reference counts blocks only; the head is ours)
        n, m, comm = c["num_gpus"], c["num_microbatches"], c["comm_time"]
        res = simulate(c["scheduler"], costs, n, m, comm_time=comm, stages=stages)
        ref, what = c["result"], (c["model"], c["scheduler"])
        assert res.makespan == pytest.approx(ref["makespan"], abs=1e-3), what
        assert res.bubble_ratio == pytest.approx(ref["bubble_ratio"], abs=1e-5), what
        assert res.fill_ratio == pytest.approx(ref["fill_bubble_ratio"], abs=1e-5), what
        assert res.drain_ratio == pytest.approx(ref["drain_bubble_ratio"], abs=1e-5), what
    # Qwen3-1.7B 1F1B: recomputing the head would cost 16 head forwards more
    c = cases[0]
    assert (c["model"], c["scheduler"]) == ("Qwen3-1.7B", "1f1b")
    assert c["result"]["makespan"] == pytest.approx(2854.722)


def test_task_overhead_is_paid_once_per_stage_and_microbatch():
    """Every schedule's work grows by the overhead once per stage operation
    and micro-batch (a RoundPipe backward stage's recompute and backward are
    one task), and a one-device plan runs its stages back to back."""
    bare = LayerCosts.uniform(13, head_forward=3, head_backward=6)
    o = 0.25
    costs = LayerCosts(bare.forward, bare.backward, task_overhead=o)
    n, m = 4, 8
    for name in SCHEDULES:
        res = simulate(name, costs, n, m)
        ref = simulate(name, bare, n, m, plan=res.plan) if name == "roundpipe" else None
        ref = ref or simulate(name, bare, n, m)
        ops = m * (res.plan.num_slots if name == "roundpipe" else 2 * len(ref.stages))
        assert res.work == pytest.approx(ref.work + ops * o), name
    # an empty stage (more stages than layers) has no operation to pay for
    two = LayerCosts([1.0, 1.0], [2.0, 2.0], task_overhead=o)
    sparse = simulate("gpipe", two, 4, 4, stages=[1, 1, 0, 0])
    bare_sparse = simulate("gpipe", replace(two, task_overhead=0.0), 4, 4, stages=[1, 1, 0, 0])
    assert sparse.work == pytest.approx(bare_sparse.work + 4 * 2 * 2 * o)
    one = simulate("roundpipe", costs, 1, m, plan="6,6|1|6,6")
    assert one.makespan == pytest.approx(
        simulate("roundpipe", bare, 1, m, plan="6,6|1|6,6").makespan + 5 * m * o
    )


def test_roundpipe_respects_dependencies_and_comm_time():
    costs = LayerCosts.uniform(10, head_forward=2, head_backward=4)
    n, m, comm = 3, 6, 0.7
    res = simulate("roundpipe", costs, n, m, comm_time=comm)
    plan = res.plan
    seg = {(s.stage, s.kind, s.microbatch): s for s in res.timeline}
    labels = [s.label for s in plan.stages]
    forward = [s.label for s in plan.stages if s.kind == "forward"]

    def arrives(producer, consumer):
        return producer.end + (comm if producer.device != consumer.device else 0.0)

    for mb in range(m):
        for a, b in itertools.pairwise([*forward, labels[len(forward)]]):
            first = seg.get((b, "F", mb))
            assert first.start >= arrives(seg[(a, "F", mb)], first) - 1e-9
        # a backward stage's backward waits for the gradient from above; its
        # recompute only for its saved input
        for i in range(len(forward) + 1, len(labels)):
            above = seg[(labels[i - 1], "B", mb)]
            back = seg[(labels[i], "B", mb)]
            assert back.start >= arrives(above, back) - 1e-9
            assert seg[(labels[i], "R", mb)].end <= back.start + 1e-9
    # devices follow the lowered schedule
    sched = lower(plan, n, m, placement="rotate")
    assert {t.stage for t in sched.tasks} == set(labels)
    for t in res_tasks(res):
        assert t in {(x.stage, x.device) for x in res.timeline}


def res_tasks(res):
    return {(s.stage, s.device) for s in res.timeline}


def test_free_first_placement_against_a_fixed_rotation():
    """Each round on the device predicted free first (the reference's rule)
    against continuing a fixed rotation. On the paper's models (8 GPUs, 16
    micro-batches, their plans) the two place every round alike; with rounds
    smaller than a batch and uneven slots, the device free first can be another
    one, and then waits less (pinned case: 23% idle instead of 34%)."""
    from test_policy import paper_cases

    from lightning_roundpipe.plan.simulate import steady_async_bubble

    for c, costs, plan in paper_cases():
        kw = {"comm_time": c["comm_time"], "iterations": 8}
        free = steady_async_bubble(costs, plan, 8, 16, placement="free-first", **kw)
        rot = steady_async_bubble(costs, plan, 8, 16, placement="rotate", **kw)
        assert free <= rot + 1e-9, c["model"]
    costs = LayerCosts([1, 0.2, 1, 1, 1, 5], [2, 0.2, 1, 2, 1, 10])
    plan = StagePlan.parse("5|1|5")
    kw = {"round_size": 2, "iterations": 10}
    free = steady_async_bubble(costs, plan, 4, 4, placement="free-first", **kw)
    rot = steady_async_bubble(costs, plan, 4, 4, placement="rotate", **kw)
    assert free == pytest.approx(0.2339, abs=1e-3) and rot == pytest.approx(0.3358, abs=1e-3)


def test_comm_time_slows_every_multi_device_schedule():
    costs = LayerCosts.uniform(16)
    for name in SCHEDULES:
        kw = {"microbatches_per_round": 4} if name == "roundpipe" else {}
        fast = simulate(name, costs, 4, 8, **kw)
        slow = simulate(name, costs, 4, 8, comm_time=0.5, **kw)
        assert slow.makespan > fast.makespan, name
    # one round per batch (the plan chosen for each): hops never help
    fast = simulate("roundpipe", costs, 4, 8)
    assert simulate("roundpipe", costs, 4, 8, comm_time=0.5).makespan >= fast.makespan


def test_single_device_has_no_bubble():
    costs = LayerCosts.uniform(6)
    for name in ("roundpipe", "gpipe", "1f1b"):
        assert simulate(name, costs, 1, 3, comm_time=5.0).bubble_ratio == pytest.approx(0.0)


def test_zero_layer_stage_is_allowed_for_baselines():
    costs = LayerCosts.uniform(3)
    res = simulate("looped-bfs", costs, 2, 4, stages=[1, 1, 1, 0])
    assert res.stages == (1, 1, 1, 0)
    assert not [s for s in res.timeline if s.stage == "S3"]


def test_default_baseline_stages_are_balanced():
    costs = LayerCosts.uniform(13, head_forward=3, head_backward=6)
    assert simulate("gpipe", costs, 4, 8).stages == (4, 4, 4, 1)
    assert len(simulate("looped-bfs", costs, 4, 8, stages_per_device=3).stages) == 12


def test_plan_as_text_and_the_runtimes_plan_by_default():
    from lightning_roundpipe.plan import choose_plan

    costs = LayerCosts.uniform(13, head_forward=3, head_backward=6)
    res = simulate("roundpipe", costs, 4, 8, plan="6,6|1|3,3,3,3")
    assert res.plan == StagePlan.parse("6,6|1|3,3,3,3") == partition(costs, 4, 8)
    chosen = simulate("roundpipe", costs, 4, 8).plan
    assert chosen == choose_plan(costs, 4, 8, async_optimizer=False)
    assert simulate("roundpipe", costs, 4, 8, plan=chosen).makespan <= res.makespan


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("zero-bubble",), {}, "unknown schedule 'zero-bubble'; choose one of roundpipe"),
        (("gpipe",), {"stages": [3, 3, 2]}, "gpipe binds one stage to each device: got 3 stages"),
        (("looped-bfs",), {"stages": [2, 2, 2, 1, 1]}, r"needs a multiple of num_devices \(4\)"),
        (("looped-bfs",), {"stages": [2, 2, 2, 1]}, r"hold 7 layers but the model has 8"),
        (
            ("interleaved-1f1b",),
            {"num_microbatches": 6},
            r"needs num_microbatches \(6\) to be a multiple of num_devices \(4\)",
        ),
        (("roundpipe",), {"stages": [2, 2, 2, 2]}, "stages= is for the stage-bound baselines"),
        (("gpipe",), {"plan": "7|1|7"}, "plan= is for RoundPipe"),
        (("roundpipe",), {"plan": "3|1|3"}, "covers 4 layers"),
        (("roundpipe",), {"comm_time": -1.0}, "comm_time must be finite and >= 0"),
        (("roundpipe",), {"comm_time": float("inf")}, "comm_time must be finite and >= 0"),
        (("roundpipe",), {"num_microbatches": 0}, r"num_microbatches must be an integer >= 1"),
        (("gpipe",), {"iterations": 2}, "iterations must be 1"),
    ],
)
def test_errors(args, kwargs, match):
    params = {"num_devices": 4, "num_microbatches": 8}
    params.update(kwargs)
    with pytest.raises(PlanError, match=match):
        simulate(*args, LayerCosts.uniform(8), **params)


@settings(max_examples=40, deadline=None)
@given(
    n_layers=st.integers(2, 14),
    n=st.integers(1, 4),
    rounds=st.integers(1, 3),
    seed=st.integers(0, 10_000),
)
def test_roundpipe_never_worse_than_its_model(n_layers, n, rounds, seed):
    """The simulated makespan of the partitioner's plan in rounds of N never
    exceeds the (M*S + N(N-1)) * t_max / N that the partitioner optimises (no
    comm), with a fixed rotation or with each round on the device free first."""
    rng = random.Random(seed)
    fwd = [rng.uniform(0.2, 2.0) for _ in range(n_layers)]
    bwd = [2 * f for f in fwd]
    costs = LayerCosts(fwd, bwd)
    m = n * rounds
    for placement in ("rotate", "free-first"):
        res = simulate("roundpipe", costs, n, m, microbatches_per_round=n, placement=placement)
        assert res.makespan <= res.plan.objective(costs, n, m) / n + 1e-9


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("async_optimizer", [False, True])
def test_choose_microbatches_takes_the_fewest_below_the_bubble_target(n, async_optimizer):
    costs = LayerCosts.uniform(13, head_forward=3.0, head_backward=6.0)
    m = choose_microbatches(costs, n, async_optimizer=async_optimizer, target_bubble=0.05)
    candidates = [k * n for k in (1, 2, 4, 8)]
    assert m in candidates

    def bubble(k):
        res = simulate("roundpipe", costs, n, k, async_optimizer=async_optimizer)
        return res.async_bubble_ratio if async_optimizer else res.bubble_ratio

    below = [k for k in candidates if bubble(k) <= 0.05]
    if below:
        assert m == below[0]  # the fewest (largest micro-batches) that meet the target
    else:  # within a tenth of the smallest bubble, the fewest micro-batches
        assert 0.9 * bubble(m) <= min(bubble(k) for k in candidates)
    if n == 1:
        assert m == 1  # one device has no bubble at all


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_a_bubble_more_microbatches_hardly_shrink_keeps_the_fewest(async_optimizer):
    """A head 200 times a block: 48% of bubble with 2 micro-batches, 47% with
    16. "auto" took 16 (8N) micro-batches of an eighth the size for that."""
    costs = LayerCosts([1.0] * 9 + [200.0], [2.0] * 9 + [400.0])
    assert choose_microbatches(costs, 2, async_optimizer=async_optimizer) == 2


def test_choose_microbatches_grows_with_devices_without_the_async_optimizer():
    costs = LayerCosts.uniform(24)
    ms = [choose_microbatches(costs, n, async_optimizer=False) for n in (2, 4, 8)]
    assert ms == sorted(ms) and ms[-1] > 8
    # a looser target accepts fewer, larger micro-batches
    assert choose_microbatches(costs, 4, async_optimizer=False, target_bubble=0.5) == 4
    with pytest.raises(PlanError, match="target_bubble must be in"):
        choose_microbatches(costs, 4, async_optimizer=False, target_bubble=1.0)


def test_exposed_copies_lengthen_the_timeline_by_what_devices_wait_for():
    """Copies: with prefetching only a backward stage's gradient from above
    (uploaded during its recompute) and a rewalked stage's uploads of its
    input again can make a device wait; with nothing prefetched also each
    task's weights (from when its device is free) and each micro-batch's
    input (token ids, the first layer's input, count as nothing). On one
    device every wait adds to the makespan."""
    costs = LayerCosts([1.0] * 3, [2.0] * 3, memory=[10.0] * 3, weight_bytes=[10.0] * 3)
    hidden, alone = Copies(10, 5), Copies(10, 5, prefetch=False)  # a value: 0.5
    slow = Copies(1, 5)  # a value: 5, longer than a recompute (2)
    for plan, m, copies, wait in [
        # F1 (0-1): weights 2; fused (2): weights 1, input 0.5 per micro-batch;
        # B2 (0-1): weights 2, its gradient hidden by the recompute
        ("2|1|2", 1, hidden, 0.0),
        ("2|1|2", 1, alone, 2 + 1.5 + 2),
        ("2|1|2", 2, alone, 2 + 2 + 2),
        ("2|1|2", 1, slow, 5 - 2),  # the gradient's upload outlasts the recompute
        # the fused stage (1-2) rewalked: its input once more per micro-batch
        ("1|2|1|rewalk", 2, hidden, 2 * 0.5),
        ("1|2|1|rewalk", 2, alone, 1 + (2 + 2 * (0.5 + 0.5)) + 1),
        ("1|2|1|layered", 2, alone, 1 + (2 + 2 * 0.5) + 1),
    ]:
        base = simulate("roundpipe", costs, 1, m, plan=plan)
        res = simulate("roundpipe", costs, 1, m, plan=plan, copies=copies)
        assert res.copy_wait == pytest.approx(wait), (plan, m, copies)
        assert res.makespan == pytest.approx(base.makespan + wait)
        assert res.work == base.work  # waiting is idle time
    # two devices: the fused stage's weights go up while its device waits
    # for F1's first output anyway (device 1 from 0, F1's output at 4); F1's
    # and B2's weights once device 0 is free, exposed
    many = simulate("roundpipe", costs, 2, 4, plan="2|1|2", copies=alone)
    assert many.copy_wait == pytest.approx(2 + 4 * 0.5 + 2)
    assert many.makespan > simulate("roundpipe", costs, 2, 4, plan="2|1|2").makespan
    for bad, match in (
        (dict(bandwidth=0, boundary=1), "bandwidth must be > 0"),
        (dict(bandwidth=1, boundary=-1), "boundary must be >= 0 bytes"),
    ):
        with pytest.raises(PlanError, match=match):
            Copies(**bad)


# ------------------------------------------------- the asynchronous steady state
def _full_steady(costs, plan, n, m, *, iterations=None, **kw):
    """The steady-state measure from every segment of the full count of
    iterations (what steady_async_bubble computed before it could stop early)."""
    from lightning_roundpipe.plan.simulate import simulate_schedules

    k = iterations if iterations is not None else max(8, 2 * n + 2)
    _, clock = simulate_schedules(costs, plan, n, m, k, async_optimizer=True, **kw)
    segs = clock.segments
    t1 = max(s.end for s in segs if s.iteration == 1)
    t2 = min(s.start for s in segs if s.iteration == k - 1)
    if t2 <= t1:
        t1 = min(s.start for s in segs if s.iteration == 1)
        t2 = min(s.start for s in segs if s.iteration == 2)
    busy = sum(max(0.0, min(s.end, t2) - max(s.start, t1)) for s in segs)
    return max(0.0, 1.0 - busy / (n * (t2 - t1))) if t2 > t1 else 0.0


@pytest.fixture
def lowered(monkeypatch):
    """Counts the iterations the simulator lowers."""
    import sys

    mod = sys.modules["lightning_roundpipe.plan.simulate"]
    count = [0]
    real = mod.lower

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "lower", counting)
    return count


@pytest.mark.parametrize(
    ("layers", "n", "m", "kw"),
    [
        (31, 12, 48, {}),  # repeats in blocks of 4 iterations
        (41, 12, 48, {"comm_time": 0.5}),
        (41, 16, 64, {}),
        (47, 16, 48, {}),  # blocks of 7
        (30, 16, 64, {"round_size": 16}),
        (41, 12, 48, {"optimizer_time": 2200.0}),  # the optimizer sets the period
        (41, 12, 48, {"double_buffer": False, "placement": "rotate"}),
    ],
)
def test_steady_state_stops_once_iterations_repeat(lowered, layers, n, m, kw):
    """Mid-size cases: the steady state stops as soon as a block of
    iterations repeats, shifted by one period, and places the rest: the
    same answer as simulating and measuring every iteration."""
    from lightning_roundpipe.plan.simulate import steady_async_bubble

    costs = LayerCosts([1.0] * (layers - 1) + [3.0], [2.0] * (layers - 1) + [6.0])
    plan = partition(costs, n, m)
    got = steady_async_bubble(costs, plan, n, m, **kw)
    assert lowered[0] < 2 * n + 2
    assert got == pytest.approx(_full_steady(costs, plan, n, m, **kw), rel=1e-9, abs=1e-12)


def test_steady_state_equals_the_full_simulation_on_random_cases():
    from lightning_roundpipe.plan.simulate import steady_async_bubble

    rng = random.Random(7)
    for _ in range(40):
        layers = rng.randint(2, 16)
        fwd = [rng.choice([0.5, 1.0, 1.5, 3.0]) for _ in range(layers)]
        costs = LayerCosts(fwd, [f * rng.choice([1, 2, 3]) for f in fwd])
        n, m = rng.randint(2, 8), rng.randint(1, 24)
        plan = partition(costs, n, m)
        kw = {"iterations": rng.choice([None, 4, 12])}
        if rng.random() < 0.4:
            kw["round_size"] = rng.randint(1, m)
        if rng.random() < 0.4:  # an optimizer about as slow as an iteration
            work = m * sum(plan.stage_times(costs))
            kw["optimizer_time"] = work / n * rng.choice([0.5, 1.0, 1.1])
        got = steady_async_bubble(costs, plan, n, m, **kw)
        assert got == pytest.approx(_full_steady(costs, plan, n, m, **kw), abs=1e-12), kw


def test_steady_state_of_a_large_case_lowers_a_few_iterations(lowered):
    """64 devices, 256 micro-batches, 96 stage slots: the full count is 130
    iterations of 24,576 stage runs each; the iterations repeat from the
    14th on, so it lowers 14."""
    from lightning_roundpipe.plan.simulate import steady_async_bubble

    costs = LayerCosts([1.0] * 64, [1.4] * 63 + [1.0])
    plan = partition(costs, 64, 256)
    assert plan.num_slots == 96
    got = steady_async_bubble(costs, plan, 64, 256)
    assert lowered[0] <= 16
    assert 0.0 < got < 0.01


def test_steady_state_stops_on_a_settled_estimate(lowered):
    """A case whose iterations do not repeat within the full count (16
    devices; the round's first device walks around them): past 18
    iterations it stops once the idle fraction over the second half of the
    iterations has settled, close to the full count's measure."""
    from lightning_roundpipe.plan.simulate import steady_async_bubble

    costs = LayerCosts([1.0] * 48 + [3.0], [2.0] * 48 + [6.0])
    plan = partition(costs, 16, 64)
    got = steady_async_bubble(costs, plan, 16, 64)
    assert 18 <= lowered[0] < 34
    full = _full_steady(costs, plan, 16, 64)
    assert got == pytest.approx(full, abs=2e-3)
    # an explicit count, or no tolerance, is measured in full (or placed exactly)
    assert steady_async_bubble(costs, plan, 16, 64, tolerance=0) == pytest.approx(full, abs=1e-12)
    assert steady_async_bubble(costs, plan, 16, 64, iterations=34) == pytest.approx(full, abs=1e-12)
    with pytest.raises(PlanError, match="tolerance must be a finite number >= 0"):
        steady_async_bubble(costs, plan, 16, 64, tolerance=-1.0)

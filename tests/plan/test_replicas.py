"""The gradient all-reduce across servers: the link, the buckets, when each
layer's gradient is complete, and what the reduction adds to a step."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_roundpipe.plan import (
    DEFAULT_BUCKET_BYTES,
    Clock,
    LayerCosts,
    PlanError,
    Stage,
    StagePlan,
    allreduce_seconds,
    estimate_reduction,
    gradient_buckets,
    gradient_ready_times,
    lower,
    overlap_reduction,
    simulate,
)

#: with 2 servers, a link of 8e-9 Gb/s moves one byte per second each way:
#: 2 (N - 1) / N = 1 and 1 byte * 8 bits / 8 bits per second
BYTE_PER_SECOND = 8e-9


# ------------------------------------------------------------------ the link
def test_ring_allreduce_sends_2_n_minus_1_over_n_of_the_bytes():
    gb = 10.0  # 10 Gb/s: 1.25e9 bytes per second
    nbytes = 1e9
    assert allreduce_seconds(nbytes, 1, gb) == 0.0
    assert allreduce_seconds(nbytes, 2, gb) == pytest.approx(1.0 * nbytes / 1.25e9)
    assert allreduce_seconds(nbytes, 4, gb) == pytest.approx(1.5 * nbytes / 1.25e9)
    assert allreduce_seconds(0, 4, gb) == 0.0
    # the optional latency is paid on each of the 2 (N - 1) steps
    assert allreduce_seconds(nbytes, 4, gb, latency=1e-3) == pytest.approx(
        1.5 * nbytes / 1.25e9 + 6e-3
    )
    assert allreduce_seconds(nbytes, 1, gb, latency=1e-3) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"servers": 0}, "servers must be an integer >= 1"),
        ({"servers": 2.0}, "servers must be an integer >= 1"),
        ({"link_gbps": 0}, "link_gbps must be a number > 0"),
        ({"nbytes": -1}, "nbytes must be a number >= 0"),
        ({"latency": float("nan")}, "latency must be a number >= 0"),
    ],
)
def test_allreduce_refuses_bad_input(kwargs, message):
    args = {"nbytes": 1.0, "servers": 2, "link_gbps": 1.0, **kwargs}
    latency = args.pop("latency", 0.0)
    with pytest.raises(PlanError, match=message):
        allreduce_seconds(**args, latency=latency)


# --------------------------------------------------------------- the buckets
def test_buckets_go_from_the_last_layer_to_the_first_and_close_at_the_cap():
    assert gradient_buckets([4, 4, 4, 4, 4], cap=8) == [(3, 5), (1, 3), (0, 1)]
    # a bucket is closed once it reaches the cap: it may pass it by its lowest layer
    assert gradient_buckets([4, 4, 4, 4, 4], cap=7) == [(3, 5), (1, 3), (0, 1)]
    assert gradient_buckets([4, 4, 4, 4, 4], cap=100) == [(0, 5)]
    assert gradient_buckets([1, 2, 3]) == [(0, 3)]  # far below the 25 MiB default
    assert DEFAULT_BUCKET_BYTES == 25 * 2**20


def test_a_layer_is_never_split_and_a_big_one_after_a_closed_bucket_goes_alone():
    # layer 2 fills a bucket on its own, then the big layer 1 fills the next alone
    assert gradient_buckets([1, 100, 60], cap=50) == [(2, 3), (1, 2), (0, 1)]
    # a big layer joins the open bucket (as DDP's buckets do) and closes it
    assert gradient_buckets([1, 100, 10], cap=50) == [(1, 3), (0, 1)]


def test_layers_without_gradients_open_and_extend_no_bucket():
    assert gradient_buckets([0, 5, 0, 0, 5, 0], cap=8) == [(1, 5)]
    assert gradient_buckets([0, 5, 0, 0, 5, 0], cap=5) == [(4, 5), (1, 2)]
    assert gradient_buckets([0, 0, 0], cap=5) == []
    assert gradient_buckets([], cap=5) == []


def test_buckets_refuse_bad_input():
    with pytest.raises(PlanError, match="cap must be a number > 0"):
        gradient_buckets([1, 2], cap=0)
    with pytest.raises(PlanError, match=r"layer_bytes\[1\] must be a number >= 0"):
        gradient_buckets([1, -2], cap=4)


@given(
    st.lists(st.integers(0, 100), max_size=30),
    st.integers(1, 150),
)
def test_buckets_cover_every_gradient_once_in_reduction_order(sizes, cap):
    buckets = gradient_buckets(sizes, cap)
    covered = [i for a, b in buckets for i in range(a, b)]
    # ranges are disjoint, walk downwards, and hold every layer with gradients
    assert len(covered) == len(set(covered))
    assert all(a < b for a, b in buckets)
    assert all(b1[0] >= b2[1] for b1, b2 in itertools.pairwise(buckets))
    assert {i for i, n in enumerate(sizes) if n} <= set(covered)
    for k, (a, b) in enumerate(buckets):
        held = sum(sizes[a:b])
        assert sizes[a] > 0 and sizes[b - 1] > 0  # ends are layers with gradients
        assert held - sizes[a] < cap  # closed by its lowest layer, not before
        if k < len(buckets) - 1:
            assert held >= cap  # only the last bucket may be short


# ---------------------------------------------------- when gradients are done
def small_plan():
    costs = LayerCosts.uniform(7)
    return costs, StagePlan((3, 3), 1, (2, 2, 2))


@pytest.mark.parametrize("round_size", [None, 2])
@pytest.mark.parametrize("async_optimizer", [False, True])
def test_a_layer_is_done_after_its_last_backward(round_size, async_optimizer):
    costs, plan = small_plan()
    res = simulate(
        "roundpipe",
        costs,
        2,
        4,
        plan=plan,
        microbatches_per_round=round_size,
        async_optimizer=async_optimizer,
    )
    times = gradient_ready_times(res)
    assert len(times.ready) == costs.num_layers
    assert times.backward_end == pytest.approx(res.makespan)  # a training iteration ends so
    assert all(0 < t <= times.makespan for t in times.ready)
    # the backward walks down: the last layer (the fused stage) is done first,
    # the first layer last, at the end of the backward
    assert times.ready[0] == times.backward_end
    assert list(times.ready) == sorted(times.ready, reverse=True)
    assert times.ready[-1] < times.ready[0]
    for layer, t in enumerate(times.ready):
        last = max(
            s.end
            for s in res.timeline
            if s.kind == "B" and any(a <= layer < b for a, b in [_range(plan, s.stage)])
        )
        assert t == last


def _range(plan, label):
    (stage,) = [s for s in plan.stages if s.label == label]
    return stage.start, stage.stop


def test_the_exact_times_of_a_hand_checked_timeline():
    # 2 devices, 4 micro-batches, f=1 and b=2 per layer (see the simulator's timeline)
    costs, plan = small_plan()
    res = simulate("roundpipe", costs, 2, 4, plan=plan)
    times = gradient_ready_times(res)
    assert times.ready == (63.0, 63.0, 48.0, 48.0, 39.0, 39.0, 24.0)
    assert (times.backward_end, times.makespan) == (63.0, 63.0)


def test_times_from_a_lowered_schedule_match_the_simulator():
    costs, plan = small_plan()
    res = simulate("roundpipe", costs, 2, 4, plan=plan)
    sched = lower(plan, 2, 4, clock=Clock(costs, 2, async_optimizer=False))
    assert gradient_ready_times(sched) == gradient_ready_times(res)
    # bare segments need the plan
    assert gradient_ready_times(sched.predicted, plan) == gradient_ready_times(res)
    with pytest.raises(PlanError, match="pass stages="):
        gradient_ready_times(sched.predicted)


def test_times_of_a_later_iteration_are_relative_to_its_start():
    costs, plan = small_plan()
    one = gradient_ready_times(simulate("roundpipe", costs, 2, 4, plan=plan))
    res = simulate("roundpipe", costs, 2, 4, plan=plan, iterations=3)
    assert gradient_ready_times(res) == one  # the first iteration by default
    # synchronous iterations run one after another, alike
    assert gradient_ready_times(res, iteration=2) == one
    with pytest.raises(PlanError, match="no segment of iteration 5"):
        gradient_ready_times(res, iteration=5)


def test_times_of_a_baseline_schedule():
    costs, _ = small_plan()
    res = simulate("gpipe", costs, 2, 4, stages=[4, 3])
    times = gradient_ready_times(res)
    assert times.ready[:4] == (times.backward_end,) * 4
    assert times.ready[4:] == (times.ready[4],) * 3
    assert times.ready[4] < times.backward_end


def test_a_forward_only_timeline_has_no_gradients():
    costs, _ = small_plan()
    slots = [Stage(0, "F1", "forward", 0, 4), Stage(1, "F2", "forward", 4, 7)]
    sched = lower(slots, 2, 4, clock=Clock(costs, 2), training=False, output_readers=1)
    with pytest.raises(PlanError, match="no backward segment"):
        gradient_ready_times(sched)


# ------------------------------------------------------------ the reduction
def test_buckets_overlap_the_backward_and_follow_one_another():
    # layers done at 10, 20, 30 (from the top down); 5 bytes each, one bucket a layer
    red = overlap_reduction(
        [5, 5, 5], [30, 20, 10], 30, 2, BYTE_PER_SECOND, bucket_bytes=5, window_seconds=100
    )
    assert [(b.start, b.stop) for b in red.buckets] == [(2, 3), (1, 2), (0, 1)]
    assert [(b.ready, b.begin, b.end) for b in red.buckets] == [
        (10, 10, 15),
        (20, 20, 25),
        (30, 30, 35),
    ]
    assert red.link_seconds == 15 and red.finish == 35
    assert red.exposed_sync == 5  # only the last bucket outlasts the backward
    assert red.exposed_async == 0  # 5 s after the backward fit in a 100 s window
    assert not red.bottleneck
    # a slower link: the buckets queue up behind one another
    slow = overlap_reduction(
        [5, 5, 5], [30, 20, 10], 30, 2, BYTE_PER_SECOND / 4, bucket_bytes=5, window_seconds=100
    )
    assert [(b.begin, b.end) for b in slow.buckets] == [(10, 30), (30, 50), (50, 70)]
    assert slow.exposed_sync == 40
    assert slow.exposed_async == 0
    # the asynchronous step also waits for the optimizer: 40 + 70 - 100
    late = overlap_reduction(
        [5, 5, 5],
        [30, 20, 10],
        30,
        2,
        BYTE_PER_SECOND / 4,
        bucket_bytes=5,
        window_seconds=100,
        optimizer_seconds=70,
        async_optimizer=True,
    )
    assert late.exposed_async == 10 and late.exposed == 10
    # an optimizer step longer than the window paces the steps on one server
    # too: the reduction adds its whole tail after the backward
    paced = overlap_reduction(
        [5, 5, 5],
        [30, 20, 10],
        30,
        2,
        BYTE_PER_SECOND / 4,
        bucket_bytes=5,
        window_seconds=100,
        optimizer_seconds=150,
    )
    assert paced.exposed_async == paced.exposed_sync == 40
    assert late.bytes_sent == 15 and late.gradient_bytes == 15


def test_one_server_reduces_nothing():
    costs, plan = small_plan()
    res = simulate("roundpipe", costs, 2, 4, plan=plan)
    red = estimate_reduction(res, [1e9] * 7, 1, 1.0)
    assert red.bytes_sent == 0 and red.link_seconds == 0
    assert red.exposed_sync == red.exposed_async == 0
    assert not red.bottleneck and red.advice == ""
    assert red.throughput(res.makespan) == 1


def test_a_fast_link_is_hidden_and_a_slow_one_is_the_bottleneck():
    costs, plan = small_plan()  # 63 s per iteration
    res = simulate("roundpipe", costs, 2, 4, plan=plan)
    grads = [4e6] * 7
    fast = estimate_reduction(res, grads, 4, 1e6, bucket_bytes=4e6)
    assert fast.exposed_sync == pytest.approx(0, abs=1e-6)
    assert fast.exposed_async == 0
    assert not fast.bottleneck and fast.advice == ""  # (under 1% of the window)
    # with the first stage frozen the last bucket is ready before the backward ends
    frozen = estimate_reduction(res, [0.0, 0.0, *grads[2:]], 4, 1e6, bucket_bytes=4e6)
    assert frozen.finish < frozen.backward_end
    assert frozen.exposed_sync == 0 and frozen.advice == ""
    # 28 MB at 1e-3 Gb/s: 2 * 3 / 4 * 28e6 * 8 / 1e6 = 336 s of link time per 63 s window
    slow = estimate_reduction(res, grads, 4, 1e-3, optimizer_seconds=1.0)
    assert slow.link_seconds == pytest.approx(336)
    assert slow.exposed_sync == pytest.approx(336)  # one bucket: it starts after the backward
    assert slow.exposed_async == pytest.approx(336 + 1 - 63)
    assert slow.bottleneck
    assert "the network is the bottleneck" in slow.advice
    for cure in ("fewer servers", "faster network", "micro-batches", "LoRA"):
        assert cure in slow.advice
    assert slow.throughput(63) == pytest.approx(4 * 63 / (63 + 336))


def test_an_exposed_reduction_that_the_asynchronous_optimizer_would_hide():
    costs, plan = small_plan()
    res = simulate("roundpipe", costs, 2, 4, plan=plan)
    # 7 MB in 1 MB buckets at 2 s per MB: 14 s of link, shorter than the 63 s window
    red = estimate_reduction(res, [1e6] * 7, 2, 4e-3, bucket_bytes=1e6)
    assert red.link_seconds == pytest.approx(14)
    assert red.exposed_sync > 0 and red.exposed_async == 0
    assert not red.bottleneck
    assert "not hidden" in red.advice and "async_optimizer=True" in red.advice
    hidden = estimate_reduction(res, [1e6] * 7, 2, 4e-3, bucket_bytes=1e6, async_optimizer=True)
    assert hidden.exposed == 0 and hidden.advice == ""


def test_the_reduction_refuses_bad_input():
    costs, plan = small_plan()
    res = simulate("roundpipe", costs, 2, 4, plan=plan)
    with pytest.raises(PlanError, match="layer_grad_bytes has 3 entries but the plan covers 7"):
        estimate_reduction(res, [1, 2, 3], 2, 1.0)
    with pytest.raises(PlanError, match="servers must be an integer >= 1"):
        estimate_reduction(res, [1] * 7, 0, 1.0)
    with pytest.raises(PlanError, match="optimizer_seconds must be a number >= 0"):
        estimate_reduction(res, [1] * 7, 2, 1.0, optimizer_seconds=-1)
    with pytest.raises(PlanError, match="ready has 2 entries but layer_bytes has 3"):
        overlap_reduction([1, 2, 3], [1, 2], 3, 2, 1.0)

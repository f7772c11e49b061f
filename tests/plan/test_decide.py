"""Plan decisions as pure functions: at the start, after measurement, after
running out of memory."""

import pytest

from lightning_roundpipe.plan import LayerCosts, PlanError, StagePlan
from lightning_roundpipe.plan.decide import (
    after_measurement,
    after_out_of_memory,
    initial_plan,
    tightest,
)


def costs(n=8, memory=10.0, head=1.0):
    fwd = [1.0] * (n - 1) + [head]
    return LayerCosts(fwd, [2 * f for f in fwd], memory=[memory] * n, weight_bytes=[memory] * n)


def test_tightest_ignores_unset_limits():
    assert tightest(None, 5, 3) == 3 and tightest(None, None) is None


def test_initial_plan_checks_a_given_plan_and_chooses_within_the_limit():
    est = costs()
    given = StagePlan.parse("4,3|1|3,4", 8)
    assert initial_plan(est, 2, 4, given=given, async_optimizer=True, memory_limit=None) is given
    with pytest.raises(PlanError, match=r"stage F1 of plan 4,3\|1\|3,4 needs about 40"):
        initial_plan(est, 2, 4, given=given, async_optimizer=True, memory_limit=30)
    chosen = initial_plan(est, 2, 4, given=None, async_optimizer=True, memory_limit=30)
    assert max(chosen.stage_memory(est)) <= 30


def test_after_measurement_switches_only_when_clearly_better_and_never_a_given_plan():
    est = costs()
    measured = costs(head=12.0)  # a heavy head the estimates did not see
    current = StagePlan.parse("1,1,1,1,1,1,1|1|1,1,1,1,1,1,1", 8)
    kw = dict(async_optimizer=True, round_size=None, memory_limit=None, size_limit=None)
    keep = after_measurement(current, est, est, 2, 4, user_plan=False, margin=10.0, **kw)
    assert not keep.changed and keep.plan is current and "kept plan" in keep.reason
    one_slot = StagePlan.parse("|8|", 8)  # everything in the fused stage: no overlap
    switch = after_measurement(one_slot, measured, est, 2, 4, user_plan=False, margin=0.05, **kw)
    assert switch.changed and switch.plan != one_slot
    assert "re-partitioned from measurements: |8| ->" in switch.reason
    over = after_measurement(
        current,
        measured,
        est,
        2,
        4,
        user_plan=True,
        margin=0.0,
        async_optimizer=True,
        round_size=None,
        memory_limit=5,
        size_limit=None,
    )
    assert over.plan is current and over.warning and "expect an out-of-memory error" in over.reason


def test_after_out_of_memory_cuts_the_stage_or_doubles_the_microbatches():
    est = costs()
    current = StagePlan.parse("4,3|1|3,4", 8)

    def oom(failed, plan_given=False, auto=True, batch=8):
        return after_out_of_memory(
            est,
            current,
            2,
            failed,
            "F1",
            plan_given=plan_given,
            microbatches_for=lambda limit: 4,
            num_microbatches=4,
            auto_microbatches=auto,
            batch_size=batch,
            batch_microbatches=4,
        )

    cut = oom((0, 4))
    assert cut.size_limit == 20 and cut.microbatches is None and "stage F1 had 40" in cut.change
    one_layer = oom((7, 8))
    assert one_layer.microbatches == 8 and one_layer.change == "num_microbatches=8"
    assert oom((7, 8), plan_given=True, auto=False) is None  # nothing may change
    assert oom((7, 8), batch=4) is None  # micro-batches of one sample already


def test_after_out_of_memory_counts_predicted_activations_larger_where_that_changes_the_plan():
    from lightning_roundpipe.plan.decide import Predicted, plan_for_activations, stage_peaks

    est = costs()
    current = StagePlan.parse("4,3|1|3,4", 8)
    layered = StagePlan.parse("4,3|1|3,4|layered", 8)
    saved, transient = [4.0] * 8, [1.0] * 8
    asked = []

    def planner(plan, boundary=None):
        def planned(scale):
            asked.append(scale)
            return plan_for_activations(
                plan,
                est,
                [scale * x for x in saved],
                [scale * x for x in transient],
                2,
                4,
                user_plan=False,
                async_optimizer=True,
                memory_limit=60,
                boundary=boundary,
            )

        return planned

    def oom(stage, plan=current, boundary=None, scale=1.0, planned=None, peaks=None, told=True):
        """After ``stage`` (layers 0-3) of ``plan`` failed, its activations
        ``told`` (predicted ``peaks``, by default from saved and transient)."""
        asked.clear()
        if told and peaks is None:
            peaks = stage_peaks(plan, est, saved, transient, boundary)
        return after_out_of_memory(
            est,
            plan,
            2,
            (0, 4),
            stage,
            plan_given=False,
            microbatches_for=lambda limit: 4,
            num_microbatches=4,
            auto_microbatches=True,
            batch_size=8,
            batch_microbatches=4,
            predicted_peaks=peaks if told else None,
            memory_limit=60,
            activation_scale=scale,
            with_activations=planned or planner(plan, boundary),
        )

    # B3 (layers 0-3): predicted 40 + 16 + 1 of 60; its activations had room
    # for 20 / 17 of their prediction: at least a quarter more
    bwd = oom("B3")
    assert asked == [1.25] and bwd.activation_scale == 1.25
    assert bwd.size_limit is None and bwd.microbatches is None
    assert str(bwd.plan) == "3,3|2|2,2,2" == str(planner(current)(1.25).plan)
    assert bwd.change.startswith("activations counted 1.25x their prediction (stage B3 was ")
    # F1 works with 2 bytes of activations (1 counted twice) beside 40 of
    # weights: room for 10x, a twentieth more, on top of the 2x learned
    # earlier; no plan fits activations that large, so the activations do
    # not explain the failure: the stage is cut by its weights instead
    twice = stage_peaks(current, est, [2 * x for x in saved], [2 * x for x in transient])
    fwd = oom("F1", scale=2.0, peaks=twice)
    assert asked == [pytest.approx(21.0)]
    assert fwd.activation_scale is None and fwd.size_limit == 20
    # one step is at most 16x
    oom("F1")
    assert asked == [16.0]
    # no plan fits activations that large, or the plan for them is the same
    # plan with the same room: the stages are cut by their weights
    kept = Predicted(current, [0.0] * 5, "no plan fits", True, 60)
    for planned in (lambda s: kept, lambda s: Predicted(current, [0.0] * 5, "fits", False, 60)):
        cut = oom("B3", planned=planned)
        assert cut.activation_scale is None and cut.size_limit == 20
    # the same plan with nothing prefetched is a change
    unfetched = Predicted(current, [0.0] * 5, "", False, 70, None, False)
    alone = oom("B3", planned=lambda s: unfetched)
    assert alone.activation_scale == 1.25 and alone.change.endswith(", nothing prefetched")
    # a layered stage keeps its layers' inputs (3 each), which do not scale:
    # at 1.5 times the stage would fit again, larger steps follow until the
    # plan changes
    steps = oom("B3", plan=layered, boundary=3.0)
    assert asked == pytest.approx([1.5, 1.875, 2.34375])  # 1.05 * 20 / 14, then 1.25x
    assert steps.activation_scale == pytest.approx(2.34375) and steps.plan != layered
    # no activations predicted (a model without an adapter): as before
    none = oom("B3", planned=lambda s: None, told=False)
    assert none.size_limit == 20 and none.activation_scale is None and not asked


def test_stage_peaks_add_what_a_backward_stage_keeps_and_its_largest_transient():
    from lightning_roundpipe.plan.decide import stage_peaks

    est = costs()
    plan = StagePlan.parse("4,3|1|3,4", 8)
    saved, transient = [1.0] * 8, [0.5] * 7 + [3.0]
    peaks = stage_peaks(plan, est, saved, transient)
    # F1, F2 (no grad: weights and one transient), fused (layer 7), B2, B1
    assert peaks == [40.5, 30.5, 10 + 1 + 3, 30 + 3 + 0.5, 40 + 4 + 0.5]


def test_plan_for_activations_keeps_a_fitting_plan_and_replaces_one_that_would_not_fit():
    from lightning_roundpipe.plan.decide import plan_for_activations

    est = costs()
    plan = StagePlan.parse("4,3|1|3,4", 8)
    kw = dict(user_plan=False, async_optimizer=True)
    saved, transient = [5.0] * 8, [2.0] * 8
    kept = plan_for_activations(plan, est, saved, transient, 2, 4, memory_limit=100, **kw)
    assert kept.plan is plan and not kept.warning and max(kept.peaks) == 62
    # with 5 bytes kept per layer, a 4-layer backward stage needs 62 > 40
    new = plan_for_activations(plan, est, saved, transient, 2, 4, memory_limit=40, **kw)
    assert new.plan != plan and max(new.peaks) <= 40
    assert "re-planned to" in new.reason and "before the first step" in new.reason
    # a given plan is kept, with a warning that says what to change
    given = plan_for_activations(
        plan, est, saved, transient, 2, 4, memory_limit=40, user_plan=True, async_optimizer=True
    )
    assert given.plan is plan and given.warning
    assert "stage B3 of plan 4,3|1|3,4 is predicted to need 62 bytes" in given.reason
    assert "kept as given: give a plan with smaller stages or plan=None" in given.reason
    # nothing fits: one layer with its activations is over the limit
    none = plan_for_activations(plan, est, [50.0] * 8, transient, 2, 4, memory_limit=40, **kw)
    assert none.warning and "no plan fits: raise num_microbatches, shorten" in none.reason


def test_long_sequences_let_a_stage_use_more_than_half_of_the_device():
    """With the device budget known, activations that fit no plan in half of
    it get a larger limit that leaves the next stage's (small) weights the
    rest; the limit and the weight cap come back for later decisions."""
    from lightning_roundpipe.plan.decide import plan_for_activations

    est = costs()  # 10 bytes of weights (and gradients) per layer
    plan = StagePlan.parse("4,3|1|3,4", 8)
    kw = dict(user_plan=False, async_optimizer=True, memory_limit=100)
    saved, transient = [100.0] * 8, [5.0] * 8  # one layer: 115 > 100
    half = plan_for_activations(plan, est, saved, transient, 2, 4, **kw)
    assert half.warning and "no plan fits" in half.reason and half.memory_limit == 100
    more = plan_for_activations(plan, est, saved, transient, 2, 4, **kw, device_budget=200)
    # 0.9 x 200 less a quarter of it for the next stage's weights
    assert not more.warning and more.memory_limit == pytest.approx(130)
    assert more.weight_cap == pytest.approx(50)
    assert max(more.peaks) <= 130 and more.plan != plan
    assert "(the next stage's weights need at most 50)" in more.reason
    # a given plan that fits the larger limit is kept, without a warning
    ones = StagePlan.parse("1,1,1,1,1,1,1|1|1,1,1,1,1,1,1", 8)
    given = plan_for_activations(
        ones, est, saved, transient, 2, 4, **{**kw, "user_plan": True}, device_budget=200
    )
    assert given.plan is ones and not given.warning and given.memory_limit == pytest.approx(130)
    # heavy layers: the last resort leaves the next stage one layer's weights
    # (60): one-layer stages of 60 + 50 + 5 within 0.9 x 200 - 60
    heavy = costs(memory=60.0)
    big = plan_for_activations(ones, heavy, [50.0] * 8, transient, 2, 4, **kw, device_budget=200)
    assert not big.warning and (big.memory_limit, big.weight_cap) == (120, 60)
    assert big.plan.num_slots == 15 and max(big.peaks) == 115
    assert "(the next stage's weights need at most 60)" in big.reason
    # one layer with its activations over even that: all of the usable
    # budget, nothing prefetched (60 + 56 + 5 within 0.9 x 200); later calls
    # keep it
    bare = plan_for_activations(ones, heavy, [56.0] * 8, transient, 2, 4, **kw, device_budget=200)
    assert not bare.warning and not bare.prefetch and bare.weight_cap is None
    assert bare.memory_limit == pytest.approx(180) and max(bare.peaks) == 121
    assert "nothing prefetched: the next stage's weights go up once a stage is done" in (
        bare.reason
    )
    after = {**kw, "memory_limit": 180, "device_budget": 200, "prefetch": False}
    again = plan_for_activations(bare.plan, heavy, [56.0] * 8, transient, 2, 4, **after)
    assert again.plan is bare.plan and not again.prefetch and again.memory_limit == 180
    # over even that: nothing fits
    over = plan_for_activations(ones, heavy, [120.0] * 8, transient, 2, 4, **kw, device_budget=200)
    assert over.warning and over.memory_limit == 100 and over.weight_cap is None
    assert over.prefetch
    # activations that fit half the device: the half it is
    small = plan_for_activations(plan, est, [1.0] * 8, transient, 2, 4, **kw, device_budget=200)
    assert small.plan is plan and small.memory_limit == 100 and small.weight_cap is None
    # later calls keep the larger limit and its cap: a plan within both is
    # kept, one with heavier stages is replaced by one within the cap
    later = {**kw, "memory_limit": 130, "device_budget": 200, "weight_cap": 50}
    within = plan_for_activations(plan, est, [1.0] * 8, transient, 2, 4, **later)
    assert within.plan is plan and (within.memory_limit, within.weight_cap) == (130, 50)
    heavy_stages = StagePlan.parse("7|1|7", 8)  # 70 bytes of weights in a stage
    cut = plan_for_activations(heavy_stages, est, [1.0] * 8, transient, 2, 4, **later)
    assert cut.plan != heavy_stages and cut.weight_cap == 50
    assert max(est.stage_weight_bytes(st.start, st.stop) for st in cut.plan.stages) <= 50


def test_after_measurement_keeps_stages_within_the_weight_cap():
    est = costs()
    current = StagePlan.parse("1,1,1,1,1,1,1|1|1,1,1,1,1,1,1", 8)
    kw = dict(async_optimizer=True, round_size=None, memory_limit=1000, size_limit=None)
    free = after_measurement(current, est, est, 2, 4, user_plan=False, margin=0.0, **kw)
    assert free.changed and max(free.plan.stage_memory(est)) > 15  # larger stages are better
    capped = after_measurement(
        current, est, est, 2, 4, user_plan=False, margin=0.0, weight_cap=15, **kw
    )
    # the best plan within the cap is the one-layer plan already running
    assert not capped.changed and capped.plan is current


def test_the_partitioner_is_given_the_weight_cap_not_only_checked_against_it():
    """Uneven layers: the fastest plan at the larger limit has stages over the
    weight cap; a plan within both exists and is the one chosen."""
    from lightning_roundpipe.plan.decide import plan_for_activations, stage_peaks

    fwd, weights = [1.0] * 8, [20.0] * 7 + [10.0]
    est = LayerCosts(fwd, [2 * f for f in fwd], memory=weights, weight_bytes=weights)
    saved, transient = [5.0] * 7 + [95.0], [0.0] * 7 + [5.0]  # a heavy last layer
    plan = StagePlan.parse("4,3|1|3,4", 8)
    kw = dict(user_plan=False, async_optimizer=True, memory_limit=100, device_budget=200)
    new = plan_for_activations(plan, est, saved, transient, 2, 4, **kw)
    assert not new.warning and (new.memory_limit, new.weight_cap) == (130, 50)
    assert max(stage_peaks(new.plan, est, saved, transient)) <= 130
    assert max(est.stage_weight_bytes(s.start, s.stop) for s in new.plan.stages) <= 50


def test_after_measurement_re_partitions_within_the_weight_cap_or_warns():
    fwd = [1.0] * 8
    est = LayerCosts(fwd, [2 * f for f in fwd], memory=[10.0] * 8, weight_bytes=[10.0] * 8)
    kw = dict(async_optimizer=True, round_size=None, size_limit=None, margin=0.1)
    # the current plan is over the limit with its measured activations; one
    # within the limit and the cap exists
    measured = LayerCosts(fwd, [2 * f for f in fwd], memory=[30.0] * 8, weight_bytes=[10.0] * 8)
    current = StagePlan.parse("4,3|1|3,4", 8)
    d = after_measurement(
        current, measured, est, 2, 4, user_plan=False, memory_limit=100, weight_cap=25, **kw
    )
    assert d.changed and max(d.plan.stage_memory(measured)) <= 100
    assert max(est.stage_weight_bytes(s.start, s.stop) for s in d.plan.stages) <= 25
    # one layer alone is over the limit: kept, with a warning
    heavy = LayerCosts(
        fwd, [2 * f for f in fwd], memory=[60.0] * 7 + [140.0], weight_bytes=[10.0] * 8
    )
    ones = StagePlan.parse("1,1,1,1,1,1,1|1|1,1,1,1,1,1,1", 8)
    d = after_measurement(
        ones, heavy, est, 2, 4, user_plan=False, memory_limit=130, weight_cap=15, **kw
    )
    assert not d.changed and d.warning


# ------------------------------------------------------------ layered plans
def test_a_layered_stage_keeps_its_layers_inputs_and_one_layers_working_set():
    from lightning_roundpipe.plan.decide import stage_peaks

    est = costs()
    saved, transient, inputs = [1.0] * 8, [0.5] * 7 + [3.0], 2.0
    plain = StagePlan.parse("4,3|1|3,4", 8)
    layered = StagePlan.parse("4,3|1|3,4|layered", 8)
    # forward and one-layer stages as before; B2 (layers 4-6): 30 + 2 inputs
    # (layers 5, 6) + one layer's 1 + 0.5; B3 (layers 0-3): 40 + 3 x 2 + 1.5
    assert stage_peaks(layered, est, saved, transient, inputs) == [40.5, 30.5, 14, 35.5, 47.5]
    assert stage_peaks(plain, est, saved, transient, inputs) == stage_peaks(
        plain, est, saved, transient
    )
    # inputs unknown: counted like plain stages (every layer's saved bytes)
    assert stage_peaks(layered, est, saved, transient) == stage_peaks(plain, est, saved, transient)


def test_a_rewalked_stage_keeps_no_inputs_and_one_layers_working_set():
    from lightning_roundpipe.plan.decide import rewalk_work, stage_peaks

    est = costs()
    saved, transient, inputs = [1.0] * 8, [0.5] * 7 + [3.0], 2.0
    rewalked = StagePlan.parse("4,3|1|3,4|rewalk", 8)
    # B2 (layers 4-6): 30 + a walk's two inputs (2 x 2) + 0.5, more than a
    # layer's 1 + 0.5; B3 likewise: 40 + 4.5
    assert stage_peaks(rewalked, est, saved, transient, inputs) == [40.5, 30.5, 14, 34.5, 44.5]
    assert rewalk_work([5.0, 1.0], [1.0, 2.0], 2.0) == 6.0  # a layer that saves more
    assert rewalk_work([1.0], [1.0], 2.0) == 2.0  # one layer: no walk
    # a layer below the top runs in every walk: its transient beside the two
    # values in hand, though it saves nothing
    assert rewalk_work([0.0, 10.0, 10.0], [100.0, 1.0, 1.0], 5.0) == 110.0
    assert rewalk_work([], [], 2.0) == 0.0


def test_host_need_counts_the_boundaries_a_micro_batch_keeps():
    from lightning_roundpipe.plan.decide import host_need

    ones = StagePlan.parse("1,1,1,1,1,1,1|1|1,1,1,1,1,1,1", 8)
    # layers 1..7 kept for backward stages; no forward-only boundary
    assert ones.kept_boundaries() == list(range(1, 8))
    assert host_need(ones, 10.0) == 70.0
    # "4,3|1|2,2,3": backward stages start at 7 (fused), 5, 3, 0 -> 7, 5, 3 kept;
    # forward stage F2 reads layer 4's input, which no backward stage reads
    plan = StagePlan.parse("4,3|1|2,2,3", 8)
    assert plan.kept_boundaries() == [3, 5, 7] and plan.boundaries_per_microbatch() == 4


def test_host_memory_that_one_layer_stages_exceed_gets_a_layered_plan():
    """One-layer stages fit the device but keep too many boundary values on
    the host; plain multi-layer backward stages would not fit the device, so
    the plan gets layered backward stages that fit both, and the reason says
    so. The time it costs is charged: the plan's stages take longer."""
    from lightning_roundpipe.plan.decide import host_need, plan_for_activations, stage_peaks

    est = costs(n=10, memory=1.0)
    ones = StagePlan.parse("1,1,1,1,1,1,1,1,1|1|1,1,1,1,1,1,1,1,1", 10)
    saved, transient, boundary = [20.0] * 10, [10.0] * 10, 5.0
    kw = dict(user_plan=False, async_optimizer=True, memory_limit=45.0, boundary=boundary)
    # one-layer stages: 31 bytes each; two plain layers would need 52 > 45
    fine = plan_for_activations(ones, est, saved, transient, 1, 1, **kw, host_limit=1000.0)
    assert fine.plan is ones and not fine.warning
    tight = plan_for_activations(ones, est, saved, transient, 1, 1, **kw, host_limit=25.0)
    plan = tight.plan
    assert plan.layered and not tight.warning
    assert host_need(plan, boundary) <= 25.0 < host_need(ones, boundary)
    assert max(stage_peaks(plan, est, saved, transient, boundary)) <= 45.0
    assert max(tight.peaks) <= 45.0
    assert "boundary values of 5 bytes per micro-batch on the host, over the 25" in tight.reason
    assert "backward stages recompute one layer at a time" in tight.reason
    # the second forward is in the stage times the simulator and clock use
    bwd = [st for st in plan.stages if st.kind == "backward" and st.num_layers > 1]
    assert bwd and all(
        st.time(est)
        == est.recompute_backward_time(st.start, st.stop) + est.forward_time(st.start, st.stop - 1)
        for st in bwd
    )
    # a host limit nothing meets: kept, with a warning naming the option (the
    # fewest boundary values that fit 35 bytes: one, a rewalked stage of 5)
    kw["memory_limit"] = 35.0
    none = plan_for_activations(ones, est, saved, transient, 1, 1, **kw, host_limit=4.0)
    assert none.plan is ones and none.warning
    assert "raise device_memory_limit or activation_memory (host memory)" in none.reason


def test_host_memory_that_layered_stages_exceed_gets_a_rewalked_plan():
    """Where the host holds fewer boundary values than a layered stage's
    inputs would take on the device, the plan's backward stages keep no
    layer inputs: each is computed again (rewalk), charged in the times."""
    from lightning_roundpipe.plan.decide import host_need, plan_for_activations, stage_peaks

    est = costs(n=10, memory=1.0)
    ones = StagePlan.parse("1,1,1,1,1,1,1,1,1|1|1,1,1,1,1,1,1,1,1", 10)
    # one layer: 1 + 20 + 10 = 31; a layered stage of k layers 31 + 10 (k - 1)
    # > 35 for k >= 2; a rewalked one 1 k + 30 (a walk: two 10-byte values)
    saved, transient, boundary = [20.0] * 10, [10.0] * 10, 10.0
    kw = dict(user_plan=False, async_optimizer=True, memory_limit=35.0, boundary=boundary)
    got = plan_for_activations(ones, est, saved, transient, 1, 1, **kw, host_limit=30.0)
    plan = got.plan
    assert plan.rewalk and not got.warning, got.reason
    assert host_need(plan, boundary) <= 30.0 < host_need(ones, boundary)
    assert max(stage_peaks(plan, est, saved, transient, boundary)) <= 35.0
    assert "each layer's input again from the stage's" in got.reason
    # more room on the device: a layered plan (the cheaper recompute) instead
    roomy = plan_for_activations(
        ones, est, saved, transient, 1, 1, **{**kw, "memory_limit": 80.0}, host_limit=30.0
    )
    assert roomy.plan.layered and not roomy.plan.rewalk


def test_host_memory_with_room_on_the_device_gets_plain_larger_stages():
    """Where plain multi-layer backward stages fit the device, the plan with
    fewer boundary values needs no second forward."""
    from lightning_roundpipe.plan.decide import host_need, plan_for_activations

    est = costs(n=10, memory=1.0)
    ones = StagePlan.parse("1,1,1,1,1,1,1,1,1|1|1,1,1,1,1,1,1,1,1", 10)
    kw = dict(user_plan=False, async_optimizer=True, memory_limit=200.0, boundary=5.0)
    got = plan_for_activations(ones, est, [20.0] * 10, [10.0] * 10, 1, 1, **kw, host_limit=25.0)
    assert not got.plan.layered and host_need(got.plan, 5.0) <= 25.0 and max(got.peaks) <= 200


def test_plain_stages_of_several_layers_count_one_transient():
    """The plain plans were bounded with every layer's transient added up
    (exact for one-layer stages): with the host limit asking for few
    boundary values, a plan whose stages of two layers fit by their own
    peaks (one transient at a time) was missed and 'no plan fits' said."""
    from lightning_roundpipe.plan.decide import host_need, initial_plan, plan_for_activations

    w = [45, 45, 98, 23]
    est = LayerCosts(
        [float(x) for x in w], [2.0 * x for x in w], memory=[3 * x for x in w], weight_bytes=w
    )
    saved, transient = [237, 213, 10, 85], [70, 64, 77, 61]
    limit, boundary, host_limit = 562, 33, 73
    kw = dict(async_optimizer=True, memory_limit=limit)
    current = initial_plan(est, 2, 4, given=None, **kw)
    got = plan_for_activations(
        current, est, saved, transient, 2, 4, user_plan=False, boundary=boundary,
        host_limit=host_limit, **kw,
    )  # fmt: skip
    assert not got.warning, got.reason
    assert max(got.peaks) <= limit and host_need(got.plan, boundary) <= host_limit
    assert str(got.plan) == "1,1|2|1,1"


def test_after_measurement_keeps_a_layered_plan_and_the_host_limit():
    est = costs()
    layered = StagePlan.parse("4,3|1|3,4|layered", 8)
    kw = dict(
        user_plan=False,
        async_optimizer=True,
        round_size=None,
        memory_limit=None,
        size_limit=None,
        margin=0.05,
    )
    kept = after_measurement(layered, est, est, 2, 4, **kw)
    assert kept.plan is layered and not kept.changed and "kept the layered plan" in kept.reason
    # a measured best plan whose boundary values exceed the host limit is not taken
    slow = StagePlan.parse("7|1|7", 8)
    best = after_measurement(slow, est, est, 2, 4, **kw)
    assert best.changed and best.plan == StagePlan.parse("4|4|4")  # one boundary value
    held = after_measurement(slow, est, est, 2, 4, **kw, boundary=10.0, host_limit=5.0)
    assert held.plan is slow and not held.changed and not held.warning
    # the current plan over the device limit: said, with the warning
    over = after_measurement(
        slow, est, est, 2, 4, **{**kw, "memory_limit": 50}, boundary=10.0, host_limit=5.0
    )
    assert over.plan is slow and over.warning and "expect an out-of-memory error" in over.reason
    assert "keeps 10 bytes of boundary values per micro-batch on the host, over the 5" in (
        held.reason
    )

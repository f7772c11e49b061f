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

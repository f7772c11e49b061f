import pytest

from lightning_roundpipe.plan import DispatchStep, PlanError, StagePlan, dispatch


def test_round_robin_rotation_carries_across_rounds_and_iterations():
    plan = StagePlan.parse("2|1|1,1")  # slots F1, B1, B2, B3
    dp = dispatch(plan, num_devices=3, num_microbatches=6)
    assert dp.as_strings() == [
        "0.F1@0:0-2",
        "0.B1@1:0-2",
        "0.B2@2:0-2",
        "0.B3@0:0-2",
        "1.F1@1:3-5",
        "1.B1@2:3-5",
        "1.B2@0:3-5",
        "1.B3@1:3-5",
    ]
    assert dp.next_device == (0 + 2 * 4) % 3
    nxt = dispatch(plan, 3, 6, start_device=dp.next_device)
    assert nxt.steps[0].device == 2
    assert str(nxt.steps[0]) == "0.F1@2:0-2"


def test_larger_rounds_and_a_short_last_round():
    plan = StagePlan.parse("1|1|1")
    dp = dispatch(plan, num_devices=2, num_microbatches=7, microbatches_per_round=3)
    assert dp.as_strings() == [
        "0.F1@0:0-2",
        "0.B1@1:0-2",
        "0.B2@0:0-2",
        "1.F1@1:3-5",
        "1.B1@0:3-5",
        "1.B2@1:3-5",
        "2.F1@0:6-6",
        "2.B1@1:6-6",
        "2.B2@0:6-6",
    ]


def test_device_is_g0_plus_slot_mod_n():
    plan = StagePlan.parse("3,3,3|2|2,2,2,2,1")
    n = 4
    dp = dispatch(plan, n, 12, start_device=3)
    g0 = 3
    for step in dp.steps:
        if step.slot == 0:
            first = g0
            g0 = (g0 + plan.num_slots) % n
        assert step.device == (first + step.slot) % n
    assert sum(len(s.microbatches) for s in dp.steps) == 12 * plan.num_slots


def test_step_text_round_trips():
    step = DispatchStep(2, 4, "B3", 1, 8, 12)
    parsed = DispatchStep.parse(str(step), slot=4)
    assert parsed == step
    assert list(parsed.microbatches) == [8, 9, 10, 11]
    with pytest.raises(PlanError, match=r"expected 'round\.stage@device:first-last'"):
        DispatchStep.parse("F1 on 0")


def test_grid_marks_a_step():
    plan = StagePlan.parse("1|1|1")
    dp = dispatch(plan, 2, 2)
    grid = dp.grid(mark=2)
    lines = grid.splitlines()
    assert lines[0].startswith("dev 0 | ")
    assert "[0.B2]" in lines[0]
    assert "0.B1" in lines[1] and "[" not in lines[1]
    assert lines[-1].strip() == "^ 0.B2@0:0-1"
    assert lines[-1].index("^") == lines[0].index("[0.B2]") + len("[0.B2]") // 2
    assert dp.grid() == dp.grid(None)
    assert len(dp.grid().splitlines()) == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"num_devices": 4, "num_microbatches": 3},
            r"num_microbatches \(3\) must be >= number of devices \(4\); raise num_microbatches "
            "or lower devices",
        ),
        (
            {"num_devices": 4, "num_microbatches": 8, "microbatches_per_round": 3},
            r"microbatches_per_round \(3\) must be an integer >= number of devices \(4\)",
        ),
        (
            {"num_devices": 2, "num_microbatches": 4, "start_device": 2},
            r"start_device \(2\) must be in \[0, 2\)",
        ),
        ({"num_devices": 0, "num_microbatches": 4}, "num_devices must be an integer >= 1"),
    ],
)
def test_dispatch_errors(kwargs, match):
    with pytest.raises(PlanError, match=match):
        dispatch(StagePlan.parse("1|1|1"), **kwargs)

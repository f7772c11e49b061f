"""The lowered schedule: tasks as strings, placement, reads and writes, the clock."""

import pytest

from lightning_roundpipe.plan import Clock, LayerCosts, PlanError, StagePlan, Task, lower
from lightning_roundpipe.plan.schedule import readers_of


def test_one_round_per_batch_by_default():
    plan = StagePlan.parse("2|1|1,1")  # slots F1, B1, B2, B3
    s = lower(plan, 3, 6, placement="rotate")
    assert s.as_strings() == ["0.F1@0:0-5", "0.B1@1:0-5", "0.B2@2:0-5", "0.B3@0:0-5"]
    assert s.num_rounds == 1 and s.round_size == 6
    assert s.weight_uploads() == {"F1": 1, "B1": 1, "B2": 1, "B3": 1}


def test_rounds_rotate_and_a_short_last_round():
    plan = StagePlan.parse("1|1|1")
    s = lower(plan, 2, 7, round_size=3, placement="rotate")
    assert s.as_strings() == [
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
    assert lower(plan, 2, 7, round_size=3, placement="rotate", start_device=1).tasks[0].device == 1


def test_fewer_microbatches_than_devices():
    plan = StagePlan.parse("1,1|1|1,1")
    s = lower(plan, 4, 1, placement="rotate")
    assert s.as_strings() == [
        "0.F1@0:0-0",
        "0.F2@1:0-0",
        "0.B1@2:0-0",
        "0.B2@3:0-0",
        "0.B3@0:0-0",
    ]


def test_reads_and_writes():
    s = lower(StagePlan.parse("2,1|1|1,2"), 2, 2, placement="rotate")
    assert s.describe() == [
        "0.F1@0:0-1 L0-1 reads act0 writes act2",
        "0.F2@1:0-1 L2 reads act2 writes act3",
        "0.B1@0:0-1 L3 reads act3 writes grad3,loss",
        "0.B2@1:0-1 L2 reads act2,grad3 writes grad2",
        "0.B3@0:0-1 L0-1 reads act0,grad2 writes -",
    ]
    # a backward stage starting inside a forward stage: the forward stage saves
    # that boundary for it
    s = lower(StagePlan.parse("3|1|1,2"), 1, 1, placement="rotate")
    assert s.describe()[0] == "0.F1@0:0-0 L0-2 reads act0 writes act2,act3"
    assert s.readers == {0: 2, 2: 1, 3: 1}
    # forward-only: the controller reads the last output
    plan = StagePlan.parse("2|1|2")
    assert readers_of(plan.stages[:1], output_readers=1) == {0: 1, 2: 1}


def test_ordered_slots_are_marked():
    s = lower(StagePlan.parse("1|1|1"), 2, 4, round_size=2, ordered_slots={0}, placement="rotate")
    assert [t.ordered for t in s.tasks] == [True, False, False, True, False, False]
    assert s.describe()[0].endswith(" ordered")


def test_task_text_round_trips():
    t = lower(StagePlan.parse("2|1|1,1"), 2, 12, round_size=4, placement="rotate").tasks[9]
    assert str(t) == "2.B1@1:8-11"
    assert Task.parse_short(str(t)) == (t.round, t.stage, t.device, t.mb_start, t.mb_stop)
    assert Task.parse_short("2.B3@1:8-11") == (2, "B3", 1, 8, 12)
    assert list(t.microbatches) == list(range(t.mb_start, t.mb_stop))
    with pytest.raises(PlanError, match=r"expected 'round\.stage@device:first-last'"):
        Task.parse_short("F1 on 0")


def test_grid_marks_a_task():
    s = lower(StagePlan.parse("1|1|1"), 2, 2, placement="rotate")
    lines = s.grid(mark=2).splitlines()
    assert lines[0].startswith("dev 0 | ")
    assert "[0.B2]" in lines[0]
    assert "0.B1" in lines[1] and "[" not in lines[1]
    assert lines[-1].strip() == "^ 0.B2@0:0-1"
    assert lines[-1].index("^") == lines[0].index("[0.B2]") + len("[0.B2]") // 2
    assert s.grid() == s.grid(None) and len(s.grid().splitlines()) == 2


def test_free_first_starts_each_round_on_the_device_free_first():
    # F1 is slow (forward 4): iteration 0 leaves the devices free at 12, 19 and
    # 11 (worked out by hand in the comments), so iteration 1 starts on device 2
    costs = LayerCosts([4, 1, 1], [1, 1, 1])
    plan = StagePlan.parse("1,1|1|1,1")  # F1=L0, F2=L1, B1=L2 fused, B2=L1, B3=L0
    clock = Clock(costs, 3)
    s0 = lower(plan, 3, 2, clock=clock, iteration=0)
    # dev0: F1 0-4, 4-8 | dev1: F2 4-5, 8-9 | dev2: B1 5-7, 9-11
    # dev0: B2 R 8-9 B 9-10, R 10-11 B 11-12 (its gradients came at 7 and 11)
    # dev1: B3 R 9-13 B 13-14, R 14-18 B 18-19
    assert s0.as_strings() == ["0.F1@0:0-1", "0.F2@1:0-1", "0.B1@2:0-1", "0.B2@0:0-1", "0.B3@1:0-1"]
    assert clock.free == [12.0, 19.0, 11.0]
    clock.step(0)
    s1 = lower(plan, 3, 2, clock=clock, iteration=1)
    assert s1.as_strings()[0] == "0.F1@2:0-1"
    # the prediction is carried by the schedule
    b2 = [seg for seg in s0.predicted if seg.stage == "B2"]
    assert [(seg.kind, seg.start, seg.end) for seg in b2] == [
        ("R", 8, 9),
        ("B", 9, 10),
        ("R", 10, 11),
        ("B", 11, 12),
    ]


def test_recompute_starts_before_the_gradient_arrives():
    costs = LayerCosts([1, 1, 1, 3], [2, 2, 2, 6])
    plan = StagePlan.parse("3|1|1,1,1")
    clock = Clock(costs, 2, record=True)
    lower(plan, 2, 1, clock=clock)
    segs = {(s.stage, s.kind): s for s in clock.segments}
    # B2 (layer 2) recomputes while the fused stage (head) is still running
    assert segs[("B2", "R")].start < segs[("B1", "B")].end
    assert segs[("B2", "B")].start >= segs[("B1", "B")].end


def test_the_clock_charges_a_layered_stage_its_second_forward():
    costs = LayerCosts([1, 1, 1, 3], [2, 2, 2, 6])
    times = {}
    for text in ("2|2|2", "2|2|2|layered"):
        clock = Clock(costs, 1, record=True)
        sched = lower(StagePlan.parse(text), 1, 1, clock=clock)
        layered = text.endswith("layered")
        assert [t.layered for t in sched.tasks] == [False, layered, layered]
        times[text] = {(s.stage, s.kind): s.end - s.start for s in clock.segments}
    # the fused stage (layers 2-3) and B2 (layers 0-1): backward plus one layer's forward
    assert times["2|2|2|layered"][("B1", "B")] == times["2|2|2"][("B1", "B")] + 1
    assert times["2|2|2|layered"][("B2", "B")] == times["2|2|2"][("B2", "B")] + 1
    assert times["2|2|2|layered"][("B2", "R")] == times["2|2|2"][("B2", "R")]


def test_async_weights_wait_for_the_step_two_windows_back():
    costs = LayerCosts.uniform(3)
    plan = StagePlan.parse("2|1|1,1")
    clock = Clock(costs, 2, optimizer_time=100.0, record=True)
    for it in range(3):
        lower(plan, 2, 2, clock=clock, iteration=it)
        clock.step(it)
    first = {it: min(s.start for s in clock.segments if s.iteration == it) for it in range(3)}
    step0_end = max(s.end for s in clock.segments if s.iteration == 0) + 100.0
    assert first[1] < step0_end  # staleness 1: window 1 does not wait for step 0
    assert first[2] >= step0_end  # window 2 computes with update 0
    sync = Clock(costs, 2, async_optimizer=False, optimizer_time=100.0, record=True)
    lower(plan, 2, 2, clock=sync, iteration=0)
    end0 = sync.step(0)
    lower(plan, 2, 2, clock=sync, iteration=1)
    assert min(s.start for s in sync.segments if s.iteration == 1) >= end0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_devices": 2, "num_microbatches": 0}, "num_microbatches must be an integer >= 1"),
        ({"num_devices": 0, "num_microbatches": 4}, "num_devices must be an integer >= 1"),
        (
            {"num_devices": 2, "num_microbatches": 4, "round_size": 0},
            r"microbatches_per_round must be an integer >= 1, got 0; leave it unset",
        ),
        (
            {"num_devices": 2, "num_microbatches": 4, "start_device": 2, "placement": "rotate"},
            r"start_device \(2\) must be in \[0, 2\)",
        ),
        ({"num_devices": 2, "num_microbatches": 4}, "placement='free-first' needs a clock"),
        (
            {"num_devices": 2, "num_microbatches": 4, "placement": "random"},
            "placement must be 'free-first' or 'rotate'",
        ),
        (
            {"num_devices": 3, "num_microbatches": 4, "clock": Clock(LayerCosts.uniform(3), 2)},
            "the clock models 2 devices, not 3",
        ),
        (
            {"num_devices": 2, "num_microbatches": 4, "clock": Clock(LayerCosts.uniform(5), 2)},
            r"the stages cover 2 layers but the clock's costs have 5",
        ),
    ],
)
def test_lowering_errors(kwargs, match):
    with pytest.raises(PlanError, match=match):
        lower(StagePlan.parse("1|1|1"), **kwargs)

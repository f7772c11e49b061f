import re

import pytest

from lightning_roundpipe.plan import LayerCosts, PlanError, StagePlan


def test_compact_form_round_trips():
    text = "7,7,7,7|1|3,3,3,3,3,3,3,3,2,2"
    plan = StagePlan.parse(text)
    assert str(plan) == text
    assert StagePlan.parse(str(plan)) == plan
    assert plan.num_layers == 29
    assert plan.num_slots == 4 + 1 + 10


def test_all_fused_plan():
    plan = StagePlan.parse("|5|")
    assert plan.forward == () and plan.backward == ()
    assert str(plan) == "|5|"
    assert plan.fused_stage == (0, 5)
    assert plan.num_slots == 1


def test_ranges_and_labels():
    plan = StagePlan.parse("3,2|1|2,2,1")
    assert plan.forward_stages == [(0, 3), (3, 5)]
    assert plan.fused_stage == (5, 6)
    assert plan.backward_stages == [(3, 5), (1, 3), (0, 1)]
    assert [(s.label, s.kind, s.start, s.stop) for s in plan.stages] == [
        ("F1", "forward", 0, 3),
        ("F2", "forward", 3, 5),
        ("B1", "fused", 5, 6),
        ("B2", "backward", 3, 5),
        ("B3", "backward", 1, 3),
        ("B4", "backward", 0, 1),
    ]
    again = StagePlan.from_ranges(plan.forward_stages, plan.fused_stage, plan.backward_stages)
    assert again == plan


def test_stage_times_and_objective():
    costs = LayerCosts([1, 1, 1, 3], [2, 2, 2, 6], memory=[1, 1, 1, 5])
    plan = StagePlan.parse("3|1|1,1,1")
    assert plan.stage_times(costs) == [3, 9, 3, 3, 3]
    assert plan.stage_memory(costs) == [3, 5, 1, 1, 1]
    assert plan.max_stage_time(costs) == 9
    # (M*S + N*(N-1)) * t_max
    assert plan.objective(costs, num_devices=2, num_microbatches=4) == (4 * 5 + 2) * 9


def test_describe_mentions_every_stage():
    costs = LayerCosts([1, 1, 1, 3], [2, 2, 2, 6], memory=[1, 1, 1, 5])
    text = StagePlan.parse("2,1|1|3").describe(costs)
    assert "F1  forward                layers 0-1  time 2  memory 2" in text
    assert "B1  forward+loss+backward  layer 3  time 9" in text
    assert "B2  recompute+backward     layers 0-2" in text


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("3,3|1", "expected three '|'-separated parts"),
        ("3,3|1|3,3|tiled", "optionally followed by '|layered' or '|rewalk'"),
        ("3,a|1|3,3", "forward part '3,a' is not a comma-separated list of integers"),
        ("3|1,1|3", "the fused part must be one integer"),
        ("3,3|0|3,3", "the fused stage has 0 layers; it needs at least one layer"),
        ("3,0|1|3", "forward stage 2 has 0 layers; every stage needs at least one layer"),
        ("3,3|1|3,2", "forward stages cover 6 layers but backward stages cover 5"),
    ],
)
def test_parse_errors_name_the_rule(text, match):
    with pytest.raises(PlanError, match=re.escape(match)):
        StagePlan.parse(text)


def test_layer_count_must_match_model():
    with pytest.raises(
        PlanError,
        match=r"covers 7 layers \(forward 6 \+ fused 1\) but the model has 8; the forward and "
        "fused counts must add up to the number of layers",
    ):
        StagePlan.parse("3,3|1|3,3", num_layers=8)
    with pytest.raises(PlanError, match=r"covers 2 layers .* but the model has 3"):
        StagePlan.parse("1|1|1").stage_times(LayerCosts([1, 1, 1], [1, 1, 1]))


@pytest.mark.parametrize(
    ("forward", "fused", "backward", "match"),
    [
        (
            [(0, 2), (3, 4)],
            (4, 5),
            [(0, 4)],
            "forward stage 2 starts at layer 3 but the previous "
            "stage ends at 2; forward stages must be contiguous",
        ),
        (
            [(0, 2)],
            (3, 5),
            [(0, 2)],
            "the fused stage starts at layer 3 but the forward stages end at 2; they must meet",
        ),
        (
            [(0, 4)],
            (4, 5),
            [(2, 4), (0, 1)],
            "backward stage B3 ends at layer 1 but the stage above it starts at 2",
        ),
        ([(0, 4)], (4, 5), [(2, 4)], "backward stages stop at layer 2; they must reach layer 0"),
        ([(0, 4)], (4, 5), [(0, 4)], None),
        ([(0, 4)], (4, 5), [(0, 4)], "the fused stage must end at the last layer"),
    ],
)
def test_from_ranges_checks_contiguity_and_coverage(forward, fused, backward, match):
    if match is None:
        assert str(StagePlan.from_ranges(forward, fused, backward)) == "4|1|4"
    elif "last layer" in match:
        with pytest.raises(PlanError, match=match):
            StagePlan.from_ranges(forward, fused, backward, num_layers=6)
    else:
        with pytest.raises(PlanError, match=match):
            StagePlan.from_ranges(forward, fused, backward)


def test_layered_plans_round_trip_and_charge_the_second_forward():
    plan = StagePlan.parse("3,2|2|2,3|layered", 7)
    assert plan.layered and str(plan) == "3,2|2|2,3|layered"
    assert StagePlan.parse(str(plan)) == plan != StagePlan.parse("3,2|2|2,3")
    costs = LayerCosts([1, 2, 3, 4, 5, 6, 7], [10, 20, 30, 40, 50, 60, 70])
    stages = {st.label: st for st in plan.stages}
    assert [st.layered for st in plan.stages] == [False, False, True, True, True]
    # forward stages as before; the fused stage and the backward ones run a
    # second forward of every layer but their top one
    assert stages["F1"].time(costs) == 6
    assert stages["B1"].time(costs) == 6 + 7 + 60 + 70 + 6
    assert stages["B2"].time(costs) == 4 + 5 + 40 + 50 + 4
    assert stages["B3"].time(costs) == 1 + 2 + 3 + 10 + 20 + 30 + 1 + 2
    assert "B3  recompute+backward by layer layers 0-2" in plan.describe()
    with pytest.raises(PlanError, match="layered must be True or False"):
        StagePlan((3,), 1, (3,), "yes")


def test_rewalked_plans_round_trip_and_charge_each_layers_input_again():
    plan = StagePlan.parse("3,2|2|2,3|rewalk", 7)
    assert plan.layered and plan.rewalk and str(plan) == "3,2|2|2,3|rewalk"
    assert StagePlan.parse(str(plan)) == plan != StagePlan.parse("3,2|2|2,3|layered")
    costs = LayerCosts([1, 2, 3, 4, 5, 6, 7], [10, 20, 30, 40, 50, 60, 70])
    stages = {st.label: st for st in plan.stages}
    assert [st.rewalk for st in plan.stages] == [False, False, True, True, True]
    # each layer's input computed from the stage input: the layers below it
    # once more, for every layer but the first (B3: layer 0 for layer 1,
    # layers 0-1 for layer 2)
    assert stages["B3"].time(costs) == 1 + 2 + 3 + 10 + 20 + 30 + 1 + (1 + 2)
    assert stages["B2"].time(costs) == 4 + 5 + 40 + 50 + 4  # two layers: as layered
    assert stages["F1"].time(costs) == 6
    assert "B3  recompute+backward by layer, rewalked layers 0-2" in plan.describe()
    with pytest.raises(PlanError, match="rewalk=True needs layered=True"):
        StagePlan((3,), 1, (3,), False, True)
    with pytest.raises(PlanError, match="rewalk must be True or False"):
        StagePlan((3,), 1, (3,), True, 1)
    with pytest.raises(PlanError, match=re.escape("followed by '|layered' or '|rewalk'")):
        StagePlan.parse("3|1|3|rewalked")

import json

import pytest

from lightning_roundpipe.plan import LayerCosts, PlanError


def test_basic_sums_and_sizes():
    c = LayerCosts([1, 2, 3], [2, 4, 6], memory=[10, 20, 30], weight_bytes=[5, 5, 7])
    assert c.num_layers == len(c) == 3
    assert c.forward_time(0, 3) == 6
    assert c.forward_time(1, 2) == 2
    assert c.backward_time(1, 3) == 10
    assert c.recompute_backward_time(0, 2) == 9
    assert c.stage_memory(1, 3) == 50
    assert c.stage_weight_bytes(0, 3) == 17
    assert c.forward == (1, 2, 3)


def test_unknown_memory_is_zero():
    c = LayerCosts([1, 1], [1, 1])
    assert c.stage_memory(0, 2) == 0
    assert c.stage_weight_bytes(0, 2) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"forward": [], "backward": []}, "at least one layer"),
        ({"forward": [1, 2], "backward": [1]}, r"backward has 1 entries but forward has 2"),
        ({"forward": [1, -1], "backward": [1, 1]}, r"forward\[1\] must be finite and >= 0"),
        ({"forward": [1, float("nan")], "backward": [1, 1]}, r"forward\[1\]"),
        ({"forward": [1], "backward": [float("inf")]}, r"backward\[0\]"),
        ({"forward": [1], "backward": [1], "memory": [1, 2]}, "memory has 2 entries"),
        ({"forward": [1], "backward": ["a"]}, r"backward\[0\] must be a number"),
        ({"forward": "12", "backward": [1]}, "must be a sequence of numbers"),
    ],
)
def test_validation_messages(kwargs, match):
    with pytest.raises(PlanError, match=match):
        LayerCosts(**kwargs)


def test_json_round_trip(tmp_path):
    c = LayerCosts([0.5, 1.25], [1, 2.5], memory=[3, 4], weight_bytes=[7, 8])
    path = tmp_path / "costs.json"
    c.save(path)
    assert LayerCosts.load(path) == c
    assert LayerCosts.from_dict(json.loads(path.read_text())) == c


def test_load_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        LayerCosts.load(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(PlanError, match="expected a JSON object"):
        LayerCosts.load(bad)
    with pytest.raises(PlanError, match="unknown LayerCosts keys"):
        LayerCosts.from_dict({"forward": [1], "backward": [1], "fwd": [1]})
    with pytest.raises(PlanError, match="needs the key 'backward'"):
        LayerCosts.from_dict({"forward": [1]})


def test_uniform_with_head():
    c = LayerCosts.uniform(13, head_forward=3, head_backward=6, memory=1, head_memory=4)
    assert c.forward[:12] == (1.0,) * 12 and c.forward[12] == 3
    assert c.backward[12] == 6
    assert c.memory[12] == 4
    with pytest.raises(PlanError, match="num_layers must be >= 1"):
        LayerCosts.uniform(0)
    with pytest.raises(PlanError, match="head_memory needs memory"):
        LayerCosts.uniform(3, head_memory=2)


def test_decoder_costs_follow_the_gqa_formula():
    from lightning_roundpipe.plan import decoder_costs

    s, b, h, m, a, k, v = 2048, 1, 2048, 6144, 16, 8, 151936
    c = decoder_costs(
        28,
        seq=s,
        micro_batch=b,
        hidden=h,
        mlp=m,
        heads=a,
        kv_heads=k,
        vocab=v,
        flops_per_second=1.0,
    )
    assert c.num_layers == 30
    block = 4 * s * b * h**2 + 4 * s * b * h**2 * k / a + 4 * s**2 * b * h + 6 * s * b * h * m
    assert c.forward[1] == block and c.backward[1] == 2 * block
    assert c.forward[-1] == 2 * s * b * h * v  # the LM head
    act = (12 + 4 * k / a) * s * b * h + 6 * s * b * m
    assert c.memory[1] - 2 * c.weight_bytes[1] == act
    # a heavy LM head relative to a block: the reason RoundPipe exists
    assert 2 < c.forward[-1] / c.forward[1] < 10  # ~5x for Qwen3-1.7B shapes

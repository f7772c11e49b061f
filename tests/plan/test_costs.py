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
        # (finite each, but stage sums over them would overflow to inf)
        (
            {"forward": [1e308, 1e308], "backward": [1, 1]},
            r"forward adds up to inf, past 1.8e\+302, .* give the values in a larger unit",
        ),
        ({"forward": [1], "backward": [1e303]}, r"backward adds up to 1e\+303, past"),
        ({"forward": [1], "backward": [1], "memory": [1e305]}, r"memory adds up to 1e\+305"),
        ({"forward": [1], "backward": ["a"]}, r"backward\[0\] must be a number"),
        ({"forward": "12", "backward": [1]}, "must be a list of numbers"),
        (
            {"forward": [1], "backward": [1], "task_overhead": -0.5},
            r"task_overhead must be a finite number >= 0, got -0.5",
        ),
        ({"forward": [1], "backward": [1], "task_overhead": "1"}, r"task_overhead must be"),
        (
            {"forward": [1, 2], "backward": [1, 2], "memory": 7},
            r"memory must be a list of numbers \(one per layer\), got int 7",
        ),
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
    assert "task_overhead" not in c.to_dict()
    o = LayerCosts([0.5, 1.25], [1, 2.5], task_overhead=0.25)
    o.save(path)
    assert LayerCosts.load(path) == o and LayerCosts.load(path).task_overhead == 0.25


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


def test_decoder_costs_of_a_mixture_of_experts_are_heavy_in_weights_light_in_compute():
    from lightning_roundpipe.plan import decoder_costs

    shape = dict(seq=2048, micro_batch=1, hidden=2048, heads=32, kv_heads=4, vocab=151936)
    # Qwen3-30B-A3B-like: 128 experts of width 768, 8 per token
    moe = decoder_costs(4, mlp=768, experts=128, experts_per_token=8, **shape)
    dense = decoder_costs(4, mlp=768 * 8, **shape)  # the same compute per token, dense
    s, b, h = 2048, 1, 2048
    # compute: 8 experts' MLP plus the router, the same attention
    assert moe.forward[1] - dense.forward[1] == pytest.approx(2 * s * b * h * 128 / 1e12)
    # weights: all 128 experts (and the router) go up
    attn = (2 * h * h + 2 * h * h * 4 / 32) * 2
    assert moe.weight_bytes[1] == attn + (3 * h * 768 * 128 + h * 128) * 2
    assert moe.weight_bytes[1] > 10 * dense.weight_bytes[1]
    # DeepSeek-V3-like mix: one dense block first, a shared expert in the others
    mix = decoder_costs(
        3,
        mlp=256,
        experts=8,
        experts_per_token=2,
        shared_mlp=256,
        dense_blocks=1,
        dense_mlp=1024,
        **shape,
    )
    assert mix.weight_bytes[1] == attn + 3 * h * 1024 * 2
    assert mix.weight_bytes[2] == attn + (3 * h * (256 * 8 + 256) + h * 8) * 2
    assert mix.forward[2] < mix.forward[1]  # 3 x 256 visited columns against 1024


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(experts=4, experts_per_token=5), "experts_per_token must be between 0 and experts"),
        (dict(experts=4), "needs experts_per_token >= 1"),
        (dict(experts=4, experts_per_token=1, dense_blocks=3), "dense_blocks must be between"),
    ],
)
def test_decoder_costs_refuse_impossible_experts(kwargs, message):
    from lightning_roundpipe.plan import decoder_costs

    with pytest.raises(PlanError, match=message):
        decoder_costs(
            2, seq=8, micro_batch=1, hidden=8, mlp=8, heads=2, kv_heads=2, vocab=16, **kwargs
        )

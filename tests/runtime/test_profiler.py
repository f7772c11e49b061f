"""Measured auto-partitioning: profiling, re-planning, determinism."""

import time

import pytest
import torch
from torch import nn

from lightning_roundpipe.plan import partition
from lightning_roundpipe.plan.policy import _arrangements
from lightning_roundpipe.runtime import RoundPipeEngine


class Slow(nn.Module):
    """Few parameters (cheap by size-based estimates) but slow to run."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.delay = delay

    def forward(self, x):
        time.sleep(self.delay)
        return torch.tanh(self.lin(x))


def model(slow_at: int, n: int = 10, delay: float = 0.03, others: float = 0.01):
    torch.manual_seed(0)
    layers = [Slow(others) for _ in range(n)]
    layers[slow_at] = Slow(delay)
    return layers


LAYER_BYTES = 72 * 4 * 2  # Linear(8, 8): weights and gradients in fp32


def run(layers, iterations, **kw):
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    kw.setdefault("replan_margin", 0.0)  # any measured improvement: timing noise aside
    eng = RoundPipeEngine(layers, ["cpu"] * 2, 4, profile_iterations=2, **kw)
    plans = [eng.plan]
    try:
        for _ in range(iterations):
            eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
            eng.step()
            plans.append(eng.plan)
        return eng, plans
    finally:
        eng.close()


def stage_of(plan, layer):
    return [st for st in plan.stages if st.start <= layer < st.stop]


def test_a_slow_layer_gets_a_stage_of_its_own_after_replanning():
    layers = model(slow_at=4)
    # at most two layers per stage, so the pipeline has to cut; then a stage of
    # its own for the slow layer (30 ms vs 10 ms) beats pairing it with another
    eng, plans = run(layers, iterations=5, device_memory_limit=2 * LAYER_BYTES)
    costs = eng.measured_costs()
    assert costs is not None
    assert costs.forward[4] > 2 * max(costs.forward[i] for i in range(10) if i != 4)
    assert plans[0] != plans[-1], "the measured plan should replace the size-based one"
    for st in stage_of(plans[-1], 4):
        assert (st.start, st.stop) == (4, 5), f"{st.label} shares the slow layer: {plans[-1]}"
    # the measured plan is the partitioner's plan for the measured costs, its
    # stages perhaps in another order (near-equal measured times)
    formula = partition(costs, 2, 4, memory_limit=2 * LAYER_BYTES)
    assert plans[-1] in _arrangements(formula, costs, 2 * LAYER_BYTES), (plans[-1], formula)


def test_cpu_workers_measure_their_own_host_work_per_stage():
    """A stage pays host work per micro-batch on top of its layers (hand-offs,
    seeding, hooks); with small layers it outweighs them, and the plan from
    size-based costs, one-layer backward stages, is replaced by one with few
    stages. The overhead is the worker thread's CPU time outside the layers'
    marks: a layer that sleeps adds nothing to it."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(32)]
    eng, plans = run(layers, iterations=4)
    costs = eng.measured_costs()
    assert costs.task_overhead > 0
    assert plans[0].num_slots > 20
    assert plans[-1].num_slots < plans[0].num_slots / 2, plans[-1]
    # the overhead is a few small layers' worth (their measured times vary
    # too much from run to run to compare plans without it)
    assert costs.task_overhead > min(costs.forward)
    # sleeping layers: wall time in the layers, none on the thread's clock
    sleepy, _ = run(model(slow_at=4, delay=0.02, others=0.02), iterations=3)
    assert sleepy.measured_costs().task_overhead < 0.01


def test_same_measurements_give_the_same_plan():
    layers = model(slow_at=7)
    eng, _ = run(layers, iterations=4)
    costs = eng.measured_costs()
    assert partition(costs, 2, 4) == partition(costs, 2, 4)
    assert partition(costs, 4, 8) == partition(costs, 4, 8)


def test_a_given_plan_is_never_changed():
    layers = model(slow_at=4)
    _, plans = run(layers, iterations=5, plan="5,4|1|4,5")
    assert all(str(p) == "5,4|1|4,5" for p in plans)


def test_profiling_can_be_turned_off():
    layers = model(slow_at=4, delay=0.0, others=0.0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with RoundPipeEngine(layers, ["cpu"] * 2, 4, profile_iterations=0) as eng:
        for _ in range(3):
            eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
            eng.step()
        assert eng.measured_costs() is None


def test_measured_memory_adds_the_activations_each_layer_saves():
    layers = model(slow_at=4, delay=0.0, others=0.0)
    eng, _ = run(layers, iterations=4)
    # batch 8 in 4 micro-batches of 2: Linear(8, 8) saves its input and tanh its
    # output, 2 x 8 fp32 values each; the weight (saved by the matmul) is not
    # counted. The loss runs as part of the last layer: MSE keeps the difference
    # of output and target (2 x 8 values more)
    assert eng._profiler.activation_bytes() == [2 * (2 * 8 * 4)] * 9 + [3 * (2 * 8 * 4)]
    assert list(eng.measured_costs().memory) == [LAYER_BYTES + 128] * 9 + [LAYER_BYTES + 192]


class Blowup(nn.Module):
    """No parameters (free by size-based estimates) but large activations."""

    def forward(self, x):
        return torch.tanh(x.repeat(1, 64)).reshape(x.shape[0], 64, -1).mean(dim=1)


def test_stages_over_the_limit_with_measured_activations_are_cut(caplog):
    torch.manual_seed(0)
    layers = [Slow(0.0), Blowup(), Slow(0.0), Slow(0.0), Blowup(), Slow(0.0)]
    limit = 5000  # one Blowup (4096 bytes measured) and one Linear fit, two Blowups do not
    with caplog.at_level("INFO", logger="lightning_roundpipe.runtime.engine"):
        eng, plans = run(layers, iterations=4, device_memory_limit=limit, replan_margin=0.9)
    costs = eng.measured_costs()
    assert costs.memory[1] == costs.memory[4] == 2 * 8 * 64 * 4  # tanh's output, 2 samples
    assert max(plans[0].stage_memory(costs)) > limit  # the size-based plan was too big
    assert max(plans[-1].stage_memory(costs)) <= limit  # replaced despite the 0.9 margin
    assert "over the limit" in caplog.text


def test_measured_activations_over_the_limit_are_reported(caplog):
    torch.manual_seed(0)
    layers = [Slow(0.0), Blowup(), Slow(0.0), Slow(0.0), Blowup(), Slow(0.0)]
    with caplog.at_level("INFO", logger="lightning_roundpipe.runtime.engine"):
        # a given plan is kept, with a warning naming what to change
        _, plans = run(layers, iterations=4, device_memory_limit=5000, plan="3,2|1|2,3")
        assert {str(p) for p in plans} == {"3,2|1|2,3"}
        assert "of the given plan 3,2|1|2,3 needs about" in caplog.text
        assert "give a plan with smaller stages or raise num_microbatches" in caplog.text
        # no plan at all fits: the plan is kept and the message says what to raise
        caplog.clear()
        run(layers, iterations=4, device_memory_limit=4000)
        assert "no plan fits the device memory limit with the measured activations" in caplog.text
        assert "raise num_microbatches (smaller micro-batches) or device_memory_limit" in (
            caplog.text
        )


def test_tensors_without_plain_storage_are_skipped_not_fatal():
    from lightning_roundpipe.runtime.profiler import saved_bytes

    lin = nn.Linear(3, 3)
    sparse = torch.randn(3, 3).to_sparse().requires_grad_()
    x = torch.randn(3, 3, requires_grad=True)
    into = {}
    with saved_bytes(lin, into, 0):
        y = torch.sparse.mm(sparse, lin(x))  # saves a sparse tensor for backward
    y.sum().backward()
    assert into[0] == 3 * 3 * 4 * 2  # the input and the dense product; the sparse one skipped
    assert sparse.grad is not None


def test_a_size_limit_holds_for_plans_from_measurements_too():
    # size_limit (weights and gradients, as learned from an out-of-memory error)
    # caps every stage's estimate, also after re-partitioning from measurements;
    # device_memory_limit still bounds the measured activations
    torch.manual_seed(0)
    layers = [Slow(0.0), Blowup(), Slow(0.0), Slow(0.0), Blowup(), Slow(0.0)]
    for device_limit in (None, 5000):
        eng, plans = run(
            layers, iterations=4, size_limit=LAYER_BYTES, device_memory_limit=device_limit
        )
        assert eng._replanned
        for plan in plans:
            assert max(plan.stage_memory(eng.estimates)) <= LAYER_BYTES, plan
        if device_limit is not None:
            assert max(plans[-1].stage_memory(eng.measured_costs())) <= device_limit


def test_a_plan_within_both_limits_is_found_when_one_exists():
    # the fastest plan under the size cap packs the Blowup's activations with
    # its neighbours, over the device limit; a plan with smaller stages meets both
    torch.manual_seed(0)
    layers = [Slow(0.0), Blowup(), *[Slow(0.0) for _ in range(6)]]
    limit, cap = 5000, 2 * LAYER_BYTES
    eng, plans = run(layers, iterations=4, size_limit=cap, device_memory_limit=limit)
    assert max(plans[0].stage_memory(eng.measured_costs())) > limit  # from estimates: too big
    assert max(plans[-1].stage_memory(eng.estimates)) <= cap
    assert max(plans[-1].stage_memory(eng.measured_costs())) <= limit


def test_size_limit_must_be_positive():
    import pytest

    with pytest.raises(ValueError, match="size_limit must be > 0"):
        RoundPipeEngine([nn.Linear(2, 2)], ["cpu"], 1, size_limit=0)


def test_tasks_and_waits_are_named_for_torch_profilers():
    """Every task runs inside a record_function range named by its plan string
    (``RP <iteration>:<task>``), and waits are named too: a profiler that
    records all threads sees them."""
    layers = [nn.Linear(4, 4) for _ in range(4)]
    x = torch.randn(4, 4)
    cfg = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with RoundPipeEngine(layers, ["cpu"] * 2, 2, plan="3|1|1,2") as eng:
        eng.forward_backward(x, labels=x, loss_fn=nn.functional.mse_loss)  # not recorded
        eng.synchronize()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=cfg
        ) as prof:
            eng.forward_backward(x, labels=x, loss_fn=nn.functional.mse_loss)
            eng.synchronize()
        sched = eng.last_schedule
    names = {e.name for e in prof.events() if e.name.startswith("RP ")}
    assert {f"RP 1:{t}" for t in sched.tasks} <= names
    assert not any(n.startswith("RP 0:") for n in names)  # before the profiler ran
    assert any(n.startswith("RP wait grad") for n in names)


def test_measured_and_simulated_timelines_and_a_chrome_trace(tmp_path):
    pytest.importorskip("matplotlib")
    import json

    layers = [nn.Linear(4, 4) for _ in range(5)]
    x = torch.randn(6, 4)
    with RoundPipeEngine(layers, ["cpu"] * 2, 3, plan="2,2|1|2,2", trace=True) as eng:
        for _ in range(4):
            eng.forward_backward(x, labels=x, loss_fn=nn.functional.mse_loss)
            eng.step()
        eng.synchronize()
        ops = eng.trace_operations()
        paths = eng.write_trace(tmp_path)
    assert sorted(p.name for p in paths) == [
        "timeline-measured.png",
        "timeline-simulated.png",
        "trace.json",
    ]
    assert {o["kind"] for o in ops} == {"F", "R", "B"}
    assert all(o["end"] >= o["start"] for o in ops)
    # one operation per stage, micro-batch and part
    per_iteration = 3 * (2 + 2 * 1 + 2 * 2)  # F1, F2; fused F+B; B2, B3 R+B
    assert len([o for o in ops if o["iteration"] == 3]) == per_iteration
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = trace["traceEvents"]
    assert len(events) == len(ops) and {e["tid"] for e in events} == {0, 1}
    assert all(e["ph"] == "X" and e["args"]["task"].startswith("RP ") for e in events)
    with (
        RoundPipeEngine(layers, ["cpu"], 1) as eng,
        pytest.raises(RuntimeError, match="trace=True"),
    ):
        eng.trace_operations()


def test_a_profiler_started_inside_a_named_range_does_not_fail_the_task():
    """A worker's range opened before a profiler starts is closed without
    torch's fast path asserting (it failed whatever task was running)."""
    from lightning_roundpipe.runtime.profiler import named

    r = named("RP task")
    r.__enter__()
    with torch.profiler.profile():
        r.__exit__(None, None, None)


def test_size_based_costs_count_the_experts_a_token_visits():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lightning_roundpipe.runtime import estimate_costs
    from lightning_roundpipe.runtime.profiler import active_parameters

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
    )
    model = Qwen3MoeForCausalLM(config)
    dense, moe = model.model.layers
    experts = moe.mlp.experts
    expert_params = experts.gate_up_proj.numel() + experts.down_proj.numel()
    total = sum(p.numel() for p in moe.parameters())
    # 2 of 8 experts per token; the router and attention count in full
    assert active_parameters(moe) == total - expert_params * 6 / 8
    assert active_parameters(dense) == sum(p.numel() for p in dense.parameters())
    costs = estimate_costs([dense, moe], torch.float32)
    floor = 1e-3 * max(active_parameters(dense), active_parameters(moe))
    assert costs.forward[1] == pytest.approx(total - expert_params * 6 / 8 + floor)
    assert costs.weight_bytes[1] == 4 * total  # every expert goes up


def test_the_trace_keeps_the_last_training_iterations_and_evaluation_calls():
    """(evaluation calls were never dropped, and every recorded operation
    sorted all the kept ones: time and memory grew with each validation)"""
    from lightning_roundpipe.runtime.profiler import TraceRecorder

    cpu = torch.device("cpu")
    rec = TraceRecorder(keep=3)
    for it in range(10):
        for mb in range(4):
            rec.add(0, cpu, it, f"{it}.F1@0:{mb}", "F1", mb, "F", float(it), it + 0.5)
        rec.add(1, cpu, -1 - it, f"eval {it}", "F1", 0, "F", it + 0.6, it + 0.7)
    ops = rec.operations()
    assert sorted({o["iteration"] for o in ops}) == [-10, -9, -8, 7, 8, 9]
    assert len(ops) == 3 * 4 + 3
    assert [o["start"] for o in ops] == sorted(o["start"] for o in ops)

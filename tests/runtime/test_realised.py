"""The runtime realises the lowered schedule: with layers that sleep for known
times, CPU workers run exactly the tasks the simulator lowered, on the same
devices and in the same order, and take about the simulated time."""

import importlib.util
from pathlib import Path

import pytest

from lightning_roundpipe.plan import StagePlan
from lightning_roundpipe.plan.simulate import simulate_schedules

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "schedule.py"


def bench():
    spec = importlib.util.spec_from_file_location("bench_schedule", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(("n", "plan"), [(2, "4,4,4|1|3,3,3,3"), (3, "6,6|1|2,2,2,2,2,2")])
def test_workers_run_the_lowered_tasks_in_the_simulated_time(n, plan):
    mod = bench()
    costs = mod.model_costs(unit=0.003)
    plan = StagePlan.parse(plan)
    m, iterations = 4, 4
    schedules, clock = simulate_schedules(costs, plan, n, m, iterations, async_optimizer=True)
    _, ops = mod.run_engine(costs, plan, n, m, iterations, trace=True)
    for sched in schedules:
        for d in range(n):
            ran = [
                op["task"] for op in ops if op["iteration"] == sched.iteration and op["device"] == d
            ]
            lowered = [str(t) for t in sched.device_tasks(d)]
            assert list(dict.fromkeys(ran)) == lowered, (sched.iteration, d)
    # about the simulated time: the margin holds on a loaded 2-core machine
    # (benchmarks/schedule.py measures it: within 1.10 on an idle one)
    measured = min(mod.run_engine(costs, plan, n, m, iterations)[0] for _ in range(2))
    simulated = max(s.end for s in clock.segments)
    assert measured <= 1.35 * simulated, (measured, simulated)

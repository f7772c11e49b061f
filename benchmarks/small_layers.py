"""Plans for small layers with and without the task overhead in the cost model.

    python benchmarks/small_layers.py [--layers 64 --width 32] [--append docs/benchmarks.md]

A stack of ``Linear(width, width)`` layers on CPU workers: each stage pays
host work per micro-batch (hand-offs, seeding, hooks) on top of its layers,
which for small layers outweighs them. The engine measures that overhead
while profiling (``LayerCosts.task_overhead``) and re-plans with it. This
script runs, alternated in one session, engines that profile and re-plan as
usual, and engines whose profiler records no overhead (what the engine did
before it knew of it), and times the steps after the re-plan; beside each,
the plan it installed and that plan's simulated step with the measured
overhead.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lightning_roundpipe.plan import StagePlan
from lightning_roundpipe.plan.policy import simulated_period
from lightning_roundpipe.runtime import RoundPipeEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit


def layers(num: int, width: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(width, width) for _ in range(num)]


def _steps(eng: RoundPipeEngine, x, y, opt, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.step(opt.step)
        eng.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def run(
    num: int = 64,
    width: int = 32,
    workers: int = 2,
    microbatches: int = 8,
    steps: int = 20,
    rounds: int = 3,
    warmup: int = 5,
) -> tuple[str, dict[str, float]]:
    x, y = torch.randn(2 * microbatches, width), torch.randn(2 * microbatches, width)
    variants = ("without overhead", "with overhead")
    times: dict[str, list[float]] = {k: [] for k in variants}
    plans: dict[str, StagePlan] = {}
    costs = None
    for _ in range(rounds):  # alternated: the machine's drift affects both alike
        for name in variants:
            with RoundPipeEngine(
                layers(num, width),
                ["cpu"] * workers,
                microbatches,
                profile_iterations=2,
                async_optimizer=False,
            ) as eng:
                if name == "without overhead":  # the profiler records none
                    eng._profiler.add_overhead = lambda iteration, seconds: None
                opt = torch.optim.SGD(eng.parameters(), lr=1e-3)
                _steps(eng, x, y, opt, warmup)  # profiled, then re-planned
                times[name] += _steps(eng, x, y, opt, steps)
                plans[name] = eng.plan
                if name == "with overhead":
                    costs = eng.measured_costs()
    assert costs is not None
    lines = [
        f"`Linear({width}, {width})` x {num}, {workers} CPU workers, {microbatches} micro-batches, "
        f"synchronous steps, the plan after profiling; measured overhead "
        f"{costs.task_overhead * 1e3:.3f} ms per stage and micro-batch, mean layer "
        f"forward+backward {(sum(costs.forward) + sum(costs.backward)) / num * 1e3:.3f} ms "
        "(profiled, last round).",
        "",
        "| profiler | plan | slots | simulated step (ms) | measured step, median (ms) |",
        "|---|---|---:|---:|---:|",
    ]
    result = {}
    for name, plan in plans.items():
        sim = simulated_period(costs, plan, workers, microbatches, async_optimizer=False)
        med = statistics.median(times[name])
        result[name] = med
        text = str(plan) if len(str(plan)) <= 40 else str(plan)[:37] + "..."
        lines.append(
            f"| {name} | `{text}` | {plan.num_slots} | {sim * 1e3:.1f} | {med * 1e3:.1f} |"
        )
    return "\n".join(lines) + "\n", result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--append", type=Path)
    args = ap.parse_args()
    table, _ = run(
        args.layers, args.width, args.workers, args.microbatches, args.steps, args.rounds
    )
    head = (
        f"### Small layers: the task overhead in the plan ({datetime.date.today()})\n\n"
        f"`python benchmarks/small_layers.py` on {platform.machine()}, "
        f"{torch.get_num_threads()} intra-op threads, torch {torch.__version__}, "
        f"{_cores()} cores.\n\n"
    )
    emit(head + table, args.append)


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


if __name__ == "__main__":
    main()

"""Does the runtime realise the schedule it lowers?

Layers that sleep for fixed times (``time.sleep`` releases the GIL) turn CPU
workers into devices with known per-layer costs: a forward sleeps ``f``, a
backward ``b``, a recompute ``f`` again. The engine is given those costs, runs
``K`` iterations back to back with the asynchronous optimizer, and its wall
time is held against the simulator's makespan of the same ``K`` lowered
iterations (same plan, same placement). A ratio of 1.0 means the runtime
realises the simulated schedule exactly; the excess is the runtime's own cost
(thread hand-offs, Python per task and micro-batch) plus anything it places
or waits for differently.

    python benchmarks/schedule.py                          # the table
    python benchmarks/schedule.py --append docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lightning_roundpipe.plan import LayerCosts, StagePlan
from lightning_roundpipe.plan.policy import choose_plan
from lightning_roundpipe.plan.simulate import simulate_schedules
from lightning_roundpipe.runtime import RoundPipeEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit


class _Sleep(torch.autograd.Function):
    """``x * w`` that takes ``fwd`` seconds forward and ``bwd`` backward."""

    @staticmethod
    def forward(ctx, x, w, fwd: float, bwd: float):
        time.sleep(fwd)
        ctx.save_for_backward(x, w)
        ctx.bwd = bwd
        return x * w

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.bwd)
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum().reshape(w.shape), None, None


class SleepLayer(nn.Module):
    """A layer with known forward and backward times (seconds)."""

    def __init__(self, fwd: float, bwd: float) -> None:
        super().__init__()
        self.fwd, self.bwd = fwd, bwd
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return _Sleep.apply(x, self.w, self.fwd, self.bwd)


def model_costs(blocks: int = 12, unit: float = 0.002, head: float = 3.0) -> LayerCosts:
    """``blocks`` blocks (forward ``unit``, backward ``2 unit``) and an LM head
    ``head`` times a block, in seconds."""
    return LayerCosts.uniform(
        blocks + 1,
        forward=unit,
        backward=2 * unit,
        head_forward=head * unit,
        head_backward=2 * head * unit,
    )


def _loss(out, _labels):
    return out.float().mean()


def sleep_floor(costs: LayerCosts, plan: StagePlan, m: int) -> float:
    """The same operations as one iteration of ``plan`` (forward stages without
    autograd, the fused stage forward and backward, each backward stage
    recompute and backward), run back to back on this thread without the
    engine, divided by their nominal time: what ``time.sleep`` overshoot and
    autograd cost before any pipeline is involved."""
    layers = [SleepLayer(f, b) for f, b in zip(costs.forward, costs.backward, strict=True)]
    x = torch.randn(1, 4)
    nominal = m * sum(plan.stage_times(costs))
    t0 = time.perf_counter()
    for _ in range(m):
        for st in plan.stages:
            part = layers[st.start : st.stop]
            if st.kind == "forward":
                with torch.no_grad():
                    for layer in part:
                        layer(x)
                continue
            h = x.detach().requires_grad_(st.start > 0)
            for layer in part:
                h = layer(h)
            h.sum().backward()
    return (time.perf_counter() - t0) / nominal


def run_engine(
    costs: LayerCosts, plan: StagePlan, n: int, m: int, iterations: int, trace: bool = False
) -> tuple[float, list[dict] | None]:
    """Wall seconds of ``iterations`` back-to-back asynchronous iterations on
    ``n`` CPU workers (and the recorded operations with ``trace``)."""
    x = torch.randn(m, 4)
    layers = [SleepLayer(f, b) for f, b in zip(costs.forward, costs.backward, strict=True)]
    with RoundPipeEngine(
        layers,
        ["cpu"] * n,
        m,
        plan=plan,
        costs=costs,
        async_optimizer=True,
        profile_iterations=0,
        trace=trace,
    ) as eng:
        t0 = time.perf_counter()
        for _ in range(iterations):
            eng.forward_backward(x, labels=x, loss_fn=_loss)
            eng.step()
        eng.synchronize()
        seconds = time.perf_counter() - t0
        return seconds, eng.trace_operations() if trace else None


def measure(
    costs: LayerCosts, plan: StagePlan, n: int, m: int, iterations: int, repeat: int = 2
) -> tuple[float, float]:
    """(measured seconds, simulated seconds) for ``iterations`` back-to-back
    asynchronous iterations on ``n`` CPU workers: the best of ``repeat`` runs
    after a warm-up run."""
    run_engine(costs, plan, n, m, 1)  # warm-up: first calls, probes, allocations
    measured = min(run_engine(costs, plan, n, m, iterations)[0] for _ in range(repeat))
    _, clock = simulate_schedules(costs, plan, n, m, iterations, async_optimizer=True)
    simulated = max(s.end for s in clock.segments)
    return measured, simulated


def run(
    devices=(1, 2, 3, 4),
    microbatches: int = 8,
    iterations: int = 5,
    unit: float = 0.004,
    fixed: tuple[str, ...] = ("4,4,4|1|3,3,3,3", "6,6|1|2,2,2,2,2,2"),
) -> tuple[str, list[float]]:
    """The table and the ratios (measured / simulated)."""
    costs = model_costs(unit=unit)
    rows = [
        "| workers | plan | micro-batches | simulated (ms) | measured (ms) | measured / simulated "
        "| sleep floor (no engine) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    ratios = []
    floors: dict[StagePlan, float] = {}
    for n in devices:
        plans = [choose_plan(costs, n, microbatches)] + [StagePlan.parse(p) for p in fixed]
        for plan in dict.fromkeys(plans):
            if plan not in floors:
                floors[plan] = sleep_floor(costs, plan, microbatches)
            meas, sim = measure(costs, plan, n, microbatches, iterations)
            ratios.append(meas / sim)
            rows.append(
                f"| {n} | `{plan}` | {microbatches} | {sim * 1e3:.0f} | {meas * 1e3:.0f} | "
                f"{meas / sim:.3f} | {floors[plan]:.3f} |"
            )
    return "\n".join(rows), ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--unit", type=float, default=0.004, help="a block's forward (s)")
    parser.add_argument("--append", type=Path)
    args = parser.parse_args()
    table, ratios = run(tuple(args.devices), args.microbatches, args.iterations, args.unit)
    out = (
        f"### Measured against simulated schedule ({datetime.date.today()})\n\n"
        f"`python benchmarks/schedule.py`: CPU workers running layers that sleep for fixed "
        f"times (12 blocks of forward {args.unit * 1e3:g} ms / backward "
        f"{2 * args.unit * 1e3:g} ms, an LM head 3x a block), {args.iterations} asynchronous "
        f"iterations back to back, wall time against the simulator's makespan of the same "
        f"lowered iterations (best of 2 runs after a warm-up). Sleep floor: the same "
        f"operations on one thread without the engine, over their nominal time (what sleeping "
        f"and autograd cost before any pipeline). Machine: {platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}.\n\n"
        f"{table}\n\nWorst ratio {max(ratios):.3f}, mean {sum(ratios) / len(ratios):.3f}.\n"
    )
    emit(out, args.append)


if __name__ == "__main__":
    main()

"""Simulated bubble ratios: RoundPipe (sync and async) against GPipe, 1F1B,
Interleaved 1F1B and Looped BFS, for 1 to 8 devices; and RoundPipe on the
paper's five models against the reference's own figures.

    python benchmarks/bubbles.py                          # Qwen3-1.7B shapes, size-based costs
    python benchmarks/bubbles.py --costs measured.json    # per-layer times measured by the engine
    python benchmarks/bubbles.py --append docs/benchmarks.md --png-dir docs/images
    python benchmarks/bubbles.py --paper                  # the paper's five models only

``--paper``: the 25 cases in ``../shared/reference/paper_bubble_cases.json``
(per-layer times measured on an RTX 4090, 8 GPUs, 16 micro-batches, the
activation hop time): for each model the reference's asynchronous
steady-state bubble, the reference's plan as our runtime places it, and the
plan we choose (:func:`~lightning_roundpipe.plan.choose_plan`), each lowered
and simulated exactly as the runtime runs it (whole-batch rounds, each round
on the device free first, recompute before the gradient arrives, the
optimizer's ordering rules and the controller's loss wait). The fourth
column: the partitioner's formula plan in rounds of N, the earlier default.

Costs: ``--costs`` reads a LayerCosts JSON (e.g. ``engine.measured_costs().save(path)``
after a few profiled iterations); by default the decoder formula of
:func:`lightning_roundpipe.plan.decoder_costs` for a Qwen3-1.7B-sized model
(28 blocks, hidden 2048, sequence 2048, vocab 151936). RoundPipe uses the
partitioner's plan; the looped baselines use 2 stages per device, all
baselines a min-max balanced cut with activation checkpointing. Micro-batches:
``--microbatches-per-device`` x N. Efficiency: the time one device would need
for the same work without a pipeline and without recompute, divided by N x the
schedule's time per iteration (1.0 = perfect; recompute and bubbles lower it).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from lightning_roundpipe.plan import (
    SCHEDULES,
    LayerCosts,
    StagePlan,
    choose_plan,
    choose_round,
    decoder_costs,
    partition,
    simulate,
    simulated_period,
)
from lightning_roundpipe.plan.simulate import steady_async_bubble

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit

DEVICES = (1, 2, 4, 8)


def default_costs() -> LayerCosts:
    return decoder_costs(
        28,
        seq=2048,
        micro_batch=1,
        hidden=2048,
        mlp=6144,
        heads=16,
        kv_heads=8,
        vocab=151936,
        flops_per_second=1e12,
    )


def run(costs: LayerCosts, per_device: int, devices=DEVICES, png_dir: Path | None = None) -> str:
    rows = [
        "| schedule | "
        + " | ".join(f"N={n} bubble" for n in devices)
        + " | "
        + " | ".join(f"N={n} efficiency" for n in devices if n > 1)
        + " |",
        "|---|" + "---:|" * (2 * len(devices) - (1 in devices)),
    ]
    names = [("roundpipe (sync)", "roundpipe", False), ("roundpipe (async)", "roundpipe", True)]
    names += [(s, s, False) for s in SCHEDULES if s != "roundpipe"]
    for label, schedule, asyn in names:
        bubbles, scaling = [], []
        for n in devices:
            m = per_device * n
            kw = {"stages_per_device": 2} if schedule in ("interleaved-1f1b", "looped-bfs") else {}
            if schedule == "interleaved-1f1b" and m % n:
                bubbles.append("-")
                continue
            res = simulate(schedule, costs, n, m, async_optimizer=asyn, **kw)
            ratio = res.async_bubble_ratio if asyn else res.bubble_ratio
            bubbles.append(f"{ratio:.1%}")
            # throughput per device: micro-batches per unit of time per device
            # steady state with the asynchronous optimizer: iterations back to back
            period = res.work / (n * (1 - ratio)) if asyn else res.makespan
            # efficiency: one device running the whole model without a pipeline
            # and without recompute would take m * ideal; n devices ideally n times less
            ideal = sum(costs.forward) + sum(costs.backward)
            if n > 1:
                scaling.append(f"{m * ideal / (n * period):.2f}")
            if (
                png_dir is not None
                and n == 4
                and schedule in ("roundpipe", "looped-bfs")
                and not asyn
            ):
                from lightning_roundpipe.plan import plot_timeline

                plot_timeline(res, png_dir / f"bubbles-{schedule}-n4.png")
        rows.append(f"| {label} | " + " | ".join(bubbles) + " | " + " | ".join(scaling) + " |")
    return "\n".join(rows)


CASES = Path(__file__).resolve().parents[2] / "shared" / "reference" / "paper_bubble_cases.json"


def paper_cases(path: Path = CASES) -> list[tuple[dict, LayerCosts, StagePlan]]:
    """The RoundPipe cases: (case, per-layer costs with the head last, the
    reference's plan in our compact form)."""
    import json

    out = []
    for c in json.loads(path.read_text()):
        if c["scheduler"] != "roundpipe":
            continue
        n = c["num_layers"]
        costs = LayerCosts(
            [c["fwd_time_per_layer"]] * n + [c["lmhead_fwd_time"]],
            [c["bwd_time_per_layer"]] * n + [c["lmhead_bwd_time"]],
        )
        fwd, bwd = c["stage_partition"].split("|")
        counts = [int(x) for x in bwd.split(",")]
        plan = StagePlan(tuple(int(x) for x in fwd.split(",")), counts[0] + 1, tuple(counts[1:]))
        out.append((c, costs, plan))
    return out


def paper(path: Path = CASES) -> tuple[str, list[tuple[str, float, float]]]:
    """The table, and per model (name, reference bubble, ours)."""
    rows = [
        "| model | reference | reference's plan, our runtime | formula plan in rounds of N "
        "| ours | our plan |",
        "|---|---:|---:|---:|---:|---|",
    ]
    results = []
    for c, costs, ref_plan in paper_cases(path):
        n, m, comm = c["num_gpus"], c["num_microbatches"], c["comm_time"]
        ref = c["result"]["async_steady_bubble_ratio"]
        ref_ours = steady_async_bubble(costs, ref_plan, n, m, comm_time=comm)
        before = steady_async_bubble(
            costs, partition(costs, n, m), n, m, comm_time=comm, round_size=n
        )
        plan = choose_plan(costs, n, m, comm_time=comm)
        ours = steady_async_bubble(costs, plan, n, m, comm_time=comm)
        shown = str(plan) if len(str(plan)) <= 40 else str(plan)[:37] + "..."
        rows.append(
            f"| {c['model']} | {ref:.2%} | {ref_ours:.2%} | {before:.2%} | **{ours:.2%}** | "
            f"`{shown}` |"
        )
        results.append((c["model"], ref, ours))
    return "\n".join(rows), results


def paper_sync(path: Path = CASES) -> tuple[str, list[tuple[str, float, float]]]:
    """One iteration (``roundpipe_sync``) of the paper's cases: the bubble
    with whole-batch rounds and with the round the engine chooses
    (:func:`~lightning_roundpipe.plan.choose_round` with the plan's simulated
    step), against the reference's single-iteration figure."""
    rows = [
        "| model | reference | whole-batch rounds | ours | chosen round |",
        "|---|---:|---:|---:|---:|",
    ]
    results = []
    m = 16  # (the reference's cases all have 16 micro-batches and 8 GPUs)
    for c, costs, _ in paper_cases(path):
        n, comm = c["num_gpus"], c["comm_time"]
        assert c["num_microbatches"] == m
        plan = choose_plan(costs, n, m, async_optimizer=False)

        def step(g: int, plan: StagePlan = plan, costs: LayerCosts = costs, n: int = n) -> float:
            return simulated_period(costs, plan, n, m, async_optimizer=False, round_size=g)

        g = choose_round(m, num_devices=n, period=step).round_size
        kw = {"plan": plan, "comm_time": comm}
        whole = simulate("roundpipe", costs, n, m, **kw).bubble_ratio
        ours = simulate("roundpipe", costs, n, m, microbatches_per_round=g, **kw).bubble_ratio
        ref = c["result"]["bubble_ratio"]
        rows.append(f"| {c['model']} | {ref:.2%} | {whole:.2%} | **{ours:.2%}** | {g} of {m} |")
        results.append((c["model"], ref, ours))
    return "\n".join(rows), results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--costs", type=Path, help="LayerCosts JSON (default: Qwen3-1.7B shapes)")
    parser.add_argument("--microbatches-per-device", type=int, default=4)
    parser.add_argument("--png-dir", type=Path)
    parser.add_argument("--append", type=Path)
    parser.add_argument("--paper", action="store_true", help="the paper's five models only")
    parser.add_argument("--cases", type=Path, default=CASES, help="paper_bubble_cases.json")
    args = parser.parse_args()
    paper_out = ""
    if args.cases.exists():
        table, _ = paper(args.cases)
        sync_table, _ = paper_sync(args.cases)
        paper_out = (
            f"### Asynchronous steady-state bubble on the paper's models "
            f"({datetime.date.today()})\n\n`python benchmarks/bubbles.py --paper`: the "
            "reference's 8-GPU, 16-micro-batch cases (its per-layer times, its activation hop "
            "time), simulated as our runtime lowers and runs them.\n\n" + table + "\n\n"
            "One iteration with the synchronous optimizer (`roundpipe_sync`), against the "
            "reference's single-iteration bubble:\n\n" + sync_table + "\n"
        )
    if args.paper:
        emit(paper_out, args.append)
        return
    costs = LayerCosts.load(args.costs) if args.costs else default_costs()
    source = str(args.costs) if args.costs else "Qwen3-1.7B shapes (decoder_costs)"
    table = run(costs, args.microbatches_per_device, png_dir=args.png_dir)
    out = (
        f"### Simulated bubbles ({datetime.date.today()})\n\n`python benchmarks/bubbles.py`: "
        f"costs from {source}, {costs.num_layers} layers, "
        f"{args.microbatches_per_device} micro-batches per device, no communication time.\n\n"
        f"{table}\n"
    )
    emit(out + ("\n" + paper_out if paper_out else ""), args.append)


if __name__ == "__main__":
    main()

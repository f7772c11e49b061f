"""Simulated bubble ratios: RoundPipe (sync and async) against GPipe, 1F1B,
Interleaved 1F1B and Looped BFS, for 1 to 8 devices.

    python benchmarks/bubbles.py                          # Qwen3-1.7B shapes, size-based costs
    python benchmarks/bubbles.py --costs measured.json    # per-layer times measured by the engine
    python benchmarks/bubbles.py --append docs/benchmarks.md --png-dir docs/images

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

from lightning_roundpipe.plan import SCHEDULES, LayerCosts, decoder_costs, simulate

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--costs", type=Path, help="LayerCosts JSON (default: Qwen3-1.7B shapes)")
    parser.add_argument("--microbatches-per-device", type=int, default=4)
    parser.add_argument("--png-dir", type=Path)
    parser.add_argument("--append", type=Path)
    args = parser.parse_args()
    costs = LayerCosts.load(args.costs) if args.costs else default_costs()
    source = str(args.costs) if args.costs else "Qwen3-1.7B shapes (decoder_costs)"
    table = run(costs, args.microbatches_per_device, png_dir=args.png_dir)
    out = (
        f"### Simulated bubbles ({datetime.date.today()})\n\n`python benchmarks/bubbles.py`: "
        f"costs from {source}, {costs.num_layers} layers, "
        f"{args.microbatches_per_device} micro-batches per device, no communication time.\n\n"
        f"{table}\n"
    )
    emit(out, args.append)


if __name__ == "__main__":
    main()

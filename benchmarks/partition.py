"""Partitioner speed: the exact fast partitioner against the O(L^3) reference.

    python benchmarks/partition.py                  # print the table
    python benchmarks/partition.py --append docs/benchmarks.md

Costs model a decoder-only LM: a cheap embedding, L-2 blocks with +-5% noise
(forward 1, backward 2), an LM head 3x a block; per-layer memory with a limit
that forces several backward stages. Both partitioners must return the same
plan; the table prints the median of repeated runs in milliseconds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from lightning_roundpipe.plan import LayerCosts, partition, partition_exhaustive

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit

LAYERS = (28, 64, 94, 200)
NUM_DEVICES, NUM_MICROBATCHES = 8, 16
TARGETS_MS = {28: 1.0, 94: 15.0}  # issue #2, on a 2-core machine
RESEARCH_MS = {28: 2.9, 94: 1470.0}  # as reported in the RoundPipe paper


def model_costs(num_layers: int, seed: int = 0) -> tuple[LayerCosts, float]:
    rng = random.Random(seed)
    fwd = [rng.uniform(0.95, 1.05) for _ in range(num_layers)]
    fwd[0], fwd[-1] = 0.05, 3.0
    bwd = [2 * f * rng.uniform(0.95, 1.05) for f in fwd]
    mem = [rng.randint(900, 1100) for _ in range(num_layers)]
    mem[-1] = 3000
    return LayerCosts(fwd, bwd, memory=mem), 6000.0


def median_ms(fn, min_time: float = 0.3, max_runs: int = 200) -> float:
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_runs and (time.perf_counter() - start < min_time or len(times) < 3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(reference: bool = True) -> str:
    head = "| layers | plan slots | fast (ms) | O(L^3) reference (ms) | speed-up | target (ms) |"
    rows = [head, "|---:|---:|---:|---:|---:|---:|"]
    for n in LAYERS:
        costs, limit = model_costs(n)
        plan = partition(costs, NUM_DEVICES, NUM_MICROBATCHES, memory_limit=limit)
        fast = median_ms(
            lambda c=costs, lim=limit: partition(c, NUM_DEVICES, NUM_MICROBATCHES, memory_limit=lim)
        )
        if reference:
            ref_plan = partition_exhaustive(costs, NUM_DEVICES, NUM_MICROBATCHES, limit)
            if ref_plan != plan:
                raise SystemExit(f"{n} layers: reference plan {ref_plan} != fast plan {plan}")
            ref = median_ms(
                lambda c=costs, lim=limit: partition_exhaustive(
                    c, NUM_DEVICES, NUM_MICROBATCHES, lim
                ),
                min_time=0.0,
                max_runs=3,
            )
            ref_s, speed = f"{ref:.2f}", f"{ref / fast:.0f}x"
        else:
            ref_s = speed = "-"
        target = TARGETS_MS.get(n)
        rows.append(
            f"| {n} | {plan.num_slots} | {fast:.3f} | {ref_s} | {speed} | "
            f"{'-' if target is None else f'<= {target:g}'} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--append", type=Path, help="append the table to this markdown file")
    parser.add_argument("--no-reference", action="store_true", help="skip the O(L^3) baseline")
    args = parser.parse_args()
    table = run(reference=not args.no_reference)
    header = (
        f"### Partitioner speed ({datetime.date.today()})\n\n"
        f"`python benchmarks/partition.py`: N={NUM_DEVICES} devices, M={NUM_MICROBATCHES} "
        f"micro-batches, memory limit on. Machine: {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}. The research code's "
        f"times from the paper: {RESEARCH_MS[28]} ms for 28 layers, "
        f"{RESEARCH_MS[94]:g} ms for 94.\n"
    )
    out = f"{header}\n{table}\n"
    emit(out, args.append)


if __name__ == "__main__":
    main()

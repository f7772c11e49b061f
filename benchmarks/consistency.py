"""Ablation: the per-parameter event protocol against a blocking copy.

    python benchmarks/consistency.py [--workers 2] [--append docs/benchmarks.md]
    python benchmarks/consistency.py --device cuda --width 4096 --batch 1024 4096   # a GPU

The same model, data and fused AdamW, run with the asynchronous optimizer
(``step`` returns at once; copies are ordered per parameter by events, so the
next window computes while the host updates) and with the blocking copy
(``step`` waits for every stage, then steps and copies the weights before the
next window may start: a barrier before the weight cast). Reports the median
time per iteration (``forward_backward`` + ``step``) of each, in one run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lightning_roundpipe.runtime import RoundPipeEngine, use_fused

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit


def model(width: int, depth: int) -> list[nn.Module]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return [*layers, nn.Linear(width, 1)]


def run(
    async_mode: bool, devices: list[str], width: int, depth: int, iters: int, batch: int
) -> float:
    layers = model(width, depth)
    opt = torch.optim.AdamW([p for m in layers for p in m.parameters()], lr=1e-4)
    use_fused(opt)
    x, y = torch.randn(batch, width), torch.randn(batch, 1)
    times = []
    precision = "bf16-mixed" if devices[0].startswith("cuda") else "32-true"
    with RoundPipeEngine(
        layers,
        devices,
        4,
        async_optimizer=async_mode,
        microbatches_per_round=4,
        precision=precision,
    ) as eng:
        for i in range(iters + 2):
            t0 = time.perf_counter()
            eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
            eng.step(opt.step)
            if i >= 2:  # warm-up excluded
                times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        eng.synchronize()
        drain = time.perf_counter() - t0
    return statistics.median(times) + drain / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=None, help="default: 2 on CPU, 1 on a GPU")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--append", type=Path)
    args = parser.parse_args()
    params = (args.width * args.width + args.width) * args.depth + args.width + 1
    workers = args.workers or (1 if args.device == "cuda" else 2)
    devices = [f"{args.device}:0" if args.device == "cuda" else "cpu"] * workers
    where = (
        f"{workers} worker(s) on {torch.cuda.get_device_name(0)}, bf16"
        if args.device == "cuda"
        else f"{workers} CPU workers, fp32"
    )
    rows = []
    for batch in args.batch:
        blocking = run(False, devices, args.width, args.depth, args.iters, batch)
        events = run(True, devices, args.width, args.depth, args.iters, batch)
        rows.append(
            f"| {batch} | {blocking * 1e3:.1f} | {events * 1e3:.1f} | "
            f"{(blocking - events) / blocking:+.0%} |"
        )
    out = (
        f"### Event protocol vs blocking copy ({datetime.date.today()})\n\n"
        f"`python benchmarks/consistency.py`: {params:,} parameters ({args.depth} x "
        f"Linear({args.width}, {args.width})), {where}, 4 micro-batches, "
        f"fused AdamW; {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}."
        "\n\n| batch | blocking copy, sync (ms/iter) | per-parameter events, async (ms/iter) "
        "| saved |\n|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n"
    )
    emit(out, args.append)


if __name__ == "__main__":
    main()

"""Overheads: controller cost per dispatched (stage, micro-batch), optimizer time
hidden by the asynchronous optimizer, and host memory per parameter.

    python benchmarks/overhead.py [--width 1024 --depth 8] [--append docs/benchmarks.md]

1. Controller and worker cost per (stage slot, micro-batch), tiny layers
   (``benchmarks/engine.py overhead``).
2. Optimizer time per iteration (fused AdamW on the host) and how much of it
   the asynchronous optimizer hides: iteration time synchronous minus
   asynchronous, divided by the optimizer's own time, on the same model in
   the same run.
3. Host bytes per parameter for full fine-tuning with AdamW in bf16, measured
   from the engine's tensors and the optimizer state after a step: the fp32
   parameters (optimizer copy), the bf16 master copy, the fp32 gradient buffer
   and AdamW's two moments. Target: <= 20 bytes/parameter with no pinned
   allocator rounding on top (the master copy is one exactly-sized arena).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
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


def _engine_bench():
    spec = importlib.util.spec_from_file_location(
        "bench_engine", Path(__file__).with_name("engine.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def model(width: int, depth: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)] + [
        nn.Linear(width, 1)
    ]


def optimizer_hiding(width: int, depth: int, iters: int, workers: int) -> tuple[float, ...]:
    """(optimizer ms, sync iteration ms, async iteration ms, hidden fraction)."""
    x, y = torch.randn(16, width), torch.randn(16, 1)
    times = {}
    opt_times = []
    for asyn in (False, True):
        layers = model(width, depth)
        opt = torch.optim.AdamW([p for m in layers for p in m.parameters()], lr=1e-4)
        use_fused(opt)

        def step(opt=opt) -> None:
            t0 = time.perf_counter()
            opt.step()
            opt_times.append(time.perf_counter() - t0)

        its = []
        with RoundPipeEngine(
            layers,
            ["cpu"] * workers,
            4,
            async_optimizer=asyn,
            microbatches_per_round=4,
            profile_iterations=0,
        ) as eng:
            for i in range(iters + 2):
                t0 = time.perf_counter()
                eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
                eng.step(step)
                if i >= 2:
                    its.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            eng.synchronize()
            drain = time.perf_counter() - t0
        times[asyn] = statistics.median(its) + drain / iters
    opt_ms = statistics.median(opt_times)
    hidden = (times[False] - times[True]) / opt_ms if opt_ms else float("nan")
    return opt_ms * 1e3, times[False] * 1e3, times[True] * 1e3, hidden


def host_bytes_per_param(width: int, depth: int) -> tuple[dict[str, float], int]:
    layers = model(width, depth)
    params = [p for m in layers for p in m.parameters()]
    n = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-4)
    x, y = torch.randn(8, width), torch.randn(8, 1)
    with RoundPipeEngine(layers, ["cpu"], 2, precision="bf16-mixed", profile_iterations=0) as eng:
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.step(opt.step)
        mem = eng.host_memory()
    state = sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    parts = {
        "fp32 parameters (optimizer copy)": sum(p.numel() * p.element_size() for p in params),
        "bf16 master copy": mem["master"],
        "fp32 gradient buffer": mem["grad"],
        "gradients still attached after the step": mem["step_grads"],
        "AdamW moments": state,
    }
    return {k: v / n for k, v in parts.items()}, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--append", type=Path)
    args = parser.parse_args()

    controller = _engine_bench().overhead(devices=(1, 2), microbatches=32)
    opt_ms, sync_ms, async_ms, hidden = optimizer_hiding(
        args.width, args.depth, args.iters, args.workers
    )
    per_param, n = host_bytes_per_param(args.width, args.depth)
    total = sum(per_param.values())
    mem_rows = "\n".join(f"| {k} | {v:.2f} |" for k, v in per_param.items())
    out = (
        f"### Overheads ({datetime.date.today()})\n\n`python benchmarks/overhead.py`: "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, CPU workers.\n\n"
        f"Controller and worker cost per (stage slot, micro-batch):\n\n{controller}\n\n"
        f"Optimizer ({n:,} parameters, fused AdamW, {args.workers} worker(s)): step "
        f"{opt_ms:.1f} ms; iteration {sync_ms:.1f} ms synchronous, {async_ms:.1f} ms "
        f"asynchronous; hidden: {hidden:.0%} of the optimizer's time.\n\n"
        f"Host memory per parameter, full fine-tuning, AdamW, bf16:\n\n"
        f"| part | bytes/parameter |\n|---|---:|\n{mem_rows}\n| **total** | **{total:.2f}** |\n"
    )
    emit(out, args.append)


if __name__ == "__main__":
    main()

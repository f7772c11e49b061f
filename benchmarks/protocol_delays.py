"""What the asynchronous optimizer hides, with the GPU's and host's times injected.

    python benchmarks/protocol_delays.py --compute 2 --step 1.8 --weight-copy 0.8 --grad-copy 0.3

CPU workers run a tiny model whose work takes almost nothing; the engine's
``chaos`` hook sleeps at its hand-off points instead: per window ``--compute``
seconds of forward and backward (one fused stage, as the planner makes on one
large GPU), ``--step`` seconds of optimizer step, ``--weight-copy`` seconds of
P copies (fp32 weights into the master copy) and ``--grad-copy`` seconds of G
copies. Sleeping threads need no cores, so the step times show the ordering
rules alone: synchronous, about compute + step + copies; asynchronous, what
the rules leave exposed, with one master copy of the weights
(``double_buffer=False``) and with two (the default). Used to read the step
times of the first H200 run (``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit

LAYERS, MICROBATCHES = 8, 16


def step_times(
    compute: float,
    step: float,
    weight_copy: float,
    grad_copy: float,
    async_mode: bool,
    steps: int,
    double_buffer: bool | None = None,
) -> list[float]:
    import torch
    from torch import nn

    from lightning_roundpipe.runtime import RoundPipeEngine

    params = 2 * LAYERS  # weight and bias of each layer
    sleeps = {
        "forward": compute / 3 / (MICROBATCHES * LAYERS),  # called per layer and micro-batch
        "backward": 2 * compute / 3 / MICROBATCHES,  # per micro-batch
        "step": step,
        "p_copy": weight_copy / params,
        "g_copy": grad_copy / params,
    }

    def chaos(point: str) -> None:
        if point in sleeps:
            time.sleep(sleeps[point])

    torch.manual_seed(0)
    layers = [nn.Linear(16, 16) for _ in range(LAYERS)]
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=1e-3)
    x, y = torch.randn(MICROBATCHES, 16), torch.randn(MICROBATCHES, 16)
    plan = f"|{LAYERS}|"  # one fused stage
    times = []
    with RoundPipeEngine(
        layers,
        ["cpu"],
        MICROBATCHES,
        plan=plan,
        async_optimizer=async_mode,
        double_buffer=double_buffer,
        chaos=chaos,
    ) as eng:
        for _ in range(steps):
            t0 = time.perf_counter()
            eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
            eng.step(opt.step)
            times.append(time.perf_counter() - t0)
        eng.synchronize()
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compute", type=float, default=2.0, help="seconds per window")
    parser.add_argument("--step", type=float, default=1.8)
    parser.add_argument("--weight-copy", type=float, default=0.8)
    parser.add_argument("--grad-copy", type=float, default=0.3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--append", type=Path)
    args = parser.parse_args(argv)
    rows = ["| optimizer | step times (s) | steady step (s) |", "|---|---|---:|"]
    modes = {
        "synchronous": (False, None),
        "asynchronous, one master copy": (True, False),
        "asynchronous, two master copies": (True, True),
    }
    for name, (mode, double) in modes.items():
        got = step_times(
            args.compute, args.step, args.weight_copy, args.grad_copy, mode, args.steps, double
        )
        steady = statistics.median(got[2:]) if len(got) > 2 else statistics.median(got)
        rows.append(f"| {name} | {', '.join(f'{t:.2f}' for t in got)} | {steady:.2f} |")
    emit(
        f"### Protocol with injected times ({datetime.date.today()})\n\n"
        f"`python benchmarks/protocol_delays.py`: one fused stage, compute {args.compute} s, "
        f"step {args.step} s, weight copies {args.weight_copy} s, gradient copies "
        f"{args.grad_copy} s per window.\n\n" + "\n".join(rows) + "\n",
        args.append,
    )


if __name__ == "__main__":
    main()

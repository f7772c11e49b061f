"""Host optimizer throughput: parameters updated per second by torch's AdamW
implementations on this machine's CPU.

    python benchmarks/optimizer.py [--params 50e6] [--append docs/benchmarks.md]

Compares the per-tensor loop (``foreach=False``), the multi-tensor path
(``foreach=True``) and the fused kernel (``fused=True``) on the same fp32
parameters and gradients (tensors shaped like a transformer's), checks that
they agree, and names the fastest.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit


def shapes(total: int, hidden: int = 1024) -> list[tuple[int, ...]]:
    per_block = [
        (hidden,),
        (3 * hidden, hidden),
        (hidden, hidden),
        (hidden,),
        (4 * hidden, hidden),
        (hidden, 4 * hidden),
    ]
    size = sum(torch.Size(s).numel() for s in per_block)
    return per_block * max(1, total // size)


def run(total: int, repeat: int = 5) -> tuple[str, str]:
    torch.manual_seed(0)
    base = [torch.randn(s) for s in shapes(total)]
    grads = [torch.randn(s) * 1e-3 for s in shapes(total)]
    n = sum(p.numel() for p in base)
    variants = {
        "per-tensor (foreach=False)": {"foreach": False},
        "multi-tensor (foreach=True)": {"foreach": True},
        "fused (fused=True)": {"fused": True},
    }
    rows = ["| AdamW path | params/s (M) | time per step (ms) |", "|---|---:|---:|"]
    results, finals = {}, {}
    for name, kw in variants.items():
        params = [torch.nn.Parameter(p.clone()) for p in base]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        try:
            opt = torch.optim.AdamW(params, lr=1e-3, **kw)
        except (RuntimeError, ValueError) as exc:
            rows.append(f"| {name} | unsupported: {exc} | - |")
            continue
        opt.step()  # state allocation outside the timing
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        results[name] = t
        finals[name] = params
        rows.append(f"| {name} | {n / t / 1e6:,.1f} | {t * 1e3:.1f} |")
    ref = finals.get("per-tensor (foreach=False)")
    for params in finals.values():
        for a, b in zip(params, ref, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    best = min(results, key=results.get)
    return "\n".join(rows), best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--append", type=Path)
    args = parser.parse_args()
    table, best = run(int(args.params))
    out = (
        f"### Host optimizer throughput ({datetime.date.today()})\n\n"
        f"`python benchmarks/optimizer.py`: {int(args.params):,} fp32 parameters, "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads.\n\n{table}\n\nFastest: {best} "
        "(all three agree to 1e-5).\n"
    )
    emit(out, args.append)


if __name__ == "__main__":
    main()

"""Longest trainable sequence (micro-batch 1) per strategy, found by bisection.

    python benchmarks/max_seqlen.py                               # smoke: tiny model, CPU
    python benchmarks/max_seqlen.py --size 1.7b --low 1024 --high 262144
    python benchmarks/max_seqlen.py --size 1.7b --devices 1 2     # must not depend on devices

Each probe trains two steps at one sequence length in a fresh process
(``lm_runner.py``); a length passes when no out-of-memory error occurs.
Bisection between ``--low`` and ``--high`` (in multiples of ``--step``).
Target: roundpipe >= 4x the best offloading peer.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_runner import trial
from report import emit


def longest(
    strategy: str, size: str, low: int, high: int, step: int, devices: int, lora: int = 0
) -> str:
    def trial_at(seq: int) -> dict:
        return trial(strategy, size, seq, 1, 1, 2, devices, lora=lora)

    first = trial_at(low)
    if "skipped" in first or "error" in first:
        return first.get("skipped") or first["error"]
    if first.get("oom"):
        return f"< {low}"
    lo, hi = low // step, high // step  # lo passes; search (lo, hi]
    if hi <= lo:  # nothing above --low to search
        return f">= {low}"
    top = trial_at(hi * step)
    if "tokens_per_second" in top:
        return f">= {hi * step}"
    while hi - lo > 1:
        mid = (lo + hi) // 2
        r = trial_at(mid * step)
        if "tokens_per_second" in r:
            lo = mid
        else:
            hi = mid
    return str(lo * step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--low", type=int, default=64)
    parser.add_argument("--high", type=int, default=256)
    parser.add_argument("--step", type=int, default=64)
    parser.add_argument("--devices", type=int, nargs="+", default=[1])
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=["roundpipe", "auto", "fsdp_offload", "deepspeed_offload"],
    )
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--append", type=Path)
    args = parser.parse_args()
    rows = ["| strategy | devices | longest sequence |", "|---|---:|---:|"]
    for s in args.strategies:
        for n in args.devices if s.startswith("roundpipe") else [1]:
            found = longest(s, args.size, args.low, args.high, args.step, n, args.lora)
            rows.append(f"| {s} | {n} | {found} |")
    out = (
        f"### Longest sequence ({datetime.date.today()})\n\n`python benchmarks/max_seqlen.py`: "
        f"size {args.size}{f', LoRA r={args.lora}' if args.lora else ''}, micro-batch 1, "
        f"search {args.low}..{args.high} step {args.step}.\n\n" + "\n".join(rows) + "\n"
    )
    emit(out, args.append)


if __name__ == "__main__":
    main()

"""Throughput: tokens/s of the same LightningModule under each strategy.

    python benchmarks/throughput.py                          # smoke: tiny model, CPU
    python benchmarks/throughput.py --sizes 0.6b 1.7b --seq 2048 --batch 16 --micro 2
    python benchmarks/throughput.py ... --append docs/benchmarks.md

A Qwen3-style causal LM built from a config (sizes in ``lm_runner.SIZES``),
the same global batch for every strategy, each with its micro-batch size;
every trial runs in its own process (``lm_runner.py``). Columns: tokens/s, the
ratio to the no-offload baseline (``auto``, activation checkpointing on, where
the model fits) and to the best offloading peer (FSDP CPU offload, DeepSpeed
ZeRO-3 offload; skipped without CUDA / without deepspeed).
Targets on one GPU: roundpipe >= 90% of no-offload and >= 2x the best peer.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_runner import STRATEGIES, trial
from report import emit


def table(sizes, seq, batch, micro, steps, devices) -> str:
    rows = [
        "| size | strategy | tokens/s | vs no offload | vs best offloading peer |",
        "|---|---|---:|---:|---:|",
    ]
    for size in sizes:
        res = {s: trial(s, size, seq, batch, micro, steps, devices) for s in STRATEGIES}
        tps = {s: r.get("tokens_per_second") for s, r in res.items()}
        base = tps.get("auto")
        peers = [tps[s] for s in ("fsdp_offload", "deepspeed_offload") if tps.get(s)]
        best_peer = max(peers) if peers else None
        for s, r in res.items():
            if "tokens_per_second" in r:
                t = r["tokens_per_second"]
                vs_base = f"{t / base:.0%}" if base else "-"
                peer = best_peer and s.startswith("roundpipe")
                vs_peer = f"{t / best_peer:.2f}x" if peer else "-"
                rows.append(f"| {size} | {s} | {t:,.0f} | {vs_base} | {vs_peer} |")
            else:
                why = "out of memory" if r.get("oom") else r.get("skipped") or r.get("error")
                rows.append(f"| {size} | {s} | {why} | - | - |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny"])
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--append", type=Path)
    args = parser.parse_args()
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only"
    out = (
        f"### Throughput ({datetime.date.today()})\n\n`python benchmarks/throughput.py`: "
        f"{device}, {platform.machine()}, torch {torch.__version__}; sequence {args.seq}, "
        f"global batch {args.batch}, micro-batch {args.micro}, {args.devices} device(s), "
        f"{args.steps} steps.\n\n"
        + table(args.sizes, args.seq, args.batch, args.micro, args.steps, args.devices)
        + "\n"
    )
    emit(out, args.append)


if __name__ == "__main__":
    main()

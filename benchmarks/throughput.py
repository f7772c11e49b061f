"""Throughput: tokens/s of the same LightningModule under each strategy.

    python benchmarks/throughput.py                          # smoke: tiny model, CPU
    python benchmarks/throughput.py --sizes 0.6b 1.7b --seq 2048 --batch 16 --micro 2
    python benchmarks/throughput.py ... --append docs/benchmarks.md --json docs/data/throughput.json

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
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_runner import ABLATIONS, STRATEGIES, trial
from report import emit


def measure(
    sizes, seq, batch, micro, steps, devices, strategies=STRATEGIES, progress=None, lora=0
) -> dict[str, dict[str, dict]]:
    """Every strategy on every size, each in a fresh process: {size: {strategy:
    result}}; ``progress(results)`` is called after each trial."""
    results: dict[str, dict[str, dict]] = {}
    for size in sizes:
        for s in strategies:
            r = trial(s, size, seq, batch, micro, steps, devices, lora=lora)
            results.setdefault(size, {})[s] = r
            sys.stderr.write(f"{size} {s}: {results[size][s]}\n")
            if progress:
                progress(results)
    return results


def _peers(res: dict[str, dict]) -> tuple[float | None, float | None]:
    tps = {s: r.get("tokens_per_second") for s, r in res.items()}
    peers = [tps[s] for s in ("fsdp_offload", "deepspeed_offload") if tps.get(s)]
    return tps.get("auto"), (max(peers) if peers else None)


def table(results: dict[str, dict[str, dict]]) -> str:
    rows = [
        "| size | strategy | tokens/s | vs no offload | vs best offloading peer |",
        "|---|---|---:|---:|---:|",
    ]
    for size, res in results.items():
        base, best_peer = _peers(res)
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


def bars(results: dict[str, dict[str, dict]], title: str, path: Path) -> Path:
    """Bar chart of tokens/s per size and strategy (missing bars say why)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # sizes where nothing was measured (every strategy skipped) get no group
    sizes = [n for n, r in results.items() if any("tokens_per_second" in x for x in r.values())]
    sizes = sizes or list(results)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(STRATEGIES)
    for k, s in enumerate(STRATEGIES):
        for i, size in enumerate(sizes):
            r = results[size].get(s, {})
            x = i + (k - (len(STRATEGIES) - 1) / 2) * width
            t = r.get("tokens_per_second")
            if t:
                ax.bar(x, t, width, color=f"C{k}", label=s if i == 0 else None)
            else:
                why = "OOM" if r.get("oom") else "n/a"
                ax.bar(x, 0, width, color=f"C{k}", label=s if i == 0 else None)
                ax.text(x, 0, why, rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels(sizes)
    ax.set_ylabel("tokens/s (higher is better)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny"])
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument(
        "--strategies", nargs="+", choices=STRATEGIES + ABLATIONS, default=list(STRATEGIES)
    )
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--append", type=Path)
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args()
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only"
    setting = {k: getattr(args, k) for k in ("seq", "batch", "micro", "steps", "devices", "lora")}
    doc = {"date": str(datetime.date.today()), "device": device, "torch": torch.__version__}
    doc["setting"] = {"precision": "bf16-mixed" if torch.cuda.is_available() else "32-true"}
    doc["setting"].update(setting)

    def save(results: dict) -> None:  # after every trial: a stopped run keeps what it measured
        if args.json:
            args.json.write_text(json.dumps({**doc, "results": results}, indent=1) + "\n")

    results = measure(
        args.sizes,
        args.seq,
        args.batch,
        args.micro,
        args.steps,
        args.devices,
        args.strategies,
        save,
        args.lora,
    )
    out = (
        f"### Throughput ({datetime.date.today()})\n\n`python benchmarks/throughput.py`: "
        f"{device}, {platform.machine()}, torch {torch.__version__}; sequence {args.seq}, "
        f"global batch {args.batch}, micro-batch {args.micro}, {args.devices} device(s), "
        f"{f'LoRA r={args.lora}, ' if args.lora else ''}"
        f"{args.steps} steps; tokens/s from the median step after the first.\n\n"
        + table(results)
        + "\n"
    )
    emit(out, args.append)


if __name__ == "__main__":
    main()

"""Bytes one training iteration moves between host and devices, against the least
its schedule could move.

    python benchmarks/traffic.py [--append docs/benchmarks.md]

A decoder-shaped stack (``--blocks`` MLP blocks of width ``--hidden``, an LM
head of ``--vocab``) on CPU workers, which count every copy as the bytes a
device would move. For 1, 2 and 4 workers and 8 micro-batches: rounds of N
micro-batches (the earlier default) against one round per batch (the default
now, within the host activation budget). The minimum is each stage's weights
up once and its fp32 gradients down once per iteration.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import torch
from torch import nn

from lightning_roundpipe.runtime import RoundPipeEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit


def model(blocks: int, hidden: int, vocab: int) -> list[nn.Module]:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Embedding(vocab, hidden)]
    layers += [
        nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        for _ in range(blocks)
    ]
    layers.append(nn.Linear(hidden, vocab))
    return layers


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def measure(n: int, m: int, round_size: int | None, blocks: int, hidden: int, vocab: int, seq: int):
    ids = torch.randint(0, vocab, (m, seq))
    with RoundPipeEngine(
        model(blocks, hidden, vocab),
        ["cpu"] * n,
        m,
        microbatches_per_round=round_size,
        precision="bf16-mixed",
        profile_iterations=0,
    ) as eng:
        for _ in range(2):
            eng.forward_backward(ids, labels=ids, loss_fn=_loss)
            eng.step()
        eng.synchronize()
        return eng.traffic_report(), str(eng.plan)


def run(
    devices=(1, 2, 4),
    m: int = 8,
    blocks: int = 8,
    hidden: int = 256,
    vocab: int = 8192,
    seq: int = 64,
) -> str:
    mib = 2**20
    rows = [
        "| workers | plan | rounds | weights up (MiB) | x minimum | gradients down (MiB) "
        "| x minimum | activations up / down (MiB) |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for n in devices:
        for label, mr in (
            (f"{m // n} rounds of {n} (before)", n),
            (f"1 round of {m} (now)", None),
        ):
            rep, plan = measure(n, m, mr, blocks, hidden, vocab, seq)
            mv = rep.moved
            rows.append(
                f"| {n} | `{plan}` | {label} | {mv['weights_up'] / mib:.1f} | "
                f"{rep.weights_ratio:.2f} | {mv['grads_down'] / mib:.1f} | "
                f"{mv['grads_down'] / rep.grads_minimum:.2f} | "
                f"{mv['acts_up'] / mib:.1f} / {mv['acts_down'] / mib:.1f} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--append", type=Path)
    args = parser.parse_args()
    table = run(blocks=args.blocks, hidden=args.hidden, vocab=args.vocab, seq=args.seq)
    out = (
        f"### Bytes per iteration ({datetime.date.today()})\n\n`python benchmarks/traffic.py`: "
        f"{args.blocks} MLP blocks of width {args.hidden}, an LM head of {args.vocab}, "
        f"8 micro-batches of 1 x {args.seq} tokens, bf16 weights, fp32 gradients; CPU workers "
        f"counting the bytes a device would move ({platform.machine()}, torch "
        f"{torch.__version__}).\n\n{table}\n"
    )
    emit(out, args.append)


if __name__ == "__main__":
    main()

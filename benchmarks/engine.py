"""Engine benchmarks: controller overhead (CPU) and throughput against no offload (GPU).

    python benchmarks/engine.py overhead               # CPU workers, tiny layers
    python benchmarks/engine.py throughput             # one GPU: Llama-style stack
    python benchmarks/engine.py throughput --hidden 2048 --layers 28 --vocab 151936 \\
        --seq 2048 --batch 16 --microbatches 8
    python benchmarks/engine.py all --append docs/benchmarks.md

``overhead``: layers of ``Linear(4, 4)`` so compute is negligible; a plan of
one-layer stages; the wall time of ``forward_backward + synchronize`` per
(stage slot, micro-batch), against a plain PyTorch loop doing the same work
(forward, recompute forward, backward per micro-batch) in the same run.

``throughput``: tokens/s of ``forward_backward + synchronize`` for a
Llama/Qwen3-style decoder (RMSNorm, GQA attention with rotary embeddings,
SwiGLU MLP, LM head + cross-entropy) in bf16, RoundPipe (weights in host
memory) against the same model resident on the GPU with activation
checkpointing per block and the same micro-batches (no optimizer step in
either). With ``--profile`` it also reports the fraction of copy time that
overlaps compute, from a CUDA profiler trace.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_roundpipe.plan import StagePlan
from lightning_roundpipe.runtime import RoundPipeEngine


# ------------------------------------------------------------------ overhead
def overhead(devices: tuple[int, ...] = (1, 2, 4), microbatches: int = 32) -> str:
    torch.set_num_threads(1)
    num_layers = 16
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(num_layers)]
    plan = StagePlan((1,) * (num_layers - 1), 1, (1,) * (num_layers - 1))
    x, y = torch.randn(microbatches, 4), torch.randn(microbatches, 4)
    loss_fn = nn.functional.mse_loss
    seq = nn.Sequential(*layers)

    def plain() -> None:
        for j in range(microbatches):
            xj = x[j : j + 1]
            with torch.no_grad():  # the forward stages
                seq(xj)
            loss_fn(seq(xj), y[j : j + 1]).backward()  # recompute + backward

    rows = [
        "| workers | round size | engine per (slot, mb) (us) | plain (us) | overhead (us) |",
        "|---:|---:|---:|---:|---:|",
    ]
    slots = plan.num_slots * microbatches
    base = _median(plain, repeat=7) / slots * 1e6
    for n in devices:
        for mr in (n, microbatches):
            eng = RoundPipeEngine(
                layers, ["cpu"] * n, microbatches, plan=plan, microbatches_per_round=mr
            )
            try:

                def run(eng=eng) -> None:
                    eng.forward_backward(x, labels=y, loss_fn=loss_fn)
                    eng.synchronize()

                run()
                t = _median(run, repeat=7) / slots * 1e6
            finally:
                eng.close()
            rows.append(f"| {n} | {mr} | {t:.1f} | {base:.1f} | {t - base:.1f} |")
    return "\n".join(rows)


sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit  # noqa: E402


def _median(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------- the model
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def _rotary(x: torch.Tensor, base: float = 1e6) -> torch.Tensor:
    s, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = torch.arange(s, device=x.device, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DecoderBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, mlp: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.norm1 = RMSNorm(hidden)
        self.q = nn.Linear(hidden, heads * self.dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.o = nn.Linear(heads * self.dim, hidden, bias=False)
        self.norm2 = RMSNorm(hidden)
        self.gate = nn.Linear(hidden, mlp, bias=False)
        self.up = nn.Linear(hidden, mlp, bias=False)
        self.down = nn.Linear(mlp, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.dim).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        att = nn.functional.scaled_dot_product_attention(
            _rotary(q), _rotary(k), v, is_causal=True, enable_gqa=True
        )
        x = x + self.o(att.transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class LMHead(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build(
    hidden: int, num_layers: int, vocab: int, heads: int, kv_heads: int, mlp: int
) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Embedding(vocab, hidden),
        *[DecoderBlock(hidden, heads, kv_heads, mlp) for _ in range(num_layers)],
        LMHead(hidden, vocab),
    ]


def throughput(args: argparse.Namespace) -> str:
    if not torch.cuda.is_available():
        return "(throughput: no CUDA device; skipped)"
    dev = torch.device("cuda", 0)
    layers = build(args.hidden, args.layers, args.vocab, args.heads, args.kv_heads, args.mlp)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    labels = torch.randint(0, args.vocab, (args.batch, args.seq))
    tokens = args.batch * args.seq
    m = args.microbatches

    # no offload: the bf16 model on the GPU, checkpointed blocks, same micro-batches
    resident = [
        layer.to(dev, torch.bfloat16)
        for layer in build(
            args.hidden, args.layers, args.vocab, args.heads, args.kv_heads, args.mlp
        )
    ]

    def step_resident() -> None:
        for x, y in zip(ids.chunk(m), labels.chunk(m), strict=True):
            h = resident[0](x.to(dev))
            for blk in resident[1:-1]:
                h = checkpoint(blk, h, use_reentrant=False)
            (lm_loss(resident[-1](h), y.to(dev)) / m).backward()
        torch.cuda.synchronize()

    step_resident()
    t_res = _median(step_resident, args.repeat)
    resident.clear()  # free the GPU copy before RoundPipe runs
    torch.cuda.empty_cache()

    rows = [
        "| strategy | tokens/s | vs no offload |",
        "|---|---:|---:|",
        f"| no offload (activation checkpointing) | {tokens / t_res:,.0f} | 100% |",
    ]
    eng = RoundPipeEngine(
        layers, [dev], m, precision="bf16-mixed", microbatches_per_round=args.round_size or m
    )
    try:

        def step_rp() -> None:
            eng.forward_backward(ids, labels=labels, loss_fn=lm_loss)
            eng.synchronize()

        step_rp()
        t_rp = _median(step_rp, args.repeat)
        rows.append(f"| roundpipe (plan {eng.plan}) | {tokens / t_rp:,.0f} | {t_res / t_rp:.0%} |")
        if args.profile:
            rows.append(f"\ncopy time overlapping compute: {_overlap(step_rp):.0%}")
        mem = eng.host_memory()
        rows.append(
            f"\nhost memory: master {mem['master'] / 2**30:.2f} GiB, gradient buffers "
            f"{mem['grad'] / 2**30:.2f} GiB, page-locked {mem['pinned'] / 2**30:.2f} GiB "
            "(registered exactly, no power-of-two rounding)"
        )
    finally:
        eng.close()
    return "\n".join(rows)


def _overlap(fn) -> float:
    """Fraction of memcpy time on the GPU that overlaps kernel time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    kernels, copies = [], []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (ev.time_range.start, ev.time_range.end)
        (copies if "Memcpy" in ev.name else kernels).append(span)
    kernels.sort()
    merged: list[list[float]] = []
    for a, b in kernels:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = sum(b - a for a, b in copies)
    if total <= 0:
        return math.nan
    covered = 0.0
    for a, b in copies:
        for ka, kb in merged:
            covered += max(0.0, min(b, kb) - max(a, ka))
    return covered / total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["overhead", "throughput", "all"])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--mlp", type=int, default=6144)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--round-size", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--append", type=Path)
    args = parser.parse_args(argv)

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    head = (
        f"### Engine ({datetime.date.today()})\n\nMachine: {platform.machine()}, "
        f"{os.cpu_count()} cores, {device}; torch {torch.__version__}.\n"
    )
    parts = [head]
    if args.what in ("overhead", "all"):
        parts.append(
            "Controller and worker overhead, CPU workers, `Linear(4, 4)` layers, "
            "31 one-layer slots, 32 micro-batches:\n\n" + overhead()
        )
    if args.what in ("throughput", "all"):
        parts.append(
            f"Throughput, hidden {args.hidden}, {args.layers} blocks, vocab "
            f"{args.vocab}, sequence {args.seq}, batch {args.batch}, "
            f"{args.microbatches} micro-batches, bf16:\n\n" + throughput(args)
        )
    out = "\n\n".join(parts) + "\n"
    emit(out, args.append)


if __name__ == "__main__":
    main()

"""Expert compute of a Mixture-of-Experts layer: the pipeline against the model's own forward.

    python benchmarks/experts.py [--hidden 512 --experts 64 --top-k 8 --tokens 1024]
                                 [--append docs/benchmarks.md]

A one-block Qwen3-MoE-shaped causal LM (random weights from a config, small
vocabulary so the MoE block dominates) runs forward + backward of one batch:

* ``own``: the model's own forward and ``loss.backward()`` (plain PyTorch);
* ``roundpipe``: the same model under a RoundPipe engine (the causal-LM
  adapter's pipeline layers on one worker of this machine's device), which
  runs the model's own decoder block and therefore its configured experts
  implementation.

for each transformers experts implementation: ``eager`` (a Python loop over
the experts a batch hits, one matmul pair each, with a host sync to find
them), ``batched_mm`` (per-token gathered expert weights) and ``grouped_mm``
(tokens sorted by expert, one grouped matmul; transformers' default and what
the pipeline runs unless the model says otherwise). Reported: median
milliseconds per forward + backward and tokens/s, the pipeline's time over the
model's own, and every implementation's time over ``grouped_mm``.
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

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def build(impl: str, hidden: int, experts: int, top_k: int, vocab: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    heads = max(1, hidden // 64)
    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=max(8, (3 * hidden) // 8),  # Qwen3-30B-A3B: 768 for 2048
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=hidden // heads,
        num_experts=experts,
        num_experts_per_tok=top_k,
        experts_implementation=impl,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config)


def _time(step, iters: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def own(model, ids: torch.Tensor, iters: int) -> tuple[float, float]:
    """Median seconds per forward + backward of the model itself, and its loss."""
    losses = []

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(float(out.loss.detach()))

    return _time(step, iters), losses[-1]


def pipelined(model, ids: torch.Tensor, iters: int, device: str) -> tuple[float, float]:
    """The same through a RoundPipe engine (one worker, one micro-batch)."""
    from lightning_roundpipe.models import find_adapter
    from lightning_roundpipe.runtime import RoundPipeEngine

    holder = torch.nn.Module()
    holder.model = model
    adapter = find_adapter(holder)
    losses = []
    with RoundPipeEngine(adapter.layers(), [device], 1) as engine:
        adapter.attach(engine)
        try:

            def step() -> None:
                out = model(input_ids=ids, labels=ids)
                out.loss.backward()
                engine.synchronize()
                engine.zero_grad()
                losses.append(float(out.loss.detach()))

            seconds = _time(step, iters)
        finally:
            adapter.detach()
    return seconds, losses[-1]


def run(
    hidden: int = 512,
    experts: int = 64,
    top_k: int = 8,
    tokens: int = 1024,
    vocab: int = 256,
    iters: int = 3,
    implementations: tuple[str, ...] = IMPLEMENTATIONS,
    device: str = "cpu",
) -> str:
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    rows, results = [], {}
    for impl in implementations:
        model = build(impl, hidden, experts, top_k, vocab).to(device)
        t_own, loss_own = own(model, ids.to(device), iters)
        t_rp, loss_rp = pipelined(model, ids, iters, device)
        results[impl] = (t_own, t_rp)
        # same weights, same data: the two must agree before their times mean anything
        if abs(loss_own - loss_rp) > 1e-3 * max(1.0, abs(loss_own)):
            raise AssertionError(f"{impl}: pipeline loss {loss_rp} != model loss {loss_own}")
    base = results.get("grouped_mm", next(iter(results.values())))[0]
    for impl, (t_own, t_rp) in results.items():
        rows.append(
            f"| {impl} | {t_own * 1e3:.1f} | {tokens / t_own:,.0f} | {t_rp * 1e3:.1f} | "
            f"{tokens / t_rp:,.0f} | {t_rp / t_own:.2f} | {t_own / base:.2f} |"
        )
    return (
        "| experts implementation | own fwd+bwd (ms) | own tokens/s | RoundPipe fwd+bwd (ms) "
        "| RoundPipe tokens/s | RoundPipe / own | own / grouped_mm |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--implementations", default=",".join(IMPLEMENTATIONS))
    ap.add_argument("--append", type=Path)
    args = ap.parse_args()
    table = run(
        args.hidden,
        args.experts,
        args.top_k,
        args.tokens,
        iters=args.iters,
        implementations=tuple(args.implementations.split(",")),
        device=args.device,
    )
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()
    out = (
        f"\n## Expert compute of a Mixture-of-Experts layer ({datetime.date.today()})\n\n"
        f"`python benchmarks/experts.py --hidden {args.hidden} --experts {args.experts} "
        f"--top-k {args.top_k} --tokens {args.tokens}` on {args.device} ({where or 'x86_64'}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}): a one-block Qwen3-MoE-shaped "
        f"LM, {args.experts} experts, {args.top_k} per token, one batch of {args.tokens} "
        "tokens, forward + backward, median of the timed iterations after one warm-up. "
        "'own' is the model's own forward and backward, 'RoundPipe' the same model through "
        "the engine (one worker), which runs the model's own block with its configured experts "
        "implementation; the losses are checked equal before timing counts.\n\n" + table
    )
    emit(out, args.append)


if __name__ == "__main__":
    main()

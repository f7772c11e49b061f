"""What one decoder block keeps for its backward per token, untiled and
tiled, and the longest sequence the estimate predicts from it, for
Llama-3.1-8B with LoRA (r = 32) in bf16.

    python benchmarks/activation_per_token.py [--gpu-memory 80] [--host-memory 128]
        [--append docs/benchmarks.md]

The model is built from its config on the meta device (nothing downloaded);
the block's saved bytes are measured by the same short CPU probes the planner
uses (``lightning_roundpipe.models.memory``), reported per token in bytes and
in hidden-sized bf16 values. The baseline is the untiled block in the same
run. The longest sequence at micro-batch 1 on one GPU comes from ``plan
estimate``: bounded by the GPU alone, and with the host memory as well.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit

from lightning_roundpipe.models.attention import backward_workspace
from lightning_roundpipe.models.causal_lm import CausalLMAdapter
from lightning_roundpipe.models.estimate import _meta_model, estimate, materialiser, tile_budget

GIB = 2**30
MILLION = 1 << 20
LORA_RANK = 32


def llama_8b() -> transformers.LlamaConfig:
    """Llama-3.1-8B's shape (public config values)."""
    return transformers.LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=32,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


def saved_per_token(
    config: transformers.LlamaConfig, gpu_memory: float
) -> tuple[dict[str, float], Any]:
    """Bytes per token one block keeps for its backward, never tiled and with
    the tiling a long sequence gets (the slope of the probes' polynomial),
    and the tiled block's activation model."""
    small = transformers.LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})
    adapter = CausalLMAdapter(_meta_model(small, LORA_RANK), "model")
    real = materialiser(torch.bfloat16)

    out = {}
    # the tiles the estimate gives a long sequence on this GPU (tile_memory="auto")
    tiles = adapter.tiles_for(tile_budget(gpu_memory), torch.bfloat16)
    for label, chosen in (("never tiled", {}), ("tiled", tiles)):
        act = adapter.activation_model(torch.bfloat16, chosen, loss=True, prepare=real)
        # the block's bytes per token (rotary tables, kept once per micro-batch, too)
        out[label] = act.saved[1][1] + act.shared[1]
    return out, act


def working_rows(act: Any, seq: int, workspace: float, value: float) -> list[str]:
    """What the tiled block's backward works with beyond what it keeps at
    ``seq`` tokens, per moment the probes traced (in hidden-sized values per
    token), on CUDA: the flash workspace at the attention's backward."""
    w = act.working[1]
    tile = act.mlp_tile

    def most(polys: Any, x: int) -> float:
        return max(c0 + c1 * x + c2 * x * x for c0, c1, c2 in polys)

    moments = {
        "outside the MLP tiles (the largest)": most(w.outside, seq),
        f"in an MLP tile of {tile} tokens": most(w.tile_base, seq) + most(w.tile_work, tile),
        "at the attention's backward, with the CUDA flash workspace": most(w.attention, seq)
        + workspace,
    }
    rows = ["| moment of the backward | values per token |", "|---|---:|"]
    rows += [f"| {k} | {v / value:.2f} |" for k, v in moments.items()]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GiB")
    parser.add_argument("--host-memory", type=float, default=128.0, help="GiB")
    parser.add_argument("--append", type=Path)
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    transformers.logging.set_verbosity_error()
    config = llama_8b()
    hidden_bytes = config.hidden_size * 2
    per_token, tiled = saved_per_token(config, args.gpu_memory * GIB)
    rows = [
        "| block | saved per token (KiB) | hidden-sized bf16 values | vs never tiled |",
        "|---|---:|---:|---:|",
    ]
    base = per_token["never tiled"]
    for label, b in per_token.items():
        rows.append(f"| {label} | {b / 1024:.1f} | {b / hidden_bytes:.2f} | {b / base:.2f}x |")
    kw = dict(gpu_memory=args.gpu_memory * GIB, lora_rank=LORA_RANK, precision="bf16-mixed")
    device = estimate(config, **kw, name="llama-3.1-8b")
    host = dict(host_memory=args.host_memory * GIB, name="llama-3.1-8b")
    both = estimate(config, **kw, **host)
    # the base loaded in bf16: its own master copy, held once on the host
    once = estimate(config, **kw, **host, frozen_dtype=torch.bfloat16)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, no GPU"
    heads = (config.num_attention_heads, config.num_key_value_heads)
    head_dim = config.hidden_size // config.num_attention_heads
    value = MILLION * config.hidden_size * 2
    fused, split = (
        backward_workspace(MILLION, *heads, head_dim, 2, split=s) for s in (False, True)
    )
    out = (
        f"### Activation memory per token of a Llama-3.1-8B block ({datetime.date.today()})\n\n"
        f"`python benchmarks/activation_per_token.py --gpu-memory {args.gpu_memory:g} "
        f"--host-memory {args.host_memory:g}` on {machine} (probes on CPU, model from its "
        f"config; LoRA r={LORA_RANK} on every linear layer, bf16-mixed).\n\n"
        + "\n".join(rows)
        + "\n\n"
        f"Longest sequence at micro-batch 1 predicted by `plan estimate` on one "
        f"{args.gpu_memory:g} GiB GPU: {device.longest_seq} tokens bounded by device "
        f"memory alone; with {args.host_memory:g} GiB of host memory {both.longest_seq} "
        f"tokens ({both.longest_bound}; model state {both.host['state'] / GIB:.1f} GiB, "
        f"the base loaded in fp32) or {once.longest_seq} tokens ({once.longest_bound}; "
        f"model state {once.host['state'] / GIB:.1f} GiB, the base loaded in bf16)"
        + (
            ""
            if once.device_longest_host is None
            else f"; the {once.device_longest_seq} tokens of the device alone need "
            f"{once.device_longest_host / GIB:.0f} GiB of host memory (bf16 base)"
        )
        + ".\n"
        f"\nCUDA flash-attention backward workspace of one block at {MILLION} tokens "
        f"(`backward_workspace`, from PyTorch's kernel source; not measured here): "
        f"{fused / value:.2f} hidden-sized values fused, {split / value:.2f} with the "
        f"backward split over key/value head groups (tiled blocks).\n"
        f"\nWhat the tiled block's backward works with beyond what it keeps, at {MILLION} "
        f"tokens on CUDA (traced op by op by the probes; its output's gradient included):\n\n"
        + "\n".join(working_rows(tiled, MILLION, split, value))
        + f"\n\nA one-layer backward stage at {MILLION} tokens: "
        f"{tiled.stage_peak(1, 2, MILLION, cuda=True) / value:.2f} values per token "
        f"({tiled.stage_peak(1, 2, MILLION, cuda=True) / GIB:.1f} GiB) beside its weights.\n"
    )
    emit(out, args.append)


if __name__ == "__main__":
    main()

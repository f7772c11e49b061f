"""Sliding-window attention over query tiles against the model's dense mask:
peak host memory and time of a one-step long-sequence fit on a CPU worker,
and the longest sequence ``plan estimate`` predicts for Mistral-7B's shape.

    python benchmarks/sliding_window.py [--seq 16384] [--window 512] [--append docs/benchmarks.md]

A tiny-width Mistral (hidden 64, 2 blocks, 4 query and 2 key/value heads,
every layer sliding) with one sequence per micro-batch, ``roundpipe_sync``
on one CPU worker; each trial in a fresh process, reporting how far its
peak resident memory (``VmHWM``, reset at the start; Linux) rises above the
start, and the step's wall time. The baseline is the same fit with the
layers given transformers' dense ``sequence x sequence`` mask, as before
tiling (the adapter's choice patched out in the child).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import textwrap
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESIDENT, emit, measured_fit

GIB = 2**30

CHILD = RESIDENT + textwrap.dedent(
    """
    import gc, json, sys, time
    import lightning as L, torch, transformers
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_roundpipe import RoundPipeStrategy
    from lightning_roundpipe.models import layers

    seq, s = int(sys.argv[1]), json.loads(sys.argv[2])
    if s["dense"]:  # the model's own dense mask, as before tiling
        layers._Decoder._sliding_window = lambda self, *args: None
    transformers.logging.set_verbosity_error()
    config = transformers.MistralConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=s["window"], max_position_embeddings=seq,
        bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM._from_config(config, attn_implementation="sdpa")

    class Fit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.losses = []

        def training_step(self, batch, i):
            loss = self.model(input_ids=batch[0], labels=batch[0]).loss
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ids = torch.randint(0, 1000, (1, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # thread pools and kernels exist before the baseline
        model(input_ids=ids[:, :64])
    gc.collect()
    before = restart_peak()
    strategy = RoundPipeStrategy(async_optimizer=False, num_microbatches=1, profile_iterations=0)
    fit = Fit()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(fit, DataLoader(TensorDataset(ids), batch_size=1))
    seconds = time.perf_counter() - start
    print("RESULT", json.dumps({"grown": status("VmHWM") * 1024 - before,
                                "seconds": seconds, "loss": fit.losses[0]}))
    """
)


def trial(seq: int, window: int, dense: bool) -> dict:
    """One fit in a fresh process: peak growth (bytes), seconds, loss."""
    settings = {"window": window, "dense": dense}
    return measured_fit(CHILD, str(seq), json.dumps(settings))


def mistral_7b():
    """Mistral-7B v0.1's shape (public config values)."""
    import transformers

    return transformers.MistralConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=32,
        vocab_size=32000,
        sliding_window=4096,
        max_position_embeddings=32768,
        rope_theta=10000.0,
    )


def longest(dense: bool, gpu_memory: float) -> int:
    """``plan estimate``'s longest sequence at micro-batch 1 for Mistral-7B
    with LoRA (r = 32) in bf16 on one GPU. ``dense``: the
    layers under the dense mask, counted by hand on top of what the probes
    see (they are shorter than the window, where transformers gives SDPA no
    mask, so the estimate without tiles never saw it): each layer keeps the
    additive bias SDPA makes of the booleans for its backward (``s^2``
    elements in bf16), and the booleans (``s^2`` bytes, shared by a stage's
    layers) and the padded copy of the bias the memory-efficient kernel
    makes when a row's length is not a multiple of 8 are counted as working
    memory. Not measured: a count by hand, on top of the prediction."""
    from lightning_roundpipe.models import layers, memory
    from lightning_roundpipe.models.estimate import estimate

    model = memory.ActivationModel
    original = layers._Decoder._sliding_window, model.saved_bytes, model.transient_bytes

    def blocks(values, extra):
        return [x if i in (0, len(values) - 1) else x + extra for i, x in enumerate(values)]

    def saved(self, seq, micro_batch=1):
        kept = micro_batch * seq * seq * self.element
        return blocks(original[1](self, seq, micro_batch), kept)

    def transient(self, seq, micro_batch=1, *, cuda=False):
        work = micro_batch * seq * seq * (1 + self.element)
        return blocks(original[2](self, seq, micro_batch, cuda=cuda), work)

    if dense:
        layers._Decoder._sliding_window = lambda self, *args: None
        model.saved_bytes, model.transient_bytes = saved, transient
    try:
        est = estimate(
            mistral_7b(),
            gpu_memory=gpu_memory * GIB,
            lora_rank=32,
            precision="bf16-mixed",
            name="mistral-7b",
        )
    finally:
        layers._Decoder._sliding_window, model.saved_bytes, model.transient_bytes = original
    return est.longest_seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GiB, for the estimate")
    parser.add_argument("--no-estimate", action="store_true", help="skip the 7B estimate")
    parser.add_argument("--estimate-only", action="store_true", help="skip the CPU fits")
    parser.add_argument("--append", type=Path)
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, no GPU"
    out = ""
    if not args.estimate_only:
        runs = {dense: trial(args.seq, args.window, dense) for dense in (True, False)}
        mask = args.seq * args.seq  # the dense mask's booleans
        rows = [
            "| sliding-window layers | peak growth (MiB) | step (s) | loss |",
            "|---|---:|---:|---:|",
        ]
        for dense, label in ((True, "dense mask (baseline)"), (False, "query tiles")):
            r = runs[dense]
            rows.append(
                f"| {label} | {r['grown'] / 2**20:.0f} | {r['seconds']:.1f} | {r['loss']:.6f} |"
            )
        out = (
            f"### Sliding-window attention over query tiles ({datetime.date.today()})\n\n"
            f"`python benchmarks/sliding_window.py --seq {args.seq} --window {args.window}` on "
            f"{machine}: a tiny-width Mistral (hidden 64, 2 blocks, every layer sliding), one "
            f"{args.seq}-token sequence, one CPU worker, one step (the dense mask's booleans "
            f"alone: {mask / 2**20:.0f} MiB).\n\n" + "\n".join(rows) + "\n"
        )
    if not args.no_estimate:
        est = {dense: longest(dense, args.gpu_memory) for dense in (True, False)}
        out += (
            f"\n`plan estimate` for Mistral-7B v0.1's shape (window 4096) with LoRA r=32 in "
            f"bf16 on one {args.gpu_memory:g} GiB GPU: longest sequence at micro-batch 1 "
            f"{est[True]:,} tokens with the dense mask counted by hand (each layer's bias "
            "kept for its backward, the booleans and the bias's padded copy at the call: not "
            "measured; the estimate did not count the mask before, its probes being shorter "
            "than the window, where transformers gives SDPA no mask), "
            f"{est[False]:,} with query tiles (predicted; on {machine}).\n"
        )
    emit(out, args.append)


if __name__ == "__main__":
    main()

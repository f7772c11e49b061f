"""Peak host memory of a one-step long-sequence fit on CPU workers, with the
loss chunked and the MLPs tiled (``tile_memory``) and without.

    python benchmarks/long_context.py [--seq 8192] [--append docs/benchmarks.md]

A tiny-width Llama (hidden 64, 2 blocks) with a 32,000-token vocabulary and one
sequence per micro-batch, ``roundpipe_sync`` on one CPU worker; each trial in a
fresh process, reporting how far its peak resident memory (``VmHWM``,
reset at the start; Linux) rises above the start. The fp32 logits of the sequence are the
baseline: untiled, the head keeps them (and more) at once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import LLAMA, RESIDENT, emit

VOCAB = 32_000

CHILD = (
    RESIDENT
    + LLAMA
    + textwrap.dedent(
        """
    import gc, json, sys
    import lightning as L, torch, transformers
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_roundpipe import RoundPipeStrategy

    seq, s = int(sys.argv[1]), json.loads(sys.argv[2])
    model = llama(s, seq)

    class Fit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.peak = -1  # predicted (only with a device_memory_limit)

        def training_step(self, batch, i):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def on_train_batch_end(self, *args):
            peaks = self.trainer.strategy.engine.predicted_peaks
            if peaks:
                self.peak = int(max(peaks))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ids = torch.randint(0, s["vocab"], (s["batch"], seq))
    with torch.no_grad():  # thread pools and kernels exist before the baseline
        model(input_ids=ids[:, :64])
    gc.collect()

    before = restart_peak()
    strategy = RoundPipeStrategy(
        async_optimizer=False, num_microbatches=1, tile_memory=s["tile_memory"],
        device_memory_limit=s["device_memory_limit"], profile_iterations=0,
    )
    fit = Fit()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(fit, DataLoader(TensorDataset(ids), batch_size=s["batch"]))
    print("PEAK", (status("VmHWM") * 1024 - before), fit.peak)
    """
    )
)


def peak_growth(
    seq: int,
    tile_memory: int | None,
    *,
    vocab: int = VOCAB,
    hidden: int = 64,
    mlp: int = 1,
    layers: int = 2,
    batch: int = 1,
    device_memory_limit: int | None = None,
    live: bool = False,
) -> tuple[int, int]:
    """Bytes a one-step fit's peak resident memory rises above its start, in a
    fresh process (the peak of this one says nothing), and the engine's
    predicted peak stage memory (-1 without a ``device_memory_limit``). The
    model: a Llama of ``layers`` blocks, ``hidden`` wide, MLP ``2 x mlp x
    hidden``; ``batch`` sequences of ``seq`` tokens in one micro-batch.
    ``live``: glibc maps every buffer over 128 KiB on its own and unmaps it
    when freed, so resident memory follows the live tensors instead of what
    the heap keeps after they die (fragmentation that tile-sized buffers
    between large ones leave: tens of percent here)."""
    settings = dict(
        vocab=vocab,
        hidden=hidden,
        mlp=mlp,
        layers=layers,
        batch=batch,
        tile_memory=tile_memory,
        device_memory_limit=device_memory_limit,
    )
    env = dict(os.environ)
    if live:  # (glibc's documented tunables; other allocators ignore them)
        env.update(MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(seq), json.dumps(settings)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the measured fit failed:\n{done.stderr[-3000:]}")
    grown, predicted = done.stdout.split("PEAK")[-1].split()
    return int(grown), int(predicted)


def table(seq: int) -> str:
    logits = seq * VOCAB * 4
    rows = [
        f"| tile_memory | peak growth (MiB) | vs the fp32 logits ({logits / 2**20:.0f} MiB) |",
        "|---|---:|---:|",
    ]
    for label, option in (
        ("None (never tile)", None),
        ("128 MiB ('auto' on CPU)", 128 * 2**20),
        ("4 MiB", 4 * 2**20),
    ):
        grown, _ = peak_growth(seq, option)
        rows.append(f"| {label} | {grown / 2**20:.0f} | {grown / logits:.2f}x |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--append", type=Path)
    args = parser.parse_args()
    machine = f"{platform.machine()}, {os.cpu_count()} cores, no GPU"
    out = (
        f"### Long-sequence memory on CPU ({datetime.date.today()})\n\n"
        f"`python benchmarks/long_context.py --seq {args.seq}` on {machine}: one "
        f"{args.seq}-token sequence, vocabulary {VOCAB}, one CPU worker, one step.\n\n"
        + table(args.seq)
        + "\n"
    )
    emit(out, args.append)


if __name__ == "__main__":
    main()

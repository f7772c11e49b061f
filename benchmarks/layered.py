"""Host memory for stage-boundary activations, one-layer stages against the
plan the engine chooses when ``activation_memory`` leaves room for fewer
boundary values (larger backward stages that recompute one layer at a time).

    python benchmarks/layered.py [--seq 4096] [--layers 8] [--hidden 256]
        [--append docs/benchmarks.md]

A Llama of ``--layers`` blocks built from its config, one sequence of
``--seq`` tokens per step and micro-batch, fp32, ``roundpipe_sync`` on one
CPU worker, three steps; each trial in a fresh process. The baseline, in the
same run: the plan with one layer per stage (given), its predicted peak stage
memory setting the device limit of the second trial (1.25x: one layer with its
activations fits a stage, two plain ones do not), whose ``activation_memory``
is 40% of what the baseline held; the third trial runs the chosen plan's cuts
rewalked (``|rewalk``: no layer inputs kept on the device, each computed
again from the stage input), to price that against keeping them. Reported:
the plan, the most boundary bytes
the host held at once (``engine.boundary_peak``), the process's peak resident
memory above its start (``VmHWM``, Linux), seconds per step (the last two)
and the loss after three steps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import LLAMA, RESIDENT, emit, measured_fit

CHILD = (
    RESIDENT
    + LLAMA
    + textwrap.dedent(
        """
    import gc, json, sys, time
    import lightning as L, torch, transformers
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_roundpipe import RoundPipeStrategy

    s = json.loads(sys.argv[1])
    model = llama(s, s["seq"])

    class Fit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.times, self.losses = [], []

        def training_step(self, batch, i):
            self.start = time.perf_counter()
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def on_train_batch_end(self, outputs, *args):
            self.times.append(time.perf_counter() - self.start)
            self.losses.append(float(outputs["loss"]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, s["vocab"], (3, s["seq"]), generator=g)
    with torch.no_grad():  # thread pools and kernels exist before the baseline
        model(input_ids=ids[:1, :64])
    gc.collect()

    before = restart_peak()
    strategy = RoundPipeStrategy(
        async_optimizer=False, num_microbatches=1, plan=s["plan"], tile_memory=None,
        device_memory_limit=s["device_memory_limit"], activation_memory=s["activation_memory"],
        profile_iterations=0,
    )
    fit = Fit()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    engine = {}
    class Keep(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            e = trainer.strategy.engine
            engine.update(plan=str(e.plan), peak=e.boundary_peak,
                          predicted=[int(p) for p in e.predicted_peaks or []])
    trainer.callbacks.append(Keep())
    trainer.fit(fit, DataLoader(TensorDataset(ids), batch_size=1))
    out = dict(engine, grown=(status("VmHWM") * 1024 - before), times=fit.times,
               losses=fit.losses)
    print("RESULT", json.dumps(out))
    """
    )
)


def trial(settings: dict) -> dict:
    """One fit in a fresh process (its peak memory says nothing about the
    next one's)."""
    return measured_fit(CHILD, json.dumps(settings))


def compare(base: dict) -> tuple[dict, dict, dict]:
    """The baseline (one layer per stage), the trial with 40% of its
    boundary bytes as ``activation_memory`` and 1.25x its predicted peak
    stage as the device limit, and that trial's plan rewalked, for the
    model and sequence of ``base``."""
    ones = ",".join(["1"] * (base["layers"] + 1))  # embedding and blocks; the head is fused
    one = trial(
        dict(base, plan=f"{ones}|1|{ones}", device_memory_limit=2**40, activation_memory=None)
    )
    limited = trial(
        dict(
            base,
            plan="auto",
            device_memory_limit=int(1.25 * max(one["predicted"])),
            activation_memory=int(0.4 * one["peak"]),
        )
    )
    cuts = limited["plan"].rsplit("|", 1)[0] if limited["plan"].count("|") == 3 else limited["plan"]
    rewalked = trial(
        dict(
            base,
            plan=f"{cuts}|rewalk",
            device_memory_limit=2**40,
            activation_memory=int(0.4 * one["peak"]),
        )
    )
    return one, limited, rewalked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--append", type=Path)
    args = parser.parse_args()
    base = dict(seq=args.seq, layers=args.layers, hidden=args.hidden, vocab=args.vocab)
    one, limited, rewalked = compare(base)
    rows = [
        "| plan | boundary values held at most (MiB) | peak resident growth (MiB) "
        "| seconds per step | loss after 3 steps |",
        "|---|---:|---:|---:|---:|",
    ]
    # (plans named below the table: their '|' would split a table cell)
    trials = (("one layer per stage (baseline)", one), ("chosen", limited), ("rewalked", rewalked))
    for label, r in trials:
        step = sum(r["times"][1:]) / len(r["times"][1:])
        rows.append(
            f"| {label} | {r['peak'] / 2**20:.1f} | {r['grown'] / 2**20:.0f} "
            f"| {step:.2f} | {r['losses'][-1]:.6f} |"
        )
    slower = (sum(limited["times"][1:]) / sum(one["times"][1:])) - 1
    walked = (sum(rewalked["times"][1:]) / sum(limited["times"][1:])) - 1
    machine = f"{platform.machine()}, {os.cpu_count()} cores, no GPU"
    out = (
        f"### Fewer boundary values on the host: layered stages ({datetime.date.today()})\n\n"
        f"`python benchmarks/layered.py --seq {args.seq} --layers {args.layers} --hidden "
        f"{args.hidden} --vocab {args.vocab}` on {machine}: a Llama of {args.layers} blocks, "
        f"hidden {args.hidden}, one {args.seq}-token sequence per step, fp32, one CPU "
        "worker, synchronous optimizer; the second trial's activation_memory is 40% of what "
        "the first held, its device limit 1.25x the first's predicted peak stage.\n\n"
        + "\n".join(rows)
        + f"\n\nPlans: `{one['plan']}` (baseline), `{limited['plan']}` (chosen) and "
        f"`{rewalked['plan']}` (rewalked). The chosen plan holds "
        f"{limited['peak'] / one['peak']:.2f}x the boundary bytes and takes {slower:+.0%} "
        f"time per step; rewalked, its stages keep no layer inputs on the device for "
        f"{walked:+.0%} time per step against the chosen plan.\n"
    )
    emit(out, args.append)


if __name__ == "__main__":
    main()

"""Regenerate the documentation's pictures, all but the GPU profile, with one command.

    python examples/make_pictures.py            # into docs/images/
    python examples/make_pictures.py --out /tmp/pics --steps 20

- Figure 1 timelines (RoundPipe vs Looped BFS, and two overlapping iterations)
  from ``figure1_timeline.py``;
- a bar chart of simulated bubble ratios across schedules for 4 and 8 devices
  (Qwen3-1.7B shapes, ``benchmarks/bubbles.py``'s setting);
- loss curves of the tiny LM main job under ``strategy="roundpipe_sync"``,
  ``"roundpipe"`` and ``"auto"`` (same module, data and seed; sync equals auto);
- throughput bars from ``benchmarks/throughput.py``'s raw results
  (``docs/data/gpu-throughput.json``, written with ``--json``; when the file is
  missing, the smoke setting is measured on this machine and saved there);
- the five ordering rules of the asynchronous optimizer, from a recorded trace
  (``protocol_trace.py``).

The H200 profile timeline (``docs/images/gpu-timeline-h200.png``) is drawn
from a recorded GPU trace by ``benchmarks/trace_summary.py --picture``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _save(fig, ax, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def bubble_bars(out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lightning_roundpipe.plan import SCHEDULES, simulate

    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    from bubbles import default_costs  # the benchmark's Qwen3-1.7B shapes

    costs = default_costs()
    labels = ["roundpipe (async)", *SCHEDULES]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.38
    for k, n in enumerate((4, 8)):
        m = 4 * n
        vals = []
        for label in labels:
            name = "roundpipe" if label.startswith("roundpipe") else label
            kw = {"stages_per_device": 2} if name in ("interleaved-1f1b", "looped-bfs") else {}
            res = simulate(name, costs, n, m, async_optimizer=label.endswith("(async)"), **kw)
            vals.append(
                100 * (res.async_bubble_ratio if label.endswith("(async)") else res.bubble_ratio)
            )
        xs = [i + (k - 0.5) * width for i in range(len(labels))]
        ax.bar(xs, vals, width, label=f"{n} devices, {m} micro-batches")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("bubble ratio (%)")
    ax.set_title("Simulated bubbles, Qwen3-1.7B shapes (lower is better)", fontsize=10)
    return _save(fig, ax, out / "bubbles-bars.png")


def loss_curves(out: Path, steps: int) -> Path:
    import lightning as L
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from train_tiny_lm import Throughput, TinyLM, TinyTextData

    import lightning_roundpipe  # noqa: F401
    from lightning_roundpipe import RoundPipeStrategy

    curves = {}
    for label, strategy, devices in [
        ("auto (1 device)", "auto", 1),
        (
            "roundpipe_sync (2 workers)",
            RoundPipeStrategy(async_optimizer=False, num_microbatches=4),
            2,
        ),
        ("roundpipe async (2 workers)", RoundPipeStrategy(num_microbatches=4), 2),
    ]:
        L.seed_everything(0)
        cb = Throughput()
        trainer = L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=devices,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[cb],
            log_every_n_steps=1,
            limit_val_batches=0,
        )
        trainer.fit(TinyLM(), TinyTextData(batch_size=16))
        curves[label] = cb.losses
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for (label, losses), style in zip(curves.items(), ["-", "--", ":"], strict=True):
        ax.plot(range(1, len(losses) + 1), losses, style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(
        "Tiny LM, AdamW lr 3e-3: sync matches ordinary training; one-step-stale async "
        "lags at this high learning rate",
        fontsize=9,
    )
    return _save(fig, ax, out / "loss-curves.png")


def throughput_bars(out: Path, results: Path) -> Path:
    import json

    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    import throughput

    if results.exists():
        doc = json.loads(results.read_text())
    else:  # the smoke setting, measured here (CPU workers without a GPU)
        import datetime

        import torch

        setting = dict(seq=64, batch=8, micro=2, steps=4, devices=1)
        doc = {
            "date": str(datetime.date.today()),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only",
            "setting": setting,
            "results": throughput.measure(["tiny"], **setting),
        }
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(doc, indent=1) + "\n")
    st = doc["setting"]
    title = (
        f"Throughput, {doc['device']} ({doc['date']}): sequence {st['seq']}, batch "
        f"{st['batch']}, micro-batch {st['micro']}, {st['devices']} device(s)"
    )
    return throughput.bars(doc["results"], title, out / "throughput-bars.png")


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE.parent / "docs" / "images")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument(
        "--throughput",
        type=Path,
        default=HERE.parent / "docs" / "data" / "gpu-throughput.json",
        help="raw results of benchmarks/throughput.py --json (measured here if missing); "
        "by default the GPU record",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import figure1_timeline

    figure1_timeline.main(["--out", str(args.out)])
    import protocol_trace

    written = [
        bubble_bars(args.out),
        loss_curves(args.out, args.steps),
        throughput_bars(args.out, args.throughput),
        protocol_trace.main(["--out", str(args.out)]),
    ]
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()

"""Two RoundPipe servers on this machine: the gradient reduction's exposed time.

    python benchmarks/multinode.py [--steps 12] [--hidden 256] [--append docs/benchmarks.md]

Two processes stand in for two servers (gloo over loopback, started as a
manual multi-node launch sets them up: ``MASTER_ADDR``, ``MASTER_PORT``,
``NODE_RANK``), each a ``roundpipe_sync`` / ``roundpipe`` replica on one CPU
worker with the same per-server batch; the baseline in the same run is one
server alone. Reported per mode: steady step time (after two warm-up steps)
of one server and of two, the gradient bytes each server all-reduced per step,
the time an all-reduce was in flight, and how long the optimizer waited for
the average after the server's own gradients were in (with the synchronous
optimizer that wait is the reduction's exposed time; with the asynchronous
one it is hidden while it fits in the next window's compute, and the step
times tell). On one machine the two servers also share its cores, so the
step-time ratio mixes that contention in.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import lightning as L, torch, transformers
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_roundpipe import RoundPipeStrategy

    s = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    L.seed_everything(0)
    config = transformers.LlamaConfig(
        vocab_size=4000, hidden_size=s["hidden"], intermediate_size=4 * s["hidden"],
        num_hidden_layers=s["layers"], num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=s["seq"], bos_token_id=None, eos_token_id=None,
    )
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")

    class Fit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.marks = []

        def training_step(self, batch, i):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def on_train_batch_start(self, *args):
            self.marks.append(time.perf_counter())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    ids = torch.randint(0, 4000, (s["batch"] * (s["steps"] + 1) * s["nodes"], s["seq"]))
    fit = Fit()
    strategy = RoundPipeStrategy(
        async_optimizer=s["async"], num_microbatches=2, profile_iterations=0
    )
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, num_nodes=s["nodes"],
        max_steps=s["steps"], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    seen = {}

    class Keep(L.Callback):
        def on_train_end(self, trainer, module):
            trainer.strategy.engine.synchronize()  # the last window's reduction too
            seen["reduction"] = trainer.strategy.engine.reduction

    trainer.callbacks.append(Keep())
    trainer.fit(fit, DataLoader(TensorDataset(ids), batch_size=s["batch"]))
    steps = fit.marks[2:]  # after two warm-up steps
    per_step = (steps[-1] - steps[0]) / (len(steps) - 1)
    out = {"step": per_step, "reduction": seen.get("reduction"), "rank": trainer.global_rank}
    print("RESULT", json.dumps(out))
    """
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(settings: dict, nodes: int) -> list[dict]:
    """One trial: ``nodes`` server processes; their RESULT lines."""
    port = str(_port())
    procs = []
    for rank in range(nodes):
        env = dict(os.environ)
        if nodes > 1:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(rank))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", CHILD, json.dumps({**settings, "nodes": nodes})],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"a server failed:\n{err[-3000:]}")
        results.append(json.loads(out.split("RESULT", 1)[1]))
    return results


def table(settings: dict) -> str:
    rows = [
        "| optimizer | one server: step (s) | two servers: step (s) | all-reduced per step "
        "| all-reduce in flight per step (s) | optimizer waited per step (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode in (False, True):
        s = {**settings, "async": mode}
        one = run(s, 1)[0]
        two = run(s, 2)
        red = two[0]["reduction"]
        windows = red["windows"]
        rows.append(
            f"| {'asynchronous' if mode else 'synchronous'} | {one['step']:.3f} "
            f"| {max(r['step'] for r in two):.3f} "
            f"| {red['bytes'] / windows / 2**20:.1f} MiB "
            f"| {red['busy_seconds'] / windows:.3f} "
            f"| {red['wait_seconds'] / windows:.3f} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--append", type=Path)
    args = parser.parse_args()
    settings = dict(
        steps=args.steps, hidden=args.hidden, layers=args.layers, seq=args.seq, batch=args.batch
    )
    machine = f"{platform.machine()}, {os.cpu_count()} cores, no GPU"
    out = (
        f"### Two servers on one machine: the gradient reduction ({datetime.date.today()})\n\n"
        f"`python benchmarks/multinode.py --steps {args.steps} --hidden {args.hidden}` on "
        f"{machine}: a Llama of {args.layers} blocks, hidden {args.hidden}, vocabulary 4000; "
        f"{args.batch} sequences of {args.seq} tokens per server and step, one CPU worker "
        "per server, gloo over loopback. Optimizer waited: for the average after the "
        "server's own gradients were in (exposed with the synchronous optimizer; hidden "
        "behind the next window with the asynchronous one unless the step times grow); "
        "averages over all steps, warm-up included; step times after two warm-up steps.\n\n"
        + table(settings)
        + "\n"
    )
    emit(out, args.append)


if __name__ == "__main__":
    main()

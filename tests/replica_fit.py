"""One server's process of a multi-server RoundPipe fit (tests/test_servers.py
launches it under torchrun, or with the environment variables a manual launch
sets, or alone as the one-server reference).

    python tests/replica_fit.py OUT --nodes N --batch-size B [--async] [--fail-at K]
        [--kill-at K] [--hang-at K] [--oom-once] [--no-log] [--steps S]
    python tests/replica_fit.py --zygote   # forks servers on request (see zygote())

Writes ``OUT/rank{r}.pt`` (the parameters, the logged metrics and how many
samples the replica saw), ``OUT/last.ckpt`` (rank 0, through the Trainer) or,
when the fit fails, ``OUT/error{r}.txt`` with the exception.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time
import traceback
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from strategy.modules import CausalLM, lm_data
from torch.utils.data import DataLoader, DistributedSampler

from lightning_roundpipe import RoundPipeStrategy


class Replica(CausalLM):
    """The tests' causal LM; logs its loss across servers, counts its samples
    and fails on request."""

    def __init__(
        self,
        fail_at: int | None = None,
        kill_at: int | None = None,
        hang_at: int | None = None,
        sync_log: bool = True,
    ) -> None:
        super().__init__("qwen3", lr=1e-3)
        self.fail_at, self.kill_at, self.hang_at = fail_at, kill_at, hang_at
        self.sync_log = sync_log
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        rank = self.trainer.global_rank
        if self.kill_at is not None and rank == 1 and self.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fail_at is not None and rank == 1 and self.global_step == self.fail_at:
            raise ValueError("injected failure on the second server")
        if self.hang_at is not None and rank == 1 and self.global_step == self.hang_at:
            time.sleep(600)
        out = self.model(input_ids=batch[0], attention_mask=batch[1], labels=batch[2])
        # (after the forward: a step run again after a re-plan saw its batch once)
        self.seen.extend(batch[0][:, 0].tolist())
        if self.sync_log:  # a collective of the loop's thread in every step
            self.log("synced_loss", out.loss, sync_dist=True)
        return out.loss


def run_out_of_memory_once() -> None:
    """The first stage of several layers in this process's first batch raises
    torch.OutOfMemoryError (as a GPU that ran out would), so that this server
    alone re-plans, with smaller stages, and runs the batch again."""
    from lightning_roundpipe.runtime import worker

    original = worker.Worker._layers
    fired = []

    def layers(self, job, *args, **kwargs):
        task = job.task
        if not fired and job.call.iteration == 0 and task.stop - task.start > 1:
            fired.append(task)
            raise torch.OutOfMemoryError("CUDA out of memory (injected on one server)")
        return original(self, job, *args, **kwargs)

    worker.Worker._layers = layers


class _StopEverywhere(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("the first fit stopped on purpose")


def stopped_fit(args: argparse.Namespace) -> None:
    """A fit every server stops with the same exception, which the script
    catches (a pruned trial, a retry loop): the next fit of these processes
    must not take its failure report for a new one."""
    strategy = RoundPipeStrategy(async_optimizer=args.async_, watchdog_timeout=args.watchdog)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        num_nodes=args.nodes,
        max_steps=3,
        callbacks=[_StopEverywhere()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(Replica(None, None, None, False), DataLoader(lm_data(n=16, pad=False), 4))
    except RuntimeError as exc:
        assert "stopped on purpose" in str(exc), exc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--async", dest="async_", action="store_true")
    parser.add_argument("--fail-at", type=int)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--hang-at", type=int)
    parser.add_argument("--oom-once", action="store_true", help="on rank 1")
    parser.add_argument("--no-log", action="store_true")
    parser.add_argument("--resume", type=Path, help="a checkpoint to resume from")
    parser.add_argument("--watchdog", type=float, default=60.0)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--clip", type=float, default=0.05)
    parser.add_argument("--rank1-bucket", type=int, help="reduce_bucket_bytes on rank 1")
    parser.add_argument("--rank1-steps", type=int, help="max_steps on rank 1")
    parser.add_argument(
        "--init-by-rank", action="store_true", help="each server's weights start differently"
    )
    parser.add_argument(
        "--exception-checkpoint", action="store_true", help="with an OnExceptionCheckpoint"
    )
    parser.add_argument(
        "--stopped-fit-first",
        action="store_true",
        help="first a fit that every server stops with an exception, caught",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # two servers share this machine's cores
    if args.stopped_fit_first:
        stopped_fit(args)
    L.seed_everything(0)
    module = Replica(args.fail_at, args.kill_at, args.hang_at, not args.no_log)
    rank = int(os.environ.get("RANK", os.environ.get("NODE_RANK", "0")))
    if args.init_by_rank:  # (a head initialised without a seed, LoRA's random A)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.01 * rank)
    init = [p.detach().clone() for p in module.parameters()]
    strategy = RoundPipeStrategy(
        async_optimizer=args.async_,
        num_microbatches=2,
        watchdog_timeout=args.watchdog,
        # several buckets even for this small model
        reduce_bucket_bytes=args.rank1_bucket if args.rank1_bucket and rank == 1 else 8192,
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        num_nodes=args.nodes,
        max_steps=args.rank1_steps if args.rank1_steps and rank == 1 else args.steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip or None,  # clipped: the norm must be the global one
        logger=False,
        callbacks=[OnExceptionCheckpoint(args.out)] if args.exception_checkpoint else None,
        enable_checkpointing=args.exception_checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if args.oom_once and rank == 1:
        run_out_of_memory_once()
    try:
        data = lm_data(n=64, pad=False)
        if args.nodes == 1:
            # the order Lightning's sampler gives the servers' shards (shuffled
            # with seed 0): batch i here is the union of the servers' batches i
            sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
            batches = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
        else:
            batches = DataLoader(data, batch_size=args.batch_size)
        trainer.fit(module, batches, ckpt_path=args.resume)
        trainer.save_checkpoint(args.out / "last.ckpt")
    except BaseException as exc:
        (args.out / f"error{rank}.txt").write_text(
            f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        )
        # the weights the module holds after the failure, with its step count
        failed = {"params": [p.detach().clone() for p in module.parameters()]}
        torch.save({**failed, "global_step": trainer.global_step}, args.out / f"failed{rank}.pt")
        raise
    torch.save(
        {
            "params": [p.detach().clone() for p in module.parameters()],
            "init": init,
            "metrics": {k: v.clone() for k, v in trainer.callback_metrics.items()},
            "seen": module.seen,
            "world_size": trainer.world_size,
            "global_rank": trainer.global_rank,
        },
        args.out / f"rank{trainer.global_rank}.pt",
    )


def zygote() -> None:
    """``--zygote``: with everything a server imports imported, read one JSON
    request per line on stdin (``argv``, ``env``, ``log``) and fork a server
    for each, answering ``{"pid": ...}``; answer ``{"exit": pid, "code": ...}``
    as each ends (the code as subprocess gives it: negative for a signal).
    Leaves at the end of its input. A forked server returns from here and
    ends as the interpreter does at the end of a script."""
    children: set[int] = set()
    pending = b""
    while True:
        readable = select.select([0], [], [], 0.2)[0]
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _answer({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            for pid in children:  # (its parent left: whatever still runs is killed)
                os.killpg(pid, signal.SIGKILL)
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _become_server(request)
                main(request["argv"])
                return
            children.add(pid)
            _answer({"pid": pid})


def _answer(message: dict) -> None:
    os.write(1, json.dumps(message).encode() + b"\n")


def _become_server(request: dict) -> None:
    """In a forked server: a session of its own (killed as a group, as a
    launched server), the launch's environment and its output to its log."""
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        zygote()
    else:
        main()

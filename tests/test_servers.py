"""Several servers: RoundPipe replicas joined by torch.distributed (gloo, CPU
workers, two processes on this machine over loopback).

Each server is a process of ``tests/replica_fit.py``: under ``torchrun
--nnodes=2 --nproc-per-node=1`` (one torchrun per server, as on two machines),
or started with the variables a manual launch sets (``MASTER_ADDR``,
``MASTER_PORT``, ``NODE_RANK``)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import replica_fit
import torch
from strategy.modules import CausalLM, lm_data, loader

from lightning_roundpipe import RoundPipeStrategy

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="needs torch.distributed with gloo",
    ),
    # one test process runs them all, with one zygote (its imports: 10 s of CPU)
    pytest.mark.xdist_group("servers"),
]

SCRIPT = Path(__file__).with_name("replica_fit.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    out = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        out.pop(key, None)
    out["PYTHONPATH"] = os.pathsep.join([str(Path.cwd()), out.get("PYTHONPATH", "")])
    return out


class Zygote:
    """Where the manually launched servers start: forked from a process of
    ``tests/replica_fit.py --zygote`` that imported torch, Lightning,
    transformers and this package once (a fresh interpreter spent about
    10 s of CPU on those imports, most of a server's time here). Each server
    still runs in a process and a session of its own, with the environment
    variables a manual launch sets, and ends as an interpreter does (its
    exit code, atexit, threads at shutdown); the torchrun test launches
    real interpreters."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--zygote"],
            env=env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.exits: dict[int, int] = {}
        self._pending = b""

    def _message(self, deadline: float) -> dict | None:
        """The zygote's next message, None past ``deadline``."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            assert chunk, f"the zygote ended (exit code {self.proc.wait()})"
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        message = json.loads(line)
        if "exit" in message:
            self.exits[message["exit"]] = message["code"]
        return message

    def start(self, argv: list[str], environ: dict[str, str], log: Path) -> int:
        """Fork a server running ``main(argv)``; its pid."""
        request = {"argv": argv, "env": environ, "log": str(log)}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + 120  # (the first waits for the imports)
        while True:
            message = self._message(deadline)
            assert message is not None, "the zygote did not fork a server within 120 s"
            if "pid" in message:
                return message["pid"]

    def wait(self, pid: int, timeout: float) -> int | None:
        """``pid``'s exit code (negative: the signal), None past ``timeout``."""
        deadline = time.monotonic() + timeout
        while pid not in self.exits and self._message(deadline) is not None:
            pass
        return self.exits.get(pid)

    def close(self) -> None:
        self.proc.stdin.close()  # (it leaves at the end of its input)
        self.proc.wait(timeout=60)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def servers(
    out: Path,
    *args: str,
    zygote: Zygote | None = None,
    limit: float = 240.0,
    others: float = 30.0,
) -> list[int | None]:
    """Run two servers to the end (rank 0 within ``limit``, the other then
    within ``others`` seconds); returns their exit codes (None: killed here).
    Forked from ``zygote`` with a manual launch's variables, else each under
    torchrun."""
    out.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    launched: list[Callable[[float], int | None]] = []
    killers: list[Callable[[], None]] = []
    for rank in (0, 1):
        argv = [str(out), "--nodes", "2", *args]
        log = out / f"log{rank}.txt"
        if zygote is not None:
            extra = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(rank)}
            pid = zygote.start(argv, {**env(), **extra}, log)
            launched.append(functools.partial(zygote.wait, pid))
            killers.append(functools.partial(_kill_forked, zygote, pid))
            continue
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(SCRIPT),
            *argv,
        ]
        with open(log, "w") as file:
            proc = subprocess.Popen(
                cmd, env=env(), stdout=file, stderr=subprocess.STDOUT, start_new_session=True
            )
        launched.append(functools.partial(_wait_launched, proc))
        killers.append(functools.partial(_kill_launched, proc))
    deadline = time.monotonic() + limit
    codes = []
    try:
        launched[0](max(1.0, deadline - time.monotonic()))
        for wait in launched:
            codes.append(wait(max(1.0, min(others, deadline - time.monotonic()))))
    finally:
        for kill in killers:  # a hung or orphaned server (its launcher too)
            kill()
    return codes


def _wait_launched(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _kill_launched(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
        proc.wait()


def _kill_forked(zygote: Zygote, pid: int) -> None:
    if pid in zygote.exits:
        return
    # (its session: the server started it first thing; ProcessLookupError:
    # it ended, and the zygote's word of it is still on its way)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, 9)
    assert zygote.wait(pid, 60) is not None, f"server {pid} was not reaped"


def one_server(out: Path, *args: str) -> None:
    """The one-server reference, in this process (a server of its own would
    spend most of its time importing Lightning)."""
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    try:
        replica_fit.main([str(out), "--nodes", "1", *args])
    finally:
        torch.set_num_threads(threads)


def logs(out: Path) -> str:
    return "".join(p.read_text()[-3000:] for p in sorted(out.glob("log*.txt")))


def result(out: Path, rank: int) -> dict:
    path = out / f"rank{rank}.pt"
    assert path.exists(), f"server {rank} wrote no result:\n{logs(out)}"
    return torch.load(path, weights_only=False)


def error(out: Path, rank: int) -> str:
    path = out / f"error{rank}.txt"
    assert path.exists(), f"server {rank} did not fail:\n{logs(out)}"
    return path.read_text().splitlines()[0]


# --------------------------------------------------------------- exactness
def test_two_servers_train_exactly_like_one_server_with_twice_the_batch(tmp_path):
    """torchrun --nnodes=2 --nproc-per-node=1: batch 4 per server equals one
    server with batch 8 on the same samples (synchronous optimizer, gradient
    accumulation, clipping by the global norm), also when one server ran out
    of device memory in its first batch and re-planned alone (its warning
    names its rank); the logged loss is reduced across servers; the
    checkpoint is written once and loads on one server."""
    two = tmp_path / "two"
    assert servers(two, "--batch-size", "4", "--oom-once") == [0, 0], logs(two)
    replanned = (two / "log1.txt").read_text()
    assert re.search(
        r"\[rank: 1\] RoundPipe: cpu ran out of memory in stage F\d \(layers \d-\d\) during "
        r"the first batch; re-planned with stages of at most \d+ bytes",
        replanned,
    ), replanned[-3000:]
    assert "ran out of memory" not in (two / "log0.txt").read_text()
    one_server(tmp_path / "one", "--batch-size", "8")
    a, b = result(tmp_path / "two", 0), result(tmp_path / "two", 1)
    ref = result(tmp_path / "one", 0)
    assert (a["world_size"], a["global_rank"], b["global_rank"]) == (2, 0, 1)
    # each server saw its own shard; together the samples the one server saw
    assert len(a["seen"]) == len(b["seen"]) == len(ref["seen"]) // 2
    assert sorted(a["seen"] + b["seen"]) == sorted(ref["seen"])
    for x, y in zip(a["params"], ref["params"], strict=True):
        torch.testing.assert_close(x, y)
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    torch.testing.assert_close(a["metrics"]["synced_loss"], ref["metrics"]["synced_loss"])
    torch.testing.assert_close(b["metrics"]["synced_loss"], ref["metrics"]["synced_loss"])
    # resume the two servers' checkpoint on one server
    ckpt = tmp_path / "two" / "last.ckpt"
    assert ckpt.exists()
    one_server(tmp_path / "resumed", "--batch-size", "8", "--steps", "5", "--resume", str(ckpt))
    resumed = result(tmp_path / "resumed", 0)
    assert not all(
        torch.equal(x, y) for x, y in zip(resumed["params"], a["params"], strict=True)
    )  # one more step ran


def test_asynchronous_replicas_stay_identical(tmp_path, zygote):
    """The asynchronous optimizer (one step behind) on each server: every
    replica applies the same updates, to rank 0's weights when the servers
    started from different ones (as DDP's replicas)."""
    codes = servers(
        tmp_path, "--batch-size", "4", "--async", "--clip", "0", "--init-by-rank", zygote=zygote
    )
    a, b = result(tmp_path, 0), result(tmp_path, 1)
    assert codes == [0, 0]
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a["params"], a["init"], strict=True))


# ---------------------------------------------------------------- failures
def test_a_server_that_raises_is_named_by_the_others(tmp_path, zygote):
    """Server 1 raises in its training step; server 0, waiting in the
    gradient reduction, fails with server 1's error (not a hang)."""
    t0 = time.monotonic()
    codes = servers(tmp_path, "--fail-at", "2", "--no-log", "--watchdog", "60", zygote=zygote)
    assert codes == [1, 1]  # both leave with their exception, neither aborts nor hangs
    message = error(tmp_path, 0)
    assert "ReplicaError" in message and "replica rank 1 failed" in message, message
    assert "ValueError: injected failure on the second server" in message
    assert time.monotonic() - t0 < 60  # well within the watchdog timeout


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_a_server_that_raises_with_an_exception_checkpoint_fails_both_at_once(
    tmp_path, async_, zygote
):
    """OnExceptionCheckpoint (and no collective of the loop's thread in the
    steps): the failing server's checkpoint waited at a barrier for the other,
    which waited for its gradients, both until the watchdog (10 minutes by
    default). Now both leave at once, each with its error (the healthy one's
    a ReplicaError naming the other's failure, also with the asynchronous
    optimizer), the failing one with the weights of its last step, as the
    other's: its queued update is applied."""
    extra = ["--async"] if async_ else []
    t0 = time.monotonic()
    args = ("--fail-at", "2", "--no-log", "--exception-checkpoint", "--accumulate", "1", *extra)
    codes = servers(tmp_path, *args, "--watchdog", "120", zygote=zygote)
    assert codes == [1, 1], logs(tmp_path)
    assert time.monotonic() - t0 < 60, logs(tmp_path)
    assert error(tmp_path, 1).startswith("ValueError: injected failure on the second server")
    message = error(tmp_path, 0)
    assert "replica rank 1 failed: ValueError: injected failure on the second" in message, message
    if not message.startswith("RuntimeError: RoundPipe cannot save"):  # (its step was not whole)
        assert message.startswith("ReplicaError"), message
    a, b = (torch.load(tmp_path / f"failed{r}.pt", weights_only=False) for r in (0, 1))
    # (the healthy server may have counted its next step, queued but never applied)
    assert b["global_step"] == 2 and a["global_step"] in (2, 3)
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))


def test_a_fit_after_a_stopped_one_is_not_failed_by_its_report(tmp_path, zygote):
    """Every server stops a first fit with an exception the script catches;
    the second fit of the same processes trains (the failure reports left in
    the rendezvous store are the first fit's, under their own keys)."""
    codes = servers(tmp_path, "--stopped-fit-first", "--no-log", "--watchdog", "60", zygote=zygote)
    assert codes == [0, 0], logs(tmp_path)


def test_servers_started_with_different_settings_are_refused_naming_it(tmp_path, zygote):
    """Different reduce buckets would reduce mismatched tensors (gloo aborts
    the process without a Python error): refused on every server first."""
    codes = servers(tmp_path, "--rank1-bucket", "1", "--no-log", "--watchdog", "60", zygote=zygote)
    assert codes == [1, 1], logs(tmp_path)
    for rank in (0, 1):
        message = error(tmp_path, rank)
        assert "reduce_bucket_bytes differs between rank 0 and rank 1 (8192 against 1)" in (
            message
        ), message


def test_a_server_that_finished_early_is_named_as_finished(tmp_path, zygote):
    """Unequal steps (a user error): the server still training says the
    other finished, not that it died or hangs."""
    # (rank 1's checkpoint after its fit then waits for rank 0 in vain)
    codes = servers(tmp_path, "--rank1-steps", "2", "--no-log", "--watchdog", "8", zygote=zygote)
    assert codes[0] == 1, logs(tmp_path)
    message = error(tmp_path, 0)
    assert "replica rank 1 finished its fit while this one goes on" in message, message


def test_a_killed_server_is_named_by_the_others(tmp_path, zygote):
    """Server 1 is killed (SIGKILL) between steps; server 0 fails in its next
    collective (the logged loss is reduced across servers) naming rank 1."""
    t0 = time.monotonic()
    codes = servers(tmp_path, "--kill-at", "2", "--watchdog", "60", zygote=zygote)
    assert codes[0] == 1 and codes[1] != 0
    message = error(tmp_path, 0)
    assert "replica rank 1 stopped responding" in message, message
    assert time.monotonic() - t0 < 60


def test_a_hung_server_fails_the_others_after_the_watchdog_timeout(tmp_path, zygote):
    """Server 1 hangs in its training step (alive: its reducer still beats);
    server 0 fails once its reduction waited watchdog_timeout, naming the
    window server 1 never closed, and leaves with that exception (no abort
    from an all-reduce still in flight at exit)."""
    codes = servers(
        tmp_path, "--hang-at", "2", "--no-log", "--watchdog", "8", limit=90, others=1, zygote=zygote
    )
    assert codes[0] == 1
    message = error(tmp_path, 0)
    assert "took more than 8 s (watchdog_timeout)" in message, message
    assert "replica rank 1 is alive but has not closed optimizer window 2" in message


# ---------------------------------------------------------------- set-up
def two_server_trainer() -> L.Trainer:
    return L.Trainer(
        strategy=RoundPipeStrategy(async_optimizer=False),
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
    )


def torchrun_rank_zero(monkeypatch, world_size: int, per_server: int) -> None:
    """The environment torchrun gives its first process."""
    values = dict(
        TORCHELASTIC_RUN_ID="test",
        RANK="0",
        LOCAL_RANK="0",
        GROUP_RANK="0",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(per_server),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    for key, value in values.items():
        monkeypatch.setenv(key, value)


def test_servers_without_a_rendezvous_are_refused(monkeypatch):
    for key in ("MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    trainer = two_server_trainer()
    with pytest.raises(ValueError, match="set MASTER_ADDR, MASTER_PORT and NODE_RANK"):
        trainer.fit(CausalLM(), loader(lm_data()))


def test_one_process_per_server_is_required(monkeypatch):
    """torchrun --nproc-per-node=2 on two servers: four processes for two
    servers, refused with what to change."""
    torchrun_rank_zero(monkeypatch, world_size=4, per_server=2)
    trainer = two_server_trainer()
    assert trainer.world_size == 2
    with pytest.raises(ValueError, match="launch with torchrun --nproc-per-node=1"):
        trainer.fit(CausalLM(), loader(lm_data()))


def test_several_processes_on_one_server_are_refused(monkeypatch):
    """torchrun --nproc-per-node=2 with the default num_nodes=1, the DDP
    habit: each process would train alone on all the data; refused."""
    torchrun_rank_zero(monkeypatch, world_size=2, per_server=2)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(),
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
    )
    with pytest.raises(ValueError, match=r"2 processes were launched \(TorchElasticEnvironment\)"):
        trainer.fit(CausalLM(), loader(lm_data()))


def test_bucket_size_is_validated():
    with pytest.raises(ValueError, match="reduce_bucket_bytes must be a positive number of bytes"):
        RoundPipeStrategy(reduce_bucket_bytes=0)


def test_one_server_is_not_distributed():
    strategy = RoundPipeStrategy()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    assert (trainer.world_size, trainer.global_rank, strategy.is_distributed) == (1, 0, False)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}

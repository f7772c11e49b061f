"""Fault injection at every named point: the failure reaches the caller fast,
with its context, and no thread survives."""

import contextlib
import re
import threading
import time

import pytest
import torch
from torch import nn

from lightning_roundpipe.runtime import (
    HandoffTimeout,
    OptimizerStepError,
    RoundPipeEngine,
    WorkerError,
)


class Injected(RuntimeError):
    pass


class Fault:
    """A chaos hook that raises at ``point`` on its ``after``-th visit."""

    def __init__(self, point: str, after: int = 1, exc: type[BaseException] = Injected):
        self.point, self.after, self.exc = point, after, exc
        self.seen = 0
        self._lock = threading.Lock()

    def __call__(self, point: str) -> None:
        if point != self.point:
            return
        with self._lock:
            self.seen += 1
            fire = self.seen == self.after
        if fire:
            raise self.exc(f"injected fault at {point}")


WORKER_POINTS = ["forward", "backward", "upload", "download", "store"]
OPTIMIZER_POINTS = ["g_copy", "p_copy", "step", "call"]


def model():
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(5)] + [nn.Linear(8, 1)]


def drive(eng, steps=3):
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    for _ in range(steps):
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.step(lambda: None).wait()
        eng.call(lambda: None).wait()
    eng.synchronize()


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("point", WORKER_POINTS + OPTIMIZER_POINTS)
def test_fault_reaches_the_caller_with_context(point, n, async_mode):
    before = threading.active_count()
    eng = RoundPipeEngine(
        model(),
        ["cpu"] * n,
        3,
        plan="2,3|1|1,2,2",
        async_optimizer=async_mode,
        watchdog_timeout=30,
        chaos=Fault(point, after=2),
    )
    t0 = time.monotonic()
    try:
        with pytest.raises((WorkerError, OptimizerStepError, Injected, RuntimeError)) as info:
            drive(eng)
    finally:
        eng.close()
    assert time.monotonic() - t0 < 20
    assert threading.active_count() == before
    exc = info.value
    chain, e = [], exc
    while e is not None:
        chain.append(e)
        e = e.__cause__
    assert any(isinstance(c, Injected) for c in chain), f"{point}: not chained: {exc!r}"
    text = str(exc)
    if point in WORKER_POINTS:
        assert isinstance(exc, WorkerError)
        assert "device cpu (worker" in text and "failed in stage" in text
        assert f"iteration {exc.iteration}" in text and exc.iteration >= 0
        if point != "upload":  # a weight upload happens before any micro-batch
            assert "micro-batch" in text
        if point in ("forward",):
            assert ", layer " in text
    else:
        assert isinstance(exc, OptimizerStepError)
        assert ("optimizer step" in text) or ("queued call" in text)
        if point in ("g_copy", "p_copy"):
            cause = exc.__cause__
            assert "copy" in str(cause) and "layers[" in str(cause)


def test_out_of_memory_names_the_stage_and_what_to_change():
    eng = RoundPipeEngine(
        model(),
        ["cpu"] * 2,
        2,
        plan="2,3|1|1,2,2",
        chaos=Fault("upload", exc=torch.OutOfMemoryError),
    )
    try:
        with pytest.raises(
            WorkerError,
            match=r"OutOfMemoryError: injected fault at upload\. "
            r"Stage [FB]\d needs about .* GiB for weights and gradients plus "
            r"activations; .*Raise num_microbatches .*device_memory_limit",
        ):
            drive(eng, steps=1)
    finally:
        eng.close()


class Stuck(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if torch.is_grad_enabled():
            time.sleep(3)  # the recompute hangs longer than the watchdog allows
        return self.lin(x)


def _timed_out(middle: nn.Module, timeout: float) -> str:
    """The error of one step through Linear, ``middle``, Linear, Linear on
    two CPU workers that times out."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), middle, nn.Linear(8, 8), nn.Linear(8, 1)]
    eng = RoundPipeEngine(
        layers, ["cpu"] * 2, 2, plan="2,1|1|1,2", watchdog_timeout=timeout, profile_iterations=0
    )
    try:
        with pytest.raises((WorkerError, HandoffTimeout)) as info:
            drive(eng, steps=1)
    finally:
        eng.close()
    return str(info.value)


def test_watchdog_reports_what_never_arrived_with_the_marked_grid():
    text = _timed_out(Stuck(), 1.0)
    # which hand-off never arrived, and the grid marked where the pipeline stands
    assert "waited 1 s for" in text
    assert "dev 0 |" in text and "dev 1 |" in text and "^ 0." in text and "[0." in text


class SlowOnce(nn.Module):
    """Its first forward without autograd (a forward stage's first micro-batch,
    on each worker's copy) takes ``seconds``, or until ``SlowOnce.release``
    is set (a class attribute: the workers' copies share it)."""

    release: threading.Event | None = None

    def __init__(self, seconds=2.0):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seconds, self.calls = seconds, 0

    def forward(self, x):
        if not torch.is_grad_enabled():
            self.calls += 1
            if self.calls == 1:
                if SlowOnce.release is not None:
                    SlowOnce.release.wait(30)
                else:
                    time.sleep(self.seconds)
        return self.lin(x)


def test_a_watchdog_timeout_names_the_slow_stage_layer_and_micro_batch():
    """The stage that waits times out, but the message names the one it
    waited on: the worker still in its slow layer (not only the waiter)."""
    text = _timed_out(SlowOnce(2.0), 0.5)
    assert "waited 0.5 s for" in text
    assert re.search(
        r"still running: device cpu \(worker 0\) stage \w+, layer 1, micro-batch 0, "
        r"for \d+\.\d s",
        text,
    ), text
    assert "A worker may be stuck" not in text


def test_a_slow_asynchronous_optimizer_step_is_blamed_on_the_optimizer():
    """Window 3 computes with the weights of step 1: when that step is slower
    than the watchdog timeout, the error says the optimizer step has not
    finished, not that a stage is stuck."""
    calls = []

    def step():
        calls.append(1)
        if len(calls) == 2:  # optimizer step 1
            time.sleep(2.0)

    eng = RoundPipeEngine(
        model(), ["cpu"] * 2, 2, plan="2,3|1|1,2,2", async_optimizer=True, watchdog_timeout=0.5
    )
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    try:
        with pytest.raises(WorkerError) as info:
            for _ in range(5):
                eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
                eng.step(step)
            eng.synchronize()
    finally:
        eng.close()
    text = str(info.value)
    assert text.startswith("optimizer step 1 did not finish in time: device cpu (worker "), text
    assert "waited 0.5 s for the weight copies (P copies) of optimizer step 1" in text
    assert "optimizer step 1 has not finished" in text
    assert "may be stuck" not in text and "still running" not in text
    assert isinstance(info.value.__cause__, HandoffTimeout)
    assert info.value.__cause__.optimizer == 1


def test_threads_that_do_not_stop_are_named_with_what_blocks_them():
    """close() names each thread that did not stop by kind: a device worker
    with the stage, layer and micro-batch it runs, the optimizer thread with
    its step."""
    torch.manual_seed(0)
    release = SlowOnce.release = threading.Event()
    layers = [nn.Linear(8, 8), SlowOnce(), nn.Linear(8, 8), nn.Linear(8, 1)]
    eng = RoundPipeEngine(
        layers,
        ["cpu"] * 2,
        2,
        plan="2,1|1|1,2",
        async_optimizer=True,
        watchdog_timeout=30,
        profile_iterations=0,
    )
    rt = eng._rt
    blocked = threading.Event()

    def stuck_step():
        blocked.wait(30)

    def forward():
        with contextlib.suppress(RuntimeError):  # (the engine is closed under it)
            eng.forward(torch.randn(4, 8))

    caller = threading.Thread(target=forward, name="test-caller", daemon=True)
    threads = [t for w in rt.workers for t in w.threads] + [rt.optimizer.thread]
    try:
        eng.step(stuck_step)  # (an empty window: the step runs, and blocks)
        caller.start()
        deadline = time.monotonic() + 10
        while rt.workers[0]._layer != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)

        class Quick:  # the engine's finalizer, with a short join
            alive = True

            def __call__(self):
                self.alive = False
                return rt.shutdown(join_timeout=0.2)

        real, eng._finalizer = eng._finalizer, Quick()
        with pytest.raises(RuntimeError, match="did not stop within") as info:
            eng.close()
        text = str(info.value)
        assert re.search(
            r"roundpipe-worker-0-cpu \(running device cpu \(worker 0\) stage \w+, layer 1, "
            r"micro-batch 0, for \d+\.\d s: a layer may be blocked\)",
            text,
        ), text
        assert (
            "roundpipe-optimizer (the optimizer thread, 0 steps applied so far: an optimizer "
            "step, its weight copies or a queued call (engine.call) may be blocked)"
        ) in text, text
        assert "roundpipe-worker-1" not in text and "courier" not in text
    finally:
        release.set()
        SlowOnce.release = None
        blocked.set()
        for t in [*threads, caller]:
            t.join(10)
        real()
    assert not any(t.is_alive() for t in threads)


class Unprintable(RuntimeError):
    """A user's exception whose message cannot be formatted."""

    def __str__(self) -> str:
        raise ValueError("its __str__ fails")


def test_a_failure_whose_message_cannot_be_formatted_still_reaches_the_caller_at_once():
    """(Formatting it raised inside the worker: the worker died unreported,
    and the caller waited for the watchdog, which blamed another worker.)"""
    before = threading.active_count()
    eng = RoundPipeEngine(
        model(),
        ["cpu"] * 3,
        3,
        plan="2,3|1|1,2,2",
        watchdog_timeout=60,
        chaos=Fault("forward", after=2, exc=lambda _: Unprintable()),
    )
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerError) as info:
            drive(eng)
    finally:
        eng.close()
    assert time.monotonic() - t0 < 20
    assert re.search(
        r"failed in stage \w+ .*micro-batch \d.*: Unprintable: Unprintable\(\)", str(info.value)
    )
    assert isinstance(info.value.__cause__, Unprintable)
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before

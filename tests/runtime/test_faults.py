"""Fault injection at every named point: the failure reaches the caller fast,
with its context, and no thread survives."""

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


def test_watchdog_reports_what_never_arrived_with_the_marked_grid():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), Stuck(), nn.Linear(8, 8), nn.Linear(8, 1)]
    eng = RoundPipeEngine(
        layers, ["cpu"] * 2, 2, plan="2,1|1|1,2", watchdog_timeout=1.0, profile_iterations=0
    )
    try:
        with pytest.raises((WorkerError, HandoffTimeout)) as info:
            drive(eng, steps=1)
    finally:
        eng.close()
    text = str(info.value)
    # which hand-off never arrived, and the grid marked where the pipeline stands
    assert "waited 1 s for" in text
    assert "dev 0 |" in text and "dev 1 |" in text and "^ 0." in text and "[0." in text

"""An interrupt (Ctrl+C) stays an interrupt wherever it lands, so Lightning
shuts down gracefully, as under the default strategy."""

import threading

import pytest
import torch

from lightning_roundpipe import RoundPipeStrategy

from .modules import SeqModule, cpu_trainer, loader, seq_data


class InterruptedSGD(torch.optim.SGD):
    """Ctrl+C arriving while the third step runs."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.01)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls == 3:
            raise KeyboardInterrupt
        return super().step(closure)


class Interrupted(SeqModule):
    def configure_optimizers(self):
        return InterruptedSGD(self.parameters())


@pytest.mark.parametrize("strategy", ["auto", "sync", "async"])
def test_an_interrupt_in_the_optimizer_step_shuts_down_like_lightning(strategy):
    before = {t.ident for t in threading.enumerate()}
    chosen = (
        strategy if strategy == "auto" else RoundPipeStrategy(async_optimizer=strategy == "async")
    )
    trainer = cpu_trainer(chosen, max_steps=5)
    with pytest.raises(SystemExit):  # Lightning's answer to KeyboardInterrupt
        trainer.fit(Interrupted(extra=False), loader(seq_data(48), 8))
    assert trainer.interrupted
    # (the asynchronous step fails on the optimizer thread, after the loop
    # counted it: the next step reports it)
    assert trainer.global_step == (3 if strategy == "async" else 2)
    assert {t.ident for t in threading.enumerate()} <= before


ARMED = threading.Event()


class ArmAtThirdBatch(SeqModule):
    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 2:
            ARMED.set()


def _interrupt_when_armed(original, after: int = 1):
    """``original`` raising KeyboardInterrupt at its ``after``-th call on the
    main thread once the module armed it (Ctrl+C landing exactly there)."""
    calls = [0]

    def wrapped(*args, **kwargs):
        if ARMED.is_set() and threading.current_thread() is threading.main_thread():
            calls[0] += 1
            if calls[0] == after:
                ARMED.clear()
                raise KeyboardInterrupt
        return original(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize(
    "where, strategy",
    [("step wait", "sync"), ("hand-off", "sync"), ("hand-off", "async")],
)
def test_an_interrupt_mid_hand_off_or_in_the_steps_wait_ends_the_fit_at_once(
    where, strategy, monkeypatch, caplog
):
    """Ctrl+C while the synchronous step waits for the backward stages, or
    between two of a batch's task hand-offs: the pipeline fails at once
    instead of the shutdown waiting for work that never comes until the
    watchdog (600 s by default; 5 s here, after which the strategy logs
    that the queued steps were not applied)."""
    from lightning_roundpipe.runtime import RoundPipeEngine
    from lightning_roundpipe.runtime.worker import Worker

    if where == "step wait":
        monkeypatch.setattr(
            RoundPipeEngine,
            "_wait_tasks",
            _interrupt_when_armed(RoundPipeEngine._wait_tasks),
        )
    else:  # a few tasks into the third batch's hand-off
        monkeypatch.setattr(Worker, "submit", _interrupt_when_armed(Worker.submit, after=3))
    ARMED.clear()
    before = {t.ident for t in threading.enumerate()}
    chosen = RoundPipeStrategy(async_optimizer=strategy == "async", watchdog_timeout=5)
    trainer = cpu_trainer(chosen, max_steps=5, devices=2)
    with caplog.at_level("WARNING"), pytest.raises(SystemExit):
        trainer.fit(ArmAtThirdBatch(extra=False), loader(seq_data(48), 8))
    assert trainer.interrupted
    assert not ARMED.is_set()  # (it was raised)
    assert "not applied" not in caplog.text
    assert {t.ident for t in threading.enumerate()} <= before


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, exc):
        # (its kind and arguments only: an exception the node kept would keep,
        # through its traceback, the engine alive in a cycle gc cannot see)
        ctx.kind, ctx.args = type(exc), exc.args
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ctx.kind(*ctx.args)


class InterruptingLayer(torch.nn.Module):
    """Raises ``exc`` once, in its forward or its backward, once armed
    (a user's layer calling ``sys.exit`` or Ctrl+C landing on a worker)."""

    def __init__(self, exc: BaseException, backward: bool) -> None:
        super().__init__()
        self.exc, self.backward = exc, backward

    def forward(self, x):
        if not (ARMED.is_set() and torch.is_grad_enabled()):
            return torch.tanh(x)
        ARMED.clear()
        if self.backward:
            return torch.tanh(_RaiseInBackward.apply(x, self.exc))
        raise type(self.exc)(*self.exc.args)  # (a new one: see _RaiseInBackward)


class InterruptedInALayer(ArmAtThirdBatch):
    def __init__(self, exc: BaseException, backward: bool) -> None:
        super().__init__(extra=False)
        self.net[3] = InterruptingLayer(exc, backward)


@pytest.mark.parametrize("strategy", ["auto", "sync", "async"])
@pytest.mark.parametrize(
    "kind, backward", [(KeyboardInterrupt, False), (SystemExit, True)], ids=["ctrl-c", "exit"]
)
def test_an_interrupt_raised_in_a_layer_on_a_worker_stays_an_interrupt(strategy, kind, backward):
    """KeyboardInterrupt or SystemExit from a layer on a worker thread
    reaches Lightning as itself, as under the default strategy (Ctrl+C: a
    graceful shutdown; SystemExit: its code), noting where it was raised."""
    # (made here: an exception kept for the session, as a parameter, would keep
    # the frames it was raised through, and with them the engine, alive)
    exc = kind(3) if kind is SystemExit else kind()
    ARMED.clear()
    before = {t.ident for t in threading.enumerate()}
    chosen = (
        strategy
        if strategy == "auto"
        else RoundPipeStrategy(async_optimizer=strategy == "async", watchdog_timeout=30)
    )
    trainer = cpu_trainer(chosen, max_steps=5, devices=2)
    with pytest.raises(SystemExit) as raised:
        trainer.fit(InterruptedInALayer(exc, backward), loader(seq_data(48), 8))
    assert not ARMED.is_set()  # (it was raised)
    assert trainer.interrupted
    if isinstance(exc, SystemExit):
        assert raised.value.code == 3
        if strategy != "auto":
            (note,) = raised.value.__notes__
            assert note.startswith("(raised on a RoundPipe worker thread: device cpu")
            assert "micro-batch" in note and "stage" in note
    else:
        assert raised.value.code == 1  # Lightning's exit after its graceful shutdown
    assert {t.ident for t in threading.enumerate()} <= before
    del raised, trainer, chosen

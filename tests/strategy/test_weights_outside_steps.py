"""Weights and gradients changed outside the optimizer step: by hooks, by
Lightning's weight-averaging callbacks, by an ``optimizer_step`` override that
skips a step. RoundPipe computes with its own copies of the weights, so each of
these must reach them as it reaches the module in ordinary training."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.runtime.optimizer import Chaos

from .modules import SeqModule, cpu_trainer, loader, seq_data, state


def _fit(module, strategy, *, epochs=2, callbacks=(), validate=False, accumulate=1):
    trainer = cpu_trainer(
        strategy,
        max_epochs=epochs,
        callbacks=list(callbacks),
        num_sanity_val_steps=0,
        limit_val_batches=2 if validate else 0,
        accumulate_grad_batches=accumulate,
    )
    data = seq_data(32)
    trainer.fit(module, loader(data, 8), loader(data, 8) if validate else None)
    return trainer


def _sync():
    return RoundPipeStrategy(async_optimizer=False, num_microbatches=2)


class Losses(L.Callback):
    def __init__(self):
        self.train, self.val = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append(float(outputs["loss"]))

    def on_validation_epoch_end(self, trainer, pl_module):
        self.val.append(float(trainer.callback_metrics["val_loss"]))


class Reinitialized(SeqModule):
    """Weights set in place in a hook: loading pretrained weights in
    ``on_fit_start``, re-initialising at an epoch start, clamping after each
    batch (``copy_``/``clamp_`` under ``no_grad``, as ``load_state_dict`` does)."""

    def __init__(self, hook: str) -> None:
        super().__init__(lr=0.05, extra=False)
        self.hook = hook

    def _set(self):
        g = torch.Generator().manual_seed(123)
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def on_fit_start(self):
        if self.hook == "on_fit_start":
            self._set()

    def on_train_epoch_start(self):
        if self.hook == "on_train_epoch_start" and self.current_epoch == 1:
            self._set()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.hook == "clamp":
            with torch.no_grad():
                for p in self.net.parameters():
                    p.clamp_(-0.1, 0.1)


@pytest.mark.parametrize("hook", ["on_fit_start", "on_train_epoch_start", "clamp"])
def test_weights_changed_in_place_by_a_hook_are_what_the_next_step_computes_with(hook):
    losses = {}
    weights = {}
    for name, strategy in [("auto", "auto"), ("sync", _sync())]:
        module = Reinitialized(hook)
        record = Losses()
        _fit(module, strategy, callbacks=[record])
        losses[name], weights[name] = record.train, state(module)
    torch.testing.assert_close(losses["sync"], losses["auto"])
    torch.testing.assert_close(weights["sync"], weights["auto"])


def test_weights_set_before_the_first_step_are_used_by_the_asynchronous_optimizer_too():
    first = {}
    for name, strategy in [("auto", "auto"), ("async", RoundPipeStrategy(num_microbatches=2))]:
        record = Losses()
        _fit(Reinitialized("on_fit_start"), strategy, epochs=1, callbacks=[record])
        first[name] = record.train[0]  # the later ones are one update behind
    torch.testing.assert_close(first["async"], first["auto"])


class DataCopied(SeqModule):
    """Weights changed through ``.data``, which no version counter sees: the
    module tells the strategy."""

    def __init__(self, tell: bool) -> None:
        super().__init__(lr=0.05, extra=False)
        self.tell = tell

    def on_train_start(self):
        for p in self.net.parameters():
            p.data.copy_(torch.full_like(p, 0.05))
        if self.tell:
            self.trainer.strategy.reload_weights()


def test_weights_changed_through_data_are_used_after_reload_weights():
    record = {}
    for name, strategy, tell in [("auto", "auto", False), ("sync", _sync(), True)]:
        losses = Losses()
        _fit(DataCopied(tell), strategy, epochs=1, callbacks=[losses])
        record[name] = losses.train
    torch.testing.assert_close(record["sync"], record["auto"])


def test_validation_with_an_ema_callback_sees_the_average_and_training_goes_on():
    got = {}
    for name, strategy in [("auto", "auto"), ("sync", _sync())]:
        module, losses = SeqModule(lr=0.05, extra=False), Losses()
        _fit(module, strategy, epochs=3, validate=True, callbacks=[EMAWeightAveraging(), losses])
        got[name] = (losses.val, losses.train, state(module))
    # validation computes with the averaged weights, training with the raw ones,
    # and the module ends on the average (on_train_end copies it in)
    torch.testing.assert_close(got["sync"], got["auto"])


@pytest.mark.parametrize("double_buffer", [True, False])
def test_an_ema_callback_leaves_asynchronous_training_as_it_was(double_buffer):
    """Its average, swapped in for each validation, is for the validation
    alone: the training steps after it compute with the one-update-behind
    weights, as without the callback."""
    train = []
    for callbacks in ([], [EMAWeightAveraging()]):
        losses = Losses()
        strategy = RoundPipeStrategy(num_microbatches=2, double_buffer=double_buffer)
        _fit(
            SeqModule(lr=0.05, extra=False),
            strategy,
            epochs=3,
            validate=True,
            callbacks=[*callbacks, losses],
        )
        train.append(losses.train)
    torch.testing.assert_close(train[1], train[0])


def test_an_asynchronous_fit_ends_on_the_ema_average_and_does_not_race_it():
    ends, averages = [], []
    for seed in (None, 1):
        module = SeqModule(lr=0.05, extra=False)
        strategy = RoundPipeStrategy(num_microbatches=2)
        if seed is not None:  # the optimizer thread late at every hand-off
            strategy._chaos = Chaos(seed, {"step": 0.01, "g_copy": 0.01})
        ema = EMAWeightAveraging()
        _fit(module, strategy, epochs=2, callbacks=[ema])
        ends.append(state(module))
        averages.append(state(ema._average_model.module))
    # on_train_end copied the average in, and no queued update came on top
    torch.testing.assert_close(ends[0], averages[0])
    # the average read the weights after each update, never during one
    torch.testing.assert_close(ends[1], ends[0])


def test_stochastic_weight_averaging_reads_settled_weights_under_the_asynchronous_optimizer():
    ends = []
    for seed in (None, 2):
        module = SeqModule(lr=0.05, extra=False)
        strategy = RoundPipeStrategy(num_microbatches=2)
        if seed is not None:
            strategy._chaos = Chaos(seed, {"step": 0.02, "g_copy": 0.02})
        swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2)
        _fit(module, strategy, epochs=4, callbacks=[swa])
        ends.append(state(module))
    torch.testing.assert_close(ends[1], ends[0])


class SkipsSomeSteps(SeqModule):
    """An ``optimizer_step`` override that runs the closure but skips the step
    of batches 1, 5, ...: Lightning's zero_grad at the next window's first
    batch drops the skipped window's gradients."""

    def __init__(self) -> None:
        super().__init__(lr=0.05, extra=False)
        self.seen = []

    def on_before_optimizer_step(self, optimizer):
        self.seen.append(self.net[4].bias.grad.clone())

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if batch_idx % 4 == 1:
            optimizer_closure()
            return
        optimizer.step(closure=optimizer_closure)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_gradients_of_a_skipped_step_do_not_leak_into_the_next(accumulate):
    got = {}
    for name, strategy in [("auto", "auto"), ("sync", _sync())]:
        module = SkipsSomeSteps()
        _fit(module, strategy, epochs=1, accumulate=accumulate)
        got[name] = (module.seen, state(module))
    torch.testing.assert_close(got["sync"], got["auto"])


class Gathers(SeqModule):
    def training_step(self, batch, batch_idx):
        self.gathered = self.all_gather(torch.ones(5, 1)).shape
        return super().training_step(batch, batch_idx)


def test_all_gather_on_one_process_adds_no_dimension():
    module = Gathers(extra=False)
    _fit(module, _sync(), epochs=1)
    assert module.gathered == (5, 1)


class WithLBFGS(SeqModule):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1)


def test_an_optimizer_that_needs_a_closure_is_refused_before_training():
    module = WithLBFGS(extra=False)
    before = state(module)
    with pytest.raises(ValueError, match=r"LBFGS\.step needs a closure.*AdamW, SGD"):
        _fit(module, _sync(), epochs=1)
    torch.testing.assert_close(state(module), before)


class Clamp(L.Callback):
    """The clamp of the section's example, after every batch."""

    def on_train_batch_end(self, trainer, pl_module, *args):
        with torch.no_grad():
            for p in pl_module.net.parameters():
                p.clamp_(-0.1, 0.1)


def test_a_change_before_a_checkpoint_is_saved_is_not_lost(tmp_path):
    """Saving a checkpoint settles the engine and notes the weights' versions:
    a clamp in on_train_batch_end just before (Lightning saves after the
    other callbacks) still goes into the master copies."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    got = {}
    for name, strategy in [("auto", "auto"), ("sync", _sync())]:
        saving = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=1, monitor=None)
        module = SeqModule(lr=0.05, extra=False)
        cpu_trainer(
            strategy, max_steps=6, callbacks=[Clamp(), saving], enable_checkpointing=True
        ).fit(module, loader(seq_data(48), 8))
        got[name] = state(module)
    torch.testing.assert_close(got["sync"], got["auto"])


class ChangedAtValidationEnd(SeqModule):
    def __init__(self) -> None:
        super().__init__(lr=0.05, extra=False)

    def on_validation_epoch_end(self):
        with torch.no_grad():
            self.net[4].weight.zero_()
            self.net[4].bias.fill_(3.0)


@pytest.mark.parametrize("double_buffer", [True, False])
def test_a_change_in_an_end_of_epoch_validation_reaches_the_next_step(double_buffer):
    """The end-of-epoch validation runs before on_train_epoch_end, where the
    asynchronous strategy settles its queued update: the change made in the
    validation is the weights the next epoch's first step computes with."""
    losses = {}
    for name, strategy in [
        ("auto", "auto"),
        ("async", RoundPipeStrategy(num_microbatches=2, double_buffer=double_buffer)),
    ]:
        record = Losses()
        _fit(ChangedAtValidationEnd(), strategy, epochs=2, callbacks=[record], validate=True)
        losses[name] = record.train
    first = 4  # the second epoch's first batch (32 samples, batches of 8)
    assert losses["async"][first] == pytest.approx(losses["auto"][first], rel=1e-4)

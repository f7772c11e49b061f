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


class SharpnessAware(torch.optim.SGD):
    """A SAM-style optimizer: its step accepts ``closure=None`` (no setup
    check can tell it from SGD) but evaluates the loss again at perturbed
    weights, asserting on the closure or calling it."""

    def __init__(self, params, asserts: bool) -> None:
        super().__init__(params, lr=0.1)
        self.asserts = asserts

    @torch.no_grad()
    def step(self, closure=None):
        if self.asserts:
            assert closure is not None, "SAM requires a closure, but it was not provided"
        with torch.enable_grad():
            closure()  # at the perturbed weights (left out here)
        return super().step()


class WithSharpnessAware(SeqModule):
    def __init__(self, asserts: bool) -> None:
        super().__init__(extra=False)
        self.asserts = asserts

    def configure_optimizers(self):
        return SharpnessAware(self.parameters(), self.asserts)


@pytest.mark.parametrize("asserts", [True, False], ids=["asserts", "calls-none"])
@pytest.mark.parametrize("async_optimizer", [False, True], ids=["sync", "async"])
def test_an_optimizer_failing_without_a_closure_says_why_there_is_none(asserts, async_optimizer):
    module = WithSharpnessAware(asserts)
    before = state(module)
    what = "AssertionError: SAM requires a closure" if asserts else "TypeError: 'NoneType'"
    with pytest.raises(
        Exception,
        match=rf"(?s)SharpnessAware\.step failed without a closure \({what}.*steps afterwards, "
        r"without a closure.*AdamW, SGD",
    ):
        _fit(module, RoundPipeStrategy(async_optimizer=async_optimizer), epochs=1)
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


def _by_hand(module, x):
    """The module's net on ``x`` from its parameters' values, without calling
    it (during a fit its layers run in the pipeline)."""
    w = [p.detach() for p in module.net.parameters()]
    h = torch.tanh(torch.nn.functional.linear(x, w[0], w[1]))
    h = torch.tanh(torch.nn.functional.linear(h, w[2], w[3]))
    return torch.nn.functional.linear(h, w[4], w[5])


class Swap(L.Callback):
    """A hand-written average for validation: weights swapped in when the
    validation starts and put back when it ends, through load_state_dict;
    checks that the validation computes with the swapped-in weights."""

    def __init__(self, start: str, end: str) -> None:
        self.seen: list[tuple[float, float]] = []
        setattr(self, start, self._swap_in)
        setattr(self, end, self._put_back)

    def _swap_in(self, trainer, module):
        self.kept = {k: v.detach().clone() for k, v in module.state_dict().items()}
        module.load_state_dict({k: v * 0.9 for k, v in self.kept.items()})
        x, y = seq_data(32)[:8]
        self.expected = float(torch.nn.functional.mse_loss(_by_hand(module, x), y))

    def _put_back(self, trainer, module):
        self.seen.append((float(trainer.callback_metrics["val_loss"]), self.expected))
        module.load_state_dict(self.kept)


@pytest.mark.parametrize("double_buffer", [True, False])
@pytest.mark.parametrize(
    "hooks",
    [
        ("on_validation_start", "on_validation_end"),
        ("on_validation_epoch_start", "on_validation_epoch_end"),
    ],
)
def test_weights_swapped_in_for_validation_and_put_back_leave_training_as_it_was(
    hooks, double_buffer
):
    """Asynchronous: a callback's on_validation_start runs before the
    strategy's, which waited for the queued update: the weights it kept (and
    put back) were those before that update, which was lost. Weights put back
    also made every master copy the newest weights, so the run was no longer
    one update behind. Now the validation sees the swapped-in weights, and
    the run trains exactly as one never validated."""
    finals = {}
    for swap in (False, True):
        module = SeqModule(lr=0.05, extra=False)
        strategy = RoundPipeStrategy(num_microbatches=2, double_buffer=double_buffer)
        callbacks = [Swap(*hooks)] if swap else []
        trainer = cpu_trainer(
            strategy, max_epochs=2, callbacks=callbacks, num_sanity_val_steps=0,
            limit_val_batches=1, val_check_interval=2,
        )  # fmt: skip
        data = seq_data(32)
        trainer.fit(module, loader(data, 8), loader(data, 8))
        finals[swap] = state(module)
        if swap:
            assert len(callbacks[0].seen) == 4
            for got, expected in callbacks[0].seen:
                assert got == pytest.approx(expected, rel=1e-5)
    torch.testing.assert_close(finals[True], finals[False])


@pytest.mark.parametrize("name", ["auto", "sync"])
def test_weights_changed_when_validation_starts_are_what_it_computes_with(name):
    """A change in on_validation_start (before the strategy's own hook) was
    noted as seen by it and never copied in: validate computed with the old
    weights."""
    swap = Swap("on_validation_start", "on_validation_end")
    data = seq_data(32)
    cpu_trainer(
        "auto" if name == "auto" else _sync(), callbacks=[swap], limit_val_batches=1
    ).validate(SeqModule(lr=0.05, extra=False), loader(data, 8))
    trainer = cpu_trainer(
        "auto" if name == "auto" else _sync(), max_steps=2, callbacks=[swap],
        num_sanity_val_steps=0, val_check_interval=1, limit_val_batches=1,
    )  # fmt: skip
    trainer.fit(SeqModule(lr=0.05, extra=False), loader(data, 8), loader(data, 8))
    assert len(swap.seen) == 3
    for got, expected in swap.seen:
        assert got == pytest.approx(expected, rel=1e-5)


class ForwardAtTheEnd(SeqModule):
    """A forward through the model where the fit settles its updates (the end
    of an epoch, of training), and a validation step that takes an input
    gradient (autograd on inside the evaluation): each computes with the
    module's weights as they are then."""

    def __init__(self) -> None:
        super().__init__(lr=0.05, extra=False)
        self.pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def _compare(self, where):
        x = seq_data(32)[:8][0]
        with torch.no_grad():
            self.pairs.append((where, self.net(x), _by_hand(self, x)))

    def on_train_epoch_end(self):
        self._compare("epoch end")

    def on_train_end(self):
        self._compare("train end")

    def validation_step(self, batch, batch_idx):
        x, y = batch
        with torch.enable_grad():  # (the input's gradient would be taken from it)
            loss = torch.nn.functional.mse_loss(self.net(x.clone().requires_grad_(True)), y)
        self.pairs.append(("grad in validation", loss.detach(), _loss_by_hand(self, batch)))
        self.log("val_loss", loss.detach())
        # a later call without autograd in the same validation
        later = torch.nn.functional.mse_loss(self.net(x), y)
        self.pairs.append(("after it", later, _loss_by_hand(self, batch)))


def _loss_by_hand(module, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(_by_hand(module, x), y)


@pytest.mark.parametrize("double_buffer", [True, False])
def test_asynchronous_forwards_where_updates_are_settled_use_the_modules_weights(double_buffer):
    """Asynchronous: a forward in on_train_epoch_end/on_train_end computed with
    the one-update-behind copies, and a validation step with autograd on
    switched the rest of the validation to them."""
    module = ForwardAtTheEnd()
    strategy = RoundPipeStrategy(num_microbatches=2, double_buffer=double_buffer)
    trainer = cpu_trainer(
        strategy, max_epochs=2, num_sanity_val_steps=0, limit_val_batches=2,
        inference_mode=False,
    )  # fmt: skip
    data = seq_data(32)
    trainer.fit(module, loader(data, 8), loader(data, 8))
    kinds = {where for where, _, _ in module.pairs}
    assert kinds == {"epoch end", "train end", "grad in validation", "after it"}
    for where, got, expected in module.pairs:
        torch.testing.assert_close(got, expected, msg=where)


class ZeroGradHook(SeqModule):
    """optimizer_zero_grad overridden: clears every batch (with
    set_to_none=False), or every other one (gradients carried over)."""

    def __init__(self, every: int) -> None:
        super().__init__(lr=0.05, extra=False)
        self.every, self.calls = every, 0

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self.calls += 1
        if batch_idx % self.every == 0:
            optimizer.zero_grad(set_to_none=False)


def test_an_optimizer_zero_grad_override_is_called_and_one_that_keeps_gradients_refused():
    """The strategy routed the hook to its own zero_grad: an override was
    never called, and one that carries gradients into the next step trained
    differently without a word (gradients are released after every step)."""
    got = {}
    for name, strategy in [("auto", "auto"), ("sync", _sync())]:
        module = ZeroGradHook(every=1)
        _fit(module, strategy, epochs=1)
        assert module.calls == 4
        got[name] = state(module)
    torch.testing.assert_close(got["sync"], got["auto"])
    with pytest.raises(
        Exception,
        match=r"ZeroGradHook\.optimizer_zero_grad did not clear the gradients \(batch 1\): "
        r"RoundPipe releases them after every optimizer step.*accumulate_grad_batches",
    ):
        _fit(ZeroGradHook(every=2), _sync(), epochs=1)


class ZeroGradMidWindow(SeqModule):
    def __init__(self, how: str) -> None:
        super().__init__(lr=0.05, extra=False)
        self.how = how

    def on_train_batch_start(self, batch, batch_idx):
        if self.how == "module":
            self.zero_grad()

    def training_step(self, batch, batch_idx):
        if self.how == "optimizer":
            self.optimizers().zero_grad()
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("how", ["module", "optimizer"])
def test_zero_grad_between_the_batches_of_a_window_drops_the_earlier_ones(how):
    """The window's gradients are in the engine's buffers, not in .grad: a
    zero_grad between two batches of an accumulation window left them, and
    the step used every batch instead of the last."""
    got = {}
    for name, strategy in [("auto", "auto"), ("sync", _sync())]:
        module = ZeroGradMidWindow(how)
        _fit(module, strategy, epochs=1, accumulate=2)
        got[name] = state(module)
    torch.testing.assert_close(got["sync"], got["auto"])


class ForwardBeforeStep(SeqModule):
    """The model called from on_before_optimizer_step (a metric of the
    weights the step is about to change)."""

    def __init__(self, grad: bool = False) -> None:
        super().__init__(extra=False)
        self.grad = grad
        self.seen: list[torch.Tensor] = []

    def on_before_optimizer_step(self, optimizer) -> None:
        x = seq_data(4).tensors[0]
        with torch.set_grad_enabled(self.grad):
            out = self.net(x)
        if self.grad:
            out.sum().backward()
        with torch.no_grad():  # the weights before the step, as in the parameters
            torch.testing.assert_close(out, torch.nn.Sequential.forward(self.net, x))
        self.seen.append(out.detach())


def test_a_model_call_in_on_before_optimizer_step_computes_with_the_weights_before_it():
    """(synchronous: it waited for the step it was called from, until the watchdog)"""
    module = ForwardBeforeStep()
    strategy = RoundPipeStrategy(async_optimizer=False, num_microbatches=2, watchdog_timeout=30)
    cpu_trainer(strategy, max_steps=3).fit(module, loader(seq_data(32), 8))
    assert len(module.seen) == 3
    expected = ForwardBeforeStep()
    cpu_trainer("auto", max_steps=3).fit(expected, loader(seq_data(32), 8))
    torch.testing.assert_close(torch.stack(module.seen), torch.stack(expected.seen))


def test_a_backward_through_the_model_in_on_before_optimizer_step_is_refused():
    strategy = RoundPipeStrategy(async_optimizer=False, num_microbatches=2, watchdog_timeout=30)
    with pytest.raises(RuntimeError, match=r"training call .* from inside optimizer step 0"):
        cpu_trainer(strategy, max_steps=1).fit(ForwardBeforeStep(grad=True), loader(seq_data(8), 8))

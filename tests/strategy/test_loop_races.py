"""Where the training loop's thread meets the pipeline's threads: validation,
checkpoints, queued calls and autograd on the loop's thread see exactly what
ordinary training would."""

import lightning as L
import pytest
import torch

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.runtime.optimizer import Chaos

from .modules import DropoutSeq, SeqModule, loader, seq_data

QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)


def _fit(module, strategy, devices, *, validate: bool, **kw):
    kw.setdefault("max_steps", 4)
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        num_sanity_val_steps=0,
        limit_val_batches=1 if validate else 0,
        val_check_interval=1,
        enable_checkpointing=False,
        **QUIET,
        **kw,
    )
    data = seq_data(48)
    trainer.fit(module, loader(data, 12), loader(data, 12))
    return trainer


def _late_backward(seed: int) -> RoundPipeStrategy:
    s = RoundPipeStrategy(
        async_optimizer=True, num_microbatches=4, seed=3, plan="2,2,2|1|1,1,1,1,1,1"
    )
    # tasks start late: validation's eval() comes while backward stages are queued
    s._chaos = Chaos(seed, {"upload": 0.03})
    return s


@pytest.mark.parametrize("devices", [1, 3])
def test_validation_between_steps_does_not_change_asynchronous_training(devices):
    plain = DropoutSeq()
    _fit(plain, _late_backward(0), devices, validate=False)
    validated = DropoutSeq()
    _fit(validated, _late_backward(1), devices, validate=True)
    for a, b in zip(plain.parameters(), validated.parameters(), strict=True):
        torch.testing.assert_close(a, b)


class _SaveAtValidation(L.Callback):
    """A checkpoint at the end of every validation, with the loss validation saw."""

    def __init__(self, directory) -> None:
        self.directory = directory
        self.saved = []

    def on_validation_end(self, trainer, module):
        path = self.directory / f"step{trainer.global_step}.ckpt"
        trainer.save_checkpoint(path)
        self.saved.append((path, float(trainer.callback_metrics["val_loss"])))


@pytest.mark.parametrize(
    ("devices", "double_buffer"),
    [(1, None), (3, None), (3, False)],
    ids=["1-two-copies", "3-two-copies", "3-one-copy"],
)
def test_validation_sees_the_weights_the_checkpoint_saved_at_the_same_moment(
    tmp_path, devices, double_buffer
):
    """What ModelCheckpoint(monitor=...), EarlyStopping and ReduceLROnPlateau
    judge is the model they save: validation under the asynchronous optimizer
    runs with the newest weights, and training is unchanged by it."""

    def strategy():
        return RoundPipeStrategy(num_microbatches=4, double_buffer=double_buffer)

    saver = _SaveAtValidation(tmp_path)
    module = DropoutSeq()
    _fit(module, strategy(), devices, validate=True, callbacks=[saver])
    unvalidated = DropoutSeq()
    _fit(unvalidated, strategy(), devices, validate=False)
    for a, b in zip(module.parameters(), unvalidated.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert len(saver.saved) == 4
    data = seq_data(48)
    for path, seen in saver.saved:
        plain = L.Trainer(accelerator="cpu", devices=1, **QUIET, limit_val_batches=1)
        (out,) = plain.validate(DropoutSeq(), loader(data, 12), ckpt_path=path, verbose=False)
        torch.testing.assert_close(out["val_loss"], seen)


def test_autograd_on_the_loops_thread_reaching_pipeline_parameters():
    """A weight penalty and a tied weight used outside the layer stack: exact
    in synchronous mode, refused (before any step) in asynchronous mode."""
    from .modules import PenalizedSeq

    def run(strategy, devices=1):
        module = PenalizedSeq()
        L.seed_everything(0)
        L.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=devices,
            max_steps=3,
            enable_checkpointing=False,
            **QUIET,
        ).fit(module, loader(seq_data(48), 12))
        return module

    ref = run("auto")
    for devices in (1, 3):
        got = run(RoundPipeStrategy(async_optimizer=False, num_microbatches=4), devices)
        for a, b in zip(ref.parameters(), got.parameters(), strict=True):
            torch.testing.assert_close(a, b)
    module = PenalizedSeq()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(
        RuntimeError,
        match=r"pipeline parameter net\.\d\.\w+ got a gradient from autograd on the "
        r"training loop's thread .* Use strategy='roundpipe_sync'",
    ):
        L.Trainer(
            strategy="roundpipe",
            accelerator="cpu",
            max_steps=3,
            enable_checkpointing=False,
            **QUIET,
        ).fit(module, loader(seq_data(48), 12))
    for a, b in zip(before, module.parameters(), strict=True):
        torch.testing.assert_close(a, b)


class _LambdaSeq(DropoutSeq):
    """Records the learning rate the loop reads at each batch start, and lets
    a callback-like hook set a momentum for one batch."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[float] = []

    def on_train_batch_start(self, batch, batch_idx):
        opt = self.trainer.optimizers[0]
        self.read.append(opt.param_groups[0]["lr"])
        opt.param_groups[0]["momentum"] = 0.5 if batch_idx == 2 else 0.9

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _scheduled(seed: int | None) -> RoundPipeStrategy:
    s = RoundPipeStrategy(async_optimizer=True, num_microbatches=2, seed=3)
    if seed is not None:  # an optimizer thread lagging by random amounts
        s._chaos = Chaos(seed, {"step": 0.05, "p_copy": 0.03})
    return s


def test_the_learning_rate_the_loop_reads_and_each_update_uses_do_not_race_the_optimizer():
    """Schedulers step on the loop's thread and an asynchronous update uses
    the hyperparameters the loop had set when its step was queued: what the
    loop reads is the default strategy's at every batch, and the weights are
    the same however late the optimizer thread runs."""
    expected = [0.05 / (k + 1) for k in range(6)]
    runs = []
    for seed in (None, 0, 1):
        module = _LambdaSeq()
        _fit(module, _scheduled(seed), 2, validate=False, max_steps=6)
        assert module.read == pytest.approx(expected, rel=1e-12), seed
        runs.append(module)
    for other in runs[1:]:
        for a, b in zip(runs[0].parameters(), other.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    reference = _LambdaSeq()
    _fit(reference, "auto", 1, validate=False, max_steps=6)
    assert reference.read == pytest.approx(expected, rel=1e-12)


class _AdamSeq(DropoutSeq):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class _ResetMoments(L.Callback):
    """A per-batch hook that reads and changes the optimizer's state after
    waiting for the queued updates: what it reads is the state after every
    earlier batch's step, whatever the optimizer thread's timing."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        trainer.strategy.wait_for_updates()
        opt = trainer.optimizers[0]
        first = opt.state.get(opt.param_groups[0]["params"][0], {})
        self.seen.append(int(first["step"]) if first else 0)
        if batch_idx % 2 == 1:
            for s in opt.state.values():
                s["exp_avg"].zero_()


def test_a_hook_that_waits_for_the_updates_reads_and_changes_the_optimizer_state_safely():
    """The asynchronous optimizer, its steps delayed at random: with
    wait_for_updates() the hook sees every earlier step applied and its change
    of the moments is never lost, so runs with different delays are equal."""
    runs = []
    for seed in (0, 1):
        strategy = RoundPipeStrategy(num_microbatches=2, seed=3)
        strategy._chaos = Chaos(seed, {"step": 0.02, "p_copy": 0.02})
        hook, module = _ResetMoments(), _AdamSeq()
        _fit(module, strategy, 2, validate=False, max_steps=6, callbacks=[hook])
        assert hook.seen == list(range(6))
        runs.append(module)
        opt = module.trainer.optimizers[0]  # put back as configured after the fit
        assert [(g["fused"], g["foreach"]) for g in opt.param_groups] == [(None, None)]
    for a, b in zip(*(m.parameters() for m in runs), strict=True):
        torch.testing.assert_close(a, b)


class _ForwardWithAutograd(L.Callback):
    """Hooks that call the model with autograd on (Lightning does not turn it
    off for callbacks): after wait_for_updates() in a per-batch hook, and at
    the end of an epoch (where the strategy waits itself)."""

    def __init__(self) -> None:
        self.gaps: list[float] = []

    def _check(self, pl_module):
        x = torch.linspace(-1, 1, 24).reshape(3, 8)
        plain = torch.nn.Sequential(*(type(m)(*_sizes(m)) for m in pl_module.net))
        plain.load_state_dict(pl_module.net.state_dict())
        out = pl_module.net(x)
        assert out.requires_grad
        self.gaps.append((out.detach() - plain(x).detach()).abs().max().item())

    def on_train_batch_end(self, trainer, pl_module, *args):
        trainer.strategy.wait_for_updates()
        self._check(pl_module)

    def on_train_epoch_end(self, trainer, pl_module):
        self._check(pl_module)


def _sizes(module):
    return (module.in_features, module.out_features) if hasattr(module, "in_features") else ()


def test_a_hooks_forward_with_autograd_computes_with_the_weights_the_module_holds():
    """With the asynchronous optimizer the devices compute a training step
    with weights one update behind; a hook's own call with autograd on (not a
    training step) computes with the module's weights, as a call without
    autograd does, and training goes on as without the hook."""
    runs = []
    for hook in (_ForwardWithAutograd(), None):
        module = SeqModule(extra=False)
        strategy = RoundPipeStrategy(num_microbatches=2, seed=3)
        _fit(
            module,
            strategy,
            2,
            validate=False,
            max_steps=6,
            max_epochs=2,
            limit_train_batches=3,
            callbacks=[hook] if hook else [],
        )
        runs.append(module)
        if hook is not None:
            assert len(hook.gaps) == 8
            assert max(hook.gaps) < 1e-6
    for a, b in zip(*(m.parameters() for m in runs), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _WaitsInStep(SeqModule):
    """Reads settled optimizer state inside its own training step."""

    def training_step(self, batch, batch_idx):
        self.trainer.strategy.wait_for_updates()
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_waiting_for_the_updates_inside_the_training_step_leaves_its_weights_alone(accumulate):
    """The step's own model call computes with the one-update-behind weights
    of the asynchronous optimizer whether or not the step waited for the
    queued update first (a hold for the hooks' calls would have made it use
    the newest ones: 1e-3 off)."""
    runs = []
    for module in (_WaitsInStep(extra=False), SeqModule(extra=False)):
        strategy = RoundPipeStrategy(num_microbatches=2, seed=3)
        _fit(module, strategy, 2, validate=False, max_steps=4, accumulate_grad_batches=accumulate)
        runs.append(module)
    for a, b in zip(*(m.parameters() for m in runs), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

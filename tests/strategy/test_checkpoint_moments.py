"""Checkpoints saved at the less usual moments resume exactly: after an
evaluation that followed the fit, after a fit stopped by an exception, from
``on_before_optimizer_step`` (inside a synchronous step) and from
``OnExceptionCheckpoint`` after that hook failed; a fit after evaluating from
a checkpoint starts from nothing of it; the fused optimizer kernel survives a
resume and stays out of the checkpoint."""

import time

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint

from lightning_roundpipe import RoundPipeStrategy

from .modules import DropoutSeq, SeqModule, cpu_trainer, loader, seq_data, state


class Fails(torch.nn.Module):
    """A layer that raises in training calls once ``fail`` is set."""

    fail = False

    def forward(self, x):
        if self.fail and torch.is_grad_enabled():
            raise ValueError("layer failed on purpose")
        return x


class FailFrom(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step:
            module.net[2].fail = True


class Evaluated(DropoutSeq):
    """Dropout (its masks follow the engine's iteration), AdamW, every loop."""

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])


def strategy(kind: str):
    return RoundPipeStrategy(async_optimizer=kind == "async", num_microbatches=4)


def data(same: bool = False):
    """4 steps an epoch; ``same``: every batch the same (a resume within an
    epoch then sees the batches of the uninterrupted run)."""
    if same:
        x, y = seq_data(8).tensors
        return loader(torch.utils.data.TensorDataset(x.repeat(4, 1), y.repeat(4, 1)), 8)
    return loader(seq_data(32), 8)


def resume(ckpt, kind: str, same: bool = False) -> dict[str, torch.Tensor]:
    module = Evaluated()
    cpu_trainer(strategy(kind), max_epochs=2).fit(module, data(same), ckpt_path=ckpt)
    return state(module)


@pytest.mark.parametrize("evaluation", ["validate", "test", "predict"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_checkpoint_saved_after_fit_and_an_evaluation_resumes_exactly(tmp_path, kind, evaluation):
    straight = Evaluated()
    cpu_trainer(strategy(kind), max_epochs=2).fit(straight, data())
    module = Evaluated()
    trainer = cpu_trainer(strategy(kind), max_epochs=1)
    trainer.fit(module, data())
    getattr(trainer, evaluation)(module, loader(seq_data(16, seed=1), 8))
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    saved = torch.load(tmp_path / "after.ckpt", weights_only=False)
    assert saved["RoundPipePrecision"]["iteration"] == 4  # the fit's, not the evaluation's
    assert ("roundpipe_stale_weights" in saved) == (kind == "async")
    torch.testing.assert_close(resume(tmp_path / "after.ckpt", kind), state(straight))


class StopsAtStep(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            raise RuntimeError("stopped on purpose")


def test_a_checkpoint_saved_after_a_failed_async_fit_resumes_exactly(tmp_path):
    straight = Evaluated()
    cpu_trainer(strategy("async"), max_epochs=2).fit(straight, data(same=True))
    trainer = cpu_trainer(strategy("async"), max_epochs=2, callbacks=[StopsAtStep(5)])
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        trainer.fit(Evaluated(), data(same=True))
    trainer.save_checkpoint(tmp_path / "failed.ckpt")
    saved = torch.load(tmp_path / "failed.ckpt", weights_only=False)
    assert saved["global_step"] == 5 and "roundpipe_stale_weights" in saved
    resumed = resume(tmp_path / "failed.ckpt", "async", same=True)
    torch.testing.assert_close(resumed, state(straight))


class BeforeStep(L.Callback):
    """At step 2's ``on_before_optimizer_step``: saves a checkpoint, reads the
    state dict and clamps a weight (``reload_weights``), or raises."""

    def __init__(self, path, fail: bool = False) -> None:
        self.path, self.fail = path, fail

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_step != 2:
            return
        if self.fail:
            raise RuntimeError("failed on purpose")
        trainer.save_checkpoint(self.path)
        self.weights = {
            k: v.clone() for k, v in trainer.strategy.lightning_module_state_dict().items()
        }
        with torch.no_grad():
            module.net[0].weight.clamp_(-0.1, 0.1)
        if hasattr(trainer.strategy, "reload_weights"):  # (not the default strategy)
            trainer.strategy.reload_weights()


def test_a_checkpoint_saved_before_an_optimizer_step_holds_the_weights_before_it(tmp_path):
    """(roundpipe_sync waited for the step it was called from: a hang until
    the watchdog)"""
    saved, final = {}, {}
    for kind in ("auto", "sync", "async"):
        hook = BeforeStep(tmp_path / f"{kind}.ckpt")
        module = SeqModule(extra=False)
        plan = (
            "auto"
            if kind == "auto"
            else RoundPipeStrategy(
                async_optimizer=kind == "async", num_microbatches=4, watchdog_timeout=30.0
            )
        )
        cpu_trainer(plan, max_epochs=1, callbacks=[hook]).fit(module, data())
        saved[kind] = torch.load(tmp_path / f"{kind}.ckpt", weights_only=False)
        assert saved[kind]["global_step"] == 2
        torch.testing.assert_close(saved[kind]["state_dict"], hook.weights)
        final[kind] = state(module)
    torch.testing.assert_close(saved["sync"]["state_dict"], saved["auto"]["state_dict"])
    torch.testing.assert_close(final["sync"], final["auto"])  # the clamp was trained from


def test_a_failed_pre_step_hook_leaves_roundpipe_sync_able_to_save_on_exception(tmp_path):
    """(the step's failure failed the engine: OnExceptionCheckpoint raised the
    hook's exception again and wrote nothing)"""
    saved = {}
    for kind in ("auto", "sync"):
        folder = tmp_path / kind
        trainer = cpu_trainer(
            "auto" if kind == "auto" else strategy(kind),
            max_epochs=1,
            enable_checkpointing=True,
            callbacks=[OnExceptionCheckpoint(folder), BeforeStep(None, fail=True)],
        )
        with pytest.raises(RuntimeError, match="failed on purpose"):
            trainer.fit(SeqModule(extra=False), data())
        saved[kind] = torch.load(folder / "on_exception.ckpt", weights_only=False)
    assert saved["sync"]["global_step"] == saved["auto"]["global_step"] == 2
    torch.testing.assert_close(saved["sync"]["state_dict"], saved["auto"]["state_dict"])
    torch.testing.assert_close(
        saved["sync"]["optimizer_states"][0]["state"], saved["auto"]["optimizer_states"][0]["state"]
    )


def test_a_fit_after_evaluating_a_checkpoint_starts_from_its_weights_only(tmp_path):
    first = cpu_trainer(strategy("async"), max_epochs=1)
    first.fit(Evaluated(), data())
    first.save_checkpoint(tmp_path / "x.ckpt")
    weights = torch.load(tmp_path / "x.ckpt", weights_only=False)["state_dict"]

    by_hand = Evaluated()
    by_hand.load_state_dict(weights)
    cpu_trainer(strategy("async"), max_epochs=1).fit(by_hand, data())

    module = Evaluated()
    trainer = cpu_trainer(strategy("async"), max_epochs=1)
    trainer.validate(module, loader(seq_data(16, seed=1), 8), ckpt_path=tmp_path / "x.ckpt")
    trainer.fit(module, data())  # a new fit: the checkpoint's one-behind weights play no part
    torch.testing.assert_close(state(module), state(by_hand))


class Fused(L.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def on_train_batch_start(self, trainer, *args):
        group = trainer.optimizers[0].param_groups[0]
        self.seen.append((group["fused"], group["foreach"]))


def test_the_fused_kernel_survives_a_resume_and_stays_out_of_the_checkpoint(tmp_path):
    first = cpu_trainer(strategy("sync"), max_epochs=1)
    first.fit(Evaluated(), data())
    first.save_checkpoint(tmp_path / "rp.ckpt")
    groups = torch.load(tmp_path / "rp.ckpt", weights_only=False)["optimizer_states"][0]
    # what configure_optimizers asked for, so another strategy resumes with it
    assert [(g["fused"], g["foreach"]) for g in groups["param_groups"]] == [(None, None)]
    seen = Fused()
    trainer = cpu_trainer(strategy("sync"), max_epochs=2, callbacks=[seen])
    trainer.fit(Evaluated(), data(), ckpt_path=tmp_path / "rp.ckpt")
    assert seen.seen and set(seen.seen) == {(True, False)}
    seen = Fused()
    trainer = cpu_trainer("auto", max_epochs=2, callbacks=[seen])
    trainer.fit(Evaluated(), data(), ckpt_path=tmp_path / "rp.ckpt")
    assert set(seen.seen) == {(None, None)}


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_pipeline_failure_with_on_exception_checkpoint_releases_the_module(tmp_path, kind):
    """OnExceptionCheckpoint runs before the strategy's on_exception: saving
    after a worker failed closed the engine first (it re-raised the failure
    and left the module patched: the next fit failed). The synchronous
    weights are the last step's: saved; the asynchronous optimizer's last
    step was never applied: refused, saying so."""
    module = SeqModule(extra=False)
    layers = list(module.net)
    module.net = torch.nn.Sequential(*layers[:2], Fails(), *layers[2:])
    trainer = cpu_trainer(
        strategy(kind),
        max_epochs=2,
        enable_checkpointing=True,
        callbacks=[OnExceptionCheckpoint(tmp_path), FailFrom(3)],
    )
    with pytest.raises(Exception) as failed:
        trainer.fit(module, data())
    assert trainer.strategy.engine is None and "forward" not in vars(module.net)
    saved = tmp_path / "on_exception.ckpt"
    if saved.exists():  # (async: when its last step was applied before the failure)
        assert "layer failed on purpose" in str(failed.value)
        torch.testing.assert_close(
            torch.load(saved, weights_only=False)["state_dict"], state(module)
        )
    else:
        assert kind == "async" and "cannot save the model's state" in str(failed.value), repr(
            failed.value
        )
    module.net[2].fail = False  # the module trains again
    cpu_trainer(strategy(kind), max_epochs=1).fit(module, data())


class FailsLateInBackward(torch.nn.Module):
    """Fails in a backward stage's recompute (autograd on), late enough that
    the synchronous step already waits for the window's stages."""

    fail = False

    def forward(self, x):
        if self.fail and torch.is_grad_enabled():
            time.sleep(0.5)
            raise ValueError("layer failed on purpose")
        return x


def test_a_synchronous_step_whose_window_failed_before_it_ran_can_still_be_saved(tmp_path):
    """The step never ran: the weights are the last step's, so the
    on-exception checkpoint is saved (it was refused as if a step had
    failed midway, whenever the failure came after the step began waiting)."""
    module = SeqModule(extra=False)
    layers = list(module.net)
    module.net = torch.nn.Sequential(*layers[:2], FailsLateInBackward(), *layers[2:])
    trainer = cpu_trainer(
        RoundPipeStrategy(async_optimizer=False, num_microbatches=4, plan="3|3|3"),
        max_epochs=2,
        enable_checkpointing=True,
        callbacks=[OnExceptionCheckpoint(tmp_path), FailFrom(3)],
    )
    with pytest.raises(Exception, match="layer failed on purpose"):
        trainer.fit(module, data())
    assert trainer.global_step == 3
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)
    assert saved["global_step"] == 3
    torch.testing.assert_close(saved["state_dict"], state(module))


class SavesBeforeStep(L.Callback):
    def __init__(self, path, step: int) -> None:
        self.path, self.step = path, step

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_checkpoint_saved_inside_a_batch_resumes_with_its_dropout_masks(tmp_path, kind):
    """Lightning runs a batch whose checkpoint was saved before it was done
    again: the checkpoint's iteration is that batch's first (it counted the
    batch, so every later dropout mask was shifted by one)."""
    straight = Evaluated()
    cpu_trainer(strategy(kind), max_epochs=2).fit(straight, data(same=True))
    path = tmp_path / "inside.ckpt"
    cpu_trainer(strategy(kind), max_epochs=1, callbacks=[SavesBeforeStep(path, 2)]).fit(
        Evaluated(), data(same=True)
    )
    saved = torch.load(path, weights_only=False)
    assert saved["global_step"] == 2 and saved["RoundPipePrecision"]["iteration"] == 2
    torch.testing.assert_close(resume(path, kind, same=True), state(straight))


def test_fitting_again_on_the_same_trainer_goes_on_with_new_dropout_masks():
    """A second fit of the same Trainer continues its steps, and with them the
    engine's iteration numbers (they restarted at 0: the first fit's masks)."""
    losses = []

    class Recorded(Evaluated):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            losses.append(float(loss))
            return loss

    module = Recorded(lr=0.0)  # (the losses then depend on the masks alone)
    trainer = cpu_trainer(strategy("sync"), max_epochs=1)
    trainer.fit(module, data(same=True))
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module, data(same=True))
    assert len(losses) == 8 and losses[4:] != losses[:4]
    assert trainer.strategy.precision_plugin.final["iteration"] == 8

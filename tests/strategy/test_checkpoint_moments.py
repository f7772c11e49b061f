"""Checkpoints saved at the less usual moments resume exactly: after an
evaluation that followed the fit, after a fit stopped by an exception, and a
fit after evaluating from a checkpoint starts from nothing of it; the fused
optimizer kernel survives a resume and stays out of the checkpoint."""

import lightning as L
import pytest
import torch

from lightning_roundpipe import RoundPipeStrategy

from .modules import DropoutSeq, cpu_trainer, loader, seq_data, state


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

"""Gradient clipping as Lightning does it: over the parameters the optimizer
holds (those outside the pipeline included, trainable ones it does not hold
left out), every ``clip_gradients`` call applied in turn."""

import pytest
import torch

from lightning_roundpipe import RoundPipeStrategy

from .modules import SeqModule, cpu_trainer, loader, seq_data, state


class OuterScale(SeqModule):
    """A trainable scale outside the layer stack, in the loss of every sample."""

    def __init__(self) -> None:
        super().__init__(lr=0.5, extra=False)
        self.scale = torch.nn.Parameter(torch.tensor(3.0))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x) * self.scale, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class LastLayerOnly(SeqModule):
    """Every layer trainable, the optimizer holding the last one only."""

    def __init__(self, frozen: bool = False) -> None:
        super().__init__(lr=0.5, extra=False)
        if frozen:  # the same training, the other layers without gradients
            for p in self.net[:4].parameters():
                p.requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net[4].parameters(), lr=self.hparams.lr, momentum=0.9)


class ClipsTwice(SeqModule):
    def __init__(self) -> None:
        super().__init__(lr=0.5, extra=False)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, **kw):
        self.clip_gradients(optimizer, gradient_clip_val=0.02, gradient_clip_algorithm="value")
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


def fit(module, strategy, **kw):
    cpu_trainer(strategy, max_epochs=2, **kw).fit(module, loader(seq_data(48), 8))
    return state(module)


def sync():
    return RoundPipeStrategy(async_optimizer=False)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("module", [OuterScale, LastLayerOnly])
def test_sync_clips_the_optimizers_parameters_like_lightning(module, algorithm):
    clip = dict(gradient_clip_val=0.05, gradient_clip_algorithm=algorithm)
    expected = fit(module(), "auto", **clip)
    torch.testing.assert_close(fit(module(), sync(), **clip), expected)


def test_async_clipping_norm_leaves_out_parameters_the_optimizer_does_not_hold():
    clip = dict(gradient_clip_val=0.05)
    expected = fit(LastLayerOnly(frozen=True), "roundpipe", **clip)
    torch.testing.assert_close(fit(LastLayerOnly(), "roundpipe", **clip), expected)


def test_every_clip_gradients_call_is_applied_in_turn():
    torch.testing.assert_close(fit(ClipsTwice(), sync()), fit(ClipsTwice(), "auto"))


class ClipsAfterBackward(SeqModule):
    """``self.clip_gradients`` in ``on_after_backward`` (where ``.grad`` is
    None under RoundPipe): applied at the step, to the step's gradient."""

    def __init__(self) -> None:
        super().__init__(lr=0.5, extra=False)

    def on_after_backward(self):
        self.clip_gradients(self.optimizers(), gradient_clip_val=0.05)


def test_clipping_asked_for_after_the_backward_is_applied_at_the_step_with_a_warning():
    """Synchronous and asynchronous alike (it used to be dropped by the
    synchronous step): as Lightning's clipping of the same value."""
    expected = fit(SeqModule(lr=0.5, extra=False), "auto", gradient_clip_val=0.05)
    with pytest.warns(UserWarning, match=r"clip_gradients was called outside the optimizer step"):
        got = fit(ClipsAfterBackward(), sync())
    torch.testing.assert_close(got, expected)
    reference = fit(SeqModule(lr=0.5, extra=False), "roundpipe", gradient_clip_val=0.05)
    with pytest.warns(UserWarning, match=r"clip_gradients was called outside"):
        torch.testing.assert_close(fit(ClipsAfterBackward(), "roundpipe"), reference)

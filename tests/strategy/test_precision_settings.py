"""Precision settings RoundPipe does not run as asked are refused or warned
about; fp16 loss scaling that cannot recover says why; the fused Adam kernel
is used only where it computes the same update."""

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.precision import RoundPipePrecision
from lightning_roundpipe.runtime.optimizer import LossScaler, NonFiniteError, use_fused

from .modules import SeqModule, cpu_trainer, loader, seq_data


def test_a_custom_precision_plugin_is_refused():
    class Halving(MixedPrecision):
        def pre_backward(self, tensor, module):
            return super().pre_backward(tensor / 2, module)

    with pytest.raises(ValueError, match="the precision plugin Halving is not supported"):
        RoundPipePrecision.from_plugin(Halving("bf16-mixed", "cpu"))


def test_a_grad_scaler_with_other_settings_is_refused():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    with pytest.raises(ValueError, match=r"= \(8.0, 2.0, 0.5, 2\) is not supported"):
        RoundPipePrecision.from_plugin(MixedPrecision("16-mixed", "cpu", scaler=scaler))
    default = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    assert RoundPipePrecision.from_plugin(default).precision == "16-mixed"


def test_a_loss_scale_that_overflows_below_any_use_says_why():
    scaler = LossScaler(enabled=True)
    with pytest.raises(NonFiniteError, match="not finite at any scale"):
        for _ in range(60):  # 2^16 halved 40 times is below 2^-24
            scaler.update(overflow=True)
    assert scaler.scale < 2.0**-24


def test_the_fused_adam_kernel_is_used_for_fp32_weights_only():
    fp32 = torch.nn.Linear(2, 2)
    assert use_fused(torch.optim.AdamW(fp32.parameters()))
    bf16 = torch.nn.Linear(2, 2).to(torch.bfloat16)
    assert not use_fused(torch.optim.AdamW(bf16.parameters()))


class Bf16Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16).to(torch.bfloat16)

    def forward(self, x):
        return self.lin(x.to(self.lin.weight.dtype)).float()


def test_low_precision_weights_under_32_true_are_warned_about():
    module = SeqModule(extra=False)
    module.net[2] = Bf16Linear()
    trainer = cpu_trainer(RoundPipeStrategy(async_optimizer=False), max_steps=1)
    with pytest.warns(UserWarning, match="parameters in bfloat16 under precision='32-true'"):
        trainer.fit(module, loader(seq_data(16), 8))


class NaNGradientOnce(SeqModule):
    """A finite loss whose gradient is not finite, at the second step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 1:
            return loss + 0 * self.net(batch[0] * float("inf")).sum().nan_to_num(0.0)
        return loss


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_non_finite_gradient_raises_the_same_error_in_both_modes(asynchronous):
    strategy = RoundPipeStrategy(async_optimizer=asynchronous, nonfinite="raise")
    module = NaNGradientOnce(extra=False)
    with pytest.raises(NonFiniteError, match="not finite"):
        cpu_trainer(strategy, max_steps=4).fit(module, loader(seq_data(48), 8))


class OverflowAtThirdStep(SeqModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 1e30 if self.global_step == 2 else loss


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_asynchronous_fp16_windows_start_with_the_scale_after_their_weights_update(
    delay, monkeypatch
):
    """Window w starts with the loss scale after update w - 2 (the last its
    weights hold), however late the optimizer thread's overflow check: the
    skipped steps and scales do not depend on timing."""
    import time

    import lightning_roundpipe.runtime.optimizer as optimizer

    check = optimizer.all_finite

    def slow(t):
        time.sleep(delay)
        return check(t)

    monkeypatch.setattr(optimizer, "all_finite", slow)
    seen = []
    run = optimizer.OptimizerWorker.run

    def record(self, job):
        run(self, job)
        seen.append((job.window, job.scale, job.handle.skipped))

    monkeypatch.setattr(optimizer.OptimizerWorker, "run", record)
    trainer = cpu_trainer(
        RoundPipeStrategy(num_microbatches=2),
        max_steps=6,
        plugins=[RoundPipePrecision("16-mixed")],
    )
    trainer.fit(OverflowAtThirdStep(extra=False), loader(seq_data(48), 8))
    full = 2.0**16
    # window 2 overflows and halves the scale; window 3 started from update
    # 1's scale, window 4 from update 2's (halved)
    assert seen == [
        (0, full, False),
        (1, full, False),
        (2, full, True),
        (3, full, False),
        (4, full / 2, False),
        (5, full / 2, False),
    ]


class NaNOutsideGradient(SeqModule):
    """The parameter outside the pipeline gets a NaN gradient at the second
    step, while the loss stays finite."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 1:
            # forward: 0; backward: 0 * inf, NaN (torch.where's known trap)
            unused = (self.extra.weight * float("inf")).sum()
            loss = loss + torch.where(torch.tensor(True), torch.zeros(()), unused)
        return loss


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_a_non_finite_gradient_outside_the_pipeline_counts(nonfinite):
    module = NaNOutsideGradient(extra=True)
    strategy = RoundPipeStrategy(async_optimizer=False, nonfinite=nonfinite)
    trainer = cpu_trainer(strategy, max_steps=4)
    if nonfinite == "raise":
        with pytest.raises(NonFiniteError, match=r"in extra\.weight in optimizer step 1"):
            trainer.fit(module, loader(seq_data(48), 8))
    else:
        trainer.fit(module, loader(seq_data(48), 8))
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


class BackboneHead(L.LightningModule):
    """A pipelined backbone and a classifier head outside it (fp32 on the host)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Sequential(
            torch.nn.Linear(8, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU()
        )
        self.head = torch.nn.Linear(64, 3)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.head(self.backbone(x))
        loss = torch.nn.functional.cross_entropy(logits, (y[:, 0] > 0).long())
        self.losses.append(loss.detach().float())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def test_mixed_precision_steps_run_under_autocast_on_the_host():
    """bf16-mixed: the pipeline's bf16 outputs fed to an fp32 module outside it
    work as under Lightning's mixed precision (the step ran without autocast:
    a dtype error at the first step)."""
    modules = {}
    for kind in ("auto", "sync"):
        modules[kind] = BackboneHead()
        plan = "auto" if kind == "auto" else RoundPipeStrategy(async_optimizer=False)
        cpu_trainer(plan, max_steps=3, precision="bf16-mixed").fit(
            modules[kind], loader(seq_data(32), 8)
        )
    ref, mod = modules["auto"], modules["sync"]
    torch.testing.assert_close(torch.stack(mod.losses), torch.stack(ref.losses), atol=2e-2, rtol=0)
    for (name, x), y in zip(mod.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(x, y, atol=2e-2, rtol=0, msg=name)


def test_asynchronous_fp16_resumed_right_after_an_overflow_goes_on_like_the_uninterrupted_run(
    tmp_path,
):
    """A checkpoint between update 2 (which overflowed and halved the scale)
    and window 4: the resumed window 3 starts with update 1's scale, as in
    the uninterrupted run (it started with the halved one, and the runs
    parted)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(ckpt=None, save=False):
        module = OverflowAtThirdStep(extra=False)
        saver = ModelCheckpoint(tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
        trainer = cpu_trainer(
            RoundPipeStrategy(num_microbatches=2),
            max_steps=6,
            plugins=[RoundPipePrecision("16-mixed")],
            enable_checkpointing=save,
            callbacks=[saver] if save else [],
        )
        data = torch.utils.data.TensorDataset(*(t[:8].repeat(6, 1) for t in seq_data(8).tensors))
        trainer.fit(module, loader(data, 8), ckpt_path=ckpt)
        return module, trainer.strategy.precision_plugin.final

    straight, final = fit(save=True)
    saved = torch.load(tmp_path / "step=3.ckpt", weights_only=False)["RoundPipePrecision"]
    assert saved["loss_scale"]["scale"] == 2.0**15 and saved["window_scale"] == 2.0**16
    resumed, resumed_final = fit(tmp_path / "step=3.ckpt")
    assert resumed_final["loss_scale"] == final["loss_scale"]
    for (name, x), y in zip(
        resumed.state_dict().items(), straight.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(x, y, msg=name)


class LossFromLogits(L.LightningModule):
    """A causal LM's next-token loss computed on the host from its logits,
    weighted small (an accumulation divisor)."""

    def __init__(self, weight: float) -> None:
        super().__init__()
        from .modules import hf_model

        self.model = hf_model("llama", vocab_size=1024)
        self.weight = weight

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self.model(input_ids=ids).logits
        assert logits.dtype == torch.float32  # (under 16-mixed, in fp32)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        return loss * self.weight

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0 / self.weight)


def test_fp16_logits_returned_for_a_loss_on_the_host_keep_their_small_gradients():
    """16-mixed: the logits came back in fp16, so their gradient (about
    1/(tokens x vocabulary), unscaled on the host) flushed to zero: 88% of
    the LM head's update was lost. They come back in fp32: the update is the
    fp32 run's."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 1024, (8, 32), generator=g))
    updates = {}
    for name, plugins in (("fp32", []), ("fp16", [RoundPipePrecision("16-mixed")])):
        module = LossFromLogits(weight=1 / 256)
        before = module.model.lm_head.weight.detach().clone()
        strategy = RoundPipeStrategy(async_optimizer=False, num_microbatches=2)
        cpu_trainer(strategy, max_steps=1, plugins=plugins).fit(module, loader(data, 8))
        updates[name] = module.model.lm_head.weight.detach() - before
    fp16, fp32 = updates["fp16"], updates["fp32"]
    assert (fp16 == 0).float().mean() < 0.01
    assert (fp16 - fp32).norm() / fp32.norm() < 0.02


class SmallLossHead(BackboneHead):
    """A head outside the pipeline with a loss weighted small (an
    accumulation divisor): fp16 gradients of the host code, unscaled, flush
    to zero."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) / 2**22

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=float(2**22))


def test_fp16_host_code_keeps_its_small_gradients():
    """16-mixed: the step's code on the host ran under fp16 autocast while
    the loss scale is the pipeline's: the head's gradients, unscaled, flushed
    to zero. It runs in fp32: the updates are the fp32 run's."""
    updates = {}
    for name, plugins in (("fp32", []), ("fp16", [RoundPipePrecision("16-mixed")])):
        module = SmallLossHead()
        before = [p.detach().clone() for p in module.parameters()]
        strategy = RoundPipeStrategy(async_optimizer=False, num_microbatches=2)
        cpu_trainer(strategy, max_steps=1, plugins=plugins).fit(module, loader(seq_data(8), 8))
        updates[name] = [p.detach() - b for p, b in zip(module.parameters(), before, strict=True)]
    for fp16, fp32 in zip(updates["fp16"], updates["fp32"], strict=True):
        assert (fp16 == 0).float().mean() < 0.01
        assert (fp16 - fp32).norm() / fp32.norm() < 0.02


class MakesTensors(SeqModule):
    def training_step(self, batch, batch_idx):
        x, y = batch
        weight = torch.ones(y.shape[0])  # (bf16 under bf16-true, as under Lightning's)
        assert weight.dtype == torch.bfloat16
        loss = torch.nn.functional.mse_loss(self.net(x), y, reduction="none").squeeze(-1) * weight
        return loss.mean()


def test_tensors_made_in_a_bf16_true_step_are_bf16():
    module = MakesTensors(extra=False)
    cpu_trainer(RoundPipeStrategy(async_optimizer=False), max_steps=2, precision="bf16-true").fit(
        module, loader(seq_data(16), 8)
    )
    assert torch.get_default_dtype() == torch.float32  # (restored after the step)


def test_the_fp16_loss_scale_goes_across_strategies_in_checkpoints(tmp_path):
    """Lightning restores a precision plugin's state by the plugin's class
    name: a 16-mixed checkpoint of the default strategy (MixedPrecision) lost
    its scale under RoundPipe (RoundPipePrecision), which restarted at 2^16,
    and the other way round. Each now goes on with the other's scale."""

    def lightning_fp16():
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))

    theirs = tmp_path / "auto.ckpt"
    trainer = cpu_trainer("auto", max_steps=1, plugins=[lightning_fp16()])
    trainer.fit(SeqModule(), loader(seq_data(16), 8))
    trainer.save_checkpoint(theirs)
    checkpoint = torch.load(theirs, weights_only=False)
    assert "RoundPipePrecision" not in checkpoint
    checkpoint["MixedPrecision"].update(scale=1024.0, _growth_tracker=7)  # (after overflows)
    torch.save(checkpoint, theirs)

    strategy = RoundPipeStrategy(async_optimizer=False, num_microbatches=2)
    plugins = [RoundPipePrecision("16-mixed")]
    trainer = cpu_trainer(strategy, max_steps=2, plugins=plugins)
    trainer.fit(SeqModule(), loader(seq_data(16), 8), ckpt_path=theirs)
    final = trainer.strategy.precision_plugin.final
    assert final["loss_scale"] == {"scale": 1024.0, "good_steps": 8}

    ours = tmp_path / "roundpipe.ckpt"
    trainer.save_checkpoint(ours)
    checkpoint = torch.load(ours, weights_only=False)
    plugin = lightning_fp16()
    plugin.load_state_dict(checkpoint["MixedPrecision"])
    assert plugin.scaler.get_scale() == 1024.0
    assert plugin.scaler._get_growth_tracker() == 8

"""Trainer(strategy="roundpipe") against Trainer(strategy="auto") on the same module."""

import subprocess
import sys
import threading
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BaseFinetuning
from torch import nn

import lightning_roundpipe
from lightning_roundpipe import RoundPipePrecision, RoundPipeStrategy

from .modules import CausalLM, LogitsLM, SeqModule, lm_data, loader, seq_data

pytest.importorskip("transformers")

QUIET = dict(
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
)


def fit(module, data, strategy, devices=1, **kw):
    L.seed_everything(0)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, **QUIET, **kw)
    trainer.fit(module, loader(data), loader(data))
    return trainer


def params(module):
    return [p.detach().clone() for p in module.parameters()]


def assert_same(a, b, atol=1e-5, rtol=1e-4):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


def sync(n_mb=4, **kw):
    return RoundPipeStrategy(async_optimizer=False, num_microbatches=n_mb, **kw)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_causal_lm_matches_default_strategy(kind):
    data = lm_data()
    ref = CausalLM(kind)
    t_ref = fit(ref, data, "auto", max_steps=6, accumulate_grad_batches=2, gradient_clip_val=0.5)
    mod = CausalLM(kind)
    t = fit(
        mod, data, sync(), devices=3, max_steps=6, accumulate_grad_batches=2, gradient_clip_val=0.5
    )
    assert_same(params(mod), params(ref))
    for key in ("train_loss", "val_loss"):
        torch.testing.assert_close(
            t.callback_metrics[key], t_ref.callback_metrics[key], atol=1e-5, rtol=1e-5
        )


def test_lora_matches_default_strategy_and_frozen_weights_get_no_gradients():
    pytest.importorskip("peft")
    data = lm_data()
    ref = CausalLM("llama", lora=True)
    fit(ref, data, "auto", max_steps=4)
    mod = CausalLM("llama", lora=True)
    strategy = sync()
    frozen_before = [p.detach().clone() for p in mod.parameters() if not p.requires_grad]
    fit(mod, data, strategy, devices=2, max_steps=4)
    assert_same(params(mod), params(ref))
    frozen_after = [p for p in mod.parameters() if not p.requires_grad]
    assert frozen_before and all(
        torch.equal(a, b) for a, b in zip(frozen_before, frozen_after, strict=True)
    )
    assert "lora_A" in "".join(mod.state_dict().keys())


def _bf16_base(module):
    """The LoRA base in bf16 (as loaded with ``torch_dtype=torch.bfloat16``),
    the adapters in fp32."""
    for p in module.parameters():
        if not p.requires_grad:
            p.data = p.data.bfloat16()
    return module


def test_lora_on_a_bf16_base_holds_it_once_and_trains_like_the_default_strategy(tmp_path):
    pytest.importorskip("peft")
    data = lm_data()
    ref = _bf16_base(CausalLM("llama", lora=True))
    fit(ref, data, "auto", max_steps=4, precision="bf16-mixed")
    mod = _bf16_base(CausalLM("llama", lora=True))
    frozen = {n: p.detach().clone() for n, p in mod.named_parameters() if not p.requires_grad}
    seen = []

    class Held(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append(trainer.strategy.engine.host_memory())

    start = params(mod)
    fit(mod, data, sync(), devices=2, max_steps=4, precision="bf16-mixed", callbacks=[Held()])
    # bf16 rounding differs with the micro-batch split: 4 steps of lr 1e-3 move
    # the adapters by ~4e-3, and nearly every element of the two runs agrees to
    # 2e-4. AdamW's first steps move an element by about lr times its
    # gradient's sign, so one whose gradient is within rounding of zero may go
    # either way (on AVX2 CPUs a few of a thousand do: up to 2 lr apart)
    trained, reference = params(mod), params(ref)
    assert_same(trained, reference, atol=4 * 1e-3, rtol=0)
    close = [torch.isclose(a, b, atol=2e-4, rtol=1e-2) for a, b in zip(trained, reference)]
    assert sum(int(c.sum()) for c in close) >= 0.98 * sum(c.numel() for c in close)
    assert max((a - b).abs().max() for a, b in zip(params(mod), start, strict=True)) > 2e-3
    # the base's master copies are the parameters themselves, which stay as they were
    assert seen and all(m["shared"] == sum(v.nbytes for v in frozen.values()) for m in seen)
    for name, p in mod.named_parameters():
        if not p.requires_grad:
            assert p.dtype == torch.bfloat16 and torch.equal(p, frozen[name]), name
    # an asynchronous run's checkpoint keeps the adapters' one-update-behind
    # weights, not a second copy of the base
    t = fit(mod, data, RoundPipeStrategy(num_microbatches=4), devices=2, max_steps=2)
    ckpt = tmp_path / "lora.ckpt"
    t.save_checkpoint(ckpt)
    stale = torch.load(ckpt, weights_only=False)["roundpipe_stale_weights"]
    trainable = {n for n, p in mod.named_parameters() if p.requires_grad}
    assert set(stale) == trainable


class _Backbone(BaseFinetuning):
    """Freezes the first layer before training (in its setup hook, before the
    strategy's) and unfreezes it at epoch 1; freezes the last layer at the start
    of epoch 0 (after the strategy built its engine)."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.net[0])

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 0:
            self.freeze(pl_module.net[4])
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.net[0], optimizer, lr=1e-2)


class _EpochEnds(L.Callback):
    """The first layer's weights and the engine's iteration count at each epoch end."""

    def __init__(self):
        self.first, self.counts = [], []

    def on_train_epoch_end(self, trainer, pl_module):
        self.first.append(params(pl_module)[:2])
        self.counts.append(trainer.strategy.engine.iteration)


def _frozen_then_trained(mod, start, ends):
    """The first layer frozen through epoch 0 and trained in epoch 1, the last
    never trained; the rebuilt engines go on numbering iterations (dropout masks)."""
    assert all(torch.equal(a, b) for a, b in zip(ends.first[0], start[:2], strict=True))
    assert not torch.equal(ends.first[1][0], start[0])
    assert not torch.equal(params(mod)[2], start[2])
    assert torch.equal(params(mod)[4], start[4])
    assert ends.counts == [8, 16]


def test_freezing_and_unfreezing_during_fit_trains_like_the_default_strategy(caplog):
    # each change of the trainable set gets an engine for the new set
    data = seq_data()
    ref = SeqModule(extra=False)
    fit(ref, data, "auto", max_epochs=2, callbacks=[_Backbone()])
    mod = SeqModule(extra=False)
    start, ends = params(mod), _EpochEnds()
    with caplog.at_level("INFO"):
        fit(mod, data, sync(2), devices=2, max_epochs=2, callbacks=[_Backbone(), ends])
    assert_same(params(mod), params(ref))
    _frozen_then_trained(mod, start, ends)
    rebuilt = [r.message for r in caplog.records if "rebuilt the engine" in r.message]
    assert len(rebuilt) == 2
    assert "(net.4.weight, net.4.bias)" in rebuilt[0] and "(net.0.weight" in rebuilt[1]


def test_asynchronous_training_follows_freezing_and_unfreezing():
    mod = SeqModule(extra=False)
    start, ends = params(mod), _EpochEnds()
    strategy = RoundPipeStrategy(num_microbatches=2)
    fit(mod, seq_data(), strategy, devices=2, max_epochs=2, callbacks=[_Backbone(), ends])
    _frozen_then_trained(mod, start, ends)


def test_freezing_inside_an_accumulation_window_is_refused():
    class Midway(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:  # the second of two accumulated batches
                pl_module.net[0].requires_grad_(False)

    with pytest.raises(ValueError, match="changed in the middle of a gradient accumulation"):
        fit(
            SeqModule(extra=False),
            seq_data(),
            sync(2),
            devices=2,
            max_steps=2,
            accumulate_grad_batches=2,
            callbacks=[Midway()],
        )


def test_loss_from_logits_in_training_step():
    data = lm_data()
    ref = LogitsLM("qwen3")
    fit(ref, data, "auto", max_steps=4)
    mod = LogitsLM("qwen3")
    fit(mod, data, sync(), devices=2, max_steps=4)
    assert_same(params(mod), params(ref))


@pytest.mark.parametrize("devices", [1, 3])
def test_sequential_with_extra_loss_term_and_step_scheduler(devices):
    data = seq_data()
    ref = SeqModule()
    fit(ref, data, "auto", max_epochs=2)
    mod = SeqModule()
    t = fit(mod, data, sync(), devices=devices, max_epochs=2)
    assert_same(params(mod), params(ref))
    assert (
        t.lr_scheduler_configs[0].scheduler.get_last_lr()
        == ref.trainer.lr_scheduler_configs[0].scheduler.get_last_lr()
    )


def test_async_mode_trains():
    data = lm_data(64)
    mod = CausalLM("qwen3", lr=3e-3)
    t = fit(mod, data, "roundpipe", devices=2, max_epochs=3)
    assert isinstance(t.strategy, RoundPipeStrategy) and t.strategy.async_optimizer
    assert float(t.callback_metrics["val_loss"]) < 4.5  # log(97) = 4.57 at the start


def test_registered_names():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["roundpipe"]["init_params"] == {"async_optimizer": True}
    assert StrategyRegistry["roundpipe_sync"]["init_params"] == {"async_optimizer": False}
    assert lightning_roundpipe.RoundPipeStrategy is RoundPipeStrategy


def test_checkpoint_loads_without_roundpipe_and_resume_matches(tmp_path):
    data = lm_data()
    straight = CausalLM("qwen3")
    fit(straight, data, sync(), devices=2, max_steps=8)

    first = CausalLM("qwen3")
    t1 = fit(first, data, sync(), devices=2, max_epochs=1)  # 4 steps: an epoch boundary
    ckpt = tmp_path / "half.ckpt"
    t1.save_checkpoint(ckpt)
    resumed = CausalLM("qwen3")
    L.seed_everything(0)
    t2 = L.Trainer(strategy=sync(), accelerator="cpu", devices=2, max_steps=8, **QUIET)
    t2.fit(resumed, loader(data), loader(data), ckpt_path=ckpt)
    assert_same(params(resumed), params(straight), atol=1e-6, rtol=1e-6)

    # an ordinary Lightning user loads it without lightning_roundpipe
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
        "from tests.strategy.modules import CausalLM\n"
        f"m = CausalLM.load_from_checkpoint({str(ckpt)!r})\n"
        "assert 'lightning_roundpipe' not in sys.modules\n"
        "print(sum(p.numel() for p in m.parameters()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) == sum(p.numel() for p in first.parameters())


def test_checkpoint_from_default_strategy_resumes_under_roundpipe(tmp_path):
    data = lm_data()
    straight = CausalLM("qwen3")
    fit(straight, data, "auto", max_steps=8)
    first = CausalLM("qwen3")
    t1 = fit(first, data, "auto", max_epochs=1)
    t1.save_checkpoint(tmp_path / "a.ckpt")
    resumed = CausalLM("qwen3")
    L.seed_everything(0)
    L.Trainer(strategy=sync(), accelerator="cpu", devices=2, max_steps=8, **QUIET).fit(
        resumed, loader(data), loader(data), ckpt_path=tmp_path / "a.ckpt"
    )
    assert_same(params(resumed), params(straight))


class NoStack(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        return self.a(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_errors_name_the_option():
    data = seq_data(8)
    with pytest.raises(
        ValueError,
        match=r"no layer stack found in NoStack: .*searched: a\)\. "
        "Pass layers='attribute.path' to RoundPipeStrategy",
    ):
        fit(NoStack(), data, sync(), max_steps=1)
    with pytest.raises(
        ValueError,
        match="precision='64-true' is not supported by the RoundPipe "
        "strategy; use one of '32-true'",
    ):
        fit(SeqModule(), data, sync(), max_steps=1, precision="64-true")
    with pytest.raises(ValueError, match=r"layers='nope': SeqModule has no attribute 'nope'"):
        fit(SeqModule(), data, sync(layers="nope"), max_steps=1)
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer or 'auto'"):
        RoundPipeStrategy(num_microbatches=0)


class Manual(SeqModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


def test_manual_optimization_is_refused():
    with pytest.raises(ValueError, match="supports automatic optimization only"):
        fit(Manual(), seq_data(8), sync(), max_steps=1)


@pytest.mark.parametrize("double_buffer", [None, False], ids=["two-copies", "one-copy"])
def test_async_resume_continues_exactly_like_an_uninterrupted_async_run(tmp_path, double_buffer):
    data = lm_data()

    def strategy():
        return RoundPipeStrategy(num_microbatches=4, double_buffer=double_buffer)

    straight = CausalLM("qwen3")
    fit(straight, data, strategy(), devices=2, max_steps=8)
    first = CausalLM("qwen3")
    t1 = fit(first, data, strategy(), devices=2, max_epochs=1)
    ckpt = tmp_path / "async.ckpt"
    t1.save_checkpoint(ckpt)
    assert "roundpipe_stale_weights" in torch.load(ckpt, weights_only=False)
    # (a weights-only checkpoint resumes nothing: no second copy of the weights)
    t1.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
    assert "roundpipe_stale_weights" not in torch.load(tmp_path / "weights.ckpt")
    resumed = CausalLM("qwen3")
    L.seed_everything(0)
    L.Trainer(
        strategy=strategy(),
        accelerator="cpu",
        devices=2,
        max_steps=8,
        **QUIET,
    ).fit(resumed, loader(data), loader(data), ckpt_path=ckpt)
    assert_same(params(resumed), params(straight), atol=1e-6, rtol=1e-6)
    # and restarting from the parameters alone is not the same run
    assert any(not torch.equal(a, b) for a, b in zip(params(first), params(straight), strict=True))


class DropoutLM(CausalLM):
    """Attention dropout: its masks depend on the iteration number."""

    def __init__(self) -> None:
        super().__init__("qwen3")
        self.model.config.attention_dropout = 0.2
        for layer in self.model.model.layers:
            layer.self_attn.attention_dropout = 0.2


def test_fp16_resume_goes_on_with_the_loss_scale_and_the_dropout_masks(tmp_path):
    """A 16-mixed run resumed from a checkpoint continues exactly: the loss
    scale (backed off from 2^16 by overflowing first steps) and the engine's
    iteration number (dropout masks) are saved with the precision plugin."""
    data = lm_data()

    def fp16():  # (Trainer(precision="16-mixed") falls back to bf16 on CPU; this does not)
        return dict(devices=2, plugins=[RoundPipePrecision("16-mixed")])

    straight = DropoutLM()
    fit(straight, data, sync(), max_steps=8, **fp16())
    first = DropoutLM()
    t1 = fit(first, data, sync(), max_epochs=1, **fp16())  # 4 steps
    ckpt = tmp_path / "fp16.ckpt"
    t1.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["RoundPipePrecision"] == {
        "iteration": 4,
        "loss_scale": {"scale": 2.0**16, "good_steps": 4},
    }
    resumed = DropoutLM()
    L.seed_everything(0)
    t2 = L.Trainer(strategy=sync(), accelerator="cpu", max_steps=8, **fp16(), **QUIET)
    t2.fit(resumed, loader(data), loader(data), ckpt_path=ckpt)
    assert_same(params(resumed), params(straight), atol=1e-6, rtol=1e-6)
    # a scale that had backed off goes on from where it was, not from 2^16
    saved["RoundPipePrecision"]["loss_scale"] = {"scale": 1024.0, "good_steps": 2}
    torch.save(saved, tmp_path / "backed_off.ckpt")
    t3 = L.Trainer(strategy=sync(), accelerator="cpu", max_steps=8, **fp16(), **QUIET)
    t3.fit(DropoutLM(), loader(data), loader(data), ckpt_path=tmp_path / "backed_off.ckpt")
    assert t3.strategy.precision_plugin.final == {
        "iteration": 8,
        "loss_scale": {"scale": 1024.0, "good_steps": 6},
    }


def test_roundpipe_checkpoint_resumes_under_the_default_strategy(tmp_path):
    data = lm_data()
    straight = CausalLM("qwen3")
    fit(straight, data, "auto", max_steps=8)
    first = CausalLM("qwen3")
    t1 = fit(first, data, sync(), devices=2, max_epochs=1)
    t1.save_checkpoint(tmp_path / "rp.ckpt")
    resumed = CausalLM("qwen3")
    L.seed_everything(0)
    L.Trainer(strategy="auto", accelerator="cpu", devices=1, max_steps=8, **QUIET).fit(
        resumed, loader(data), loader(data), ckpt_path=tmp_path / "rp.ckpt"
    )
    assert_same(params(resumed), params(straight))


class MetricLM(CausalLM):
    def __init__(self):
        super().__init__("qwen3", lr=3e-3)
        import torchmetrics

        self.train_mean = torchmetrics.MeanMetric()
        self.val_ppl = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.train_mean(loss.detach())
        self.log("train_mean", self.train_mean, on_step=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        ids, mask, labels = batch
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        self.val_ppl(loss.exp())
        self.log("val_loss", loss)
        self.log("val_ppl", self.val_ppl)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


def test_callbacks_loggers_and_metrics_work(tmp_path):
    from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor="val_loss", save_top_k=2, every_n_epochs=1
    )
    trainer = L.Trainer(
        strategy="roundpipe",
        accelerator="cpu",
        devices=2,
        max_epochs=3,
        logger=[CSVLogger(tmp_path, name="csv"), CSVLogger(tmp_path, name="second")],
        log_every_n_steps=1,
        callbacks=[
            ckpt,
            LearningRateMonitor(logging_interval="step"),
            EarlyStopping(monitor="val_loss", patience=5),
        ],
        enable_progress_bar=True,
        enable_model_summary=True,
    )
    module = MetricLM()
    data = lm_data(32)
    trainer.fit(module, loader(data), loader(data))
    assert trainer.current_epoch == 3
    best = Path(ckpt.best_model_path)
    assert best.exists()
    loaded = MetricLM.load_from_checkpoint(best)
    assert sum(p.numel() for p in loaded.parameters()) == sum(
        p.numel() for p in module.parameters()
    )
    # (the strategy's own metrics reach every logger, as self.log's do)
    second = (Path(trainer.loggers[1].log_dir) / "metrics.csv").read_text()
    assert "roundpipe/step_time" in second.splitlines()[0]
    metrics = (Path(trainer.logger.log_dir) / "metrics.csv").read_text()
    for column in (
        "train_loss",
        "train_mean",
        "val_loss",
        "val_ppl",
        "lr-AdamW",
        "roundpipe/step_time",
        "roundpipe/wait_fraction",
        "roundpipe/simulated_bubble",
    ):
        assert column in metrics.splitlines()[0]
    lrs = [
        float(row.split(",")[metrics.splitlines()[0].split(",").index("lr-AdamW")])
        for row in metrics.splitlines()[1:]
        if row.split(",")[metrics.splitlines()[0].split(",").index("lr-AdamW")]
    ]
    assert max(lrs) == pytest.approx(3e-3) and min(lrs) == pytest.approx(3e-3 * 0.9**2)


class PredictLM(CausalLM):
    def test_step(self, batch, batch_idx):
        ids, mask, labels = batch
        self.log("test_loss", self.model(input_ids=ids, attention_mask=mask, labels=labels).loss)

    def predict_step(self, batch, batch_idx):
        ids, mask, _ = batch
        return self.model(input_ids=ids, attention_mask=mask).logits


def test_test_and_predict_run_forward_only_through_the_pipeline():
    data = lm_data(16)
    ref = PredictLM("qwen3")
    mod = PredictLM("qwen3")
    kw = dict(accelerator="cpu", **QUIET)
    ref_test = L.Trainer(strategy="auto", devices=1, **kw).test(ref, loader(data))
    ref_pred = L.Trainer(strategy="auto", devices=1, **kw).predict(ref, loader(data))
    rp_test = L.Trainer(strategy=sync(), devices=2, **kw).test(mod, loader(data))
    rp_pred = L.Trainer(strategy=sync(), devices=2, **kw).predict(mod, loader(data))
    assert rp_test[0]["test_loss"] == pytest.approx(ref_test[0]["test_loss"], rel=1e-5)
    for a, b in zip(rp_pred, ref_pred, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(p.grad is None for p in mod.parameters())


def test_async_training_matches_a_staleness_one_reference():
    """Window k computes with the weights after k-1 updates; update k applies to
    the weights after k-1 updates (hand-written with plain PyTorch)."""
    import copy

    data = lm_data()
    steps = 6
    mod = CausalLM("qwen3")
    reference = copy.deepcopy(mod.model)
    fit(mod, data, RoundPipeStrategy(num_microbatches=4), devices=2, max_steps=steps)

    compute = copy.deepcopy(reference)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    history = [[p.detach().clone() for p in reference.parameters()]]
    batches = [b for _ in range(2) for b in loader(data)][:steps]
    for k, (ids, mask, labels) in enumerate(batches):
        with torch.no_grad():
            for c, w in zip(compute.parameters(), history[max(0, k - 1)], strict=True):
                c.copy_(w)
        compute.zero_grad()
        compute(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        for p, c in zip(reference.parameters(), compute.parameters(), strict=True):
            p.grad = c.grad.clone()
        opt.step()
        history.append([p.detach().clone() for p in reference.parameters()])
    assert_same(
        [p.detach() for p in mod.model.parameters()], [p.detach() for p in reference.parameters()]
    )


class ForeignOptimizer(SeqModule):
    def configure_optimizers(self):
        return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)


def test_optimizer_over_foreign_parameters_is_refused():
    with pytest.raises(
        ValueError,
        match="the optimizer holds a parameter that is not a parameter of the LightningModule",
    ):
        fit(ForeignOptimizer(), seq_data(8), sync(), max_steps=1)


def test_duplicate_gpus_need_workers_per_device():
    strategy = sync()
    strategy.parallel_devices = [torch.device("cuda", 0), torch.device("cuda", 0)]
    with pytest.raises(
        ValueError,
        match=r"devices lists a GPU more than once \(cuda:0, cuda:0\); "
        "to run several pipeline workers on one GPU pass workers_per_device=k",
    ):
        strategy._build_engine(None)


def test_workers_per_device_multiplies_cpu_workers():
    data = seq_data()
    ref = SeqModule()
    fit(ref, data, "auto", max_steps=3)
    mod = SeqModule()
    t = fit(mod, data, sync(workers_per_device=2), devices=2, max_steps=3)
    assert t.strategy.microbatches == 4
    assert_same(params(mod), params(ref))


class GradHookLM(CausalLM):
    """Records each step's gradient norm and halves the gradients before the step."""

    def __init__(self) -> None:
        super().__init__("qwen3")
        self.norms: list[torch.Tensor] = []

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:  # the asynchronous optimizer: not available here
            return
        self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        for g in grads:
            g.mul_(0.5)


class BackwardHooksLM(CausalLM):
    """Counts the backward hooks Lightning runs around each backward."""

    def __init__(self) -> None:
        super().__init__("qwen3")
        self.calls: list[str] = []

    def on_before_backward(self, loss):
        self.calls.append("before")

    def backward(self, loss, *args, **kwargs):
        self.calls.append("backward")
        super().backward(loss, *args, **kwargs)

    def on_after_backward(self):
        self.calls.append("after")


class CountBackward(L.Callback):
    def __init__(self) -> None:
        self.calls = 0

    def on_after_backward(self, trainer, pl_module):
        self.calls += 1


@pytest.mark.parametrize("strategy", ["roundpipe", "roundpipe_sync"])
def test_backward_hooks_and_an_overridden_backward_run(strategy):
    mod, cb = BackwardHooksLM(), CountBackward()
    fit(mod, lm_data(), strategy, max_steps=2, accumulate_grad_batches=2, callbacks=[cb])
    assert mod.calls == ["before", "backward", "after"] * 4
    assert cb.calls == 4


def test_sync_hooks_before_the_step_see_and_change_this_steps_gradients():
    data = lm_data()
    ref = GradHookLM()
    fit(ref, data, "auto", max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.05)
    mod = GradHookLM()
    fit(
        mod, data, sync(), devices=2, max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.05
    )
    assert len(mod.norms) == len(ref.norms) == 4
    torch.testing.assert_close(torch.stack(mod.norms), torch.stack(ref.norms), rtol=1e-4, atol=1e-6)
    assert_same(params(mod), params(ref))
    # the step releases its gradients: nothing stays attached between steps
    assert all(p.grad is None for p in mod.parameters())


def test_async_warns_that_hooks_before_the_step_cannot_see_gradients():
    data = lm_data()
    with pytest.warns(
        UserWarning,
        match=r"GradHookLM.on_before_optimizer_step is overridden.*roundpipe_sync",
    ):
        fit(GradHookLM(), data, "roundpipe", max_steps=2)

    class ClipHookLM(CausalLM):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, **kw):
            torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)  # needs .grad

    with pytest.warns(UserWarning, match=r"ClipHookLM.configure_gradient_clipping is overridden"):
        fit(ClipHookLM(), data, "roundpipe", max_steps=2)


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_auto_microbatches_follow_the_simulated_bubble_and_short_batches_train(async_optimizer):
    from lightning_roundpipe.plan import choose_microbatches
    from lightning_roundpipe.runtime import estimate_costs

    data = lm_data(n=33)  # batches of 8, the last one a single sample
    strategy = RoundPipeStrategy(async_optimizer=async_optimizer)
    mod = CausalLM()
    seen = []

    class Count(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append(trainer.strategy.engine.last_schedule.num_microbatches)

    fit(mod, data, strategy, devices=2, max_epochs=1, callbacks=[Count()])
    costs = estimate_costs(strategy.pipeline_layers, torch.float32)
    assert strategy.microbatches == choose_microbatches(costs, 2, async_optimizer=async_optimizer)
    # batches of 8 (split into at most 8), the last one sample: one micro-batch,
    # fewer than the two devices
    assert seen == [min(strategy.microbatches, 8)] * 4 + [1]
    if not async_optimizer:
        ref = CausalLM()
        fit(ref, data, "auto", max_epochs=1)
        assert_same(params(mod), params(ref))


class SkipsABatch(CausalLM):
    """Returns None for batch 1, after calling the model (whose pipelined
    backward has then already run) when ``call_model``."""

    def __init__(self, call_model: bool) -> None:
        super().__init__("qwen3")
        self.call_model = call_model

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx) if self.call_model else None
        return None if batch_idx == 1 else loss


@pytest.mark.parametrize("call_model", [False, True])
def test_a_training_step_returning_none_changes_nothing(call_model):
    ref, mod = SkipsABatch(call_model), SkipsABatch(call_model)
    fit(ref, lm_data(), "auto", max_steps=3)
    fit(mod, lm_data(), sync(), devices=2, max_steps=3)
    # tight: a step on zero gradients still moves AdamW's weights a little
    assert_same(params(mod), params(ref), atol=5e-6, rtol=1e-6)


def test_trace_dir_gets_timelines_and_a_chrome_trace_and_traffic_is_reported(tmp_path, caplog):
    pytest.importorskip("matplotlib")
    import json
    import logging

    strategy = RoundPipeStrategy(num_microbatches=4, trace_dir=str(tmp_path / "trace"))
    with caplog.at_level(logging.INFO):
        fit(CausalLM(), lm_data(), strategy, devices=2, max_steps=4)
    files = sorted(p.name for p in (tmp_path / "trace").iterdir())
    assert files == ["timeline-measured.png", "timeline-simulated.png", "trace.json"]
    events = json.loads((tmp_path / "trace" / "trace.json").read_text())["traceEvents"]
    assert {e["tid"] for e in events} == {0, 1}
    # each stage's weights went up once in the last step (one round per batch)
    assert "weights up" in caplog.text and "(1.00x the minimum)" in caplog.text


def test_activation_memory_must_be_a_byte_count():
    with pytest.raises(ValueError, match="activation_memory must be a positive number of bytes"):
        RoundPipeStrategy(activation_memory=0)


def test_the_startup_log_and_plan_errors_name_the_layers(caplog):
    """Plan strings count the embedding and the head: the log and the errors
    say which index is which."""
    data = lm_data(8)
    with caplog.at_level("INFO"):
        fit(CausalLM(), data, sync(n_mb=2), max_steps=1)
    assert "pipeline layers (0 embed, 1-3 blocks, 4 head), plan" in caplog.text
    with pytest.raises(
        ValueError, match=r"has 5.*Pipeline layers: 0 embed, 1-3 blocks, 4 head$"
    ) as info:
        fit(CausalLM(), data, sync(n_mb=2, plan="1,1|1|1,1"), max_steps=1)
    assert "covers" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"nonfinite": "drop"}, "nonfinite must be 'raise', 'skip' or 'ignore', got 'drop'"),
        ({"watchdog_timeout": 0}, "watchdog_timeout must be > 0"),
        ({"microbatches_per_round": 0}, "microbatches_per_round must be an integer >= 1"),
        ({"device_memory_limit": -1}, "device_memory_limit must be > 0 bytes"),
        ({"replan_margin": -0.1}, "replan_margin must be >= 0"),
        (
            {"async_optimizer": False, "double_buffer": True},
            r"double_buffer=True needs the asynchronous optimizer \(async_optimizer=True\)",
        ),
        ({"double_buffer": "yes"}, "double_buffer must be True or False or None, got 'yes'"),
        # every option's type, checked from its annotation before anything else:
        # a string is not a flag, a float is not a count of workers
        ({"async_optimizer": "false"}, "async_optimizer must be True or False, got 'false'"),
        ({"fuse_optimizer": "no"}, "fuse_optimizer must be True or False, got 'no'"),
        ({"seed": 1.5}, "seed must be an integer or None, got 1.5"),
        # (past torch.manual_seed's range the seed wrapped around: 2**64 ran as 0)
        (
            {"seed": 2**64},
            r"seed must be in \[-2\*\*63, 2\*\*64\) or None, got 18446744073709551616",
        ),
        (
            {"seed": -(2**63) - 1},
            r"seed must be in \[-2\*\*63, 2\*\*64\) or None, got -9223372036854775809",
        ),
        ({"plan": 5}, "plan must be a string or 'auto', got 5"),
        ({"layers": 123}, "layers must be a string or None, got 123"),
        ({"trace_dir": 123}, "trace_dir must be a string or a path or None, got 123"),
        ({"workers_per_device": 2.5}, "workers_per_device must be an integer, got 2.5"),
        ({"watchdog_timeout": "5"}, "watchdog_timeout must be a number, got '5'"),
        (
            {"device_memory_limit": 1e9},
            "device_memory_limit must be an integer or None, got 1000000000.0",
        ),
        ({"nonfinite": 3}, "nonfinite must be 'raise' or 'skip' or 'ignore', got 3"),
        ({"log_every_n_steps": "5"}, "log_every_n_steps must be an integer or None, got '5'"),
        ({"log_every_n_steps": -1}, r"log_every_n_steps must be >= 0 \(0 turns the strategy's own"),
    ],
)
def test_engine_options_are_refused_when_the_strategy_is_built(kwargs, match):
    """The strategy validates the engine's options once, through the same
    EngineOptions the engine uses, before any setup."""
    with pytest.raises(ValueError, match=match):
        RoundPipeStrategy(**kwargs)


class BatchNormSeq(SeqModule):
    def __init__(self) -> None:
        super().__init__(extra=False)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


@pytest.mark.parametrize("n_mb", [1, 2])
def test_batch_norm_over_micro_batches_is_warned_of_and_one_micro_batch_is_whole_batch(n_mb):
    """Batch norm sees one micro-batch at a time: with several its statistics
    differ from whole-batch training (the strategy warns, naming the layer
    and the count); with one micro-batch the training equals the default
    strategy's."""
    data = seq_data(32)
    ref = BatchNormSeq()
    fit(ref, data, "auto", max_steps=3)
    mod = BatchNormSeq()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(mod, data, sync(n_mb), devices=2, max_steps=3)
    said = [str(w.message) for w in caught if "normalise over the samples" in str(w.message)]
    if n_mb == 1:
        assert not said
        assert_same(params(mod), params(ref))
        assert torch.allclose(mod.net[1].running_mean, ref.net[1].running_mean, atol=1e-6)
    else:
        assert said == [
            "BatchNorm1d (layer 1) normalise over the samples of each micro-batch: with 2 "
            "micro-batches per batch (as given) their statistics, and so the training, differ "
            "from whole-batch training and change with the count; set num_microbatches=1 for "
            "whole-batch statistics, or a fixed integer so that runs on different numbers of "
            "devices agree"
        ]


def test_batch_norm_on_a_one_sample_micro_batch_says_which_option_to_change():
    """5 samples in 3 micro-batches are cut 2, 2, 1: batch norm's own error
    on the last gets what to change (the count, or dropping the short batch)."""
    data = seq_data(5)
    trainer = L.Trainer(strategy=sync(3), accelerator="cpu", devices=2, max_steps=1, **QUIET)
    with pytest.raises(
        Exception,
        match=r"micro-batch 2.*more than 1 value per channel.*one sample: give "
        r"num_microbatches at most half the smallest batch.*drop_last=True",
    ):
        trainer.fit(BatchNormSeq(), loader(data, 5))


class SequenceFirstSeq(SeqModule):
    def __init__(self, batch_first: bool) -> None:
        super().__init__(extra=False)
        block = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)
        self.net = nn.Sequential(block, nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x.view(len(x), 2, 4).repeat(1, 1, 2)), y[:, None])


@pytest.mark.parametrize("batch_first", [False, True])
def test_sequence_first_modules_are_warned_of_when_the_batch_is_split(batch_first):
    """Batches are split along dimension 0: a module taking sequence-first
    input would see its sequences cut. The strategy says so, naming the
    outermost such module once (not the attention inside it)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(SequenceFirstSeq(batch_first), seq_data(16), sync(2), devices=2, max_steps=1)
    said = [str(w.message) for w in caught if "batch_first=False" in str(w.message)]
    if batch_first:
        assert not said
    else:
        assert said == [
            "TransformerEncoderLayer (layer 0) take(s) batch_first=False, but RoundPipe splits "
            "every batch into 2 micro-batches along dimension 0 (each tensor whose first "
            "dimension is the batch size): if sequences reach these modules sequence-first, the "
            "split cuts the sequences instead of the batch. Build them with batch_first=True, or "
            "set num_microbatches=1"
        ]


class _Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x):
        return self.lin(x), x.sum(-1, keepdim=True)  # one value: a tuple


class _Join(nn.Module):
    def forward(self, pair):  # takes the tuple whole, as nn.Sequential passes it
        return pair[0] * pair[1]


class TupleSeq(SeqModule):
    def __init__(self) -> None:
        super().__init__(extra=False)
        self.net = nn.Sequential(_Split(), _Join(), nn.Tanh(), nn.Linear(16, 1))


def test_sequential_children_take_a_tuple_whole_as_torch_passes_it():
    """nn.Sequential hands each child the previous one's output as its one
    argument, a tuple included: pipelined, it trains like the default
    strategy (the model adapters' layers get tuples spread instead)."""
    data = seq_data(32)
    ref = TupleSeq()
    fit(ref, data, "auto", max_steps=3)
    mod = TupleSeq()
    fit(mod, data, sync(2, plan="1,2|1|2,1"), devices=2, max_steps=3)  # (the tuple crosses stages)
    assert_same(params(mod), params(ref))


class IteratedSeq(SeqModule):
    """Runs its layer stack child by child: the stack itself is never called."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        for layer in self.net:
            x = layer(x)
        return nn.functional.mse_loss(x, y)


def test_a_step_that_never_calls_the_layer_stack_is_warned_of():
    """Iterating over an nn.Sequential runs its children outside the pipeline
    (on the loop's thread, on the host): the first training step says so,
    naming the stack; a step that calls it says nothing."""
    data = seq_data(16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(IteratedSeq(extra=False), data, sync(2), devices=2, max_steps=2)
    said = [str(w.message) for w in caught if "never called net" in str(w.message)]
    assert len(said) == 1, said
    assert said[0].startswith(
        "the first training step never called net (nn.Sequential), the layer stack RoundPipe "
        "pipelines: whatever of its layers ran, ran on the training loop's thread outside the "
        "pipeline"
    )
    assert "Call net(...) itself rather than its layers one by one" in said[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(SeqModule(extra=False), data, sync(2), devices=2, max_steps=2)
        # (a call without gradients counts: a linear probe on a frozen stack)
        fit(ProbedSeq(), data, sync(2), devices=2, max_steps=2)
    assert not [w for w in caught if "never called" in str(w.message)]


class ProbedSeq(SeqModule):
    """The stack runs without gradients; only the module outside it trains."""

    def __init__(self) -> None:
        super().__init__(extra=True)
        self.net.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            features = self.net(x)
        return nn.functional.mse_loss(self.extra(features), y)


def test_option_types_accept_numpy_numbers_and_refuse_flags_for_numbers():
    import numpy as np

    strategy = RoundPipeStrategy(
        seed=np.int64(3),
        watchdog_timeout=np.float32(5.0),
        workers_per_device=1,
        num_microbatches=np.int64(2),  # (the type check took it, the value check refused it)
        oom_replans=np.int32(1),
        microbatches_per_round=np.int64(2),
    )
    assert type(strategy.num_microbatches) is int and strategy.num_microbatches == 2
    assert type(strategy.options.microbatches_per_round) is int
    with pytest.raises(ValueError, match="seed must be an integer or None, got True"):
        RoundPipeStrategy(seed=True)


@pytest.mark.parametrize("plan", ["garbage", "", "5||"])
def test_an_unreadable_plan_is_refused_when_the_strategy_is_made(plan):
    with pytest.raises(ValueError, match=rf"plan={plan!r} cannot be read: cannot parse plan"):
        RoundPipeStrategy(plan=plan)


def test_the_strategys_metrics_cover_each_step_of_each_engine(tmp_path):
    """A second fit (a new engine, whose counters start at 0) and a
    validation between steps: the wait fraction and transfer rate were
    negative after a new engine, the step time counted the validation."""
    from lightning.pytorch.loggers import CSVLogger

    module = SeqModule(extra=False)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(async_optimizer=False, num_microbatches=2),
        accelerator="cpu",
        devices=2,
        max_steps=4,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        val_check_interval=2,
        limit_val_batches=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader(seq_data(64), 8), loader(seq_data(16), 8))
    trainer.fit_loop.epoch_loop.max_steps = 8
    trainer.fit(module, loader(seq_data(64), 8), loader(seq_data(16), 8))
    trainer.logger.finalize("success")
    lines = (Path(trainer.logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    rows = [dict(zip(header, line.split(","), strict=True)) for line in lines[1:]]
    steps = [r for r in rows if r.get("roundpipe/wait_fraction")]
    assert len(steps) >= 4
    for row in steps:
        assert float(row["roundpipe/wait_fraction"]) >= 0.0, row
        assert float(row["roundpipe/transfer_gb_per_s"]) >= 0.0, row


class _CheckpointedDropoutLM(CausalLM):
    def __init__(self, checkpointing: bool) -> None:
        super().__init__("llama")
        self.model.config.attention_dropout = 0.2
        for layer in self.model.model.layers:  # (the config is read at init)
            layer.self_attn.attention_dropout = 0.2
        if checkpointing:
            self.model.gradient_checkpointing_enable()


@pytest.mark.parametrize("async_optimizer", [False, True], ids=["sync", "async"])
def test_gradient_checkpointing_with_dropout_trains_exactly_like_without(async_optimizer):
    """transformers' gradient checkpointing recomputes a block in its backward
    with the random stream its forward drew from: on the workers' copies the
    checkpoint replays the layer's own generator, so the recompute draws the
    forward's dropout masks whatever runs beside it."""
    data = lm_data()
    runs = []
    for checkpointing in (False, True):
        module = _CheckpointedDropoutLM(checkpointing)
        strategy = RoundPipeStrategy(async_optimizer=async_optimizer, num_microbatches=4, seed=1)
        fit(module, data, strategy, devices=2, max_steps=3)
        runs.append(params(module))
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _MasksAtRandom(CausalLM):
    """Gradient checkpointing (no dropout: the default strategy's masks are
    not the pipeline's), two calls with labels=, the second's labels masked
    at random on the loop's thread while the first call's backward
    (recomputing checkpointed blocks) runs on the workers."""

    def __init__(self) -> None:
        super().__init__("llama", lr=1e-2)
        self.model.gradient_checkpointing_enable()

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        first = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        keep = torch.rand(labels.shape) < 0.5
        second = self.model(
            input_ids=ids, attention_mask=mask, labels=labels.masked_fill(~keep, -100)
        )
        return first + second.loss


def test_gradient_checkpointing_leaves_the_loops_random_numbers_alone():
    """(torch.utils.checkpoint kept and put back the process's CPU generator
    on the worker threads: the loop's masks drawn meanwhile were the layer's
    numbers, and its stream was rewound; runs differed from each other and
    from the default strategy)"""
    data = lm_data()
    expected = _MasksAtRandom()
    fit(expected, data, "auto", max_steps=3)
    for _ in range(2):
        module = _MasksAtRandom()
        fit(module, data, _sync_run(), devices=2, max_steps=3)
        for a, b in zip(params(module), params(expected), strict=True):
            torch.testing.assert_close(a, b)


@pytest.mark.gpu
def test_gradient_checkpointing_with_dropout_on_gpu_workers_replays_the_masks():
    """On CUDA workers the checkpoint's recompute starts the device's
    generator where its forward did (under the device's lock), the CPU
    generator untouched: checkpointed training equals the same run without
    checkpointing, with dropout on, and the loop's masks drawn during the
    backward are those of a run without RoundPipe's threads."""
    data = lm_data()
    runs = []
    for checkpointing in (False, True):
        module = _CheckpointedDropoutLM(checkpointing)
        strategy = RoundPipeStrategy(
            async_optimizer=False, num_microbatches=4, seed=1, workers_per_device=2
        )
        L.seed_everything(0)
        trainer = L.Trainer(strategy=strategy, accelerator="cuda", devices=1, max_steps=3, **QUIET)
        trainer.fit(module, loader(data))
        runs.append(params(module))
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b)
    expected = _MasksAtRandom()
    fit(expected, data, "auto", max_steps=3)
    module = _MasksAtRandom()
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(async_optimizer=False, num_microbatches=4, workers_per_device=2),
        accelerator="cuda",
        devices=1,
        max_steps=3,
        **QUIET,
    )
    trainer.fit(module, loader(data), loader(data))
    for a, b in zip(params(module), params(expected), strict=True):
        torch.testing.assert_close(a.cpu(), b, atol=1e-5, rtol=1e-4)


def _sync_run() -> RoundPipeStrategy:
    return RoundPipeStrategy(async_optimizer=False, num_microbatches=4, plan="1,1,1,1|1|1,1,1,1")


class _FailsAtStep(SeqModule):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 3:
            raise RuntimeError("the user's step failed")
        return super().training_step(batch, batch_idx)


def test_an_asynchronous_run_stopped_by_the_users_error_keeps_its_queued_update():
    """An exception from the user's step (or a callback, or an interrupt)
    stops the fit after three steps: the third update, still queued on the
    optimizer thread, goes into the weights first, so the module holds the
    weights of a three-step run, as global_step says."""
    data = seq_data(64)
    straight = SeqModule(extra=False)
    fit(straight, data, RoundPipeStrategy(num_microbatches=2), devices=2, max_steps=3)
    failed = _FailsAtStep(extra=False)
    with pytest.raises(RuntimeError, match="the user's step failed"):
        fit(failed, data, RoundPipeStrategy(num_microbatches=2), devices=2, max_steps=6)
    assert failed.trainer.global_step == 3
    assert_same(params(failed), params(straight))
    assert not [t for t in threading.enumerate() if t.name.startswith("roundpipe")]


def test_the_tuners_lr_find_goes_back_to_where_it_started_under_the_asynchronous_optimizer(
    monkeypatch, tmp_path
):
    """lr_find trains a few steps, then restores the checkpoint it started
    from into the running fit: a new engine starts from the restored
    weights, so the fit that follows equals a fit without lr_find."""
    import tqdm
    from lightning.pytorch.tuner import Tuner

    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # (lr_find's bar: no thread)

    data = seq_data(64)

    def trainer():
        return L.Trainer(
            strategy=RoundPipeStrategy(num_microbatches=2),
            accelerator="cpu",
            devices=2,
            max_steps=4,
            default_root_dir=tmp_path,  # (lr_find's checkpoint)
            **QUIET,
        )

    straight = SeqModule(extra=False)
    L.seed_everything(0)
    trainer().fit(straight, loader(data))
    tuned = SeqModule(extra=False)
    L.seed_everything(0)
    t = trainer()
    finder = Tuner(t).lr_find(
        tuned, train_dataloaders=loader(data), num_training=5, update_attr=False
    )
    assert finder is not None and len(finder.results["lr"]) > 0
    t.fit(tuned, loader(data))
    assert_same(params(tuned), params(straight))

"""Failures at the Lightning level: atomic checkpoints, interrupts, leaks."""

import gc
import signal
import threading
import time
import warnings

import lightning as L
import pytest
import torch

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.runtime import RoundPipeEngine, pinned_bytes

from .modules import SeqModule, loader, seq_data

QUIET = dict(
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
)


def test_crash_while_saving_leaves_the_previous_checkpoint_intact(tmp_path):
    data = seq_data(32)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(async_optimizer=False, num_microbatches=2),
        accelerator="cpu",
        devices=2,
        max_steps=2,
        **QUIET,
    )
    module = SeqModule()
    trainer.fit(module, loader(data))
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    good = path.read_bytes()

    from fsspec.implementations.local import LocalFileOpener

    original = LocalFileOpener.write
    hits = []

    def crash(self, data):  # half the checkpoint reaches the disk, then it is full
        hits.append(len(data))
        original(self, data[: len(data) // 2])
        raise OSError("disk full")

    LocalFileOpener.write = crash
    try:
        with pytest.raises(OSError, match="disk full"):
            trainer.save_checkpoint(path)
    finally:
        LocalFileOpener.write = original
    assert hits  # the write itself failed, half-way
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary left
    assert SeqModule.load_from_checkpoint(path) is not None


class Interrupt(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 2:
            raise KeyboardInterrupt


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_ctrl_c_stops_cleanly_and_no_thread_survives(async_optimizer):
    before = threading.active_count()
    handler = signal.getsignal(signal.SIGINT)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(async_optimizer=async_optimizer, num_microbatches=2),
        accelerator="cpu",
        devices=2,
        max_epochs=3,
        callbacks=[Interrupt()],
        **QUIET,
    )
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful interrupt exits after teardown
            trainer.fit(SeqModule(extra=False), loader(seq_data(64)))
    finally:
        signal.signal(signal.SIGINT, handler)
    assert trainer.interrupted
    assert trainer.strategy.engine is None
    assert threading.active_count() == before


def _twenty_fits(accelerator, devices, workers_per_device=1, cuda_allocated=None):
    cuda = accelerator == "gpu"
    before = threading.active_count()
    pinned = pinned_bytes()
    allocated = cuda_allocated() if cuda else 0
    data = seq_data(16)
    for i in range(20):
        strategy = RoundPipeStrategy(
            async_optimizer=bool(i % 2), num_microbatches=2, workers_per_device=workers_per_device
        )
        trainer = L.Trainer(
            strategy=strategy, accelerator=accelerator, devices=devices, max_steps=2, **QUIET
        )
        trainer.fit(SeqModule(extra=False), loader(data))
        assert threading.active_count() == before, f"fit {i} left threads behind"
        assert pinned_bytes() == pinned, f"fit {i} left page-locked memory registered"
        if cuda:
            assert cuda_allocated() == allocated, f"fit {i} left device memory"
    del trainer, strategy
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, RoundPipeEngine)]


def test_twenty_fits_leak_no_threads_and_no_engines():
    _twenty_fits("cpu", 2)


@pytest.mark.gpu
def test_twenty_fits_on_a_gpu_leak_no_threads_pinned_or_device_memory(cuda_allocated):
    _twenty_fits("gpu", 1, workers_per_device=2, cuda_allocated=cuda_allocated)


def test_a_second_fit_after_a_failure_works():
    class Boom(SeqModule):
        def __init__(self):
            super().__init__(extra=False)

        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise ValueError("bad batch")
            return super().training_step(batch, batch_idx)

    data = seq_data(32)
    t = L.Trainer(
        strategy=RoundPipeStrategy(num_microbatches=2),
        accelerator="cpu",
        devices=2,
        max_steps=4,
        **QUIET,
    )
    with pytest.raises(ValueError, match="bad batch"):
        t.fit(Boom(), loader(data))
    assert t.strategy.engine is None
    module = SeqModule(extra=False)
    t2 = L.Trainer(
        strategy=RoundPipeStrategy(num_microbatches=2),
        accelerator="cpu",
        devices=2,
        max_steps=4,
        **QUIET,
    )
    t2.fit(module, loader(data))
    assert torch.isfinite(t2.callback_metrics["train_loss"])


def test_async_refuses_optimized_parameters_outside_the_pipeline():
    t = L.Trainer(
        strategy=RoundPipeStrategy(num_microbatches=2),
        accelerator="cpu",
        devices=2,
        max_steps=1,
        **QUIET,
    )
    with pytest.raises(
        ValueError,
        match=r"the optimizer updates parameters outside the pipeline "
        r"\(extra.weight, extra.bias\); .*Use strategy='roundpipe_sync'",
    ):
        t.fit(SeqModule(), loader(seq_data(8)))


class Distilled(L.LightningModule):
    """A frozen teacher larger than the student it trains: the largest stack,
    chosen for its size, is not the one the optimizer updates."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        width = 32
        self.teacher = torch.nn.Sequential(
            torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
            torch.nn.Tanh(), torch.nn.Linear(width, 1),
        ).requires_grad_(False)  # fmt: skip
        self.student = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            target = self.teacher(x)
        out = self.student(x)
        loss = torch.nn.functional.mse_loss(out, y) + torch.nn.functional.mse_loss(out, target)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.student.parameters(), lr=1e-2)


def test_a_frozen_stack_chosen_over_the_one_being_trained_is_named():
    """(It was pipelined in silence, the student trained on the host, and the
    asynchronous refusal did not say which layers= fixes it.)"""

    def fit(strategy):
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=2, **QUIET)
        module = Distilled()
        trainer.fit(module, loader(seq_data(16)))
        return trainer

    with pytest.warns(UserWarning) as record:
        trainer = fit(RoundPipeStrategy(async_optimizer=False, num_microbatches=2))
    messages = [str(w.message) for w in record if "largest layer stack" in str(w.message)]
    assert messages == [
        "RoundPipe pipelines 'teacher', the largest layer stack, but the optimizer updates "
        "none of its parameters (it runs forward only); it updates those of 'student', which "
        "trains on the host, outside the pipeline. To pipeline the stack being trained "
        "pass layers='student' to RoundPipeStrategy; to keep this choice, and silence this "
        "warning, pass layers='teacher'"
    ]
    assert trainer.strategy.pipeline_layers[0] is trainer.lightning_module.teacher[0]
    with pytest.raises(ValueError) as err:
        fit(RoundPipeStrategy(num_microbatches=2))
    assert str(err.value) == (
        "the optimizer updates parameters outside the pipeline (student.0.weight, "
        "student.0.bias, student.2.weight, student.2.bias): RoundPipe pipelines 'teacher', the "
        "largest layer stack, whose parameters the optimizer does not update, while it trains "
        "'student'. Pass layers='student' to RoundPipeStrategy to pipeline the stack being "
        "trained (or use strategy='roundpipe_sync' to train it on the host)"
    )
    for async_optimizer in (False, True):
        for layers in ("student", "teacher")[: 2 - async_optimizer]:
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                chosen = fit(
                    RoundPipeStrategy(
                        async_optimizer=async_optimizer, num_microbatches=2, layers=layers
                    )
                )
            stack = getattr(chosen.lightning_module, layers)
            assert chosen.strategy.pipeline_layers[0] is stack[0]
            assert not [w for w in record if "largest layer stack" in str(w.message)]


@pytest.mark.chaos
def test_chaos_delays_devices_plans_and_a_resume_match_an_undisturbed_run(chaos_runs, tmp_path):
    """Random delays at every hand-off, random device counts, plans and optimizer
    mode, a checkpoint and resume in the middle: the final weights equal an
    undisturbed run with the same settings."""
    import random

    from lightning_roundpipe.runtime.optimizer import Chaos

    from .modules import CausalLM, lm_data

    points = {
        "upload": 0.002,
        "grad": 0.002,
        "g_copy": 0.001,
        "p_copy": 0.001,
        "step": 0.002,
        "download": 0.001,
        "forward": 0.001,
        "backward": 0.001,
        "store": 0.001,
        "call": 0.001,
    }
    data = lm_data(32)
    for seed in range(chaos_runs):
        rng = random.Random(seed)
        devices = rng.randint(1, 3)
        plan = rng.choice(["auto", "1,1,1|2|1,1,1", "2,1|2|3", "|5|"])
        asyn = rng.random() < 0.5

        def strategy(chaos=None, asyn=asyn, plan=plan):
            s = RoundPipeStrategy(async_optimizer=asyn, num_microbatches=4, plan=plan)
            s._chaos = chaos
            return s

        calm = CausalLM("qwen3")
        L.seed_everything(seed)
        L.Trainer(
            strategy=strategy(), accelerator="cpu", devices=devices, max_steps=8, **QUIET
        ).fit(calm, loader(data), loader(data))

        first = CausalLM("qwen3")
        L.seed_everything(seed)
        t1 = L.Trainer(
            strategy=strategy(Chaos(seed, points)),
            accelerator="cpu",
            devices=devices,
            max_epochs=1,
            **QUIET,
        )
        # validation makes the epoch end cleanly in the checkpoint (without it Lightning
        # resumes a non-resumable loader mid-epoch and replays a batch)
        t1.fit(first, loader(data), loader(data))
        ckpt = tmp_path / f"chaos-{seed}.ckpt"
        t1.save_checkpoint(ckpt)
        second = CausalLM("qwen3")
        L.seed_everything(seed)
        L.Trainer(
            strategy=strategy(Chaos(seed + 1, points)),
            accelerator="cpu",
            devices=devices,
            max_steps=8,
            **QUIET,
        ).fit(second, loader(data), loader(data), ckpt_path=ckpt)
        for a, b in zip(calm.parameters(), second.parameters(), strict=True):
            torch.testing.assert_close(
                a,
                b,
                atol=1e-6,
                rtol=1e-6,
                msg=lambda m, s=seed, d=devices, p=plan, y=asyn: (
                    f"seed {s}, {d} devices, plan {p}, async {y}: {m}"
                ),
            )


class SlowSGD(torch.optim.SGD):
    """Each step takes a while: the training loop moves on while it runs."""

    def step(self, closure=None):
        time.sleep(0.2)
        return super().step(closure)


class SlowStepModule(SeqModule):
    def __init__(self):
        super().__init__(extra=False)

    def configure_optimizers(self):
        return SlowSGD(self.parameters(), lr=self.hparams.lr)


def test_validation_during_fit_does_not_drop_a_queued_steps_gradients():
    # Lightning calls module.zero_grad() when validation starts; with the
    # asynchronous optimizer a step may still be using the gradients then
    def run(validate):
        module = SlowStepModule()
        L.seed_everything(0)
        trainer = L.Trainer(
            strategy=RoundPipeStrategy(),
            accelerator="cpu",
            devices=1,
            max_steps=3,
            val_check_interval=1,
            limit_val_batches=1 if validate else 0,
            num_sanity_val_steps=0,
            **QUIET,
        )
        trainer.fit(module, loader(seq_data()), loader(seq_data(8, seed=1)))
        return [p.detach().clone() for p in module.parameters()]

    for a, b in zip(run(validate=True), run(validate=False), strict=True):
        torch.testing.assert_close(a, b)

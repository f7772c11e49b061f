"""Failures at the Lightning level: atomic checkpoints, interrupts, leaks."""

import gc
import signal
import threading

import lightning as L
import pytest
import torch

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.runtime import RoundPipeEngine

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

    io = trainer.strategy.checkpoint_io
    original = io.save_checkpoint

    def crash(checkpoint, filepath, storage_options=None):
        with open(filepath, "wb") as fh:
            fh.write(b"half a checkpoint")
        raise OSError("disk full")

    io.save_checkpoint = crash
    try:
        with pytest.raises(OSError, match="disk full"):
            trainer.save_checkpoint(path)
    finally:
        io.save_checkpoint = original
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


def test_twenty_fits_leak_no_threads_and_no_engines():
    before = threading.active_count()
    data = seq_data(16)
    for i in range(20):
        strategy = RoundPipeStrategy(async_optimizer=bool(i % 2), num_microbatches=2)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=2, **QUIET)
        trainer.fit(SeqModule(extra=False), loader(data))
        assert threading.active_count() == before, f"fit {i} left threads behind"
    del trainer, strategy
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, RoundPipeEngine)]


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

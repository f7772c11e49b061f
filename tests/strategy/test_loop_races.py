"""Where the training loop's thread meets the pipeline's threads: validation,
checkpoints, queued calls and autograd on the loop's thread see exactly what
ordinary training would."""

import lightning as L
import pytest
import torch

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.runtime.optimizer import Chaos

from .modules import DropoutSeq, loader, seq_data

QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)


def _fit(module, strategy, devices, *, validate: bool, **kw):
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=4,
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

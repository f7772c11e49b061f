"""Batches smaller than the number of workers or than ``num_microbatches``
run wherever they appear (the last batch of an epoch, an uneven validation
set, ``batch_size=1`` for validate and predict), with the results of the
default strategy."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_roundpipe import RoundPipeStrategy

from .modules import CausalLM, SeqModule, lm_data, seq_data

QUIET = dict(
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
)


def _trainer(strategy, devices=1, **kw):
    L.seed_everything(0)
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, **QUIET, **kw)


@pytest.mark.parametrize("num_microbatches", ["auto", 4])
@pytest.mark.parametrize("devices", [1, 3])
def test_a_last_batch_of_one_sample_trains_like_the_default_strategy(devices, num_microbatches):
    data = seq_data(17)  # batches of 8, 8 and 1
    ref = SeqModule(extra=False)
    _trainer("auto", max_epochs=2).fit(ref, DataLoader(data, batch_size=8))
    mod = SeqModule(extra=False)
    strategy = RoundPipeStrategy(async_optimizer=False, num_microbatches=num_microbatches)
    _trainer(strategy, devices, max_epochs=2).fit(mod, DataLoader(data, batch_size=8))
    for a, b in zip(ref.parameters(), mod.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    # the asynchronous optimizer runs the same batches
    trainer = _trainer(RoundPipeStrategy(num_microbatches=num_microbatches), devices, max_epochs=2)
    trainer.fit(SeqModule(extra=False), DataLoader(data, batch_size=8))
    assert trainer.global_step == 6


class _PredictLM(CausalLM):
    def predict_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0]).logits


@pytest.mark.parametrize("devices", [1, 3])
def test_an_uneven_validation_set_and_batch_size_one_validate_and_predict(devices):
    train, val = lm_data(16), lm_data(7, seed=1)  # validation batches of 4 and 3
    ids = TensorDataset(val.tensors[0])
    results = []
    for name in ("auto", "roundpipe_sync"):
        module = _PredictLM()
        n = 1 if name == "auto" else devices
        trainer = _trainer(name, n, max_steps=2)
        trainer.fit(module, DataLoader(train, batch_size=8), DataLoader(val, batch_size=4))
        fitted = float(trainer.callback_metrics["val_loss"])
        (out,) = _trainer(name, n).validate(module, DataLoader(val, batch_size=1), verbose=False)
        predicted = _trainer(name, n).predict(module, DataLoader(ids, batch_size=1))
        results.append((fitted, out["val_loss"], torch.cat(predicted)))
    (a_fit, a_val, a_pred), (b_fit, b_val, b_pred) = results
    assert b_pred.shape == a_pred.shape == (7, 12, 97)
    torch.testing.assert_close(torch.tensor(b_fit), torch.tensor(a_fit))
    torch.testing.assert_close(torch.tensor(b_val), torch.tensor(a_val))
    torch.testing.assert_close(b_pred, a_pred, atol=1e-5, rtol=1e-4)

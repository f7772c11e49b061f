"""Losses as users write them: the model's loss scaled or combined with other
terms, several model calls per step, batches with no labelled token."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.runtime.optimizer import NonFiniteError

from .modules import CausalLM, lm_data

QUIET = dict(
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
)


class WeightedLM(CausalLM):
    """Multi-task weighting: the model's loss scaled, and a second call on
    shifted labels with its own weight."""

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        main = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        other = self.model(input_ids=ids.flip(1), labels=labels.flip(1)).loss
        loss = 0.5 * main + 0.25 * other
        self.log("loss", loss)
        return loss


def _fit(module, strategy, devices=1, **kw):
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=4, **QUIET, **kw
    )
    trainer.fit(module, DataLoader(lm_data(32), batch_size=8))
    return trainer


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_scaled_and_combined_model_loss_trains_like_the_default_strategy(devices, accumulate):
    ref, got = WeightedLM(), WeightedLM()
    a = _fit(ref, "auto", accumulate_grad_batches=accumulate)
    b = _fit(
        got,
        RoundPipeStrategy(async_optimizer=False, num_microbatches=4),
        devices,
        accumulate_grad_batches=accumulate,
    )
    torch.testing.assert_close(b.callback_metrics["loss"], a.callback_metrics["loss"])
    for x, y in zip(ref.parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


class MonitoredFirstCallLM(CausalLM):
    """A first model call whose loss is only logged (never backpropagated),
    then the call that trains: its gradients are added after the first
    call's turn, which only the step's settling gives up."""

    def __init__(self, logits: bool) -> None:
        super().__init__()
        self.logits = logits

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        watched = self.model(input_ids=ids.flip(1), labels=labels.flip(1)).loss
        self.log("watched", watched.detach())
        if not self.logits:
            return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
        )


@pytest.mark.parametrize("logits", [False, True], ids=["labels", "logits"])
def test_a_call_never_backpropagated_holds_up_no_later_calls_gradients(logits):
    """Gradients are added in call order; a later call's wait for an earlier
    call's factor that never comes (its loss was only logged) counts as
    waiting for that factor, not for a stage, so waiting for the stages
    after the first batch's backward does not hang (it waited for the
    watchdog), and the step drops the first call's gradients as autograd would."""
    ref, got = MonitoredFirstCallLM(logits), MonitoredFirstCallLM(logits)
    _fit(ref, "auto")
    strategy = RoundPipeStrategy(async_optimizer=False, num_microbatches=2, watchdog_timeout=60)
    _fit(got, strategy, 2)
    for x, y in zip(ref.parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


def test_asynchronous_training_with_a_combined_loss_trains():
    module = WeightedLM()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = _fit(module, RoundPipeStrategy(num_microbatches=4), 2)
    assert torch.isfinite(trainer.callback_metrics["loss"])
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


def _unlabelled(n=8):
    ids, mask, labels = lm_data(n).tensors
    return torch.utils.data.TensorDataset(ids, mask, torch.full_like(labels, -100))


def test_a_batch_with_no_labelled_token_has_a_nan_loss_as_in_the_model():
    module = CausalLM()
    ids, mask, labels = _unlabelled().tensors
    with torch.no_grad():
        expected = module.model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert torch.isnan(expected)
    with pytest.raises(NonFiniteError, match="no labelled token"):
        L.Trainer(strategy="roundpipe", accelerator="cpu", devices=2, max_steps=1, **QUIET).fit(
            module, DataLoader(_unlabelled(), batch_size=8)
        )
    trainer = L.Trainer(strategy="roundpipe", accelerator="cpu", devices=2, **QUIET)
    (out,) = trainer.validate(CausalLM(), DataLoader(_unlabelled(), batch_size=8), verbose=False)
    assert out["val_loss"] != out["val_loss"]  # NaN, as the model reports it
    skip = RoundPipeStrategy(nonfinite="skip")
    module = CausalLM()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = L.Trainer(strategy=skip, accelerator="cpu", devices=2, max_steps=1, **QUIET)
    trainer.fit(module, DataLoader(_unlabelled(), batch_size=8))
    for a, b in zip(before, module.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_sequences_of_one_token_are_refused_for_having_no_next_token():
    ids, mask, labels = lm_data(8).tensors
    one = torch.utils.data.TensorDataset(ids[:, :1], mask[:, :1], labels[:, :1])
    with pytest.raises(NonFiniteError, match=r"no labelled token \(sequences of one token have"):
        L.Trainer(strategy="roundpipe", accelerator="cpu", devices=2, max_steps=1, **QUIET).fit(
            CausalLM(), DataLoader(one, batch_size=8)
        )


class SoftPromptLM(CausalLM):
    """A trainable soft prompt outside the model, given as inputs_embeds."""

    def __init__(self, loss_inside: bool = True) -> None:
        super().__init__()
        self.loss_inside = loss_inside
        torch.manual_seed(2)
        self.prompt = torch.nn.Parameter(torch.randn(3, 32) * 0.1)

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        n = ids.shape[0]
        with torch.no_grad():
            tokens = self.model.get_input_embeddings()(ids)
        embeds = torch.cat([self.prompt.expand(n, -1, -1), tokens], 1)
        mask = torch.cat([torch.ones(n, 3, dtype=mask.dtype), mask], 1)
        labels = torch.cat([torch.full((n, 3), -100), labels], 1)
        if self.loss_inside:
            return self.model(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss
        logits = self.model(inputs_embeds=embeds, attention_mask=mask).logits
        target = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 97), target.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("loss_inside", [True, False])
@pytest.mark.parametrize("devices", [1, 3])
def test_a_trainable_soft_prompt_trains_like_the_default_strategy(devices, loss_inside):
    ref, got = SoftPromptLM(loss_inside), SoftPromptLM(loss_inside)
    _fit(ref, "auto")
    _fit(got, RoundPipeStrategy(async_optimizer=False, num_microbatches=4), devices)
    assert not torch.equal(got.prompt, SoftPromptLM().prompt)  # it trained
    for x, y in zip(ref.parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


class EncodedSeq(L.LightningModule):
    """A trainable module outside the pipeline feeds the nn.Sequential."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Linear(8, 8)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16),
            torch.nn.Tanh(),
            torch.nn.Linear(16, 16),
            torch.nn.Tanh(),
            torch.nn.Linear(16, 16),
            torch.nn.Tanh(),
            torch.nn.Linear(16, 16),
            torch.nn.Linear(16, 1),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(self.encoder(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("devices", [1, 3])
def test_gradients_flow_out_of_the_pipeline_into_a_module_before_it(devices):
    from .modules import seq_data

    data = DataLoader(seq_data(32), batch_size=8)
    ref, got = EncodedSeq(), EncodedSeq()
    L.seed_everything(0)
    L.Trainer(strategy="auto", accelerator="cpu", max_steps=3, **QUIET).fit(ref, data)
    L.seed_everything(0)
    strategy = RoundPipeStrategy(async_optimizer=False, num_microbatches=4)
    L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=3, **QUIET).fit(
        got, data
    )
    assert not torch.equal(got.encoder.weight, EncodedSeq().encoder.weight)
    for x, y in zip(ref.parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(x, y)

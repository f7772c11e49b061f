"""What a training step gives the model and gets back is what it would be
under the default strategy: the tuple of ``return_dict=False``, the bf16 batch
of ``precision="bf16-true"``, logits in the dtype the model computes in."""

import lightning as L
import pytest
import torch
from torch import nn

from lightning_roundpipe import RoundPipeStrategy

from .modules import TINY, CausalLM, SeqModule, cpu_trainer, lm_data, loader, seq_data, state


def _fit(module, strategy, *, steps=2, precision="32-true", data=None, val=False):
    trainer = cpu_trainer(
        strategy,
        max_steps=steps,
        precision=precision,
        num_sanity_val_steps=0,
        limit_val_batches=1 if val else 0,
        val_check_interval=1 if val else None,
    )
    data = data if data is not None else lm_data(16)
    trainer.fit(module, loader(data, 4), loader(data, 4) if val else None)


def _sync():
    return RoundPipeStrategy(async_optimizer=False, num_microbatches=2)


#: trained weights after steps of a batch summed in micro-batches versus whole:
#: float32 sums in another order (on an AVX2 CPU up to ~1e-5 off after two
#: steps at lr 0.05, past assert_close's default for float32)
TRAINED = {"atol": 5e-5, "rtol": 1e-4}


class TupleLM(CausalLM):
    """The model called with ``return_dict=False``, with and without labels."""

    def __init__(self) -> None:
        super().__init__(kind="llama", lr=0.05)
        self.kinds, self.val_logits = [], []

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        out = self.model(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
        self.kinds.append(type(out))
        return out[0]

    def validation_step(self, batch, batch_idx):
        ids, mask, _ = batch
        out = self.model(input_ids=ids, attention_mask=mask, return_dict=False)
        self.kinds.append(type(out))
        self.val_logits.append(out[0])


def test_return_dict_false_gives_the_models_tuple():
    got = {}
    for name, strategy in [("auto", "auto"), ("sync", _sync())]:
        module = TupleLM()
        _fit(module, strategy, val=True)
        assert set(module.kinds) == {tuple}, (name, module.kinds)
        got[name] = (module.val_logits, state(module))
    torch.testing.assert_close(got["sync"], got["auto"], **TRAINED)


class GatedSeq(L.LightningModule):
    """A small module outside the layer stack fed the batch: it must see the
    batch in the module's dtype."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 1))
        self.gate = nn.Linear(8, 1)
        self.dtypes = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.dtypes.append((x.dtype, y.dtype))
        return nn.functional.mse_loss(self.net(x) * torch.sigmoid(self.gate(x)), y.float())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_bf16_true_gives_the_step_a_bf16_batch_as_lightning_does():
    seen = {}
    for name, strategy in [("auto", "auto"), ("sync", _sync())]:
        module = GatedSeq()
        _fit(module, strategy, precision="bf16-true", data=seq_data(16))
        seen[name] = module.dtypes
    assert seen["sync"] == seen["auto"] == [(torch.bfloat16, torch.bfloat16)] * 2


class OwnLoss(CausalLM):
    """The loss computed in the step from the logits the model returns."""

    def __init__(self) -> None:
        super().__init__(kind="llama", lr=0.05)
        self.dtypes = []

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        self.dtypes.append(logits.dtype)
        return nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
        )


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_logits_returned_to_the_step_are_in_the_dtype_the_model_returns(precision):
    seen = {}
    for name, strategy in [("auto", "auto"), ("sync", _sync())]:
        module = OwnLoss()
        _fit(module, strategy, precision=precision)
        seen[name] = module.dtypes
    assert seen["sync"] == seen["auto"] == [torch.bfloat16] * 2


class EvalModeLM(CausalLM):
    """The model left in eval() mode, as ``from_pretrained`` returns it: it
    trains, with dropout off, as in plain PyTorch."""

    def __init__(self) -> None:
        super().__init__(kind="llama", lr=0.05)
        self.model.eval()


class EvalModeSeq(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 1))
        self.eval()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("kind", ["hf", "sequential"])
def test_a_model_in_eval_mode_trains_like_the_default_strategy(kind):
    got = {}
    for name, strategy in [("auto", "auto"), ("sync", _sync())]:
        if kind == "hf":
            module, data = EvalModeLM(), None
        else:
            module, data = EvalModeSeq(), seq_data(16)
        before = state(module)
        _fit(module, strategy, data=data)
        got[name] = state(module)
    assert any(not torch.equal(got["sync"][k], before[k]) for k in before)
    torch.testing.assert_close(got["sync"], got["auto"], **TRAINED)


class InputGradient(L.LightningModule):
    """A derivative with respect to the stack's input inside the step
    (saliency, a gradient penalty)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.how = how

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x.clone().requires_grad_(True)
        out = self.net(x)
        if self.how == "backward-inputs":
            out.sum().backward(inputs=[x], retain_graph=True)
        else:
            torch.autograd.grad(
                out.sum(), x, retain_graph=True, create_graph=self.how == "create_graph"
            )
        return nn.functional.mse_loss(out, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("grad", r"torch.autograd.grad \(or backward\(inputs=...\)\) reached the RoundPipe"),
        ("backward-inputs", r"torch.autograd.grad \(or backward\(inputs=...\)\) reached"),
        ("create_graph", r"a backward with create_graph=True .* cannot be differentiated again"),
    ],
)
def test_derivatives_other_than_the_losss_backward_are_refused_before_any_gradient(how, message):
    """They would add the layers' weight gradients to the step (or lose the
    second-order term) without a word; refused before the pipeline's backward."""
    module = InputGradient(how)
    before = state(module)
    with pytest.raises(RuntimeError, match=message):
        _fit(module, _sync(), steps=1, data=seq_data(8))
    torch.testing.assert_close(state(module), before)


class Pairs:
    """A custom batch type: the module's transfer hook turns it into tensors."""

    def __init__(self, items) -> None:
        self.items = items


class TransferHooks(SeqModule):
    """Lightning's batch transfer hooks: a custom batch converted in
    ``transfer_batch_to_device``, the targets changed in
    ``on_after_batch_transfer`` (both run under the default strategy)."""

    def __init__(self) -> None:
        super().__init__(lr=0.05, extra=False)
        self.calls: list[str] = []

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.calls.append("transfer")
        x = torch.stack([a for a, _ in batch.items]).to(device)
        y = torch.stack([b for _, b in batch.items]).to(device)
        return x, y

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.calls.append("after")
        x, y = batch
        return x, 2 * y + 1


def test_batch_transfer_hooks_run_with_the_host_as_the_device():
    data = seq_data(32)

    def batches():
        return torch.utils.data.DataLoader(data, batch_size=8, collate_fn=Pairs)

    got = {}
    for name, strategy in [("auto", "auto"), ("sync", RoundPipeStrategy(async_optimizer=False))]:
        module = TransferHooks()
        cpu_trainer(strategy, max_steps=4, limit_val_batches=1, val_check_interval=2).fit(
            module, batches(), batches()
        )
        got[name] = (state(module), module.calls)
    torch.testing.assert_close(got["sync"][0], got["auto"][0])
    assert got["sync"][1] == got["auto"][1]


class Residual(nn.Sequential):
    """An nn.Sequential whose own forward adds a residual around each child."""

    def forward(self, x):
        for m in self:
            x = x + m(x)
        return x


def test_an_nn_sequential_with_its_own_forward_is_refused():
    module = SeqModule(extra=False)
    module.net = Residual(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"Residual is an nn\.Sequential with its own forward"):
        cpu_trainer(RoundPipeStrategy(async_optimizer=False), max_steps=1).fit(
            module, loader(seq_data(16), 8)
        )


class Duplicate(nn.Module):
    def forward(self, h):
        return h, h


class WritesOne(nn.Module):
    """Writes the first of two entries in place; the second is the same
    tensor, so it changes too (legal: Linear keeps its input, not output)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, pair):
        a, b = pair
        a.mul_(2)
        return self.lin(a) + b


class AliasedEntries(L.LightningModule):
    def __init__(self, shape: str = "same") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 16), Duplicate(), WritesOne(), nn.Tanh(), nn.Linear(16, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(input=x), y)  # (Sequential's own keyword)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("plan", [None, "1,1,1,1|1|1,1,1,1"])
def test_one_tensor_passed_twice_between_layers_stays_one_tensor(plan):
    expected = AliasedEntries()
    cpu_trainer("auto", max_steps=2).fit(expected, loader(seq_data(32), 8))
    got = AliasedEntries()
    strategy = RoundPipeStrategy(async_optimizer=False, num_microbatches=2, plan=plan or "auto")
    cpu_trainer(strategy, max_steps=2).fit(got, loader(seq_data(32), 8))
    torch.testing.assert_close(state(got), state(expected))


class BatchMean(nn.Module):
    def forward(self, h):
        return h.mean(0, keepdim=True)


@pytest.mark.parametrize("last", ["mean over the batch", "sequence first"])
def test_outputs_whose_first_dimension_is_not_the_batch_are_refused(last):
    net = nn.Sequential(nn.Linear(8, 4), BatchMean() if last == "mean over the batch" else Swap01())
    engine_module = _Evaluated(net)
    with pytest.raises(ValueError, match="its first dimension is not the batch"):
        cpu_trainer(RoundPipeStrategy(async_optimizer=False, num_microbatches=2)).predict(
            engine_module, loader(seq_data(16), 8)
        )


class Swap01(nn.Module):
    def forward(self, h):
        return h.unsqueeze(1).expand(-1, 3, -1).transpose(0, 1)


class _Evaluated(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])


def test_sparse_adam_is_refused_naming_the_dense_gradients():
    class SparseEmbedding(AliasedEntries):
        def configure_optimizers(self):
            return torch.optim.SparseAdam(self.parameters(), lr=0.1)

    with pytest.raises(ValueError, match="SparseAdam needs sparse gradients"):
        cpu_trainer(RoundPipeStrategy(async_optimizer=False), max_steps=1).fit(
            SparseEmbedding(), loader(seq_data(16), 8)
        )


class TwoHeads(nn.Module):
    """Class logits, a value, and the integer predictions (no gradient)."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.cls, self.reg, self.as_dict = nn.Linear(16, 3), nn.Linear(16, 1), as_dict

    def forward(self, h):
        logits, value = self.cls(h), self.reg(h)
        if self.as_dict:
            return {"logits": logits, "value": value, "pred": logits.argmax(-1)}
        return logits, value, logits.argmax(-1)


class MultiOutput(L.LightningModule):
    def __init__(self, as_dict: bool, value_only: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.value_only = value_only
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), TwoHeads(as_dict))

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        logits, value, pred = out.values() if isinstance(out, dict) else out
        assert pred.dtype == torch.long
        loss = nn.functional.mse_loss(value, y)
        if not self.value_only:
            loss = loss + nn.functional.cross_entropy(logits, (y[:, 0] > 0).long())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(("as_dict", "value_only"), [(False, False), (True, False), (True, True)])
def test_a_last_layer_with_several_outputs_trains_like_the_default_strategy(as_dict, value_only):
    """A tuple or dict of outputs (it was refused at the first step): each
    floating-point one carries its part of the backward; one the loss does
    not use contributes nothing."""
    ref, mod = MultiOutput(as_dict, value_only), MultiOutput(as_dict, value_only)
    _fit(ref, "auto", steps=3, data=seq_data(16))
    _fit(mod, _sync(), steps=3, data=seq_data(16))
    torch.testing.assert_close(state(mod), state(ref))


class ItemsLM(CausalLM):
    """transformers' Trainer loss arguments: the loss summed over the batch's
    labelled tokens and divided by ``num_items_in_batch`` (here twice the
    real count, as over an accumulation window of two batches), the targets
    passed pre-shifted as ``shift_labels`` (with ``labels=`` as the model
    needs); every other batch has no labelled token at all."""

    def __init__(self, kind: str, form: str) -> None:
        super().__init__(kind=kind, lr=0.05)
        if kind == "mixtral":
            from transformers import MixtralConfig, MixtralForCausalLM

            torch.manual_seed(0)
            config = MixtralConfig(
                **TINY, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2
            )
            config.output_router_logits, config.router_aux_loss_coef = True, 0.5
            self.model = MixtralForCausalLM(config)
        self.form = form
        self.losses, self.val_losses = [], []

    def _loss(self, batch, batch_idx):
        ids, mask, labels = batch
        if batch_idx % 2 and "items" in self.form:  # (without: NaN, as the model's)
            labels = torch.full_like(labels, -100)
        kw = {}
        if "items" in self.form:
            count = (nn.functional.pad(labels, (0, 1), value=-100)[:, 1:] != -100).sum()
            kw["num_items_in_batch"] = 2 * count + 3
        if "shift" in self.form:
            kw["shift_labels"] = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
            labels = torch.zeros_like(labels)  # (read for its presence only)
        return self.model(input_ids=ids, attention_mask=mask, labels=labels, **kw).loss

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch, batch_idx)
        self.losses.append(loss.detach())
        return loss

    def validation_step(self, batch, batch_idx):
        self.val_losses.append(self._loss(batch, batch_idx))

    def configure_optimizers(self):
        # (SGD: AdamW's normalised steps blow float noise in tiny gradients up)
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.parametrize(
    ("kind", "form"), [("llama", "items"), ("llama", "shift"), ("mixtral", "items+shift")]
)
def test_transformers_loss_arguments_train_like_the_default_strategy(kind, form):
    """(They were refused: transformers' Trainer passes them.) The MoE model
    adds its router loss unscaled, as the model does (one micro-batch: with
    more, each adds its own router loss, see the user guide)."""
    got = {}
    sync = RoundPipeStrategy(async_optimizer=False, num_microbatches=1)
    for name, strategy in [("auto", "auto"), ("sync", sync if kind == "mixtral" else _sync())]:
        module = ItemsLM(kind, form)
        _fit(module, strategy, steps=4, val=True)
        got[name] = (module.losses, module.val_losses, state(module))
    losses = torch.stack(got["auto"][0])
    assert losses.isfinite().all()
    assert (losses[1::2] == 0).all() == (form == "items"), losses  # (mixtral: + router loss)
    torch.testing.assert_close(got["sync"], got["auto"], **TRAINED)


def test_transformers_loss_arguments_it_cannot_follow_are_refused():
    module = CausalLM(kind="llama")
    ids, mask, labels = lm_data(4)[:]
    trainer = cpu_trainer(_sync(), max_steps=1, num_sanity_val_steps=0)
    calls = []

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            for kw, error in [
                (
                    {"shift_labels": labels},
                    r"^model: shift_labels with a target at the last position .* set "
                    r"shift_labels\[\.\.\., -1\] to -100, or pass labels= alone$",
                ),
                (
                    {"shift_labels": labels[:, 1:]},
                    r"^model: shift_labels must be a tensor of the labels' shape \(4, 12\), got ",
                ),
                (
                    {"num_items_in_batch": 0},
                    r"^model: num_items_in_batch must be a positive number of labelled tokens, "
                    r"got 0$",
                ),
            ]:
                with pytest.raises((TypeError, ValueError), match=error):
                    pl_module.model(input_ids=ids, attention_mask=mask, labels=labels, **kw)
                calls.append(kw)

    trainer.callbacks.append(Probe())
    trainer.fit(module, loader(lm_data(8), 4))
    assert len(calls) == 3

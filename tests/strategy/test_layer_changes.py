"""Changes to the pipeline's layers outside the pipeline reach the workers'
copies of them, as they would reach the layers under the default strategy:
attributes set in a callback, PEFT's ``disable_adapter()``, hooks registered
during the fit, pruning (which renames weights and adds buffers), batch-norm
statistics reset by replacing their tensors and updated by passes without a
backward."""

import copy
import pickle
import threading

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging
from torch import nn

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.runtime import LayoutChanged, RoundPipeEngine

from .modules import (
    TINY,
    VOCAB,
    CausalLM,
    SeqModule,
    cpu_trainer,
    hf_model,
    lm_data,
    loader,
    seq_data,
    state,
)


class SideBranch(nn.Module):
    """A hook that is a method of the layer adds a side branch (LoRA-like):
    it belongs to the layer and must run on the worker's copy of it."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(16, 16)
        self.extra = nn.Linear(16, 16, bias=False)
        self.base.register_forward_hook(self._add)

    def _add(self, module, inputs, output):
        return output + self.extra(inputs[0])

    def forward(self, x):
        return self.base(x)


class WithSideBranch(SeqModule):
    def __init__(self) -> None:
        super().__init__(lr=0.05, extra=False)
        torch.manual_seed(0)
        branch = SideBranch()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), branch, nn.Tanh(), nn.Linear(16, 1))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_hook_that_is_a_method_of_the_layer_runs_on_the_workers_copy(precision):
    expected = _fit(WithSideBranch(), "auto", precision=precision)
    got = _fit(WithSideBranch(), sync(), precision=precision)  # (bf16: a dtype error before)
    tol = {} if precision == "32-true" else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, expected, **tol)
    _fit(WithSideBranch(), RoundPipeStrategy(num_microbatches=2))  # async: no outside-grad error


class Swap(L.Callback):
    def on_train_epoch_start(self, trainer, module):
        if trainer.current_epoch == 1:
            module.net[1] = nn.ReLU()


def test_a_layer_of_the_stack_replaced_during_the_fit_is_followed():
    expected = _fit(SeqModule(extra=False), "auto", callbacks=[Swap()])
    torch.testing.assert_close(_fit(SeqModule(extra=False), sync(), callbacks=[Swap()]), expected)


class InPlaceScale(L.Callback):
    """Changes a plain tensor attribute in place (not a buffer): invisible to
    the comparison of attributes, so the callback asks for new copies."""

    def on_train_epoch_start(self, trainer, module):
        if trainer.current_epoch == 1:
            module.net[1].scale.mul_(0.5)
            if not isinstance(trainer.strategy, L.pytorch.strategies.SingleDeviceStrategy):
                trainer.strategy.reload_weights()


class ScaledByTensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.ones(16)

    def forward(self, x):
        return x * self.scale


class TensorAttribute(SeqModule):
    def __init__(self) -> None:
        super().__init__(lr=0.1, extra=False)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), ScaledByTensor(), nn.Tanh(), nn.Linear(16, 1))


def test_reload_weights_makes_new_copies_of_layers_changed_in_place():
    expected = _fit(TensorAttribute(), "auto", callbacks=[InPlaceScale()])
    got = _fit(TensorAttribute(), sync(), callbacks=[InPlaceScale()])
    torch.testing.assert_close(got, expected)


def sync(**kw):
    return RoundPipeStrategy(async_optimizer=False, num_microbatches=2, **kw)


class Scaled(nn.Module):
    """Multiplies by a plain float attribute (a temperature annealed by a callback)."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x):
        return x * self.factor


class Annealed(SeqModule):
    def __init__(self) -> None:
        super().__init__(lr=0.1, extra=False)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), Scaled(), nn.Tanh(), nn.Linear(16, 1))


class Anneal(L.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        module.net[1].factor = 1.0 / (1 + trainer.global_step)


def _fit(module, strategy, **kw):
    kw.setdefault("max_epochs", 2)
    cpu_trainer(strategy, **kw).fit(module, loader(seq_data(32), 8))
    return state(module)


def test_a_layer_attribute_set_in_a_callback_reaches_the_workers():
    expected = _fit(Annealed(), "auto", callbacks=[Anneal()])
    torch.testing.assert_close(_fit(Annealed(), sync(), callbacks=[Anneal()]), expected)
    # (and it mattered: without the annealing the run differs)
    plain = _fit(Annealed(), sync())
    assert any(not torch.allclose(a, b) for a, b in zip(plain.values(), expected.values()))


class ReferenceForward(CausalLM):
    """A DPO-style step: the model with its LoRA adapters switched off is the
    reference, in the same step as the trained forward."""

    def __init__(self) -> None:
        super().__init__("llama", lr=1e-2, lora=True)

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        with torch.no_grad(), self.model.disable_adapter():
            reference = self.model(input_ids=ids, attention_mask=mask).logits
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        target = labels[:, 1:].reshape(-1)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), target)
        return loss + nn.functional.mse_loss(logits.float(), reference.float())


def test_peft_disable_adapter_is_followed_within_a_step():
    got = {}
    for name, strategy in [("auto", "auto"), ("sync", sync())]:
        module = ReferenceForward()
        cpu_trainer(strategy, max_steps=4).fit(module, loader(lm_data(32), 8))
        got[name] = state(module)
    torch.testing.assert_close(got["sync"], got["auto"], atol=1e-5, rtol=1e-4)


class ReferenceWithGrad(CausalLM):
    """The reference forward with the adapters switched off but gradients
    enabled (no torch.no_grad()), through labels= or the logits; with
    ``bias="all"`` the biases stay trainable there, so that forward has a
    backward too, which runs after the adapters are switched on again."""

    def __init__(self, labels: bool, bias: str = "none") -> None:
        super().__init__("llama", lr=1e-2)
        from peft import LoraConfig, get_peft_model

        self.model = hf_model("llama", attention_bias=True)
        torch.manual_seed(1)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], bias=bias)
        self.model = get_peft_model(self.model, config)
        with torch.no_grad():  # (LoRA B starts at zero: the adapters matter at once)
            for name, p in self.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        self.labels = labels

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        with self.model.disable_adapter():
            if self.labels:
                reference = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
            else:
                reference = self.model(input_ids=ids, attention_mask=mask).logits.float().mean()
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        return loss + 0.5 * reference

    def configure_optimizers(self):
        # (SGD: a key projection's bias has a gradient that is zero but for
        # rounding, which Adam would amplify)
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


@pytest.mark.parametrize("labels", [True, False], ids=["labels", "logits"])
@pytest.mark.parametrize("bias", ["none", "all"])
def test_a_reference_forward_with_gradients_enabled_trains_like_the_default_strategy(labels, bias):
    """Under disable_adapter() with the base frozen no weight requires a
    gradient: the call runs forward only, as autograd records nothing (with
    labels= it was refused: requires_grad changed after the engine was built).
    With trainable biases it has a backward, which ran with the adapters as
    they were when autograd reached it (on again): the gradients were the
    adapted model's."""
    got = {}
    for name, strategy in [("auto", "auto"), ("sync", sync())]:
        module = ReferenceWithGrad(labels, bias)
        cpu_trainer(strategy, max_steps=3).fit(module, loader(lm_data(24), 8))
        got[name] = state(module)
    torch.testing.assert_close(got["sync"], got["auto"], atol=1e-5, rtol=1e-4)


class EvaluatedThenTrained(SeqModule):
    """The forward runs in eval() (dropout off), the module is back in
    train() when autograd reaches the pipeline's outputs."""

    def __init__(self) -> None:
        super().__init__(lr=0.1, extra=False)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.net.eval()
        out = self.net(x)
        self.net.train()
        return nn.functional.mse_loss(out, y)


def test_a_backward_runs_in_the_mode_its_forward_ran_in():
    """(it took the mode at backward time: dropout in the recomputed forward)"""
    expected = _fit(EvaluatedThenTrained(), "auto")
    torch.testing.assert_close(_fit(EvaluatedThenTrained(), sync()), expected)


def test_unfreezing_a_weight_within_a_step_is_refused_naming_what_to_do():
    class Unfreezes(SeqModule):
        def __init__(self) -> None:
            super().__init__(extra=False)
            self.net[0].weight.requires_grad_(False)

        def training_step(self, batch, batch_idx):
            self.net[0].weight.requires_grad_(True)
            try:
                return super().training_step(batch, batch_idx)
            finally:
                self.net[0].weight.requires_grad_(False)

    with pytest.raises(
        ValueError,
        match=r"net\.0\.weight requires a gradient but did not when the engine was built .*"
        r"Unfreeze weights between steps",
    ):
        _fit(Unfreezes(), sync())


class FrozenCopy(SeqModule):
    """A copy of the model made during the fit (a reference or EMA model):
    its calls run the copy, not the pipeline of the model it was copied from
    (it called the original's pipeline, with the current weights)."""

    def __init__(self) -> None:
        super().__init__(lr=0.1, extra=False)
        self.copies: list[nn.Module] = []  # (a list: not a submodule)

    def on_fit_start(self) -> None:
        self.copies = [copy.deepcopy(self.net)]

    def training_step(self, batch, batch_idx):
        x, y = batch
        (reference,) = self.copies
        with torch.no_grad():
            target = reference(x)
        # pickled during the fit (torch.save of the model in a callback)
        loaded = pickle.loads(pickle.dumps(self.net))
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), nn.Sequential.forward(loaded, x))
        out = self.net(x)
        return nn.functional.mse_loss(out, y) + 0.5 * nn.functional.mse_loss(out, target)


def test_a_copy_of_the_model_made_during_the_fit_runs_itself():
    expected = _fit(FrozenCopy(), "auto")
    module = FrozenCopy()
    torch.testing.assert_close(_fit(module, sync()), expected)
    x = seq_data(4).tensors[0]
    (reference,) = module.copies
    with torch.no_grad():  # (after the fit too)
        torch.testing.assert_close(reference(x), nn.Sequential.forward(reference, x))


class AnnealedNumbers(CausalLM):
    """A model-level number the model reads at every forward, changed by the
    module from the second step: a router loss coefficient, Cohere's logit
    scale, Gemma 2's soft-capping (a config field)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        import transformers

        small = {**TINY, "num_hidden_layers": 2, "head_dim": 8}
        torch.manual_seed(0)
        if kind == "qwen3_moe":
            config = transformers.Qwen3MoeConfig(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                output_router_logits=True,
                router_aux_loss_coef=0.001,
                **small,
            )
            self.model = transformers.Qwen3MoeForCausalLM(config)
        elif kind == "cohere":
            self.model = transformers.CohereForCausalLM(
                transformers.CohereConfig(logit_scale=0.5, **small)
            )
        else:
            config = transformers.Gemma2Config(final_logit_softcapping=30.0, **small)
            self.model = transformers.Gemma2ForCausalLM(config)
        self.kind = kind

    def on_train_batch_start(self, batch, batch_idx):
        late = self.global_step >= 1
        if self.kind == "qwen3_moe":
            self.model.router_aux_loss_coef = 5.0 if late else 0.001
        elif self.kind == "cohere":
            self.model.logit_scale = 2.0 if late else 0.5
        else:
            self.model.config.final_logit_softcapping = 0.5 if late else 30.0


@pytest.mark.parametrize("kind", ["qwen3_moe", "cohere", "gemma2"])
def test_model_numbers_changed_during_the_fit_are_read_at_every_call(kind):
    # (the router loss is per micro-batch: one, to compare it with the default)
    count = 1 if kind == "qwen3_moe" else 2
    pipelined = RoundPipeStrategy(async_optimizer=False, num_microbatches=count)
    got = {}
    for name, strategy in [("auto", "auto"), ("sync", pipelined)]:
        module = AnnealedNumbers(kind)
        cpu_trainer(strategy, max_steps=3).fit(module, loader(lm_data(24), 8))
        got[name] = state(module)
    torch.testing.assert_close(got["sync"], got["auto"], atol=1e-5, rtol=1e-4)


class CountingHook(L.Callback):
    """Registers a forward hook, a method of this callback, when the second
    epoch starts: it must run on this object, not on a copy."""

    def __init__(self) -> None:
        self.calls = 0

    def hook(self, module, inputs, output):
        self.calls += 1

    def on_train_epoch_start(self, trainer, module):
        if trainer.current_epoch == 1:
            module.net[2].register_forward_hook(self.hook)


def test_hooks_registered_during_the_fit_run_on_the_users_objects():
    counting = CountingHook()
    _fit(SeqModule(extra=False), sync(), callbacks=[counting])
    # per micro-batch, and again when a stage is computed again for its backward
    assert counting.calls >= 4


def _pruning():
    # global L1 pruning reads each layer's masked weight (an attribute its
    # pre-hook computes on every call), then renames the weight and adds a mask
    return ModelPruning("l1_unstructured", amount=0.4, use_lottery_ticket_hypothesis=False)


def test_model_pruning_trains_like_the_default_strategy():
    expected = _fit(SeqModule(extra=False), "auto", max_epochs=3, callbacks=[_pruning()])
    got = _fit(SeqModule(extra=False), sync(), max_epochs=3, callbacks=[_pruning()])
    assert set(got) == set(expected)  # (weight_orig, weight_mask: the pruning was kept)
    torch.testing.assert_close(got, expected)


def test_the_engine_refuses_a_layer_whose_parameters_changed():
    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)]
    with RoundPipeEngine(layers, ["cpu"], num_microbatches=2) as engine:
        torch.nn.utils.prune.l1_unstructured(layers[0], "weight", amount=0.5)
        change = "layer 0: added weight_orig, weight_mask; removed weight"
        assert engine.layout_changed() == [change]
        with pytest.raises(
            LayoutChanged,
            match=r"parameters or buffers of pipeline layer 0 \(Linear\) changed after the engine "
            r"was built \(added weight_orig, weight_mask; removed weight\); close it and build",
        ):
            engine.forward(torch.randn(4, 4))


class BatchNormSeq(SeqModule):
    def __init__(self) -> None:
        super().__init__(lr=0.05, extra=False)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


class ResetStatistics(L.Callback):
    """New tensors for the statistics and a cumulative average (SWA's reset)."""

    def on_train_epoch_start(self, trainer, module):
        if trainer.current_epoch == 1:
            bn = module.net[1]
            bn.running_mean = torch.zeros_like(bn.running_mean)
            bn.running_var = torch.ones_like(bn.running_var)
            bn.num_batches_tracked = torch.zeros_like(bn.num_batches_tracked)
            bn.momentum = None


class UpdateStatistics(L.Callback):
    """``update_bn`` when training ends: passes in training mode without a backward."""

    def on_train_end(self, trainer, module):
        torch.optim.swa_utils.update_bn(loader(seq_data(32, seed=1), 8), module.net)


@pytest.mark.parametrize(
    "callbacks",
    [
        lambda: [ResetStatistics()],
        lambda: [UpdateStatistics()],
        lambda: [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)],
    ],
    ids=["replaced-statistics", "update_bn", "swa"],
)
def test_batch_norm_statistics_follow_replacements_and_passes_without_backward(callbacks):
    # (one micro-batch: whole-batch statistics, equal to the default strategy)
    one = RoundPipeStrategy(async_optimizer=False, num_microbatches=1)
    expected = _fit(BatchNormSeq(), "auto", callbacks=callbacks())
    got = _fit(BatchNormSeq(), one, callbacks=callbacks())
    if isinstance(callbacks()[0], StochasticWeightAveraging):
        # the statistics of the averaged weights; the weights themselves differ:
        # after SWA's batch-norm epoch (no backward, no zero_grad) the default
        # strategy steps once more with the last training step's gradients,
        # which RoundPipe released after that step
        expected = {k: v for k, v in expected.items() if k.startswith("net.1.running")}
        got = {k: got[k] for k in expected}
    torch.testing.assert_close(got, expected)


class Counting(nn.Module):
    """Counts its forward passes on the module that owns it (a plain
    back-reference, not a submodule)."""

    def __init__(self, owner: nn.Module) -> None:
        super().__init__()
        self.__dict__["owner"] = owner

    def forward(self, x):
        with self.owner.lock:
            self.owner.passes += 1
        return x


class WithBackReference(SeqModule):
    def __init__(self) -> None:
        super().__init__(extra=False)
        self.passes = 0
        # (cannot be deep-copied: the module is shared, never copied, not
        # even once to find the reference)
        self.lock = threading.Lock()
        layers = list(self.net)
        self.net = nn.Sequential(*layers[:2], Counting(self), *layers[2:])


def test_a_module_outside_the_layer_that_it_refers_to_is_shared_not_copied():
    """Copying the back-reference would copy the LightningModule (every
    other layer, the Trainer) into each layer copy, and the count would go
    to the copies."""
    module = WithBackReference()
    trainer = cpu_trainer(sync(), max_steps=2)
    trainer.fit(module, loader(seq_data(32), 8))
    assert module.passes > 0
    expected = _fit(WithBackReference(), "auto", max_steps=2)
    torch.testing.assert_close(state(module), expected)


class Locked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def forward(self, x):
        with self.lock:
            return x


def test_a_layer_that_cannot_be_copied_is_refused_naming_it():
    module = SeqModule(extra=False)
    layers = list(module.net)
    module.net = nn.Sequential(*layers[:3], Locked(), *layers[3:])
    with pytest.raises(TypeError, match=r"pipeline layer 3 \(Locked\) cannot be copied") as err:
        cpu_trainer(sync(), max_steps=1).fit(module, loader(seq_data(16), 8))
    assert "keep objects that cannot be deep-copied" in str(err.value)


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.tanh(self.inner(x))


class ThroughAList(nn.Module):
    """Calls its own linear through a helper kept in a plain list (out of
    ``modules()``, as PEFT does): the helper is the layer's state, copied
    with it, so the copy computes with the worker's weights."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.view = [Wrapper(self.lin)]

    def forward(self, x):
        return self.view[0](x)


class WithHelperInAList(SeqModule):
    def __init__(self) -> None:
        super().__init__(extra=False)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), ThroughAList(), nn.Linear(16, 1))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_helper_wrapping_the_layers_own_module_is_copied_with_it(asynchronous):
    expected = _fit(WithHelperInAList(), "auto", max_steps=4)
    strategy = RoundPipeStrategy(async_optimizer=asynchronous, num_microbatches=2)
    got = _fit(WithHelperInAList(), strategy, max_steps=4)
    if not asynchronous:
        torch.testing.assert_close(got, expected)

"""Settings RoundPipe cannot honour are refused when the fit starts, naming
what to change, before any weight changes: never ignored, never found out
after the whole fit."""

import lightning as L
import pytest
import torch

from lightning_roundpipe import RoundPipeStrategy

from .modules import CausalLM, SeqModule, cpu_trainer, lm_data, loader, seq_data, state


def _fit(module, strategy):
    cpu_trainer(strategy, max_steps=2).fit(module, loader(seq_data(16), 8))


@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_gradient_hooks_on_pipeline_parameters_are_refused(kind):
    module = SeqModule(extra=False)
    getattr(module.net[2].weight, kind)(lambda *args: None)
    before = state(module)
    with pytest.raises(ValueError, match=r"gradient hooks .* net\.2\.weight: .*would never run"):
        _fit(module, RoundPipeStrategy(async_optimizer=False))
    torch.testing.assert_close(state(module), before)


class HookedAtTrainStart(SeqModule):
    def __init__(self) -> None:
        super().__init__(extra=False)

    def on_train_start(self) -> None:  # after the strategy's setup
        self.net[2].weight.register_hook(lambda grad: grad)


def test_gradient_hooks_registered_when_training_starts_are_refused_at_the_first_step():
    module = HookedAtTrainStart()
    before = state(module)
    with pytest.raises(ValueError, match=r"gradient hooks .* net\.2\.weight: .*would never run"):
        _fit(module, RoundPipeStrategy(async_optimizer=False))
    torch.testing.assert_close(state(module), before)


def test_an_unwritable_trace_dir_is_refused_before_training(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    module = SeqModule(extra=False)
    before = state(module)
    with pytest.raises(ValueError, match=r"trace_dir=.* cannot be created .* writable folder"):
        _fit(module, RoundPipeStrategy(trace_dir=blocked / "trace"))
    torch.testing.assert_close(state(module), before)


def test_a_model_with_nothing_trainable_is_refused():
    module = SeqModule(extra=False)
    module.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter of the LightningModule requires a gradient"):
        _fit(module, RoundPipeStrategy())


def test_lightnings_module_labelling_profiler_is_refused_naming_the_switch():
    """PyTorchProfiler's default labels every module with forward hooks
    (``RegisterRecordFunction``, entered here without starting a profiler),
    which the pipeline does not run."""
    from lightning.pytorch.profilers.pytorch import RegisterRecordFunction

    from .modules import CausalLM, lm_data

    module = CausalLM()
    trainer = cpu_trainer(RoundPipeStrategy(async_optimizer=False), max_steps=1)
    with (
        RegisterRecordFunction(module),
        pytest.raises(ValueError, match=r"PyTorchProfiler\(record_module_names=False\)"),
    ):
        trainer.fit(module, loader(lm_data(16), 8))


def test_sync_batchnorm_is_refused_naming_the_setting():
    trainer = cpu_trainer(
        RoundPipeStrategy(async_optimizer=False), max_steps=1, sync_batchnorm=True
    )
    with pytest.raises(ValueError, match=r"sync_batchnorm=True\) is not supported by RoundPipe"):
        trainer.fit(SeqModule(extra=False), loader(seq_data(16), 8))


def test_a_compiled_layer_is_warned_about():
    module = SeqModule(extra=False)
    module.net[2].compile(backend="eager")
    trainer = cpu_trainer(RoundPipeStrategy(async_optimizer=False), max_steps=1)
    with pytest.warns(UserWarning, match=r"compiled with Module.compile\(\) \(Linear\)"):
        trainer.fit(module, loader(seq_data(16), 8))


def test_an_on_after_backward_override_is_warned_about():
    """(.grad of the pipeline's weights is None there, in both modes: a
    gradient-logging hook read nothing, silently)"""

    class Logs(SeqModule):
        def on_after_backward(self):
            self.seen = [p.grad for p in self.net.parameters()]

    trainer = cpu_trainer(RoundPipeStrategy(async_optimizer=False), max_steps=1)
    with pytest.warns(UserWarning, match=r"Logs\.on_after_backward is overridden\. Under Round"):
        trainer.fit(Logs(extra=False), loader(seq_data(16), 8))


def test_a_compiled_model_holding_the_layers_is_warned_about():
    """torch.compile of the model traced the pipeline's dispatch (graph breaks
    at every hand-off, recompiling: the first steps seconds each), silently."""
    from lightning_roundpipe.strategy import _compiled

    module = SeqModule(extra=False)
    layers = list(module.net)
    module.net = torch.compile(module.net, backend="eager")  # (lazy: nothing compiles here)
    with pytest.warns(UserWarning, match=r"RoundPipe: net was compiled with torch\.compile and "):
        _compiled(layers, module)


def test_a_stack_compiled_in_place_runs_uncompiled_during_the_fit_and_compiled_after():
    """Module.compile() on the nn.Sequential (or a Hugging Face model) traced
    the pipeline's dispatch: the steps 40-100x slower, silently. It runs
    uncompiled during the fit (its layers run uncompiled on the workers
    anyway), warned, and is compiled again after it."""

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.during = module.net._compiled_call_impl

    expected = SeqModule(extra=False)
    cpu_trainer(RoundPipeStrategy(async_optimizer=False), max_steps=2).fit(
        expected, loader(seq_data(16), 8)
    )
    module = SeqModule(extra=False)
    module.net.compile(backend="eager")
    compiled = module.net._compiled_call_impl
    watch = Watch()
    trainer = cpu_trainer(RoundPipeStrategy(async_optimizer=False), max_steps=2, callbacks=[watch])
    with pytest.warns(UserWarning, match=r"net was compiled with Module\.compile\(\) and holds"):
        trainer.fit(module, loader(seq_data(16), 8))
    assert watch.during is None and module.net._compiled_call_impl is compiled
    torch.testing.assert_close(state(module), state(expected))


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_peft_prefix_tuning_is_refused_in_both_modes(async_optimizer):
    """(async refused its prompt parameters saying "use roundpipe_sync",
    which then refused the key-value cache at the first step)"""
    peft = pytest.importorskip("peft")
    module = CausalLM("llama")
    config = peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    module.model = peft.get_peft_model(module.model, config)
    before = state(module)
    with pytest.raises(
        TypeError, match=r"model uses PEFT prefix tuning.*prompt tuning or P-tuning"
    ):
        cpu_trainer(RoundPipeStrategy(async_optimizer=async_optimizer), max_steps=1).fit(
            module, loader(lm_data(8), 4)
        )
    torch.testing.assert_close(state(module), before)


def test_lazy_modules_are_refused_saying_to_run_a_forward_first():
    module = SeqModule(extra=False)
    module.net[0] = torch.nn.LazyLinear(16)
    with pytest.raises(ValueError, match=r"net\.0\.weight is an uninitialized parameter of a lazy"):
        _fit(module, RoundPipeStrategy(async_optimizer=False))
    module.net(torch.zeros(2, 8))  # materialized: trains
    _fit(module, RoundPipeStrategy(async_optimizer=False))


class Embedded(SeqModule):
    def __init__(self) -> None:
        super().__init__(extra=False)
        self.net = torch.nn.Sequential(
            torch.nn.Embedding(10, 16, max_norm=0.5), torch.nn.Flatten(), torch.nn.Linear(128, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        ids = (x.abs() * 3).long().clamp(max=9)
        return torch.nn.functional.mse_loss(self.net(ids), y)


def test_an_embedding_that_renormalizes_its_weight_in_the_forward_is_refused():
    """Its rows were renormalized on the workers' copies only: lost, silently."""
    module = Embedded()
    before = state(module)
    with pytest.raises(ValueError, match=r"net\.0 is an nn\.Embedding with max_norm=0\.5, which"):
        _fit(module, RoundPipeStrategy(async_optimizer=False))
    torch.testing.assert_close(state(module), before)

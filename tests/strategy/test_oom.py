"""Running out of device memory in the first batch: the strategy re-plans with
smaller stages or more micro-batches and runs the batch again (CPU workers with
an injected out-of-memory error)."""

import lightning as L
import pytest
import torch

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.runtime import worker as worker_mod
from lightning_roundpipe.runtime.nested import batch_size_of

from .modules import CausalLM, lm_data, loader

QUIET = dict(
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
)


@pytest.fixture
def oom_when(monkeypatch):
    """Make a stage raise torch.OutOfMemoryError when ``pred(layers, micro-batch
    size, iteration)`` holds; returns the list of failures injected."""
    hits = []

    def install(pred):
        original = worker_mod.Worker._layers

        def layers(self, task, j, replicas, x, *args, **kwargs):
            size = batch_size_of(x)
            if pred(len(replicas), size, task.call.iteration):
                hits.append((len(replicas), size, task.call.iteration))
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return original(self, task, j, replicas, x, *args, **kwargs)

        monkeypatch.setattr(worker_mod.Worker, "_layers", layers)
        return hits

    return install


def fit(module, strategy, devices=1, steps=4, **kw):
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, **QUIET, **kw
    )
    trainer.fit(module, loader(lm_data()))
    return trainer


def weights(module):
    return [p.detach().clone() for p in module.parameters()]


def test_stages_too_big_are_cut_smaller_and_the_batch_runs_again(oom_when):
    ref = CausalLM()
    fit(ref, "auto", accumulate_grad_batches=2)
    hits = oom_when(lambda layers, size, it: layers > 2)
    mod = CausalLM()
    strategy = RoundPipeStrategy(async_optimizer=False)
    with pytest.warns(
        UserWarning,
        match=r"ran out of memory in stage .* re-planned with "
        r"device_memory_limit=\d+",
    ):
        fit(mod, strategy, accumulate_grad_batches=2)
    assert hits, "the injected failure never fired"
    assert all(st.stop - st.start <= 2 for st in strategy.stage_plan.stages)
    for a, b in zip(weights(mod), weights(ref), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_async_run_after_replanning_equals_a_run_that_fitted(oom_when):
    # micro-batches of more than 4 samples "do not fit": after cutting the stages
    # down to single layers the strategy doubles the micro-batches (batch 8: 1 -> 2)
    ref = CausalLM()
    fit(ref, RoundPipeStrategy(num_microbatches=2))
    hits = oom_when(lambda layers, size, it: size is not None and size > 4)
    mod = CausalLM()
    strategy = RoundPipeStrategy(oom_replans=8)
    with pytest.warns(UserWarning, match=r"re-planned with num_microbatches=2"):
        fit(mod, strategy)
    assert hits and strategy.microbatches == 2
    for a, b in zip(weights(mod), weights(ref), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "options",
    [
        dict(plan="2,2|1|1,1,2", num_microbatches=1),  # the user's plan and count are kept
        dict(oom_replans=0),
    ],
)
def test_no_replanning_when_the_options_forbid_it(oom_when, options):
    oom_when(lambda layers, size, it: size is not None and size > 4)
    with pytest.raises(
        worker_mod.WorkerError,
        match=r"OutOfMemoryError: CUDA out of memory \(injected\)\. Stage .* needs about .* "
        r"Raise num_microbatches .* lower device_memory_limit",
    ):
        fit(CausalLM(), RoundPipeStrategy(async_optimizer=False, **options))


def test_out_of_memory_after_the_first_batch_is_reported_not_retried(oom_when):
    oom_when(lambda layers, size, it: it == 2)
    with pytest.raises(worker_mod.WorkerError, match=r"iteration 2: OutOfMemoryError"):
        fit(CausalLM(), RoundPipeStrategy(async_optimizer=False))


def test_oom_replans_must_be_a_count():
    with pytest.raises(ValueError, match="oom_replans must be an integer >= 0"):
        RoundPipeStrategy(oom_replans=-1)

"""Running out of device memory in the first batch: the strategy re-plans with
smaller stages or more micro-batches and runs the batch again (CPU workers with
an injected out-of-memory error)."""

import lightning as L
import pytest
import torch

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.runtime import WorkerError
from lightning_roundpipe.runtime import worker as worker_mod
from lightning_roundpipe.runtime.nested import batch_size_of

from .modules import CausalLM, SeqModule, lm_data, loader, seq_data

QUIET = dict(
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
)


@pytest.fixture
def oom_when(monkeypatch):
    """Make a stage raise torch.OutOfMemoryError (or ``error()``) when
    ``pred(layers, micro-batch size, iteration, stage)`` holds; returns the
    list of failures injected."""
    hits = []

    def install(pred, error=lambda: torch.OutOfMemoryError("CUDA out of memory (injected)")):
        original = worker_mod.Worker._layers

        def layers(self, job, j, replicas, x, *args, **kwargs):
            size = batch_size_of(x)
            if pred(len(replicas), size, job.call.iteration, job.task):
                hits.append((len(replicas), size, job.call.iteration, job.task))
                raise error()
            return original(self, job, j, replicas, x, *args, **kwargs)

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
    hits = oom_when(lambda layers, size, it, *_: layers > 2)
    mod = CausalLM()
    strategy = RoundPipeStrategy(async_optimizer=False)
    with pytest.warns(
        UserWarning,
        match=r"ran out of memory in stage .* re-planned with "
        r"stages of at most \d+ bytes of weights and gradients",
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
    hits = oom_when(lambda layers, size, it, *_: size is not None and size > 4)
    mod = CausalLM()
    strategy = RoundPipeStrategy(oom_replans=8)
    with pytest.warns(UserWarning, match=r"re-planned with num_microbatches=2"):
        fit(mod, strategy)
    assert hits and strategy.microbatches == 2
    for a, b in zip(weights(mod), weights(ref), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_library_allocation_failure_is_replanned_like_out_of_memory(oom_when):
    # cuBLAS and cuDNN report their own failed allocations as a RuntimeError
    message = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    hits = oom_when(
        lambda layers, size, it, *_: size is not None and size > 4, lambda: RuntimeError(message)
    )
    strategy = RoundPipeStrategy(oom_replans=8)
    with pytest.warns(UserWarning, match=r"re-planned with num_microbatches=2"):
        fit(CausalLM(), strategy)
    assert hits and strategy.microbatches == 2


def test_what_counts_as_out_of_memory():
    from lightning_roundpipe.runtime.device import is_out_of_memory

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling"))
    assert is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))  # not from a library
    assert not is_out_of_memory(None)


@pytest.mark.parametrize(
    "options",
    [
        dict(plan="2,2|1|1,1,2", num_microbatches=1),  # the user's plan and count are kept
        dict(oom_replans=0),
    ],
)
def test_no_replanning_when_the_options_forbid_it(oom_when, options):
    oom_when(lambda layers, size, it, *_: size is not None and size > 4)
    with pytest.raises(
        worker_mod.WorkerError,
        match=r"OutOfMemoryError: CUDA out of memory \(injected\)\. Stage .* needs about .* "
        r"Raise num_microbatches .* lower device_memory_limit",
    ):
        fit(CausalLM(), RoundPipeStrategy(async_optimizer=False, **options))


def test_out_of_memory_after_the_first_batch_is_reported_not_retried(oom_when):
    oom_when(lambda layers, size, it, *_: it == 2)
    with pytest.raises(worker_mod.WorkerError, match=r"iteration 2: OutOfMemoryError"):
        fit(CausalLM(), RoundPipeStrategy(async_optimizer=False))


def test_oom_replans_must_be_a_count():
    with pytest.raises(ValueError, match="oom_replans must be an integer >= 0"):
        RoundPipeStrategy(oom_replans=-1)


class EpochLoss(CausalLM):
    """Logs its loss per step and as an epoch mean, as a tensor and through a
    torchmetrics metric."""

    def __init__(self):
        super().__init__()
        import torchmetrics

        self.mean_loss = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.mean_loss.update(loss.detach())
        self.log("metric_loss", self.mean_loss, on_step=False, on_epoch=True)
        return loss


@pytest.mark.parametrize("async_mode", [False, True])
def test_out_of_memory_in_a_backward_stage_is_retried_or_reported(oom_when, async_mode):
    # the backward stages run after training_step returned: the failure must be
    # caught before Lightning's zero_grad, and what the step logged is logged once
    ref = EpochLoss()
    # a limit that gives a two-layer backward stage in the asynchronous plan
    # (2,1,1|1|1,1,2): it is cut. The synchronous plan's backward stages have
    # one layer each and its micro-batches one sample each: no smaller plan
    # exists, so the failure is reported after one attempt. Never tiled, the
    # activations are predicted not to fit any plan, so the plan is kept until
    # the (injected) failure (tiled, one-layer stages are predicted to fit and
    # chosen before the first step)
    opts = dict(async_optimizer=async_mode, device_memory_limit=136512, tile_memory=None)
    if not async_mode:
        hits = oom_when(lambda layers, size, it, stage: stage.kind == "backward" and not hits)
        with pytest.raises(WorkerError, match=r"failed in stage B\d+ .*OutOfMemoryError"):
            fit(EpochLoss(), RoundPipeStrategy(**opts), devices=2)
        assert len(hits) == 1 and hits[0][0] == 1 and hits[0][1] == 1
        return
    ref_trainer = fit(ref, RoundPipeStrategy(**opts), devices=2)
    hits = oom_when(lambda layers, size, it, stage: stage.kind == "backward" and layers > 1)
    mod = EpochLoss()
    strategy = RoundPipeStrategy(**opts)
    with pytest.warns(UserWarning, match=r"ran out of memory in stage B"):
        trainer = fit(mod, strategy, devices=2)
    assert hits
    assert all(
        st.stop - st.start == 1 for st in strategy.stage_plan.stages if st.kind == "backward"
    )
    for a, b in zip(weights(mod), weights(ref), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # the failed attempt's logged loss is not counted in the epoch mean
    for key in ("train_loss_epoch", "metric_loss"):
        torch.testing.assert_close(trainer.callback_metrics[key], ref_trainer.callback_metrics[key])


def test_gradients_outside_the_pipeline_are_not_counted_twice(oom_when):
    # SeqModule's extra parameter gets its gradient from autograd on the main
    # thread before the pipeline's backward fails; the re-run must start afresh
    def run(module, inject):
        if inject:
            # once, in the pipeline's backward (the fused stage of plan |5|)
            hits = oom_when(lambda layers, size, it, stage: stage.kind != "forward" and not hits)
        L.seed_everything(0)
        trainer = L.Trainer(
            strategy=RoundPipeStrategy(async_optimizer=False),
            accelerator="cpu",
            devices=1,
            max_steps=3,
            **QUIET,
        )
        trainer.fit(module, loader(seq_data()))
        return hits if inject else None

    ref, mod = SeqModule(), SeqModule()
    run(ref, inject=False)
    with pytest.warns(UserWarning, match="re-planned"):
        assert run(mod, inject=True)
    for a, b in zip(weights(mod), weights(ref), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_no_replan_below_the_largest_layer(oom_when):
    # the failing stage holds small layers only: halving it would go below the
    # big layer elsewhere, which must still fit alone, so the original
    # out-of-memory error is reported (not a planning error from a new engine)
    class Wide(SeqModule):
        def __init__(self):
            super().__init__(extra=False)
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                *[torch.nn.Linear(8, 8) for _ in range(4)],
                torch.nn.Linear(8, 512),
                torch.nn.Linear(512, 1),
            )

    oom_when(lambda layers, size, it, stage: stage.start == 0 and layers > 1)
    strategy = RoundPipeStrategy(async_optimizer=False, num_microbatches=2)
    with pytest.raises(worker_mod.WorkerError, match=r"OutOfMemoryError"):
        L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, **QUIET).fit(
            Wide(), loader(seq_data())
        )
    assert strategy.engine is None  # closed by Lightning's exception handling


class _TunedSeq(SeqModule):
    """A batch_size the Tuner scales, over 256 samples."""

    def __init__(self) -> None:
        super().__init__(lr=1e-2, extra=False)
        self.batch_size = 2

    def train_dataloader(self):
        return loader(seq_data(256), self.batch_size)

    def val_dataloader(self):
        return loader(seq_data(64), self.batch_size)


@pytest.mark.parametrize("method", ["fit", "validate"])
@pytest.mark.parametrize("strategy", ["auto", "sync", "async"])
def test_the_batch_size_finder_goes_on_after_out_of_memory_like_the_default_strategy(
    oom_when, strategy, method, tmp_path
):
    """The Tuner catches a trial's out-of-memory error and tries a smaller
    batch: the failed engine is replaced (every call through it used to
    raise the old error again: a wrong batch size, or a crash)."""
    from lightning.pytorch.tuner import Tuner

    if strategy == "auto":
        # (the same failure, where a plain run raises it: the first layer's input)
        def forward(module, args):
            if args[0].shape[0] >= 16:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")

        chosen = "auto"
    else:
        oom_when(lambda layers, size, *_: size >= 16)
        chosen = RoundPipeStrategy(
            async_optimizer=strategy == "async", num_microbatches=1, oom_replans=0
        )
    module = _TunedSeq()
    if strategy == "auto":
        module.net[0].register_forward_pre_hook(forward)
    devices = 1 if strategy == "auto" else 2
    trainer = L.Trainer(
        strategy=chosen,
        accelerator="cpu",
        devices=devices,
        max_epochs=1,
        default_root_dir=tmp_path,
        **QUIET,
    )
    found = Tuner(trainer).scale_batch_size(
        module, mode="binsearch", method=method, steps_per_trial=2, max_trials=6
    )
    assert found == 14
    if method == "fit":
        trainer.fit(module)  # (and goes on training with it)
        assert trainer.global_step == 256 // 14 + 1


def test_the_learning_rate_finder_after_a_replan_and_after_an_error(
    oom_when, monkeypatch, tmp_path
):
    """Asynchronous: a first-batch re-plan during the search (the new engine
    put its callback first in the Tuner's list, where the search reads its
    results), and a user error during it (undoing the strategy's callback
    failed in the swapped list, leaving threads and the patched module)."""
    import threading

    import tqdm
    from lightning.pytorch.tuner import Tuner

    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # (no tqdm monitor thread)
    hits = oom_when(lambda layers, size, *_: size > 1)  # (more micro-batches fit)
    module = _TunedSeq()
    module.batch_size = 16
    no_val = dict(limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer = L.Trainer(
        strategy="roundpipe", accelerator="cpu", devices=2, max_epochs=1, **QUIET, **no_val
    )
    found = Tuner(trainer).lr_find(module, num_training=8, early_stop_threshold=None)
    assert hits and len(found.results["lr"]) == 8

    class Fails(_TunedSeq):
        def training_step(self, batch, batch_idx):
            if batch_idx == 3:
                raise RuntimeError("a bug in the user's training_step")
            return super().training_step(batch, batch_idx)

    before = {t.ident for t in threading.enumerate()}
    module = Fails()
    trainer = L.Trainer(
        strategy="roundpipe", accelerator="cpu", devices=2, max_epochs=1, **QUIET, **no_val
    )
    with pytest.raises(RuntimeError, match=r"a bug in the user's training_step"):
        Tuner(trainer).lr_find(module, num_training=8)
    assert {t.ident for t in threading.enumerate()} <= before
    assert trainer.strategy.engine is None and "forward" not in module.net.__dict__

"""The fit's first batch, run again after a device ran out of memory.

Lightning's closure runs ``training_step`` and then ``backward``; during the
first training batch of a fit :class:`FirstBatchRetry` waits for every stage
at the end of each, so that running out of device memory surfaces where the
batch can still be run again. It then asks
:func:`~lightning_roundpipe.plan.decide.after_out_of_memory` what to change,
has the strategy build a new engine with it (activations counted larger
than predicted, smaller stages or more micro-batches), forgets what the failed attempt
logged and runs the batch's ``training_step`` again, so the result is that of
a run that fitted at once.
"""

from __future__ import annotations

import gc
import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message
from torch import Tensor

from .plan.decide import after_out_of_memory
from .runtime.device import is_out_of_memory
from .runtime.nested import batch_size_of
from .runtime.worker import WorkerError

if TYPE_CHECKING:
    from .strategy import RoundPipeStrategy

__all__ = ["FirstBatchRetry"]


class FirstBatchRetry:
    """Re-planning after an out-of-memory failure in the fit's first batch.

    Args:
        strategy: the strategy whose engine is rebuilt.
        replans: how many times (``oom_replans``).
        close: closes the strategy's engine.
        build: builds a new one (with what this object learned), resuming an
            asynchronous run from the given one-behind weights.
        microbatches: the micro-batch count the strategy would use with a
            given stage size limit (for the plan a re-plan would get).

    Attributes:
        size_limit: a cap on each stage's weights and gradients learned from a
            failure (size-estimate bytes), or None.
        microbatches: a micro-batch count learned from a failure, or None.
        activation_scale: how many times over predicted activations count,
            learned from failures (1: as predicted).
        resumed: the one-behind weights a resumed run started from (a re-plan
            before the first step resumes from them again).
    """

    def __init__(
        self,
        strategy: RoundPipeStrategy,
        replans: int,
        *,
        close: Callable[[], None],
        build: Callable[[dict[str, Tensor] | None], None],
        microbatches: Callable[[Any, int, int | None], int],
    ) -> None:
        self.strategy = strategy
        self._close = close
        self._build = build
        self._microbatches = microbatches
        self.replans = replans
        self.left = replans
        self.size_limit: int | None = None
        self.microbatches: int | None = None
        self.activation_scale = 1.0
        self.resumed: dict[str, Tensor] | None = None
        self.open = False  # the first batch is running on a fresh engine
        self._call: tuple[tuple, dict] | None = None

    def reset(self) -> None:
        """A new fit: nothing learned yet."""
        self.left, self.size_limit, self.microbatches = self.replans, None, None
        self.activation_scale = 1.0

    def arm(self) -> None:
        """A fresh engine for fitting: watch its first batch."""
        self.open = self.replans > 0

    def end(self) -> None:
        """Gradients are in the window (or a step is queued): no more re-runs."""
        self.open = False
        self._call = None
        self.resumed = None

    # ------------------------------------------------------------ the closure
    def training_step(self, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``run(*args, **kwargs)`` (the strategy's ``training_step``), again on
        a re-planned engine as long as a device runs out of memory."""
        self._call = (args, kwargs)
        while True:
            failure: WorkerError | None = None
            try:
                out = run(*args, **kwargs)
                # stages still running (the backward of a loss computed inside
                # the model) fail here, where the batch can be run again, and
                # not in the zero_grad Lightning calls next
                self.strategy.engine.wait_stages()
                if out is None or (isinstance(out, Mapping) and out.get("loss") is None):
                    self.end()  # nothing to run backward on: what it logged stays
                return out
            except WorkerError as err:
                failure = err
            self.replan(failure)
            failure = None
            self._forget_logged()

    def backward(self, run: Callable[[Tensor], None], loss: Tensor) -> None:
        """``run(loss)`` (the precision plugin's backward) and every stage,
        again after re-planning with the batch's training step run again."""
        module = self.strategy.lightning_module
        precision = self.strategy.precision_plugin
        while True:
            failure: WorkerError | None = None
            try:
                run(loss)
                self.strategy.engine.wait_stages()
                break
            except WorkerError as err:
                failure = err
            # outside the except block: the failed attempt's frames and the
            # old engine are not kept alive while the batch runs again
            self.replan(failure)
            failure = None
            # gradients autograd left in parameters outside the pipeline
            # (sync mode) would otherwise be counted twice
            for p in module.parameters():
                p.grad = None
            loss = precision.pre_backward(self._rerun(), module)
        self.end()

    # --------------------------------------------------------------- helpers
    def _forget_logged(self) -> None:
        """What the failed attempt logged is logged again by the next one."""
        results = getattr(self.strategy.lightning_module.trainer, "_results", None)
        if results is not None:
            results.reset(metrics=None, fx="training_step")

    def _rerun(self) -> Tensor:
        """The first batch's training step again, on the re-planned engine; its
        loss, normalized for accumulation as Lightning's closure does."""
        from lightning.pytorch.loops.optimization.automatic import ClosureResult
        from lightning.pytorch.trainer import call

        assert self._call is not None
        args, kwargs = self._call
        trainer = self.strategy.lightning_module.trainer
        self._forget_logged()
        output = call._call_strategy_hook(trainer, "training_step", *args, **kwargs)
        loss = ClosureResult.from_training_step_output(
            output, trainer.accumulate_grad_batches
        ).closure_loss
        if loss is None:
            raise RuntimeError("training_step returned no loss when run again after re-planning")
        return loss

    def replan(self, err: WorkerError) -> None:
        """Rebuild the engine with activations counted larger, smaller stages
        or more micro-batches, or
        re-raise ``err`` (not an out-of-memory error, none left, nothing to change)."""
        strategy = self.strategy
        engine = strategy.engine
        if not is_out_of_memory(err.__cause__) or engine is None or self.left <= 0:
            raise err
        start, stop = err.layers
        plan, m, n = engine.plan, engine.num_microbatches, engine.num_devices
        estimates = engine.estimates
        batch = None if self._call is None else batch_size_of(self._call)
        decision = after_out_of_memory(
            estimates,
            plan,
            n,
            (start, stop),
            err.stage,
            plan_given=strategy.plan != "auto",
            # the count the new engine would use (limit < the old stage: the tighter one)
            microbatches_for=lambda limit: self._microbatches(estimates, n, limit),
            num_microbatches=m,
            auto_microbatches=strategy.num_microbatches == "auto",
            batch_size=batch,
            batch_microbatches=None if batch is None else engine.microbatches_for(batch),
            predicted_peaks=engine.predicted_peaks,
            memory_limit=engine.memory_limit,
            prefetch=engine.prefetch,
            activation_scale=engine.activation_scale,
            with_activations=engine.plan_with_activations,
        )
        if decision is None:
            raise err
        if decision.size_limit is not None:
            self.size_limit = decision.size_limit
        if decision.microbatches is not None:
            self.microbatches = decision.microbatches
        if decision.activation_scale is not None:
            self.activation_scale = decision.activation_scale
        self.left -= 1
        cuda = any(d.type == "cuda" for d in engine.devices)
        self._close()
        del engine
        _forget_frames(err)  # tensors of the failed attempt held by its traceback
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()  # the failed engine's blocks back to the driver
        self._build(self.resumed)
        message = (
            f"RoundPipe: {err.device} ran out of memory in stage {err.stage} (layers "
            f"{start}-{stop - 1}) during the first batch; re-planned with {decision.change}: "
            f"plan {plan} -> {decision.plan or strategy.engine.plan}, {m} -> "
            f"{strategy.engine.num_microbatches} "
            "micro-batches; running the batch again"
        )
        # every server re-plans on its own (gradients are reduced per layer,
        # whatever each server's plan): the one that ran out says so
        if strategy.world_size > 1:
            message = rank_prefixed_message(message, strategy.global_rank)
        warnings.warn(message, stacklevel=2)


def _forget_frames(exc: BaseException | None) -> None:
    """Clear the local variables of the finished frames in ``exc``'s traceback
    and in those of its causes (frames still running are left alone)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__

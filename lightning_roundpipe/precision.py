"""``RoundPipePrecision``: the Trainer's ``precision=`` for the RoundPipe strategy.

The engine does the precision work itself (a low-precision master copy that
devices compute in, fp32 gradient buffers, fp16 loss scaling on the host), so
this plugin adds no autocast and no loss scaling of its own. Its
``optimizer_step`` runs the closure, Lightning's pre-step hooks and the
engine's step; the gradient clipping Lightning asks for is applied to the
fp32 gradients of the optimizer's parameters inside the step (recorded
first, in order, when the step is asynchronous).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.core import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from typing_extensions import override

from .groups import ThreadGroups
from .runtime.optimizer import all_finite
from .runtime.options import PRECISION_ALIASES, PRECISIONS

if TYPE_CHECKING:
    from .runtime import RoundPipeEngine

__all__ = ["SUPPORTED", "RoundPipePrecision"]

SUPPORTED = tuple(PRECISIONS)


#: torch.amp.GradScaler's defaults, which RoundPipe's loss scaling uses
_DEFAULT_SCALER = (2.0**16, 2.0, 0.5, 2000)


def _scaler_settings(scaler: Any) -> tuple[float, float, float, int]:
    return (
        float(scaler.get_scale()),
        float(scaler.get_growth_factor()),
        float(scaler.get_backoff_factor()),
        int(scaler.get_growth_interval()),
    )


class RoundPipePrecision(Precision):
    """Precision plugin for :class:`~lightning_roundpipe.RoundPipeStrategy`.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"16-mixed"``.
    """

    def __init__(
        self, precision: Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed"] = "32-true"
    ) -> None:
        precision = PRECISION_ALIASES.get(precision, precision)
        if precision not in SUPPORTED:
            raise ValueError(
                f"precision={precision!r} is not supported by the RoundPipe strategy; use one of "
                f"{', '.join(repr(p) for p in SUPPORTED)}"
            )
        self.precision = precision
        # clipping asked for before the gradients exist (asynchronous steps), in order
        self.clips: list[tuple[float, GradClipAlgorithmType]] = []
        self._clip_now = False  # in a synchronous step, with its gradients in .grad
        self._in_step = False  # in the hooks Lightning runs before a step
        self._warned_early_clip = False
        # the asynchronous optimizer's own param_groups
        self._groups: ThreadGroups | None = None
        # the engine of the strategy using this plugin (set while it has one)
        self.engine: RoundPipeEngine | None = None
        # several servers: averages the gradients of parameters outside the
        # pipeline over them (set by the strategy; the pipeline's own are
        # averaged by the engine)
        self.after_backward: Callable[[], None] | None = None
        # the engine counters (RoundPipeEngine.counters) the next engine goes
        # on from: a checkpoint's being resumed, or those of the engine a
        # rebuild within the fit replaces (set by the strategy)
        self.carried: dict[str, Any] | None = None
        # the devices' type (set by the strategy): autocast there too
        self.device_type = "cpu"
        # what the last engine ended with (saved by a checkpoint after the fit)
        self.final: dict[str, Any] | None = None
        # the iteration the training batch in progress started at (set by
        # the strategy), and whether that batch is still in progress (the
        # Trainer's batch progress: a checkpoint saved meanwhile runs it again)
        self.batch_start: int | None = None
        self.in_batch: Callable[[], bool] = lambda: False

    @override
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run goes on with: the engine's iteration number (its
        dropout masks are those of the uninterrupted run) and the fp16 loss
        scale with its count of good steps (Lightning saves it in checkpoints
        under this plugin's name)."""
        engine = self.engine
        if engine is None:  # after the fit: what its engine ended with
            return dict(self.final or {})
        engine.synchronize()  # the scale after the last step
        counters = engine.counters()
        if self.batch_start is not None and self.in_batch():
            # saved inside a training batch (OnExceptionCheckpoint, a hook before
            # the optimizer step): the resumed run does that batch again
            counters["iteration"] = self.batch_start
        return counters

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self.carried = dict(state_dict)
        if self.engine is not None and self.engine.iteration == 0:
            self.engine.continue_from(self.carried)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """16-mixed: the loss scale also as Lightning's own fp16 plugin saves
        its ``GradScaler`` (under ``"MixedPrecision"``), so a run resumed from
        this checkpoint under another strategy goes on with the scale."""
        state = checkpoint.get(type(self).__qualname__)
        if self.precision != "16-mixed" or not state or "loss_scale" not in state:
            return
        growth, backoff, interval = _DEFAULT_SCALER[1:]
        checkpoint.setdefault(
            MixedPrecision.__qualname__,
            {
                "scale": float(state["loss_scale"]["scale"]),
                "growth_factor": growth,
                "backoff_factor": backoff,
                "growth_interval": interval,
                "_growth_tracker": int(state["loss_scale"]["good_steps"]),
            },
        )

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """16-mixed, resuming a checkpoint another strategy saved with
        Lightning's fp16 plugin: its ``GradScaler`` scale and count of good
        steps go on here (Lightning restores a plugin's state by the plugin's
        class name, so they would be dropped and the scale restart at 2^16)."""
        theirs = checkpoint.get(MixedPrecision.__qualname__)
        if (
            self.precision != "16-mixed"
            or type(self).__qualname__ in checkpoint
            or not isinstance(theirs, dict)
            or "scale" not in theirs
        ):
            return
        settings = tuple(
            theirs.get(k, d)
            for k, d in zip(
                ("growth_factor", "backoff_factor", "growth_interval"),
                _DEFAULT_SCALER[1:],
                strict=True,
            )
        )
        if settings != _DEFAULT_SCALER[1:]:
            rank_zero_warn(
                f"the checkpoint's GradScaler grew and backed off with growth_factor, "
                f"backoff_factor, growth_interval = {settings}; RoundPipe goes on from its scale "
                f"with {_DEFAULT_SCALER[1:]} (torch's defaults)"
            )
        tracker = theirs.get("_growth_tracker", 0)
        self.load_state_dict(
            {"loss_scale": {"scale": float(theirs["scale"]), "good_steps": int(tracker)}}
        )

    def _outside(self, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
        """The optimizer's parameters that are not the pipeline's (found once
        per engine, optimizer and parameter count: the check runs at every
        step)."""
        engine = self.engine
        assert engine is not None
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        key = (id(engine), id(optimizer), count)
        if self.__dict__.get("_outside_key") != key:
            inside = {id(p) for p in engine.parameters()}
            self._outside_params = [
                p for g in optimizer.param_groups for p in g["params"] if id(p) not in inside
            ]
            self._outside_key = key
        return self._outside_params

    @classmethod
    def from_plugin(cls, plugin: Precision | None) -> RoundPipePrecision:
        """Turn the plugin Lightning chose from ``Trainer(precision=...)`` into ours."""
        if plugin is None:
            return cls()
        if isinstance(plugin, RoundPipePrecision):
            return plugin
        from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision

        if type(plugin) not in (Precision, MixedPrecision, HalfPrecision, DoublePrecision):
            # (its hooks would not run: RoundPipe computes in its own precision)
            raise ValueError(
                f"the precision plugin {type(plugin).__name__} is not supported by RoundPipe, "
                "which runs its own precision (RoundPipePrecision); choose it with "
                "Trainer(precision='32-true' | 'bf16-mixed' | 'bf16-true' | '16-mixed')"
            )
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and _scaler_settings(scaler) != _DEFAULT_SCALER:
            raise ValueError(
                f"a GradScaler with init_scale, growth_factor, backoff_factor, growth_interval "
                f"= {_scaler_settings(scaler)} is not supported by RoundPipe, which scales fp16 "
                f"losses itself with {_DEFAULT_SCALER} (torch's defaults); pass "
                "Trainer(precision='16-mixed') without a plugin"
            )
        name = getattr(plugin, "precision", "32-true")
        if type(plugin) is Precision:
            name = "32-true"
        return cls(name)

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.precision == "bf16-true":
            return module.to(torch.bfloat16)
        return module

    @override
    def convert_input(self, data: Any) -> Any:
        """bf16-true: the batch's floating-point tensors in bf16, as Lightning's
        own bf16-true plugin casts them (a module outside the pipeline fed the
        batch, float targets)."""
        if self.precision == "bf16-true":
            return apply_to_collection(
                data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.bfloat16
            )
        return data

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """``bf16-mixed``: the steps' own code on the host (modules outside the
        pipeline fed its low-precision outputs, the loss) runs under autocast
        in bf16, as under Lightning's mixed precision; the pipeline's layers
        compute on the workers' threads in that dtype already (autocast is per
        thread). ``16-mixed``: the step's own code runs in fp32 (the pipeline
        gives its outputs in fp32): the loss scale is the pipeline's, applied
        inside it, so fp16 gradients of host code would not be scaled and
        would flush to zero. ``bf16-true``: floating-point tensors a step
        makes are bf16, as under Lightning's."""
        if self.precision == "bf16-true":
            # tensors a step makes are bf16, as under Lightning's bf16-true (the
            # default dtype is the process's: the engine's own code gives dtypes)
            with self.tensor_init_context():
                yield
            return
        if self.precision != "bf16-mixed":
            yield
            return
        engine = self.engine
        dtype = engine.compute_dtype if engine is not None else PRECISIONS[self.precision]
        with ExitStack() as stack:
            # (the host's tensors are CPU ones; a step may make device ones too)
            for kind in dict.fromkeys(("cpu", self.device_type)):
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            yield

    @contextmanager
    def tensor_init_context(self) -> Generator[None, None, None]:
        if self.precision == "bf16-true":
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                yield
            finally:
                torch.set_default_dtype(default)
        else:
            yield

    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the gradients of ``optimizer``'s parameters (Lightning's
        clipping, each call in turn), inside the step: at once in a synchronous
        one, whose gradients are in ``.grad`` then; recorded for an asynchronous
        one, whose gradients do not exist yet on this thread. A call outside
        the step (``self.clip_gradients`` in ``on_after_backward``, where
        ``.grad`` is None under RoundPipe) is recorded too and applied first
        in the step, to the whole step's gradient (warned once)."""
        if not clip_val or clip_val <= 0:
            return
        algorithm = GradClipAlgorithmType(gradient_clip_algorithm)
        if self._clip_now:
            super().clip_gradients(optimizer, clip_val, algorithm)
            return
        if not self._in_step and not self._warned_early_clip:
            self._warned_early_clip = True
            rank_zero_warn(
                "clip_gradients was called outside the optimizer step's hooks (e.g. in "
                "on_after_backward, where .grad is None under RoundPipe: the gradients are "
                "the pipeline's until the step): it is applied at the step, to the step's "
                "whole gradient, as if called in configure_gradient_clipping. With "
                "accumulate_grad_batches > 1 the default strategy would clip each batch's "
                "partial sum instead; clip in configure_gradient_clipping (or set "
                "gradient_clip_val) to get the same result under every strategy"
            )
        self.clips.append((float(clip_val), algorithm))

    def merge_groups(self) -> None:
        """Once the queued steps have run: what the optimizer changed in its
        own param_groups goes into the loop's (:meth:`ThreadGroups.merge`)."""
        if self._groups is not None:
            self._groups.merge()

    def _clipped(self, optimizer: Any, step: Callable[[], Any]) -> Callable[[], Any]:
        """``step`` after the clipping recorded so far (forgotten here), over
        the parameters ``optimizer`` holds now (the optimizer thread's groups
        may change meanwhile)."""
        clips, self.clips = self.clips, []
        if not clips:
            return step
        params = list(self.main_params(optimizer))

        def clipped() -> Any:
            _clip(params, clips)
            return step()

        return clipped

    @override
    def optimizer_step(
        self,
        optimizer: Optimizable,
        model: LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (``training_step`` and the pipelined backward), the
        hooks Lightning runs before a step (``on_before_optimizer_step``, gradient
        clipping, which :meth:`clip_gradients` records), then the step, through
        the engine, as Lightning's DeepSpeed and FSDP precision plugins do with
        theirs. With the asynchronous optimizer the step is queued (the window's
        gradients do not exist yet on this thread); synchronous: the hooks run
        inside the step with this step's gradients in ``.grad``."""
        engine = self.engine
        if engine is None:
            raise RuntimeError("RoundPipePrecision steps only inside the RoundPipe strategy")
        earlier = engine.has_pending_gradients  # from accumulated earlier batches
        result = closure()
        # the closure may have rebuilt the engine (out-of-memory re-plan)
        engine = self.engine
        assert engine is not None
        if self.after_backward is not None:
            self.after_backward()
        self._in_step = True  # (the hooks from here on clip the step's gradients)
        try:
            return self._step(optimizer, model, result, earlier, **kwargs)
        finally:
            self._in_step = False

    def _step(
        self, optimizer: Any, model: LightningModule, result: Any, earlier: bool, **kwargs: Any
    ) -> Any:
        """The hooks before a step and the step, after the closure."""
        engine = self.engine
        assert engine is not None
        if result is None and not earlier:
            # training_step returned None: Lightning runs the hooks and steps an
            # optimizer that has no gradients, i.e. nothing changes. Drop what a
            # model call with labels= already put into the window.
            self._after_closure(model, optimizer)
            self.clips = []
            if engine.has_pending_gradients:
                engine.zero_grad()
            return None

        def step() -> Any:
            return optimizer.step(**kwargs)

        if engine.async_optimizer:
            self._after_closure(model, optimizer)
            # (on the optimizer thread's own param_groups: see ThreadGroups)
            if self._groups is None or self._groups.optimizer is not optimizer:
                self._groups = ThreadGroups(optimizer)
            queued = _without_closure(optimizer, self._groups.queued_step(**kwargs))
            engine.step(self._clipped(optimizer, queued))
        else:

            def prepare() -> dict[str, Any] | None:
                # clipping asked for before the step's hooks (on_after_backward)
                clips, self.clips = self.clips, []
                _clip(list(self.main_params(optimizer)), clips)
                self._clip_now = True  # the hooks clip these gradients themselves
                try:
                    self._after_closure(model, optimizer)
                finally:
                    self._clip_now = False
                # parameters outside the pipeline: their gradients count in the
                # overflow and non-finite checks as the pipeline's do
                for p in self._outside(optimizer):
                    if p.grad is not None and not all_finite(p.grad):
                        names = {id(q): n for n, q in model.named_parameters()}
                        return {"nonfinite": names.get(id(p), "a parameter outside the pipeline")}
                return None

            engine.step(_without_closure(optimizer, step), prepare=prepare).wait()
        return result


class ClosureRequiredError(RuntimeError):
    """An optimizer's step failed because it was called without a closure."""


def _without_closure(optimizer: Any, step: Callable[[], Any]) -> Callable[[], Any]:
    """``step``, whose failure for want of a closure says why there is none.

    An optimizer whose ``step(closure=None)`` still needs one (SAM-style
    optimizers re-evaluate the loss at perturbed weights) cannot be told apart
    at setup from one that only accepts it (every torch optimizer does); its
    failure can: it asserts on the closure or calls ``None``."""

    def run() -> Any:
        try:
            return step()
        except (AssertionError, TypeError, ValueError, RuntimeError) as exc:
            text = str(exc)
            if "closure" not in text.lower() and "'NoneType' object is not callable" not in text:
                raise
            raise ClosureRequiredError(
                f"{type(optimizer).__name__}.step failed without a closure "
                f"({type(exc).__name__}: {text}): it evaluates the loss again inside the step "
                "(as SAM does), while RoundPipe runs each batch's forward and backward through "
                "the pipeline once and steps afterwards, without a closure. Return an optimizer "
                "from configure_optimizers whose step needs no closure (AdamW, SGD, ...)"
            ) from exc

    return run


def _clip(params: list[torch.Tensor], clips: list[tuple[float, GradClipAlgorithmType]]) -> None:
    """Lightning's clipping of ``params``' gradients, each recorded call in turn."""
    for value, algorithm in clips:
        if algorithm == GradClipAlgorithmType.VALUE:
            torch.nn.utils.clip_grad_value_(params, value)
        else:
            torch.nn.utils.clip_grad_norm_(params, value)

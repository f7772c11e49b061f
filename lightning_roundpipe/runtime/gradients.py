"""Gradients the caller's autograd completes after a call returned.

A ``forward_backward(..., scale="later")`` call's weight gradients wait on the
host until autograd reaching its loss gives their factor (:class:`Gain`); a
call with ``input_grads=True`` leaves the gradient of its inputs in the store
for the caller to take. :class:`CallerGradients` keeps both ledgers for the
engine: registering, taking, settling at a window's end, and skipping a step
whose input gradient was not finite.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .calls import Gain, Runtime
from .nested import flatten_tensors
from .optimizer import LossScaler, NonFiniteError, all_finite
from .options import NonFinite
from .store import Key

__all__ = ["CallerGradients"]

log = logging.getLogger(__name__)


@dataclass
class _Wanted:
    """A call whose input gradients the caller will take."""

    inputs: Any
    microbatches: int
    batch_size: int
    loss_scale: float
    window: int


class CallerGradients:
    """The engine's ledger of gradient factors given later and of input
    gradients wanted, by iteration. ``wait`` runs a blocking wait the way the
    engine translates failures and timeouts."""

    def __init__(
        self,
        rt: Runtime,
        scaler: LossScaler,
        nonfinite: NonFinite,
        wait: Callable[[Callable[[], Any]], Any],
    ) -> None:
        self._rt = rt
        self._scaler = scaler
        self._nonfinite = nonfinite
        self._wait = wait
        self._wanted: dict[int, _Wanted] = {}
        self._skip: set[int] = set()  # windows with a non-finite input gradient
        # calls whose factor is not given yet or whose gradients the couriers
        # may still hold
        self._gains: dict[int, Gain] = {}

    # ------------------------------------------------------------- register
    def track(self, gain: Gain) -> None:
        """A submitted call whose factor comes later."""
        with self._rt.store.lock:
            self._forget_settled()
            self._gains[gain.iteration] = gain

    def want_inputs(
        self,
        iteration: int,
        inputs: Any,
        microbatches: int,
        batch_size: int,
        loss_scale: float,
        window: int,
    ) -> None:
        """A submitted call whose input gradients the caller will take."""
        self._wanted[iteration] = _Wanted(inputs, microbatches, batch_size, loss_scale, window)

    def forget_inputs(self, iteration: int) -> None:
        """The call failed before its backward: nobody takes its input gradients."""
        self._wanted.pop(iteration, None)

    # ------------------------------------------------------- input gradients
    def input_grads(self, iteration: int) -> list[torch.Tensor | None]:
        """See :meth:`RoundPipeEngine.input_grads`."""
        wanted = self._wanted.pop(iteration, None)
        if wanted is None:
            raise RuntimeError(
                f"iteration {iteration} computed no input gradients, or they were taken "
                "already: run it with forward_backward(..., input_grads=True)"
            )
        store = self._rt.store
        per_mb = [
            self._wait(
                lambda j=j: store.take(
                    Key(iteration, "grad", 0, j), f"input gradient of micro-batch {j}"
                )[0]
            )
            for j in range(wanted.microbatches)
        ]
        out: list[torch.Tensor | None] = []
        for i, t in enumerate(flatten_tensors(wanted.inputs)):
            grads = [g[i] for g in per_mb]
            if any(g is None for g in grads):
                out.append(None)
                continue
            grads = [g.to("cpu", torch.float32) for g in grads]
            # split tensors were cut along dim 0; the others went to every micro-batch
            split = t.dim() > 0 and t.shape[0] == wanted.batch_size
            g = torch.cat(grads) if split else torch.stack(grads).sum(0)
            if wanted.loss_scale != 1.0:
                g = g / wanted.loss_scale
            out.append(g.to(t.dtype))
        self._check_finite(out, iteration, wanted.window)
        return out

    def _check_finite(self, grads: list[torch.Tensor | None], iteration: int, window: int) -> None:
        """Input gradients go to modules outside the pipeline, which the
        window's step updates too: a non-finite one skips that step (fp16: an
        overflow, the loss scale backs off) or raises, as a weight gradient would."""
        if not self._scaler.enabled and self._nonfinite == "ignore":
            return
        if all(g is None or all_finite(g) for g in grads):
            return
        if not self._scaler.enabled and self._nonfinite == "raise":
            raise NonFiniteError(
                f"the gradient of the pipeline's inputs in iteration {iteration} is not finite "
                "(inf or NaN); the weights were not updated by it. Set nonfinite='skip' to skip "
                "such steps, or look for the cause (learning rate, data, precision)"
            )
        self._skip.add(window)

    def take_skip(self, window: int) -> bool:
        """Whether ``window``'s step must be skipped (asked once, at its step)."""
        skip = window in self._skip
        self._skip.discard(window)
        return skip

    # ----------------------------------------------------------------- gains
    def scale(self, iteration: int, factor: float) -> None:
        """See :meth:`RoundPipeEngine.scale_gradients`."""
        store = self._rt.store
        with store.lock:
            gain = self._gains.get(iteration)
            if gain is None or gain.value is not None:
                raise RuntimeError(
                    f"the gradients of iteration {iteration} were already scaled, or it was not "
                    "run with scale='later': backward through a RoundPipe loss runs once (use "
                    "the loss once per backward, without retain_graph)"
                )
            gain.value = float(factor)
            store.lock.notify_all()
        self._wake_couriers()

    def awaiting(self, window: int) -> bool:
        """Whether a call of ``window`` still waits for its factor (its loss
        not yet backpropagated)."""
        with self._rt.store.lock:
            return any(g.window == window and g.value is None for g in self._gains.values())

    def settle(self, window: int) -> None:
        """Gradients of ``window`` still waiting for a factor get 0: autograd
        never reached their loss (it was not part of what was backpropagated)."""
        store = self._rt.store
        with store.lock:
            open_ = [g for g in self._gains.values() if g.window == window and g.value is None]
            for g in open_:
                g.value, g.dropped = 0.0, True
            store.lock.notify_all()
        for g in open_:  # input gradients nobody will take: out of the store
            if g.iteration in self._wanted:
                self.input_grads(g.iteration)
        if open_:
            log.debug(
                "RoundPipe: iterations %s of window %d were never backpropagated: their "
                "gradients are dropped",
                [g.iteration for g in open_],
                window,
            )
            self._wake_couriers()

    def wait_settled(self) -> None:
        """Gradients whose factor is known are in the buffers (those still
        waiting for theirs are not part of the window yet)."""
        store = self._rt.store
        gains = list(self._gains.values())
        self._wait(
            lambda: store.wait_until(
                lambda: all(g.value is None or g.parked == 0 for g in gains),
                "gradients to be added with their factor",
            )
        )
        with store.lock:
            self._forget_settled()

    def _forget_settled(self) -> None:
        """Drop calls whose factor is known and whose gradients are all added
        (caller holds the store's lock)."""
        self._gains = {it: g for it, g in self._gains.items() if g.value is None or g.parked}

    def _wake_couriers(self) -> None:
        for w in self._rt.workers:
            w.courier.wake()

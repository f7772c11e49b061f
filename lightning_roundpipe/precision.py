"""``RoundPipePrecision``: the Trainer's ``precision=`` for the RoundPipe strategy.

The engine does the precision work itself (a low-precision master copy that
devices compute in, fp32 gradient buffers, fp16 loss scaling on the host), so
this plugin adds no autocast and no loss scaling of its own. It remembers the
gradient clipping Lightning asks for, which the engine applies to the fp32
gradients inside the (possibly asynchronous) optimizer step.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

from .runtime.options import PRECISIONS

__all__ = ["SUPPORTED", "RoundPipePrecision"]

SUPPORTED = tuple(PRECISIONS)
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed"}


class RoundPipePrecision(Precision):
    """Precision plugin for :class:`~lightning_roundpipe.RoundPipeStrategy`.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"16-mixed"``.
    """

    def __init__(
        self, precision: Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed"] = "32-true"
    ) -> None:
        precision = _ALIASES.get(precision, precision)
        if precision not in SUPPORTED:
            raise ValueError(
                f"precision={precision!r} is not supported by the RoundPipe strategy; use one of "
                f"{', '.join(repr(p) for p in SUPPORTED)}"
            )
        self.precision = precision
        self.clip: tuple[float, str] | None = None

    @classmethod
    def from_plugin(cls, plugin: Precision | None) -> RoundPipePrecision:
        """Turn the plugin Lightning chose from ``Trainer(precision=...)`` into ours."""
        if plugin is None:
            return cls()
        if isinstance(plugin, RoundPipePrecision):
            return plugin
        name = getattr(plugin, "precision", "32-true")
        if type(plugin) is Precision:
            name = "32-true"
        return cls(name)

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.precision == "bf16-true":
            return module.to(torch.bfloat16)
        return module

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
        """Record the clipping; the engine applies it inside the optimizer step."""
        if clip_val and clip_val > 0:
            self.clip = (float(clip_val), GradClipAlgorithmType(gradient_clip_algorithm).value)

    def take_clip(self) -> dict[str, float]:
        """Keyword arguments for ``engine.step`` (and forget the request)."""
        clip, self.clip = self.clip, None
        if clip is None:
            return {}
        value, algorithm = clip
        return {"clip_grad_norm": value} if algorithm == "norm" else {"clip_grad_value": value}

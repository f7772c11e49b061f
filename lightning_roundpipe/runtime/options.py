"""Engine options: one frozen set, validated once, shared by the strategy and the engine.

The strategy builds an :class:`EngineOptions` when it is constructed (so a bad
value fails before anything else happens, naming the option) and hands it,
completed with what only setup knows (precision, seed, a size cap or an
activation scale learned from an out-of-memory failure), to :meth:`RoundPipeEngine.from_options
<lightning_roundpipe.runtime.RoundPipeEngine.from_options>`; an engine built
from keyword arguments validates them through the same class. Precisions and
the non-finite policies are defined here and nowhere else.
"""

from __future__ import annotations

import numbers
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, Union, get_args, get_origin

import torch

from ..plan import PlanError
from ..plan.schedule import Placement

__all__ = [
    "NONFINITE",
    "PRECISIONS",
    "PRECISION_ALIASES",
    "EngineOptions",
    "NonFinite",
    "Precision",
    "check_types",
]

Precision = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed"]
#: the compute dtype (and master-copy dtype) of each supported precision
PRECISIONS: dict[str, torch.dtype] = {
    "32-true": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16,
}
# the shorter names Trainer(precision=...) accepts
PRECISION_ALIASES: dict[str | int, str] = {
    "32": "32-true",
    32: "32-true",
    "bf16": "bf16-mixed",
    "16": "16-mixed",
    16: "16-mixed",
}
NonFinite = Literal["raise", "skip", "ignore"]
NONFINITE = ("raise", "skip", "ignore")


def _accepts(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the annotated type ``hint`` (``bool`` is not an
    ``int`` here, and a number is not a flag: ``"false"`` is not ``False``)."""
    origin = get_origin(hint)
    if hint is Any:
        return True
    if origin is Literal:  # (of the right type: which values, the option's own check says)
        return any(isinstance(value, type(a)) for a in get_args(hint))
    if origin in (Union, types.UnionType):
        return any(_accepts(value, h) for h in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is int:  # (NumPy's integers too)
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if isinstance(origin, type):  # (list[int] and the like: the container only)
        return isinstance(value, origin)
    return isinstance(hint, type) and isinstance(value, hint)


def _describe(hint: Any) -> list[str]:
    origin = get_origin(hint)
    if origin is Literal:
        return [repr(a) for a in get_args(hint)]
    if origin in (Union, types.UnionType):
        return [d for h in get_args(hint) for d in _describe(h)]
    names = {
        bool: "True or False",
        int: "an integer",
        float: "a number",
        str: "a string",
        os.PathLike: "a path",
        type(None): "None",
    }
    if hint in names:
        return [names[hint]]
    return [f"a {getattr(origin or hint, '__name__', str(hint))}"]


def check_types(values: Mapping[str, Any], hints: Mapping[str, Any]) -> None:
    """Raise a ``ValueError`` (as every option's own check does) naming the
    first option in ``values`` whose value is not of its annotated type in
    ``hints`` (options without one are not checked), before the options'
    value checks: a string where a flag belongs would otherwise count as
    true, a float number of workers fail deep inside a run."""
    for name, value in values.items():
        hint = hints.get(name)
        if hint is not None and not _accepts(value, hint):
            raise ValueError(f"{name} must be {' or '.join(_describe(hint))}, got {value!r}")


def plain_int(value: Any) -> Any:
    """A NumPy (or other integral) number as a Python int; anything else as it is."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)
    return value


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class EngineOptions:
    """How an engine runs (see :class:`~lightning_roundpipe.runtime.RoundPipeEngine`
    for each option's meaning); validated when created."""

    precision: Precision = "32-true"
    async_optimizer: bool = False
    microbatches_per_round: int | Literal["auto"] | None = None
    activation_memory: int | None = None
    placement: Placement = "free-first"
    trace: bool = False
    forbid_host_sync: bool = False
    fit_to_batch: bool = False
    seed: int = 0
    watchdog_timeout: float = 600.0
    device_memory_limit: int | None = None
    size_limit: int | None = None
    activation_scale: float = 1.0
    optimizer_threads: int | None = None
    profile_iterations: int = 2
    replan_margin: float = 0.05
    nonfinite: NonFinite = "raise"
    tile_memory: int | Literal["auto"] | None = "auto"
    double_buffer: bool | None = None

    def __post_init__(self) -> None:
        check_types(
            {f.name: getattr(self, f.name) for f in fields(self)},
            typing.get_type_hints(EngineOptions),
        )
        for f in fields(self):  # (NumPy integers, which check_types accepts: plain ints)
            object.__setattr__(self, f.name, plain_int(getattr(self, f.name)))
        if self.double_buffer not in (None, True, False):
            raise ValueError(
                f"double_buffer must be True, False or None, got {self.double_buffer!r}"
            )
        if self.double_buffer and not self.async_optimizer:
            raise ValueError(
                "double_buffer=True needs the asynchronous optimizer (async_optimizer=True): "
                "with synchronous steps no window reads the weights while they are copied; "
                "leave double_buffer unset"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision {self.precision!r} is not supported; use one of "
                f"{', '.join(repr(p) for p in PRECISIONS)}"
            )
        if self.optimizer_threads is not None and self.optimizer_threads < 1:
            raise ValueError(f"optimizer_threads must be >= 1, got {self.optimizer_threads}")
        if self.nonfinite not in NONFINITE:
            raise ValueError(
                f"nonfinite must be 'raise', 'skip' or 'ignore', got {self.nonfinite!r}"
            )
        if self.profile_iterations < 0:
            raise ValueError(f"profile_iterations must be >= 0, got {self.profile_iterations}")
        if not self.replan_margin >= 0:
            raise ValueError(f"replan_margin must be >= 0, got {self.replan_margin!r}")
        if not self.watchdog_timeout > 0:
            raise ValueError(f"watchdog_timeout must be > 0, got {self.watchdog_timeout!r}")
        mr = self.microbatches_per_round
        if mr not in (None, "auto") and not _positive_int(mr):
            raise PlanError(
                f"microbatches_per_round must be an integer >= 1, 'auto' or None, got "
                f"{mr!r}; leave it unset for one round per batch"
            )
        if mr == "auto":  # one spelling of "the whole batch within the budget"
            object.__setattr__(self, "microbatches_per_round", None)
        if self.activation_memory is not None and not _positive_int(self.activation_memory):
            raise ValueError(
                "activation_memory must be a positive number of bytes, got "
                f"{self.activation_memory!r}"
            )
        if self.placement not in ("free-first", "rotate"):
            raise ValueError(f"placement must be 'free-first' or 'rotate', got {self.placement!r}")
        if self.size_limit is not None and not self.size_limit > 0:
            raise ValueError(f"size_limit must be > 0, got {self.size_limit!r}")
        if not self.activation_scale >= 1:
            raise ValueError(f"activation_scale must be >= 1, got {self.activation_scale!r}")
        tm = self.tile_memory
        if tm not in ("auto", None) and not _positive_int(tm):
            raise ValueError(
                f"tile_memory must be a positive number of bytes, 'auto' or None, got {tm!r}; "
                "leave it 'auto' to tile only sequences whose working set needs it"
            )
        if self.device_memory_limit is not None and not self.device_memory_limit > 0:
            raise ValueError(
                f"device_memory_limit must be > 0 bytes, got {self.device_memory_limit!r}"
            )

    @property
    def double_buffered(self) -> bool:
        """Whether the trainable weights get a second master copy (the default
        with the asynchronous optimizer)."""
        return self.async_optimizer if self.double_buffer is None else self.double_buffer

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype devices compute in (and master copies are stored in)."""
        return PRECISIONS[self.precision]

    def as_kwargs(self) -> dict[str, Any]:
        """The options as engine keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

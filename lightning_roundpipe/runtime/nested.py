"""Nested activations: tensors inside tuples, lists and dicts.

Layer inputs and outputs may be a tensor or a (nested) tuple/list/dict of
tensors and other values. These helpers map over the tensors, split a batch
into micro-batches along dimension 0, and call a layer with such a value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "batch_size_of",
    "call_layer",
    "flatten_tensors",
    "map_tensors",
    "merge_microbatches",
    "split_microbatches",
]


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """Apply ``fn`` to every tensor in ``value``, keeping the structure."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        if hasattr(value, "_fields"):  # namedtuple
            return type(value)(*(map_tensors(fn, v) for v in value))
        return tuple(map_tensors(fn, v) for v in value)
    if isinstance(value, list):
        return [map_tensors(fn, v) for v in value]
    if isinstance(value, Mapping):
        out = {k: map_tensors(fn, v) for k, v in value.items()}
        try:
            return type(value)(out)
        except TypeError:  # mappings that cannot be built from a dict
            return out
    return value


def flatten_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value``, in a deterministic order."""
    out: list[torch.Tensor] = []
    map_tensors(out.append, value)
    return out


def batch_size_of(value: Any) -> int | None:
    """Size of dimension 0 of the first tensor with at least one dimension."""
    for t in flatten_tensors(value):
        if t.dim() > 0:
            return t.shape[0]
    return None


def split_microbatches(value: Any, num_microbatches: int, batch_size: int) -> list[Any]:
    """Split ``value`` into ``num_microbatches`` pieces along dimension 0.

    Tensors whose first dimension equals ``batch_size`` are split with
    ``torch.tensor_split`` (sizes differ by at most one); everything else
    (scalars, tensors of another size, non-tensors) is passed to every
    micro-batch unchanged."""

    def pieces(t: torch.Tensor) -> Any:
        if t.dim() > 0 and t.shape[0] == batch_size:
            return _Split(torch.tensor_split(t, num_microbatches, dim=0))
        return t

    marked = map_tensors(pieces, value)
    return [_take(marked, j) for j in range(num_microbatches)]


class _Split:
    __slots__ = ("parts",)

    def __init__(self, parts: tuple[torch.Tensor, ...]) -> None:
        self.parts = parts


def _take(value: Any, j: int) -> Any:
    if isinstance(value, _Split):
        return value.parts[j]
    if isinstance(value, tuple):
        if hasattr(value, "_fields"):
            return type(value)(*(_take(v, j) for v in value))
        return tuple(_take(v, j) for v in value)
    if isinstance(value, list):
        return [_take(v, j) for v in value]
    if isinstance(value, Mapping):
        out = {k: _take(v, j) for k, v in value.items()}
        try:
            return type(value)(out)
        except TypeError:
            return out
    return value


def merge_microbatches(values: list[Any]) -> Any:
    """Inverse of :func:`split_microbatches` for outputs: tensors with a batch
    dimension are concatenated along it, 0-d tensors stacked; other values are
    taken from the first micro-batch."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack(values)
        return torch.cat(values, dim=0)
    if isinstance(first, tuple):
        parts = [merge_microbatches([v[i] for v in values]) for i in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else tuple(parts)
    if isinstance(first, list):
        return [merge_microbatches([v[i] for v in values]) for i in range(len(first))]
    if isinstance(first, Mapping):
        out = {k: merge_microbatches([v[k] for v in values]) for k in first}
        try:
            return type(first)(out)
        except TypeError:
            return out
    return first


def call_layer(layer: Callable[..., Any], value: Any) -> Any:
    """Call ``layer`` with ``value``: a tuple is spread as positional arguments,
    a dict as keyword arguments, anything else is the single argument."""
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return layer(*value)
    if isinstance(value, dict):
        return layer(**value)
    return layer(value)

"""Nested activations: tensors inside tuples, lists and dicts.

Layer inputs and outputs may be a tensor or a (nested) tuple/list/dict of
tensors and other values. These helpers map over the tensors, split a batch
into micro-batches along dimension 0, and call a layer with such a value. The
structure is torch's own pytree (``torch.utils._pytree``, as torch's pipelining
micro-batch splitter uses); mappings pytree does not know (a tokenizer's
``BatchEncoding``, a ``UserDict``) are read as plain dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "batch_size_of",
    "call_layer",
    "flatten_tensors",
    "map_tensors",
    "merge_microbatches",
    "split_microbatches",
]


def _foreign_mapping(value: Any) -> bool:
    return isinstance(value, Mapping) and type(value) not in pytree.SUPPORTED_NODES


def _as_tree(value: Any) -> Any:
    """``value`` with every mapping pytree does not know turned into a dict."""
    return pytree.tree_map(
        lambda x: _as_tree(dict(x)) if _foreign_mapping(x) else x,
        value,
        is_leaf=_foreign_mapping,
    )


def map_tensors(
    fn: Callable[[torch.Tensor], Any], value: Any, _done: dict[int, Any] | None = None
) -> Any:
    """Apply ``fn`` to every distinct tensor in ``value``, keeping the
    structure (one pass: this runs for every stage and micro-batch). A tensor
    found twice (a layer returning ``(h, h)``) maps to one result, so a copy
    keeps them one tensor, as a later layer's in-place write expects."""
    done: dict[int, Any] = {} if _done is None else _done

    def visit(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            key = id(x)
            if key not in done:
                done[key] = fn(x)
            return done[key]
        if _foreign_mapping(x):
            return map_tensors(fn, dict(x), done)
        return x

    return pytree.tree_map(visit, value, is_leaf=_foreign_mapping)


def flatten_tensors(value: Any, _seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every distinct tensor in ``value`` (one found twice, once), in a
    deterministic order: the order :func:`map_tensors` visits them in."""
    seen: set[int] = set() if _seen is None else _seen
    out: list[torch.Tensor] = []
    for x in pytree.tree_leaves(value, is_leaf=_foreign_mapping):
        if isinstance(x, torch.Tensor):
            if id(x) not in seen:
                seen.add(id(x))
                out.append(x)
        elif _foreign_mapping(x):
            out.extend(flatten_tensors(dict(x), seen))
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
    leaves, spec = pytree.tree_flatten(_as_tree(value))
    split = [
        torch.tensor_split(x, num_microbatches, dim=0)
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch_size
        else None
        for x in leaves
    ]
    return [
        pytree.tree_unflatten([x if s is None else s[j] for x, s in zip(leaves, split)], spec)
        for j in range(num_microbatches)
    ]


def merge_microbatches(values: list[Any], sizes: Sequence[int] | None = None) -> Any:
    """Inverse of :func:`split_microbatches` for outputs: tensors with a batch
    dimension are concatenated along it; other values are taken from the
    first micro-batch, as are tensors equal in all of them (a value given
    to every micro-batch). One micro-batch's outputs come back as they are.
    Differing 0-d tensors (each a value of its whole micro-batch, a reduction)
    are refused: the unsplit batch's value cannot be put together from them;
    so are differing tensors whose first dimension is not each micro-batch's
    size (``sizes``, when given: a batch-wise reduction, a sequence-first
    value), which concatenating would put together wrongly."""
    if len(values) == 1:
        return values[0]
    flat = [pytree.tree_flatten(_as_tree(v)) for v in values]
    spec = flat[0][1]

    def merge(parts: list[Any]) -> Any:
        first = parts[0]
        if not isinstance(first, torch.Tensor):
            return first
        if first.dim() == 0:
            if all(torch.equal(p, first) for p in parts[1:]):
                return first  # the same in every micro-batch: a value given to all
            raise ValueError(
                f"the last pipeline layer returned a 0-dim tensor (one value for a whole "
                f"micro-batch, no batch dimension); from {len(parts)} micro-batches the value "
                "of the unsplit batch cannot be put together. Return per-sample values (the "
                "batch dimension first) and reduce them outside the layer stack, or use "
                "num_microbatches=1"
            )
        if sizes is not None and any(p.shape[0] != n for p, n in zip(parts, sizes, strict=True)):
            if all(p.shape == first.shape and torch.equal(p, first) for p in parts[1:]):
                return first  # the same in every micro-batch: a value given to all
            raise ValueError(
                f"the last pipeline layer returned a tensor of shape {tuple(first.shape)} for a "
                f"micro-batch of {sizes[0]} samples: its first dimension is not the batch, so "
                f"the outputs of {len(parts)} micro-batches cannot be put together into the "
                "unsplit batch's. Return batch-first values (per-sample, the batch dimension "
                "first: transpose sequence-first outputs, reduce over the batch outside the "
                "layer stack), or use num_microbatches=1"
            )
        return torch.cat(parts, dim=0)

    return pytree.tree_unflatten([merge(list(p)) for p in zip(*(f[0] for f in flat))], spec)


def call_layer(layer: Callable[..., Any], value: Any) -> Any:
    """Call ``layer`` with ``value``: a tuple is spread as positional arguments,
    a dict as keyword arguments, anything else is the single argument."""
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return layer(*value)
    if isinstance(value, dict):
        return layer(**value)
    return layer(value)

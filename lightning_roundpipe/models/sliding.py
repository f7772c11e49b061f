"""Sliding-window attention over query tiles, without a sequence x sequence mask.

A decoder layer with sliding-window attention lets each position see the
``window`` positions up to itself. Transformers builds that as a dense
boolean mask of ``sequence x sequence`` entries per micro-batch (16 GiB at
128K tokens, more once SDPA turns it into an additive bias), and a masked
call cannot use the flash kernel. Positions further apart than the window
never meet, so the attention can run over tiles of queries instead: each
tile calls :func:`~torch.nn.functional.scaled_dot_product_attention` with
the keys from ``window - 1`` positions before it, under a mask of
``tile x (tile + window - 1)`` entries. The result is the same attention;
memory grows with the sequence times the window, not its square.

:class:`SlidingWindow` is a :class:`~torch.overrides.TorchFunctionMode`
(thread-local: only the calling worker's layer is affected) that a decoder
layer enters around its block when the adapter gave the block no mask (see
``_Decoder``): every SDPA call inside then runs tiled. It is used only
where the model's attention goes through SDPA (``attn_implementation
"sdpa"``), without padding, packed sequences or attention dropout; any
other case keeps the model's own mask.

A masked call with grouped-query attention (``enable_gqa``) would fall back
to the math kernel, which materialises the scores; the tiles' keys and
values are expanded to the query heads instead (each tile's own, about
``(tile + window) / tile`` times the keys and values of the tile's
positions), so that the memory-efficient kernel runs them. A first tile no
longer than the window needs no mask and runs as a causal call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from ..runtime.scope import stage_cached

__all__ = [
    "PROBE_TILE",
    "PROBE_WINDOW",
    "SlidingWindow",
    "mask_bytes",
    "probing",
    "scaled",
    "sliding_tile",
    "sliding_window_attention",
]

#: the window and tile the activation probes run sliding-window layers with
#: (their sequences, 16 to 48 tokens, are shorter than any real window):
#: every probe length is then four tiles or more, each tile's keys 1.5
#: times its queries, as at long sequences under :func:`sliding_tile`
PROBE_WINDOW, PROBE_TILE = 3, 4

_PROBING: ContextVar[bool] = ContextVar("roundpipe_sliding_probing", default=False)


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """While active (the activation probes, :mod:`.memory`), sliding-window
    layers attend over :data:`PROBE_WINDOW` positions in tiles of
    :data:`PROBE_TILE`, whatever their own window: the probes' short
    sequences then run the tiled attention that long ones run."""
    token = _PROBING.set(True)
    try:
        yield
    finally:
        _PROBING.reset(token)


def scaled(window: int) -> tuple[int, int | None]:
    """The window and tile a layer of ``window`` attends with now: its own
    (tile: :func:`sliding_tile`), or while :func:`probing`, the probes'."""
    if _PROBING.get():
        return PROBE_WINDOW, PROBE_TILE
    return window, None


def sliding_tile(window: int) -> int:
    """Queries per call for a window: twice the window (each tile's keys are
    then about 1.5 times its queries; real windows are hundreds of positions
    or more, so the calls are never small)."""
    return 2 * window


def mask_bytes(window: int, element: int, seq: int) -> int:
    """Bytes of the additive masks the tiles of a layer of ``window`` take
    views of at ``seq`` tokens (:func:`_biases`; ``element`` bytes each):
    kept for the backward, once per stage whatever its sliding-window
    layers."""
    tile = sliding_tile(window)
    rows = min(tile, seq)
    later = tile * _padded(tile + window - 1) if seq > tile else 0
    return (rows * _padded(rows) + later) * element


def _padded(n: int) -> int:
    """``n`` rounded up to a multiple of 16: a bias whose rows are that far
    apart is aligned for the memory-efficient kernel, which otherwise pads
    (copies) it at every call."""
    return -(-n // 16) * 16


def _biases(
    window: int, tile: int, seq: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The additive masks (0 where a query sees a key, -inf elsewhere) every
    tile's call takes a view of, so that the calls (and their backwards,
    which keep them) share one copy: the first tile's (queries and keys
    from position 0: ``0 <= q - k < window``) and, when ``seq`` has more
    than one tile, every later tile's (its queries, the keys from
    ``window - 1`` before them: query ``i`` sees keys ``i`` to
    ``i + window - 1``). Their rows are :func:`_padded` apart."""

    def bias(rows: int, keys: int, shift: int) -> torch.Tensor:
        # query i sees keys i + shift - window + 1 to i + shift; one boolean
        # temporary at a time
        out = torch.zeros(rows, _padded(keys), dtype=dtype, device=device)
        for cut in (lambda t: t.triu_(shift + 1), lambda t: t.tril_(shift - window)):
            out.masked_fill_(cut(torch.ones_like(out, dtype=torch.bool)), float("-inf"))
        return out

    rows = min(tile, seq)
    first = bias(rows, rows, 0)
    later = bias(tile, tile + window - 1, window - 1) if seq > tile else None
    return first, later


def sliding_window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window: int,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
    tile: int | None = None,
) -> torch.Tensor:
    """Causal attention in which position ``q`` sees keys ``q - window + 1``
    to ``q`` (transformers' ``sliding_window_causal_mask_function``), over
    query tiles of ``tile`` positions (default :func:`sliding_tile`; at
    least ``window - 1``).

    ``query`` is ``(..., heads, sequence, head_dim)``, ``key`` and ``value``
    ``(..., kv_heads, sequence, head_dim)`` with ``heads`` a multiple of
    ``kv_heads`` when ``enable_gqa`` (as for SDPA). The tiles are
    :func:`torch.split` chunks, and a tile's keys its own chunk after the
    last ``window - 1`` of the one before: the backward then handles every
    chunk at once, where slicing each tile out of the whole would make the
    backward allocate a sequence-sized gradient per tile. The masks are
    views of two shared ones (:func:`_biases`; within a stage, one pair for
    all its layers, :func:`~..runtime.scope.stage_cached`)."""
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    seq = query.shape[-2]
    if key.shape[-2] != seq or value.shape[-2] != seq:
        raise ValueError(
            f"sliding-window attention over tiles needs as many keys as queries (no cache), "
            f"got {seq} queries and {key.shape[-2]} keys"
        )
    if seq <= window:  # no position is out of another's window: causal attention
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
    size = tile if tile is not None else sliding_tile(window)
    if size < max(1, window - 1):
        raise ValueError(f"tile must be >= max(1, window - 1) = {max(1, window - 1)}, got {size}")
    groups = query.shape[-3] // key.shape[-3]
    first, later = stage_cached(
        ("sliding bias", window, size, min(seq, size + 1), query.dtype, query.device),
        lambda: _biases(window, size, seq, query.dtype, query.device),
    )
    back = window - 1  # keys a later tile takes from the chunk before
    out = []
    chunks = zip(query.split(size, -2), key.split(size, -2), value.split(size, -2), strict=True)
    before: tuple[torch.Tensor, torch.Tensor] | None = None
    for q, k, v in chunks:
        rows = q.shape[-2]
        if before is None:  # the first tile: keys from position 0
            before = (k, v)
            if rows <= window:  # every query sees every earlier key: causal
                out.append(
                    F.scaled_dot_product_attention(
                        q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
                    )
                )
                continue
            bias = first[:rows, :rows]
        else:
            (pk, pv), before = before, (k, v)
            if back:
                k = torch.cat([pk[..., size - back :, :], k], dim=-2)
                v = torch.cat([pv[..., size - back :, :], v], dim=-2)
            assert later is not None  # (built when the sequence has more than one tile)
            bias = later[:rows, : rows + back]
        if groups > 1:  # (a masked GQA call would run the math kernel)
            k = k.repeat_interleave(groups, dim=-3)
            v = v.repeat_interleave(groups, dim=-3)
        out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale))
    return torch.cat(out, dim=-2)


class SlidingWindow(TorchFunctionMode):
    """While active, every :func:`~torch.nn.functional.scaled_dot_product_attention`
    call is sliding-window attention over query tiles
    (:func:`sliding_window_attention`). A decoder layer enters it around a
    block whose mask it left out; a call that still brings a mask, or
    attention dropout, is refused (the window would be lost)."""

    def __init__(self, window: int, tile: int | None = None) -> None:
        super().__init__()
        self.window = window
        self.tile = tile

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        call = dict(zip(names, args, strict=False)) | kwargs
        if call.get("attn_mask") is not None or call.get("dropout_p", 0.0):
            raise RuntimeError(
                "a sliding-window layer's attention was called with a mask or attention "
                "dropout after RoundPipe left its mask out; please report the model type"
            )
        return sliding_window_attention(
            call["query"],
            call["key"],
            call["value"],
            self.window,
            scale=call.get("scale"),
            enable_gqa=bool(call.get("enable_gqa", False)),
            tile=self.tile,
        )

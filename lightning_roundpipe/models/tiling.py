"""Sequence tiling for long contexts: the LM loss over chunks of tokens, and
per-token layers (a decoder block's MLP) over sequence tiles.

At long sequences two transient values dominate a stage's device memory: the
head's full-vocabulary logits (and their fp32 copy and gradient: ``tokens x
vocab`` several times over) and a block's MLP intermediates (``tokens x
intermediate_size``). Both are per-token work, so they can run a tile of tokens
at a time with the same result:

* :class:`ChunkedLogits` stands in for the logits when the loss is computed
  inside the pipeline. :meth:`ChunkedLogits.loss` computes the next-token
  cross-entropy chunk by chunk; while training, each chunk's backward runs at
  once (the loss of a fused stage is always differentiated right after), so
  only the hidden-state gradient and the head's weight gradients are kept, not
  the logits. In fp16 (whose gradients need the loss scale, known only in
  backward) the chunks' logits are recomputed in backward instead.
* :func:`tiled` runs a per-token module (an MLP, a norm) over sequence tiles
  under ``no_grad`` and, in backward, recomputes one tile at a time with its
  gradient, so a tile's intermediates are all that ever exist (for a norm:
  its input is kept instead of its fp32 copy).

Torch has no sequence-tiled autograd primitive (``torch.utils.checkpoint``
recomputes a whole call at once), hence these two small autograd functions.
Dropout (a module, or a dropout rate a module gives ``F.dropout``) is never
tiled while it draws (:func:`draws_random`), so a tiled run keeps the untiled
run's dropout masks. Other random numbers drawn
inside a tile (the router jitter of Mixtral's and PhiMoE's expert blocks) are
recorded in forward and handed back to the tile's recompute in backward
(:class:`_RandomTape`), so the gradient is that of the forward that ran.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime.device import draws_random

__all__ = ["ChunkedLogits", "draws_random", "shifted", "tiled", "trainable", "watching_tiles"]

# who is told when a tile's backward starts and ends, per thread (the
# planner's memory probes: :mod:`.memory`)
_watch = threading.local()


@contextlib.contextmanager
def watching_tiles(observer: Any) -> Iterator[None]:
    """While inside, ``observer.tile(True)`` is called when this thread starts
    the backward of one tile of :func:`tiled` and ``observer.tile(False)``
    when it ends it (what a tile works with is sized by the tile, the rest by
    the sequence: :func:`~.memory.probe_activations` tells them apart)."""
    before = getattr(_watch, "observer", None)
    _watch.observer = observer
    try:
        yield
    finally:
        _watch.observer = before


def _bytes_only() -> bool:
    """Whether this thread's observer counts bytes only (the probes, whose
    backward differentiates the input alone): the parameters' gradients are
    then allocated as they would be, with values nobody reads (a
    Mixtral-8x7B block's tiled backward spent most of its probe time
    zeroing and adding its experts' gradients, 1.4B values each)."""
    return bool(getattr(getattr(_watch, "observer", None), "bytes_only", False))


@contextlib.contextmanager
def _one_tile() -> Iterator[None]:
    observer = getattr(_watch, "observer", None)
    if observer is None:
        yield
        return
    observer.tile(True)
    try:
        yield
    finally:
        observer.tile(False)


def trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def shifted(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Next-token targets, as Hugging Face's causal LM loss builds them."""
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


class ChunkedLogits:
    """The logits of ``hidden`` under ``project``, never materialised whole:
    what a head returns in their place when the loss is computed in chunks of
    ``chunk`` tokens (:meth:`loss`)."""

    def __init__(
        self,
        hidden: torch.Tensor,
        project: Callable[[torch.Tensor], torch.Tensor],
        params: Sequence[nn.Parameter],
        chunk: int,
    ) -> None:
        self.hidden = hidden
        self.project = project
        self.params = list(params)
        self.chunk = chunk

    def loss(self, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the labelled tokens (``-100``
        ignored; 0 when there is none), equal to computing it from the full
        logits."""
        target = shifted(labels).reshape(-1).to(self.hidden.device)
        count = (target != -100).sum().clamp(min=1)  # on the device: no sync
        return _ChunkedLoss.apply(
            self.hidden, target, count, self.project, self.chunk, *self.params
        )


def _loss_chunks(
    flat: torch.Tensor,
    target: torch.Tensor,
    count: torch.Tensor,
    project: Callable[[torch.Tensor], torch.Tensor],
    chunk: int,
    params: Sequence[torch.Tensor],
    want: Sequence[bool],
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
    """The loss over ``flat`` chunk by chunk and, where ``want`` asks (hidden
    first, then each parameter), its gradients times ``scale`` (None: the
    loss only). Parameter gradients are summed in fp32 across chunks."""
    want_h, want_p = want[0], list(want[1:])
    grad = any(want)
    total = torch.zeros((), dtype=torch.float32, device=flat.device)
    gh = torch.empty_like(flat) if want_h else None
    gp: list[torch.Tensor | None] = [
        torch.zeros_like(p, dtype=torch.float32) if w else None
        for p, w in zip(params, want_p, strict=True)
    ]
    chosen = [p for p, w in zip(params, want_p, strict=True) if w]
    for start in range(0, flat.shape[0], chunk):
        stop = min(start + chunk, flat.shape[0])
        with torch.set_grad_enabled(grad):
            x = flat[start:stop].detach().requires_grad_(want_h)
            logits = project(x)
            part = (
                nn.functional.cross_entropy(
                    logits.float(), target[start:stop], ignore_index=-100, reduction="sum"
                )
                / count
            )
            if grad:
                goal = part if scale is None else part * scale
                found = torch.autograd.grad(goal, ([x] if want_h else []) + chosen)
        total = total + part.detach()
        if not grad:
            continue
        found = list(found)
        if want_h:
            gh[start:stop] = found.pop(0)
        for i, w in enumerate(want_p):
            if w:
                gp[i].add_(found.pop(0))
    return total, gh, gp


class _ChunkedLoss(torch.autograd.Function):
    """The loss of :meth:`ChunkedLogits.loss`. Forward differentiates each chunk
    at once for a unit output gradient; backward scales those gradients (or, in
    fp16, recomputes each chunk with the real output gradient, loss scale
    included, so small gradients do not underflow)."""

    @staticmethod
    def forward(ctx, hidden, target, count, project, chunk, *params):
        want = [ctx.needs_input_grad[0], *ctx.needs_input_grad[5:]]
        ctx.shape, ctx.project, ctx.chunk = hidden.shape, project, chunk
        ctx.dtypes = [p.dtype for p in params]
        flat = hidden.reshape(-1, hidden.shape[-1])
        ctx.eager = any(want) and hidden.dtype != torch.float16
        if ctx.eager:
            loss, gh, gp = _loss_chunks(flat, target, count, project, chunk, params, want, None)
            ctx.grads = (gh, gp)
        else:
            loss, _, _ = _loss_chunks(
                flat, target, count, project, chunk, params, [False] * len(want), None
            )
            ctx.save_for_backward(hidden, target, count, *params)
        return loss

    @staticmethod
    def backward(ctx, g):
        want = [ctx.needs_input_grad[0], *ctx.needs_input_grad[5:]]
        if ctx.eager:
            gh, gp = ctx.grads
            ctx.grads = None
            gh = None if gh is None else (gh * g).reshape(ctx.shape)
            gp = [None if v is None else v * g for v in gp]
        else:
            hidden, target, count, *params = ctx.saved_tensors
            flat = hidden.reshape(-1, hidden.shape[-1])
            _, gh, gp = _loss_chunks(flat, target, count, ctx.project, ctx.chunk, params, want, g)
            gh = None if gh is None else gh.reshape(ctx.shape)
        params_out = [None if v is None else v.to(d) for v, d in zip(gp, ctx.dtypes, strict=True)]
        return (gh, None, None, None, None, *params_out)


def tiled(
    fn: Callable[..., torch.Tensor],
    params: Sequence[nn.Parameter],
    x: torch.Tensor | Sequence[torch.Tensor],
    tile: int,
    dim: int = 1,
) -> torch.Tensor:
    """``fn(x)`` for a function that acts on each position of ``x`` alone (a
    decoder block's MLP, whose trainable parameters are ``params``), computed
    ``tile`` positions along ``dim`` at a time: forward keeps only ``x`` and
    the output; backward recomputes each tile with its gradient. ``x`` may be
    several tensors with the same positions along ``dim`` (``fn`` then takes
    one tile of each). ``fn`` must return a tensor and draw no random numbers
    (:func:`draws_random`)."""
    xs = (x,) if isinstance(x, torch.Tensor) else tuple(x)
    # random draws are recorded only where a backward may recompute the tiles
    return _Tiled.apply(fn, tile, dim, len(xs), torch.is_grad_enabled(), *xs, *params)


class _RandomTape(TorchDispatchMode):
    """Inside it, random ops (``nondeterministic_seeded``) are recorded in
    order with copies of what they return and of the arguments they write
    (``recording``), or are not run and hand back what a recording holds
    (replay). What a tile of :func:`tiled` draws in forward is so drawn again
    by its recompute in backward, from whichever generator the forward drew
    them (the worker's seeded one), at the memory of the values drawn.
    Torch's checkpoint instead restores the default generators' states,
    which the workers' seeded draws do not use."""

    supports_higher_order_operators = True  # (passed through: only aten ops draw)

    def __init__(self, recording: list[tuple[Any, ...]] | None = None) -> None:
        super().__init__()
        self.replay = recording is not None
        self.tape: list[tuple[Any, ...]] = list(recording) if recording is not None else []
        self.used = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
            return func(*args, **kwargs)
        written = _written(func, args, kwargs)
        if not self.replay:
            out = func(*args, **kwargs)
            aliased = bool(written) and _aliases_first(func)  # (then kept once)
            kept = None if aliased else _copied(out)
            self.tape.append((func, kept, [_copied(w) for w in written]))
            return out
        if self.used == len(self.tape) or self.tape[self.used][0] != func:
            raise RuntimeError(
                f"a tiled module's recompute drew other random numbers than its forward "
                f"({func}); its random draws must not depend on the values it computes"
            )
        _, out, values = self.tape[self.used]
        self.used += 1
        for target, value in zip(written, values, strict=True):
            target.copy_(value)
        if written and _aliases_first(func):
            return written[0]
        return _copied(out)


def _written(func: Any, args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensor arguments an aten op writes (``self`` of ``uniform_``, the
    ``out=`` of ``bernoulli.out``, the ``noise`` of ``rrelu_with_noise``)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        if isinstance(value, torch.Tensor):
            out.append(value)
    return out


def _aliases_first(func: Any) -> bool:
    """Whether the op returns (an alias of) the first argument it writes."""
    returns = func._schema.returns
    return len(returns) == 1 and returns[0].alias_info is not None


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copied(v) for v in value)
    return value


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tile, dim, n, record, *tensors):
        ctx.fn, ctx.tile, ctx.dim, ctx.n = fn, tile, dim, n
        ctx.dtypes = [p.dtype for p in tensors[n:]]
        ctx.save_for_backward(*tensors)
        pieces = zip(*(x.split(tile, dim) for x in tensors[:n]), strict=True)
        outs, ctx.draws = [], []
        for piece in pieces:
            with _RandomTape() if record else contextlib.nullcontext() as tape:
                outs.append(fn(*(p.contiguous() for p in piece)))
            ctx.draws.append(tape.tape if tape is not None and tape.tape else None)
        return torch.cat(outs, dim)

    @staticmethod
    def backward(ctx, g):
        n = ctx.n
        saved = ctx.saved_tensors
        xs, params = saved[:n], saved[n:]
        want_x, want_p = ctx.needs_input_grad[5 : 5 + n], ctx.needs_input_grad[5 + n :]
        chosen = [p for p, w in zip(params, want_p, strict=True) if w]
        gx = [torch.empty_like(x) if w else None for x, w in zip(xs, want_x, strict=True)]
        unread = _bytes_only()
        zeros = torch.empty_like if unread else torch.zeros_like
        gp = [
            zeros(p, dtype=torch.float32) if w else None
            for p, w in zip(params, want_p, strict=True)
        ]
        start = 0
        draws = ctx.draws  # (kept: a retained graph may be differentiated again)
        for *pieces, gpiece, drawn in zip(
            *(x.split(ctx.tile, ctx.dim) for x in xs),
            g.split(ctx.tile, ctx.dim),
            draws,
            strict=True,
        ):
            with _one_tile():
                with torch.enable_grad():
                    ins = [
                        p.detach().contiguous().requires_grad_(w)
                        for p, w in zip(pieces, want_x, strict=True)
                    ]
                    if drawn is None:
                        out = ctx.fn(*ins)
                    else:
                        with _RandomTape(drawn) as replay:
                            out = ctx.fn(*ins)
                        if replay.used != len(drawn):
                            raise RuntimeError(
                                "a tiled module's recompute drew other random numbers than its "
                                "forward (fewer); its random draws must not depend on the values "
                                "it computes"
                            )
                    wanted = [i for i, w in zip(ins, want_x, strict=True) if w] + chosen
                    found = list(torch.autograd.grad(out, wanted, gpiece))
                del ins, out
                size = pieces[0].shape[ctx.dim]
                for v in gx:
                    if v is not None:
                        v.narrow(ctx.dim, start, size).copy_(found.pop(0))
                for v in gp:
                    if v is not None:
                        added = found.pop(0)
                        if not unread:
                            v.add_(added)
                        del added
            start += size
        params_out = [
            None
            if v is None
            else torch.empty_like(v, dtype=d)
            if unread and v.dtype != d
            else v.to(d)
            for v, d in zip(gp, ctx.dtypes, strict=True)
        ]
        return (None, None, None, None, None, *gx, *params_out)

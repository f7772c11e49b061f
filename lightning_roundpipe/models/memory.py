"""Activation memory of a causal LM's pipeline layers, predicted before the
first step from short probes.

What a layer saves for its backward depends on details no config states (an
RMSNorm that keeps an fp32 copy, key/value heads repeated for attention,
which attention kernel runs, a frozen weight whose input is not kept), so it
is measured rather than derived: each distinct layer (the embedding, one
decoder block per structure, the head) runs its forward once at three short
sequence lengths, in the compute dtype and with the call's tiling, padding,
packing and router settings, while :func:`~..runtime.profiler.saved_bytes`
counts the bytes autograd keeps. Saved bytes of a layer are a polynomial of
degree at most two in the sequence length (linear for flash and
memory-efficient attention, quadratic where scores or a mask are kept), so
three lengths give it exactly; a micro-batch of ``b`` sequences saves ``b``
times as much, but for what its sequences share (rotary tables of shared
positions), measured by a fourth probe of two sequences. A tensor counts
only while the layer's graph keeps it (:func:`~..runtime.profiler.saved_bytes`).

On top of what a stage keeps for its backward, one layer at a time works with
transient values: a tile of MLP intermediates and their gradients (or the
whole MLP's, untiled), the attention's input gradients (on CUDA with the
flash kernel's workspace, which tiled blocks split over head groups:
:mod:`.attention`), one loss chunk's logits, the gradients of the stage's
output and input (the input is counted once, with what its first layer keeps:
the adapter's layers keep it intact, so the stage holds no copy; the output
itself is freed before the backward unless router statistics come with it).
:class:`ActivationModel` adds the largest of those (no two layers' transients
exist at once) to a stage's weights, gradients and saved activations.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..runtime.profiler import saved_bytes
from .attention import backward_workspace

__all__ = ["ActivationModel", "applied_tiles", "probe_activations", "value_bytes"]

#: sequence lengths of the probes (short: a probe of an 8B model's block costs
#: about a second on two CPU cores)
PROBE_LENGTHS = (16, 32, 48)


def _quadratic(xs: Sequence[int], ys: Sequence[float]) -> tuple[float, float, float]:
    """The polynomial ``c0 + c1 x + c2 x^2`` through three points (Lagrange)."""
    (x0, x1, x2), (y0, y1, y2) = xs, ys
    d0, d1, d2 = (x0 - x1) * (x0 - x2), (x1 - x0) * (x1 - x2), (x2 - x0) * (x2 - x1)
    c2 = y0 / d0 + y1 / d1 + y2 / d2
    c1 = -(y0 * (x1 + x2) / d0 + y1 * (x0 + x2) / d1 + y2 * (x0 + x1) / d2)
    c0 = y0 * x1 * x2 / d0 + y1 * x0 * x2 / d1 + y2 * x0 * x1 / d2
    return c0, c1, max(0.0, c2)


@dataclass(frozen=True)
class ActivationModel:
    """Device memory a causal LM's pipeline layers need for one micro-batch
    beyond their weights and gradients.

    Attributes:
        saved: per layer, ``(c0, c1, c2)``: bytes one sequence of ``s`` tokens
            keeps for the backward, ``c0 + c1 s + c2 s^2``.
        hidden: the hidden size; ``element``: bytes of one element in the
            compute dtype.
        mlp_width: elements of MLP intermediates and their gradients per token
            (twice the MLP's active parameters over the hidden size; 0: no MLP
            known).
        mlp_tile: tokens per MLP tile (None: never tiled).
        vocab: the vocabulary; ``loss_chunk``: tokens per loss chunk (None:
            the loss sees whole logits; their share is in ``saved``).
        head_params: trainable parameters of the head (their fp32 gradients
            exist during a chunked loss).
        shared: per layer, bytes per position kept once per micro-batch
            whatever its number of sequences (rotary tables of positions
            shared by the batch); ``saved`` holds the rest.
        attention: the decoder blocks' query heads, key/value heads and
            head size (None: not known), for the workspace of a CUDA
            flash-attention backward (:func:`~.attention.backward_workspace`).
        keeps_output: whether a backward stage's output stays on the device
            through its backward (with router statistics: several outputs);
            else it is freed first (:func:`~..runtime.worker.release_output`).
    """

    saved: tuple[tuple[float, float, float], ...]
    hidden: int
    element: int
    mlp_width: float
    mlp_tile: int | None
    vocab: int
    loss_chunk: int | None
    head_params: int
    shared: tuple[float, ...]
    attention: tuple[int, int, int] | None
    keeps_output: bool

    def saved_bytes(self, seq: int, micro_batch: int = 1) -> list[float]:
        """Bytes each layer keeps for its backward for a micro-batch of
        ``micro_batch`` sequences of ``seq`` tokens."""
        return [
            micro_batch * (c0 + c1 * seq + c2 * seq * seq) + once * seq
            for (c0, c1, c2), once in zip(self.saved, self.shared, strict=True)
        ]

    def transient_bytes(self, seq: int, micro_batch: int = 1, *, cuda: bool = False) -> list[float]:
        """Bytes each layer works with on top of what is saved while it runs
        (forward, recompute or backward): the largest of its MLP intermediates
        with their gradients (one tile's when tiled), its attention's input
        gradients with their score working set (where scores are kept: the
        quadratic part of ``saved``), a loss chunk's logits; plus the
        gradients of the stage's output and input, and the output itself if
        it is kept through the backward (the input is the first layer's, in
        ``saved``: the adapter's layers keep it intact, so the stage holds
        no copy of it). ``cuda``: the layers run on CUDA, whose
        flash-attention backward adds a workspace (one head group's in tiled
        blocks, :mod:`.attention`; the CPU kernel has none; with a mask,
        another kernel runs, whose workspace is taken to be the same)."""
        tokens = seq * micro_batch
        tiled = self.mlp_tile is not None and tokens > self.mlp_tile
        workspace = 0.0
        if cuda and self.attention is not None:
            heads, kv_heads, head_dim = self.attention
            workspace = float(
                backward_workspace(tokens, heads, kv_heads, head_dim, self.element, split=tiled)
            )
        boundary = (2 + self.keeps_output) * tokens * self.hidden * self.element
        out = []
        last = len(self.saved) - 1
        for i, (_, _, c2) in enumerate(self.saved):
            if i == last:
                if self.loss_chunk is not None and tokens > self.loss_chunk:
                    # one chunk's logits (compute dtype, fp32, softmax, gradient)
                    # and the head's fp32 gradients summed over chunks
                    work = min(tokens, self.loss_chunk) * self.vocab * (2 * self.element + 12)
                    work += 4 * self.head_params
                else:  # the gradients of the (saved) logits and their fp32 copy
                    work = tokens * self.vocab * (self.element + 4)
            elif i == 0:
                work = 0.0
            else:
                if tiled:  # a tile's recomputed intermediates and their gradients
                    mlp = self.mlp_tile * self.mlp_width * self.element
                else:  # the gradients of the (saved) intermediates
                    mlp = tokens * self.mlp_width * self.element / 2
                attention = 4 * tokens * self.hidden * self.element + micro_batch * c2 * seq * seq
                attention += workspace
                work = max(mlp, attention)
            out.append(work + boundary)
        return out

    def stage_peak(
        self, start: int, stop: int, seq: int, micro_batch: int = 1, *, cuda: bool = False
    ) -> float:
        """Activation bytes of a backward (or fused) stage over layers
        ``[start, stop)`` at its peak: everything its layers save, plus the
        largest transient."""
        saved = self.saved_bytes(seq, micro_batch)[start:stop]
        transient = self.transient_bytes(seq, micro_batch, cuda=cuda)[start:stop]
        return sum(saved) + max(transient, default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "saved": [list(c) for c in self.saved],
            "hidden": self.hidden,
            "element": self.element,
            "mlp_width": self.mlp_width,
            "mlp_tile": self.mlp_tile,
            "vocab": self.vocab,
            "loss_chunk": self.loss_chunk,
            "head_params": self.head_params,
            "shared": list(self.shared),
            "attention": None if self.attention is None else list(self.attention),
            "keeps_output": self.keeps_output,
        }


def value_bytes(tokens: int, hidden: int, element: int) -> int:
    """Bytes of one layer input of a causal LM for ``tokens`` tokens: the
    hidden states (``element`` bytes each) and the positions (int64)."""
    return tokens * (hidden * element + 8)


def applied_tiles(tiles: dict[str, int], tokens: int) -> dict[str, int]:
    """The tile sizes that take effect for a micro-batch of ``tokens`` tokens:
    the layers tile only what is longer than a tile."""
    return {k: v for k, v in tiles.items() if tokens > v}


def _signature(layer: nn.Module) -> tuple:
    """Layers with the same structure save the same bytes: probe one of each."""
    params = tuple(
        (n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters()
    )
    return (type(layer).__name__, getattr(layer, "kind", None), params)


def _probe_inputs(
    embed: nn.Module,
    dtype: torch.dtype,
    seq: int,
    vocab: int,
    mask: bool,
    packed: bool,
    router: bool,
    batch: int = 1,
) -> dict[str, Any]:
    """The first block's input for ``batch`` sequences of ``seq`` tokens, from
    the model's own embedding (not copied: it keeps no activations worth probing)."""
    ids = torch.arange(seq).remainder(vocab).reshape(1, seq).expand(batch, seq)
    kwargs: dict[str, Any] = {"input_ids": ids}
    if router:
        kwargs["router"] = True
    if mask:  # one padded position: the padded attention path
        m = torch.ones(batch, seq, dtype=torch.long)
        m[:, 0] = 0
        kwargs["attention_mask"] = m
    if packed:  # two sequences in the row
        half = seq // 2
        kwargs["position_ids"] = torch.cat([torch.arange(half), torch.arange(seq - half)])[None]
        kwargs["packed"] = True
    with torch.no_grad():
        out = embed(**kwargs)
    return {
        k: v.to(dtype)
        if torch.is_tensor(v) and v.is_floating_point() and k == "hidden_states"
        else v
        for k, v in out.items()
    }


def probe_activations(
    layers: Sequence[nn.Module],
    dtype: torch.dtype,
    *,
    hidden: int,
    vocab: int,
    mlp_width: float,
    tiles: dict[str, int],
    loss: Any = None,
    mask: bool = False,
    packed: bool = False,
    router: bool = False,
    lengths: Sequence[int] = PROBE_LENGTHS,
    prepare: Callable[[nn.Module], nn.Module] | None = None,
    attention: tuple[int, int, int] | None = None,
) -> ActivationModel:
    """Measure what each of a causal LM adapter's ``layers`` (embedding,
    blocks, head) saves for its backward at three short ``lengths``, on
    copies in ``dtype`` on the CPU, with the call's settings (``tiles`` as
    the adapter chose them for the real call, a padding ``mask``, ``packed``
    sequences, ``router`` statistics, the ``loss`` computed inside the head's
    stage); see :class:`ActivationModel`, whose ``attention`` heads are
    given. ``prepare``: how to get a runnable CPU copy of a layer (default a
    copy in ``dtype``; for a model on the meta device, one with random values)."""
    copies: dict[tuple, nn.Module] = {}

    def runnable(layer: nn.Module) -> nn.Module:
        key = _signature(layer)
        if key not in copies:
            if prepare is not None:
                copies[key] = prepare(layer)
            else:
                copies[key] = copy.deepcopy(layer).to(device="cpu", dtype=dtype)
        return copies[key]

    # the embedding keeps its indices only: the model's own unless it must be
    # materialised (``prepare``)
    embed = layers[0] if prepare is None else runnable(layers[0])
    mlp_tile, loss_chunk = tiles.get("mlp_tile"), tiles.get("loss_chunk")
    head = layers[-1]
    measured: dict[tuple, list[Any]] = {}
    per_layer: list[list[float]] = [[] for _ in layers]
    paired: list[float] = [0.0 for _ in layers]  # two sequences at the last length
    last = lengths[-1]
    for seq, batch in [*((n, 1) for n in lengths), (last, 2)]:
        # tile at the probe exactly when the real call tiles
        probe_tiles = {}
        if mlp_tile:
            probe_tiles["mlp_tile"] = max(1, batch * seq // 4)
        x = _probe_inputs(embed, dtype, seq, vocab, mask, packed, router, batch)
        for i, layer in enumerate(layers):
            rep = runnable(layer)
            key = (_signature(layer), seq, batch)
            if i == 0:  # (the model's own embedding: it keeps its indices only)
                got = batch * _embedding_bytes(embed, seq)
            elif layer is head and loss_chunk:
                # a chunked loss keeps the head's input and, until backward,
                # its gradient (and no logits): counted below, exactly
                got = 0.0
            else:
                if key not in measured:
                    inputs = dict(x, **probe_tiles)
                    inputs["hidden_states"] = inputs["hidden_states"].detach().requires_grad_()
                    counted: dict[int, int] = {}
                    with torch.enable_grad(), saved_bytes(rep, counted, 0):
                        out = rep(**inputs)
                        if layer is head and loss is not None:
                            labels = torch.zeros(batch, seq, dtype=torch.long)
                            loss(out, labels)
                    measured[key] = [float(counted[0]), None if layer is head else out]
                got, nxt = measured[key]
                if nxt is not None:
                    x = {k: (v.detach() if torch.is_tensor(v) else v) for k, v in nxt.items()}
            if batch == 1:
                per_layer[i].append(got)
            else:
                paired[i] = got
    element = torch.empty(0, dtype=dtype).element_size()
    saved = [_quadratic(lengths, ys) for ys in per_layer]
    # what two sequences keep less than twice one's: kept once per micro-batch
    shared = [max(0.0, 2 * ys[-1] - two) / last for ys, two in zip(per_layer, paired, strict=True)]
    saved = [(c0, c1 - once, c2) for (c0, c1, c2), once in zip(saved, shared, strict=True)]
    if loss_chunk:
        c0, c1, c2 = saved[-1]
        saved[-1] = (c0, c1 + 2 * hidden * element, c2)  # input and its gradient
    head_params = sum(p.numel() for p in head.parameters() if p.requires_grad)
    return ActivationModel(
        saved=tuple(saved),
        hidden=hidden,
        element=element,
        mlp_width=mlp_width,
        mlp_tile=mlp_tile,
        vocab=vocab,
        loss_chunk=loss_chunk,
        head_params=head_params,
        shared=tuple(shared),
        attention=attention,
        keeps_output=router,
    )


def _embedding_bytes(embed: nn.Module, seq: int) -> float:
    counted: dict[int, int] = {}
    ids = torch.arange(seq).reshape(1, seq)
    with torch.enable_grad(), saved_bytes(embed, counted, 0):
        embed(input_ids=ids)
    return float(counted[0])


def longest_sequence(fits: Any, low: int = 1, high: int = 1 << 24) -> int:
    """The largest ``s`` in ``[low, high]`` with ``fits(s)`` (monotone), 0 if
    none: a bisection."""
    if not fits(low):
        return 0
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low

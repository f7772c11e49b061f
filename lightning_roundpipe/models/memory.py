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
transient values. A decoder block's are measured too: at each probe length
its backward runs as a backward stage runs it (its output freed first, the
output's gradient handed to autograd, which frees it once used) while
:class:`_LiveBytes` traces the bytes of the tensors alive beyond what the
forward kept, op by op: outside the tiles of its per-token work (its input's
gradient, the attention's and the projections' gradients, an untiled MLP's
intermediates), at each tile's start and within a tile, and at the attention
kernel's backward. The same code runs the same ops at every length, so each
moment's bytes are a polynomial fitted over the three lengths, and the
prediction at a long sequence is the largest of them there (the largest at
the probes' lengths is often a weight-sized moment, which a long sequence
dwarfs). On CUDA the flash kernel's workspace is added at the attention's
backward (split over head groups in tiled blocks: :mod:`.attention`; the CPU
kernel has none). The head's loss chunk (or whole logits) and its input's
gradient are known and counted as such. :class:`ActivationModel` adds the
largest transient of a stage's layers (no two layers' exist at once) to its
weights, gradients and saved activations; the stage's input is counted once,
with what its first layer keeps (the adapter's layers keep it intact, so the
stage holds no copy), and its output is freed before the backward unless
router statistics come with it.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from ..runtime.profiler import saved_bytes
from ..runtime.worker import backward_handing_over
from . import sliding
from .attention import backward_workspace
from .layers import PER_LAYER_KEY, SHARED_KV_PREFIX
from .sliding import mask_bytes
from .tiling import watching_tiles

__all__ = ["ActivationModel", "applied_tiles", "probe_activations", "value_bytes"]

#: sequence lengths of the probes (short: a probe of an 8B model's block costs
#: about a second on two CPU cores)
PROBE_LENGTHS = (16, 32, 48)
#: tiles per probe where the call tiles (two: enough to tell a tile's work
#: from the sequence's, and each tile's ops cost the probe time)
PROBE_TILES = 2


def _quadratic(xs: Sequence[int], ys: Sequence[float]) -> tuple[float, float, float]:
    """The polynomial ``c0 + c1 x + c2 x^2`` through three points (Lagrange)."""
    (x0, x1, x2), (y0, y1, y2) = xs, ys
    d0, d1, d2 = (x0 - x1) * (x0 - x2), (x1 - x0) * (x1 - x2), (x2 - x0) * (x2 - x1)
    c2 = y0 / d0 + y1 / d1 + y2 / d2
    c1 = -(y0 * (x1 + x2) / d0 + y1 * (x0 + x2) / d1 + y2 * (x0 + x1) / d2)
    c0 = y0 * x1 * x2 / d0 + y1 * x0 * x2 / d1 + y2 * x0 * x1 / d2
    return c0, c1, max(0.0, c2)


Poly = tuple[float, float, float]


def _at(c: Poly, x: float) -> float:
    return max(0.0, c[0] + c[1] * x + c[2] * x * x)


def _most(polys: Sequence[Poly], x: float) -> float:
    return max((_at(c, x) for c in polys), default=0.0)


@dataclass(frozen=True)
class Working:
    """What a decoder block's backward works with beyond what its forward
    kept, measured by the probes (:class:`_LiveBytes`): for each moment of
    it, a polynomial ``c0 + c1 x + c2 x^2``, in ``x`` tokens of one
    sequence for the moments outside the tiles of its per-token work
    (``outside``: its input's gradient, the attention's and the
    projections' gradients, an untiled MLP's intermediates), when one of
    those tiles starts (``tile_base``) and at its attention kernel's
    backward (``attention``; None: no fused attention kernel ran, e.g. eager
    attention); in ``x`` tokens of one tile for the moments within it
    (``tile_work``). Only moments that can be the largest are kept."""

    outside: tuple[Poly, ...]
    tile_base: tuple[Poly, ...]
    tile_work: tuple[Poly, ...]
    attention: tuple[Poly, ...] | None

    def bytes(self, seq: int, micro_batch: int, tile: int, workspace: float) -> float:
        """The most at once for ``micro_batch`` sequences of ``seq`` tokens,
        ``tile`` tokens per tile, with ``workspace`` bytes more at the
        attention's backward (CUDA's flash kernel)."""
        out = micro_batch * _most(self.outside, seq)
        tiles = micro_batch * _most(self.tile_base, seq) + _most(self.tile_work, tile)
        if self.attention is None:  # (then it is not told apart: added to the rest)
            return max(out, tiles) + workspace
        attention = micro_batch * _most(self.attention, seq) + workspace
        return max(out, tiles, attention)

    def to_dict(self) -> dict[str, Any]:
        return {
            "outside": [list(c) for c in self.outside],
            "tile_base": [list(c) for c in self.tile_base],
            "tile_work": [list(c) for c in self.tile_work],
            "attention": None if self.attention is None else [list(c) for c in self.attention],
        }


@dataclass(frozen=True)
class ActivationModel:
    """Device memory a causal LM's pipeline layers need for one micro-batch
    beyond their weights and gradients.

    Attributes:
        saved: per layer, ``(c0, c1, c2)``: bytes one sequence of ``s`` tokens
            keeps for the backward, ``c0 + c1 s + c2 s^2``.
        working: per layer, what its backward works with beyond that
            (:class:`Working`; None: the embedding and the head, whose
            transients are known: none, and the loss's logits).
        hidden: the hidden size; ``element``: bytes of one element in the
            compute dtype.
        mlp_tile: tokens per MLP tile (None: never tiled).
        vocab: the head's outputs per token (the vocabulary; a classifier's
            labels); ``loss_chunk``: tokens per loss chunk (None: the loss
            sees whole logits; their share is in ``saved``).
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
        windows: per layer, the window of a sliding-window layer whose
            attention runs over query tiles (:mod:`.sliding`), else None:
            past the window the masks its tiles share
            (:func:`~.sliding.mask_bytes`, counted for each such layer,
            though a stage's layers share them) add to ``saved`` (what the
            tiles keep per token is in ``saved`` already: the probes run
            such layers tiled).
        masks: per layer, the kind of the dense ``(sequence, sequence)`` mask
            it reads and its bytes per element, or None: a stage builds one
            per kind and keeps it through its run (no probe sees it: it is
            built outside the layers). Counted in each such layer's transient
            bytes, of which a stage counts its largest: once per stage (a
            stage with layers of two kinds holds two, counted once).
    """

    saved: tuple[Poly, ...]
    working: tuple[Working | None, ...]
    hidden: int
    element: int
    mlp_tile: int | None
    vocab: int
    loss_chunk: int | None
    head_params: int
    shared: tuple[float, ...]
    attention: tuple[int, int, int] | None
    keeps_output: bool
    windows: tuple[int | None, ...] = ()
    masks: tuple[tuple[str, int] | None, ...] = ()

    def saved_bytes(self, seq: int, micro_batch: int = 1) -> list[float]:
        """Bytes each layer keeps for its backward for a micro-batch of
        ``micro_batch`` sequences of ``seq`` tokens."""
        windows = self.windows or (None,) * len(self.saved)
        return [
            micro_batch * (c0 + c1 * seq + c2 * seq * seq)
            + once * seq
            + (mask_bytes(w, self.element, seq) if w is not None and seq > w else 0)
            for (c0, c1, c2), once, w in zip(self.saved, self.shared, windows, strict=True)
        ]

    def transient_bytes(self, seq: int, micro_batch: int = 1, *, cuda: bool = False) -> list[float]:
        """Bytes each layer works with on top of what is saved while it runs
        (forward, recompute or backward): a block's as its probes measured it
        (:class:`Working`: its input's gradient, one tile's intermediates
        when tiled, the whole MLP's when not, the attention's gradients), the
        head's loss chunk (or whole logits) with their gradients; plus the
        gradient of the stage's output, and the output itself if it is kept
        through the backward (the input is the first layer's, in ``saved``:
        the adapter's layers keep it intact, so the stage holds no copy of
        it). ``cuda``: the layers run on CUDA, whose flash-attention
        backward adds a workspace at the attention (one head group's in
        tiled blocks, :mod:`.attention`; the CPU kernel has none; with a
        mask, another kernel runs, whose workspace is taken to be the same)."""
        tokens = seq * micro_batch
        tiled = self.mlp_tile is not None and tokens > self.mlp_tile
        workspace = 0.0
        if cuda and self.attention is not None:
            heads, kv_heads, head_dim = self.attention
            workspace = float(
                backward_workspace(tokens, heads, kv_heads, head_dim, self.element, split=tiled)
            )
        # (the output's gradient is in the blocks' measured work)
        boundary = self.keeps_output * tokens * self.hidden * self.element
        out = []
        last = len(self.saved) - 1
        for i, work_of in enumerate(self.working):
            if i == last:
                if self.loss_chunk is not None and tokens > self.loss_chunk:
                    # one chunk's logits (compute dtype, fp32, softmax, gradient)
                    # and the head's fp32 gradients summed over chunks
                    work = min(tokens, self.loss_chunk) * self.vocab * (2 * self.element + 12)
                    work += 4 * self.head_params
                else:  # the gradients of the (saved) logits and their fp32 copy
                    work = tokens * self.vocab * (self.element + 4)
                # and the gradient of its input
                work += tokens * self.hidden * self.element
            elif work_of is None:  # (the embedding's: its output's gradient)
                work = tokens * self.hidden * self.element
            else:  # (untiled: the MLP is one tile of every token)
                tile = self.mlp_tile if tiled else tokens
                work = work_of.bytes(seq, micro_batch, tile, workspace)
            mask = self.masks[i] if i < len(self.masks) else None
            if mask is not None:
                work += micro_batch * seq * seq * mask[1]
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
            "working": [None if w is None else w.to_dict() for w in self.working],
            "hidden": self.hidden,
            "element": self.element,
            "mlp_tile": self.mlp_tile,
            "vocab": self.vocab,
            "loss_chunk": self.loss_chunk,
            "head_params": self.head_params,
            "shared": list(self.shared),
            "attention": None if self.attention is None else list(self.attention),
            "keeps_output": self.keeps_output,
            "windows": list(self.windows),
            "masks": [None if m is None else list(m) for m in self.masks],
        }


def value_bytes(tokens: int, hidden: int, element: int) -> int:
    """Bytes of one layer input of a causal LM for ``tokens`` tokens: the
    hidden states (``element`` bytes each) and the positions (int64)."""
    return tokens * (hidden * element + 8)


def applied_tiles(tiles: dict[str, int], tokens: int) -> dict[str, int]:
    """The tile sizes that take effect for a micro-batch of ``tokens`` tokens:
    the layers tile only what is longer than a tile."""
    return {k: v for k, v in tiles.items() if tokens > v}


#: the fused attention kernels' backward ops (CPU and CUDA)
_ATTENTION_BACKWARD = frozenset(
    {
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention_backward",
        "_flash_attention_backward",
        "_efficient_attention_backward",
    }
)


class _Fp32Matmuls(TorchDispatchMode):
    """Probes only: CPU matrix products in bf16/fp16 computed in fp32 and
    rounded back (the same output tensor's dtype and shape; the probes count
    bytes, not values). Torch's reduced-precision CPU GEMM with an
    untransposed second operand (a linear's input gradient) runs about 60x
    slower than fp32 on CPUs without AVX-512 BF16: for a Llama-3.1-8B MLP
    weight and 48 tokens, 20 s instead of 0.36 s on an AVX2 machine. A
    parameter's fp32 copy is kept while the parameter lives and is unchanged
    (the probes run each layer at several lengths, forward and backward: for
    Llama-3.1-8B, converting its weights again each time was a third of the
    estimate's time)."""

    # parameter -> (its version when copied, its fp32 copy)
    _weights = WeakIdKeyDictionary()
    # its storage -> the parameter (while it lives)
    _by_storage: ClassVar[weakref.WeakValueDictionary[int, nn.Parameter]] = (
        weakref.WeakValueDictionary()
    )

    _OPS = frozenset(
        {
            torch.ops.aten.mm.default,
            torch.ops.aten.addmm.default,
            torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default,
        }
        # Mixture-of-Experts layers' grouped products (transformers' default
        # experts kernel): in bf16 one Mixtral-8x7B expert backward of 96
        # tokens took 95 s on CPU, 1.5 s in fp32
        | (
            {torch.ops.aten._grouped_mm.default}
            if hasattr(torch.ops.aten, "_grouped_mm")
            else set()
        )
    )
    _LOW = (torch.bfloat16, torch.float16)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.set_.source_Tensor:
            return self._set(func, args, kwargs)
        # (in autograd's backward, not a recompute in it, which enables grad,
        # nor a forward's no_grad region, whose products are read: rotary tables)
        if func in self._OPS and _in_backward() and not torch.is_grad_enabled():
            unread = self._weight_gradient(func, args, kwargs)
            if unread is not None:
                return unread
        if func in self._OPS:
            dtype = next(
                (
                    a.dtype
                    for a in args
                    if isinstance(a, torch.Tensor)
                    and a.device.type == "cpu"
                    and a.dtype in self._LOW
                ),
                None,
            )
            if dtype is not None:
                up = [
                    self._fp32(a) if isinstance(a, torch.Tensor) and a.dtype == dtype else a
                    for a in args
                ]
                kw = {
                    k: self._fp32(v) if isinstance(v, torch.Tensor) and v.dtype == dtype else v
                    for k, v in kwargs.items()
                    if k != "out_dtype"  # (the result is rounded back below)
                }
                return func(*up, **kw).to(dtype)
        return func(*args, **kwargs)

    @classmethod
    def _set(cls, func, args, kwargs) -> Any:
        """``dest.set_(src)``; where ``src`` is ``dest``'s own storage in its
        own geometry (nothing changes but the version: how
        ``torch.nn.utils.parametrize`` registers a parametrization, which
        PEFT's LoRA on Mixture-of-Experts weights does at each forward), the
        parameter's fp32 copy stays its copy."""
        dest, src = args[0], args[1]
        same = (
            _storage_key(dest) == _storage_key(src)
            and dest.size() == src.size()
            and dest.stride() == src.stride()
            and dest.storage_offset() == src.storage_offset()
        )
        param = cls._by_storage.get(_storage_key(dest)) if same else None
        kept = None if param is None else cls._weights.get(param)
        fresh = kept is not None and kept[0] == param._version
        out = func(*args, **kwargs)
        if fresh:  # (autograd counts the in-place op once, above this mode, on return)
            cls._weights[param] = (param._version + 1, kept[1])
        return out

    @staticmethod
    def _weight_gradient(func, args, kwargs) -> torch.Tensor | None:
        """A product in a backward whose result is larger than each of its
        operands (at the probes' short lengths: a weight's gradient, from
        the activations and their gradients), allocated with its shape and
        not computed (None: any other product). Only gradients are added
        into it and nothing reads its values, while the bytes are what the
        probes count: a Mixtral-8x7B block's tiled backward computed its
        experts' gradients, 1.4B values each, twice per probe."""
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]

        def meta(v: Any) -> Any:
            return v.to("meta") if isinstance(v, torch.Tensor) else v

        try:
            shape = func(*map(meta, args), **{k: meta(v) for k, v in kwargs.items()})
        except Exception:  # (no meta kernel for this op: computed)
            return None
        if not isinstance(shape, torch.Tensor) or shape.numel() <= max(
            (t.numel() for t in tensors), default=0
        ):
            return None
        return torch.empty_strided(shape.size(), shape.stride(), dtype=shape.dtype)

    @classmethod
    def _fp32(cls, a: torch.Tensor) -> torch.Tensor:
        """``a`` in fp32; a parameter, or a view of one, from its kept copy.
        A view that autograd saved for the backward is no view of the
        parameter object when unpacked, only of its storage: found by that
        (a Mixtral-8x7B block's backward converted its expert weights again
        each time, a fifth of its probes' time)."""
        base = a if a._base is None else a._base
        key = _storage_key(a)
        if not isinstance(base, nn.Parameter):
            base = cls._by_storage.get(key)
        if not (
            base is not None
            and base.dtype == a.dtype
            and base.is_contiguous()
            and base.storage_offset() == 0
            and _storage_key(base) == key
        ):
            return a.float()
        kept = cls._weights.get(base)
        if kept is None or kept[0] != base._version:
            kept = (base._version, base.detach().float())
            cls._weights[base] = kept
            cls._by_storage[key] = base
        return kept[1].as_strided(a.size(), a.stride(), a.storage_offset())


class _LiveBytes(TorchDispatchMode):
    """Bytes of the tensors that ops run while inside create and that are
    still alive, traced op by op from :meth:`start`: above what was alive
    then after each op that allocates outside tiles (``outside``) and at the
    attention kernel's backward (``attention``), when each tile starts
    (``tile_starts``), and above a tile's start after each op that
    allocates in it (``tile_ops``: the most over tiles, op by op). The same
    code at another length runs the same ops, so the traces of three
    lengths give each op's bytes as a polynomial (:func:`_fit_working`).
    A storage counts from the op that creates it until it is freed. (The
    CPU allocator keeps no statistics, and torch's memory trackers are
    private tools of its distributed package: hence this one.)"""

    #: what a tiled backward reads (:mod:`.tiling`): the parameters' gradient
    #: values are never read, so it allocates them without computing them
    bytes_only = True

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live = 0
        self.base = 0
        self.outside: list[int] = []
        self.attention: list[int] = []
        self.tile_starts: list[int] = []
        self.tile_ops: list[int] = []
        self._depth = self._tile_start = self._tile_op = 0
        self._tracing = False

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.refs.items() if ref.expired()]:
            self.live -= self.refs.pop(key)[1]

    def forget(self, tensors: Sequence[torch.Tensor]) -> None:
        """Stop counting these tensors' storages (alive or not)."""
        for t in tensors:
            found = self.refs.pop(_storage_key(t), None)
            if found is not None:
                self.live -= found[1]

    def start(self) -> None:
        """From now on, trace above what is alive now."""
        self._sweep()
        self.base = self.live
        self._tracing = True

    def tile(self, begin: bool) -> None:
        """A tile's backward begins or ends (:func:`~.tiling.watching_tiles`;
        only the outermost of nested tiles counts)."""
        self._depth += 1 if begin else -1
        if begin and self._depth == 1 and self._tracing:
            self._sweep()
            self._tile_start, self._tile_op = self.live, 0
            self.tile_starts.append(self.live - self.base)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        made = [t for t in _tensors(out) if t.device.type != "meta"]
        # (a view or an in-place result shares its input's storage: not new)
        given = {_storage_key(t) for t in _tensors((args, kwargs))} if made else set()
        new = [t for t in made if _storage_key(t) not in given]
        attention = func.overloadpacket.__name__ in _ATTENTION_BACKWARD
        if new or attention:
            self._sweep()  # (only an allocation can raise the bytes)
            for t in new:
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in self.refs:
                    self.refs[ref.cdata] = (ref, storage.nbytes())
                    self.live += storage.nbytes()
            if self._tracing:
                self._record(attention)
        return out

    def _record(self, attention: bool) -> None:
        if not self._depth:
            self.outside.append(self.live - self.base)
            if attention:
                self.attention.append(self.live - self.base)
            return
        if self._tile_op == len(self.tile_ops):
            self.tile_ops.append(0)
        k = self._tile_op
        self.tile_ops[k] = max(self.tile_ops[k], self.live - self._tile_start)
        self._tile_op += 1


def _in_backward() -> bool:
    """Whether this thread runs autograd's backward (torch's checkpoint
    asks the same)."""
    return torch._C._current_graph_task_id() != -1


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an op's arguments or results (tuples, lists and dicts
    of them; a hand-written walk: ``pytree`` costs more than the op here)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _backward_working(live: _LiveBytes, out: Any, x: torch.Tensor) -> _LiveBytes | None:
    """After a forward that ran inside ``live``: its backward from ``out``
    to its input ``x`` (a leaf) as a backward stage runs it, the output
    freed first, traced by ``live`` (None: nothing to differentiate)."""
    hidden = out["hidden_states"] if isinstance(out, dict) else out
    # the output itself: freed before a stage's backward, or counted apart
    live.forget([hidden])
    if not hidden.requires_grad:
        return None
    with _Fp32Matmuls(), live, watching_tiles(live):
        live.start()
        # the output's gradient counts until autograd has used it, as in a
        # stage (gradients of the input only: the parameters' are counted apart)
        backward_handing_over([hidden], [torch.ones_like(hidden)], inputs=[x])
    live.refs.clear()  # (the traces are what is kept)
    return live


def _signature(layer: nn.Module) -> tuple:
    """Layers with the same structure save the same bytes: probe one of each."""
    params = tuple(
        (n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters()
    )
    # (a layer storing or reusing keys and values for others runs otherwise)
    sharing = (getattr(layer, "kv_role", None), getattr(layer, "carries_kv", False))
    return (type(layer).__name__, getattr(layer, "kind", None), sharing, params)


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
        if torch.is_tensor(v) and v.is_floating_point() and k in ("hidden_states", PER_LAYER_KEY)
        else v
        for k, v in out.items()
    }


def _line(xs: Sequence[int], ys: Sequence[float]) -> Poly:
    """The least-squares line ``c0 + c1 x`` through the points (work per
    token of a tile: linear in the tile, and a curve through three short
    tiles would run away at a long one)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return my - slope * mx, slope, 0.0


def _tail_line(xs: Sequence[int], ys: Sequence[float]) -> Poly:
    """The line through the two longest points: what a sliding-window layer
    keeps or works with grows linearly once its tiles repeat, and at the
    shortest probe the first tile is a larger share (a curve through all
    three would run away at long sequences)."""
    (x1, x2), (y1, y2) = xs[-2:], ys[-2:]
    slope = (y2 - y1) / (x2 - x1)
    return y2 - slope * x2, slope, 0.0


def _envelope(polys: Sequence[Poly]) -> tuple[Poly, ...]:
    """The polynomials no other one bounds coefficient by coefficient (the
    rest are never the largest at a positive length)."""
    kept: list[Poly] = []
    for p in sorted(set(polys), reverse=True):
        if not any(all(a >= b for a, b in zip(k, p, strict=True)) for k in kept):
            kept.append(p)
    return tuple(kept)


def _fit_trace(
    xs: Sequence[int], traces: Sequence[Sequence[int]], line: bool, tail: bool = False
) -> tuple[Poly, ...]:
    """Each op's bytes as a polynomial of the length, from its bytes at
    ``xs`` (``line``: a least-squares line, :func:`_line`; ``tail``: the
    line through the two longest, :func:`_tail_line`; else the quadratic
    through the three). Where the traces do not line up (the ops depend on
    the data: experts that get no tokens; a sliding-window layer's tiles),
    the largest of each trace."""
    if not traces[0]:
        return ((0.0, 0.0, 0.0),)
    fit = _tail_line if tail else _line if line else _quadratic
    if any(len(t) != len(traces[0]) for t in traces):
        return (fit(xs, [max(t, default=0) for t in traces]),)
    return _envelope([fit(xs, list(ys)) for ys in zip(*traces, strict=True)])


def _fit_working(
    lengths: Sequence[int],
    tiles: Sequence[int],
    measured: Sequence[_LiveBytes | None],
    sliding: bool = False,
) -> Working | None:
    """One layer's :class:`Working` from its traced backwards at ``lengths``
    tokens (``tiles`` tokens per tile; ``sliding``: a sliding-window layer
    attending over query tiles, whose work grows linearly)."""
    if len(measured) != len(lengths) or any(w is None for w in measured):
        return None
    at = [w for w in measured if w is not None]
    attention = None
    if all(w.attention for w in at):
        attention = _fit_trace(lengths, [w.attention for w in at], line=False, tail=sliding)
    return Working(
        outside=_fit_trace(lengths, [w.outside for w in at], line=False, tail=sliding),
        tile_base=_fit_trace(lengths, [w.tile_starts for w in at], line=False, tail=sliding),
        tile_work=_fit_trace(tiles, [w.tile_ops for w in at], line=True),
        attention=attention,
    )


def probe_activations(
    layers: Sequence[nn.Module],
    dtype: torch.dtype,
    *,
    hidden: int,
    vocab: int,
    tiles: dict[str, int],
    logit_width: int | None = None,
    loss: Any = None,
    mask: bool = False,
    packed: bool = False,
    router: bool = False,
    lengths: Sequence[int] = PROBE_LENGTHS,
    prepare: Callable[[nn.Module], nn.Module] | None = None,
    attention: tuple[int, int, int] | None = None,
    memo: dict[tuple, list[Any]] | None = None,
) -> ActivationModel:
    """Measure what each of a causal LM adapter's ``layers`` (embedding,
    blocks, head) saves for its backward at three short ``lengths``, on
    copies in ``dtype`` on the CPU, with the call's settings (``tiles`` as
    the adapter chose them for the real call, a padding ``mask``, ``packed``
    sequences, ``router`` statistics, the ``loss`` computed inside the head's
    stage); see :class:`ActivationModel`, whose ``attention`` heads are
    given. ``vocab``: the token ids' range; ``logit_width``: the head's
    outputs per token (default ``vocab``; a classifier's labels).
    ``prepare``: how to get a runnable CPU copy of a layer (default a copy in
    ``dtype``; for a model on the meta device, one with random values).
    ``memo``: the layers' probes (what a layer saved, its output and its
    backward's trace, by layer, length, sequences and MLP tiling), kept for
    the next call with the same ``dtype``, ``loss``, ``mask``, ``packed``,
    ``router`` and ``prepare`` (the caller keys it by them): calls that
    differ in the loss chunk alone probe the blocks once (a Mixture-of-
    Experts block's probes take minutes on CPU)."""
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
    measured: dict[tuple, list[Any]] = {} if memo is None else memo
    per_layer: list[list[float]] = [[] for _ in layers]
    paired: list[float] = [0.0 for _ in layers]  # two sequences at the last length
    works: list[list[_LiveBytes | None]] = [[] for _ in layers]
    last = lengths[-1]
    # sliding-window layers run tiled (at the probes' own window: the
    # sequences are short) where the real call runs them tiled
    with sliding.probing():
        for seq, batch in [*((n, 1) for n in lengths), (last, 2)]:
            # tile at the probe exactly when the real call tiles
            probe_tiles = {}
            if mlp_tile:
                probe_tiles["mlp_tile"] = max(1, batch * seq // PROBE_TILES)
            x = _probe_inputs(embed, dtype, seq, vocab, mask, packed, router, batch)
            for i, layer in enumerate(layers):
                key = (_signature(layer), seq, batch, bool(probe_tiles))
                if i == 0:  # (the model's own embedding: it keeps its indices only)
                    got = batch * _embedding_bytes(embed, seq)
                elif layer is head and loss_chunk:
                    # a chunked loss keeps the head's input and, until backward,
                    # its gradient (and no logits): counted below, exactly
                    got = 0.0
                else:
                    if key not in measured:
                        rep = runnable(layer)
                        inputs = dict(x, **probe_tiles)
                        leaf = inputs["hidden_states"].detach().requires_grad_()
                        inputs["hidden_states"] = leaf
                        counted: dict[int, int] = {}
                        # a block's backward is measured too (the head's is known)
                        live = _LiveBytes() if layer is not head and batch == 1 else None
                        with (
                            torch.enable_grad(),
                            saved_bytes(rep, counted, 0),
                            _Fp32Matmuls(),  # (below the tracer, which sees its outputs only)
                            live or contextlib.nullcontext(),
                        ):
                            out = rep(**inputs)
                            if layer is head and loss is not None:
                                labels = torch.zeros(batch, seq, dtype=torch.long)
                                loss(out, labels)
                        work = None if live is None else _backward_working(live, out, leaf)
                        # (detached: a kept output must not keep its graph alive)
                        nxt = None
                        if layer is not head:
                            nxt = {
                                k: v.detach() if torch.is_tensor(v) else v for k, v in out.items()
                            }
                        measured[key] = [float(counted[0]), nxt, work]
                        del out
                    got, nxt, work = measured[key]
                    if nxt is not None:
                        # (detached when kept; a layer's inputs are a new dict;
                        # keys and values stored for later layers stay, whichever
                        # earlier probe's output this is)
                        kept = {k: v for k, v in x.items() if k.startswith(SHARED_KV_PREFIX)}
                        x = {**kept, **nxt}
                    if batch == 1:
                        works[i].append(work)
                if batch == 1:
                    per_layer[i].append(got)
                else:
                    paired[i] = got
    element = torch.empty(0, dtype=dtype).element_size()
    # (a padding mask, whatever its values, keeps the model's dense mask)
    pad = torch.ones(1, 1) if mask else None
    windows = tuple(
        layer._sliding_window(pad, packed) if hasattr(layer, "_sliding_window") else None
        for layer in layers
    )
    saved = [
        (_quadratic if w is None else _tail_line)(lengths, ys)
        for ys, w in zip(per_layer, windows, strict=True)
    ]
    # what two sequences keep less than twice one's: kept once per micro-batch
    shared = [max(0.0, 2 * ys[-1] - two) / last for ys, two in zip(per_layer, paired, strict=True)]
    saved = [(c0, c1 - once, c2) for (c0, c1, c2), once in zip(saved, shared, strict=True)]
    if loss_chunk:
        c0, c1, c2 = saved[-1]
        saved[-1] = (c0, c1 + 2 * hidden * element, c2)  # input and its gradient
    head_params = sum(p.numel() for p in head.parameters() if p.requires_grad)
    tile_lengths = [max(1, n // PROBE_TILES) for n in lengths]
    return ActivationModel(
        saved=tuple(saved),
        working=tuple(
            _fit_working(lengths, tile_lengths, w, sliding=win is not None)
            for w, win in zip(works, windows, strict=True)
        ),
        hidden=hidden,
        element=element,
        mlp_tile=mlp_tile,
        vocab=vocab if logit_width is None else logit_width,
        loss_chunk=loss_chunk,
        head_params=head_params,
        shared=tuple(shared),
        attention=attention,
        keeps_output=router,
        windows=windows,
        masks=tuple(
            (layer.kind, n)
            if hasattr(layer, "mask_element") and (n := layer.mask_element(mask, packed, element))
            else None
            for layer in layers
        ),
    )


def _embedding_bytes(embed: nn.Module, seq: int) -> float:
    counted: dict[int, int] = {}
    ids = torch.arange(seq).reshape(1, seq)
    with torch.enable_grad(), saved_bytes(embed, counted, 0):
        embed(input_ids=ids)
    return float(counted[0])


def longest_sequence(fits: Any, low: int = 1, high: int = 1 << 24, checks: int = 0) -> int:
    """The largest ``s`` in ``[low, high]`` with ``fits(s)`` (monotone), 0 if
    none: a bisection. With ``checks``, as many lengths spread evenly below
    the one found are tried as well, and where one does not fit the search
    goes on below it (a predicate that is monotone only mostly): the length
    returned then fits, the next one does not, nor does any checked length
    below it fail."""
    while True:
        found = _bisect(fits, low, high)
        if not found:
            return 0
        below = sorted({low + (found - low) * k // (checks + 1) for k in range(1, checks + 1)})
        failed = next((s for s in below if low < s < found and not fits(s)), None)
        if failed is None:
            return found
        high = failed - 1


def _bisect(fits: Any, low: int, high: int) -> int:
    """:func:`longest_sequence` without checks."""
    if not fits(low):
        return 0
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low

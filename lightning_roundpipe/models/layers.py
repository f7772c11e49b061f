"""The pipeline layers of a Hugging Face causal LM, made of the model's own modules.

``_Embed`` (token embeddings and whatever the model does before its first
block), one ``_Decoder`` per decoder block (the block itself, called as the
model calls it, with the mask and rotary tables the model would give it), and
``_Head`` (final norm, LM head, and what the ``*ForCausalLM`` does to the
logits). Only a dict crosses stage boundaries: the hidden states, the positions,
the 2-D padding mask when there is padding, ``packed`` when the positions hold
several sequences, and, when the router load-balancing loss is on, the running
router statistics (:func:`router_statistics`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..runtime.scope import stage_cached
from . import attention
from .attention import GroupedAttention
from .families import INDEXED_KINDS, MASKLESS_KINDS, RECURRENT_KINDS
from .sliding import SlidingWindow, scaled
from .tiling import ChunkedLogits, draws_random, tiled, trainable

__all__ = ["balance_loss", "is_packed"]

# the masking_utils function each attention type's mask comes from
_MASK_FUNCTIONS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
    "chunked_attention": "create_chunked_causal_mask",
    "indexed_attention": "create_causal_mask",
}
# the running router statistics carried from stage to stage
ROUTER_KEYS = ("router_counts", "router_probs", "router_tokens")
# tokens per loss chunk and per tile of a block's per-token work (its MLP and
# norms), when the adapter tiles the call
TILE_KEYS = ("loss_chunk", "mlp_tile")


def _packed_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which packed sequence each token belongs to (a new one wherever the
    positions do not continue by one), computed on the device, no sync."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def is_packed(position_ids: torch.Tensor) -> bool:
    """Whether host ``position_ids`` hold several sequences per row (positions
    that restart), as transformers detects packed inputs."""
    if position_ids.dim() < 2:
        position_ids = position_ids.reshape(1, -1)
    return bool((_packed_ids(position_ids)[:, -1] != 0).any())


# normalisations over the last dimension, by class name where transformers
# defines its own (LlamaRMSNorm, Qwen3RMSNorm, GemmaRMSNorm, ...)
_NORM_NAMES = ("RMSNorm", "LayerNorm")


def _norms(block: nn.Module, skip: nn.Module | None) -> list[nn.Module]:
    """The per-token normalisations of ``block`` outside ``skip`` (the tiled
    MLP): leaf modules that normalise over the last dimension only, with at
    most one-dimensional parameters, drawing no random numbers."""
    inside = set() if skip is None else {id(m) for m in skip.modules()}
    out = []
    for m in block.modules():
        if id(m) in inside or next(m.children(), None) is not None:
            continue
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            ok = len(m.normalized_shape) == 1
        else:
            ok = type(m).__name__.endswith(_NORM_NAMES)
        if ok and all(p.dim() <= 1 for p in m.parameters()) and not draws_random(m):
            out.append(m)
    return out


def _lora_linear() -> type | None:
    """peft's LoRA linear layer class, when peft is in use (a model can only
    hold one once peft is imported)."""
    module = sys.modules.get("peft.tuners.lora.layer")
    return getattr(module, "Linear", None)


def _projections(block: nn.Module, skip: Sequence[nn.Module]) -> list[tuple[nn.Module, bool]]:
    """The outermost per-token linear maps of ``block`` outside ``skip`` (the
    tiled MLP and norms), each with whether it keeps its input for the
    backward: ``nn.Linear`` (keeps it when its weight is trainable) and
    peft's plain LoRA linear (no variant such as DoRA or activated LoRA,
    whose output may depend on the position, no dropout; keeps it when its
    adapters are trainable). They act on each position alone, so their
    output can be recomputed tile by tile (:class:`_PerToken`)."""
    lora = _lora_linear()
    inside = {id(m) for s in skip for m in s.modules()}
    out: list[tuple[nn.Module, bool]] = []
    for m in block.modules():
        if id(m) in inside:
            continue
        if lora is not None and isinstance(m, lora):
            inside.update(id(c) for c in m.modules())  # its base and adapters go with it
            plain = type(m) is lora and not getattr(m, "lora_variant", None)
            if plain and not draws_random(m):
                out.append((m, bool(trainable(m))))
        elif type(m) is nn.Linear:
            out.append((m, m.weight.requires_grad))
    return out


def _after(inner: Any, outer: Any, *xs: torch.Tensor) -> torch.Tensor:
    """``outer(inner(*xs))``: a per-token module after the value it reads."""
    return outer(inner(*xs))


def _plus(inner: Any, x: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:
    """``x + inner(*xs)``: a residual sum."""
    return x + inner(*xs)


def _entry_is(entry: tuple[Any, int], t: torch.Tensor) -> bool:
    """Whether an autograd edge (``node.next_functions`` entry) comes from ``t``."""
    node, index = entry
    if t.grad_fn is not None:
        return node is t.grad_fn and index == t.output_nr
    return t.requires_grad and getattr(node, "variable", None) is t


@functools.cache
def _no_cache(make: Any) -> dict[str, None]:
    """The mask helper's "no key/value cache" argument: transformers renamed it
    from ``past_key_values`` to ``cache`` (the old name warns, then goes in 5.40)."""
    name = "cache" if "cache" in inspect.signature(make).parameters else "past_key_values"
    return {name: None}


class _PerToken:
    """The per-token values of one tiled block call, each with a recipe from
    values the backward keeps anyway (the block's input, the attention's
    output): ``value == fn(*roots)`` position by position.

    A norm's output, a linear projection's output, and the block's input
    plus one of those (the residual sum, recognised from autograd's add
    node) have recipes. A per-token module that reads such a value runs
    ``module(fn(*roots))`` over tiles of the roots (:func:`~.tiling.tiled`),
    so the value itself is never kept for the backward: for a Llama block
    neither norm's output nor the residual after attention is kept."""

    def __init__(self, block_input: torch.Tensor, per_row: int) -> None:
        self.block_input = block_input
        self.per_row = per_row
        # id of a value -> (a weak reference to it, its autograd node and
        # output index, fn, roots, trainable parameters); the node is held so
        # that an add's edge can name the value after the value itself is
        # gone (what ``h = residual + attention(x)`` leaves), and so that no
        # other node takes its identity for the call
        self._made: dict[int, tuple[Any, Any, int, Any, tuple, list]] = {}

    def remember(self, out: torch.Tensor, fn: Any, roots: tuple, params: list) -> None:
        if torch.is_grad_enabled() and out.grad_fn is not None:  # (else nothing is kept)
            self._made[id(out)] = (weakref.ref(out), out.grad_fn, out.output_nr, fn, roots, params)

    def recipe(self, x: torch.Tensor) -> tuple[Any, tuple, list] | None:
        found = self._made.get(id(x))
        got = found[3:] if found is not None and found[0]() is x else self._residual(x)
        if got is None or any(r.shape[:-1] != x.shape[:-1] for r in got[1]):
            return None  # (roots tile along the same positions as the value)
        return got

    def _residual(self, h: torch.Tensor) -> tuple[Any, tuple, list] | None:
        """``block_input + v`` for a remembered ``v``, as autograd recorded it."""
        node, x = h.grad_fn, self.block_input
        if node is None or node.name() != "AddBackward0" or h.shape != x.shape:
            return None
        if getattr(node, "_saved_alpha", None) != 1 or len(node.next_functions) != 2:
            return None
        first, second = node.next_functions
        for other, edge in ((second, first), (first, second)):
            if not _entry_is(edge, x):
                continue
            for _, v_node, v_index, fn, roots, params in self._made.values():
                if other[0] is v_node and other[1] == v_index:
                    return functools.partial(_plus, fn), (x, *roots), params
        return None

    def after(self, forward: Any, params: list, x: torch.Tensor) -> tuple[Any, tuple, list, bool]:
        """The recipe of ``forward(x)``: over ``x``'s recipe when it has one
        (and whether it has)."""
        found = self.recipe(x)
        if found is None:
            return forward, (x,), params, False
        fn, roots, inner = found
        return functools.partial(_after, fn, forward), roots, params + inner, True

    def run(self, fn: Any, roots: tuple, params: list) -> torch.Tensor:
        """``fn(*roots)`` over tiles of the roots' positions."""
        return tiled(fn, params, roots, self.per_row, dim=roots[0].dim() - 2)


def _one_tensor(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The call's tensor when a module is called with exactly one positional
    tensor (what tiling handles); None for any other call."""
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
        return args[0]
    return None


def _width(norm: nn.Module, x: torch.Tensor) -> int:
    """The last dimension ``norm`` normalises (its weight's size; ``x``'s when
    it has none)."""
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return weight.shape[0]
    return x.shape[-1]


def _boundary(
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    packed: bool,
    carried: dict[str, torch.Tensor],
    tiles: dict[str, int],
) -> dict[str, Any]:
    """What crosses a stage boundary (absent values stay absent); ``carried``:
    router statistics, per-layer inputs, stored keys and values."""
    out: dict[str, Any] = {"hidden_states": hidden_states, "position_ids": position_ids}
    if attention_mask is not None:
        out["attention_mask"] = attention_mask
    if packed:
        out["packed"] = True
    out.update(carried)
    out.update(tiles)
    return out


def _router(values: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: values[k] for k in ROUTER_KEYS if values.get(k) is not None}


def _tiles(values: dict[str, Any]) -> dict[str, int]:
    """The tile sizes the adapter chose for the call (tokens), passed along."""
    return {k: values[k] for k in TILE_KEYS if values.get(k)}


def _padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """What ``create_recurrent_attention_mask`` gives recurrent blocks (linear
    attention, Mamba, convolutions), without its device check for an
    all-ones mask: the 2-D mask, which the adapter gives only with padding."""
    return None if attention_mask is None else attention_mask.contiguous()


# the per-layer inputs still to be consumed, carried from stage to stage
PER_LAYER_KEY = "per_layer_inputs"
# the token ids the blocks get (DeepSeek-V4's hash routing), carried likewise
TOKEN_IDS_KEY = "block_input_ids"
# what a block passes on to the next (Family.chained), carried likewise
CHAINED_KEY = "chained"
# keys and values a layer stored for later layers to reuse, carried from stage
# to stage as "<prefix><layer type>:key" and ":value"
SHARED_KV_PREFIX = "shared_kv:"


class _PerLayerInputs(nn.Module):
    """What a Gemma 4 ``*Model`` computes from the tokens for every decoder
    layer (its per-layer embeddings, ``[batch, sequence, layers, width]``),
    by the model's own ``get_per_layer_inputs`` and
    ``project_per_layer_inputs``, run on this module, which holds the
    submodules and settings those read (not the whole model)."""

    _ATTRIBUTES = (
        "hidden_size_per_layer_input",
        "per_layer_input_scale",
        "per_layer_model_projection_scale",
        "per_layer_projection_scale",
        "config",
    )
    _MODULES = (
        "embed_tokens",
        "embed_tokens_per_layer",
        "per_layer_model_projection",
        "per_layer_projection_norm",
    )

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        for name in self._MODULES:
            setattr(self, name, getattr(base, name))
        for name in self._ATTRIBUTES:
            if name in base._buffers:  # (Gemma 3n's scales: they go to the device)
                self.register_buffer(name, base._buffers[name], persistent=False)
            elif hasattr(base, name):
                setattr(self, name, getattr(base, name))
        self._get = type(base).get_per_layer_inputs
        self._project = type(base).project_per_layer_inputs
        # Gemma 3n looks the tokens up only (none for given inputs_embeds)
        self._from_ids_only = len(inspect.signature(self._get).parameters) == 2

    def forward(self, input_ids, inputs_embeds):
        if self._from_ids_only:
            tokens = None if input_ids is None else self._get(self, input_ids)
        else:
            tokens = self._get(self, input_ids, inputs_embeds)
        return self._project(self, inputs_embeds, tokens)


def _magnitude(x: torch.Tensor) -> torch.Tensor:
    """Each position's root-mean-square over the hidden size."""
    return torch.mean(x**2, dim=-1, keepdim=True) ** 0.5


def _rescaled(x: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` with each position's root-mean-square set to ``magnitude``."""
    x = x.to(dtype=dtype, device=magnitude.device)
    return x * magnitude / torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))


class _RepeatStreams(nn.Module):
    """DeepSeek-V4's streams from the embeddings (``[batch, sequence, streams,
    hidden]``): the embeddings, repeated."""

    def __init__(self, streams: int) -> None:
        super().__init__()
        self.streams = streams

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.unsqueeze(2).expand(-1, -1, self.streams, -1).contiguous()


class _AltUpIn(nn.Module):
    """Gemma 3n's streams from the embeddings (``[streams, batch, sequence,
    hidden]``): the embeddings, then each of its ``altup_projections`` of them
    at the embeddings' magnitude (what ``Gemma3nTextModel.forward`` does
    before its first block; its code is inline there, so written here)."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.altup_projections = base.altup_projections

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        magnitude = _magnitude(h)
        streams = [h, *(_rescaled(p(h), magnitude, h.dtype) for p in self.altup_projections)]
        return torch.stack(streams, dim=0)


class _AltUpOut(nn.Module):
    """Gemma 3n's merge of the streams after the last block: the first, and
    each ``altup_unembed_projections`` of the others at the first's
    magnitude, averaged (before the final norm)."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.altup_unembed_projections = base.altup_unembed_projections

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        magnitude = _magnitude(h[0])
        merged = [
            h[0],
            *(
                _rescaled(p(h[i + 1]), magnitude, h.dtype)
                for i, p in enumerate(self.altup_unembed_projections)
            ),
        ]
        return torch.mean(torch.stack(merged), dim=0)


class _Embed(nn.Module):
    """The token embeddings (or the given ``inputs_embeds``: exactly one of
    them, the model's own rule), then what the family's ``*Model`` does before
    its first block, in its order: an embedding multiplier, learned absolute
    positions, dropout (a module, or a rate applied in the embedding's
    train/eval mode, which is the model's), a norm (NanoChat). With
    ``router=True`` the router statistics start at zero."""

    def __init__(
        self,
        embed: nn.Module,
        positions: nn.Module | None = None,
        multiplier: float | None = None,
        dropout: nn.Module | None = None,
        experts: int = 0,
        dropout_rate: float = 0.0,
        norm: nn.Module | None = None,
        project_in: nn.Module | None = None,
        positions_from_mask: bool = False,
        multiply_given: bool = True,
        per_layer: nn.Module | None = None,
        token_ids: bool = False,
        streams_in: nn.Module | None = None,
    ) -> None:
        super().__init__()
        # makes the streams of hidden states the blocks carry (DeepSeek-V4's
        # hyper-connections, Gemma 3n's AltUp)
        self.streams_in = streams_in
        self.multiply_given = multiply_given
        # the token ids go on to the blocks
        self.token_ids = token_ids
        self.per_layer = per_layer
        self.embed = embed
        self.norm = norm
        self.project_in = project_in
        self.positions_from_mask = positions_from_mask
        self.positions = positions
        self.multiplier = multiplier
        self.dropout = dropout
        self.dropout_rate = dropout_rate
        self.experts = experts

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        packed=False,
        inputs_embeds=None,
        router=False,
        **tiles,
    ):
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        carried: dict[str, torch.Tensor] = {}
        if self.per_layer is not None:
            carried[PER_LAYER_KEY] = self.per_layer(input_ids, h)
        if self.multiplier is not None and (inputs_embeds is None or self.multiply_given):
            h = h * self.multiplier
        if position_ids is None and self.positions_from_mask and attention_mask is not None:
            mask = attention_mask.to(h.device).long()
            position_ids = mask.cumsum(-1) * mask - 1  # (OPT's: padding at -1)
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        if self.project_in is not None:
            h = self.project_in(h)
        if self.positions is not None and self.positions_from_mask:
            h = h + self.positions(attention_mask, 0, position_ids=position_ids).to(h.device)
        elif self.positions is not None:
            h = h + self.positions(position_ids).to(h.device)
        if self.dropout is not None:
            h = self.dropout(h)
        if self.dropout_rate:
            h = nn.functional.dropout(h, self.dropout_rate, training=self.embed.training)
        if self.norm is not None:
            h = self.norm(h)
        if self.streams_in is not None:
            h = self.streams_in(h)
        if self.token_ids and input_ids is not None:
            carried[TOKEN_IDS_KEY] = input_ids
        stats: dict[str, torch.Tensor] = {}
        if router:
            stats = {
                "router_counts": torch.zeros(1, self.experts, dtype=torch.long, device=h.device),
                "router_probs": torch.zeros(1, self.experts, dtype=torch.float32, device=h.device),
                "router_tokens": torch.zeros(1, dtype=torch.long, device=h.device),
            }
        return _boundary(
            h, position_ids, attention_mask, packed, {**stats, **carried}, _tiles(tiles)
        )


def router_statistics(
    logits: torch.Tensor, top_k: int, experts: int, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One router's contribution to transformers' ``load_balancing_loss_func``:
    how often each expert is among the top ``top_k`` of the softmax (no
    gradient), the routing probabilities summed per expert (with gradient) and
    the tokens counted, padding left out, as that function sums them over layers."""
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1)[1].reshape(-1)
    if attention_mask is None:
        counts = torch.zeros(experts, dtype=torch.long, device=logits.device)
        counts.scatter_add_(0, chosen, torch.ones_like(chosen))
        return (
            counts,
            probs.float().sum(dim=0),
            torch.full((1,), probs.shape[0], device=probs.device),
        )
    keep = attention_mask.reshape(-1).to(logits.device)
    counts = torch.zeros(experts, dtype=torch.long, device=logits.device)
    counts.scatter_add_(0, chosen, keep.long().repeat_interleave(top_k))
    weighted = (probs.float() * keep.float().unsqueeze(-1)).sum(dim=0)
    return counts, weighted, keep.long().sum().reshape(1)


def balance_loss(
    counts: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor, experts: int
) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` from the sums over every
    router (summed over micro-batches first for a whole batch's value)."""
    total = tokens.float().sum()
    per_expert = counts.reshape(-1, experts).sum(0).float() / total
    prob_per_expert = probs.reshape(-1, experts).sum(0) / total
    return torch.sum(per_expert * prob_per_expert.unsqueeze(0)) * experts


class _Decoder(nn.Module):
    """One decoder block, called as the family's ``*Model`` calls it.

    The block's mask (the model's own for this layer's attention type) and
    rotary tables are built from the positions and the 2-D mask by a stage's
    first layer that needs them, once per micro-batch, and shared by the
    stage's other layers (``stage_cached``, keyed by kind). With the router
    statistics present, the block's routers' logits are recorded as
    transformers records them (a forward hook on the router class its
    ``_can_record_outputs`` names, installed for the call on this layer's own
    copy of the block) and added to the running sums."""

    # never writes its input in place (transformers' blocks are functional):
    # a stage that starts here needs no copy of its input (see RoundPipeEngine)
    input_intact = True

    def __init__(
        self,
        layer: nn.Module,
        rotary: nn.Module | None,
        config: Any,
        kind: str,
        *,
        rotary_per_kind: bool = False,
        rotary_kinds: tuple[str, ...] | None = None,
        rotary_fp32: bool = False,
        rotary_dict: tuple[str, ...] = (),
        chained: str | None = None,
        streams_first: bool = False,
        nope_scaling: Any = None,
        always_mask: bool = False,
        tiled_sliding: bool = True,
        block_kwargs: dict[str, Any] | None = None,
        scratch_kwargs: tuple[str, ...] = (),
        alibi: Any = None,
        padding_mask_kwarg: str | None = None,
        carries_kv: bool = False,
        kv_role: str | None = None,
        routers: tuple[str, ...] = (),
        router_index: int = 0,
        top_k: int = 0,
        experts: int = 0,
        mlp: str | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        # the block's per-token feed-forward submodule, tiled at long sequences
        self.mlp = mlp
        self.rotary = rotary
        # the shared rotary module's identity, kept by the workers' copies (each
        # replica of this layer holds its own copy of the module)
        self.rotary_key = id(rotary)
        self.config = config
        # the model's attention type for this layer: which mask it gets
        self.kind = kind
        self.rotary_per_kind = rotary_per_kind
        self.rotary_kinds = rotary_kinds
        # the model computes this layer's rotary table for fp32 inputs
        self.rotary_fp32 = rotary_fp32
        # the rotary tables of these types, as a dict (DeepSeek-V4's)
        self.rotary_dict = tuple(rotary_dict)
        # the keyword taking what the block before returned beside its hidden
        # states (it returns the same for the next)
        self.chained = chained
        # the hidden states are streams stacked first (Gemma 3n's AltUp): the
        # masks are built for one of them
        self.streams_first = streams_first
        # the family's function giving the layers without the rotary table a
        # query scale from the positions (attention_scaling=)
        self.nope_scaling = nope_scaling
        self.always_mask = always_mask
        self.tiled_sliding = tiled_sliding
        self.block_kwargs = dict(block_kwargs or {})
        self.scratch_kwargs = tuple(scratch_kwargs)
        # the family's function building the ALiBi biases from the 2-D mask
        self.alibi = alibi
        self.padding_mask_kwarg = padding_mask_kwarg
        # whether a later layer reuses keys and values stored here or before
        self.carries_kv = carries_kv
        # "store": its keys and values are kept for later layers, "reuse": it
        # reads an earlier layer's (None: neither)
        self.kv_role = kv_role
        # submodule paths of the block's routers, and where their logits are
        # in the router's output
        self.routers = routers
        self.router_index = router_index
        self.top_k = top_k
        self.experts = experts

    def _sliding_window(self, attention_mask, packed) -> int | None:
        """The window of a sliding-window layer whose attention runs over
        query tiles (:mod:`~.sliding`) instead of under the model's dense
        mask: SDPA attention, no padding, no packed sequences, no attention
        dropout, no gradient checkpointing of the block (transformers'
        recompute would run the block outside the tiles' mode: without the
        window); None otherwise."""
        window = getattr(self.config, "sliding_window", None)
        if (
            self.kind != "sliding_attention"
            or not self.tiled_sliding
            or self.checkpointed()
            or attention_mask is not None
            or packed
            or self.always_mask
            or getattr(self.config, "_attn_implementation", None) != "sdpa"
            or getattr(self.config, "attention_dropout", 0.0)
            or not isinstance(window, int)
            or isinstance(window, bool)
            or window < 1
        ):
            return None
        return window

    def _mask(self, hidden_states, position_ids, attention_mask, packed):
        """The model's own mask for this layer type, without the checks that
        read device values (the adapter decided them on the host): a padding
        mask is always applied (no ``is_causal`` shortcut), packed sequences
        are kept apart from ``position_ids``."""
        from transformers import masking_utils

        if self.streams_first:
            hidden_states = hidden_states[0]
        if self.kind in MASKLESS_KINDS:
            return None
        if self.kind in RECURRENT_KINDS:
            return _padding_mask(attention_mask)
        make = getattr(masking_utils, _MASK_FUNCTIONS[self.kind])
        kwargs: dict[str, Any] = {}
        if attention_mask is not None or self.always_mask or self.kind in INDEXED_KINDS:
            kwargs["allow_is_causal_skip"] = False
        if attention_mask is None and packed:
            ids = position_ids.expand(hidden_states.shape[0], -1)
            kwargs["and_mask_function"] = masking_utils.packed_sequence_mask_function(
                _packed_ids(ids)
            )
            if self.kind == "chunked_attention":
                # the model counts chunks from each packed sequence's own
                # positions (it remaps the chunked mask to them): a causal mask
                # with that overlay is the same mask
                start = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
                chunks = masking_utils.remap_positions_for_packed_sequence(
                    masking_utils.chunked_overlay(self.config.attention_chunk_size, start), ids
                )
                kwargs["and_mask_function"] = masking_utils.and_masks(
                    kwargs["and_mask_function"], chunks
                )
                make = masking_utils.create_causal_mask
        return make(
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=attention_mask,
            **_no_cache(make),
            position_ids=None,  # packing is known: no detection on the device
            **kwargs,
        )

    def _alibi(self, hidden_states, attention_mask):
        """The ALiBi biases the model gives every block, from the padding mask
        (all ones without padding, which gives the model's values)."""
        if attention_mask is None:
            attention_mask = torch.ones(
                hidden_states.shape[:2], dtype=torch.long, device=hidden_states.device
            )
        heads = int(self.config.num_attention_heads)
        return self.alibi(attention_mask, heads, dtype=hidden_states.dtype)

    def _rotary(self, hidden_states, position_ids):
        if self.rotary_fp32:  # (the module reads its input's dtype and device only)
            hidden_states = hidden_states[..., :0].float()
        if self.rotary_dict:
            return {t: self.rotary(hidden_states, position_ids, t) for t in self.rotary_dict}
        if self.rotary_per_kind:
            return self.rotary(hidden_states, position_ids, self.kind)
        return self.rotary(hidden_states, position_ids)

    def forward(self, hidden_states, position_ids, attention_mask=None, packed=False, **extra):
        window = self._sliding_window(attention_mask, packed)
        # built by the stage's first decoder layer of this kind, reused by the
        # others; none for a sliding-window layer whose attention runs over
        # query tiles (one beside it whose block is checkpointed has the model's)
        mask = None
        if window is None:
            mask = stage_cached(
                ("mask", self.kind),
                lambda: self._mask(hidden_states, position_ids, attention_mask, packed),
            )
        kwargs = dict(self.block_kwargs, attention_mask=mask, position_ids=position_ids)
        shared = {
            k[len(SHARED_KV_PREFIX) : -len(":key")]: (v, extra[k[: -len("key")] + "value"])
            for k, v in extra.items()
            if k.startswith(SHARED_KV_PREFIX) and k.endswith(":key")
        }
        kwargs.update({name: {} for name in self.scratch_kwargs})
        if self.scratch_kwargs:  # (what earlier layers stored, for this one to read)
            kwargs[self.scratch_kwargs[0]].update(shared)
        if self.padding_mask_kwarg is not None:
            kwargs[self.padding_mask_kwarg] = _padding_mask(attention_mask)
        if self.alibi is not None:
            kwargs["alibi"] = stage_cached(
                ("alibi",), lambda: self._alibi(hidden_states, attention_mask)
            )
        if (
            self.rotary is not None
            and self.rotary_kinds is not None
            and self.kind not in self.rotary_kinds
        ):
            kwargs["position_embeddings"] = None
            if self.nope_scaling is not None:
                kwargs["attention_scaling"] = stage_cached(
                    ("nope_scaling",), lambda: self.nope_scaling(position_ids)
                )
        elif self.rotary is not None:
            key = ("rotary", self.rotary_key, self.kind if self.rotary_per_kind else None)
            kwargs["position_embeddings"] = stage_cached(
                key, lambda: self._rotary(hidden_states, position_ids)
            )
        stats, tiles = _router(extra), _tiles(extra)
        carried: dict[str, torch.Tensor] = {}
        if self.chained is not None:
            kwargs[self.chained] = extra.get(CHAINED_KEY)
        token_ids = extra.get(TOKEN_IDS_KEY)
        if token_ids is not None:  # (the next blocks' too)
            kwargs["input_ids"] = carried[TOKEN_IDS_KEY] = token_ids
        per_layer = extra.get(PER_LAYER_KEY)
        if per_layer is not None:
            # this block's slice; the later blocks' go on (a view: it keeps a
            # gradient path of its own, and the boundary copies only its part)
            kwargs["per_layer_input"] = per_layer[:, :, 0, :]
            if per_layer.shape[2] > 1:
                carried[PER_LAYER_KEY] = per_layer[:, :, 1:, :]
        # a sliding-window layer without its dense mask: attention over tiles
        sliding = SlidingWindow(*scaled(window)) if window is not None else contextlib.nullcontext()
        if stats and self.routers:
            # (never tiled: the routers' logits are recorded with their gradient)
            with sliding:
                h, stats = self._recording(hidden_states, kwargs, attention_mask, stats)
        else:
            with self._tiled_mlp(hidden_states, tiles.get("mlp_tile")), sliding:
                h = self.layer(hidden_states, **kwargs)
        if self.chained is not None and h[1] is not None:  # (for the next block)
            carried[CHAINED_KEY] = h[1]
        if isinstance(h, tuple):
            h = h[0]
        if self.carries_kv and self.scratch_kwargs:
            # stored here or before, read after: on to the next stage (views of
            # their own, so the stage's backward reaches the stored ones)
            for kind, (k, v) in kwargs[self.scratch_kwargs[0]].items():
                carried[f"{SHARED_KV_PREFIX}{kind}:key"] = k.view_as(k)
                carried[f"{SHARED_KV_PREFIX}{kind}:value"] = v.view_as(v)
        return _boundary(h, position_ids, attention_mask, packed, {**stats, **carried}, tiles)

    def mask_element(self, mask: bool, packed: bool, element: int) -> int:
        """Bytes per ``(query, key)`` pair of the dense mask a stage builds once
        for this layer's kind (:meth:`_mask`, kept for the stage's whole run)
        with a padding ``mask`` or ``packed`` sequences, 0 if none: a boolean
        mask under SDPA (without padding or packing it lets the kernel mask
        causally: none), a mask in the compute dtype (``element`` bytes)
        under eager attention."""
        pad = torch.ones(1, 1) if mask else None
        if self.kind in MASKLESS_KINDS or self.kind in RECURRENT_KINDS:
            return 0
        if self._sliding_window(pad, packed) is not None:
            return 0  # (attention over query tiles, with masks of its own)
        if getattr(self.config, "_attn_implementation", None) != "sdpa":
            return element
        dense = mask or packed or self.always_mask or self.kind in INDEXED_KINDS
        return 1 if dense else 0

    def checkpointed(self) -> bool:
        """Whether transformers checkpoints the block (gradient checkpointing,
        training): its backward recomputes it outside this layer's call, so
        nothing may run differently inside the call (tiles, sliding tiles)."""
        return bool(getattr(self.layer, "gradient_checkpointing", False) and self.layer.training)

    @contextlib.contextmanager
    def _tiled_mlp(self, hidden_states: torch.Tensor, tile: int | None) -> Iterator[None]:
        """While the block runs, its per-token work runs over sequence tiles
        of ``tile`` tokens (:func:`~.tiling.tiled`) when the micro-batch has
        more: the MLP, and every normalisation (RMSNorm / LayerNorm over the
        last dimension: the block's norms, Qwen3's per-head query/key norms),
        which then keep their input alone instead of its fp32 copy.

        A per-token module that reads a norm's output, a projection's output
        or the residual sum of either with the block's input (the MLP after
        the post-attention norm; a linear projection or LoRA linear that
        keeps its input, such as the attention's query/key/value projections
        after the input norm) runs that value's recipe inside its own tiles,
        from the values the backward keeps anyway (:class:`_PerToken`): the
        norms' outputs and the residual after attention are never kept (for
        a Llama block three hidden-sized values per token less), for the
        cost of recomputing them, and the projections, in backward. Set on
        this layer's own copy of the block (each worker has one), for the call."""
        tokens = hidden_states.shape[:-1].numel()
        # (a block whose hidden states have more dimensions than batch,
        # sequence and hidden size, as DeepSeek-V4's streams, runs whole; so
        # does a checkpointed one: its recompute would run untiled)
        if not tile or tokens <= tile or hidden_states.dim() != 3 or self.checkpointed():
            yield
            return
        mlp = None if self.mlp is None else self.layer.get_submodule(self.mlp)
        if mlp is not None and draws_random(mlp):
            mlp = None
        known = _PerToken(hidden_states, max(1, tile // hidden_states.shape[0]))
        wrapped: list[tuple[nn.Module, Any]] = []

        def wrap(module: nn.Module, tiled_forward: Any) -> None:
            wrapped.append((module, module.__dict__.get("forward")))
            module.forward = tiled_forward

        def block_wide(x: torch.Tensor | None) -> bool:
            return x is not None and x.dim() >= 2 and x.shape[:-1].numel() == tokens

        if mlp is not None:
            forward = mlp.forward  # (an instance attribute, if one is set, is kept)

            def tiled_mlp(*args: Any, _forward=forward, **kwargs: Any) -> Any:
                x = _one_tensor(args, kwargs)
                if x is None or x.dim() < 2:
                    return _forward(*args, **kwargs)
                fn, roots, params, _ = known.after(_forward, trainable(mlp), x)
                return known.run(fn, roots, params)

            wrap(mlp, tiled_mlp)
        norms = _norms(self.layer, mlp)
        for norm in norms:

            def tiled_norm(*args: Any, _norm=norm, _forward=norm.forward, **kwargs: Any) -> Any:
                x = _one_tensor(args, kwargs)
                if x is None or x.dim() < 2 or x.shape[-1] != _width(_norm, x):
                    return _forward(*args, **kwargs)
                # rows of the last dimension, as many per tile as ``tile``
                # tokens of the block's input have
                rows = x.reshape(-1, x.shape[-1])
                per_tile = max(1, tile * rows.shape[0] // tokens)
                if rows.shape[0] <= per_tile:
                    return _forward(x)
                out = tiled(_forward, trainable(_norm), rows, per_tile, dim=0).reshape(x.shape)
                if block_wide(x):  # its readers may recompute it in their tiles
                    known.remember(out, *known.after(_forward, trainable(_norm), x)[:3])
                return out

            wrap(norm, tiled_norm)
        skip = [m for m in (mlp, *norms) if m is not None]
        for reader, keeps in _projections(self.layer, skip):

            def projection(
                *args: Any, _reader=reader, _forward=reader.forward, _keeps=keeps, **kwargs: Any
            ) -> Any:
                x = _one_tensor(args, kwargs)
                if not block_wide(x):
                    return _forward(*args, **kwargs)
                fn, roots, params, composed = known.after(_forward, trainable(_reader), x)
                # a projection that keeps its input reads a recomputable value
                # in its tiles; any other computes as usual
                out = known.run(fn, roots, params) if _keeps and composed else _forward(x)
                if _keeps or composed:
                    # (its roots are kept anyway: it keeps its input, or they
                    # are a recipe's; a frozen linear's input may not be)
                    known.remember(out, fn, roots, params)
                return out

            wrap(reader, projection)
        # attention's backward over head groups (CUDA): only where a backward follows
        split = torch.is_grad_enabled() and hidden_states.device.type in attention.SPLIT_DEVICES
        try:
            with GroupedAttention() if split else contextlib.nullcontext():
                yield
        finally:
            for module, own in reversed(wrapped):
                if own is None:
                    del module.forward
                else:
                    module.forward = own

    def _recording(self, hidden_states, kwargs, attention_mask, stats):
        """Run the block recording its routers' logits; add their statistics."""
        logits: list[torch.Tensor] = []
        index = self.router_index

        def record(module, args, output):
            logits.append(output[index] if isinstance(output, tuple) else output)

        handles = [self.layer.get_submodule(p).register_forward_hook(record) for p in self.routers]
        try:
            h = self.layer(hidden_states, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        counts, probs, tokens = (
            stats["router_counts"],
            stats["router_probs"],
            stats["router_tokens"],
        )
        for lg in logits:  # in call order, as transformers sums them
            c, p, t = router_statistics(lg, self.top_k, self.experts, attention_mask)
            counts, probs, tokens = counts + c, probs + p, tokens + t
        return h, {"router_counts": counts, "router_probs": probs, "router_tokens": tokens}


class _Head(nn.Module):
    """Final norm and LM head (its input divided by ``hidden_divisor``,
    MiniCPM3; its output in fp32 with ``float_logits``, Nemotron-H), then
    what the ``*ForCausalLM`` does to the logits: a scale (Cohere), a divisor
    (Granite), tanh soft-capping (Gemma 2/3), the logits cut to the
    unpadded vocabulary (Inkling). Returns
    the logits, or with router statistics a dict of the logits and the
    statistics (the loss function adds the load-balancing term)."""

    input_intact = True  # (as _Decoder's)

    def __init__(
        self,
        norm: nn.Module | None,
        lm_head: nn.Module,
        scale: float | None = None,
        divisor: float | None = None,
        softcap: float | None = None,
        hidden_divisor: float | None = None,
        float_logits: bool = False,
        project_out: nn.Module | None = None,
        cast_to_head: bool = False,
        vocab: float | None = None,
        pre: nn.Module | None = None,
    ) -> None:
        super().__init__()
        # applied before the norm (DeepSeek-V4's hc_head, merging the streams)
        self.pre = pre
        self.cast_to_head = cast_to_head
        # the logits' entries kept (Inkling's unpadded vocabulary; None: all)
        self.vocab = None if vocab is None else int(vocab)
        self.norm = norm if norm is not None else nn.Identity()
        self.project_out = project_out
        self.lm_head = lm_head
        self.hidden_divisor = hidden_divisor
        self.float_logits = float_logits
        self.scale = scale
        self.divisor = divisor
        self.softcap = softcap

    def project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The logits of ``hidden_states`` (each position alone)."""
        hidden_states = self.norm(hidden_states)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        if self.hidden_divisor is not None:
            hidden_states = hidden_states / self.hidden_divisor
        if self.cast_to_head:
            hidden_states = hidden_states.to(self.lm_head.weight.dtype)
        logits = self.lm_head(hidden_states)
        if self.vocab is not None and self.vocab < logits.shape[-1]:
            logits = logits[..., : self.vocab]
        if self.float_logits:
            logits = logits.float()
        if self.scale is not None:
            logits = logits * self.scale
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def forward(
        self,
        hidden_states,
        position_ids=None,
        attention_mask=None,
        packed=False,
        loss_chunk=None,
        mlp_tile=None,
        **router,
    ):
        if self.pre is not None:  # (merges streams: the tokens' hidden states after it)
            hidden_states = self.pre(hidden_states)
        tokens = hidden_states.shape[:-1].numel()
        if loss_chunk and tokens > loss_chunk and not draws_random(self):
            # the loss computes the logits chunk by chunk (tiling.ChunkedLogits)
            pre = {id(p) for p in self.pre.parameters()} if self.pre is not None else set()
            params = [p for p in trainable(self) if id(p) not in pre]
            logits = ChunkedLogits(hidden_states, self.project, params, loss_chunk)
        else:
            logits = self.project(hidden_states)
        stats = _router(router)
        if not stats:
            return logits
        return {"logits": logits, **stats}

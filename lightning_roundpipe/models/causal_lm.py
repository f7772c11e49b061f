"""The adapter for Hugging Face decoder-only causal LMs (every family in
:mod:`.families`, also wrapped by PEFT).

Layers: the embedding stage, one layer per decoder block, the head (see
:mod:`.layers`). Whether a batch has padding or packed sequences is decided on
the host before anything is uploaded, so no layer waits for the device to
answer it. Called with ``labels=`` while training, the loss is computed inside
the pipeline (the fused stage) per micro-batch and weighted by its share of the
batch's labelled tokens, so it equals the unsplit model's loss and full-batch
logits never exist. Config settings and call arguments the pipeline layers do
not implement are refused, never ignored.

Mixture-of-Experts router loss (``output_router_logits=True`` on a family with a
:class:`~.families.RouterAux`): the model adds ``coef *
load_balancing_loss_func(...)``, a function of every layer's routing of the
whole batch. The statistics it needs (per expert: how often it is chosen,
without gradient, and the summed routing probabilities, with gradient; the
number of real tokens) travel as running sums with the hidden states, each
MoE block adding its own, and the loss function adds the term from the sums.
Within one micro-batch this is exact. A micro-batch's backward runs before the
next micro-batch's routing exists, so across micro-batches each micro-batch's
term is the model's aux loss *of that micro-batch*, weighted like its
cross-entropy (its share of the labelled tokens): with ``num_microbatches=1``
the loss equals the unsplit model's exactly. Evaluation (no backward) sums the
statistics of all micro-batches first, so ``aux_loss`` and the loss are the
whole batch's, as the model's. The output's ``router_logits`` stay None.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..runtime.optimizer import NonFiniteError
from ..runtime.profiler import active_parameters
from .attention import attention_heads
from .base import _Adapter, _from_pipeline, _give_factor, _needing_grad
from .layers import (
    ROUTER_KEYS,
    TILE_KEYS,
    _AltUpIn,
    _AltUpOut,
    _Decoder,
    _Embed,
    _Head,
    _PerLayerInputs,
    _RepeatStreams,
    balance_loss,
    is_packed,
)
from .layout import (
    check_config,
    layer_kinds,
    layout_of,
    layout_problem,
    recorded_routers,
    router_recorder,
)
from .memory import ActivationModel, applied_tiles, probe_activations, value_bytes
from .tiling import ChunkedLogits, shifted

__all__ = ["CausalLMAdapter", "causal_lm_loss"]

# a key-value cache argument: transformers renamed past_key_values to cache (5.2x)
_CACHE_ARGS = ("past_key_values", "cache")

# the call arguments a causal LM's adapter reads (CausalLMAdapter.handled)
_HANDLED = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "past_key_values",
    "cache",
    "inputs_embeds",
    "labels",
    "use_cache",
    "logits_to_keep",
    "output_router_logits",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
)

# the loss arguments of transformers' causal LM loss (ForCausalLMLoss), which
# its Trainer passes: a causal LM's adapter reads them, a classifier's does not
_LM_LOSS_ARGS = ("num_items_in_batch", "shift_labels")


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, empty: float | None = 0.0
) -> torch.Tensor:
    """Mean next-token cross-entropy over the real tokens (labels ``-100`` are
    ignored). With none: ``empty`` (0 for a micro-batch, whose weight is then
    0), or, with ``empty=None``, NaN as the model's own loss is."""
    target = shifted(labels).reshape(-1).to(logits.device)
    flat = logits.float().reshape(-1, logits.shape[-1])
    count = (target != -100).sum()
    total = nn.functional.cross_entropy(flat, target, ignore_index=-100, reduction="sum")
    return total / (count if empty is None else count.clamp(min=1))


def _token_counts(labels: list[torch.Tensor]) -> list[int]:
    """Each micro-batch's labelled next tokens."""
    return [int((shifted(y) != -100).sum()) for y in labels]


class _LMLoss:
    """The pipeline's loss function: :func:`causal_lm_loss` of the head's
    logits, plus ``coef`` times the router load-balancing loss of the
    micro-batch when the head returns router statistics."""

    def __init__(self, coef: float, experts: int, scale: float = 1.0) -> None:
        self.coef = coef
        self.experts = experts
        self.scale = scale  # of the cross-entropy (num_items_in_batch=: see _item_scale)

    def __call__(self, out: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = out["logits"] if isinstance(out, dict) else out
        if isinstance(logits, ChunkedLogits):
            loss = logits.loss(labels)
        else:
            loss = causal_lm_loss(logits, labels)
        if self.scale != 1.0:
            loss = loss * self.scale
        if not isinstance(out, dict):
            return loss
        aux = balance_loss(*(out[k] for k in ROUTER_KEYS), self.experts)
        return loss + self.coef * aux.to(loss.device)


# inputs whose presence changes what the layers keep
_SHAPED = ("attention_mask", "packed", "router")


def _has_submodule(module: nn.Module, path: str | None) -> bool:
    if path is None:
        return False
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _scalar(target: nn.Module, path: str | Callable[[Any], Any] | None) -> float | None:
    """A number the model reads at ``path`` (``"config.logits_scaling"``), or
    a family's function of the model giving it."""
    if path is None:
        return None
    value: Any = path(target) if callable(path) else target
    for part in () if callable(path) else path.split("."):
        value = getattr(value, part)
    return None if value is None else float(value)


def _has_per_layer_inputs(config: Any, family: Any) -> bool:
    """Whether this model of a family with per-layer embeddings has them
    (Gemma 4's ``hidden_size_per_layer_input``, 0: none)."""
    return family.per_layer_inputs and bool(getattr(config, "hidden_size_per_layer_input", 0))


def _module_function(target: nn.Module, name: str | None) -> Any:
    """A function of the modeling module the model's ``*Model`` comes from."""
    if name is None:
        return None
    return getattr(sys.modules[type(target).__module__], name)


def _layer_rotary(rotary: nn.Module | None, config: Any, family: Any, i: int) -> nn.Module | None:
    """Layer ``i``'s rotary module: the model's, or (``rotary_by_theta``) the
    one of its list built for the layer's rotary base (None: no positions)."""
    if family.rotary_by_theta is None or rotary is None:
        return rotary
    theta = getattr(config, family.rotary_by_theta)[i]
    if not theta:
        return None
    for module in rotary:
        if module.config.rope_parameters["rope_theta"] == theta:
            return module
    raise ValueError(
        f"config.{family.rotary_by_theta}[{i}]={theta!r} has no rotary module in the model; "
        f"its bases are {[m.config.rope_parameters['rope_theta'] for m in rotary]}"
    )


def _streams(config: Any, family: Any) -> int:
    """How many streams of the hidden states the blocks carry (DeepSeek-V4's
    hyper-connections, Gemma 3n's AltUp; 1: the hidden states alone)."""
    if family.hyper_streams is not None:
        return int(getattr(config, family.hyper_streams))
    return int(config.altup_num_inputs) if family.altup else 1


def _streams_in(base: nn.Module, config: Any, family: Any) -> nn.Module | None:
    """What makes those streams from the embeddings (None: one stream)."""
    if family.altup:
        return _AltUpIn(base)
    if family.hyper_streams is not None:
        return _RepeatStreams(_streams(config, family))
    return None


def _rotary_kinds(config: Any, family: Any) -> tuple[str, ...] | None:
    """The layer types given the rotary table (None: all): the family's, or
    those with rotary settings in ``config.rope_parameters`` (NoPE layers
    have None there)."""
    if not family.nope_without_rope_parameters:
        return family.rotary_kinds
    rope = getattr(config, "rope_parameters", None) or {}
    return tuple(kind for kind, settings in rope.items() if settings is not None)


class CausalLMAdapter(_Adapter):
    """A Hugging Face decoder-only causal LM of a supported family (optionally
    inside PEFT).

    Construction refuses a model whose layout its family entry does not
    describe, or whose config asks for something the pipeline layers do not do
    the way the model does (:func:`~.layout.check_config`)."""

    kind = "Hugging Face causal LM"
    #: whether the model adds its family's router load-balancing loss (a
    #: ``*ForCausalLM`` does; a sequence classifier does not)
    router_loss = True
    #: the call arguments the adapter reads; any other with a value is refused
    handled: tuple[str, ...] = (*_HANDLED, *_LM_LOSS_ARGS)

    def __init__(self, target: nn.Module, name: str) -> None:
        layout = layout_of(target)
        if layout is None:
            why = layout_problem(target) or f"a {type(target).__name__}, not a Hugging Face model"
            raise ValueError(f"{name}: cannot pipeline {why}")
        check_config(target, layout, name)
        self.target = target
        self.name = name
        self.layout = layout
        self.engine = None
        family = layout.family
        config = layout.config  # (a multimodal model's text config)
        self._signature = inspect.signature(type(target).forward)
        aux = family.router_aux if self.router_loss else None
        self._experts = int(getattr(target, aux.experts)) if aux else 0
        self._aux_coef = float(getattr(target, aux.coef)) if aux else 0.0
        recorder = router_recorder(layout.base) if aux else None
        self._recorder = recorder
        top_k = int(getattr(target, aux.top_k)) if aux else 0
        self._layers: list[nn.Module] = [
            _Embed(
                layout.embed,
                positions=layout.positions,
                multiplier=_scalar(target, family.embed_multiplier),
                dropout=layout.dropout,
                experts=self._experts,
                dropout_rate=_scalar(layout.base, family.embed_dropout_rate) or 0.0,
                norm=layout.embed_norm,
                project_in=layout.project_in,
                positions_from_mask=family.positions_from_mask,
                multiply_given=family.multiply_given_embeds,
                per_layer=_PerLayerInputs(layout.base)
                if _has_per_layer_inputs(config, family)
                else None,
                token_ids=family.block_input_ids,
                streams_in=_streams_in(layout.base, config, family),
            )
        ]
        self._streams = _streams(config, family)
        kinds = layer_kinds(config, family, len(layout.layers))
        self._chunked = "chunked_attention" in kinds
        modes = list(getattr(config, family.kv_sharing) or []) if family.kv_sharing else []
        # (a layer passes stored keys and values on while a later one reuses them)
        reused_after = [
            "reuse" in modes[i + 1 :] and any(m == "store" for m in modes[: i + 1])
            for i in range(len(layout.layers))
        ]
        for i, (layer, kind) in enumerate(zip(layout.layers, kinds, strict=True)):
            routers: tuple[str, ...] = ()
            if recorder is not None:
                routers = recorded_routers(layer, f"{family.layers}.{i}", recorder)
            self._layers.append(
                _Decoder(
                    layer,
                    _layer_rotary(layout.rotary, config, family, i),
                    config,
                    kind,
                    rotary_per_kind=family.rotary_per_layer_type,
                    rotary_kinds=_rotary_kinds(config, family),
                    rotary_fp32=kind in family.rotary_fp32_kinds,
                    rotary_dict=family.rotary_dict,
                    chained=family.chained,
                    streams_first=family.altup,
                    nope_scaling=_module_function(target, family.nope_scaling),
                    always_mask=family.always_mask,
                    tiled_sliding=family.tiled_sliding,
                    block_kwargs=dict(family.block_kwargs),
                    scratch_kwargs=family.scratch_kwargs,
                    alibi=_module_function(target, family.alibi),
                    padding_mask_kwarg=family.padding_mask_kwarg,
                    carries_kv=bool(modes) and reused_after[i],
                    kv_role=modes[i] if i < len(modes) else None,
                    routers=routers,
                    router_index=recorder[1] if recorder else 0,
                    top_k=top_k,
                    experts=self._experts,
                    mlp=family.mlp if _has_submodule(layer, family.mlp) else None,
                )
            )
        self._layers.append(self._head(target, layout))
        # transient elements per token of a loss chunk (the logits in the compute
        # dtype, their fp32 copy, its softmax and gradient) and of an MLP tile
        # (its intermediates and their gradients: about twice its active
        # parameters per hidden unit)
        self._vocab = int(config.vocab_size)
        self._logit_width = self._vocab  # (the head's output per token)
        mlps = [d.layer.get_submodule(d.mlp) for d in self._layers[1:-1] if d.mlp is not None]
        hidden = int(config.hidden_size)
        self._mlp_width = max((2 * active_parameters(m) / hidden for m in mlps), default=0.0)
        self._moe_output = "router_logits" in (
            getattr(type(layout.base), "_can_record_outputs", None) or {}
        )
        # numbers the model reads at every forward (a router coefficient or a
        # logit scale a callback anneals): read again at every call
        embed = self._layers[0]
        self._numbers = [
            (embed, "multiplier", target, family.embed_multiplier),
            (embed, "dropout_rate", layout.base, family.embed_dropout_rate),
            *self._head_numbers(target),
        ]

    def _head(self, target: nn.Module, layout: Any) -> nn.Module:
        """The last pipeline layer: the final norm and LM head, then what the
        ``*ForCausalLM`` does to the logits."""
        family = layout.family
        return _Head(
            layout.norm,
            layout.lm_head,
            scale=_scalar(target, family.logit_scale),
            divisor=_scalar(target, family.logit_divisor),
            softcap=_scalar(target, family.logit_softcap),
            hidden_divisor=_scalar(target, family.hidden_divisor),
            float_logits=family.float_logits,
            project_out=layout.project_out,
            cast_to_head=family.cast_to_head,
            vocab=_scalar(target, family.logit_vocab),
            pre=_AltUpOut(layout.base) if family.altup else layout.head_pre,
        )

    def _head_numbers(self, target: nn.Module) -> list[tuple[nn.Module, str, Any, Any]]:
        """The head's numbers read again at every call (see ``_numbers``)."""
        head, family = self._layers[-1], self.layout.family
        return [
            (head, "scale", target, family.logit_scale),
            (head, "divisor", target, family.logit_divisor),
            (head, "softcap", target, family.logit_softcap),
            (head, "hidden_divisor", target, family.hidden_divisor),
        ]

    def layers(self) -> list[nn.Module]:
        return self._layers

    def _layer_names(self) -> list[tuple[str, str]]:
        blocks = [("block", "blocks")] * (len(self._layers) - 2)
        return [("embed", "embed"), *blocks, ("head", "head")]

    def boundary_estimate(self, dtype: torch.dtype) -> Callable[[Any], int]:
        """Hidden states in the compute dtype (all their streams, DeepSeek-V4)
        plus the positions, mask, router statistics and token ids that travel
        with them, and (Gemma 4) the per-layer embeddings still to be used and
        the keys and values stored for later layers, at most all of them (the
        first boundary's)."""
        size = torch.empty(0, dtype=dtype).element_size()
        config = self.layout.config
        hidden = int(config.hidden_size) * self._streams
        router = self._experts * 16 + 8
        per_token = 0
        ids_bytes = 8 if self._layers[0].token_ids else 0  # (the token ids, carried)
        if self._layers[0].per_layer is not None:
            per_token += int(config.hidden_size_per_layer_input) * len(self._layers[1:-1])
        if any(d.carries_kv for d in self._layers[1:-1]):
            heads = attention_heads(config)
            if heads is not None:  # keys and values of each stored layer type
                kinds = {d.kind for d in self._layers[1:-1]}
                per_token += 2 * len(kinds) * heads[1] * heads[2]

        def estimate(inputs: Any) -> int:
            ids = inputs.get("input_ids")
            tokens = ids.numel() if ids is not None else inputs["inputs_embeds"].shape[:-1].numel()
            out = value_bytes(tokens, hidden, size)  # hidden states, positions
            out += tokens * per_token * size + tokens * ids_bytes
            mask = inputs.get("attention_mask")
            if mask is not None:
                out += mask.numel() * mask.element_size()
            if inputs.get("router"):
                out += router
            return out

        return estimate

    def tile_sizes(self, loss: bool) -> dict[str, int]:
        """Tokens per loss chunk (with ``loss``: the loss is computed in the
        pipeline) and per tile of a block's per-token work, from the engine's
        ``tile_budget``; the layers tile only micro-batches with more tokens
        than that."""
        budget = self.engine.tile_budget if self.engine is not None else None
        if budget is None:
            return {}
        return self.tiles_for(budget, self.engine.compute_dtype, loss)

    def tiles_for(self, budget: int, dtype: torch.dtype, loss: bool = True) -> dict[str, int]:
        """The tile sizes for a ``budget`` of bytes per tile in ``dtype``: a
        loss chunk's logits (compute dtype, fp32 copy, softmax and gradient)
        and a block tile's MLP intermediates with their gradients (where the
        block has no tiled MLP, its norms' fp32 working values, ~16 bytes per
        hidden unit)."""
        size = torch.empty(0, dtype=dtype).element_size()
        out = {}
        if loss:
            out["loss_chunk"] = max(1, int(budget // (self._vocab * (2 * size + 12))))
        if any(d.checkpointed() for d in self._layers[1:-1]):
            return out  # (checkpointed blocks run whole: see _Decoder.checkpointed)
        hidden = int(self.layout.config.hidden_size)
        per_token = self._mlp_width * size or 16 * hidden
        out["mlp_tile"] = max(1, int(budget // per_token))
        return out

    def activation_model(
        self,
        dtype: torch.dtype,
        tiles: dict[str, int],
        *,
        loss: bool,
        mask: bool = False,
        packed: bool = False,
        router: bool = False,
        prepare: Callable[[nn.Module], nn.Module] | None = None,
    ) -> ActivationModel:
        """What this model's pipeline layers keep and work with for a
        micro-batch, measured by short probes in ``dtype`` with the call's
        tiling (``tiles``, :meth:`tile_sizes`), padding ``mask``, ``packed``
        sequences, ``router`` statistics and the ``loss`` computed in the
        pipeline (:func:`~.memory.probe_activations`, which also says what
        ``prepare`` does); cached per setting."""
        key = (dtype, tuple(sorted(tiles.items())), loss, mask, packed, router)
        cache = self.__dict__.setdefault("_activation_models", {})
        # the layers' probes, shared by the settings that differ in tiles alone
        memos = self.__dict__.setdefault("_layer_probes", {})
        memo = memos.setdefault((dtype, loss, mask, packed, router, prepare), {})
        if key not in cache:
            cache[key] = probe_activations(
                self._layers,
                dtype,
                hidden=int(self.layout.config.hidden_size),
                vocab=self._vocab,
                logit_width=self._logit_width,
                tiles=tiles,
                loss=_LMLoss(self._aux_coef, self._experts) if loss else None,
                mask=mask,
                packed=packed,
                router=router,
                prepare=prepare,
                attention=attention_heads(self.layout.config),
                memo=memo,
            )
        return cache[key]

    def _expect(self, inputs: dict[str, Any], batch: torch.Tensor, loss: bool) -> None:
        """Before a training call: the engine learns the predicted activation
        memory of this call's micro-batches (and re-plans if they would not
        fit). Only where a stage memory limit exists."""
        engine = self.engine
        if engine.memory_limit is None or batch.dim() < 2:
            return
        seq = int(batch.shape[1])
        micro = -(-int(batch.shape[0]) // engine.num_microbatches)
        tiles = applied_tiles({k: inputs[k] for k in TILE_KEYS if k in inputs}, seq * micro)
        shape = (seq, micro, tuple(sorted(tiles.items())), *(k in inputs for k in _SHAPED))
        if shape == self.__dict__.get("_expected"):
            return
        model = self.activation_model(
            engine.compute_dtype,
            tiles,
            loss=loss,
            mask="attention_mask" in inputs,
            packed="packed" in inputs,
            router="router" in inputs,
        )
        # one layer input of a micro-batch: the batch's share
        boundary = self.boundary_estimate(engine.compute_dtype)(inputs) * micro / batch.shape[0]
        cuda = engine.devices[0].type == "cuda"
        engine.expect_activations(
            model.saved_bytes(seq, micro), model.transient_bytes(seq, micro, cuda=cuda), boundary
        )
        self._expected = shape

    def _cache(self, past_key_values: Any, use_cache: bool | None) -> bool:
        """Whether the model would run with a key-value cache (it then never
        treats ``position_ids`` as packed sequences): given, or ``use_cache``
        defaulting to the config's, off under gradient checkpointing in training."""
        if past_key_values is not None:
            return True
        if use_cache is None:
            use_cache = bool(getattr(self.layout.config, "use_cache", False))
        base = self.layout.base
        if use_cache and getattr(base, "gradient_checkpointing", False) and base.training:
            return False
        return bool(use_cache)

    def _token_weights(self, labels: list[torch.Tensor]) -> list[float]:
        """Each micro-batch's share of the batch's labelled tokens, so the sum
        of the weighted micro-batch losses is the model's loss (the one place
        the loss weighting is decided; a micro-batch's router loss, when on,
        gets the same weight)."""
        counts = _token_counts(labels)
        if labels and labels[0].shape[-1] <= 1:  # (nothing to predict the next token of)
            return self._shares(counts, "token", "sequences of one token have no next token")
        return self._shares(counts, "token")

    def _item_weights(self, labels: list[torch.Tensor]) -> list[float]:
        """:meth:`_token_weights` for a call with ``num_items_in_batch=``,
        whose loss is a sum, 0 with no labelled token (each micro-batch's
        cross-entropy is then 0 and scaled by 0; its router loss, when on,
        weighs alike in each)."""
        counts = _token_counts(labels)
        total = sum(counts)
        return [c / total if total else 1 / len(counts) for c in counts]

    def _shares(
        self, counts: list[int], what: str, none: str = "every label is -100"
    ) -> list[float]:
        """Each micro-batch's share of the batch's labelled ``what``s. None
        labelled (``none`` says how that looks): NaN, as the model's own loss
        is (0 / 0); refused first with ``nonfinite="raise"``."""
        total = sum(counts)
        if total:
            return [c / total for c in counts]
        engine = self.engine
        # (fp16: the loss scaler skips the step, as Lightning's GradScaler does)
        if engine is not None and engine.nonfinite == "raise" and not engine.scaler.enabled:
            raise NonFiniteError(
                f"{self.name}: the batch has no labelled {what} ({none}), so its "
                "loss is NaN, as the model itself returns it; the weights were not updated. "
                "Filter such batches out, or set nonfinite='skip' to skip their steps"
            )
        return [math.nan] * len(counts)

    def _arguments(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by name, bound as the model's own ``forward``
        binds them (families order their positional arguments differently);
        arguments the pipeline does not implement are refused."""
        try:
            bound = self._signature.bind(self.target, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}: {exc}") from None
        values: dict[str, Any] = {}
        for i, (key, value) in enumerate(bound.arguments.items()):
            if i == 0:
                continue  # self
            kind = self._signature.parameters[key].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                values.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                if value:
                    raise TypeError(f"{self.name}: unexpected positional arguments {value!r}")
            else:
                values[key] = value
        unknown = sorted(k for k, v in values.items() if k not in self.handled and v is not None)
        if unknown:
            raise TypeError(
                f"{self.name}: arguments {unknown} are not supported by the RoundPipe pipeline; "
                "call the model without them"
            )
        return values

    def _check_call(self, a: dict[str, Any]) -> None:
        """Refuse call arguments the pipeline would otherwise ignore."""
        name = self.name
        attention_mask, labels = a.get("attention_mask"), a.get("labels")
        for arg in _CACHE_ARGS:
            if a.get(arg) is not None:
                raise TypeError(
                    f"{name}: {arg} is not supported by the RoundPipe pipeline (it keeps no "
                    f"key-value cache, so e.g. prefix tuning cannot work); call the model without "
                    f"{arg}, e.g. generate(..., use_cache=False) during a fit (after it, the "
                    "model is plain again and generates with its cache)"
                )
        if a.get("use_cache") and self._cache(None, True):
            # (the config's use_cache, or none given, is fine: the output has no cache)
            raise TypeError(
                f"{name}: use_cache=True asks for a key-value cache back, which the RoundPipe "
                "pipeline does not keep (the next call would compute without the context); "
                "call the model without use_cache, e.g. generate(..., use_cache=False) during "
                "a fit (after it, the model is plain again and generates with its cache)"
            )
        if attention_mask is not None and (
            not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2
        ):
            raise TypeError(
                f"{name}: attention_mask must be a 2-D (batch, sequence) padding mask, got "
                f"{_shape(attention_mask)}; the pipeline builds each layer's mask itself, so "
                "prepared masks are not supported"
            )
        positions = a.get("position_ids")
        if positions is not None and (
            not isinstance(positions, torch.Tensor) or positions.dim() not in (1, 2)
        ):
            raise TypeError(
                f"{name}: position_ids must be a (sequence) or (batch or 1, sequence) tensor, got "
                f"{_shape(positions)}; "
                "the pipeline splits them with the batch (multimodal rotary positions, one row "
                "per axis, are not supported): pass the text positions"
            )
        for key in ("output_attentions", "output_hidden_states"):
            if a.get(key):
                raise TypeError(
                    f"{name}: {key}=True is not supported by the RoundPipe pipeline (it returns "
                    f"the loss and logits only); call the model without {key}"
                )
        if (
            a.get("output_router_logits")
            and self.router_loss
            and self.layout.family.router_aux is None
            # (a MoE model records router logits even where its config has no such setting)
            and (hasattr(self.layout.config, "output_router_logits") or self._moe_output)
        ):
            raise TypeError(
                f"{name}: output_router_logits=True is not supported by the RoundPipe pipeline: "
                f"{type(self.target).__name__} adds no router loss, it would only return every "
                "router's logits, and the pipeline returns the loss and logits; call the model "
                "without output_router_logits"
            )
        if labels is not None:
            self._check_labels(a)

    def _loss_arguments(self, a: dict[str, Any]) -> float | None:
        """transformers' causal LM loss arguments, as its loss reads them (only
        with ``labels=``; without, the model ignores them too):
        ``shift_labels`` (the targets already shifted, used instead of the
        labels) becomes the labels it is the shift of, and the factor that
        turns the mean over the batch's labelled tokens into their sum over
        ``num_items_in_batch`` is returned (None: no such argument)."""
        labels, shift = a.get("labels"), a.get("shift_labels")
        items = a.get("num_items_in_batch")
        if labels is None:
            return None
        if shift is not None:
            if not isinstance(shift, torch.Tensor) or shift.shape != labels.shape:
                raise TypeError(
                    f"{self.name}: shift_labels must be a tensor of the labels' shape "
                    f"{tuple(labels.shape)}, got {_shape(shift)}"
                )
            if bool((shift[..., -1] != -100).any()):
                raise ValueError(
                    f"{self.name}: shift_labels with a target at the last position (the next "
                    "token of a sequence that goes on past this batch, as context-parallel "
                    "shards have) is not supported by the RoundPipe pipeline, whose loss "
                    "predicts tokens within each sequence; set shift_labels[..., -1] to -100, "
                    "or pass labels= alone"
                )
            first = torch.full_like(shift[..., :1], -100)
            a["labels"] = labels = torch.cat([first, shift[..., :-1]], dim=-1)
        if items is None:
            return None
        count = float(items.item() if isinstance(items, torch.Tensor) else items)
        if not count > 0:
            raise ValueError(
                f"{self.name}: num_items_in_batch must be a positive number of labelled "
                f"tokens, got {items!r}"
            )
        return float((shifted(labels) != -100).sum()) / count

    def _check_labels(self, a: dict[str, Any]) -> None:
        """Refuse a call with ``labels=`` whose loss the pipeline would not
        compute as the model does."""
        logits_to_keep = a.get("logits_to_keep", 0)
        if not _keeps_all(logits_to_keep):
            raise TypeError(
                f"{self.name}: logits_to_keep={logits_to_keep!r} with labels= is not supported by "
                "the RoundPipe pipeline (the loss needs every position's logits); call the model "
                "without logits_to_keep"
            )
        _check_loss(self.target, self.name)

    def _router_loss(self, a: dict[str, Any]) -> bool:
        """Whether this call adds the router load-balancing loss (the call's
        ``output_router_logits``, else the config's, as the model decides)."""
        if self.layout.family.router_aux is None or not self.router_loss:
            return False
        on = a.get("output_router_logits")
        if on is None:
            on = getattr(self.layout.config, "output_router_logits", False)
        if on and self._recorder is None:
            raise ValueError(
                f"{self.name}: cannot find the routers of {type(self.layout.base).__name__} (its "
                "_can_record_outputs names no router class for 'router_logits'), so the pipeline "
                "cannot add the router load-balancing loss; set output_router_logits=False"
            )
        return bool(on)

    def _read_numbers(self) -> None:
        """The model's current scalars onto the pipeline layers (a changed one
        makes the layer's replicas new: the engine compares the layers'
        attributes at every call) and the router loss coefficient."""
        for module, attr, root, path in self._numbers:
            if path is None:
                continue
            value = _scalar(root, path)
            if attr == "dropout_rate":
                value = value or 0.0
            if getattr(module, attr) != value:
                setattr(module, attr, value)
        aux = self.layout.family.router_aux
        if aux and self.router_loss:
            self._aux_coef = float(getattr(self.target, aux.coef))

    def _prepare(
        self, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], torch.Tensor, bool]:
        """A call's arguments checked and turned into the pipeline's inputs:
        ``(arguments by name, inputs, batch tensor, as_tuple)``; while
        training, the engine has learnt the call's activation memory."""
        self._read_numbers()
        a = self._arguments(args, kwargs)
        input_ids, inputs_embeds = a.get("input_ids"), a.get("inputs_embeds")
        attention_mask, position_ids = a.get("attention_mask"), a.get("position_ids")
        if (input_ids is None) ^ (inputs_embeds is not None):
            # the model's own check, with its message (the Llama family's)
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        self._check_call(a)
        # return_dict=False (or, when not given or None as PEFT's wrapper passes
        # it, the config's return_dict): the model's tuple form
        as_tuple = a.get("return_dict")
        if as_tuple is None:
            as_tuple = getattr(self.layout.config, "return_dict", True)
        as_tuple = not as_tuple
        # the batch tensor: token ids, or embeddings (split into micro-batches
        # along dim 0 like the ids; floating, so uploaded in the compute dtype)
        batch = input_ids if input_ids is not None else inputs_embeds
        inputs: dict[str, Any] = (
            {"input_ids": input_ids} if input_ids is not None else {"inputs_embeds": inputs_embeds}
        )
        # decided here, on the host, so no stage has to read device values: a
        # mask without padding is no mask (the model would skip it too), and
        # packed sequences are detected from the positions (as the model does,
        # packing is looked for only with no mask and no cache, by the families
        # that give their mask functions the positions)
        if attention_mask is not None and not bool(attention_mask.all()):
            inputs["attention_mask"] = attention_mask
        if position_ids is not None:
            if position_ids.dim() == 1:
                position_ids = position_ids.unsqueeze(0)
            if position_ids.shape[0] != batch.shape[0]:
                position_ids = position_ids.expand(batch.shape[0], -1)
            inputs["position_ids"] = position_ids
            self._check_longrope(position_ids)
            given = next((a[k] for k in _CACHE_ARGS if a.get(k) is not None), None)
            no_cache = not self._cache(given, a.get("use_cache"))
            packs = self.layout.packs_sequences
            if packs and attention_mask is None and no_cache and is_packed(position_ids):
                if self._chunked:
                    _check_packed_chunks()
                inputs["packed"] = True
        self._check_dynamic_rope(batch, position_ids)
        if self._router_loss(a):
            inputs["router"] = True
        training = self._wants_backward(inputs)
        loss = a.get("labels") is not None
        inputs.update(self.tile_sizes(loss=training and loss))
        if training:
            self._expect(inputs, batch, loss=loss)
        return a, inputs, batch, as_tuple

    def _check_dynamic_rope(self, batch: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        """rope_type='dynamic' rescales its frequencies, replacing a buffer of
        the rotary embedding, in the forward of a call longer than any before
        (than ``max_position_embeddings`` at first): state the pipeline's
        copies cannot follow (each worker's would rescale on its own). Refused
        here, before anything runs, rather than by the worker that saw it."""
        rotary = self.layout.rotary
        kinds = getattr(rotary, "rope_type", None)
        kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
        if not any(isinstance(k, str) and "dynamic" in k for k in kinds):
            return
        end = int(position_ids.max()) + 1 if position_ids is not None else int(batch.shape[1])
        cached = getattr(rotary, "max_seq_len_cached", None)
        if cached is None or end <= int(cached):
            return
        raise ValueError(
            f"{self.name}: rope_type='dynamic' rescales its frequencies when a sequence is "
            f"longer than any before, which the pipeline's copies of the layers cannot follow, "
            f"and this batch reaches position {end} (max_position_embeddings="
            f"{self.layout.config.max_position_embeddings}): train with sequences of at most "
            f"{int(cached)} tokens, or use 'linear' or 'yarn' rope scaling"
        )

    def _check_longrope(self, position_ids: torch.Tensor) -> None:
        """LongRoPE picks its short or long frequencies from the largest
        position of a call: the model's one call sees the batch's, each
        micro-batch its own. Refused where they would pick differently (rows'
        positions on both sides of ``original_max_position_embeddings``)."""
        rotary, engine = self.layout.rotary, self.engine
        kinds = getattr(rotary, "rope_type", None)
        kinds = kinds if isinstance(kinds, dict) else {None: kinds}
        if "longrope" not in kinds.values() or engine is None:
            return
        rows = int(position_ids.shape[0])
        m = engine.microbatches_for(rows, torch.is_grad_enabled())
        ends = [int(p.max()) + 1 for p in torch.tensor_split(position_ids, m) if p.numel()]
        params = self.layout.config.rope_parameters or {}
        for kind, rope in kinds.items():
            limit = (params.get(kind) if kind is not None else params) or {}
            limit = limit.get("original_max_position_embeddings") if rope == "longrope" else None
            if limit is not None and min(ends) <= limit < max(ends):
                raise ValueError(
                    f"{self.name}: rope_type='longrope' picks its short or long frequencies from "
                    "the largest position of each call, and this batch's micro-batches would "
                    f"pick differently (their largest positions reach {min(ends)} to "
                    f"{max(ends)} tokens, original_max_position_embeddings={limit}), where the "
                    "model's one call picks the long set for every row. Keep each batch's rows "
                    "on one side of it (group packed sequences by length), or set "
                    "num_microbatches=1"
                )

    def call(self, *args: Any, **kwargs: Any) -> Any:
        a, inputs, _, as_tuple = self._prepare(args, kwargs)
        scale = self._loss_arguments(a)  # (num_items_in_batch=: the sum over it)
        labels, logits_to_keep = a.get("labels"), a.get("logits_to_keep", 0)
        router = "router" in inputs
        engine = self.engine
        training = self._wants_backward(inputs)
        if training and labels is not None:
            # the gradient factor (Lightning's accumulation division, a scaled or
            # combined loss) is whatever autograd brings to the returned loss
            loss = engine.forward_backward(
                inputs,
                labels=labels,
                loss_fn=_LMLoss(self._aux_coef, self._experts, 1.0 if scale is None else scale),
                loss_weights=self._token_weights if scale is None else self._item_weights,
                scale="later",
                input_grads=bool(_needing_grad(inputs)),
            )
            loss = _from_pipeline(loss, engine, engine.iteration - 1, inputs, _give_factor)
            return self._output(as_tuple, loss=loss, logits=None)
        if training:
            if router:
                raise ValueError(
                    f"{self.name}: output_router_logits=True while training without labels= is "
                    "not supported by the RoundPipe pipeline (the router load-balancing loss is "
                    "added inside the pipeline, to the loss it computes from labels=); call the "
                    "model with labels=, or set output_router_logits=False"
                )
            logits = self._outputs_with_backward(inputs)
            return self._output(as_tuple, logits=_keep(logits, logits_to_keep))
        # (the head's logits are batch-first; its router statistics, one row
        # per micro-batch, are put together as they are)
        out = engine.forward(inputs, per_microbatch=True)
        aux = None
        if isinstance(out, dict):  # router statistics of every micro-batch
            aux = balance_loss(*(out[k] for k in ROUTER_KEYS), self._experts)
            out = out["logits"]
        loss = None
        if labels is not None:
            if scale is None:
                loss = causal_lm_loss(out, labels, empty=None)
            else:  # (none labelled: 0, the sum over num_items_in_batch)
                loss = causal_lm_loss(out, labels) * scale
            if aux is not None:
                loss = loss + self._aux_coef * aux
        return self._output(as_tuple, loss=loss, logits=_keep(out, logits_to_keep), aux_loss=aux)

    def _output(self, as_tuple: bool, aux_loss: torch.Tensor | None = None, **fields: Any) -> Any:
        """The model's output type: ``MoeCausalLMOutputWithPast`` for models
        that record router logits, else ``CausalLMOutputWithPast``; with
        ``as_tuple`` (``return_dict=False``) its tuple, as the model gives it
        (the fields that are not None, in order)."""
        from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

        if self._moe_output:
            out = MoeCausalLMOutputWithPast(aux_loss=aux_loss, **fields)
        else:
            out = CausalLMOutputWithPast(**fields)
        return out.to_tuple() if as_tuple else out


def _shape(x: Any) -> Any:
    """A call argument's shape for an error message (its type if not a tensor)."""
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _keeps_all(logits_to_keep: Any) -> bool:
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


def _keep(logits: torch.Tensor, logits_to_keep: Any) -> torch.Tensor:
    """The model's ``logits_to_keep`` selection (it selects hidden states before
    the LM head, which acts on each position alone: the same logits)."""
    if _keeps_all(logits_to_keep):
        return logits
    if isinstance(logits_to_keep, torch.Tensor):
        logits_to_keep = logits_to_keep.to(logits.device)
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:  # transformers < 5.21: the models sliced the positions inline
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return logits[:, keep, :]
    return slice_logits_to_keep(logits, logits_to_keep)


def _check_packed_chunks() -> None:
    """Chunked attention (Llama 4) over packed sequences counts chunks from each
    sequence's own positions from transformers 5.23 on; refuse it before."""
    from transformers import masking_utils

    if not hasattr(masking_utils, "remap_positions_for_packed_sequence"):
        raise ValueError(
            "packed sequences (position_ids that restart, no attention_mask) in a model with "
            "chunked attention need transformers>=5.23, whose masks count chunks from each "
            "sequence's own positions; upgrade transformers, or pass an attention_mask"
        )


def _check_loss(target: nn.Module, name: str) -> None:
    """With ``labels=`` the pipeline computes the standard next-token
    cross-entropy (``ForCausalLMLoss``); refuse a model set to another loss."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    fn = target.loss_function
    if fn is not ForCausalLMLoss:
        raise ValueError(
            f"{name}: the model's loss_function is {getattr(fn, '__name__', fn)!r}, but with "
            "labels= the RoundPipe pipeline computes the standard next-token cross-entropy "
            "(ForCausalLMLoss); call the model without labels= and compute the loss from the "
            "logits"
        )

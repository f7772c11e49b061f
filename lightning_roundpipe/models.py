"""Model adapters: find a module's layer stack and run calls to it through the pipeline.

An adapter knows, for one kind of model, (1) the ordered pipeline layers (made
of the model's own submodules, so parameters and ``state_dict`` keys stay as
they are), (2) which module to intercept, and (3) how a call to that module
becomes engine work:

* :class:`SequentialAdapter`: an ``nn.Sequential``; a call returns the outputs;
  with autograd on, ``backward`` of anything computed from them runs the
  pipelined backward (the engine re-runs the forward with the output gradient).
* :class:`CausalLMAdapter`: Hugging Face causal LMs of the Llama family (Llama,
  Qwen2, Qwen3, Mistral; also wrapped by PEFT). Layers: the token embedding
  (or the given ``inputs_embeds``), each decoder layer (the mask the model
  itself builds for that layer, full or sliding-window causal, and the rotary
  embeddings are built from
  ``position_ids`` and the 2-D ``attention_mask`` by a stage's first decoder
  layer, once per micro-batch, and shared by the stage's other layers, so only
  the hidden states cross stage boundaries), and norm + LM head. Whether a batch
  has padding or packed sequences is decided on the host before anything is
  uploaded, so no layer waits for the device to answer it. Called with
  ``labels=`` while training, the loss is computed inside the pipeline (the
  fused stage) per micro-batch and weighted by its share of the batch's real
  tokens, so it equals the unsplit model's loss and full-batch logits never
  exist. Config settings and call arguments the pipeline layers do not
  implement are refused, never ignored.

:func:`find_adapter` picks the adapter for a LightningModule: the candidate
stack holding most of its parameters, refused when that is not clear.
``describe_layers()`` gives the layer numbering that plan strings use.
"""

from __future__ import annotations

import logging
import math
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .runtime.engine import EngineClosedError
from .runtime.nested import flatten_tensors
from .runtime.optimizer import NonFiniteError
from .runtime.scope import stage_cached

if TYPE_CHECKING:
    from .runtime import RoundPipeEngine

__all__ = ["CausalLMAdapter", "LayerStackNotFound", "SequentialAdapter", "find_adapter"]

log = logging.getLogger(__name__)


class LayerStackNotFound(ValueError):
    """No pipeline layer stack could be found in the module."""


class _FromPipeline(torch.autograd.Function):
    """A value the pipeline computed (outputs, or a loss whose backward already
    ran inside it); its backward runs ``run(grad)``, which returns the
    gradients of the pipeline's inputs that require one (``needs``)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, value: torch.Tensor, run, *needs) -> torch.Tensor:
        ctx.run = run
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None, None, *ctx.run(grad)


def _from_pipeline(
    value: torch.Tensor,
    engine: RoundPipeEngine,
    iteration: int,
    inputs: Any,
    backward: Callable[[RoundPipeEngine, int, torch.Tensor], float],
) -> torch.Tensor:
    """``value`` in the caller's graph: when autograd reaches it,
    ``backward(engine, iteration, grad)`` runs or completes the pipeline's backward and
    returns the factor the inputs' gradients are then taken with. The graph
    refers to the engine weakly: a graph that outlives it (a failed batch run
    again on a re-planned engine) does not keep it alive."""
    engine_ref = weakref.ref(engine)
    needs = _needing_grad(inputs)

    def run(grad: torch.Tensor) -> list[torch.Tensor | None]:
        eng = engine_ref()
        if eng is None:
            raise EngineClosedError(
                "backward reached a value of a RoundPipe engine that no longer exists"
            )
        factor = backward(eng, iteration, grad)
        if not needs:
            return []
        grads = eng.input_grads(iteration)
        return [None if grads[i] is None else grads[i] * factor for i in needs]

    flat = flatten_tensors(inputs)
    return _FromPipeline.apply(_anchor(), value, run, *(flat[i] for i in needs))


def _needing_grad(inputs: Any) -> list[int]:
    """Positions (in ``flatten_tensors`` order) of input tensors that require a
    gradient: embeddings from a trainable module outside the pipeline."""
    if not torch.is_grad_enabled():
        return []
    return [i for i, t in enumerate(flatten_tensors(inputs)) if t.requires_grad]


def _anchor() -> torch.Tensor:
    return torch.zeros((), requires_grad=True)


class _Adapter(ABC):
    """Common interception: patch ``target.forward``, restore on ``detach``."""

    target: nn.Module

    @abstractmethod
    def layers(self) -> list[nn.Module]:
        """The pipeline layers, in order."""

    @abstractmethod
    def _layer_names(self) -> list[tuple[str, str]]:
        """Each pipeline layer's kind: (name, plural name)."""

    def describe_layers(self) -> str:
        """The pipeline layers by index, as plan strings count them, runs of one
        kind collapsed: ``"0 embed, 1-28 blocks, 29 head"`` for a causal LM,
        ``"0 Linear, 1 ReLU, 2-5 Block, 6 Linear"`` for an ``nn.Sequential``."""
        names = self._layer_names()
        parts, start = [], 0
        for i in range(1, len(names) + 1):
            if i < len(names) and names[i] == names[start]:
                continue
            one, many = names[start]
            parts.append(f"{start} {one}" if i - start == 1 else f"{start}-{i - 1} {many}")
            start = i
        return ", ".join(parts)

    def attach(self, engine: RoundPipeEngine) -> None:
        self.engine = engine
        adapter = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            return adapter.call(*args, **kwargs)

        self.target.forward = forward  # instance attribute shadows the class method

    def detach(self) -> None:
        self.target.__dict__.pop("forward", None)
        self.engine = None

    def boundary_estimate(self, dtype: torch.dtype) -> Callable[[Any], int] | None:
        """Bytes of one stage-boundary value of a micro-batch, from its input,
        before anything ran (None: the engine measures it in the first step)."""
        return None

    @abstractmethod
    def call(self, *args: Any, **kwargs: Any) -> Any:
        """What a call to the intercepted module does."""

    def _outputs_with_backward(self, inputs: Any) -> torch.Tensor:
        """Forward now; when autograd reaches the outputs, run the pipelined
        backward with their gradient (same iteration: same dropout masks)."""
        engine = self.engine
        it = engine.reserve_iteration()
        out = engine.forward(inputs, iteration=it)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                "with autograd on, the pipeline's last layer must return a tensor when the loss "
                f"is computed outside the model; it returned {type(out).__name__}"
            )

        wants_input_grads = bool(_needing_grad(inputs))

        def backward(eng: RoundPipeEngine, iteration: int, grad: torch.Tensor) -> float:
            eng.forward_backward(
                inputs,
                labels=grad,
                loss_fn=_dot,
                iteration=iteration,
                loss_weights=_unit_weights,
                input_grads=wants_input_grads,
            )
            return 1.0

        value = out.float() if out.is_floating_point() else out
        return _from_pipeline(value, engine, it, inputs, backward)


def _give_factor(engine: RoundPipeEngine, iteration: int, grad: torch.Tensor) -> float:
    """The backward of a loss computed inside the pipeline already ran: the
    gradient autograd brings is the factor its weight gradients (and input
    gradients) join with."""
    factor = float(grad)
    engine.scale_gradients(iteration, factor)
    return factor


def _unit_weights(labels: list[Any]) -> list[float]:
    """Every micro-batch's output gradient counts once."""
    return [1.0] * len(labels)


def _dot(out: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient with respect to ``out`` is ``grad``."""
    return (out.float() * grad.to(out.device, torch.float32)).sum()


# --------------------------------------------------------------- Sequential
class SequentialAdapter(_Adapter):
    """An ``nn.Sequential``: its children are the pipeline layers."""

    kind = "nn.Sequential"

    def __init__(self, target: nn.Sequential, name: str) -> None:
        self.target = target
        self.name = name

    def layers(self) -> list[nn.Module]:
        return list(self.target)

    def _layer_names(self) -> list[tuple[str, str]]:
        return [(type(c).__name__, type(c).__name__) for c in self.target]

    def call(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) != 1:
            raise TypeError(f"{self.name} (nn.Sequential) takes one input")
        (x,) = args
        if torch.is_grad_enabled() and self.target.training:
            return self._outputs_with_backward(x)
        return self.engine.forward(x)


# ------------------------------------------------------------ causal LMs
# How each family's model picks a decoder layer's mask (read from its
# ``*Model.forward`` in transformers 5): LlamaModel builds one causal mask for
# every layer; MistralModel a sliding-window mask for every layer whenever
# ``config.sliding_window`` is not None (it never reads ``layer_types``);
# Qwen2Model and Qwen3Model the mask named by ``config.layer_types[i]``.
_MASK_RULES = {
    "llama": "full",
    "mistral": "sliding_window",
    "qwen2": "layer_types",
    "qwen3": "layer_types",
}
_HF_FAMILIES = tuple(_MASK_RULES)
_LAYER_TYPES = ("full_attention", "sliding_attention")
# attention implementations whose mask the adapter builds exactly as the model
# does and whose result does not depend on how the batch is split
_ATTENTION = ("eager", "sdpa")


def _is_causal_lm(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    inner = getattr(module, "model", None)
    return (
        config is not None
        and getattr(config, "model_type", None) in _HF_FAMILIES
        and isinstance(getattr(module, "lm_head", None), nn.Module)
        and isinstance(getattr(inner, "layers", None), nn.ModuleList)
        and isinstance(getattr(inner, "embed_tokens", None), nn.Module)
    )


class _Embed(nn.Module):
    """The token embedding, or the given ``inputs_embeds`` (the model's own
    rule: exactly one of them)."""

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        packed=False,
        inputs_embeds=None,
    ):
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        out = {"hidden_states": h, "position_ids": position_ids}
        if attention_mask is not None:
            out["attention_mask"] = attention_mask
        if packed:
            out["packed"] = True
        return out


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


class _Decoder(nn.Module):
    def __init__(self, layer: nn.Module, rotary: nn.Module, config: Any, sliding: bool) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        # the shared rotary module's identity, kept by the workers' copies (each
        # replica of this layer holds its own copy of the module)
        self.rotary_key = id(rotary)
        self.config = config
        # the mask the model itself builds for this layer (see _layer_types)
        self.sliding = sliding

    def _mask(self, hidden_states, position_ids, attention_mask, packed):
        """The model's own mask for this layer type, without the checks that
        read device values (the adapter decided them on the host): a padding
        mask is always applied (no ``is_causal`` shortcut), packed sequences
        are kept apart from ``position_ids``."""
        from transformers import masking_utils

        make = (
            masking_utils.create_sliding_window_causal_mask
            if self.sliding
            else masking_utils.create_causal_mask
        )
        kwargs: dict[str, Any] = {}
        if attention_mask is not None:
            kwargs["allow_is_causal_skip"] = False
        elif packed:
            ids = position_ids.expand(hidden_states.shape[0], -1)
            kwargs["and_mask_function"] = masking_utils.packed_sequence_mask_function(
                _packed_ids(ids)
            )
        return make(
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=None,  # packing is known: no detection on the device
            **kwargs,
        )

    def forward(self, hidden_states, position_ids, attention_mask=None, packed=False):
        # built by the stage's first decoder layer, reused by the others
        mask = stage_cached(
            ("mask", self.sliding),
            lambda: self._mask(hidden_states, position_ids, attention_mask, packed),
        )
        pe = stage_cached(
            ("rotary", self.rotary_key), lambda: self.rotary(hidden_states, position_ids)
        )
        h = self.layer(
            hidden_states,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=pe,
            use_cache=False,
        )
        if isinstance(h, tuple):
            h = h[0]
        out = {"hidden_states": h, "position_ids": position_ids}
        if attention_mask is not None:
            out["attention_mask"] = attention_mask
        if packed:
            out["packed"] = True
        return out


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden_states, position_ids=None, attention_mask=None, packed=False):
        return self.lm_head(self.norm(hidden_states))


def _shifted(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Next-token targets, as Hugging Face's causal LM loss builds them."""
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, empty: float | None = 0.0
) -> torch.Tensor:
    """Mean next-token cross-entropy over the real tokens (labels ``-100`` are
    ignored). With none: ``empty`` (0 for a micro-batch, whose weight is then
    0), or, with ``empty=None``, NaN as the model's own loss is."""
    target = _shifted(labels).reshape(-1).to(logits.device)
    flat = logits.float().reshape(-1, logits.shape[-1])
    count = (target != -100).sum()
    total = nn.functional.cross_entropy(flat, target, ignore_index=-100, reduction="sum")
    return total / (count if empty is None else count.clamp(min=1))


class CausalLMAdapter(_Adapter):
    """A Hugging Face Llama-family causal LM (optionally inside PEFT).

    Construction refuses a model whose config asks for something the pipeline
    layers do not do the way the model does (see :func:`_check_config`)."""

    kind = "Hugging Face causal LM"

    def __init__(self, target: nn.Module, name: str) -> None:
        _check_config(target, name)
        self.target = target
        self.name = name
        inner = target.model
        config = target.config
        types = _layer_types(target)
        self._layers = [
            _Embed(inner.embed_tokens),
            *[
                _Decoder(layer, inner.rotary_emb, config, kind == "sliding_attention")
                for layer, kind in zip(inner.layers, types, strict=True)
            ],
            _Head(inner.norm, target.lm_head),
        ]

    def layers(self) -> list[nn.Module]:
        return self._layers

    def _layer_names(self) -> list[tuple[str, str]]:
        blocks = [("block", "blocks")] * (len(self._layers) - 2)
        return [("embed", "embed"), *blocks, ("head", "head")]

    def boundary_estimate(self, dtype: torch.dtype) -> Callable[[Any], int]:
        """Hidden states in the compute dtype plus the positions and mask that
        travel with them."""
        size = torch.empty(0, dtype=dtype).element_size()
        hidden = int(self.target.config.hidden_size)

        def estimate(inputs: Any) -> int:
            ids = inputs.get("input_ids")
            tokens = ids.numel() if ids is not None else inputs["inputs_embeds"].shape[:-1].numel()
            out = tokens * hidden * size + tokens * 8  # hidden states, positions
            mask = inputs.get("attention_mask")
            if mask is not None:
                out += mask.numel() * mask.element_size()
            return out

        return estimate

    def _cache(self, past_key_values: Any, use_cache: bool | None) -> bool:
        """Whether the model would run with a key-value cache (it then never
        treats ``position_ids`` as packed sequences): given, or ``use_cache``
        defaulting to the config's, off under gradient checkpointing in training."""
        if past_key_values is not None:
            return True
        if use_cache is None:
            use_cache = bool(getattr(self.target.config, "use_cache", False))
        inner = self.target.model
        if use_cache and getattr(inner, "gradient_checkpointing", False) and inner.training:
            return False
        return bool(use_cache)

    def _token_weights(self, labels: list[torch.Tensor]) -> list[float]:
        """Each micro-batch's share of the batch's labelled tokens, so the sum
        of the weighted micro-batch losses is the model's loss (the one place
        the loss weighting is decided). No labelled token: NaN, as the model's
        own loss is (0 / 0); refused first with ``nonfinite="raise"``."""
        counts = [int((_shifted(y) != -100).sum()) for y in labels]
        total = sum(counts)
        if total:
            return [c / total for c in counts]
        if self.engine is not None and self.engine.nonfinite == "raise":
            raise NonFiniteError(
                f"{self.name}: the batch has no labelled token (every label is -100), so its "
                "loss is NaN, as the model itself returns it; the weights were not updated. "
                "Filter such batches out, or set nonfinite='skip' to skip their steps"
            )
        return [math.nan] * len(counts)

    def _check_call(
        self,
        inputs_embeds: torch.Tensor | None,
        attention_mask: Any,
        past_key_values: Any,
        labels: torch.Tensor | None,
        logits_to_keep: Any,
        kwargs: dict[str, Any],
    ) -> None:
        """Refuse call arguments the pipeline would otherwise ignore."""
        name = self.name
        if past_key_values is not None:
            raise TypeError(
                f"{name}: past_key_values is not supported by the RoundPipe pipeline (it keeps no "
                "key-value cache, so e.g. prefix tuning cannot work); call the model without "
                "past_key_values"
            )
        if attention_mask is not None and (
            not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2
        ):
            shape = (
                tuple(attention_mask.shape)
                if isinstance(attention_mask, torch.Tensor)
                else type(attention_mask).__name__
            )
            raise TypeError(
                f"{name}: attention_mask must be a 2-D (batch, sequence) padding mask, got "
                f"{shape}; the pipeline builds each layer's mask itself, so prepared masks are "
                "not supported"
            )
        for key in ("output_attentions", "output_hidden_states"):
            if kwargs.get(key):
                raise TypeError(
                    f"{name}: {key}=True is not supported by the RoundPipe pipeline (it returns "
                    f"the loss and logits only); call the model without {key}"
                )
        unknown = {
            k
            for k in kwargs
            if k not in ("return_dict", "output_attentions", "output_hidden_states")
        }
        if unknown:
            raise TypeError(
                f"{name}: arguments {sorted(unknown)} are not supported by the pipeline"
            )
        if labels is not None and not _keeps_all(logits_to_keep):
            raise TypeError(
                f"{name}: logits_to_keep={logits_to_keep!r} with labels= is not supported by the "
                "RoundPipe pipeline (the loss needs every position's logits); call the model "
                "without logits_to_keep"
            )
        if labels is not None:
            _check_loss(self.target, name)

    def call(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if (input_ids is None) ^ (inputs_embeds is not None):
            # the model's own check, with its message
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        self._check_call(
            inputs_embeds, attention_mask, past_key_values, labels, logits_to_keep, kwargs
        )
        # the batch tensor: token ids, or embeddings (split into micro-batches
        # along dim 0 like the ids; floating, so uploaded in the compute dtype)
        batch = input_ids if input_ids is not None else inputs_embeds
        inputs: dict[str, Any] = (
            {"input_ids": input_ids} if input_ids is not None else {"inputs_embeds": inputs_embeds}
        )
        # decided here, on the host, so no stage has to read device values: a
        # mask without padding is no mask (the model would skip it too), and
        # packed sequences are detected from the positions
        # (as the model does, packing is looked for only with no mask and no cache)
        if attention_mask is not None and not bool(attention_mask.all()):
            inputs["attention_mask"] = attention_mask
        if position_ids is not None:
            if position_ids.shape[0] != batch.shape[0]:
                position_ids = position_ids.expand(batch.shape[0], -1)
            inputs["position_ids"] = position_ids
            no_cache = not self._cache(past_key_values, use_cache)
            if attention_mask is None and no_cache and is_packed(position_ids):
                inputs["packed"] = True
        engine = self.engine
        training = torch.is_grad_enabled() and self.target.training
        if training and labels is not None:
            # the gradient factor (Lightning's accumulation division, a scaled or
            # combined loss) is whatever autograd brings to the returned loss
            loss = engine.forward_backward(
                inputs,
                labels=labels,
                loss_fn=causal_lm_loss,
                loss_weights=self._token_weights,
                scale="later",
                input_grads=bool(_needing_grad(inputs)),
            )
            loss = _from_pipeline(loss, engine, engine.iteration - 1, inputs, _give_factor)
            return CausalLMOutputWithPast(loss=loss, logits=None)
        if training:
            logits = self._outputs_with_backward(inputs)
            return CausalLMOutputWithPast(logits=_keep(logits, logits_to_keep))
        logits = engine.forward(inputs)
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels, empty=None)
        return CausalLMOutputWithPast(loss=loss, logits=_keep(logits, logits_to_keep))


def _keeps_all(logits_to_keep: Any) -> bool:
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


def _keep(logits: torch.Tensor, logits_to_keep: Any) -> torch.Tensor:
    """The model's ``logits_to_keep`` selection (it selects hidden states before
    the LM head, which acts on each position alone: the same logits)."""
    if _keeps_all(logits_to_keep):
        return logits
    from transformers.modeling_utils import slice_logits_to_keep

    if isinstance(logits_to_keep, torch.Tensor):
        logits_to_keep = logits_to_keep.to(logits.device)
    return slice_logits_to_keep(logits, logits_to_keep)


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


def _layer_types(target: nn.Module) -> list[str]:
    """Each decoder layer's attention type, by its family's own rule (``_MASK_RULES``)."""
    config = target.config
    n = len(target.model.layers)
    rule = _MASK_RULES[config.model_type]
    if rule == "layer_types":
        return list(config.layer_types[:n])
    if rule == "sliding_window" and getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def _check_config(target: nn.Module, name: str) -> None:
    """Refuse config settings the pipeline layers would not honour as the model
    does. What the pipeline layers leave out of the family's ``*Model.forward``
    and ``*ForCausalLM.forward``: the mask choice (reproduced per layer), the
    key-value cache (refused per call), ``output_attentions`` and
    ``output_hidden_states`` (refused), ``layers[: num_hidden_layers]``,
    ``logits_to_keep`` and the loss (checked per call). Rotary settings are
    honoured (the model's own rotary module runs), as are tied embeddings."""
    config = target.config
    inner = target.model
    impl = getattr(config, "_attn_implementation", None)
    if impl not in _ATTENTION:
        raise ValueError(
            f"{name}: config._attn_implementation={impl!r} is not supported by the RoundPipe "
            f"pipeline, which reproduces the model's attention masks for "
            f"{' and '.join(map(repr, _ATTENTION))} only; load the model with "
            "attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))"
        )
    n = len(inner.layers)
    if config.num_hidden_layers < n:
        raise ValueError(
            f"{name}: config.num_hidden_layers={config.num_hidden_layers}, but the model holds "
            f"{n} decoder layers; the model runs only the first num_hidden_layers and the "
            "pipeline would run them all: remove the extra layers or set "
            f"config.num_hidden_layers={n}"
        )
    if _MASK_RULES[config.model_type] == "layer_types":
        types = list(getattr(config, "layer_types", None) or [])
        if len(types) < n:
            raise ValueError(
                f"{name}: config.layer_types has {len(types)} entries for {n} decoder layers; "
                "give one attention type per layer"
            )
        for i, kind in enumerate(types[:n]):
            if kind not in _LAYER_TYPES:
                raise ValueError(
                    f"{name}: config.layer_types[{i}]={kind!r} is not supported by the RoundPipe "
                    f"pipeline, which builds {' and '.join(map(repr, _LAYER_TYPES))} masks only; "
                    "use one of those layer types"
                )
    for key in ("output_attentions", "output_hidden_states"):
        if getattr(config, key, False):
            raise ValueError(
                f"{name}: config.{key}=True is not supported by the RoundPipe pipeline (it "
                f"returns the loss and logits only); set config.{key}=False"
            )
    if inner._forward_hooks or inner._forward_pre_hooks:
        raise ValueError(
            f"{name}: {type(inner).__name__} has forward hooks, which the RoundPipe pipeline "
            "would not run (it calls the embedding, decoder layers and head itself); register "
            "them on those submodules instead, or remove them"
        )


# ------------------------------------------------------------------ finding
def _resolve(root: nn.Module, path: str) -> nn.Module:
    obj: Any = root
    for part in path.split("."):
        if not hasattr(obj, part):
            raise LayerStackNotFound(
                f"layers={path!r}: {type(obj).__name__} has no attribute {part!r}"
            )
        obj = getattr(obj, part)
    if not isinstance(obj, nn.Module):
        raise LayerStackNotFound(f"layers={path!r} is a {type(obj).__name__}, not an nn.Module")
    return obj


def _adapter_for(module: nn.Module, name: str) -> _Adapter | None:
    if _is_causal_lm(module):
        return CausalLMAdapter(module, name)
    if isinstance(module, nn.Sequential) and len(module) > 0:
        return SequentialAdapter(module, name)
    return None


def _count(params: Any) -> int:
    return sum(p.numel() for p in params)


def _unsupported_hf(module: nn.Module) -> str | None:
    """Why a Hugging Face model cannot be pipelined (None: not one, or it can)."""
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if not isinstance(model_type, str) or _is_causal_lm(module):
        return None
    families = ", ".join(_HF_FAMILIES)
    if model_type in _HF_FAMILIES:
        return (
            f"a {type(module).__name__} (model_type {model_type!r}) without an LM head; "
            f"RoundPipe pipelines the causal LMs (*ForCausalLM) of {families}"
        )
    return (
        f"a Hugging Face model with model_type {model_type!r}, which RoundPipe does not "
        f"support (supported: {families})"
    )


def _describe(name: str, module: nn.Module, n: int, total: int) -> str:
    return f"'{name}' ({type(module).__name__}, {n:,} parameters, {n / total:.0%})"


def find_adapter(root: nn.Module, layers: str | None = None) -> _Adapter:
    """The adapter for ``root`` (a LightningModule): the module named by
    ``layers`` (an attribute path), else the layer stack that holds most of
    ``root``'s parameters.

    The candidates are the Hugging Face causal LMs of the Llama family and the
    non-empty ``nn.Sequential`` submodules not inside another candidate; the
    one with the most parameters (frozen ones too, shared ones once) is chosen
    when it holds more than half of ``root``'s parameters, else the choice is
    refused (:class:`LayerStackNotFound`, naming what holds the rest)."""
    if layers is not None:
        module = _resolve(root, layers)
        if isinstance(module, nn.ModuleList):  # e.g. "model.model.layers": find its owner
            for name, owner in root.named_modules():
                if _is_causal_lm(owner) and owner.model.layers is module:
                    return CausalLMAdapter(owner, name)
        adapter = _adapter_for(module, layers)
        if adapter is None:
            raise LayerStackNotFound(
                f"layers={layers!r} is a {type(module).__name__}; RoundPipe can pipeline an "
                "nn.Sequential or a Hugging Face causal LM of the Llama family "
                f"({', '.join(_HF_FAMILIES)})"
            )
        return adapter
    modules = [(n, m) for n, m in root.named_modules() if n]
    candidates: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()  # modules within a candidate
    for name, module in modules:
        if id(module) in inside:
            continue
        if _is_causal_lm(module) or (isinstance(module, nn.Sequential) and len(module) > 0):
            candidates.append((name, module))
            inside.update(id(m) for m in module.modules())
    root_name = type(root).__name__
    families = ", ".join(_HF_FAMILIES)
    if not candidates:
        searched = [n for n, _ in root.named_children()]
        shown = ", ".join(searched[:12]) + (" ..." if len(searched) > 12 else "")
        foreign = [(n, t) for n, m in modules if (t := _unsupported_hf(m)) is not None]
        why = f" ('{foreign[0][0]}' is {foreign[0][1]})" if foreign else ""
        raise LayerStackNotFound(
            f"no layer stack found in {root_name}: looked for a Hugging Face causal LM of the "
            f"Llama family ({families}) and an nn.Sequential among its submodules (searched: "
            f"{shown or 'none'}). Pass layers='attribute.path' to RoundPipeStrategy only for "
            "such a module that is not a registered submodule; otherwise put the layers to "
            f"pipeline in an nn.Sequential{why}"
        )
    total = _count(root.parameters())
    sizes = [_count(m.parameters()) for _, m in candidates]
    best = max(range(len(candidates)), key=lambda i: sizes[i])  # the first of equals
    name, chosen = candidates[best]
    if sizes[best] * 2 > total or total == 0:
        return _adapter_for(chosen, name)
    # the choice is not clear: name what holds the rest
    mine = {id(p) for p in chosen.parameters()}
    within = {id(m) for m in chosen.modules()}
    other, other_n = None, -1
    for n, m in modules:
        if id(m) in within or any(c is chosen for c in m.modules()):
            continue  # inside the chosen stack, or holding it
        count = _count(p for p in m.parameters() if id(p) not in mine)
        if count > other_n:
            other, other_n = (n, m), count
    stack = _describe(name, chosen, sizes[best], total)
    if other is None or other_n == 0:
        raise LayerStackNotFound(
            f"the layer stack of {root_name} is not clear: {stack} holds at most half of its "
            f"{total:,} parameters, the rest are held by {root_name} itself. Pass "
            f"layers={name!r} to RoundPipeStrategy to pipeline it anyway"
        )
    o_name, o_mod = other
    rest = _describe(o_name, o_mod, other_n, total)
    if any(m is o_mod for _, m in candidates):
        raise LayerStackNotFound(
            f"the layer stack of {root_name} is not clear: {stack} and {rest} are both "
            f"candidates and neither holds more than half of its {total:,} parameters. Pass "
            f"layers={name!r} or layers={o_name!r} to RoundPipeStrategy"
        )
    owner = next(
        (
            (n, t)
            for n, m in modules
            if (t := _unsupported_hf(m)) is not None and any(c is o_mod for c in m.modules())
        ),
        None,
    )
    if owner is not None:
        advice = (
            f"'{owner[0]}' is {owner[1]}, so it cannot be pipelined; train it with another "
            f"strategy, or pass layers={name!r} to RoundPipeStrategy to pipeline only '{name}'"
        )
    else:
        advice = (
            "RoundPipe pipelines an nn.Sequential or a Hugging Face causal LM of the Llama "
            f"family ({families}): put the layers of '{o_name}' in an nn.Sequential, or pass "
            f"layers={name!r} to RoundPipeStrategy to pipeline only '{name}'"
        )
    raise LayerStackNotFound(
        f"the layer stack of {root_name} is not clear: the largest candidate, {stack}, holds "
        f"at most half of its {total:,} parameters; {rest} would run outside the pipeline. "
        f"{advice}"
    )

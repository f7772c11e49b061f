"""Model adapters: find a module's layer stack and run calls to it through the pipeline.

An adapter knows, for one kind of model, (1) the ordered pipeline layers (made
of the model's own submodules, so parameters and ``state_dict`` keys stay as
they are), (2) which module to intercept, and (3) how a call to that module
becomes engine work:

* :class:`SequentialAdapter`: an ``nn.Sequential``; a call returns the outputs;
  with autograd on, ``backward`` of anything computed from them runs the
  pipelined backward (the engine re-runs the forward with the output gradient).
* :class:`CausalLMAdapter`: Hugging Face causal LMs of the Llama family (Llama,
  Qwen2, Qwen3, Mistral; also wrapped by PEFT). Layers: the token embedding,
  each decoder layer (the causal mask and rotary embeddings are built from
  ``position_ids`` and the 2-D ``attention_mask`` by a stage's first decoder
  layer, once per micro-batch, and shared by the stage's other layers, so only
  the hidden states cross stage boundaries), and norm + LM head. Whether a batch
  has padding or packed sequences is decided on the host before anything is
  uploaded, so no layer waits for the device to answer it. Called with
  ``labels=`` while training, the loss is computed inside the pipeline (the
  fused stage) per micro-batch and weighted by its share of the batch's real
  tokens, so it equals the unsplit model's loss and full-batch logits never
  exist.

:func:`find_adapter` picks the adapter for a LightningModule.
"""

from __future__ import annotations

import logging
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .runtime.engine import EngineClosedError
from .runtime.nested import batch_size_of, split_microbatches
from .runtime.scope import stage_cached

if TYPE_CHECKING:
    from .runtime import RoundPipeEngine

__all__ = ["CausalLMAdapter", "LayerStackNotFound", "SequentialAdapter", "find_adapter"]

log = logging.getLogger(__name__)


class LayerStackNotFound(ValueError):
    """No pipeline layer stack could be found in the module."""


class _Deferred(torch.autograd.Function):
    """Outputs computed by the pipeline; their backward runs the pipeline's."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, value: torch.Tensor, run) -> torch.Tensor:
        ctx.run = run
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.run(grad)
        return None, None, None


def _anchor() -> torch.Tensor:
    return torch.zeros((), requires_grad=True)


class _Adapter(ABC):
    """Common interception: patch ``target.forward``, restore on ``detach``."""

    target: nn.Module

    @abstractmethod
    def layers(self) -> list[nn.Module]:
        """The pipeline layers, in order."""

    def attach(self, engine: RoundPipeEngine, grad_scale: Callable[[], float]) -> None:
        self.engine = engine
        self.grad_scale = grad_scale
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
        m = engine.microbatches_for(batch_size_of(inputs) or 0)
        it = engine.reserve_iteration()
        out = engine.forward(inputs, iteration=it)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                "with autograd on, the pipeline's last layer must return a tensor when the loss "
                f"is computed outside the model; it returned {type(out).__name__}"
            )

        # the graph refers to the engine weakly: a graph that outlives it (a
        # failed batch run again on a re-planned engine) does not keep it alive
        engine_ref = weakref.ref(engine)

        def run(grad: torch.Tensor) -> None:
            eng = engine_ref()
            if eng is None:
                raise EngineClosedError(
                    "backward reached outputs of a RoundPipe engine that no longer exists"
                )
            eng.forward_backward(
                inputs, labels=grad, loss_fn=_dot, iteration=it, loss_weights=[1.0] * m
            )

        return _Deferred.apply(_anchor(), out.float() if out.is_floating_point() else out, run)


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

    def call(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) != 1:
            raise TypeError(f"{self.name} (nn.Sequential) takes one input")
        (x,) = args
        if torch.is_grad_enabled() and self.target.training:
            return self._outputs_with_backward(x)
        return self.engine.forward(x)


# ------------------------------------------------------------ causal LMs
_HF_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


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
    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, input_ids, attention_mask=None, position_ids=None, packed=False):
        h = self.embed(input_ids)
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
    def __init__(self, layer: nn.Module, rotary: nn.Module, config: Any, index: int) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        # the shared rotary module's identity, kept by the workers' copies (each
        # replica of this layer holds its own copy of the module)
        self.rotary_key = id(rotary)
        self.config = config
        types = getattr(config, "layer_types", None)
        self.sliding = bool(types) and types[index] == "sliding_attention"

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


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the micro-batch's real tokens (labels
    ``-100`` are ignored); zero when it has none."""
    target = _shifted(labels).reshape(-1).to(logits.device)
    flat = logits.float().reshape(-1, logits.shape[-1])
    count = (target != -100).sum()
    total = nn.functional.cross_entropy(flat, target, ignore_index=-100, reduction="sum")
    return total / count.clamp(min=1)


class CausalLMAdapter(_Adapter):
    """A Hugging Face Llama-family causal LM (optionally inside PEFT)."""

    def boundary_estimate(self, dtype: torch.dtype) -> Callable[[Any], int]:
        """Hidden states in the compute dtype plus the positions and mask that
        travel with them."""
        size = torch.empty(0, dtype=dtype).element_size()
        hidden = int(self.target.config.hidden_size)

        def estimate(inputs: Any) -> int:
            ids = inputs["input_ids"]
            tokens = ids.numel()
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

    kind = "Hugging Face causal LM"

    def __init__(self, target: nn.Module, name: str) -> None:
        self.target = target
        self.name = name
        inner = target.model
        config = target.config
        self._layers = [
            _Embed(inner.embed_tokens),
            *[_Decoder(layer, inner.rotary_emb, config, i) for i, layer in enumerate(inner.layers)],
            _Head(inner.norm, target.lm_head),
        ]

    def layers(self) -> list[nn.Module]:
        return self._layers

    def call(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if input_ids is None or inputs_embeds is not None:
            raise TypeError(
                f"{self.name}: the pipeline takes input_ids (inputs_embeds is not supported)"
            )
        if past_key_values is not None or use_cache:
            log.debug("RoundPipe ignores past_key_values/use_cache (training has no cache)")
        unknown = {
            k
            for k in kwargs
            if k
            not in ("return_dict", "output_attentions", "output_hidden_states", "logits_to_keep")
        }
        if unknown:
            raise TypeError(
                f"{self.name}: arguments {sorted(unknown)} are not supported by the pipeline"
            )
        inputs: dict[str, Any] = {"input_ids": input_ids}
        # decided here, on the host, so no stage has to read device values: a
        # mask without padding is no mask (the model would skip it too), and
        # packed sequences are detected from the positions
        # (as the model does, packing is looked for only with no mask and no cache)
        if attention_mask is not None and not bool(attention_mask.all()):
            inputs["attention_mask"] = attention_mask
        if position_ids is not None:
            if position_ids.shape[0] != input_ids.shape[0]:
                position_ids = position_ids.expand(input_ids.shape[0], -1)
            inputs["position_ids"] = position_ids
            no_cache = not self._cache(past_key_values, use_cache)
            if attention_mask is None and no_cache and is_packed(position_ids):
                inputs["packed"] = True
        engine = self.engine
        training = torch.is_grad_enabled() and self.target.training
        if training and labels is not None:
            bsz = batch_size_of(input_ids)
            m = engine.microbatches_for(bsz)
            counts = [int((_shifted(y) != -100).sum()) for y in split_microbatches(labels, m, bsz)]
            total = max(1, sum(counts))
            scale = self.grad_scale()
            loss = (
                engine.forward_backward(
                    inputs,
                    labels=labels,
                    loss_fn=causal_lm_loss,
                    loss_weights=[c / total for c in counts],
                    scale=scale,
                )
                / scale
            )
            return CausalLMOutputWithPast(loss=_expect_grad(loss, scale, self.name), logits=None)
        if training:
            logits = self._outputs_with_backward(inputs)
            return CausalLMOutputWithPast(logits=logits)
        logits = engine.forward(inputs)
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class _Expect(torch.autograd.Function):
    """A loss whose backward already ran inside the pipeline with ``scale``;
    checks that autograd asks for exactly that."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, value: torch.Tensor, scale: float, name: str):
        ctx.scale, ctx.name = scale, name
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = float(grad)
        if abs(g - ctx.scale) > 1e-6 * max(1.0, abs(ctx.scale)):
            raise RuntimeError(
                f"the loss returned by {ctx.name} was scaled by {g / ctx.scale:g} before "
                "backward; RoundPipe runs the model's backward inside the pipeline when the "
                "model is called with labels=, so use the returned loss unchanged (extra terms "
                "may be added to it), or call the model without labels= and compute the loss "
                "from the logits"
            )
        return None, None, None, None


def _expect_grad(loss: torch.Tensor, scale: float, name: str) -> torch.Tensor:
    return _Expect.apply(_anchor(), loss, scale, name)


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


def find_adapter(root: nn.Module, layers: str | None = None) -> _Adapter:
    """The adapter for ``root`` (a LightningModule): the module named by
    ``layers`` (an attribute path), else the first Hugging Face causal LM of
    the Llama family, else the first ``nn.Sequential``, searching submodules
    breadth first."""
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
    searched: list[str] = []
    queue: list[tuple[str, nn.Module]] = list(root.named_children())
    while queue:
        name, module = queue.pop(0)
        searched.append(name)
        if _is_causal_lm(module):
            return CausalLMAdapter(module, name)
        queue.extend((f"{name}.{n}", c) for n, c in module.named_children())
    for name, module in root.named_modules():
        if name and isinstance(module, nn.Sequential) and len(module) > 0:
            return SequentialAdapter(module, name)
    shown = ", ".join(searched[:12]) + (" ..." if len(searched) > 12 else "")
    raise LayerStackNotFound(
        f"no layer stack found in {type(root).__name__}: looked for a Hugging Face causal LM "
        f"of the Llama family ({', '.join(_HF_FAMILIES)}) and an nn.Sequential among its "
        f"submodules (searched: {shown or 'none'}). Pass layers='attribute.path' to "
        "RoundPipeStrategy"
    )

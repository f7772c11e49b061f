"""What every adapter shares: the interception of the module's ``forward``, the
autograd node for values the pipeline computed, and the ``nn.Sequential`` adapter."""

from __future__ import annotations

import types
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..runtime.engine import EngineClosedError
from ..runtime.nested import flatten_tensors

if TYPE_CHECKING:
    from ..runtime import RoundPipeEngine

__all__ = ["LayerStackNotFound", "SequentialAdapter"]


class LayerStackNotFound(ValueError):
    """No pipeline layer stack could be found in the module."""


class _FromPipeline(torch.autograd.Function):
    """A value the pipeline computed (outputs, or a loss whose backward already
    ran inside it); its backward runs ``run(grad)``, which returns the
    gradients of the pipeline's inputs that require one (``needs``)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, run, n: int, *values_and_needs) -> Any:
        ctx.run, ctx.n = run, n
        # the anchor's gradient accumulator: whether a backward accumulates into
        # .grad (the weights' gradients are wanted) or only asks for some inputs'
        ctx.anchor = torch.autograd.graph.get_gradient_edge(anchor).node
        return tuple(v.clone() for v in values_and_needs[:n])

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "a backward with create_graph=True (a gradient penalty, a higher-order "
                "derivative) reached the RoundPipe pipeline, which computes its gradients on "
                "its workers, outside this graph: they cannot be differentiated again. Compute "
                "such terms inside a pipeline layer, or train this module with another strategy"
            )
        if not _accumulates(ctx.anchor):
            raise RuntimeError(
                "torch.autograd.grad (or backward(inputs=...)) reached the RoundPipe pipeline, "
                "whose backward always adds the layers' weight gradients to the optimizer "
                "step: only loss.backward() (Lightning's own) is supported through it. Compute "
                "derivatives with respect to the inputs inside a pipeline layer, or outside "
                "the model"
            )
        return None, None, None, *([None] * ctx.n), *ctx.run(list(grads))


def _accumulates(node: Any) -> bool:
    """Whether the running backward executes ``node``, a leaf's gradient
    accumulator (torch has no public way to ask: its private check, as its
    multi-gradient hooks use; ``torch.autograd.grad`` never accumulates)."""
    check = getattr(torch._C, "_will_engine_execute_node", None)
    if check is None:  # pragma: no cover - a torch without it: assume an ordinary backward
        return True
    try:
        return bool(check(node))
    except RuntimeError:  # raised for leaves inside torch.autograd.grad
        return False


def _from_pipeline(
    value: torch.Tensor | list[torch.Tensor],
    engine: RoundPipeEngine,
    iteration: int,
    inputs: Any,
    backward: Callable[[RoundPipeEngine, int, Any], float],
) -> Any:
    """``value`` (a tensor, or a list of them) in the caller's graph: when
    autograd reaches it, ``backward(engine, iteration, grad)`` (with a list:
    the list of their gradients, zeros for those autograd did not reach)
    runs or completes the pipeline's backward and returns the factor the
    inputs' gradients are then taken with. The graph refers to the engine
    weakly: a graph that outlives it (a failed batch run again on a
    re-planned engine) does not keep it alive."""
    engine_ref = weakref.ref(engine)
    needs = _needing_grad(inputs)
    single = isinstance(value, torch.Tensor)
    values = [value] if single else list(value)

    def run(grads: list[torch.Tensor]) -> list[torch.Tensor | None]:
        eng = engine_ref()
        if eng is None:
            raise EngineClosedError(
                "backward reached a value of a RoundPipe engine that no longer exists"
            )
        factor = backward(eng, iteration, grads[0] if single else grads)
        if not needs:
            return []
        grads = eng.input_grads(iteration)
        return [None if grads[i] is None else grads[i] * factor for i in needs]

    flat = flatten_tensors(inputs)
    out = _FromPipeline.apply(_anchor(), run, len(values), *values, *(flat[i] for i in needs))
    return out[0] if single else list(out)


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
    #: the engine's ``spread_values``: whether a tuple between layers is the
    #: next layer's positional arguments and a dict its keywords
    spread_values = True

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

    def attach(self, engine: RoundPipeEngine, root: nn.Module | None = None) -> None:
        """Calls of the target go to the pipeline from now on. ``root``: the
        module holding it (the LightningModule), searched for wrappers that
        keep the target's forward as their own attribute."""
        self.engine = engine
        adapter = self
        self.calls = 0  # (the strategy asks whether a step called the stack)

        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            # bound to the target: a deep copy of the model (an EMA or reference
            # copy made during the fit) binds it to its copy of the target, which
            # runs its own class forward; pickling stores ``getattr(module,
            # "forward")``, the class forward again (hence the name)
            if module is not adapter.target or adapter.engine is None:
                return type(module).forward(module, *args, **kwargs)
            adapter.calls += 1
            return adapter.call(*args, **kwargs)

        # (an instance attribute shadows the class method)
        self.target.forward = types.MethodType(forward, self.target)
        # a wrapper that took the target's bound forward as its own before we
        # patched it (``self.forward = model.forward``: PEFT's AdaptionPrompt)
        # would call around the pipeline: it is pointed at ours too
        self._holders = [
            (m, m.__dict__["forward"])
            for m in (root.modules() if root is not None else ())
            if m is not self.target and _bound_to(m.__dict__.get("forward"), self.target)
        ]
        for m, _ in self._holders:
            m.forward = types.MethodType(forward, self.target)

    def detach(self) -> None:
        self.target.__dict__.pop("forward", None)
        for m, original in getattr(self, "_holders", ()):
            m.forward = original
        self._holders = []
        self.engine = None

    def boundary_estimate(self, dtype: torch.dtype) -> Callable[[Any], int] | None:
        """Bytes of one stage-boundary value of a micro-batch, from its input,
        before anything ran (None: the engine measures it in the first step)."""
        return None

    @abstractmethod
    def call(self, *args: Any, **kwargs: Any) -> Any:
        """What a call to the intercepted module does."""

    def _wants_backward(self, inputs: Any) -> bool:
        """Whether a call with ``inputs`` is one autograd records, as the
        module's own call would be: gradients enabled and some pipeline weight
        or input tensor requiring one. (No weight does under PEFT's
        ``disable_adapter()`` with the base model frozen, a reference forward:
        that call runs forward only.) The module's mode does not decide: a
        model in ``eval()`` (as ``from_pretrained`` returns it) trains with its
        dropout off, as in plain PyTorch."""
        if not torch.is_grad_enabled():
            return False
        engine = self.engine
        return engine is None or engine.wants_gradients() or bool(_needing_grad(inputs))

    def _outputs_with_backward(self, inputs: Any) -> torch.Tensor:
        """Forward now; when autograd reaches the outputs, run the pipelined
        backward with their gradient (same iteration: same dropout masks)."""
        engine = self.engine
        it = engine.reserve_iteration()
        out = engine.forward(inputs, iteration=it)
        # the outputs' floating-point tensors carry the backward (several when
        # the last layer returns a tuple or dict: logits and an auxiliary loss)
        leaves, spec = pytree.tree_flatten(out)
        floating = [
            i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.is_floating_point()
        ]
        if not floating:
            return out
        if engine.compute_dtype == torch.float16:
            # fp16 outputs in fp32: the gradient a loss computed from them
            # brings back (unscaled: the loss scale is the pipeline's) would
            # flush to zero in fp16 (a token's logit gradient is ~1/(tokens x
            # vocabulary)); the pipeline scales it on its way down
            for i in floating:
                leaves[i] = leaves[i].float()
        wants_input_grads = bool(_needing_grad(inputs))

        def backward(eng: RoundPipeEngine, iteration: int, grads: list[torch.Tensor]) -> float:
            # the outputs' gradients in the outputs' structure (None elsewhere)
            tree: list[Any] = [None] * len(leaves)
            for i, g in zip(floating, grads, strict=True):
                tree[i] = g
            eng.forward_backward(
                inputs,
                labels=pytree.tree_unflatten(tree, spec),
                loss_fn=_dot,
                iteration=iteration,
                loss_weights=_unit_weights,
                input_grads=wants_input_grads,
            )
            return 1.0

        # (otherwise in the dtype the last layer computed in, as the model would
        # return it: bf16 logits under bf16 precision, half the host memory)
        values = _from_pipeline([leaves[i] for i in floating], engine, it, inputs, backward)
        for i, v in zip(floating, values, strict=True):
            leaves[i] = v
        return pytree.tree_unflatten(leaves, spec)


def _bound_to(method: Any, target: nn.Module) -> bool:
    """Whether ``method`` is ``target``'s own class ``forward``, bound to it."""
    return (
        getattr(method, "__self__", None) is target
        and getattr(method, "__func__", None) is type(target).forward
    )


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


def _dot(out: Any, grad: Any) -> torch.Tensor:
    """A loss whose gradient with respect to each of ``out``'s tensors is
    the tensor in its place in ``grad`` (none where that is None)."""
    outs, grads = pytree.tree_leaves(out), pytree.tree_leaves(grad, is_leaf=lambda g: g is None)
    terms = [
        (o.float() * g.to(o.device, torch.float32)).sum()
        for o, g in zip(outs, grads, strict=True)
        if g is not None
    ]
    return torch.stack(terms).sum()


# --------------------------------------------------------------- Sequential
class SequentialAdapter(_Adapter):
    """An ``nn.Sequential``: its children are the pipeline layers."""

    kind = "nn.Sequential"
    spread_values = False  # (each child takes the previous one's output whole)

    def __init__(self, target: nn.Sequential, name: str) -> None:
        if type(target).forward is not nn.Sequential.forward:
            # (its children would be run as a plain chain, without its forward)
            raise ValueError(
                f"{name}: {type(target).__name__} is an nn.Sequential with its own forward; the "
                "RoundPipe pipeline runs an nn.Sequential's children as a plain chain, each "
                "taking the previous one's output, so that forward would not run. Move its "
                "extra work into the children (a residual block as one child), or give "
                "layers= the path of a plain nn.Sequential"
            )
        self.target = target
        self.name = name

    def layers(self) -> list[nn.Module]:
        return list(self.target)

    def _layer_names(self) -> list[tuple[str, str]]:
        return [(type(c).__name__, type(c).__name__) for c in self.target]

    def call(self, *args: Any, **kwargs: Any) -> Any:
        if not args and set(kwargs) == {"input"}:  # (nn.Sequential.forward's own name)
            args, kwargs = (kwargs["input"],), {}
        if kwargs or len(args) != 1:
            raise TypeError(
                f"{self.name} (nn.Sequential) takes one input, as nn.Sequential.forward does; "
                f"got {len(args)} positional and keyword {sorted(kwargs)}"
            )
        (x,) = args
        if self._wants_backward(x):
            return self._outputs_with_backward(x)
        return self.engine.forward(x)

"""Finding the layer stack of a LightningModule: the candidate holding most of
its parameters, refused when that is not clear."""

from __future__ import annotations

from typing import Any

from torch import nn

from .base import LayerStackNotFound, SequentialAdapter, _Adapter
from .causal_lm import CausalLMAdapter
from .classifier import (
    QuestionAnsweringAdapter,
    SequenceClassifierAdapter,
    TokenClassifierAdapter,
)
from .families import supported_families
from .layout import (
    QUESTION_ANSWERING,
    SEQUENCE_CLASSIFICATION,
    TOKEN_CLASSIFICATION,
    Layout,
    layout_of,
    layout_problem,
)

__all__ = ["find_adapter", "hf_adapter", "trained_outside"]

_WHAT = "an nn.Sequential or a Hugging Face decoder-only causal LM (or classifier)"


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


def _is_candidate(module: nn.Module) -> bool:
    return layout_of(module) is not None or (isinstance(module, nn.Sequential) and len(module) > 0)


def hf_adapter(module: nn.Module, name: str, layout: Layout | None = None) -> CausalLMAdapter:
    """The adapter of a Hugging Face model: its sequence or token
    classifier's, its question-answering model's, or its causal LM's
    (refusing what none can pipeline)."""
    layout = layout_of(module) if layout is None else layout
    task = None if layout is None else layout.task
    if task == SEQUENCE_CLASSIFICATION:
        return SequenceClassifierAdapter(module, name)
    if task == TOKEN_CLASSIFICATION:
        return TokenClassifierAdapter(module, name)
    if task == QUESTION_ANSWERING:
        return QuestionAnsweringAdapter(module, name)
    return CausalLMAdapter(module, name)


def _adapter_for(module: nn.Module, name: str) -> _Adapter | None:
    layout = layout_of(module)
    if layout is not None:
        return hf_adapter(module, name, layout)
    if isinstance(module, nn.Sequential) and len(module) > 0:
        return SequentialAdapter(module, name)
    return None


def _count(params: Any) -> int:
    return sum(p.numel() for p in params)


def _unsupported_hf(module: nn.Module) -> str | None:
    """Why a Hugging Face model cannot be pipelined (None: not one, it can be,
    or it wraps one that can be, as PEFT's wrappers do)."""
    why = layout_problem(module)
    if why is None or any(layout_of(m) is not None for m in module.modules()):
        return None
    return why


def _describe(name: str, module: nn.Module, n: int, total: int) -> str:
    return f"'{name}' ({type(module).__name__}, {n:,} parameters, {n / total:.0%})"


def find_adapter(root: nn.Module, layers: str | None = None) -> _Adapter:
    """The adapter for ``root`` (a LightningModule): the module named by
    ``layers`` (an attribute path), else the layer stack that holds most of
    ``root``'s parameters.

    The candidates are the Hugging Face causal LMs of the supported families
    (:data:`~.families.FAMILIES`) and the non-empty ``nn.Sequential``
    submodules not inside another candidate; the one with the most parameters
    (frozen ones too, shared ones once) is chosen when it holds more than half
    of ``root``'s parameters, else the choice is refused
    (:class:`LayerStackNotFound`, naming what holds the rest)."""
    if layers is not None:
        return _named(root, layers)
    modules = [(n, m) for n, m in root.named_modules() if n]
    candidates = _candidates(modules)
    root_name = type(root).__name__
    if not candidates:
        raise LayerStackNotFound(_nothing_found(root, modules))
    total = _count(root.parameters())
    sizes = [_count(m.parameters()) for _, m in candidates]
    best = max(range(len(candidates)), key=lambda i: sizes[i])  # the first of equals
    name, chosen = candidates[best]
    if sizes[best] * 2 > total or total == 0:
        return _adapter_for(chosen, name)
    listed = _listed_stack(root, name, candidates)
    if listed is not None:
        raise LayerStackNotFound(listed)
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
            f"RoundPipe pipelines {_WHAT} ({supported_families()}): put the layers of "
            f"'{o_name}' in an nn.Sequential, or pass layers={name!r} to RoundPipeStrategy to "
            f"pipeline only '{name}'"
        )
    raise LayerStackNotFound(
        f"the layer stack of {root_name} is not clear: the largest candidate, {stack}, holds "
        f"at most half of its {total:,} parameters; {rest} would run outside the pipeline. "
        f"{advice}"
    )


def _candidates(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The layer stacks among ``modules`` (named, outermost first) that are
    not inside another one."""
    found: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()  # modules within a candidate
    for name, module in modules:
        if id(module) in inside:
            continue
        if _is_candidate(module):
            found.append((name, module))
            inside.update(id(m) for m in module.modules())
    return found


def trained_outside(root: nn.Module, adapter: _Adapter, optimized: set[int]) -> str | None:
    """The name of the layer stack outside ``adapter``'s that holds the most
    of the parameters in ``optimized`` (ids) when the pipelined stack holds
    none of them: a frozen stack (a distillation teacher) chosen for its
    size over the one being trained, which would then train on the host.
    None otherwise."""
    pipelined = {id(p) for layer in adapter.layers() for p in layer.parameters()}
    if pipelined & optimized:
        return None
    held = {
        name: _count(p for p in module.parameters() if id(p) in optimized)
        for name, module in _candidates([(n, m) for n, m in root.named_modules() if n])
        if not {id(p) for p in module.parameters()} & pipelined
    }
    best = max(held, key=lambda n: held[n], default=None)
    return best if best is not None and held[best] > 0 else None


def _named(root: nn.Module, layers: str) -> _Adapter:
    """The adapter for the module ``layers`` names."""
    module = _resolve(root, layers)
    if isinstance(module, nn.ModuleList):  # e.g. "model.model.layers": find its owner
        for name, owner in root.named_modules():
            layout = layout_of(owner)
            if layout is not None and layout.layers is module:
                return hf_adapter(owner, name, layout)
    adapter = _adapter_for(module, layers)
    if adapter is not None:
        return adapter
    why = _unsupported_hf(module)
    if why is not None:  # a Hugging Face model: layers= cannot make it work
        raise LayerStackNotFound(f"layers={layers!r} is {why}")
    raise LayerStackNotFound(
        f"layers={layers!r} is a {type(module).__name__}; RoundPipe can pipeline {_WHAT} "
        f"({supported_families()}): put the layers to pipeline in an nn.Sequential"
    )


def _listed_stack(
    root: nn.Module, name: str, candidates: list[tuple[str, nn.Module]]
) -> str | None:
    """The refusal when the largest candidate, ``name``, is one block of a
    stack held in an ``nn.ModuleList`` (or ``nn.ModuleDict``) with other
    candidates, which a custom forward loops over: suggesting ``layers=``
    for one block would pipeline that block alone. None otherwise."""
    if "." not in name:
        return None
    parent_name = name.rsplit(".", 1)[0]
    parent = root.get_submodule(parent_name)
    if not isinstance(parent, (nn.ModuleList, nn.ModuleDict)):
        return None
    blocks = [n for n, _ in candidates if n.rsplit(".", 1)[0] == parent_name]
    if len(blocks) < 2:
        return None
    root_name = type(root).__name__
    total = _count(root.parameters())
    kind = type(parent).__name__
    held = _describe(parent_name, parent, _count(parent.parameters()), total)
    chosen = root.get_submodule(name)
    largest = _describe(name, chosen, _count(chosen.parameters()), total)
    return (
        f"the layer stack of {root_name} is not clear: the largest candidate, {largest}, is "
        f"one of {len(blocks)} blocks of {held} and holds at most half of {root_name}'s "
        f"{total:,} parameters. An nn.{kind} is not a stack RoundPipe can pipeline, and "
        f"layers={name!r} would pipeline that block alone: make '{parent_name}' one "
        f"nn.Sequential of its blocks (nn.Sequential(*blocks), called as "
        f"self.{parent_name}(x) instead of a loop over them), or pass layers= naming an "
        "nn.Sequential that holds the whole stack"
    )


def _nothing_found(root: nn.Module, modules: list[tuple[str, nn.Module]]) -> str:
    """The refusal when ``root`` holds no candidate: a Hugging Face model it
    cannot follow is named with why (``layers=`` would not help with it);
    otherwise ``layers=`` is suggested for an ``nn.Sequential`` that is not a
    registered submodule."""
    root_name = type(root).__name__
    foreign = next(((n, t) for n, m in modules if (t := _unsupported_hf(m)) is not None), None)
    if foreign is not None:
        return (
            f"no layer stack found in {root_name}: '{foreign[0]}' is {foreign[1]}. Train it "
            "with another strategy, or put the layers to pipeline in an nn.Sequential"
        )
    searched = [n for n, _ in root.named_children()]
    shown = ", ".join(searched[:12]) + (" ..." if len(searched) > 12 else "")
    return (
        f"no layer stack found in {root_name}: looked for {_WHAT} ({supported_families()}) among "
        f"its submodules (searched: {shown or 'none'}). Pass layers='attribute.path' to "
        "RoundPipeStrategy only for such a module that is not a registered submodule; "
        "otherwise put the layers to pipeline in an nn.Sequential"
    )

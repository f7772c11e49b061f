"""Following a Hugging Face causal LM's (or sequence classifier's) layout by its
family entry, and the config settings the pipeline layers would not honour as
the model does."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

from torch import nn

from .families import LAYER_TYPES, SLIDING_IF_WINDOW, Family, Setting, family_for
from .families import supported_families as _supported

__all__ = ["Layout", "check_config", "layout_of", "layout_problem"]

# attention implementations whose mask the adapter builds exactly as the model
# does and whose result does not depend on how the batch is split
ATTENTION = ("eager", "sdpa")
# settings no family's pipeline layers implement
_GENERIC = (
    Setting(
        "is_causal",
        True,
        "the model then passes is_causal=False to every attention call and builds "
        "bidirectional masks",
    ),
)


CAUSAL_LM = "causal_lm"
SEQUENCE_CLASSIFICATION = "sequence_classification"
TOKEN_CLASSIFICATION = "token_classification"
QUESTION_ANSWERING = "question_answering"


@dataclass(frozen=True)
class _Task:
    """A task head the adapters pipeline besides the LM head."""

    task: str
    suffix: str  # of the transformers class names
    head: tuple[str, ...]  # where the head is, the first found
    # the classes whose forwards the adapter reproduces (tests compare each)
    reproduced: frozenset[str]
    what: str  # what the reproduced forwards do, for a refusal


_TASKS = (
    _Task(
        SEQUENCE_CLASSIFICATION,
        "ForSequenceClassification",
        ("score",),
        frozenset(
            {
                "GenericForSequenceClassification",
                "BloomForSequenceClassification",
                "FalconForSequenceClassification",
                "GPT2ForSequenceClassification",
                "GPTBigCodeForSequenceClassification",
                "GPTNeoForSequenceClassification",
                "GPTNeoXForSequenceClassification",
                "OPTForSequenceClassification",
            }
        ),
        "sequence classifiers that score each row's last non-padding token with a 'score' "
        "head (GenericForSequenceClassification's forward, as the *ForSequenceClassification "
        "classes of transformers do)",
    ),
    _Task(
        TOKEN_CLASSIFICATION,
        "ForTokenClassification",
        ("score", "classifier"),
        frozenset(
            {
                "GenericForTokenClassification",
                "BloomForTokenClassification",
                "FalconForTokenClassification",
                "GPT2ForTokenClassification",
                "GPTBigCodeForTokenClassification",
                "GPTNeoForTokenClassification",
                "GPTNeoXForTokenClassification",
            }
        ),
        "token classifiers that score every token after a dropout (GenericForTokenClassification's "
        "forward, as the *ForTokenClassification classes of transformers do)",
    ),
    _Task(
        QUESTION_ANSWERING,
        "ForQuestionAnswering",
        ("qa_outputs",),
        frozenset(
            {
                "GenericForQuestionAnswering",
                "BloomForQuestionAnswering",
                "FalconForQuestionAnswering",
                "GPT2ForQuestionAnswering",
                "GPTNeoForQuestionAnswering",
                "GPTNeoXForQuestionAnswering",
                "OPTForQuestionAnswering",
            }
        ),
        "extractive question-answering models that score every token as an answer's start and "
        "end with a 'qa_outputs' head (GenericForQuestionAnswering's forward, as the "
        "*ForQuestionAnswering classes of transformers do)",
    ),
)


@dataclass(frozen=True)
class Layout:
    """The modules of one causal LM, where its family entry says they are (of
    a sequence classifier: its ``score`` is the head, ``task``)."""

    family: Family
    base: nn.Module
    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module
    rotary: nn.Module | None
    positions: nn.Module | None
    dropout: nn.Module | None
    embed_norm: nn.Module | None = None
    project_in: nn.Module | None = None
    project_out: nn.Module | None = None
    head_pre: nn.Module | None = None
    task: str = CAUSAL_LM

    @property
    def config(self) -> Any:
        """The language model's settings: its ``*Model``'s config (the model's
        own, or a multimodal model's text config)."""
        return self.base.config

    @property
    def packs_sequences(self) -> bool:
        """Whether the model keeps packed sequences apart (its mask functions
        get ``position_ids``): read from its forward's source, where models
        changed between transformers releases (Falcon's in 5.2x), else the
        family entry's ``packed_sequences``."""
        read = _masks_get_positions(type(self.base))
        return self.family.packed_sequences if read is None else read


@functools.cache
def _masks_get_positions(model_cls: type) -> bool | None:
    """Whether ``model_cls.forward`` gives ``position_ids`` to one of its
    ``create_*_mask`` calls, by keyword or in a dict it unpacks into one;
    None when its source cannot be read or it calls none. (The source, not
    a run: nothing of the model runs before the pipeline is built.)"""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(model_cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None

    def given(value: ast.expr) -> bool:
        return not (isinstance(value, ast.Constant) and value.value is None)

    def is_helper(name: str) -> bool:
        return name.startswith("create_") and name.endswith("_mask")

    # names of dicts with a "position_ids" entry ({"position_ids": ...} or
    # d["position_ids"] = ...), and of variables bound to a mask helper
    # (mask_function = create_causal_mask if ... else create_sliding_...)
    dicts: set[str] = set()
    helpers: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and any(
                    isinstance(n, ast.Name) and is_helper(n.id) for n in ast.walk(node.value)
                ):
                    helpers.add(target.id)
                elif isinstance(target, ast.Name) and isinstance(node.value, ast.Dict):
                    pairs = zip(node.value.keys, node.value.values, strict=True)
                    if any(
                        isinstance(k, ast.Constant) and k.value == "position_ids" and given(v)
                        for k, v in pairs
                    ):
                        dicts.add(target.id)
                elif (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.value, ast.Name)
                    and isinstance(target.slice, ast.Constant)
                    and target.slice.value == "position_ids"
                    and given(node.value)
                ):
                    dicts.add(target.value.id)
    found: bool | None = None
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        if not (is_helper(name) or name in helpers):
            continue
        gets = any(
            (k.arg == "position_ids" and given(k.value))
            or (k.arg is None and isinstance(k.value, ast.Name) and k.value.id in dicts)
            for k in node.keywords
        )
        found = gets or bool(found)
    return found


def _child(root: nn.Module, path: str | None) -> nn.Module | None:
    """A registered submodule (not one a wrapper forwards to by ``__getattr__``)."""
    if path is None:
        return None
    obj = root
    for part in path.split("."):
        obj = obj._modules.get(part) if isinstance(obj, nn.Module) else None
        if obj is None:
            return None
    return obj


def _model_type(module: nn.Module) -> Any:
    return getattr(getattr(module, "config", None), "model_type", None)


@functools.cache
def _families_by_class() -> dict[str, Family]:
    """``*ForCausalLM`` class name -> family, from transformers' causal-LM
    auto mapping (model types such as ``exaone`` or ``internlm3`` load a
    supported family's classes under their own name); empty without
    transformers."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return {}
    out: dict[str, Family] = {}
    for model_type, names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        family = family_for(model_type)
        if family is None:
            continue
        for name in (names,) if isinstance(names, str) else names:
            out.setdefault(name, family)
    return out


def _family_of(module: nn.Module) -> Family | None:
    """The family of a causal LM: by ``config.model_type``, else, for a
    transformers class under another model type, by the class (what runs is
    the class's code)."""
    family = family_for(_model_type(module))
    cls = type(module)
    if family is None and cls.__module__.startswith("transformers.models."):
        family = _families_by_class().get(cls.__name__)
    return family


def _forward_owner(module: nn.Module) -> type:
    """The class whose ``forward`` the module runs (the first in its MRO
    defining one)."""
    return next(c for c in type(module).__mro__ if "forward" in vars(c))


def _task_of(module: nn.Module) -> _Task | None:
    """The task head of (a subclass of) a transformers class the adapters
    pipeline besides causal LMs (None: none of them)."""
    for c in type(module).__mro__:
        if c.__module__.startswith("transformers."):
            task = next((t for t in _TASKS if c.__name__.endswith(t.suffix)), None)
            if task is not None:
                return task
    return None


def _reproduced(module: nn.Module, task: _Task) -> bool:
    """Whether the module's forward is one the adapter reproduces (not a
    subclass's own)."""
    owner = _forward_owner(module)
    return owner.__name__ in task.reproduced and owner.__module__.startswith("transformers.")


def _head_path(module: nn.Module, family: Family) -> str:
    """Where the head is: the LM head, or a task head's (the first found)."""
    task = _task_of(module)
    if task is None:
        return family.lm_head
    return next((p for p in task.head if _child(module, p) is not None), task.head[0])


def _base_path(module: nn.Module, family: Family) -> str:
    """Where the decoder (the family's ``*Model``) is: where the family entry
    says, or a task model's ``base_model_prefix`` where it keeps it there
    (transformers' generic question-answering heads keep Llama's, Qwen3's
    and others' under ``transformer``)."""
    if _child(module, family.base) is None and _task_of(module) is not None:
        prefix = getattr(type(module), "base_model_prefix", None)
        if isinstance(prefix, str) and prefix and _child(module, prefix) is not None:
            return prefix
    return family.base


def layout_of(module: nn.Module) -> Layout | None:
    """The module's layout when it is a causal LM (or a sequence classifier)
    of a supported family laid out as its entry says; else None
    (:func:`layout_problem` says why)."""
    family = _family_of(module)
    if family is None:
        return None
    task = _task_of(module)
    if task is not None and not _reproduced(module, task):
        return None
    head = _child(module, _head_path(module, family))
    base_path = _base_path(module, family)
    paths = [p for p in family.module_paths(base_path) if p != family.lm_head]
    if head is None or any(_child(module, p) is None for p in paths):
        return None
    base = _child(module, base_path)
    layers = _child(base, family.layers)
    if not isinstance(layers, nn.ModuleList):
        return None
    return Layout(
        family,
        base,
        _child(base, family.embed),
        layers,
        _child(base, family.norm),
        head,
        _child(base, family.rotary),
        _child(base, family.positions),
        _child(base, family.embed_dropout),
        _child(base, family.embed_norm),
        _child(base, family.project_in),
        _child(base, family.project_out),
        _child(base, family.head_pre),
        CAUSAL_LM if task is None else task.task,
    )


def layout_problem(module: nn.Module) -> str | None:
    """Why a Hugging Face model cannot be pipelined: what was found and what
    the family entry needs (None: not a Hugging Face model, or it can be)."""
    model_type = _model_type(module)
    if not isinstance(model_type, str) or layout_of(module) is not None:
        return None
    family = _family_of(module)
    cls = type(module).__name__
    if family is None:
        return (
            f"a Hugging Face model with model_type {model_type!r}, which RoundPipe does not "
            f"support (supported: {_supported()})"
        )
    head, base_path = _head_path(module, family), _base_path(module, family)
    needed = [head if p == family.lm_head else p for p in family.module_paths(base_path)]
    missing = [p for p in needed if _child(module, p) is None]
    task = _task_of(module)
    if task is not None:
        if not _reproduced(module, task):
            owner = _forward_owner(module)
            return (
                f"a {cls} (model_type {model_type!r}) whose forward ({owner.__module__}."
                f"{owner.__qualname__}) RoundPipe does not reproduce: it pipelines {task.what}; "
                "train this one with another strategy (e.g. strategy='auto' or 'fsdp')"
            )
    elif family.lm_head in missing:
        if not cls.endswith("Model"):  # a task head: multiple choice, ...
            return (
                f"a {cls} (model_type {model_type!r}), a model with a task head other than "
                "the LM head, a classifier's or a question-answering head; RoundPipe pipelines "
                "causal LMs (the *ForCausalLM classes), sequence and token classifiers "
                "(*ForSequenceClassification, *ForTokenClassification) and extractive "
                "question answering (*ForQuestionAnswering): train this one with "
                "another strategy (e.g. strategy='auto' or 'fsdp'), or put its layers in an "
                "nn.Sequential with the head and loss as the last layer"
            )
        return (
            f"a {cls} (model_type {model_type!r}) without an LM head; RoundPipe pipelines "
            f"causal LMs: pass the {family.name} model with its head (its *ForCausalLM "
            "class, e.g. from AutoModelForCausalLM), not the bare decoder"
        )
    found = ", ".join(module._modules) or "none"
    base = _child(module, base_path)
    if base is not None:
        found += f"; in {base_path}: {', '.join(base._modules) or 'none'}"
    if not missing:  # the layer stack is not a ModuleList
        stack = f"{base_path}.{family.layers}"
        kind = type(_child(module, stack)).__name__
        return (
            f"a {cls} (model_type {model_type!r}) whose layout RoundPipe cannot follow: the "
            f"{family.name} entry needs {stack} to be an nn.ModuleList of decoder blocks, found "
            f"a {kind}"
        )
    return (
        f"a {cls} (model_type {model_type!r}) whose layout RoundPipe cannot follow: the "
        f"{family.name} entry needs the submodules {', '.join(needed)}, and "
        f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing (found: {found})"
    )


def layer_kinds(config: Any, family: Family, n: int) -> list[str]:
    """Each decoder layer's attention type, by its family's rule."""
    if family.mask_rule == LAYER_TYPES:
        names = dict(family.layer_type_kinds)
        kinds = [names.get(k, k) for k in getattr(config, family.layer_types_key)[:n]]
        if family.full_slides_if_window and getattr(config, "sliding_window", None) is not None:
            kinds = ["sliding_attention" if k == "full_attention" else k for k in kinds]
        return kinds
    if (
        family.mask_rule == SLIDING_IF_WINDOW
        and getattr(config, "sliding_window", None) is not None
    ):
        return ["sliding_attention"] * n
    return [family.every_layer] * n


def _check_setting(name: str, config: Any, setting: Setting) -> None:
    value = getattr(config, setting.name, setting.supported)
    if value != setting.supported:
        raise ValueError(
            f"{name}: config.{setting.name}={value!r} is not supported by the RoundPipe pipeline "
            f"({setting.why}); set config.{setting.name}={setting.supported!r}"
        )


def check_config(target: nn.Module, layout: Layout, name: str) -> None:
    """Refuse config settings the pipeline layers would not honour as the model
    does. What the pipeline layers leave out of the family's ``*Model.forward``
    and ``*ForCausalLM.forward``: the mask choice (reproduced per layer), the
    key-value cache (refused per call), ``output_attentions`` and
    ``output_hidden_states`` (refused), ``layers[: num_hidden_layers]``,
    ``logits_to_keep`` and the loss (checked per call), and the settings the
    family entry lists. Rotary settings are honoured (the model's own rotary
    module runs), as are tied embeddings. The settings are the language
    model's (:attr:`Layout.config`)."""
    config = layout.config
    family = layout.family
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ATTENTION:
        raise ValueError(
            f"{name}: config._attn_implementation={impl!r} is not supported by the RoundPipe "
            f"pipeline, which reproduces the model's attention masks for "
            f"{' and '.join(map(repr, ATTENTION))} only; load the model with "
            "attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'); "
            "'eager' where the model does not support sdpa)"
        )
    n = len(layout.layers)
    if family.slices_layers and config.num_hidden_layers < n:
        raise ValueError(
            f"{name}: config.num_hidden_layers={config.num_hidden_layers}, but the model holds "
            f"{n} decoder layers; the model runs only the first num_hidden_layers and the "
            "pipeline would run them all: remove the extra layers or set "
            f"config.num_hidden_layers={n}"
        )
    if family.mask_rule == LAYER_TYPES:
        key = family.layer_types_key
        types = list(getattr(config, key, None) or [])
        if len(types) < n:
            raise ValueError(
                f"{name}: config.{key} has {len(types)} entries for {n} decoder layers; "
                "give one attention type per layer"
            )
        # (a family that names its own types knows those only)
        known = [name for name, _ in family.layer_type_kinds] or list(family.layer_kinds)
        for i, kind in enumerate(types[:n]):
            if kind not in known:
                raise ValueError(
                    f"{name}: config.{key}[{i}]={kind!r} is not supported by the RoundPipe "
                    f"pipeline: {type(layout.base).__name__} builds "
                    f"{' and '.join(map(repr, known))} masks only; use one of those "
                    "layer types"
                )
    for key in ("output_attentions", "output_hidden_states"):
        if getattr(config, key, False):
            raise ValueError(
                f"{name}: config.{key}=True is not supported by the RoundPipe pipeline (it "
                f"returns the loss and logits only); set config.{key}=False"
            )
    for setting in (*_GENERIC, *family.refused):
        _check_setting(name, config, setting)
    base = layout.base
    hooks = [*base._forward_hooks.values(), *base._forward_pre_hooks.values()]
    if any(_profiler_label(h) for h in hooks):
        raise ValueError(
            f"{name}: Lightning's PyTorchProfiler labels every module's forward with hooks "
            "(record_module_names=True, its default), which the RoundPipe pipeline does not "
            "run (it calls the embedding, decoder layers and head itself, on worker threads); "
            "use Trainer(profiler=PyTorchProfiler(record_module_names=False)): RoundPipe "
            "labels every stage task with its own record_function range"
        )
    if hooks:
        raise ValueError(
            f"{name}: {type(base).__name__} has forward hooks, which the RoundPipe pipeline "
            "would not run (it calls the embedding, decoder layers and head itself); register "
            "them on those submodules instead, or remove them"
        )


def _profiler_label(hook: Any) -> bool:
    """Whether a forward hook is one of Lightning's PyTorchProfiler module
    labels (a partial of a ``RegisterRecordFunction`` method)."""
    owner = getattr(getattr(hook, "func", hook), "__self__", None)
    return type(owner).__name__ == "RegisterRecordFunction"


def router_recorder(base: nn.Module) -> tuple[type, int, str | None] | None:
    """The router class whose output transformers records as ``router_logits``
    (the model's ``_can_record_outputs``), the index of the logits in its
    output and the layer name a router's module name must hold (None: any;
    MiniMax names ``mlp.gate``); None when the model names no class."""
    spec = (getattr(type(base), "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(spec, "target_class", None)
    if not isinstance(target, type):
        return None
    return target, int(spec.index), getattr(spec, "layer_name", None)


def recorded_routers(
    layer: nn.Module, prefix: str, recorder: tuple[type, int, str | None]
) -> tuple[str, ...]:
    """The submodule paths, within ``layer`` (the block at ``prefix`` in the
    model's ``*Model``, ``"layers.3"``), of the routers transformers records,
    matched as transformers matches them: by class and, where the model names
    one, by layer name within the module's name."""
    cls, _, layer_name = recorder
    wanted = None if layer_name is None else "." + layer_name.strip(".") + "."
    return tuple(
        p
        for p, m in layer.named_modules()
        if isinstance(m, cls) and (wanted is None or wanted in f".{prefix}.{p}.")
    )

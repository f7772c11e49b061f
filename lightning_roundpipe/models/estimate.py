"""Before renting hardware: the plan, device and host memory, longest
sequence and simulated throughput of a Hugging Face causal LM under RoundPipe,
from its config alone (``python -m lightning_roundpipe.plan estimate``).

The model is built on the meta device (no weights are allocated or
downloaded); each distinct pipeline layer is materialised once, with random
values, for the activation probes of :mod:`.memory`. The stage memory limit
is what the engine would take on such a GPU (half the memory left after the
CUDA context: a worker holds a stage and prefetches the next), tiles are sized
like ``tile_memory="auto"``, and the plan is the one the engine would choose
for the predicted activations (:func:`~..plan.decide.plan_for_activations`).
Times come from matmul FLOPs at an assumed sustained rate (``tflops``); weight
traffic over an assumed link bandwidth says whether uploads can hide behind
compute.

With ``servers > 1`` (data parallelism: one replica per server), the fp32
gradients of the trainable parameters are all-reduced after every step over a
``network_gbps`` link, in buckets from the last layer down, timed against the
simulated backward (:mod:`..plan.replicas`); the optimizer step that the
asynchronous mode overlaps with is modelled as memory-bound on the host
(:data:`OPTIMIZER_BYTES` per trainable parameter at ``optimizer_gbps``).
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..plan import (
    Copies,
    LayerCosts,
    PlanError,
    ReductionEstimate,
    StagePlan,
    estimate_reduction,
    simulate,
)
from ..plan.decide import Predicted, host_need, initial_plan, plan_for_activations
from ..plan.policy import choose_round
from ..runtime.host import (
    HOST_ACTIVATION_SHARE,
    gradient_bytes,
    plan_staging_bytes,
    state_bytes,
    within_staging,
)
from ..runtime.options import PRECISION_ALIASES, PRECISIONS
from ..runtime.profiler import active_parameters, estimate_costs
from .attention import attention_heads
from .classifier import SequenceClassifierAdapter
from .finding import hf_adapter
from .layout import layout_of
from .memory import ActivationModel, applied_tiles, longest_sequence, value_bytes

__all__ = ["Estimate", "estimate", "load_config"]

_log = logging.getLogger(__name__)

GiB = 2**30
#: memory the CUDA context and allocator keep on a GPU before any tensor
CUDA_CONTEXT = 1 * GiB


def gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def host_state_bytes(
    model: nn.Module,
    precision: str,
    frozen_dtype: torch.dtype | None = None,
    double_buffer: bool = True,
) -> int:
    """Host bytes of the model's state under RoundPipe: per trainable parameter
    the parameter, its master copy in the compute dtype (two with
    ``double_buffer``, the asynchronous optimizer's default), the fp32
    gradient buffer and two Adam moments (in the parameter's dtype); per
    frozen one the parameter (in ``frozen_dtype``) and a master copy unless
    the parameter is already in the compute dtype, then it is its own master.
    Parameters are fp32 unless the precision is "-true" (Lightning converts
    the model)."""
    compute = PRECISIONS[precision]
    param = compute if precision.endswith("-true") else torch.float32
    frozen = frozen_dtype or param
    return state_bytes(
        (
            (p.numel(), param if p.requires_grad else frozen, p.requires_grad)
            for p in model.parameters()
        ),
        compute,
        2 if double_buffer else 1,
    )


#: host bytes an Adam step streams per trainable parameter (the fp32 master,
#: its gradient and the two moments, read once; a simple memory-bound model
#: of a fused step that leaves out the writes and the compute-dtype copy)
OPTIMIZER_BYTES = 16

#: host bytes per trainable parameter of an update besides the step: the
#: gradient check (fp32 read) and the weight copy (fp32 read; the write, in
#: the compute dtype, is added per precision)
UPDATE_COPY_BYTES = 4 + 4

#: lengths below the longest sequence found that its search tries as well
#: (:func:`~.memory.longest_sequence`): whether a length fits depends on the
#: plan the planner picks at it, which does not only grow with the length
LENGTH_CHECKS = 16


def load_config(source: str) -> Any:
    """A Hugging Face config from a JSON file, a directory holding
    ``config.json``, or a model name whose config is in the local cache
    (nothing is downloaded). A size the file leaves out takes transformers'
    default for its model type, and a warning says which and what."""
    import transformers

    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{source}: a directory without config.json (the file a Hugging Face model "
                "directory keeps its config in); pass the path of the config JSON file"
            )
        path = path / "config.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a config JSON file ({exc})") from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise ValueError(f"{path}: a config JSON needs 'model_type'")
        _check_model_type(data["model_type"], path)
        try:
            config = transformers.AutoConfig.for_model(**data)
        except ValueError:
            raise
        except Exception as exc:  # (transformers' own validation: its message says what)
            raise ValueError(f"{path}: {type(exc).__name__}: {exc}") from exc
        _note_defaults(data, config, path)  # (first: a default may be what a check refuses)
        _check_sizes(config, str(path))
        return config
    try:
        config = transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    except OSError as exc:
        raise ValueError(
            f"{source!r} is neither a config JSON file nor a model whose config is in the "
            "local Hugging Face cache (nothing is downloaded); pass the path of its config.json"
        ) from exc
    _check_sizes(config, source)
    return config


def _check_model_type(model_type: Any, path: Path) -> None:
    """A model type transformers knows, or an error naming the closest ones
    (transformers' own lists all of its 800-odd types)."""
    import difflib

    import transformers
    from transformers import CONFIG_MAPPING

    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return
    known = list(CONFIG_MAPPING.keys())
    close = difflib.get_close_matches(str(model_type).lower(), known, n=3, cutoff=0.75)
    hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
    raise ValueError(
        f"{path}: model_type {model_type!r} is not one transformers "
        f"{transformers.__version__} knows ({len(known)} types; {hint}a newer transformers "
        "may know it)"
    )


#: the sizes that decide an estimate, warned about when a config file leaves
#: them to transformers' defaults
_DECIDING_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


def _note_defaults(data: dict, config: Any, path: Path) -> None:
    """Warn about the deciding sizes ``data`` (a config file's contents)
    leaves out, which ``config`` took from transformers' defaults (a
    multimodal model's from its ``text_config``): a typo in a field's name
    would otherwise estimate another model without a word."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    given = data.get("text_config") if text is not config else data
    if not isinstance(given, dict):
        given = {}
    aliases = getattr(type(text), "attribute_map", {}) or {}
    taken = [
        f"{name}={value}"
        for name in _DECIDING_SIZES
        if name not in given
        and aliases.get(name) not in given
        and (value := _size(text, name)) is not None
    ]
    if taken:
        _log.warning(
            "%s leaves out %s: the estimate uses transformers' defaults for %r (%s)",
            path,
            ", ".join(t.split("=")[0] for t in taken),
            getattr(text, "model_type", type(text).__name__),
            ", ".join(taken),
        )


def _size(config: Any, name: str) -> Any:
    """``config``'s ``name``, or None where it has none, or none for the whole
    model (a heterogeneous config's per-layer sizes, which it refuses to give
    as one)."""
    try:
        return getattr(config, name, None)
    except Exception:  # (transformers' AmbiguousGlobalPerLayerAttributeError)
        return None


def _check_sizes(config: Any, source: str) -> None:
    """A config's sizes must be positive (a negative width gives a tensor
    error deep in building the model, a zero depth a meaningless estimate),
    its attention heads a multiple of its key-value heads (else the model
    fails in its first forward pass), and its position limit, where it gives
    one, positive (none would be searched past)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config

    def positive(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{source}: {name} must be a positive integer, got {value!r}")

    for name in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "intermediate_size",
        "head_dim",
    ):
        value = _size(text, name)
        if value is None:
            continue
        if name == "intermediate_size" and isinstance(value, (list, tuple)):
            for each in value:  # (one per layer: Gemma 3n)
                positive(name, each)
        elif name == "head_dim" and value == 0 and _size(text, "qk_rope_head_dim") is not None:
            pass  # (multi-head latent attention: head_dim is its RoPE part, none for NoPE)
        else:
            positive(name, value)
    heads, kv_heads = _size(text, "num_attention_heads"), _size(text, "num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise ValueError(
            f"{source}: num_attention_heads ({heads}) must be a multiple of "
            f"num_key_value_heads ({kv_heads}): each key-value head serves a group of "
            "query heads"
        )
    # (XLNet's property says -1 for no limit: not the config's own value)
    if not isinstance(getattr(type(text), "max_position_embeddings", None), property):
        value = _size(text, "max_position_embeddings")
        if value is not None:
            positive("max_position_embeddings", value)


def _causal_lm_class(config: Any) -> Any:
    """What builds the causal LM of ``config``: ``AutoModelForCausalLM``, or,
    for a config class its mapping lists under no model type, the mapped
    ``*ForCausalLM`` class made for that config class (Emu3's text config,
    whose class the mapping lists under the multimodal model type)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if type(config) in transformers.AutoModelForCausalLM._model_mapping:
        return transformers.AutoModelForCausalLM
    for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        for name in (names,) if isinstance(names, str) else names:
            cls = getattr(transformers, name, None)
            if cls is not None and getattr(cls, "config_class", None) is type(config):
                return cls
    from .families import supported_families

    # (transformers' own message lists every causal LM config class it has)
    raise ValueError(
        f"model_type {getattr(config, 'model_type', type(config).__name__)!r} has no causal "
        "language model in transformers (no *ForCausalLM class takes its config: an "
        "encoder-decoder or encoder-only model); RoundPipe pipelines decoder-only causal LMs "
        f"(supported: {supported_families()})"
    )


class ConfigError(ValueError):
    """The model cannot be built from the config (the command line names the file)."""


def _model_class(config: Any) -> Any:
    """What builds the model of ``config``: the sequence or token classifier
    or question-answering model its ``architectures`` name (a reward model's
    config), else its causal LM."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if cls and name.endswith(
            ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
        ):
            return cls
    return _causal_lm_class(config)


def _meta_model(config: Any, lora_rank: int | None) -> nn.Module:
    import transformers

    cls = _model_class(config)
    build = cls.from_config if cls is transformers.AutoModelForCausalLM else cls._from_config
    try:
        with torch.device("meta"):
            try:
                model = build(config, attn_implementation="sdpa")
            except ValueError:  # no sdpa for this family
                model = build(config, attn_implementation="eager")
    except Exception as exc:  # (the model's own checks: a pad token past the vocabulary)
        raise ConfigError(
            f"{cls.__name__} cannot be built from this config: {type(exc).__name__}: {exc}"
        ) from exc
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        # every linear layer but the head, and but those whose forward does not
        # return a tensor (the routers of PhiMoE and Llama 4 subclass nn.Linear
        # and return routing tuples, which a LoRA wrapper cannot add to)
        lora = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear")
        # (and but those PEFT refuses LoRA on in this model: Mamba projections;
        # and a classifier's score, which PEFT's SEQ_CLS, TOKEN_CLS and QUESTION_ANS train whole)
        layout = layout_of(model)
        head = None if layout is None else layout.lm_head
        left_out = [
            name
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear)
            and (not _returns_a_tensor(m) or _peft_refuses(lora, model, name) or m is head)
        ]
        lora.exclude_modules = left_out or None
        with torch.device("meta"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = get_peft_model(model, lora).get_base_model()  # adapters injected
        # peft's warnings about the config built here (its deprecated transformers
        # calls, its own MoE target patterns) are nothing the user can act on
        for w in caught:
            _log.debug("peft, injecting LoRA for the estimate: %s", w.message)
    return model


def _peft_refuses(lora: Any, model: nn.Module, name: str) -> bool:
    """Whether PEFT refuses a LoRA adapter on the module ``name`` of ``model``
    (its rule for Mamba models' ``out_proj`` and ``conv1d``), asked of PEFT's
    own check where this PEFT has it."""
    try:
        from peft.tuners import tuners_utils
    except ImportError:
        return False
    check = getattr(tuners_utils, "_check_lora_target_modules_mamba", None)
    if check is None:
        return False
    try:
        check(lora, model, name.rsplit(".", 1)[-1])
    except ValueError:
        return True
    return False


def _returns_a_tensor(linear: nn.Linear) -> bool:
    """Whether a linear layer (on the meta device) maps a token's features to
    its outputs, as LoRA's wrapper needs (it adds its update, computed from
    the same input, to the output): nn.Linear's own forward does; a
    subclass's is tried on a meta input of one token, and must give one
    tensor of ``out_features`` per token (a forward that wants other
    arguments is given the benefit of the doubt, as PEFT's "all-linear"
    would; one that fails on the token, as DeepSeek-V4's grouped projection
    wanting its input split in groups, is left out)."""
    if type(linear).forward is nn.Linear.forward:
        return True
    x = torch.empty(1, 1, linear.in_features, device="meta", dtype=linear.weight.dtype)
    try:
        inspect.signature(linear.forward).bind(x)
    except TypeError:  # (it wants other inputs: PEFT adapts it, as it would the model)
        return True
    try:
        with torch.no_grad():
            out = linear(x)
    except Exception:
        return False
    return isinstance(out, torch.Tensor) and tuple(out.shape) == (1, 1, linear.out_features)


def _materialise(layer: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A CPU copy of a meta ``layer`` with random values (what a probe needs:
    shapes, dtypes and finite numbers)."""
    out = copy.deepcopy(layer).to_empty(device="cpu").to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in [*out.parameters(), *out.buffers()]:
            if t.is_floating_point():
                _fill_random(t, g)
            else:
                t.zero_()
    return out


_RANDOM_RUN = 1_000_003  # (prime: no row of a weight repeats another)


def _fill_random(t: torch.Tensor, g: torch.Generator) -> None:
    """``t`` filled with N(0, 0.02) values: drawn for its first million
    elements, copied from them on (drawing them all took 10 of the 50
    seconds of a Llama-3.1-8B estimate, its embedding and head each 525M
    values; a probe needs finite values of a weight's scale, not fresh ones)."""
    flat = t.view(-1) if t.is_contiguous() else None
    if flat is None or flat.numel() <= 2 * _RANDOM_RUN:
        t.normal_(0.0, 0.02, generator=g)
        return
    flat[:_RANDOM_RUN].normal_(0.0, 0.02, generator=g)
    done = _RANDOM_RUN
    while done < flat.numel():
        n = min(done, flat.numel() - done)
        flat[done : done + n].copy_(flat[:n])
        done += n


def materialiser(dtype: torch.dtype) -> Callable[[nn.Module], nn.Module]:
    """``prepare`` for the activation probes of a model on the meta device:
    each layer's CPU copy with random values in ``dtype``, made once."""
    copies: dict[int, nn.Module] = {}

    def real(layer: nn.Module) -> nn.Module:
        if id(layer) not in copies:
            copies[id(layer)] = _materialise(layer, dtype)
        return copies[id(layer)]

    return real


@dataclass(frozen=True)
class Estimate:
    """What :func:`estimate` found (bytes, seconds, tokens per second)."""

    model: str
    parameters: int
    trainable: int
    gpus: int
    stage_limit: int
    seq: int
    micro_batch: int
    num_microbatches: int
    plan: str
    stage_peaks: list[float]
    host: dict[str, float]
    host_memory: int | None
    longest_seq: int
    step_seconds: float
    tokens_per_second: float
    #: each GPU link's time per step for the weights going up and the fp32
    #: gradients coming down (at once), once per round; the step is no
    #: shorter (they hide behind compute only up to its length)
    upload_seconds: float
    notes: list[str] = field(default_factory=list)
    #: data parallelism: replicas (one per server) and their network (Gb/s)
    servers: int = 1
    network_gbps: float = 100.0
    #: one optimizer step on the host (the model of :data:`OPTIMIZER_BYTES`)
    optimizer_seconds: float = 0.0
    #: the host's work per update on one server: the step, the gradient check
    #: and the weight copies (:data:`UPDATE_COPY_BYTES`); it overlaps the
    #: devices' work with the asynchronous optimizer and follows it without
    host_update_seconds: float = 0.0
    #: the devices' part of ``step_seconds``
    device_seconds: float = 0.0
    #: device time per step (all GPUs together) spent waiting for host-device
    #: copies no compute hides (nothing prefetched; a rewalked stage's
    #: uploads of its input again), part of ``device_seconds``
    copy_seconds: float = 0.0
    async_optimizer: bool = True
    #: whether a worker prefetches the next stage's weights (False: a stage
    #: takes all of the GPU's usable memory)
    prefetch: bool = True
    #: the gradient all-reduce per step (``servers > 1`` only)
    reduction: ReductionEstimate | None = None
    #: what bounds ``longest_seq``: "device memory", "host memory" or the
    #: search's ceiling
    longest_bound: str = "device memory"
    #: half of a GPU's usable bytes: a stage's share when its weights matter
    half_budget: int = 0
    #: where host memory bounds ``longest_seq``: the longest sequence the GPUs
    #: alone allow, and the host bytes it needs (model state and, at the
    #: engine's default share of what that leaves, its plan's boundary values)
    device_longest_seq: int | None = None
    device_longest_host: float | None = None

    @property
    def cluster_tokens_per_second(self) -> float:
        """Tokens per second of all servers together: each server's rate,
        its step lengthened by the all-reduce's exposed time."""
        if self.reduction is None or self.step_seconds <= 0:
            return self.tokens_per_second * self.servers
        return self.tokens_per_second * self.reduction.throughput(self.step_seconds)

    @property
    def fits(self) -> bool:
        host_ok = self.host_memory is None or self.host["total"] <= self.host_memory
        return max(self.stage_peaks) <= self.stage_limit and host_ok

    def _overflow(self) -> str:
        """What does not fit, and by how much."""
        out = []
        worst = max(self.stage_peaks)
        if worst > self.stage_limit:
            out.append(
                f"a stage's predicted peak, {gib(worst)}, is over the {gib(self.stage_limit)} a "
                "stage may use"
            )
        if self.host_memory is not None and self.host["total"] > self.host_memory:
            out.append(f"host memory {gib(self.host['total'])} is over {gib(self.host_memory)}")
        return "; ".join(out)

    def report(self) -> str:
        lines = [
            f"model: {self.model}, {self.parameters / 1e9:.3g}B parameters "
            f"({self.trainable / 1e9:.3g}B trainable)",
            f"GPUs: {self.gpus}, a stage may use {gib(self.stage_limit)} of each"
            + (
                " (all of its usable memory: nothing prefetched, the next stage's weights go "
                "up once a stage is done)"
                if not self.prefetch
                else " (more than half: the next stage's weights, prefetched meanwhile, need less)"
                if self.stage_limit > self.half_budget + 1
                else ""
            ),
            f"setting: {self.micro_batch} x {self.seq} tokens per micro-batch, "
            f"{self.num_microbatches} micro-batches per step",
            f"plan: {self.plan}",
            "device memory per stage (predicted peak): "
            + ", ".join(gib(p) for p in self.stage_peaks),
            f"host memory: {gib(self.host['total'])} (model state {gib(self.host['state'])}, "
            f"boundary activations {gib(self.host['activations'])}, page-locked gradient "
            f"staging {gib(self.host.get('staging', 0.0))})"
            + ("" if self.host_memory is None else f" of {gib(self.host_memory)}"),
            "fits: yes" if self.fits else f"fits: NO ({self._overflow()})",
            f"longest sequence at micro-batch 1: {self.longest_seq} tokens "
            f"(bounded by {self.longest_bound}"
            + (
                ""
                if self.device_longest_seq is None or self.device_longest_host is None
                else f"; the GPUs alone allow {self.device_longest_seq} tokens, with "
                f"{gib(self.device_longest_host)} of host memory"
            )
            + ")",
            f"simulated step{'' if self.fits else ' (as if it fitted)'}: "
            f"{self.step_seconds:.3g} s, {self.tokens_per_second:.4g} tokens/s "
            f"(weight uploads need {self.upload_seconds:.3g} s per step on each GPU's link"
            + (
                f"; the GPUs wait {self.copy_seconds:.3g} s in all for copies compute does not hide"
                if self.copy_seconds > 0
                else ""
            )
            + (
                ""
                if self.servers > 1
                else f"; the host's {self.host_update_seconds:.3g} s per update "
                + (
                    f"overlap the devices' {self.device_seconds:.3g} s"
                    if self.async_optimizer
                    else f"follow the devices' {self.device_seconds:.3g} s"
                )
            )
            + ")",
        ]
        red = self.reduction
        if red is not None:

            def size(x: float) -> str:  # gradients of small models are megabytes
                return gib(x) if x >= GiB else f"{x / 2**20:.3g} MiB"

            opt = f"{self.optimizer_seconds:.3g} s"
            if red.async_optimizer:
                mode = f"asynchronous optimizer, with the {opt} host optimizer step it overlaps"
            else:
                mode = f"synchronous optimizer; the {opt} host optimizer step, not counted, "
                mode += "follows as on one server"
            k = len(red.buckets)
            lines += [
                f"servers: {self.servers} replicas on a {self.network_gbps:g} Gb/s network; "
                f"gradients all-reduced per step: {size(red.gradient_bytes)} per server in "
                f"{k} bucket{'' if k == 1 else 's'}, {size(red.bytes_sent)} sent by each server",
                f"all-reduce: link busy {red.link_seconds:.3g} s per step, exposed "
                f"{red.exposed:.3g} s per step ({mode})",
                f"throughput of {self.servers} servers: {self.cluster_tokens_per_second:.4g} "
                f"tokens/s",
            ]
            if red.advice:
                lines.append(f"network: {red.advice}")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def _times(
    layers: list[nn.Module], config: Any, seq: int, micro_batch: int, tflops: float
) -> tuple[list[float], list[float]]:
    """Seconds of each layer's forward and backward from its matmul FLOPs
    (2 per active parameter and token; causal attention ``2 s^2 b`` per head
    dimension and query head), backward twice the forward."""
    tokens = seq * micro_batch
    heads, _, head_dim = attention_heads(config) or (0, 0, 0)
    rate = tflops * 1e12
    fwd = []
    for i, layer in enumerate(layers):
        flops = 2 * active_parameters(layer) * tokens
        if 0 < i < len(layers) - 1:
            flops += 2 * seq * seq * micro_batch * heads * head_dim
        if i == 0:
            flops = tokens * config.hidden_size  # a lookup
        fwd.append(flops / rate)
    return fwd, [2 * f for f in fwd]


def boundary_bytes(plan: Any, tokens: int, hidden: int, element: int) -> int:
    """Host bytes one micro-batch of ``tokens`` tokens keeps between stages
    under ``plan`` at most: the hidden states (``element`` bytes each) and
    positions of every boundary value it holds
    (:meth:`~..plan.StagePlan.boundaries_per_microbatch`)."""
    return value_bytes(tokens, hidden, element) * plan.boundaries_per_microbatch()


def _check_layers_fit(
    memory: list[float], limit: int, gpu_memory: float, lora_rank: int | None
) -> None:
    """Refuse a GPU on which some layer's weights and gradients alone exceed
    what a stage may use (half of what the CUDA context leaves), naming the
    GPU memory that would hold it, before any probe runs."""
    if not memory or max(memory) <= limit:
        return
    worst = max(range(len(memory)), key=memory.__getitem__)
    what = "the embedding" if worst == 0 else "the head" if worst == len(memory) - 1 else "a block"
    need = 2 * memory[worst] + CUDA_CONTEXT
    raise ValueError(
        f"layer {worst} ({what}) needs {gib(memory[worst])} of device memory for its weights "
        f"and gradients alone, more than a stage may use on a GPU of {gib(gpu_memory)} "
        f"({gib(limit)}: half of what the CUDA context leaves, the other half holding the next "
        f"stage's weights): gpu_memory (--gpu-memory) must be at least {gib(need)}"
        + (
            ""
            if lora_rank
            else ", or train LoRA adapters (--lora-rank): frozen weights have no gradients"
        )
    )


def tile_budget(gpu_memory: float) -> int:
    """Bytes per tile on a GPU of ``gpu_memory`` bytes as ``tile_memory="auto"``
    sizes them: an eighth of a stage's memory (half of what the CUDA context
    leaves: a stage and the next one, prefetched)."""
    return int((gpu_memory - CUDA_CONTEXT) // 2) // 8


def estimate(
    config: Any,
    *,
    gpu_memory: float,
    gpus: int = 1,
    host_memory: float | None = None,
    seq: int | None = None,
    micro_batch: int = 1,
    num_microbatches: int | None = None,
    precision: str = "bf16-mixed",
    lora_rank: int | None = None,
    tflops: float = 200.0,
    link_gbps: float = 25.0,
    async_optimizer: bool = True,
    name: str | None = None,
    servers: int = 1,
    network_gbps: float = 100.0,
    optimizer_gbps: float = 20.0,
    frozen_dtype: torch.dtype | None = None,
) -> Estimate:
    """Estimate RoundPipe on ``gpus`` GPUs of ``gpu_memory`` bytes with
    ``host_memory`` bytes of host memory (None: not checked) for a Hugging
    Face causal-LM ``config``: the plan and memory at ``seq`` tokens (default:
    the longest that fits) and ``micro_batch`` sequences per micro-batch, the
    longest sequence at micro-batch 1, and the simulated step at ``tflops``
    sustained TFLOP/s per GPU (weight uploads at ``link_gbps`` GB/s).
    ``lora_rank``: LoRA adapters of that rank on every linear layer (peft),
    the base frozen; else full fine-tuning. ``frozen_dtype``: the dtype the
    frozen weights are loaded in (default fp32, or the compute dtype of a
    "-true" precision); in the compute dtype they are their own master copy.

    ``servers`` replicas (one per server, data parallel) all-reduce their
    gradients over a ``network_gbps`` gigabit-per-second link each; the host
    optimizer step streams :data:`OPTIMIZER_BYTES` per trainable parameter at
    ``optimizer_gbps`` GB/s."""
    for label, count in (
        ("gpus", gpus),
        ("micro_batch", micro_batch),
        ("seq", seq),
        ("num_microbatches", num_microbatches),
        ("lora_rank", lora_rank),
        ("servers", servers),
    ):
        whole = isinstance(count, int) and not isinstance(count, bool)
        if count is not None and not (whole and count >= 1):
            raise ValueError(f"{label} must be an integer >= 1, got {count!r}")
    for label, value in (
        ("tflops", tflops),
        ("link_gbps", link_gbps),
        ("network_gbps", network_gbps),
        ("optimizer_gbps", optimizer_gbps),
    ):
        if not value > 0:
            raise ValueError(f"{label} must be > 0, got {value!r}")
    if frozen_dtype is not None and not lora_rank:
        # (the model is built with every weight trainable: a dtype for its
        # frozen ones would change nothing, silently)
        raise ValueError(
            "frozen_dtype (--frozen-dtype) is the dtype of the frozen base under LoRA adapters "
            "and needs lora_rank (--lora-rank): without adapters every weight is trained and "
            "none is frozen"
        )
    precision = PRECISION_ALIASES.get(precision, precision)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    dtype = PRECISIONS[precision]
    m = num_microbatches or gpus
    hidden = getattr(getattr(config, "get_text_config", lambda: config)(), "hidden_size", None)
    if lora_rank is not None and isinstance(hidden, int) and lora_rank > hidden:
        raise ValueError(
            f"lora_rank {lora_rank} is larger than the model's hidden_size {hidden}: an adapter "
            "of a rank above its layer's width adds parameters but nothing it can express; "
            f"give a rank of at most {hidden}"
        )
    model = _meta_model(config, lora_rank)
    adapter = hf_adapter(model, "model")
    settings = adapter.layout.config  # (a multimodal model's text config)
    layers = adapter.layers()
    sizes = estimate_costs(layers, dtype)
    budget_all = gpu_memory - CUDA_CONTEXT  # a worker's device bytes
    limit = int(budget_all // 2)  # a stage and the next one, prefetched
    if limit <= 0:
        raise ValueError(
            f"gpu_memory (--gpu-memory) must be more than the {gib(CUDA_CONTEXT)} the CUDA "
            f"context takes, got {gib(gpu_memory)}"
        )
    _check_layers_fit(sizes.memory or [], limit, gpu_memory, lora_rank)
    size = torch.empty(0, dtype=dtype).element_size()
    tiles = adapter.tiles_for(tile_budget(gpu_memory), dtype)
    models: dict[tuple, ActivationModel] = {}
    real = materialiser(dtype)

    def activations(tokens: int) -> ActivationModel:
        applied = applied_tiles(tiles, tokens)
        key = tuple(sorted(applied))
        if key not in models:
            try:
                models[key] = adapter.activation_model(dtype, applied, loss=True, prepare=real)
            except (ConfigError, PlanError, MemoryError, torch.OutOfMemoryError):
                raise
            except Exception as exc:  # (the model's own forward pass fails on the config)
                raise ConfigError(
                    f"{type(model).__name__} cannot be built from this config: its layers fail "
                    f"on a short probe input: {type(exc).__name__}: {exc}"
                ) from exc
        return models[key]

    state = host_state_bytes(model, precision, frozen_dtype, double_buffer=async_optimizer)
    hidden = int(settings.hidden_size)
    grads = gradient_bytes(layers)

    def staging(plan: StagePlan) -> int:
        """Page-locked buffers the gradient downloads of the plan's stages
        that compute gradients keep (the caching host allocator's blocks)."""
        return plan_staging_bytes(plan, grads, gpus)

    def left(plan: StagePlan) -> float | None:
        """Host bytes the model state and the plan's gradient staging leave
        (None: unchecked)."""
        return None if host_memory is None else host_memory - state - staging(plan)

    # what the host leaves before any activation is known, as the engine
    # decides it: from its first plan; what one micro-batch's boundary values
    # may take on the host before the plan changes is 80% of that
    spare = None if host_memory is None else host_memory - state
    start_plan = uncapped = initial_plan(
        sizes, gpus, m, given=None, async_optimizer=async_optimizer, memory_limit=limit
    )
    # smaller stages where the first plan's gradient staging would not fit
    # the host the model state leaves, as the engine starts
    size_cap: int | None = None
    if spare is not None and spare > 0:
        start_plan, cap = within_staging(
            start_plan,
            lambda cap: initial_plan(
                sizes,
                gpus,
                m,
                given=None,
                async_optimizer=async_optimizer,
                memory_limit=limit,
                size_limit=int(cap),
            ),
            sizes,
            grads,
            gpus,
            spare,
        )
        size_cap = None if cap is None else int(cap)
    start_left = left(start_plan)
    host_room = None if start_left is None else HOST_ACTIVATION_SHARE * max(0.0, start_left)

    def choose(s: int, b: int, host_limit: float | None) -> Predicted:
        """The engine's decision at ``s`` tokens by ``b`` from the first plan,
        its boundary values within ``host_limit`` host bytes (None: any)."""
        act = activations(s * b)
        return plan_for_activations(
            start_plan,
            sizes,
            act.saved_bytes(s, b),
            act.transient_bytes(s, b, cuda=True),
            gpus,
            m,
            user_plan=False,
            async_optimizer=async_optimizer,
            memory_limit=limit,
            size_limit=size_cap,
            device_budget=budget_all,
            boundary=value_bytes(s * b, hidden, size),
            host_limit=host_limit,
        )

    def host_ok(plan: StagePlan, tokens: int) -> bool:
        """Whether a micro-batch of ``tokens`` tokens keeps its boundary
        values under ``plan`` within the share of the host that the model
        state and the plan's own gradient staging leave (True: unchecked)."""
        room = left(plan)
        if room is None:
            return True
        values = boundary_bytes(plan, tokens, hidden, size)
        return room > 0 and values <= HOST_ACTIVATION_SHARE * room

    def within_host(s: int, b: int) -> tuple[Predicted, StagePlan | None, float]:
        """The decision at ``s`` tokens by ``b`` whose plan's boundary values
        fit the host, the engine's own pick where it was passed over (else
        None), and the host limit the decision was made within.

        The engine bounds a micro-batch's boundary values by a share of the
        room its first plan's gradient staging leaves (``host_room``), but
        the plan it chooses within that may stage more gradients and leave
        its values less room than that (:func:`host_ok`). Such a plan is
        passed over: chosen again with the limit just below its values, so
        with fewer boundary values, until the plan chosen fits the room it
        leaves itself or none fits (the limit falls with each: this ends).
        The plan shown and checked is then one and the same."""
        assert host_room is not None
        bound = host_room
        value = value_bytes(s * b, hidden, size)
        decision = choose(s, b, bound)
        passed = None
        while max(decision.peaks) <= decision.memory_limit and not host_ok(decision.plan, s * b):
            need = host_need(decision.plan, value)
            if need > bound or need <= 0:  # (kept over the limit: nothing fits it)
                break
            passed = passed or decision.plan
            bound = need - 1
            decision = choose(s, b, bound)
        return decision, passed, bound

    def plan_at(s: int, b: int, host: bool = True) -> Predicted:
        """The plan at ``s`` tokens by ``b``, its slots' predicted peaks and
        the bytes a stage may use with it (more than half the GPU when long
        sequences leave the next stage's weights less room, or none);
        with ``host``, a plan whose boundary values fit the host (layered or
        rewalked if need be; :func:`within_host`)."""
        if not host or host_room is None:
            return choose(s, b, None)
        return within_host(s, b)[0]

    def fits(s: int, host: bool = True) -> bool:
        """Whether ``s`` tokens at micro-batch 1 fit the devices (and, with
        ``host``, the host memory when it is given)."""
        try:
            decision = plan_at(s, 1, host)
        except PlanError:
            return False
        if max(decision.peaks) > decision.memory_limit:
            return False
        return not host or host_ok(decision.plan, s)

    given_ceiling = int(getattr(settings, "max_position_embeddings", 0) or 0)
    ceiling = given_ceiling or 1 << 20  # (none given: a million tokens)
    search = max(ceiling, 1 << 22)
    # (fits rests on the planner's pick at each length: monotone mostly, not by construction)
    longest = longest_sequence(fits, 1, search, checks=LENGTH_CHECKS)
    # which memory bounds it: the host, where the devices would take more
    if longest >= search:  # neither memory: the search's own ceiling
        bound = f"the search's ceiling, {search} tokens"
    elif host_memory is not None and fits(longest + 1, host=False):
        bound = "host memory"
    else:
        bound = "device memory"
    device_longest = device_host = None
    if bound == "host memory":
        # what the GPUs alone allow, and the host memory that would let it run:
        # its plan's boundary values at the engine's default share of the host
        device_longest = longest_sequence(
            lambda s: fits(s, host=False), longest + 1, search, checks=LENGTH_CHECKS
        )
        if device_longest:
            alone = plan_at(device_longest, 1, host=False).plan
            values = boundary_bytes(alone, device_longest, hidden, size)
            # (the staging of the first plan bounds what the plan may choose,
            # as in the engine; the chosen one's what it then takes; with that
            # much host the first plan's stages are not made smaller for it)
            staged_most = max(staging(uncapped), staging(alone))
            device_host = state + staged_most + values / HOST_ACTIVATION_SHARE
    notes = []
    seq_given = seq is not None
    shown_at = None  # nothing fits: the sequence the plan is shown at instead
    if seq is None:
        if longest:
            seq = min(longest, ceiling)
        else:  # what the GPUs alone allow, were the host large enough
            seq = shown_at = max(1, min(device_longest or 1, ceiling))
    # (the model state alone over the host: no plan fits it; the devices' own
    # plan is shown, and only the host is blamed)
    host_fits = start_left is None or start_left > 0
    passed, chosen_within = None, host_room  # (the engine's own pick, passed over)
    if shown_at is None and host_fits and host_room is not None:
        decision, passed, chosen_within = within_host(seq, micro_batch)
    else:
        decision = plan_at(seq, micro_batch, host=False)
    plan, peaks, room = decision.plan, decision.peaks, decision.memory_limit
    per_mb = boundary_bytes(plan, seq * micro_batch, hidden, size)
    # a round's boundary values: a quarter of what the host leaves once the
    # first plan's staging is counted, as the engine sizes rounds
    round_budget = None if start_left is None else max(1, int(start_left // 4))
    rounds = choose_round(m, boundary_bytes=per_mb, budget=round_budget)
    acts = per_mb * rounds.round_size
    staged = staging(plan)
    host = {
        "state": float(state),
        "activations": float(acts),
        "staging": float(staged),
        "total": float(state + acts + staged),
    }
    fwd, bwd = _times(layers, settings, seq, micro_batch, tflops)
    timed = LayerCosts(fwd, bwd, memory=sizes.memory, weight_bytes=sizes.weight_bytes)
    # copies devices wait for: with nothing prefetched, and a rewalked
    # stage's uploads of its input again
    value = value_bytes(seq * micro_batch, hidden, size)
    copies = Copies(link_gbps * 1e9, value, decision.prefetch)
    sim = simulate(
        "roundpipe",
        timed,
        gpus,
        m,
        plan=plan,
        async_optimizer=async_optimizer,
        microbatches_per_round=rounds.round_size,
        copies=copies,
    )
    # one step: the busy time spread over the GPUs, idle for the bubble (back to
    # back with the asynchronous optimizer, one iteration's makespan without)
    bubble = sim.async_bubble_ratio if async_optimizer else sim.bubble_ratio
    step = sim.work / (gpus * (1 - (bubble or 0.0)))
    # every stage's weights go up and its fp32 gradients down once per round,
    # each round's stages spread over the GPUs' links (up and down at once)
    per_round = max(sum(sizes.weight_bytes or []), sum(grads))
    upload = (
        -(-m // rounds.round_size) * per_round / (min(gpus, len(plan.stages)) * link_gbps * 1e9)
    )
    if upload > step:
        notes.append(
            f"weight traffic ({upload:.3g} s per step on each GPU's link at {link_gbps} GB/s) "
            f"exceeds compute ({step:.3g} s), so it bounds the step: more tokens per step "
            "(--microbatches, --micro-batch, --seq) hide it"
        )
        step = upload
    compute_state = host_state_bytes(model, precision, dtype, double_buffer=async_optimizer)
    if compute_state < state:
        kind = str(dtype).removeprefix("torch.")
        notes.append(
            f"frozen weights loaded in {kind} (from_pretrained(..., dtype=torch.{kind})) are "
            f"their own master copy: host state {gib(compute_state)} instead of {gib(state)}"
        )
    if spare is not None and spare <= 0:
        notes.insert(
            0,
            f"the model state alone ({gib(state)}) needs more than the host memory "
            f"({gib(host_memory)}): no sequence fits"
            + (
                " (frozen weights in the compute dtype need less: below)"
                if compute_state < state
                else "; LoRA adapters (--lora-rank) keep optimizer state for far fewer weights"
                if not lora_rank
                else ""
            ),
        )
    elif start_left is not None and start_left <= 0 and not longest:
        notes.insert(
            0,
            f"the model state ({gib(state)}) and the page-locked staging of the gradient "
            f"downloads of the first plan ({gib(staging(start_plan))}) need more than the host "
            f"memory ({gib(host_memory)}): no sequence fits; fewer trainable weights (LoRA, "
            "--lora-rank) download fewer gradients",
        )
    if shown_at is not None:
        notes.insert(
            1 if notes else 0,
            f"the plan, memory and step above are at {shown_at} tokens, the longest the GPUs "
            "alone allow (up to max_position_embeddings), as they would be with enough host "
            "memory",
        )
    elif rounds.round_size < m:
        notes.append(
            f"rounds of {rounds.round_size} micro-batches: a whole batch's boundary "
            f"activations ({gib(per_mb * m)}) exceed a quarter of the host memory the model "
            "state and the gradient staging leave, so each stage's weights go up once per round"
        )
    if plan.layered:
        extra = sum(st.extra_forward(timed) for st in plan.stages)
        how = (
            "rewalked plan: its backward stages recompute one layer at a time, each layer's "
            "input again from the stage's (forwards of the layers below"
            if plan.rewalk
            else "layered plan: its backward stages recompute one layer at a time (a second forward"
        )
        notes.append(
            f"{how}: {extra / (sum(plan.stage_times(timed)) - extra):.0%} more compute) so "
            f"that a micro-batch keeps {plan.boundaries_per_microbatch()} boundary values on "
            "the host"
        )
    if passed is not None:
        assert host_room is not None
        notes.append(
            f"the engine's default limit for a micro-batch's boundary values on the host "
            f"({gib(host_room)}, from its first plan's gradient staging) would choose plan "
            f"{passed}, whose own staging ({gib(staging(passed))}) leaves them too little host "
            f"memory; activation_memory={int(chosen_within)} (bytes) has it choose this one"
        )
    windows = sorted({w for w in activations(seq * micro_batch).windows if w is not None})
    if windows:
        count = sum(w is not None for w in activations(seq * micro_batch).windows)
        notes.append(
            f"{count} sliding-window layers (window {', '.join(map(str, windows))}) attend over "
            "query tiles: memory linear in the sequence, as predicted here; batches with "
            "padding or packed sequences give them the model's sequence x sequence mask instead"
        )
    if longest and longest >= ceiling:
        notes.append(
            f"the longest sequence is past max_position_embeddings ({ceiling})"
            if given_ceiling
            # (the search goes past the setting's own cap, up to its ceiling)
            else "the config gives no max_position_embeddings: the longest sequence is "
            f"searched up to {search} tokens"
            + (
                ""
                if seq_given
                else f", and the plan, memory and step above are shown at {ceiling} tokens"
            )
        )
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = trainable * OPTIMIZER_BYTES / (optimizer_gbps * 1e9)
    per_update = OPTIMIZER_BYTES + UPDATE_COPY_BYTES + size
    host_update = trainable * per_update / (optimizer_gbps * 1e9)
    device_step = step
    if servers == 1:  # (the all-reduce model below has its own optimizer term)
        step = max(step, host_update) if async_optimizer else step + host_update
        if async_optimizer and host_update > device_step:
            notes.append(
                f"the host's work per update ({host_update:.3g} s: optimizer step, gradient "
                f"check and weight copies, {per_update} bytes per trainable parameter at "
                f"--optimizer-gbps {optimizer_gbps:g}) is longer than the devices' "
                f"({device_step:.3g} s): the step is bound by the host; more tokens per step "
                "(batch, sequence) or fewer trainable weights (LoRA) shift the balance"
            )
    reduction = None
    if servers > 1:
        reduction = estimate_reduction(
            sim,
            grads,
            servers,
            network_gbps,
            optimizer_seconds=optimizer,
            async_optimizer=async_optimizer,
            window_seconds=device_step,
        )
    return Estimate(
        model=(name or getattr(config, "model_type", "model"))
        + (f" ({type(model).__name__})" if isinstance(adapter, SequenceClassifierAdapter) else ""),
        parameters=params,
        trainable=trainable,
        gpus=gpus,
        stage_limit=int(room),
        seq=seq,
        micro_batch=micro_batch,
        num_microbatches=m,
        plan=str(plan),
        stage_peaks=peaks,
        host=host,
        host_memory=None if host_memory is None else int(host_memory),
        longest_seq=longest,
        longest_bound=bound,
        half_budget=limit,
        device_longest_seq=device_longest or None,
        device_longest_host=device_host,
        step_seconds=step,
        tokens_per_second=seq * micro_batch * m / step if step > 0 else math.inf,
        upload_seconds=upload,
        notes=notes,
        servers=servers,
        network_gbps=network_gbps,
        optimizer_seconds=optimizer,
        host_update_seconds=host_update,
        device_seconds=device_step,
        copy_seconds=sim.copy_wait,
        async_optimizer=async_optimizer,
        reduction=reduction,
        prefetch=decision.prefetch,
    )

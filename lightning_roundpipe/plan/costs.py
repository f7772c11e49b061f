"""Per-layer costs: the only input the planning layer needs about a model.

A model is an ordered list of layers ``0..L-1`` (for a causal LM: the embedding,
the decoder blocks, then norm + LM head + loss as the last layer). For each
layer we know, measured or estimated:

* ``forward``: time of its forward pass for one micro-batch;
* ``backward``: time of its backward pass for one micro-batch, *without*
  recomputation (a recomputing stage pays ``forward + backward``);
* ``memory``: device memory needed to run that layer's forward and backward
  for one micro-batch (weights, gradients and saved activations);
* ``weight_bytes``: size of the layer's weights as uploaded to a device.

Stage costs are contiguous sums. They are always computed as differences of
prefix sums (see :class:`_Prefix`) so that the partitioner, the plan and the
simulator agree to the last bit on what a stage costs.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

__all__ = ["LayerCosts", "PlanError", "decoder_costs"]


class PlanError(ValueError):
    """Raised for invalid planning input: costs, plans, or impossible constraints."""


def _as_values(
    name: str, values: Sequence[float] | None, n: int | None
) -> tuple[float, ...] | None:
    if values is None:
        return None
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple, Sequence)):
        raise PlanError(
            f"LayerCosts.{name} must be a list of numbers (one per layer), got "
            f"{type(values).__name__} {values!r}"[:200]
        )
    out = tuple(values)
    if n is not None and len(out) != n:
        raise PlanError(
            f"LayerCosts.{name} has {len(out)} entries but forward has {n}; "
            "give one value per layer"
        )
    for i, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise PlanError(f"LayerCosts.{name}[{i}] must be a number, got {v!r}")
        if not math.isfinite(v) or v < 0:
            raise PlanError(f"LayerCosts.{name}[{i}] must be finite and >= 0, got {v!r}")
    try:
        total = math.fsum(out)
    except OverflowError:
        total = math.inf
    if total > _MOST:
        # (stage sums, their recomputes and the micro-batches' would overflow
        # to inf, and every plan would tie)
        raise PlanError(
            f"LayerCosts.{name} adds up to {total:.3g}, past {_MOST:.3g}, what stage sums "
            "times micro-batches can take without overflowing; give the values in a larger "
            "unit (seconds, not nanoseconds; GiB, not bytes)"
        )
    return out


#: the most a cost list may add up to: a millionth of the largest float
_MOST = sys.float_info.max / 1e6


@dataclass(frozen=True)
class LayerCosts:
    """Costs of each layer of a model, in pipeline order.

    Args:
        forward: forward time of each layer for one micro-batch (any time unit).
        backward: backward time of each layer for one micro-batch, without
            recomputation.
        memory: device memory needed to run each layer for one micro-batch
            (bytes or any unit shared with ``memory_limit``); ``None`` means
            unknown, and no memory constraint is applied.
        weight_bytes: bytes of each layer's weights as uploaded; ``None`` if
            unknown.
        task_overhead: time a stage spends per micro-batch on top of its
            layers (in the unit of ``forward``): handing its input and output
            over, seeding, hooks, its share of the weight binding. It is what
            makes a plan with many small stages slower than its layer sums say
            (a CPU worker pays it on its own thread; measured while profiling).
    """

    forward: Sequence[float]
    backward: Sequence[float]
    memory: Sequence[float] | None = None
    weight_bytes: Sequence[float] | None = None
    task_overhead: float = 0.0
    #: prefix sums of the costs (what stage sums are computed from)
    prefix: _Prefix = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fwd = _as_values("forward", self.forward, None)
        assert fwd is not None
        if not fwd:
            raise PlanError("LayerCosts needs at least one layer; forward is empty")
        n = len(fwd)
        object.__setattr__(self, "forward", fwd)
        object.__setattr__(self, "backward", _as_values("backward", self.backward, n))
        object.__setattr__(self, "memory", _as_values("memory", self.memory, n))
        object.__setattr__(self, "weight_bytes", _as_values("weight_bytes", self.weight_bytes, n))
        o = self.task_overhead
        if isinstance(o, bool) or not isinstance(o, (int, float)) or not math.isfinite(o) or o < 0:
            raise PlanError(f"LayerCosts.task_overhead must be a finite number >= 0, got {o!r}")
        object.__setattr__(self, "prefix", _Prefix(self))

    # ------------------------------------------------------------------ sizes
    @property
    def num_layers(self) -> int:
        """Number of layers ``L``."""
        return len(self.forward)

    def __len__(self) -> int:
        return self.num_layers

    # ----------------------------------------------------------- stage costs
    def forward_time(self, start: int, stop: int) -> float:
        """Time of a forward stage over layers ``[start, stop)``."""
        p = self.prefix.fwd
        return p[stop] - p[start]

    def backward_time(self, start: int, stop: int) -> float:
        """Backward time over ``[start, stop)`` without recomputation."""
        p = self.prefix.bwd
        return p[stop] - p[start]

    def recompute_backward_time(self, start: int, stop: int) -> float:
        """Time of a backward stage (recompute + backward) or of the fused stage
        (forward + backward) over layers ``[start, stop)``: both run the
        forward and the backward of every layer once."""
        p = self.prefix.both
        return p[stop] - p[start]

    def stage_memory(self, start: int, stop: int) -> float:
        """Device memory of a stage over ``[start, stop)`` (0 when unknown)."""
        p = self.prefix.mem
        return p[stop] - p[start]

    def stage_weight_bytes(self, start: int, stop: int) -> float:
        """Weight bytes of layers ``[start, stop)`` (0 when unknown)."""
        if self.weight_bytes is None:
            return 0
        return sum(self.weight_bytes[start:stop])

    # ------------------------------------------------------------ conversion
    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; :meth:`from_dict` reads it back."""
        out: dict[str, Any] = {"forward": list(self.forward), "backward": list(self.backward)}
        if self.memory is not None:
            out["memory"] = list(self.memory)
        if self.weight_bytes is not None:
            out["weight_bytes"] = list(self.weight_bytes)
        if self.task_overhead:
            out["task_overhead"] = self.task_overhead
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerCosts:
        """Build from a mapping with keys ``forward``, ``backward`` and optionally
        ``memory``, ``weight_bytes`` and ``task_overhead``."""
        unknown = set(data) - {"forward", "backward", "memory", "weight_bytes", "task_overhead"}
        if unknown:
            raise PlanError(
                f"unknown LayerCosts keys {sorted(unknown)}; "
                "expected forward, backward, memory, weight_bytes, task_overhead"
            )
        for key in ("forward", "backward"):
            if key not in data:
                raise PlanError(f"LayerCosts needs the key {key!r}")
        return cls(
            forward=data["forward"],
            backward=data["backward"],
            memory=data.get("memory"),
            weight_bytes=data.get("weight_bytes"),
            task_overhead=data.get("task_overhead", 0.0),
        )

    @classmethod
    def load(cls, path: str | Path) -> LayerCosts:
        """Read costs from a JSON file written by :meth:`save` (or by hand)."""
        with open(path, encoding="utf-8") as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise PlanError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(data, Mapping):
            raise PlanError(f"{path}: expected a JSON object with forward/backward lists")
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        """Write costs as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        *,
        forward: float = 1.0,
        backward: float = 2.0,
        head_forward: float | None = None,
        head_backward: float | None = None,
        memory: float | None = None,
        head_memory: float | None = None,
    ) -> LayerCosts:
        """Identical layers, optionally with a different last layer (an LM head).

        ``uniform(13, head_forward=3, head_backward=6)`` is twelve blocks and an
        LM head three times slower than a block.
        """
        if num_layers < 1:
            raise PlanError(f"num_layers must be >= 1, got {num_layers}")
        fwd = [forward] * num_layers
        bwd = [backward] * num_layers
        mem = None if memory is None else [memory] * num_layers
        if head_forward is not None:
            fwd[-1] = head_forward
        if head_backward is not None:
            bwd[-1] = head_backward
        if head_memory is not None:
            if mem is None:
                raise PlanError("head_memory needs memory for the other layers too")
            mem[-1] = head_memory
        return cls(fwd, bwd, mem)


def decoder_costs(
    num_blocks: int,
    *,
    seq: int,
    micro_batch: int,
    hidden: int,
    mlp: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    flops_per_second: float = 1e12,
    bytes_per_element: int = 2,
    experts: int = 0,
    experts_per_token: int = 0,
    shared_mlp: int = 0,
    dense_blocks: int = 0,
    dense_mlp: int | None = None,
) -> LayerCosts:
    """Size-based costs of a decoder-only LM (embedding, GQA blocks, head + loss).

    Per block, for ``s`` tokens per sequence, micro-batch ``b``, hidden ``h``,
    MLP width ``m``, ``a`` heads and ``k`` key-value heads: forward matmul FLOPs
    ``4sbh^2 + 4sbh^2 k/a + 4s^2bh + 6sbhm`` and activation memory
    ``(12 + 4k/a) sbh + 6sbm`` bytes (as used by the RoundPipe paper's analysis);
    backward is taken as twice the forward. The LM head costs ``2sbhV`` FLOPs
    forward and keeps its logits (``sbV`` elements, in fp32 for the loss).
    Times are FLOPs / ``flops_per_second``; weight bytes use
    ``bytes_per_element``.

    Mixture of Experts (``experts`` > 0): ``mlp`` is one expert's width; each
    token computes with ``experts_per_token`` experts (and a shared MLP of
    width ``shared_mlp``, 0 for none) plus the router (``2sbh x experts``
    FLOPs), while a block's weights hold every expert, so such a block is
    heavy in weights and light in compute. The first ``dense_blocks`` blocks
    have a dense MLP of width ``dense_mlp`` instead (DeepSeek-V3's
    ``first_k_dense_replace``).
    """
    if experts < 0 or not 0 <= experts_per_token <= experts:
        raise PlanError(
            f"experts_per_token must be between 0 and experts ({experts}), got {experts_per_token}"
        )
    if experts and not experts_per_token:
        raise PlanError("a Mixture-of-Experts model needs experts_per_token >= 1")
    if not 0 <= dense_blocks <= num_blocks:
        raise PlanError(f"dense_blocks must be between 0 and {num_blocks}, got {dense_blocks}")
    s, b, h, a, k, v = seq, micro_batch, hidden, heads, kv_heads, vocab
    attn_flops = 4 * s * b * h * h + 4 * s * b * h * h * k / a + 4 * s * s * b * h
    attn_act = (12 + 4 * k / a) * s * b * h
    attn_weights = (2 * h * h + 2 * h * h * k / a) * bytes_per_element

    def block(width: int, visited: int, held: int, router: int) -> tuple[float, float, float]:
        """FLOPs, activation bytes and weight bytes of a block whose tokens each
        compute with ``visited`` MLP columns of the ``held`` it stores."""
        flops = attn_flops + 6 * s * b * h * visited + 2 * s * b * h * router
        act = attn_act + 6 * s * b * visited
        return flops, act, attn_weights + (3 * h * held + h * router) * bytes_per_element

    if experts:
        moe = block(mlp, mlp * experts_per_token + shared_mlp, mlp * experts + shared_mlp, experts)
        width = dense_mlp if dense_mlp is not None else mlp
        dense = block(width, width, width, 0)
        blocks = [dense] * dense_blocks + [moe] * (num_blocks - dense_blocks)
    else:
        blocks = [block(mlp, mlp, mlp, 0)] * num_blocks
    head_flops = 2 * s * b * h * v
    head_act = s * b * v * 4 + s * b * h * bytes_per_element
    emb_weights = v * h * bytes_per_element
    fwd = (
        [s * b * h / flops_per_second]
        + [f / flops_per_second for f, _, _ in blocks]
        + [head_flops / flops_per_second]
    )
    weights = [emb_weights] + [w for _, _, w in blocks] + [emb_weights]
    memory = (
        [emb_weights + s * b * h * bytes_per_element]
        + [2 * w + act for _, act, w in blocks]
        + [2 * emb_weights + head_act]
    )
    return LayerCosts(fwd, [2 * f for f in fwd], memory=memory, weight_bytes=weights)


class _Prefix:
    """Prefix sums of a :class:`LayerCosts`; index ``i`` is the sum of layers ``< i``."""

    __slots__ = ("both", "bwd", "fwd", "mem")

    def __init__(self, costs: LayerCosts) -> None:
        fwd, bwd = costs.forward, costs.backward
        self.fwd = [0.0, *accumulate(fwd)]
        self.bwd = [0.0, *accumulate(bwd)]
        self.both = [0.0, *accumulate(f + b for f, b in zip(fwd, bwd))]
        mem = costs.memory if costs.memory is not None else [0] * len(fwd)
        self.mem = [0, *accumulate(mem)]

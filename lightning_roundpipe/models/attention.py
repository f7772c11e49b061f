"""Flash attention whose backward runs a few key/value heads at a time.

At long sequences a decoder block's attention backward is the largest transient
of a stage. PyTorch's CUDA flash-attention backward works, besides the input
gradients it returns, with an fp32 accumulator of the query gradient and, for
grouped-query attention, key and value gradients expanded to every query head,
summed afterwards: about four hidden-sized values per token for Llama-3.1-8B
(32 query heads over 8 key/value heads, bf16). Heads are independent in
attention, so the backward can run one group of key/value heads (with their
query heads) per kernel call: the workspace then is that of one group, and the
result is the same.

:class:`GroupedAttention` is a :class:`~torch.overrides.TorchFunctionMode`
(thread-local, so only the calling worker's blocks are affected): while it is
active, a differentiable call of
:func:`~torch.nn.functional.scaled_dot_product_attention` that the flash kernel
can run (no mask, no dropout, query heads a multiple of key/value heads) runs
the flash kernel once in forward (keeping what the fused kernel keeps: the
inputs, the output and the log-sum-exp) and in backward calls the kernel's
backward over head groups (:func:`kv_heads_per_call`). Any other call runs as
usual. Torch has no public head-split backward, hence this small autograd
function over the kernels' own ATen operators.

The CPU flash kernel keeps no such workspace (its backward allocates its
gradients only), so by default the split applies to CUDA tensors alone
(:data:`SPLIT_DEVICES`); the CPU kernels stand in for tests.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "ROWS_PER_CALL",
    "SPLIT_DEVICES",
    "GroupedAttention",
    "attention_heads",
    "backward_workspace",
    "heads_per_call",
    "kv_heads_per_call",
]

#: query rows (positions x query heads) a backward call covers at least: at
#: 128 rows per thread block, a few waves over an H100's 132 multiprocessors
ROWS_PER_CALL = 1 << 17

#: device types whose attention backward is split into head groups
SPLIT_DEVICES: frozenset[str] = frozenset({"cuda"})


def largest_setting(config: Any, name: str) -> Any:
    """``config.<name>``, or for a setting that layers set otherwise (a
    heterogeneous config, as Gemma 4's, refuses the global read) the largest
    of the layers' values; None when unset."""
    if getattr(config, "is_heterogeneous", False) and name in (
        getattr(config, "per_layer_attributes", None) or ()
    ):
        values = [getattr(layer, name, None) for layer in config.per_layer_config]
        return max((v for v in values if v is not None), default=None)
    return getattr(config, name, None)


def attention_heads(config: Any) -> tuple[int, int, int] | None:
    """A transformers config's query heads, key/value heads and head size, the
    largest of the layers' where they differ (None: no ``num_attention_heads``)."""
    heads = int(largest_setting(config, "num_attention_heads") or 0)
    if not heads:
        return None
    kv_heads = int(largest_setting(config, "num_key_value_heads") or heads)
    head_dim = int(largest_setting(config, "head_dim") or config.hidden_size // heads)
    return heads, kv_heads, head_dim


def kv_heads_per_call(rows_per_kv_head: int, kv_heads: int) -> int:
    """Key/value heads per backward call: the fewest whose query rows (``rows_per_kv_head``
    each: positions of the micro-batch times query heads per key/value head) reach
    :data:`ROWS_PER_CALL`, at most all of them."""
    return min(kv_heads, max(1, math.ceil(ROWS_PER_CALL / max(1, rows_per_kv_head))))


def _call_workspace(
    tokens: int, heads: int, kv_heads: int, head_dim: int, element: int, calls_kv: int
) -> int:
    """Bytes one backward call over ``calls_kv`` key/value heads works with
    beyond the gradients it leaves in place (see :func:`backward_workspace`)."""
    group = heads // max(1, kv_heads)
    rows = tokens * group * calls_kv
    per_row = head_dim * 4 + 4  # fp32 accumulator, softmax statistics
    if group > 1:
        per_row += 2 * head_dim * element  # expanded key and value gradients
    out = rows * per_row
    if calls_kv < kv_heads:
        # the call's own gradients, copied into place afterwards, and the
        # contiguous copies the kernel makes of its slices of the output and
        # of the output's gradient (head slices of a model's layout are strided;
        # measured on an H200)
        out += 3 * rows * head_dim * element + 2 * tokens * calls_kv * head_dim * element
    return out


def heads_per_call(tokens: int, heads: int, kv_heads: int, head_dim: int, element: int) -> int:
    """Key/value heads per backward call for ``tokens`` positions: as
    :func:`kv_heads_per_call`, or all of them (one call) where splitting would
    not need less memory (no grouped query heads and only a few calls: the
    copies cost more than the accumulator saves)."""
    group = heads // max(1, kv_heads)
    step = kv_heads_per_call(tokens * group, kv_heads)
    if step < kv_heads:
        split = _call_workspace(tokens, heads, kv_heads, head_dim, element, step)
        if split >= _call_workspace(tokens, heads, kv_heads, head_dim, element, kv_heads):
            return kv_heads
    return step


def backward_workspace(
    tokens: int, heads: int, kv_heads: int, head_dim: int, element: int, *, split: bool
) -> int:
    """Bytes the CUDA flash-attention backward works with beyond the input
    gradients it returns, for ``tokens`` positions (all sequences of a
    micro-batch): an fp32 query-gradient accumulator and softmax statistics
    per query row, and (grouped-query attention) key/value gradients
    expanded to every query head. ``split``: run by :class:`GroupedAttention`,
    one call's (:func:`heads_per_call`), plus the gradients that call returns
    before they are copied into place and the kernel's contiguous copies of
    its slices of the output and of the output's gradient."""
    calls_kv = heads_per_call(tokens, heads, kv_heads, head_dim, element) if split else kv_heads
    return _call_workspace(tokens, heads, kv_heads, head_dim, element, calls_kv)


def _kernels(device: torch.device) -> tuple[Any, Any] | None:
    if device.type == "cuda":
        return (
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
        )
    if device.type == "cpu":
        return (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        )
    return None


def _flash_can_run(q, k, v, is_causal: bool, enable_gqa: bool) -> bool:
    """Whether the flash kernel takes these inputs (torch's own check on CUDA)."""
    if q.device.type == "cpu":
        return q.dtype in (torch.float32, torch.bfloat16, torch.float16)
    try:
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, is_causal, enable_gqa)
        return bool(torch.backends.cuda.can_use_flash_attention(params, False))
    except (AttributeError, TypeError, RuntimeError):  # a torch without these checks
        return False


def _splittable(args: tuple, kwargs: dict[str, Any]) -> tuple | None:
    """The ``(q, k, v, is_causal, scale)`` of an attention call the split runs."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False}
    bound.update(scale=None, enable_gqa=False)
    bound.update(zip(names, args, strict=False))
    bound.update(kwargs)
    if set(bound) - set(names):
        return None
    q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    if bound["attn_mask"] is not None or bound["dropout_p"] != 0.0:
        return None
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (q, k, v)):
        return None
    if q.device.type not in SPLIT_DEVICES or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    heads, kv_heads = q.shape[1], k.shape[1]
    grouped = heads != kv_heads
    if v.shape[1] != kv_heads or heads % kv_heads or (grouped and not bound["enable_gqa"]):
        return None
    if q.shape[-1] != v.shape[-1] or not q.dtype == k.dtype == v.dtype:
        return None
    is_causal = bool(bound["is_causal"])
    if _kernels(q.device) is None or not _flash_can_run(q, k, v, is_causal, grouped):
        return None
    return q, k, v, is_causal, bound["scale"]


class GroupedAttention(TorchFunctionMode):
    """While active (in this thread), differentiable flash-eligible calls of
    :func:`~torch.nn.functional.scaled_dot_product_attention` run their
    backward over groups of key/value heads (see the module's docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            call = _splittable(args, kwargs)
            if call is not None:
                return _SplitFlash.apply(*call)
        return func(*args, **kwargs)


class _SplitFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale):
        forward, _ = _kernels(q.device)
        if q.device.type == "cuda":
            out, lse, cq, ck, mq, mk, seed, offset, _ = forward(
                q, k, v, 0.0, is_causal, False, scale=scale
            )
            ctx.extra = (cq, ck, mq, mk)
            ctx.rng = (seed, offset)
        else:
            out, lse = forward(q, k, v, 0.0, is_causal, scale=scale)
        ctx.is_causal, ctx.scale = is_causal, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved_tensors
        _, backward = _kernels(q.device)
        batch, heads, seq = q.shape[:3]
        kv_heads = k.shape[1]
        group = heads // kv_heads
        step = heads_per_call(batch * seq, heads, kv_heads, q.shape[-1], q.element_size())
        if g.stride(-1) != 1:
            g = g.contiguous()

        def call(qs: slice, ks: slice) -> tuple[torch.Tensor, ...]:
            lse_part = lse[:, qs].contiguous()
            if q.device.type == "cuda":
                return backward(
                    g[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse_part,
                    *ctx.extra, 0.0, ctx.is_causal, *ctx.rng, scale=ctx.scale,
                )  # fmt: skip
            return backward(
                g[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse_part, 0.0,
                ctx.is_causal, scale=ctx.scale,
            )  # fmt: skip

        if step >= kv_heads:
            dq, dk, dv = call(slice(None), slice(None))
            return dq, dk, dv, None, None
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for start in range(0, kv_heads, step):
            ks = slice(start, min(kv_heads, start + step))
            qs = slice(ks.start * group, ks.stop * group)
            part = call(qs, ks)
            dq[:, qs].copy_(part[0])
            dk[:, ks].copy_(part[1])
            dv[:, ks].copy_(part[2])
            del part  # before the next call allocates its own
        return dq, dk, dv, None, None

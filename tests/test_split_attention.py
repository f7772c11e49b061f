"""Flash attention with its backward over key/value head groups
(:mod:`lightning_roundpipe.models.attention`): the same outputs and gradients
as ``scaled_dot_product_attention``, only for the calls the flash kernel takes,
and (on a GPU) less backward memory than the fused kernel, as predicted."""

import pytest
import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_roundpipe.models import attention
from lightning_roundpipe.models.attention import (
    GroupedAttention,
    backward_workspace,
    heads_per_call,
    kv_heads_per_call,
)


@pytest.fixture
def split_on_cpu(monkeypatch):
    """The CPU flash kernels stand in for CUDA's; every key/value head its own
    call (also where one call would need less memory)."""
    monkeypatch.setattr(attention, "SPLIT_DEVICES", frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(attention, "heads_per_call", lambda *_: 1)


def qkv(heads, kv_heads, dtype=torch.float32, device="cpu", batch=2, seq=40, dim=16):
    g = torch.Generator().manual_seed(0)

    def make(h):  # (batch, heads, seq, dim) views of (batch, seq, heads, dim), as models pass
        x = torch.randn(batch, seq, h, dim, generator=g).to(device, dtype)
        return x.transpose(1, 2).requires_grad_()

    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    # the output's gradient as a model passes it back: (batch, seq, heads, dim)
    # in memory, as the output, which the model transposes and makes contiguous
    grad = make(heads).detach()
    return q, k, v, grad


def both(q, k, v, grad, **kwargs):
    ref = F.scaled_dot_product_attention(q, k, v, **kwargs)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    with GroupedAttention():
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    got = torch.autograd.grad(out, (q, k, v), grad)
    return (ref, *want), (out, *got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_the_split_backward_gives_the_fused_gradients(split_on_cpu, dtype, heads, kv_heads, causal):
    q, k, v, grad = qkv(heads, kv_heads, dtype)
    calls = []
    backward = attention._kernels(q.device)[1]

    def counted(*args, **kwargs):
        calls.append(args[1].shape[1])
        return backward(*args, **kwargs)

    kernels = attention._kernels
    attention._kernels = lambda device: (kernels(device)[0], counted)
    try:
        want, got = both(q, k, v, grad, is_causal=causal, scale=0.3, enable_gqa=heads != kv_heads)
    finally:
        attention._kernels = kernels
    # one call per key/value head, each with its query heads
    assert calls == [heads // kv_heads] * kv_heads
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_positional_arguments_are_understood(split_on_cpu):
    q, k, v, grad = qkv(4, 2)
    want, got = both(q, k, v, grad, attn_mask=None, dropout_p=0.0, is_causal=True, enable_gqa=True)
    assert type(got[0].grad_fn).__name__ == "_SplitFlashBackward"
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_calls_the_kernel_cannot_run_split_run_as_usual(split_on_cpu):
    q, k, v, _ = qkv(4, 2)
    mask = torch.ones(40, 40, dtype=torch.bool).tril()
    with GroupedAttention():
        usual = [
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, enable_gqa=True),
            F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), enable_gqa=True),
        ]
        with torch.no_grad():
            usual.append(F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        split = F.scaled_dot_product_attention(q[:, :2], k, v)  # heads equal: no GQA asked
    assert all(type(o.grad_fn).__name__ != "_SplitFlashBackward" for o in usual)
    assert type(split.grad_fn).__name__ == "_SplitFlashBackward"


def test_by_default_cpu_calls_are_not_split():
    """The CPU kernel keeps no workspace to save (measured: its backward
    allocates the input gradients only)."""
    q, k, v, _ = qkv(4, 2)
    with GroupedAttention():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert type(out.grad_fn).__name__ != "_SplitFlashBackward"


def test_heads_per_call_reach_the_rows_a_call_should_cover():
    rows = attention.ROWS_PER_CALL
    assert kv_heads_per_call(rows, 8) == 1  # a long sequence: one group per call
    assert kv_heads_per_call(rows // 4, 8) == 4
    assert kv_heads_per_call(rows // 4 + 1, 8) == 4
    assert kv_heads_per_call(rows // 4 - 1, 8) == 5
    assert kv_heads_per_call(1, 8) == 8  # short: one call for all


def test_the_workspace_of_a_split_backward_is_one_groups():
    """Llama-3.1-8B's attention (32 query heads over 8 key/value heads of
    128, bf16) at 1M tokens: the fused backward's workspace is 4 hidden-sized
    values per token and more; split, under one."""
    tokens, value = 1 << 20, (1 << 20) * 4096 * 2
    fused = backward_workspace(tokens, 32, 8, 128, 2, split=False)
    split = backward_workspace(tokens, 32, 8, 128, 2, split=True)
    # fp32 query-gradient accumulator (2 values) + expanded key/value gradients
    # (2 values) + softmax statistics
    assert fused == tokens * 32 * (128 * 4 + 4 + 2 * 128 * 2)
    assert 4 * value < fused < 4.1 * value
    # one group of 4 query heads, the gradients that call returns and the
    # kernel's contiguous copies of its slices of the output and its gradient
    assert split == fused // 8 + tokens * (3 * 4 * 128 * 2 + 2 * 128 * 2)
    assert split < value
    # without grouped query heads there is no expansion; short: nothing is split
    assert backward_workspace(tokens, 32, 32, 128, 2, split=False) == tokens * 32 * (128 * 4 + 4)
    short = attention.ROWS_PER_CALL // 32
    assert backward_workspace(short, 32, 8, 128, 2, split=True) == backward_workspace(
        short, 32, 8, 128, 2, split=False
    )


def test_heads_without_groups_are_split_only_where_that_needs_less_memory():
    """Without grouped query heads the fused backward keeps just the fp32
    accumulator: two calls' copies cost more than half of it saves, many
    calls less."""
    tokens = attention.ROWS_PER_CALL // 8  # 16 heads: two calls of 8
    assert heads_per_call(tokens, 16, 16, 128, 2) == 16
    fused = backward_workspace(tokens, 16, 16, 128, 2, split=False)
    assert backward_workspace(tokens, 16, 16, 128, 2, split=True) == fused
    long = attention.ROWS_PER_CALL  # one head a call: 16 calls
    assert heads_per_call(long, 16, 16, 128, 2) == 1
    split = backward_workspace(long, 16, 16, 128, 2, split=True)
    assert split < backward_workspace(long, 16, 16, 128, 2, split=False) / 2
    assert heads_per_call(tokens, 32, 8, 128, 2) == kv_heads_per_call(tokens * 4, 8) < 8


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "kv_heads"), [(32, 8), (16, 16)])
def test_on_a_gpu_the_split_backward_gives_the_fused_gradients_with_less_memory(heads, kv_heads):
    seq = 16384
    q, k, v, grad = qkv(heads, kv_heads, torch.bfloat16, "cuda", batch=1, seq=seq, dim=128)
    kwargs = dict(is_causal=True, enable_gqa=heads != kv_heads)

    def peak(split: bool):
        torch.cuda.synchronize()
        if split:
            with GroupedAttention():
                out = F.scaled_dot_product_attention(q, k, v, **kwargs)
            assert type(out.grad_fn).__name__ == "_SplitFlashBackward"
        else:  # (the flash kernel, whichever SDPA would prefer)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        grads = torch.autograd.grad(out, (q, k, v), grad)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
        grads_bytes = sum(g.numel() * g.element_size() for g in grads)
        return out, grads, extra - grads_bytes

    ref, want, fused = peak(False)
    out, got, split = peak(True)
    torch.testing.assert_close(out, ref)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    predicted = backward_workspace(seq, heads, kv_heads, 128, 2, split=True)
    if heads != kv_heads:
        assert split < fused / 2, (split, fused)
    else:  # two calls would need more than one: not split
        assert heads_per_call(seq, heads, kv_heads, 128, 2) == kv_heads
        assert split <= 1.02 * fused, (split, fused)
    assert 0.85 * predicted <= split <= 1.15 * predicted, (split, predicted, fused)
    unsplit = backward_workspace(seq, heads, kv_heads, 128, 2, split=False)
    assert 0.85 * unsplit <= fused <= 1.15 * unsplit, (fused, unsplit)


def test_head_sizes_of_a_config_whose_layers_differ_are_the_largest():
    """Gemma 4's config sets head_dim per layer and refuses a global read."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma4TextConfig(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        head_dim=16,
        per_layer_config={"2": {"head_dim": 64}},
    )
    if not getattr(config, "is_heterogeneous", False):
        pytest.skip("this transformers has no per-layer configs")
    assert attention.attention_heads(config) == (
        config.num_attention_heads,
        config.num_key_value_heads,
        64,
    )
    assert attention.largest_setting(config, "hidden_size") == config.hidden_size

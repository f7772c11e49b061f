"""Sliding-window attention over query tiles: the same attention as the
model's dense mask (forward and gradients), run by every supported family
with sliding-window layers under SDPA without building that mask, and
predicted to grow linearly with the sequence."""

import copy

import pytest
import torch
from test_adapters import TINY, attached, attached_engine, tiny
from test_memory import measured_and_predicted
from torch.nn import functional as F

from lightning_roundpipe.models import CausalLMAdapter
from lightning_roundpipe.models.sliding import (
    SlidingWindow,
    mask_bytes,
    sliding_tile,
    sliding_window_attention,
)

transformers = pytest.importorskip("transformers")


def dense(q, k, v, window):
    """Attention under transformers' sliding-window causal mask, built whole."""
    from transformers import masking_utils

    seq = q.shape[-2]
    allowed = masking_utils.sliding_window_causal_mask_function(window)
    i = torch.arange(seq, device=q.device)
    mask = allowed(0, 0, i[:, None], i[None, :])
    groups = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize(
    ("seq", "window", "tile", "heads", "kv_heads"),
    [
        (10, 3, 4, 4, 2),  # a first tile longer than the window
        (37, 5, None, 4, 4),  # the last tile short
        (64, 16, 16, 8, 2),  # a first tile as long as the window: causal
        (5, 8, None, 2, 2),  # shorter than the window: causal
        (100, 7, 6, 2, 1),  # tiles of window - 1 queries
        (33, 1, 1, 2, 2),  # a window of one: each query sees itself
    ],
)
def test_tiled_sliding_window_attention_is_the_dense_masks(seq, window, tile, heads, kv_heads):
    g = torch.Generator().manual_seed(seq)

    def leaf(h):
        return torch.randn(2, h, seq, 8, dtype=torch.float64, generator=g).requires_grad_()

    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    got = sliding_window_attention(q, k, v, window, tile=tile, enable_gqa=heads != kv_heads)
    want = dense(q, k, v, window)
    torch.testing.assert_close(got, want)
    grad = torch.randn(got.shape, dtype=torch.float64, generator=g)
    for a, b in zip(
        torch.autograd.grad(got, (q, k, v), grad),
        torch.autograd.grad(want, (q, k, v), grad),
        strict=True,
    ):
        torch.testing.assert_close(a, b)


def test_the_tiles_and_their_errors():
    assert sliding_tile(4096) == 8192
    # the two masks every tile takes a view of (rows 16-aligned), bf16; the
    # first only as long as the sequence, the later tiles' only past a tile
    assert mask_bytes(4096, 2, 1 << 20) == 8192 * (8192 + 12288) * 2
    assert mask_bytes(4096, 2, 5000) == 5000 * 5008 * 2
    assert mask_bytes(4, 2, 40) == 8 * (16 + 16) * 2
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match="window must be an integer >= 1, got 0"):
        sliding_window_attention(q, q, q, 0)
    with pytest.raises(ValueError, match="needs as many keys as queries"):
        sliding_window_attention(q, q[..., :5, :], q[..., :5, :], 2)
    with pytest.raises(ValueError, match=r"tile must be >= max\(1, window - 1\) = 3, got 2"):
        sliding_window_attention(q, q, q, 4, tile=2)
    # inside the mode every SDPA call is tiled; one that still brings a mask
    # or dropout would lose the window, and is refused
    want = dense(q, q, q, 2)
    with SlidingWindow(2):
        torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q, is_causal=True), want)
        for kwargs in ({"attn_mask": torch.ones(6, 6, dtype=torch.bool)}, {"dropout_p": 0.1}):
            with pytest.raises(RuntimeError, match="with a mask or attention dropout"):
                F.scaled_dot_product_attention(q, q, q, **kwargs)


def sliding_layers(model) -> list[int]:
    adapter = CausalLMAdapter(model, "model")
    return [
        i
        for i, layer in enumerate(adapter.layers())
        if getattr(layer, "_sliding_window", lambda *a: None)(None, False) is not None
    ]


def _sliding_under_sdpa(model) -> bool:
    return model.config._attn_implementation == "sdpa" and bool(sliding_layers(model))


#: the families whose sliding-window layers run under SDPA (tiled); each
#: family's model built once (every test process builds them to collect)
SLIDING = [k for k in TINY if _sliding_under_sdpa(tiny(k))]


def test_the_sliding_families_are_the_expected_ones():
    assert {"mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "cohere2"} <= set(SLIDING)
    # eager attention (softcapping, sinks) keeps the model's mask
    assert not {"gemma2", "gpt_oss"} & set(SLIDING)


@pytest.mark.parametrize("kind", SLIDING)
def test_sliding_families_train_like_the_model_without_the_dense_mask(kind, monkeypatch):
    """40 tokens without padding, windows of 3 or 4: the pipeline's loss and
    gradients equal the model's, with tiles of twice the window, and the
    pipeline never builds the sliding-window mask the model builds."""
    from transformers import masking_utils

    model = tiny(kind, max_position_embeddings=64)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 101, (4, 40), generator=torch.Generator().manual_seed(0))
    # (models import the mask helpers by name: count what the helper calls)
    built = []
    original = masking_utils.sliding_window_causal_mask_function

    def counting(window):
        built.append(window)
        return original(window)

    monkeypatch.setattr(masking_utils, "sliding_window_causal_mask_function", counting)
    expected = ref(input_ids=ids, labels=ids).loss
    expected.backward()
    assert built, "the model builds no sliding-window mask: nothing to compare"
    built.clear()
    with attached_engine(model, plan="2|2|2") as (_, eng):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        eng.synchronize()
    assert not built
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if q.grad is not None:  # (float32 sums in another order: ~1.5e-5 on an AVX2 CPU)
            torch.testing.assert_close(p.grad, q.grad, atol=5e-5, rtol=1e-4, msg=name)


def test_the_tiles_share_their_masks_and_backward_in_linear_time():
    """Every tile's call keeps a view of one of two masks (one pair per
    stage, whatever its layers), and the backward handles each chunk once:
    the saved masks do not grow with the sequence."""
    from lightning_roundpipe.runtime.scope import stage_scope

    def saved_storages(seq):
        q = torch.randn(1, 4, seq, 8, requires_grad=True)
        k = torch.randn(1, 2, seq, 8, requires_grad=True)
        storages = set()

        def pack(t):
            if t.dim() == 2:  # (the masks; the rest is 4-D)
                storages.add(t.untyped_storage().data_ptr())
            return t

        with stage_scope(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for _ in range(2):  # two layers of a stage
                sliding_window_attention(q, k, k, 4, enable_gqa=True)
        return storages

    assert len(saved_storages(64)) == len(saved_storages(512)) == 2


@pytest.mark.parametrize("frozen", [None, 0, 1])
def test_gradient_checkpointing_keeps_the_models_mask(frozen):
    """transformers' gradient checkpointing recomputes a block outside the
    tiles' mode: such blocks keep the model's own mask, and train like it,
    also beside a block of the same stage in evaluation mode (not
    checkpointed: tiled), each with its own mask."""
    model = tiny("mistral", max_position_embeddings=64)
    model.gradient_checkpointing_enable()
    model.train()
    if frozen is not None:
        model.model.layers[frozen].eval()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 101, (4, 40), generator=torch.Generator().manual_seed(0))
    expected = ref(input_ids=ids, labels=ids).loss
    expected.backward()
    assert len(sliding_layers(model)) == (frozen is not None)
    with attached_engine(model, plan="3|1|3") as (_, eng):  # both blocks in a stage
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        eng.synchronize()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if q.grad is not None:  # (float32 sums in another order: ~1.5e-5 on an AVX2 CPU)
            torch.testing.assert_close(p.grad, q.grad, atol=5e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("seq", [512, 1024])
def test_the_predicted_saved_bytes_bound_what_a_step_saves(seq):
    """Past the window (16), without padding: the probes' prediction of what
    the sliding-window layers keep is within a few percent above what the
    profiler measures in a real step."""
    measured, act, _ = measured_and_predicted(
        "mistral", seq, "32-true", None, padded=False, sliding_window=16
    )
    assert act.windows[1:3] == (16, 16)
    for m, p in zip(measured[1:3], act.saved_bytes(seq, 2)[1:3], strict=True):
        assert m <= p <= 1.03 * m, (seq, m, p)


def test_with_padding_the_models_mask_is_kept(monkeypatch):
    """A padding mask: the sliding-window layers get the model's own mask
    (the tiles handle neither padding nor packed sequences)."""
    from transformers import masking_utils

    model = tiny("mistral", max_position_embeddings=64)
    ids = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ref = copy.deepcopy(model)
    expected = ref(input_ids=ids, attention_mask=mask, labels=ids).loss
    built = []
    original = masking_utils.sliding_window_causal_mask_function
    monkeypatch.setattr(
        masking_utils,
        "sliding_window_causal_mask_function",
        lambda window: built.append(window) or original(window),
    )
    loss = attached(model, lambda: model(input_ids=ids, attention_mask=mask, labels=ids).loss)
    assert built
    torch.testing.assert_close(loss, expected)


def test_the_prediction_of_a_sliding_layer_grows_linearly():
    """The probes run the sliding-window layers tiled (their sequences are
    shorter than the window): what they keep and work with is linear in the
    sequence, beside the tiles' masks, and close to a full-attention
    layer's."""
    full = CausalLMAdapter(tiny("llama"), "model").activation_model(torch.float32, {}, loss=True)
    act = CausalLMAdapter(tiny("mistral"), "model").activation_model(torch.float32, {}, loss=True)
    assert act.windows[1:-1] == (4, 4) and full.windows[1:-1] == (None, None)
    for (_, _, c2), w in zip(act.saved, act.working, strict=True):
        assert c2 == 0
        polys = () if w is None else (*w.outside, *w.tile_base, *(w.attention or ()))
        assert all(p[2] == 0 for p in polys)
    seq = 1 << 20
    saved, work = act.saved_bytes(seq), act.transient_bytes(seq)
    base_saved, base_work = full.saved_bytes(seq), full.transient_bytes(seq)
    # keys and values expanded to the query heads, and the tiles' outputs
    assert base_saved[1] < saved[1] < 1.5 * base_saved[1]
    assert work[1] < 1.5 * base_work[1]


@pytest.mark.gpu
def test_on_a_gpu_the_tiles_give_the_dense_masks_attention_with_less_memory():
    """CUDA, bf16, 64K tokens, a 1024 window, grouped-query heads: the tiles
    run the memory-efficient kernel (no scores), equal the dense mask's
    attention and gradients within bf16 rounding, and peak far below it.

    The saving is the dense mask, sequence x sequence (4 GiB of booleans at
    64K, twice that once SDPA makes it a bf16 bias), against the tiles' two
    masks of 20 x window^2 bytes in bf16 (a query tile of twice the window
    by its padded span) and keys and values expanded per tile.
    It needs a sequence well past the window: on an H200 (2026-11-26), 16K
    tokens with a 4096 window peaked at 1.35 GB tiled against 1.61 GB dense,
    the tiles' masks (320 MiB) then outweighing the dense one (256 MiB)."""
    seq, window = 65536, 1024
    g = torch.Generator(device="cuda").manual_seed(0)

    def leaf(h):
        return torch.randn(
            1, h, seq, 128, dtype=torch.bfloat16, device="cuda", generator=g
        ).requires_grad_()

    q, k, v = leaf(32), leaf(8), leaf(8)
    grad = torch.randn(1, 32, seq, 128, dtype=torch.bfloat16, device="cuda", generator=g)

    def run(fn):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        grads = torch.autograd.grad(out, (q, k, v), grad)
        torch.cuda.synchronize()
        return out, grads, torch.cuda.max_memory_allocated() - before

    tiled = run(lambda: sliding_window_attention(q, k, v, window, enable_gqa=True))
    full = run(lambda: dense(q, k, v, window))
    torch.testing.assert_close(tiled[0], full[0], atol=2e-2, rtol=2e-2)
    for a, b in zip(tiled[1], full[1], strict=True):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)
    assert tiled[2] < full[2] / 2, (tiled[2], full[2])


def test_the_estimate_says_which_layers_attend_over_tiles(tmp_path):
    import io

    from lightning_roundpipe.plan.cli import main

    def note(kind):
        path = tmp_path / f"{kind}.json"
        tiny(kind).config.to_json_file(path)
        out = io.StringIO()
        assert main(["estimate", str(path), "--gpu-memory", "1.25", "--seq", "512"], out=out) == 0
        return out.getvalue()

    assert "note: 2 sliding-window layers (window 4) attend over query tiles" in note("mistral")
    assert "sliding-window" not in note("llama")

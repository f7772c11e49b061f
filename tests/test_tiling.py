"""Long sequences: the LM loss over chunks of tokens and decoder MLPs over
sequence tiles (``tile_memory``) give the results of the unsplit computation,
in fp32, bf16 and fp16 (loss scaled), for dense and Mixture-of-Experts models;
the full-vocabulary logits never exist (peak memory of a fit measured in a
fresh process); what cannot be tiled exactly (dropout, router statistics, an
MLP returning a tuple) is not."""

import copy
import functools
import sys

import lightning as L
import pytest
import torch
from conftest import LONG_FIT
from test_adapters import LM, QUIET, lm_data, tiny
from torch import nn
from torch.utils.data import DataLoader

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.models import CausalLMAdapter, attention, causal_lm_loss, layers, tiling
from lightning_roundpipe.models.tiling import ChunkedLogits, draws_random, tiled
from lightning_roundpipe.runtime import RoundPipeEngine
from lightning_roundpipe.runtime.options import EngineOptions

transformers = pytest.importorskip("transformers")


# ------------------------------------------------------------ the pieces
class Head(nn.Module):
    """A norm, a projection and a soft cap: a head's per-position work."""

    def __init__(self, hidden: int = 16, vocab: int = 37, dtype=torch.float32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden, dtype=dtype)
        self.proj = nn.Linear(hidden, vocab, dtype=dtype)

    def forward(self, h):
        return torch.tanh(self.proj(self.norm(h)) / 3.0) * 3.0


def head_case(dtype, labels_kind="some ignored"):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    head = Head(dtype=dtype)
    hidden = torch.randn(3, 11, 16, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, 37, (3, 11), generator=g)
    if labels_kind == "some ignored":
        labels[0, 7:] = -100
        labels[2, :3] = -100
    elif labels_kind == "all ignored":
        labels[:] = -100
    return head, hidden, labels


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [
        (torch.float32, {}),
        # low precision: both sides round differently (the chunks sum in fp32)
        (torch.bfloat16, dict(atol=2e-2, rtol=2e-2)),
        (torch.float16, dict(atol=1e-2, rtol=2e-3)),
    ],
)
@pytest.mark.parametrize("chunk", [1, 5, 33, 1000])
def test_the_chunked_loss_and_its_gradients_equal_the_full_logits(dtype, tol, chunk):
    head, hidden, labels = head_case(dtype)
    ref_head, ref_hidden = copy.deepcopy(head), hidden.detach().clone().requires_grad_()
    expected = causal_lm_loss(ref_head(ref_hidden), labels)
    # a loss scale (fp16) or a gradient factor (accumulation): gradients are scaled
    (expected * 64.0).backward()
    loss = ChunkedLogits(hidden, head, list(head.parameters()), chunk).loss(labels)
    (loss * 64.0).backward()
    torch.testing.assert_close(loss, expected.detach(), **tol)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, **tol)
    for (name, p), q in zip(head.named_parameters(), ref_head.parameters(), strict=True):
        assert p.grad.dtype == p.dtype
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=name)


def test_the_chunked_loss_of_no_labelled_token_is_zero_with_zero_gradients():
    head, hidden, labels = head_case(torch.float32, "all ignored")
    loss = ChunkedLogits(hidden, head, list(head.parameters()), 4).loss(labels)
    loss.backward()
    assert loss.item() == 0.0 == causal_lm_loss(head(hidden), labels).item()
    assert not hidden.grad.any() and not head.proj.weight.grad.any()


def test_the_chunked_loss_differentiates_only_what_needs_it():
    head, hidden, labels = head_case(torch.float32)
    head.proj.weight.requires_grad_(False)
    frozen = hidden.detach()  # e.g. a stage whose input needs no gradient
    loss = ChunkedLogits(frozen, head, tiling.trainable(head), 6).loss(labels)
    loss.backward()
    assert head.proj.weight.grad is None and head.proj.bias.grad is not None
    with torch.no_grad():  # evaluation: no gradient work at all
        value = ChunkedLogits(hidden, head, tiling.trainable(head), 6).loss(labels)
    torch.testing.assert_close(value, causal_lm_loss(head(hidden), labels))
    assert not value.requires_grad


class MLP(nn.Module):
    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        self.up = nn.Linear(8, 24, dtype=dtype)
        self.down = nn.Linear(24, 8, dtype=dtype)

    def forward(self, x):
        return self.down(nn.functional.silu(self.up(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tile", "dim"), [(1, 1), (4, 1), (50, 1), (2, 0)])
def test_a_tiled_mlp_and_its_gradients_equal_the_whole_call(dtype, tile, dim):
    torch.manual_seed(0)
    mlp = MLP(dtype)
    ref = copy.deepcopy(mlp)
    x = torch.randn(3, 13, 8).to(dtype).requires_grad_()
    rx = x.detach().clone().requires_grad_()
    g = torch.randn(3, 13, 8).to(dtype)
    expected = ref(rx)
    expected.backward(g)
    out = tiled(mlp, tiling.trainable(mlp), x, tile, dim)
    out.backward(g)
    tol = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, expected, **tol)
    torch.testing.assert_close(x.grad, rx.grad, **tol)
    for (name, p), q in zip(mlp.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=name)


class Jittered(nn.Module):
    """An MLP that scales its input by fresh noise (Mixtral's router jitter),
    keeping each call's noise."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()
        self.noises: list[torch.Tensor] = []

    def forward(self, x):
        noise = torch.empty_like(x).uniform_(0.5, 1.5)  # in place, as Mixtral's
        self.noises.append(noise.detach().clone())
        return self.mlp(x * noise) + torch.rand_like(x)  # and a functional draw


def test_random_numbers_a_tile_draws_are_drawn_again_by_its_recompute():
    torch.manual_seed(0)
    block = Jittered()
    x = torch.randn(3, 13, 8, requires_grad=True)
    g = torch.randn(3, 13, 8)
    out = tiled(block, tiling.trainable(block), x, 5)
    forward = block.noises[:]
    assert len(forward) == 3  # tiles of 5, 5 and 3 positions
    out.backward(g)
    # the recompute got the forward's noise, not new draws
    assert len(block.noises) == 6
    for a, b in zip(block.noises[3:], forward, strict=True):
        assert torch.equal(a, b)
    # and so the gradients are those of the forward that ran
    ref = copy.deepcopy(block.mlp)
    rx = x.detach().clone().requires_grad_()
    (ref(rx * torch.cat(forward, 1)) * g).sum().backward()
    torch.testing.assert_close(x.grad, rx.grad)
    for (name, p), q in zip(block.mlp.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_recompute_drawing_otherwise_than_its_forward_is_refused():
    calls = []

    def fn(x):
        calls.append(1)
        draws = 1 if len(calls) == 1 else 2  # forward: one draw; recompute: two
        for _ in range(draws):
            x = x * torch.rand_like(x)
        return x

    out = tiled(fn, [], torch.ones(1, 2, 4, requires_grad=True), 2)
    with pytest.raises(RuntimeError, match="recompute drew other random numbers than its forward"):
        out.sum().backward()


def replays_exactly(fn, derivative, x: torch.Tensor, tile: int = 3) -> None:
    """``tiled(fn)``'s input gradient is ``derivative(x, out)`` (computed from
    the output the forward drew): the recompute got every draw back, whatever
    argument the op wrote, and again from a retained graph."""
    torch.manual_seed(0)
    x = x.detach().requires_grad_()
    out = tiled(fn, [], x, tile)
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g, retain_graph=True)
    (again,) = torch.autograd.grad(out, x, g)
    torch.testing.assert_close(again, gx)
    torch.testing.assert_close(gx, g * derivative(x.detach(), out.detach()))


def test_draws_written_into_an_out_argument_or_another_argument_are_replayed():
    def into_out(x):  # bernoulli.out: the draw lands in a given tensor
        mask = torch.empty_like(x)
        torch.bernoulli(torch.full_like(x, 0.5), out=mask)
        return x * (mask + 0.5)

    def rrelu(x):  # rrelu_with_noise writes its noise argument, which backward reads
        return -nn.functional.rrelu(-(x * x + 1), training=True)  # a * (x^2 + 1)

    x = torch.randn(2, 7, 4)
    replays_exactly(into_out, lambda x, out: out / x, x)
    replays_exactly(rrelu, lambda x, out: 2 * x * out / (x * x + 1), x)


def test_nothing_is_recorded_where_no_backward_follows(monkeypatch):
    tapes = []

    class Counted(tiling._RandomTape):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            tapes.append(self)

    monkeypatch.setattr(tiling, "_RandomTape", Counted)

    def fn(x):
        return x * torch.rand_like(x)

    with torch.no_grad():  # a forward stage: no recompute will follow
        tiled(fn, [], torch.ones(1, 4, 2), 2)
    assert tapes == []
    tiled(fn, [], torch.ones(1, 4, 2, requires_grad=True), 2).sum().backward()
    assert len(tapes) == 4  # two tiles recorded, two replayed


def test_a_module_with_a_dropout_rate_draws_random_numbers_while_training():
    class Rated(nn.Module):  # F.dropout(x, p=self.residual_dropout), as Seed-OSS's MLP
        def __init__(self, rate):
            super().__init__()
            self.residual_dropout = rate

    assert draws_random(Rated(0.1)) and not draws_random(Rated(0.0))
    assert not draws_random(Rated(0.1).eval())
    assert not draws_random(nn.Sequential(Rated(0.0), nn.Dropout(0.0)))


def test_dropout_is_seen_only_while_it_draws():
    block = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    assert draws_random(block)
    assert not draws_random(block.eval())
    assert not draws_random(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)))


def test_tile_memory_is_validated_naming_the_option():
    for bad in (0, -5, "big"):
        with pytest.raises(ValueError, match=r"tile_memory must be a positive number of bytes"):
            EngineOptions(tile_memory=bad)
    with pytest.raises(ValueError, match=r"tile_memory must be an integer or 'auto' or None"):
        EngineOptions(tile_memory=1.5)  # (its type, from the annotation)
    with pytest.raises(ValueError, match=r"tile_memory must be a positive number of bytes"):
        RoundPipeStrategy(tile_memory=0)


def test_the_tile_budget_follows_the_option():
    net = [nn.Linear(4, 4), nn.Linear(4, 1)]
    for option, budget in [(None, None), (4096, 4096), ("auto", 128 * 2**20)]:
        with RoundPipeEngine(net, ["cpu"], 1, tile_memory=option) as eng:
            assert eng.tile_budget == budget


def test_a_tiled_block_calls_its_norms_and_mlp_any_way_and_restores_them():
    """While a block runs tiled, a norm or MLP called with one positional
    tensor is tiled (same values); any other call (a keyword argument) runs
    untiled; afterwards the modules' own forwards are back."""
    block = CausalLMAdapter(tiny("qwen3"), "model").layers()[1]
    norm, mlp = block.layer.input_layernorm, block.layer.mlp
    q, o = block.layer.self_attn.q_proj, block.layer.self_attn.o_proj
    h = torch.randn(2, 10, norm.weight.shape[0], requires_grad=True)
    want_norm, want_mlp, want_q = norm(h), mlp(h), q(norm(h))
    want_grad = torch.autograd.grad((want_q.sum(), mlp(norm(h)).sum()), h)
    with block._tiled_mlp(h, 4):
        assert all("forward" in m.__dict__ for m in (norm, mlp, q, o))
        torch.testing.assert_close(norm(h), want_norm)
        torch.testing.assert_close(norm(hidden_states=h), want_norm)
        torch.testing.assert_close(mlp(h), want_mlp)
        torch.testing.assert_close(mlp(x=h), want_mlp)
        # a projection, or the MLP, reading the norm's output: the norm in its tiles
        normed = norm(h)
        got_q, got_mlp = q(normed), mlp(normed)
        torch.testing.assert_close(got_q, want_q)
        got_grad = torch.autograd.grad((got_q.sum(), got_mlp.sum()), h)
        torch.testing.assert_close(got_grad, want_grad)
        torch.testing.assert_close(q(want_norm), want_q)  # (any other input: plain)
    assert not any("forward" in m.__dict__ for m in (norm, mlp, q, o))


# ------------------------------------------------------------ in a fit
# 7 KB: loss chunks of 3-4 tokens and MLP tiles of 2-8 positions per row at the
# tiny models' widths in fp32 and bf16 (20 tokens per micro-batch: uneven
# last pieces)
SMALL = 7_000


class Counting:
    """Counts the chunked losses and the tiled calls the workers make: of
    MLPs (``tiled``), norms, linear projections; ``fused``: those of them
    (MLPs, projections) that run the norm they read inside their tiles."""

    def __init__(self, monkeypatch) -> None:
        self.chunked = self.tiled = self.norms = self.fused = self.projections = 0
        loss, tile = ChunkedLogits.loss, layers.tiled

        def counted_loss(this, labels):
            self.chunked += 1
            return loss(this, labels)

        def counted_tile(fn, *args, **kwargs):
            if isinstance(fn, functools.partial):  # (norm, reader's forward)
                self.fused += 1
                fn_ = fn.args[1]
            else:
                fn_ = fn
            name = type(fn_.__self__).__name__  # (peft's LoRA linear is a "Linear")
            if name.endswith(("RMSNorm", "LayerNorm")):
                self.norms += 1
            elif name == "Linear":
                self.projections += 1
            else:
                self.tiled += 1
            return tile(fn, *args, **kwargs)

        monkeypatch.setattr(ChunkedLogits, "loss", counted_loss)
        monkeypatch.setattr(layers, "tiled", counted_tile)


class AdamLM(LM):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(module, tile_memory, precision="32-true"):
    L.seed_everything(0)
    strategy = RoundPipeStrategy(
        async_optimizer=False, num_microbatches=2, plan="2|2|2", tile_memory=tile_memory
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=3,
        precision=precision,
        **QUIET,
    )
    trainer.fit(module, DataLoader(lm_data(), batch_size=4))


def same_training(model, monkeypatch, precision, lm=LM, tol=None):
    """A fit with ``SMALL`` tiles and one that never tiles: the same losses and
    weights (plain SGD by default: Adam's normalisation turns the rounding of a
    near-zero gradient, which any change of summation order moves, into a
    full-size step). Returns what was chunked and tiled."""
    ref = lm(copy.deepcopy(model))
    fit(ref, None, precision)
    count = Counting(monkeypatch)
    mod = lm(model)
    fit(mod, SMALL, precision)
    tol = tol or {}
    torch.testing.assert_close(torch.stack(mod.losses), torch.stack(ref.losses), **tol)
    for (name, a), b in zip(mod.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, **tol, msg=name)
    return count


KINDS = ["llama", "qwen3", "qwen3_moe"]  # (the experts' block is tiled too)
NORMS = {"llama": 2, "qwen3": 4, "qwen3_moe": 4}  # per block


def tiled_as_designed(count: Counting, kind: str) -> None:
    # per step and micro-batch: one chunked loss; 2 blocks, forward + recompute
    assert count.chunked == 3 * 2
    assert count.tiled >= 3 * 2 * 2
    # every tiled block also tiles its norms (Qwen3's per-head query/key norms too)
    assert count.norms == NORMS[kind] * count.tiled
    # where the block runs for a backward (not in a forward stage, whose
    # weights need no gradient), the query/key/value projections read the
    # input norm's output, the MLP the post-attention norm's output of the
    # residual sum: they run those in their tiles (the output projection
    # reads the attention: as usual)
    assert count.projections > 0 and count.projections % 3 == 0
    assert count.projections + count.projections // 3 <= count.fused
    assert count.fused <= count.projections + count.tiled


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_and_tiled_fp32_training_equals_untiled(kind, monkeypatch):
    tiled_as_designed(same_training(tiny(kind), monkeypatch, "32-true"), kind)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_and_tiled_bf16_training_equals_untiled(kind, monkeypatch):
    count = same_training(tiny(kind), monkeypatch, "bf16-mixed", tol=dict(atol=1e-2, rtol=1.6e-2))
    tiled_as_designed(count, kind)


@pytest.mark.parametrize("kind", ["granitemoe", "deepseek_v2", "olmo3", "phimoe"])
def test_families_with_their_own_blocks_train_chunked_and_tiled_like_untiled(kind, monkeypatch):
    """Granite-MoE's experts under another name, DeepSeek-V2's complex rotary
    table, OLMo 3's rotary table per layer type, PhiMoE's sparsemixer."""
    count = same_training(tiny(kind), monkeypatch, "32-true")
    assert count.chunked == 3 * 2 and count.tiled >= 3 * 2 * 2


def test_checkpointed_blocks_run_whole_and_train_like_untiled(monkeypatch):
    """transformers' gradient checkpointing recomputes a block in its backward,
    outside the pipeline's call: tiled in the forward and whole in the
    recompute, the checkpoint found other saved tensors and the first step
    failed (tiles come on by themselves at long sequences). The loss is
    still chunked."""
    model = tiny("llama")
    model.gradient_checkpointing_enable()
    count = same_training(model, monkeypatch, "32-true")
    assert count.chunked == 3 * 2 and count.tiled == count.norms == 0


def test_a_tiled_block_drawing_random_numbers_trains_reproducibly(monkeypatch):
    """PhiMoE's sparsemixer draws random numbers while training: its tiles
    replay them in their recompute (inside the workers' seeded random
    streams), and two runs give the same losses and weights."""
    model = tiny("phimoe", router_jitter_noise=0.01)
    runs = []
    for _ in range(2):
        count = Counting(monkeypatch)
        mod = LM(copy.deepcopy(model))
        fit(mod, SMALL)
        assert count.tiled >= 3 * 2 * 2
        runs.append(mod)
    torch.testing.assert_close(torch.stack(runs[0].losses), torch.stack(runs[1].losses))
    for (name, a), b in zip(runs[0].named_parameters(), runs[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def lora(model: nn.Module, **settings) -> nn.Module:
    peft = pytest.importorskip("peft")
    settings.setdefault("target_modules", "all-linear")
    config = peft.LoraConfig(r=4, lora_alpha=8, **settings)
    model = peft.get_peft_model(model, config)
    with torch.no_grad():  # LoRA B starts at zero: make every adapter matter at once
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lora_projections_tiled_with_their_norm_train_like_untiled(precision, monkeypatch):
    """peft LoRA linears (the base frozen) read the input norm's output: tiled
    with the norm, the run is the untiled one."""
    tol = dict(atol=1e-2, rtol=1.6e-2) if precision == "bf16-mixed" else {}
    count = same_training(lora(tiny("llama")), monkeypatch, precision, tol=tol)
    tiled_as_designed(count, "llama")


def test_frozen_projections_compute_as_usual_and_training_equals_untiled(monkeypatch):
    """LoRA on the query and value projections only: those two read the
    input norm in their tiles; the frozen key and output projections compute
    as usual (a frozen linear's input may not be kept: its output gets no
    recipe, so the residual after attention is kept as before)."""
    model = lora(tiny("llama"), target_modules=["q_proj", "v_proj"])
    count = same_training(model, monkeypatch, "32-true")
    assert count.projections > 0 and count.projections % 2 == 0
    assert count.tiled >= 3 * 2 * 2


def test_lora_with_dropout_or_a_variant_is_not_tiled_with_the_norm(monkeypatch):
    """A LoRA dropout draws random numbers, DoRA is a variant: those
    projections run untiled, reading the norm's output. A DoRA MLP draws
    none: it is tiled with its norm; one with LoRA dropout is not tiled."""
    count = Counting(monkeypatch)
    fit(LM(lora(tiny("llama"), lora_dropout=0.1)), SMALL)
    assert count.norms > 0 and count.tiled == count.projections == count.fused == 0
    count = Counting(monkeypatch)
    fit(LM(lora(tiny("llama"), use_dora=True)), SMALL)
    assert count.tiled >= 3 * 2 * 2 and count.projections == 0
    assert 0 < count.fused < count.tiled  # (forward stages: the MLP alone)


def test_a_tiled_block_keeps_no_norm_output_nor_residual_for_its_backward():
    """What a tiled Llama block keeps per token: its input, the attention's
    query, key, value and output, and small rotary tables; neither norm's
    output nor the residual after attention (untiled: three more values)."""
    model = tiny("llama")
    config = model.config
    adapter = CausalLMAdapter(model, "model")
    hidden = config.hidden_size
    head = hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    rotary = 2 * head  # cos and sin
    want = (2 * hidden + q + 2 * kv + rotary) * 4  # fp32 bytes per token
    tiled_model = adapter.activation_model(torch.float32, {"mlp_tile": 1}, loss=False)
    got = tiled_model.saved[1][1] + tiled_model.shared[1]
    assert want <= got <= want + 4 * 4, (got, want)  # (+ the attention's log-sum-exp)
    # (the rotary tables: once per micro-batch, the positions are the batch's)
    assert tiled_model.shared[1] == rotary * 4


class Unpadded(LM):
    """Called without the padding mask: causal attention with no mask, which
    the flash kernel runs."""

    def training_step(self, batch, batch_idx):
        ids, _, labels = batch
        out = self.model(input_ids=ids, labels=labels)
        self.losses.append(out.loss.detach().clone())
        return out.loss


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_attention_backward_split_over_head_groups_trains_like_untiled(precision, monkeypatch):
    """Tiled blocks run their attention's backward a key/value head at a
    time (on CUDA; here the CPU kernels stand in): training equals untiled."""
    monkeypatch.setattr(attention, "SPLIT_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(attention, "heads_per_call", lambda *_: 1)
    split = attention._SplitFlash.apply
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return split(*args)

    monkeypatch.setattr(attention._SplitFlash, "apply", counted)
    tol = dict(atol=1e-2, rtol=1.6e-2) if precision == "bf16-mixed" else {}
    count = same_training(tiny("llama"), monkeypatch, precision, lm=Unpadded, tol=tol)
    tiled_as_designed(count, "llama")
    # in the recompute of each block before its backward (3 steps, 2 micro-batches, 2 blocks)
    assert len(calls) == 3 * 2 * 2


def test_adamw_training_of_a_dense_model_chunked_and_tiled_equals_untiled(monkeypatch):
    # Adam turns the last-bit rounding of a near-zero gradient (tiles sum in
    # another order) into a step of up to lr; 3 steps of lr 1e-2 move the
    # weights by ~3e-2, and on an AVX2 CPU one element in 1024 ends 1.6e-5 off
    tol = dict(atol=5e-5, rtol=1.3e-6)
    count = same_training(tiny("llama"), monkeypatch, "32-true", lm=AdamLM, tol=tol)
    assert count.chunked == 3 * 2 and count.tiled >= 3 * 2 * 2


def test_with_the_router_loss_the_loss_is_chunked_and_the_experts_are_not_tiled(monkeypatch):
    # the router statistics record the routers' logits with their gradient:
    # those blocks run whole
    count = same_training(tiny("qwen3_moe", output_router_logits=True), monkeypatch, "32-true")
    assert count.chunked == 3 * 2
    assert count.tiled == 0


def test_dropout_and_tuple_mlps_are_never_tiled(monkeypatch):
    """Their norms still are (a norm draws no random numbers)."""
    count = Counting(monkeypatch)
    fit(LM(tiny("gpt_oss")), SMALL)  # its MLP returns (hidden, router scores)
    assert count.chunked == 3 * 2 and count.tiled == 0 and count.norms > 0
    count.chunked = count.norms = 0
    fit(LM(tiny("gpt2", resid_pdrop=0.1)), SMALL)  # GPT-2's MLP ends in a dropout
    assert count.chunked == 3 * 2 and count.tiled == 0 and count.norms > 0
    count.chunked = 0
    fit(LM(tiny("gpt2")), SMALL)  # (and is tiled without it)
    assert count.chunked == 3 * 2 and count.tiled >= 3 * 2 * 2


def test_an_mlp_with_a_dropout_rate_is_not_tiled_and_trains_like_untiled(monkeypatch):
    """Seed-OSS's MLP drops out its output with F.dropout and a rate: untiled,
    so its masks are the untiled run's."""
    count = same_training(tiny("seed_oss", residual_dropout=0.1), monkeypatch, "32-true")
    assert count.tiled == 0 and count.norms > 0


def test_tiled_norms_beside_dropout_train_like_untiled(monkeypatch):
    """GPT-2 with dropout: its LayerNorms are tiled, its MLP is not; the
    dropout masks and so the whole run are those of the untiled run."""
    count = same_training(tiny("gpt2", resid_pdrop=0.1), monkeypatch, "32-true")
    assert count.tiled == 0 and count.norms == 2 * 3 * 2 * 3  # ln_1, ln_2 per block call


def test_evaluation_computes_the_loss_from_whole_logits(monkeypatch):
    """Without labels (or in evaluation) the logits are what the user gets."""
    count = Counting(monkeypatch)
    model = tiny("llama").eval()
    ids = lm_data(4).tensors[0]
    adapter = CausalLMAdapter(model, "model")
    with (
        torch.no_grad(),
        RoundPipeEngine(adapter.layers(), ["cpu"] * 2, 2, tile_memory=SMALL) as eng,
    ):
        adapter.attach(eng)
        try:
            out = model(input_ids=ids, labels=ids)
        finally:
            adapter.detach()
        expected = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, expected.logits)
    torch.testing.assert_close(out.loss, expected.loss)
    assert count.chunked == 0


# ------------------------------------------------------------ memory
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc: Linux")
@pytest.mark.xdist_group("long_fit")  # one test process runs the fits for both
def test_the_full_logits_never_exist(long_fit_peaks):
    """One 8,192-token sequence, a 32,000-token vocabulary: the fp32 logits
    alone are 1 GB (untiled, the fit peaks about 3 GB above its start); the
    chunked fit's resident memory peaks about 120 MB above it."""
    (long, _), (short, _) = long_fit_peaks[8192], long_fit_peaks[256]
    logits = 8192 * LONG_FIT["vocab"] * 4
    assert long < logits / 4, f"peak {long / 2**20:.0f} MiB"
    # what grows with the sequence (hidden states, attention, tiles) is small:
    # the rest is the model's state, the same at any length
    assert long - short < logits / 10, f"{long / 2**20:.0f} vs {short / 2**20:.0f} MiB"

"""Layers whose forward changes state it reads (spectral norm's power
iteration, dynamic RoPE's rescaled frequencies) cannot be pipelined: each
worker runs a private copy, and a stage is computed again for its backward.
They are refused with a message naming the layer and the buffer, never
trained with gradients of another forward than the loss's."""

import lightning as L
import pytest
import torch
from torch import nn

from lightning_roundpipe import RoundPipeStrategy

from .modules import CausalLM, cpu_trainer, hf_model, lm_data, loader, seq_data, state


def _fit(module, strategy, data, steps=2):
    cpu_trainer(strategy, max_steps=steps).fit(module, loader(data, 4))


def _sync(plan="auto"):
    return RoundPipeStrategy(async_optimizer=False, num_microbatches=1, plan=plan)


class Spectral(L.LightningModule):
    def __init__(self, parametrized: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        norm = nn.utils.parametrizations.spectral_norm if parametrized else nn.utils.spectral_norm
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), norm(nn.Linear(16, 16)), nn.Tanh(), nn.Linear(16, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("parametrized", [False, True])
def test_spectral_norm_in_a_recomputed_stage_is_refused(parametrized):
    buffer = r"parametrizations\.weight\.0\._u" if parametrized else "weight_u"
    with pytest.raises(RuntimeError, match=rf"pipeline layer 2 .*changed its buffer {buffer}"):
        # the spectral-norm layer in the first stage: its forward comes before
        # the backward's recompute
        _fit(Spectral(parametrized), _sync("3|2|1,1,1"), seq_data(16))


@pytest.mark.parametrize("parametrized", [False, True])
def test_spectral_norm_in_the_last_stage_of_a_loss_computed_outside_is_refused(parametrized):
    """The loss comes from the stack's outputs: a forward pass gives them,
    and the backward computes the batch again, so spectral norm's power
    iteration runs twice per step there too, even in the fused stage."""
    buffer = r"parametrizations\.weight\.0\._u" if parametrized else "weight_u"
    with pytest.raises(RuntimeError, match=rf"pipeline layer 2 .*changed its buffer {buffer}"):
        _fit(Spectral(parametrized), _sync("2|3|2"), seq_data(16))


class DynamicRope(CausalLM):
    def __init__(self) -> None:
        super().__init__(kind="llama")
        self.model = hf_model(
            "llama",
            layers=2,
            max_position_embeddings=8,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_dynamic_rope_past_its_positions_is_refused_with_what_to_do():
    """On the host, before anything runs (a worker refused it from inside
    the forward that rescaled the frequencies)."""
    message = (
        "model: rope_type='dynamic' rescales its frequencies when a sequence is longer than "
        "any before, which the pipeline's copies of the layers cannot follow, and this batch "
        "reaches position 12 (max_position_embeddings=8): train with sequences of at most 8 "
        "tokens, or use 'linear' or 'yarn' rope scaling"
    )
    module = DynamicRope()
    before = state(module)
    with pytest.raises(ValueError) as err:
        _fit(module, _sync(), lm_data(8, seq=12))
    assert str(err.value) == message
    torch.testing.assert_close(state(module), before)


def test_dynamic_rope_within_its_positions_trains_like_the_default_strategy():
    weights = {}
    for name, strategy in [("auto", "auto"), ("sync", _sync())]:
        module = DynamicRope()
        _fit(module, strategy, lm_data(8, seq=8), steps=3)
        weights[name] = state(module)
    torch.testing.assert_close(weights["sync"], weights["auto"])


class LongRope(CausalLM):
    """Llama with LongRoPE scaling (Phi-3's, Phi-3.5's, Phi-4-mini's): every
    forward copies the short or the long frequency set into inv_freq, chosen
    by the positions, before reading it."""

    def __init__(self) -> None:
        super().__init__(kind="llama")
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.1, 1.2, 1.3],
            "long_factor": [2.0, 3.0, 4.0, 5.0],
            "original_max_position_embeddings": 10,
        }
        self.model = hf_model("llama", layers=2, rope_parameters=rope)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("seq", [8, 12])  # (the short set; the long one)
def test_longrope_trains_like_the_default_strategy_with_recomputed_stages(seq):
    """(its in-place copy was refused when a stage was computed again for its
    backward, naming dynamic RoPE)"""
    weights = {}
    for name, strategy in [("auto", "auto"), ("sync", _sync("1,2|1|1,1,1")), ("async", None)]:
        if strategy is None:
            strategy = RoundPipeStrategy(num_microbatches=2, plan="1,2|1|1,1,1")
        module = LongRope()
        _fit(module, strategy, lm_data(8, seq=seq), steps=3)
        weights[name] = state(module)
    torch.testing.assert_close(weights["sync"], weights["auto"])
    assert any(not torch.equal(a, weights["auto"][k]) for k, a in weights["async"].items())


def test_longrope_whose_micro_batches_would_pick_different_frequencies_is_refused():
    """Rows' positions on both sides of original_max_position_embeddings
    (packed sequences): the model's one call picks the long set, a
    micro-batch of short rows would pick the short one."""

    class Packed(LongRope):
        def training_step(self, batch, batch_idx):
            ids, _, labels = batch
            positions = torch.arange(12).repeat(len(ids), 1)
            positions[len(ids) // 2 :] = torch.arange(6).repeat(2)  # (two packed sequences)
            return self.model(input_ids=ids, position_ids=positions, labels=labels).loss

    with pytest.raises(
        ValueError,
        match=r"rope_type='longrope' picks its short or long frequencies from the largest "
        r"position of each call.*reach 6 to 12 tokens, original_max_position_embeddings=10",
    ):
        _fit(Packed(), RoundPipeStrategy(async_optimizer=False, num_microbatches=2), lm_data(8, 12))


class Normalized(L.LightningModule):
    """Batch norm between linear layers; or an fp32 table added to the
    activations (a positional encoding kept as a buffer)."""

    def __init__(self, table: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        middle = Table() if table else nn.BatchNorm1d(16)
        self.net = nn.Sequential(nn.Linear(8, 16), middle, nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pe", torch.linspace(0, 1, 16))

    def forward(self, x):
        return x + self.pe


def test_batch_norm_under_bf16_mixed_trains_in_fp32_like_the_default_strategy():
    """Its fp32 running statistics with a bf16 input failed the forward; it
    runs in fp32 on the workers, as under autocast (one micro-batch: the
    statistics are a micro-batch's)."""
    modules = {}
    for kind in ("auto", "sync"):
        modules[kind] = Normalized()
        plan = "auto" if kind == "auto" else _sync("1,1|2|1,1")
        cpu_trainer(plan, max_steps=3, precision="bf16-mixed").fit(
            modules[kind], loader(seq_data(32), 8)
        )
    bn = modules["sync"].net[1]
    assert bn.running_mean.dtype == torch.float32 and int(bn.num_batches_tracked) == 3
    for (name, x), y in zip(
        modules["sync"].state_dict().items(), modules["auto"].state_dict().values(), strict=True
    ):
        torch.testing.assert_close(x, y, atol=2e-2, rtol=0, msg=name)


def test_an_fp32_buffer_mixed_into_bf16_activations_fails_saying_what_to_cast():
    with pytest.raises(RuntimeError, match=r"must cast it to the activations' dtype, e\.g\. x \+"):
        cpu_trainer(_sync(), max_steps=1, precision="bf16-mixed").fit(
            Normalized(table=True), loader(seq_data(32), 8)
        )


@pytest.mark.gpu
def test_batch_norm_under_bf16_mixed_on_gpu_workers_trains_like_the_default_strategy():
    modules = {}
    for kind in ("auto", "sync"):
        modules[kind] = Normalized()
        L.seed_everything(0)
        L.Trainer(
            strategy="auto" if kind == "auto" else _sync("1,1|2|1,1"),
            accelerator="cuda",
            devices=1,
            max_steps=3,
            precision="bf16-mixed",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(modules[kind], loader(seq_data(32), 8))
    for (name, x), y in zip(
        modules["sync"].state_dict().items(), modules["auto"].state_dict().values(), strict=True
    ):
        torch.testing.assert_close(x.cpu(), y.cpu(), atol=2e-2, rtol=0, msg=name)

"""A layer that calls ``torch.utils.checkpoint`` itself, around random ops.

The checkpoint keeps ``torch.get_rng_state()`` in its forward and sets it
again for the recompute in the backward; on a CPU worker a layer draws from
its own seeded generator, not the process's, so the recompute drew other
masks than the forward: gradients silently wrong, though the loss was right.
"""

import time

import lightning as L
import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.runtime import RoundPipeEngine
from lightning_roundpipe.runtime.device import LayerRandomness

from .models import reference

CPU = torch.device("cpu")


class _Noise(nn.Module):
    """A random op of a given kind: dropout, a mask from ``torch.rand`` (no
    generator argument given) or from ``bernoulli_``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "dropout":
            return self.drop(x)
        if self.kind == "rand":
            return x * (torch.rand(x.shape) < 0.5) * 2
        return x * torch.empty_like(x).bernoulli_(0.5) * 2


class _Checkpointed(nn.Module):
    """A block whose forward checkpoints its inner part itself (nested: a
    checkpoint inside the checkpointed part too)."""

    def __init__(self, kind: str, reentrant: bool, checkpointing: bool = True) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), _Noise(kind), nn.Tanh(), nn.Linear(8, 8))
        self.reentrant = reentrant
        self.checkpointing = checkpointing
        self.nested = kind == "nested"
        if self.nested:
            self.inner[1] = _Noise("dropout")

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        if self.nested and self.checkpointing:
            x = cp.checkpoint(self.inner[:2], x, use_reentrant=self.reentrant)
            return self.inner[2:](x)
        return self.inner(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.checkpointing:
            return self._run(x)
        return cp.checkpoint(self._run, x, use_reentrant=self.reentrant)


def _layers(kind: str, reentrant: bool, checkpointing: bool = True) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Linear(8, 8),
        _Checkpointed(kind, reentrant, checkpointing),
        nn.Tanh(),
        _Checkpointed(kind, reentrant, checkpointing),
        nn.Linear(8, 4),
    ]


def _grads(layers: list[nn.Module]) -> list[torch.Tensor]:
    return [p.grad.clone() for layer in layers for p in layer.parameters()]


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("plan", [None, "2,1|2|1,2", "1,1,1|2|1,1,1|layered"])
@pytest.mark.parametrize("kind", ["dropout", "rand", "bernoulli", "nested"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_layers_own_checkpoint_recomputes_the_forwards_random_numbers(reentrant, kind, plan):
    """The gradients equal plain PyTorch's with the pipeline's seeds and no
    checkpoint at all (the recompute drew the forward's masks), summed over
    two iterations (new masks in the second)."""
    layers = _layers(kind, reentrant)
    ref = _layers(kind, reentrant, checkpointing=False)
    loss_fn = nn.functional.mse_loss
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with RoundPipeEngine(layers, [CPU] * 2, 2, plan=plan, seed=5, watchdog_timeout=60) as eng:
        for iteration in range(2):
            loss = eng.forward_backward(x, labels=y, loss_fn=loss_fn)
            eng.synchronize()  # (the reference seeds the process's generator)
            expected = reference(ref, x, y, loss_fn, 2, seed=5, iteration=iteration)
            torch.testing.assert_close(loss, expected)
    for a, b in zip(_grads(layers), _grads(ref), strict=True):
        torch.testing.assert_close(a, b)


def test_rng_state_functions_are_torchs_own_outside_a_layer_and_the_layers_inside():
    """On a thread in no layer, ``torch.get_rng_state`` and the like read and
    set the process's generator; in a seeded layer, the layer's own (as if
    the process's had been seeded with the layer's seed before the call)."""
    rng = LayerRandomness(CPU, "probe")
    torch.manual_seed(1)
    assert torch.equal(torch.get_rng_state(), torch.default_generator.get_state())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        drawn = torch.rand(3)
    torch.manual_seed(2)
    torch.testing.assert_close(drawn, torch.rand(3))
    before = torch.default_generator.get_state()
    with rng(seed=7, training=True):
        state = torch.get_rng_state()
        first = torch.rand(3)
        with torch.random.fork_rng(devices=[]):
            forked = torch.rand(3)
        again = torch.rand(3)
        torch.set_rng_state(state)
        replayed = torch.rand(3)
    assert torch.equal(torch.default_generator.get_state(), before)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(replayed, expected)
    torch.testing.assert_close(forked, torch.rand(3))
    torch.testing.assert_close(again, forked)
    # a layer that draws in a fork only draws all the same: seeded
    rng = LayerRandomness(CPU, "forked")
    for _ in range(2):
        with rng(seed=7, training=True), torch.random.fork_rng(devices=[]):
            forked = torch.rand(3)
        assert rng.random == {True: True}
        torch.testing.assert_close(forked, expected)


class _CheckpointedLinear(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cp.checkpoint(self.inner, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_layers_own_checkpoint_leaves_the_callers_random_numbers_alone(reentrant):
    """(The recompute, on a worker's thread, set the process's generator to
    its forward's state and put it back afterwards: the numbers the caller's
    thread drew meanwhile were rewound, drawn again or lost.) Layers without
    random ops, the caller drawing while the workers compute."""
    torch.manual_seed(0)
    layers = [nn.Linear(256, 256), *(_CheckpointedLinear(reentrant) for _ in range(4))]
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    with RoundPipeEngine(layers, [CPU] * 2, 4, seed=1, watchdog_timeout=60) as eng:
        for _ in range(3):
            torch.manual_seed(123)
            drawn = []
            eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
            start = time.monotonic()
            while time.monotonic() - start < 0.3:
                drawn.append(torch.rand(1))
            eng.synchronize()
            torch.manual_seed(123)
            assert torch.equal(torch.cat(drawn), torch.rand(len(drawn)))


# ----------------------------------------------------------------- Lightning
QUIET = dict(
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
    return DataLoader(ds, batch_size=8)


class _Module(L.LightningModule):
    """A stack of blocks that checkpoint their dropout themselves."""

    def __init__(self, checkpointing: bool, reentrant: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(*_layers("dropout", reentrant, checkpointing))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: L.LightningModule, strategy, devices: int = 2) -> list[torch.Tensor]:
    L.seed_everything(0)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=4, **QUIET)
    trainer.fit(module, _data())
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_layers_own_checkpoint_with_dropout_trains_exactly_like_without(reentrant):
    """Under the strategy the dropout masks depend on (seed, iteration,
    layer, micro-batch) only: a model whose blocks checkpoint themselves
    trains exactly like the same model without the checkpoints."""
    runs = [
        _fit(
            _Module(checkpointing, reentrant),
            RoundPipeStrategy(async_optimizer=False, num_microbatches=2, seed=1),
        )
        for checkpointing in (False, True)
    ]
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

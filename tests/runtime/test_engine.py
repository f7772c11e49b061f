"""The engine computes exactly what plain single-device PyTorch computes."""

import copy
import gc
import threading
import time
import weakref

import pytest
import torch
from torch import nn

from lightning_roundpipe.plan import PlanError, StagePlan
from lightning_roundpipe.plan.decide import stage_peaks
from lightning_roundpipe.runtime import (
    EngineClosedError,
    RoundPipeEngine,
    WorkerError,
    estimate_costs,
)

from .models import lm_batch, lm_loss, mlp, reference, structured, transformer

CPU = torch.device("cpu")


def grads(layers):
    return [
        p.grad.clone() if p.grad is not None else None
        for layer in layers
        for p in layer.parameters()
    ]


def assert_grads_equal(a, b):
    ga, gb = grads(a), grads(b)
    assert len(ga) == len(gb)
    for x, y in zip(ga, gb, strict=True):
        if x is None or y is None:
            assert x is None and y is None
        else:
            torch.testing.assert_close(x, y)


def engine(layers, n, m, plan=None, **kw):
    kw.setdefault("watchdog_timeout", 60)
    return RoundPipeEngine(layers, [CPU] * n, m, plan=plan, **kw)


# -------------------------------------------------------------------- MLP
MLP_PLANS = [
    None,
    "|7|",
    "1,1,1,1,1,1|1|1,1,1,1,1,1",
    "4,2|1|3,3",
    "2,2,2|1|1,2,3",
    "6|1|6",
    "4,2|1|3,3|layered",
    "|7||layered",
]


@pytest.mark.parametrize("plan", MLP_PLANS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_mlp_matches_plain_full_batch_training(plan, n):
    layers = mlp()
    ref = copy.deepcopy(layers)
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    expected = nn.functional.mse_loss(nn.Sequential(*ref)(x), y)
    expected.backward()
    with engine(layers, n, 4, plan) as eng:
        loss = eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
    torch.testing.assert_close(loss, expected.detach())
    assert_grads_equal(layers, ref)


@pytest.mark.parametrize(("batch", "m"), [(12, 4), (13, 4), (7, 5), (9, 9)])
def test_microbatches_that_do_not_divide_the_batch(batch, m):
    layers = mlp()
    ref = copy.deepcopy(layers)
    x, y = torch.randn(batch, 8), torch.randn(batch, 4)

    def per_sample_sum(out, lab):  # a loss whose full-batch mean we can match exactly
        return ((out - lab) ** 2).sum(dim=1).mean()

    expected = per_sample_sum(nn.Sequential(*ref)(x), y)
    expected.backward()
    with engine(layers, 3 if m >= 3 else 1, m, "2,2,2|1|1,2,3") as eng:
        loss = eng.forward_backward(x, labels=y, loss_fn=per_sample_sum)
        eng.synchronize()
    torch.testing.assert_close(loss, expected.detach())
    assert_grads_equal(layers, ref)


# ------------------------------------------------------------ transformer
TRANSFORMER_PLANS = [
    None,
    "|6|",
    "1,1,1,1,1|1|1,1,1,1,1",
    "3,2|1|2,2,1",
    "2,3|1|1,1,3",
    "1,2|3|1,2",
    "1,2|3|1,2|layered",
    "3,2|1|2,3|layered",
]


@pytest.mark.parametrize("plan", TRANSFORMER_PLANS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_transformer_with_dropout_matches_seeded_reference(plan, n):
    layers = transformer()
    ref = copy.deepcopy(layers)
    ids, labels = lm_batch(10)
    expected = reference(ref, ids, labels, lm_loss, 5, seed=7)
    with engine(layers, n, 5, plan, seed=7) as eng:
        loss = eng.forward_backward(ids, labels=labels, loss_fn=lm_loss)
        eng.synchronize()
    torch.testing.assert_close(loss, expected)
    assert_grads_equal(layers, ref)


def test_the_default_generators_state_is_read_by_one_thread_without_collection(monkeypatch):
    """PyTorch's ``get_state`` holds the generator's mutex while it allocates
    the state tensor; a garbage collection there can hand the GIL to another
    worker that then waits for the mutex: a whole-process deadlock (seen once
    on CPU workers, around every layer call). So every read goes through
    ``generator_state``: under the device's RNG lock, collector paused."""
    import gc

    from lightning_roundpipe.runtime import device as dev

    seen = []

    class Probe:  # (a generator whose get_state reports the conditions)
        device = torch.device("cpu")

        def get_state(self):
            seen.append((gc.isenabled(), dev._rng_lock(self.device)._is_owned()))
            return torch.zeros(1, dtype=torch.uint8)

    assert gc.isenabled()
    dev.generator_state(Probe())
    assert seen == [(False, True)] and gc.isenabled()
    # the layers of a CPU worker read the default generator only that way
    reads = []
    real = dev.generator_state
    monkeypatch.setattr(dev, "generator_state", lambda g: reads.append(g) or real(g))
    layers = mlp()
    with engine(layers, 2, 2, "4|3|4") as eng:
        eng.forward_backward(
            torch.randn(4, 8), labels=torch.randn(4, 4), loss_fn=nn.functional.mse_loss
        )
        eng.synchronize()
    assert reads and all(g is torch.default_generator for g in reads)


def test_dropout_results_do_not_depend_on_device_count_or_plan():
    ids, labels = lm_batch(8)
    results = []
    for n, plan in [
        (1, "|6|"),
        (4, "1,1,1,1,1|1|1,1,1,1,1"),
        (2, "3,2|1|2,2,1"),
        (3, None),
        (2, "3,2|1|3,2|layered"),
        (1, "3,2|1|3,2|rewalk"),
    ]:
        layers = transformer(dropout=0.3)
        with engine(layers, n, 4, plan, seed=3) as eng:
            for _ in range(2):  # second iteration: new masks, still device-independent
                loss = eng.forward_backward(ids, labels=labels, loss_fn=lm_loss)
            eng.synchronize()
        results.append((loss, grads(layers)))
    for loss, g in results[1:]:
        torch.testing.assert_close(loss, results[0][0])
        for a, b in zip(g, results[0][1], strict=True):
            torch.testing.assert_close(a, b)


def test_attention_without_dropout_does_not_make_a_layer_random():
    """CPU attention is tagged as a random op even without dropout; counted as
    random, every Hugging Face block ran in the seeding dispatch mode for
    good, at about twice its compute time. In a layer with no dropout rate an
    attention call with ``dropout_p=0`` does not count; in one with a rate a
    tagged call counts whatever it drew (a call may draw nothing, a later
    one will)."""
    from lightning_roundpipe.runtime.device import LayerRandomness, draws_random

    q = torch.randn(2, 2, 8, 4)

    class Attention(nn.Module):
        def __init__(self, rate: float) -> None:
            super().__init__()
            self.attention_dropout = rate

        def forward(self, x: torch.Tensor, p: float) -> torch.Tensor:
            return nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=p)

    for rate, p, random in ((0.0, 0.0, False), (0.5, 0.5, True), (0.5, 0.0, True)):
        layer = Attention(rate)
        rng = LayerRandomness(torch.device("cpu"), "attention", draws_random(layer, any_mode=True))
        with rng(seed=7, training=True):
            out = layer(q, p)
        assert rng.random == {True: random}, (rate, p)
        torch.manual_seed(7)  # as if the default generator had been seeded so
        torch.testing.assert_close(out, layer(q, p))
    layer = Attention(0.0)  # (a layer whose rate is unknown counts every tagged call)
    rng = LayerRandomness(torch.device("cpu"), "attention")
    with rng(seed=7, training=True):
        layer(q, 0.0)
    assert rng.random == {True: True}


class _Sometimes(nn.Module):
    """Dropout on inputs whose mean is positive only: randomness that depends
    on the data (its first calls draw nothing)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, 0.5, self.training) if x.mean() > 0 else x


@pytest.mark.parametrize("plan", ["2|1|2", "|3|", "1,1|1|1,1"])
def test_randomness_that_depends_on_the_data_is_seeded_once_seen(plan):
    """A layer that drew nothing runs untouched; the check that the default
    generator did not move (once per stage and micro-batch) sees its first
    draw and seeds it from then on: the next iteration equals the seeded
    reference."""
    torch.manual_seed(0)
    layers = [_Sometimes(), nn.Linear(8, 8), nn.Linear(8, 8)]
    ref = copy.deepcopy(layers)
    low, high = -torch.rand(4, 8), torch.rand(4, 8)
    y = torch.randn(4, 8)
    loss_fn = nn.functional.mse_loss
    with engine(layers, 2, 2, plan, seed=3) as eng:
        for x in (low, high, high):  # nothing drawn, the first draw, seeded
            loss = eng.forward_backward(x, labels=y, loss_fn=loss_fn)
        eng.synchronize()
        assert eng.iteration == 3
    for p in ref[1].parameters():  # (the reference's gradients: not compared)
        p.requires_grad_(False)
    expected = reference(ref, high, y, loss_fn, 2, seed=3, iteration=2)
    torch.testing.assert_close(loss, expected)
    assert not torch.equal(loss, reference(ref, high, y, loss_fn, 2, seed=3, iteration=1))


def test_a_workers_first_call_is_seeded_whatever_another_workers_drew():
    """Micro-batch 0 (no draw) and 1 (a draw) run on two workers, one
    micro-batch per round: the second worker's first call of the layer must
    run in the seeding mode although the first worker's drew nothing."""
    for trial in range(3):
        torch.manual_seed(trial)
        layers = [_Sometimes(), nn.Linear(8, 8), nn.Linear(8, 8)]
        ref = copy.deepcopy(layers)
        x, y = torch.cat([-torch.rand(2, 8), torch.rand(2, 8)]), torch.randn(4, 8)
        loss_fn = nn.functional.mse_loss
        with engine(layers, 2, 2, "1|2|1", seed=3, microbatches_per_round=1) as eng:
            loss = eng.forward_backward(x, labels=y, loss_fn=loss_fn)
            eng.synchronize()
        torch.testing.assert_close(loss, reference(ref, x, y, loss_fn, 2, seed=3))
        assert_grads_equal(layers, ref)


def test_no_dropout_transformer_matches_plain_full_batch():
    layers = transformer(dropout=0.0)
    for m in layers[0].modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    ref = copy.deepcopy(layers)
    ids, labels = lm_batch(8)
    expected = lm_loss(nn.Sequential(*ref)(ids), labels)
    expected.backward()
    with engine(layers, 3, 4, "2,2|2|1,1,2") as eng:
        loss = eng.forward_backward(ids, labels=labels, loss_fn=lm_loss)
        eng.synchronize()
    torch.testing.assert_close(loss, expected.detach())
    assert_grads_equal(layers, ref)


# ------------------------------------------ parameters no backward reaches
class _Gated(nn.Module):
    """A linear layer, and a gate whose weights only pick a branch (no
    gradient flows to them, as to a sparse-attention indexer's), beside a
    parameter the forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.gate = nn.Linear(16, 1)
        self.spare = nn.Parameter(torch.ones(3))

    def forward(self, x):
        h = self.linear(x)
        return h if self.gate.weight.sum() > 0 else -h


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_parameters_no_backward_reaches_keep_no_gradient(precision):
    """As under autograd, a trainable parameter the loss does not depend on
    keeps ``.grad`` None (an optimizer then skips it, AdamW's weight decay
    included); it got zeros, the stage's share of the flat gradient buffer."""
    layers = mlp()
    layers[2] = _Gated()
    ref = copy.deepcopy(layers)
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    nn.functional.mse_loss(nn.Sequential(*ref)(x), y).backward()
    assert ref[2].gate.weight.grad is None and ref[2].spare.grad is None
    with engine(layers, 2, 4, "2,3|2|3,2", precision=precision) as eng:
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
        assert layers[2].linear.weight.grad is not None
        assert layers[2].gate.weight.grad is None and layers[2].spare.grad is None
    if precision == "32-true":
        assert_grads_equal(layers, ref)


# ------------------------------------------------------- frozen parameters
def test_frozen_parameters_get_no_gradient_or_buffer():
    layers = transformer()
    for layer in (layers[0], layers[1]):
        layer.requires_grad_(False)
    layers[3].ln1.requires_grad_(False)
    ref = copy.deepcopy(layers)
    ids, labels = lm_batch(8)
    expected = reference(ref, ids, labels, lm_loss, 4)
    with engine(layers, 2, 4, "2,3|1|1,2,2") as eng:
        loss = eng.forward_backward(ids, labels=labels, loss_fn=lm_loss)
        eng.synchronize()
        frozen = [p for p in eng._host.params if not p.param.requires_grad]
        assert frozen and all(p.grad is None for p in frozen)
    torch.testing.assert_close(loss, expected)
    assert_grads_equal(layers, ref)
    assert all(p.grad is None for p in layers[0].parameters())


# ------------------------------------------------- tuple / dict activations
@pytest.mark.parametrize(
    "plan", [None, "1,1,1,1,1|1|1,1,1,1,1", "2,3|1|3,2", "|6|", "2,3|1|3,2|layered"]
)
@pytest.mark.parametrize("n", [1, 3])
def test_tuple_and_dict_activations(plan, n):
    layers = structured()
    ref = copy.deepcopy(layers)
    ids, labels = lm_batch(6)
    scale = torch.linspace(0.5, 1.5, 6)
    expected = reference(ref, (ids, scale), labels, lm_loss, 3)
    with engine(layers, n, 3, plan) as eng:
        loss = eng.forward_backward((ids, scale), labels=labels, loss_fn=lm_loss)
        eng.synchronize()
    torch.testing.assert_close(loss, expected)
    assert_grads_equal(layers, ref)


class LossHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.lin(x).squeeze(-1), y)


class DictPass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y):
        return {"x": torch.tanh(self.lin(x)), "y": y}


def test_last_layer_returns_the_loss_with_dict_inputs():
    """A dict activation is passed as keyword arguments to the next layer."""
    torch.manual_seed(0)
    layers = [DictPass(), DictPass(), DictPass(), LossHead()]
    ref = copy.deepcopy(layers)
    batch = {"x": torch.randn(8, 8), "y": torch.randn(8)}
    h = batch
    for layer in ref:
        h = layer(**h)
    expected = h
    expected.backward()
    with engine(layers, 2, 4, "1,2|1|1,2") as eng:
        loss = eng.forward_backward(batch)
        eng.synchronize()
    torch.testing.assert_close(loss, expected.detach())
    assert_grads_equal(layers, ref)


# ------------------------------------------------------- steps, accumulation
def test_two_calls_accumulate_like_two_backward_passes_and_step_updates():
    layers = mlp()
    ref = copy.deepcopy(layers)
    opt_ref = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1, momentum=0.9)
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.1, momentum=0.9)
    data = [(torch.randn(8, 8), torch.randn(8, 4)) for _ in range(6)]
    with engine(layers, 3, 4, "3,3|1|2,2,2") as eng:
        for step in range(3):
            for x, y in data[2 * step : 2 * step + 2]:
                nn.functional.mse_loss(nn.Sequential(*ref)(x), y).backward()
                eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
            eng.synchronize()
            assert_grads_equal(layers, ref)
            opt_ref.step()
            opt_ref.zero_grad()
            eng.step(opt.step)
            opt.zero_grad()
    for a, b in zip(
        nn.Sequential(*layers).parameters(), nn.Sequential(*ref).parameters(), strict=True
    ):
        torch.testing.assert_close(a, b)


def test_loss_is_returned_before_backward_stages_finish():
    """forward_backward returns once losses are known; synchronize drains the rest."""
    gate = threading.Event()

    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            out = self.lin(x)
            if out.requires_grad:  # the backward stage: hold its backward at the gate
                out.register_hook(lambda g: g if gate.wait(30) else None)
            return out

    torch.manual_seed(0)
    layers = [Gate(), nn.Linear(8, 8), nn.Linear(8, 1)]
    with engine(layers, 2, 2, "1,1|1|2") as eng:
        loss = eng.forward_backward(
            torch.randn(4, 8), labels=torch.randn(4, 1), loss_fn=nn.functional.mse_loss
        )
        assert torch.isfinite(loss)
        assert eng._rt.done < eng._rt.submitted  # B2 is still blocked in recompute
        gate.set()
        eng.synchronize()
        assert layers[0].lin.weight.grad is not None


def test_batchnorm_running_stats_round_trip_once_per_microbatch():
    torch.manual_seed(0)
    layers = [
        nn.Linear(4, 8),
        nn.BatchNorm1d(8),
        nn.ReLU(),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8),
        nn.Linear(8, 1),
    ]
    ref = copy.deepcopy(layers)
    x, y = torch.randn(12, 4), torch.randn(12, 1)
    expected = reference(ref, x, y, nn.functional.mse_loss, 3)
    with engine(layers, 3, 3, "2,3|1|1,2,2") as eng:
        loss = eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
    torch.testing.assert_close(loss, expected)
    assert_grads_equal(layers, ref)
    for a, b in ((layers[1], ref[1]), (layers[4], ref[4])):
        torch.testing.assert_close(a.running_mean, b.running_mean)
        torch.testing.assert_close(a.running_var, b.running_var)
        assert int(a.num_batches_tracked) == int(b.num_batches_tracked) == 3


def test_tied_weights_across_layers_accumulate_into_one_gradient():
    class TiedHead(nn.Module):
        def __init__(self, emb):
            super().__init__()
            self.emb = emb

        def forward(self, h):
            return h @ self.emb.weight.t()

    torch.manual_seed(0)
    emb = nn.Embedding(11, 6)
    layers = [emb, nn.Linear(6, 6), TiedHead(emb)]
    ref = copy.deepcopy(nn.ModuleList(layers))
    ids = torch.randint(0, 11, (4, 3))
    labels = torch.randint(0, 11, (4, 3))

    def ce(out, lab):
        return nn.functional.cross_entropy(out.reshape(-1, 11), lab.reshape(-1))

    expected = ce(nn.Sequential(*ref)(ids), labels)
    expected.backward()
    with engine(layers, 2, 2, "1,1|1|1,1") as eng:
        eng.forward_backward(ids, labels=labels, loss_fn=ce)
        eng.synchronize()
        assert len(eng._host.params) == 3  # embedding weight counted once
    torch.testing.assert_close(emb.weight.grad, ref[0].weight.grad)


def test_bf16_compute_runs_close_to_fp32():
    layers = mlp()
    ref = copy.deepcopy(layers)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    expected = nn.functional.mse_loss(nn.Sequential(*ref)(x), y)
    expected.backward()
    with engine(layers, 2, 2, "3,3|1|2,2,2", precision="bf16-mixed") as eng:
        loss = eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
        assert eng._host.params[0].master.dtype == torch.bfloat16
    torch.testing.assert_close(loss, expected.detach(), atol=3e-2, rtol=3e-2)
    for a, b in zip(grads(layers), grads(ref), strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


def test_state_dict_keys_unchanged():
    layers = transformer()
    before = list(nn.ModuleList(layers).state_dict().keys())
    with engine(layers, 2, 2) as eng:
        ids, labels = lm_batch(4)
        eng.forward_backward(ids, labels=labels, loss_fn=lm_loss)
        eng.step()
    assert list(nn.ModuleList(layers).state_dict().keys()) == before


class SlowFirstRow(nn.Module):
    """Identity that sleeps on the micro-batch whose first value is the
    marker (its round then finishes after later ones on other devices)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x[0, 0].item() == 100.0:
            time.sleep(0.2)
        return x


@pytest.mark.parametrize("plan", ["|8|", "5|3|3,2"])
def test_gradient_sums_do_not_depend_on_which_device_finished_first(plan):
    """fp32 addition is not associative: the rounds' partial sums of a
    parameter's gradient are added on the host in micro-batch order, so a
    round that finishes late (micro-batch 0's, slow here) changes no bit, and
    runs on 1, 2 and 3 devices with the same rounds are bitwise equal."""
    torch.manual_seed(3)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    x[0, 0] = 100.0

    def run(n):
        layers = [SlowFirstRow(), *mlp()]
        with engine(layers, n, 6, plan, microbatches_per_round=1) as eng:
            eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
            eng.synchronize()
        return grads(layers)

    one = run(1)
    for n in (2, 3):
        for a, b in zip(run(n), one, strict=True):
            assert torch.equal(a, b)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"num_microbatches": 0}, PlanError, r"num_microbatches must be an integer >= 1, got 0"),
        ({"plan": "3|1|3"}, PlanError, "covers 4 layers .* but the model has 7"),
        ({"devices": []}, ValueError, "devices is empty"),
        ({"devices": ["meta"]}, ValueError, "device meta is not supported"),
        (
            {"precision": "64-true"},
            ValueError,
            "precision '64-true' is not supported; use one of '32-true'",
        ),
        (
            {"microbatches_per_round": 0},
            PlanError,
            r"microbatches_per_round must be an integer >= 1, 'auto' or None, got 0",
        ),
        ({"activation_memory": 0}, ValueError, r"activation_memory must be a positive number"),
        ({"placement": "random"}, ValueError, r"placement must be 'free-first' or 'rotate'"),
    ],
)
def test_constructor_errors_leave_the_model_untouched(kwargs, exc, match):
    layers = mlp()
    before = [p.detach().clone() for m in layers for p in m.parameters()]
    args = {"devices": [CPU] * 2, "num_microbatches": 4}
    args.update(kwargs)
    threads = threading.active_count()
    with pytest.raises(exc, match=match):
        RoundPipeEngine(layers, **args)
    assert threading.active_count() == threads
    for a, b in zip(before, [p for m in layers for p in m.parameters()], strict=True):
        assert torch.equal(a, b)


def test_batch_errors():
    with engine(mlp(), 2, 4) as eng:
        with pytest.raises(
            ValueError,
            match=r"batch size \(3\) is smaller than "
            r"num_microbatches \(4\); use a larger batch, lower num_microbatches, or drop a short "
            r"last batch \(drop_last=True in the DataLoader\)",
        ):
            eng.forward_backward(
                torch.randn(3, 8), labels=torch.randn(3, 4), loss_fn=nn.functional.mse_loss
            )
        with pytest.raises(ValueError, match="contain no tensor with a batch dimension"):
            eng.forward_backward(torch.tensor(1.0))
        with pytest.raises(ValueError, match=r"loss_weights has 2 entries; give one per"):
            eng.forward_backward(
                torch.randn(8, 8),
                labels=torch.randn(8, 4),
                loss_fn=nn.functional.mse_loss,
                loss_weights=[1, 1],
            )


class Boom(nn.Module):
    def __init__(self, when):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.when = when

    def forward(self, x):
        if self.when(x):
            raise ValueError("boom")
        return self.lin(x)


def test_a_failure_in_an_evaluation_pass_says_so():
    """Evaluation calls are numbered apart from training (negative, inside):
    the message names an evaluation pass, not an iteration of -1."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), Boom(lambda x: True), nn.Linear(8, 1)]
    eng = engine(layers, 2, 2, "2|1|2")
    try:
        with torch.no_grad(), pytest.raises(WorkerError, match=r"an evaluation pass: ValueError"):
            eng.forward(torch.randn(4, 8))
    finally:
        eng.close()


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize(("where", "stage"), [("forward", "F2"), ("recompute", "B2")])
def test_layer_failure_reaches_the_caller_with_context(n, where, stage):
    def when(x):
        grad = torch.is_grad_enabled()
        return (where == "forward" and not grad) or (where == "recompute" and grad)

    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), Boom(when), nn.Linear(8, 8), nn.Linear(8, 1)]
    eng = engine(layers, n, 3, "1,2|1|2,1")
    try:
        with pytest.raises(
            WorkerError,
            match=rf"failed in stage {stage} .*micro-batch 0.*"
            r"iteration 0: ValueError: boom",
        ) as info:
            eng.forward_backward(
                torch.randn(6, 8), labels=torch.randn(6, 1), loss_fn=nn.functional.mse_loss
            )
            eng.synchronize()
        assert info.value.stage == stage and info.value.microbatch == 0
        assert isinstance(info.value.__cause__, ValueError)
        with pytest.raises(WorkerError):  # the engine stays failed
            eng.synchronize()
    finally:
        eng.close()
    with pytest.raises(EngineClosedError, match="closed after a failure"):
        eng.synchronize()


def test_bad_loss_is_reported():
    eng = engine(mlp(), 1, 2)
    try:
        with pytest.raises(
            WorkerError,
            match="loss_fn must return a scalar loss tensor, got a "
            r"tensor of shape \(2, 4\)",
        ):
            eng.forward_backward(
                torch.randn(4, 8), labels=torch.randn(4, 4), loss_fn=lambda out, lab: out - lab
            )
    finally:
        eng.close()


def test_forward_backward_gives_the_loss_functions_outputs_back():
    """with_outputs: loss_fn returns (loss, output); the outputs of every
    micro-batch come back, put together along the batch, without gradient,
    and the loss is the weighted micro-batch losses' sum, as without them."""
    torch.manual_seed(0)
    layers = mlp()
    ref = copy.deepcopy(layers)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    eng = engine(layers, 2, 3)
    try:

        def loss_fn(out, lab):
            return nn.functional.mse_loss(out, lab), out * 2

        loss, outs = eng.forward_backward(x, labels=y, loss_fn=loss_fn, with_outputs=True)
        eng.synchronize()
        with pytest.raises(WorkerError, match=r"loss_fn must return \(loss, output\), got Tensor"):
            eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss, with_outputs=True)
    finally:
        eng.close()
    expected = nn.Sequential(*ref)(x)
    torch.testing.assert_close(outs, expected.detach() * 2)
    assert not outs.requires_grad
    torch.testing.assert_close(loss, nn.functional.mse_loss(expected, y).detach())


def test_closed_engine_refuses_work_and_threads_are_joined():
    before = threading.active_count()
    eng = engine(mlp(), 4, 4)
    assert threading.active_count() == before + 8  # a worker and its courier per device
    eng.close()
    eng.close()  # idempotent
    assert threading.active_count() == before
    with pytest.raises(EngineClosedError, match="closed; create a new one"):
        eng.forward_backward(torch.randn(4, 8))


def test_garbage_collected_engine_stops_its_threads():
    before = threading.active_count()
    eng = engine(mlp(), 3, 3)
    eng.forward_backward(
        torch.randn(6, 8), labels=torch.randn(6, 4), loss_fn=nn.functional.mse_loss
    )
    eng.synchronize()
    del eng
    gc.collect()
    assert threading.active_count() == before


def test_partitioner_plan_from_size_estimates_is_used():
    layers = transformer(num_blocks=6)
    with engine(layers, 4, 8) as eng:
        assert isinstance(eng.plan, StagePlan)
        assert eng.plan.num_layers == 8
        mem = eng.host_memory()
        assert mem["master"] > 0 and mem["grad"] > 0 and mem["pinned"] == 0


def test_a_closed_engine_kept_alive_holds_no_copy_of_the_model():
    # an autograd graph or a traceback may keep a closed engine referenced
    layers = transformer(num_blocks=2)
    eng = engine(layers, 2, 2)
    ids, labels = lm_batch(4)
    eng.forward_backward(ids, labels=labels, loss_fn=lm_loss)
    eng.close()
    mem = eng.host_memory()
    assert mem["master"] == 0 and mem["grad"] == 0 and mem["pinned"] == 0
    assert all(p.numel() > 0 for layer in layers for p in layer.parameters())


@pytest.mark.parametrize("async_optimizer", [False, True])
@pytest.mark.parametrize("plan", ["|7|", "4,2|1|3,3"])
def test_a_stages_gradients_are_not_kept_once_added(monkeypatch, plan, async_optimizer):
    """Each stage's fp32 gradients come down in one buffer (on CUDA a
    page-locked one); once the courier has added them into the host buffers,
    nothing may keep it. A courier that kept its last gradient referenced made
    every CUDA download pin a second buffer while the first lived on: on an
    H200, 3.6 s of cudaHostAlloc in a warm-up step and 8.6 GB of page-locked
    memory more for Qwen3-1.7B."""
    from lightning_roundpipe.runtime import worker

    made = []
    original = worker.Worker._accumulators

    def spy(self, params, weights):
        acc, hooks = original(self, params, weights)
        if acc is not None:
            made.append(weakref.ref(acc))
        return acc, hooks

    monkeypatch.setattr(worker.Worker, "_accumulators", spy)
    layers = mlp()
    opt = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=0.1)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with engine(layers, 2, 4, plan, async_optimizer=async_optimizer) as eng:
        for _ in range(3):
            eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
            eng.step(opt.step)
        eng.synchronize()
        # a worker's stage frame may let go of its buffer just after the step
        # is synchronized; the old courier kept one alive for good
        deadline = time.monotonic() + 5.0
        while True:
            gc.collect()
            alive = [r for r in made if r() is not None]
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert made and alive == []


def test_memory_guard_names_the_layer_that_cannot_fit():
    from lightning_roundpipe.runtime import estimate_costs
    from lightning_roundpipe.runtime.device import stage_memory_limit

    layers = mlp()
    costs = estimate_costs(layers, torch.float32)
    with pytest.raises(
        PlanError,
        match=r"layer 0 needs about 1152 bytes of device memory "
        r"\(weights and gradients\) but a stage may use 1000 bytes on cuda:0; "
        "even one layer at a time does not fit. Raise device_memory_limit",
    ):
        stage_memory_limit([torch.device("cuda", 0)], costs, 1000)
    assert stage_memory_limit([CPU], costs, None) is None
    assert stage_memory_limit([torch.device("cuda", 0)], costs, 10**6) == 10**6


def test_mixed_device_types_are_refused():
    from lightning_roundpipe.runtime.device import check_uniform

    with pytest.raises(ValueError, match="devices mix cpu and cuda; random numbers"):
        check_uniform([CPU, torch.device("cuda", 0)])
    check_uniform([CPU, CPU])


@pytest.mark.parametrize("n", [1, 3])
def test_forward_only_matches_plain_forward_in_eval_mode(n):
    layers = transformer()
    ref = copy.deepcopy(layers)
    for m in layers + ref:
        m.eval()
    ids, _ = lm_batch(10)
    with engine(layers, n, 5, "2,2|2|1,1,2") as eng:
        out = eng.forward(ids)
        again = eng.forward(ids)
    with torch.no_grad():
        expected = nn.Sequential(*ref)(ids)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(again, expected)
    assert all(p.grad is None for m in layers for p in m.parameters())


def test_loss_outside_the_pipeline_via_output_gradients():
    """forward() then forward_backward() with the output gradient as labels
    (same reserved iteration, so dropout masks match) equals plain training."""
    layers = transformer()
    ref = copy.deepcopy(layers)
    ids, labels = lm_batch(8)
    expected = reference(ref, ids, labels, lm_loss, 4, seed=2, iteration=0)

    with engine(layers, 2, 4, "2,3|1|1,2,2", seed=2) as eng:
        it = eng.reserve_iteration()
        logits = eng.forward(ids, iteration=it).requires_grad_(True)
        # the user's loss, computed outside the model on the whole batch
        per_mb = [lm_loss(lg, lb) for lg, lb in zip(logits.chunk(4), labels.chunk(4), strict=True)]
        loss = sum(per_mb) / 4
        loss.backward()
        eng.forward_backward(
            ids,
            labels=logits.grad,
            iteration=it,
            loss_fn=lambda out, g: (out * g).sum(),
            loss_weights=[1.0] * 4,
        )
        eng.synchronize()
    torch.testing.assert_close(loss.detach(), expected)
    assert_grads_equal(layers, ref)


def test_ordered_calls_run_after_the_queued_step():
    layers = mlp()
    order = []
    with engine(layers, 2, 2, async_optimizer=True) as eng:
        eng.forward_backward(
            torch.randn(4, 8), labels=torch.randn(4, 4), loss_fn=nn.functional.mse_loss
        )
        eng.step(lambda: order.append("step"))
        h = eng.call(lambda: order.append("zero_grad") or "done")
        assert h.wait().result == "done"
        eng.synchronize()
    assert order == ["step", "zero_grad"]


def test_fit_to_batch_splits_a_short_batch_into_single_samples():
    layers = mlp()
    ref = copy.deepcopy(layers)
    x, y = torch.randn(3, 8), torch.randn(3, 4)
    expected = nn.functional.mse_loss(nn.Sequential(*ref)(x), y)
    expected.backward()
    with engine(layers, 2, 6, fit_to_batch=True) as eng:
        assert eng.microbatches_for(3) == 3 and eng.microbatches_for(10) == 6
        loss = eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
        assert_grads_equal(layers, ref)
        torch.testing.assert_close(loss, expected.detach())
    with (
        engine(mlp(), 2, 6) as eng,
        pytest.raises(
            ValueError, match=r"batch size \(3\) is smaller than num_microbatches \(6\); use"
        ),
    ):
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)


@pytest.mark.parametrize("n", [2, 3])
def test_fewer_microbatches_than_devices(n):
    """A one-sample batch (the last of an epoch) trains on several devices, and
    evaluation with a batch of one runs: some devices simply idle."""
    layers = mlp()
    ref = copy.deepcopy(layers)
    x, y = torch.randn(1, 8), torch.randn(1, 4)
    expected = nn.functional.mse_loss(nn.Sequential(*ref)(x), y)
    expected.backward()
    with engine(layers, n, 4, fit_to_batch=True) as eng:
        loss = eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
        assert eng.last_schedule.num_microbatches == 1
        torch.testing.assert_close(loss, expected.detach())
        assert_grads_equal(layers, ref)
        with torch.no_grad():
            out = eng.forward(x)
            torch.testing.assert_close(out, nn.Sequential(*layers)(x))
    with engine(mlp(), n, 4, plan="3,3|1|2,2,2") as eng, torch.no_grad():  # no fit_to_batch
        torch.testing.assert_close(eng.forward(x), nn.Sequential(*eng.layers)(x))


@pytest.mark.parametrize(
    ("precision", "big", "small"), [("bf16-mixed", 1.0, 0.004), ("16-mixed", 0.25, 0.001)]
)
def test_low_precision_gradients_accumulate_in_fp32(precision, big, small):
    """One sample adds ``big`` to the weight's gradient, fifteen add ``small``
    each: a running sum in bf16 (fp16 under its 2^16 loss scale) would round
    each ``small`` to a step of the sum's precision (percent off). Accumulated in
    fp32, the result is the same for any round size and for any number of
    micro-batches, up to one rounding of each micro-batch's own gradient."""
    x = torch.full((16, 1), small)
    x[0] = big

    def grad(m, round_size):
        layer = nn.Linear(1, 1, bias=False)
        nn.init.ones_(layer.weight)
        with RoundPipeEngine(
            [layer],
            [CPU],
            m,
            precision=precision,
            microbatches_per_round=round_size,
            profile_iterations=0,
        ) as eng:
            # the batch's mean over samples (a sum would make fp16's upstream
            # gradient the loss scale itself, past fp16's range)
            eng.forward_backward(x, labels=None, loss_fn=lambda out, _: out.float().mean())
            eng.synchronize()
            scale = eng.scaler.scale if precision == "16-mixed" else 1.0
            return layer.weight.grad.item() / scale

    exact = (big + 15 * small) / 16
    by_round = [grad(16, r) for r in (1, 4, 16)]
    for g in by_round:
        torch.testing.assert_close(g, by_round[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(by_round[0], exact, rtol=3e-3, atol=0)
    # one micro-batch: the device sums the samples itself, then rounds once
    torch.testing.assert_close(grad(1, None), exact, rtol=1e-2, atol=0)


def test_one_device_moves_each_stages_weights_once_per_iteration():
    """The default round is the whole batch: 8 micro-batches on one device move
    each stage's weights up once and its fp32 gradients down once per
    iteration; rounds of one micro-batch move them 8 times. CPU workers count
    the bytes a device would move."""
    plan = StagePlan.parse("3,3|1|2,2,2")
    weight_bytes = sum(p.numel() * 4 for layer in mlp() for p in layer.parameters())

    def report(**kw):
        with engine(mlp(), 1, 8, plan, **kw) as eng:
            for _ in range(2):
                eng.forward_backward(
                    torch.randn(8, 8), labels=torch.randn(8, 4), loss_fn=nn.functional.mse_loss
                )
                eng.step()
            eng.synchronize()
            return eng.traffic_report()

    once = report()
    assert once.rounds == 1 and once.round.round_size == 8
    # every layer is in one forward and one backward (or the fused) stage; a
    # stage goes up as one copy of its arena range (tensors 512-byte aligned)
    raw = 2 * weight_bytes - plan_bytes(plan, "fused")
    tensors = 2 * sum(1 for layer in mlp() for _ in layer.parameters())
    assert raw <= once.weights_minimum <= raw + 512 * tensors
    assert once.moved["weights_up"] == once.weights_minimum
    assert once.moved["grads_down"] == once.grads_minimum == weight_bytes
    assert "1.00x the minimum" in str(once)
    each = report(microbatches_per_round=1)
    assert each.rounds == 8
    assert each.moved["weights_up"] == 8 * each.weights_minimum
    assert each.moved["grads_down"] == 8 * each.grads_minimum
    assert each.moved["acts_down"] == once.moved["acts_down"]  # activations move anyway


def plan_bytes(plan, kind):
    layers = mlp()
    st = next(s for s in plan.stages if s.kind == kind)
    return sum(p.numel() * 4 for layer in layers[st.start : st.stop] for p in layer.parameters())


def test_a_round_larger_than_the_batch_says_what_was_given_and_what_is_used():
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    with engine(mlp(), 2, 4, "3,3|1|2,2,2", microbatches_per_round=5) as eng:
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
        assert eng.round.round_size == 4
        assert eng.round.reason == (
            "microbatches_per_round=5 given, 4 used (the batch has 4 micro-batches)"
        )
    with engine(mlp(), 2, 4, "3,3|1|2,2,2", microbatches_per_round=2) as eng:
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
        assert eng.round.reason == "microbatches_per_round=2 as given"


def test_rounds_shrink_to_fit_the_activation_budget():
    # one sample's stage-boundary values, measured in the first iteration,
    # bound the round from the second on
    plan = StagePlan.parse("3,3|1|2,2,2")
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with engine(mlp(), 2, 8, plan, activation_memory=1) as eng:
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
        # nothing known yet: the whole batch bounds the round (here the simulator
        # prefers rounds of 4, one per device pair: the head's slot on both)
        assert "whole batch (activation size not known yet)" in eng.round.reason
        assert eng.last_schedule.num_rounds == 8 // eng.round.round_size
        per_sample = eng._boundary_per_sample
        assert per_sample > 0
    budget = int(3 * per_sample)
    ref = mlp()
    expected = nn.functional.mse_loss(nn.Sequential(*ref)(x), y)
    expected.backward()
    layers = mlp()
    with engine(layers, 2, 8, plan, activation_memory=budget) as eng:
        for _ in range(2):
            loss = eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
            eng.zero_grad()
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
        assert eng.round.round_size == 3
        assert eng.last_schedule.num_rounds == 3  # 3 + 3 + 2 micro-batches
        assert "3 of 8 micro-batches per round" in eng.round.reason
        torch.testing.assert_close(loss, expected.detach())
        assert_grads_equal(layers, ref)
    # an estimate bounds the first iteration already
    with engine(
        mlp(),
        2,
        8,
        plan,
        activation_memory=budget,
        activation_estimate=lambda mb: int(per_sample / 3) + 1,
    ) as eng:
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        assert eng.last_schedule.num_rounds > 1


def test_evaluation_calls_between_steps_keep_the_running_statistics_order():
    """Ordered tasks (layers with running statistics) wait for the previous
    round of their slot; many forward-only calls in between (a validation loop)
    must not make the engine forget what they wait for."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)]
    ref = copy.deepcopy(layers)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with engine(layers, 2, 4, "1,1|1|1,1", microbatches_per_round=2, watchdog_timeout=20) as eng:
        for _ in range(2):
            eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
            for layer in layers:
                layer.eval()
            with torch.no_grad():
                for _ in range(6):
                    eng.forward(x)
            for layer in layers:
                layer.train()
        eng.synchronize()
    for _ in range(2):  # the same running-statistics updates, micro-batch by micro-batch
        for j in range(4):
            nn.Sequential(*ref)(x[2 * j : 2 * j + 2])
    torch.testing.assert_close(layers[1].running_mean, ref[1].running_mean)
    torch.testing.assert_close(layers[1].running_var, ref[1].running_var)


def test_an_evaluation_pass_reads_the_statistics_the_pass_before_it_wrote():
    """A training-mode pass writes batch norm's statistics back after its
    outputs are returned; an evaluation pass right after it, on the other
    worker, waits for them instead of uploading the old ones (the write-back
    is slowed down here, so a stale read would show every time)."""

    def layers_():
        torch.manual_seed(0)
        return [nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4)]

    def slow_statistics(point):
        if point == "state":
            time.sleep(0.02)

    layers, ref = layers_(), nn.Sequential(*layers_())
    with engine(layers, 2, 1, "|4|", chaos=slow_statistics) as eng:
        for step in range(8):
            x = torch.randn(16, 8) * (1 + step % 5)
            for module in [*layers, ref]:
                module.train()
            with torch.no_grad():
                ref(x)
                eng.forward(x)
            for module in [*layers, ref]:
                module.eval()
            with torch.no_grad():
                torch.testing.assert_close(eng.forward(x), ref(x), atol=1e-5, rtol=1e-4)


def test_forward_only_passes_in_training_mode_update_running_statistics_in_order():
    """A forward-only pass in training mode updates batch norm's statistics
    as the layers' own forward would (``update_bn``), micro-batch by
    micro-batch across rounds and calls; a forward_backward of the iteration
    a forward pass reserved leaves them alone (no second update)."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)]
    ref = copy.deepcopy(layers)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    with engine(layers, 2, 4, "1,1|1|1,1", microbatches_per_round=2, watchdog_timeout=20) as eng:
        with torch.no_grad():
            for _ in range(3):
                eng.forward(x)
        it = eng.reserve_iteration()
        eng.forward(x, iteration=it)
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss, iteration=it)
        eng.synchronize()
    with torch.no_grad():
        for _ in range(4):
            for j in range(4):
                nn.Sequential(*ref)(x[2 * j : 2 * j + 2])
    torch.testing.assert_close(layers[1].running_mean, ref[1].running_mean)
    torch.testing.assert_close(layers[1].running_var, ref[1].running_var)
    assert int(layers[1].num_batches_tracked) == 16


class FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.3)  # the step is queued first, and waits for these gradients
        raise RuntimeError("backward broke (injected)")


class BreakBackward(nn.Module):
    def forward(self, x):
        return FailsInBackward.apply(x)


def test_a_step_whose_gradients_never_came_reports_the_failure():
    layers = [nn.Linear(4, 4), BreakBackward(), nn.Linear(4, 1)]
    with engine(layers, 2, 2, "2|1|1,1", async_optimizer=True) as eng:
        eng.forward_backward(
            torch.randn(4, 4), labels=torch.randn(4, 1), loss_fn=nn.functional.mse_loss
        )
        handle = eng.step()
        with pytest.raises(WorkerError, match=r"backward broke \(injected\)"):
            handle.wait()


def test_placement_never_changes_what_is_computed():
    """Rounds start on the device predicted free first, from whatever costs the
    engine has, or by a fixed rotation: only where work runs changes, never the
    result (dropout included)."""
    from lightning_roundpipe.plan import LayerCosts

    ids, labels = lm_batch(8)
    results, placements = [], set()
    for kw in (
        {"placement": "rotate"},
        {},
        {"costs": LayerCosts([5, 1, 1, 1, 1, 9], [1, 1, 1, 1, 1, 9])},
        {"costs": LayerCosts([1, 1, 1, 1, 1, 1], [9, 1, 1, 1, 1, 1])},
    ):
        layers = transformer(dropout=0.3)
        with engine(layers, 3, 4, "2,2|2|1,1,1,1", seed=11, microbatches_per_round=2, **kw) as eng:
            for _ in range(3):
                loss = eng.forward_backward(ids, labels=labels, loss_fn=lm_loss)
            eng.synchronize()
            placements.add(tuple(eng.last_schedule.as_strings()))
        results.append((loss, grads(layers)))
    assert len(placements) > 1  # the settings really placed work differently
    for loss, g in results[1:]:
        torch.testing.assert_close(loss, results[0][0])
        for a, b in zip(g, results[0][1], strict=True):
            torch.testing.assert_close(a, b)


def test_synchronize_waits_for_calls_queued_behind_a_step():
    """A checkpoint taken after synchronize() never sees a half-applied
    scheduler step or zero_grad queued behind the optimizer step."""
    layers = mlp()
    ran = []

    def slow_scheduler_step():
        time.sleep(0.3)
        ran.append("scheduler")

    with engine(layers, 2, 2, async_optimizer=True) as eng:
        eng.forward_backward(
            torch.randn(4, 8), labels=torch.randn(4, 4), loss_fn=nn.functional.mse_loss
        )
        eng.step(lambda: None)
        eng.call(slow_scheduler_step)
        eng.synchronize()
        assert ran == ["scheduler"]


class _SquashInPlace(nn.Module):
    def forward(self, x):  # its gradient depends on the input: a changed input shows
        return x.mul_(2.0).tanh() * 1.0  # (the next layer writes its input in place)


def _in_place_layers():
    torch.manual_seed(0)
    return list(
        nn.Sequential(
            nn.Linear(8, 16),
            nn.ReLU(inplace=True),
            nn.Linear(16, 16),
            _SquashInPlace(),
            nn.Hardtanh(inplace=True),
            nn.Linear(16, 4),
        )
    )


@pytest.mark.parametrize(
    "plan",
    [
        "1,1,1,1,1|1|1,1,1,1,1",
        "2,1,2|1|1,1,1,1,1",
        "|6|",
        "1,2|3|2,1",
        "4|2|1,3",
        "4|2|1,3|layered",
        "1,4|1|5|layered",
        "|6||layered",
        "1,4|1|5|rewalk",
        "|6||rewalk",
    ],
)
@pytest.mark.parametrize("n", [1, 3])
def test_layers_that_change_their_input_in_place(plan, n):
    """A layer that writes its input in place (ReLU(inplace=True), x.mul_())
    at the start of any stage, or right after a boundary saved inside one, never
    changes a value another task reads, nor (in a layered stage) the input its
    first pass kept for the recompute: results equal plain PyTorch."""
    layers = _in_place_layers()
    ref = nn.Sequential(*copy.deepcopy(layers))
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    expected = nn.functional.mse_loss(ref(x.clone()), y)
    expected.backward()
    x_before = x.clone()
    with engine(layers, n, 4, plan) as eng:
        loss = eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
    torch.testing.assert_close(loss, expected.detach())
    assert_grads_equal(layers, list(ref))
    torch.testing.assert_close(x, x_before)  # the caller's batch is untouched


def test_the_store_copies_a_value_for_readers_before_the_last():
    from lightning_roundpipe.runtime.store import Key, Store

    store = Store(5.0)
    key, value = Key(0, "act", 1, 0), torch.ones(3)
    store.put(key, value, readers=2)
    first, last = store.take(key, "first", copy=torch.clone)
    assert not last and first is not value and torch.equal(first, value)
    second, last = store.take(key, "second", copy=torch.clone)
    assert last and second is value  # the last reader may write it in place


def test_a_value_two_stages_read_is_copied_for_the_first_before_the_last_writes_it():
    """A boundary value read by a backward stage and by a forward stage
    whose first layer writes it in place: whichever takes it first gets its
    own copy, made before the last reader can take it (on CPU workers an
    upload is the host value itself), so the recompute never sees the
    forward's write, however the workers race. Several runs on three
    workers, each equal to plain PyTorch."""

    def model():
        torch.manual_seed(0)
        return [
            nn.Linear(8, 8),
            nn.Linear(8, 16),
            _SquashInPlace(),
            nn.ReLU(inplace=True),
            nn.Linear(16, 16),
            _SquashInPlace(),
            nn.Hardtanh(inplace=True),
            nn.Linear(16, 4),
        ]

    ref = nn.Sequential(*model())
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    expected = nn.functional.mse_loss(ref(x.clone()), y)
    expected.backward()
    for _ in range(10):  # (before the fix, one run in five went wrong)
        layers = model()
        with engine(layers, 3, 4, "2,2|4|2,2", profile_iterations=0) as eng:
            loss = eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
            eng.synchronize()
        torch.testing.assert_close(loss, expected.detach())
        assert_grads_equal(layers, list(ref))


class _Intact(nn.Linear):
    input_intact = True  # never writes its input: a stage starting here copies nothing


class _Untrue(nn.Module):
    input_intact = True  # ... but it does

    def forward(self, x):
        return x.mul_(2.0).tanh()


def test_a_layer_that_keeps_its_input_intact_gets_the_stage_input_itself(monkeypatch):
    """A backward stage's first layer that declares ``input_intact`` is given
    the input's autograd leaf (one device copy, not two); a layer that
    declares it and writes its input anyway fails with autograd's error,
    naming the device and stage, never a wrong gradient."""
    from lightning_roundpipe.runtime import worker as worker_mod

    copies = []
    leaves = worker_mod.Worker._leaves

    def counted(self, x, copy=True):
        copies.append(copy)
        return leaves(self, x, copy)

    monkeypatch.setattr(worker_mod.Worker, "_leaves", counted)
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), _Intact(16, 16), nn.Tanh(), nn.Linear(16, 4)]
    ref = nn.Sequential(*copy.deepcopy(layers))
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    expected = nn.functional.mse_loss(ref(x), y)
    expected.backward()
    with engine(layers, 2, 2, "1,1|2|1,1") as eng:  # backward stages [0], [1]; fused [2, 3]
        loss = eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
    torch.testing.assert_close(loss, expected.detach())
    assert_grads_equal(layers, list(ref))
    assert False in copies and True in copies  # the _Intact stage, the Tanh one
    layers = [nn.Linear(8, 16), _Untrue(), nn.Linear(16, 4)]
    with engine(layers, 1, 1, "1,1|1|1,1") as eng, pytest.raises(WorkerError) as info:
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
    assert "in-place operation" in str(info.value) and "stage B" in str(info.value)
    assert "class sets input_intact = True" in str(info.value)


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.f(x))  # (its add keeps nothing)


def test_a_backward_stage_frees_its_output_before_its_backward_when_nothing_reads_it(
    monkeypatch,
):
    """A backward stage whose output comes from a residual add (which keeps
    nothing for its backward) frees the output's memory before the backward;
    one whose last operation keeps its result (tanh) does not; results equal
    plain PyTorch either way."""
    from lightning_roundpipe.runtime import worker as worker_mod

    freed = []
    release = worker_mod.release_output

    def counted(out):
        done = release(out)
        freed.append(done)
        if done:
            assert out.untyped_storage().nbytes() == 0
        return done

    monkeypatch.setattr(worker_mod, "release_output", counted)
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), _Residual(), nn.Tanh(), _Residual(), nn.Linear(16, 4)]
    ref = nn.Sequential(*copy.deepcopy(layers))
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    expected = nn.functional.mse_loss(ref(x), y)
    expected.backward()
    # backward stages [0, 1], [2], [3]; the fused one [4]; two micro-batches
    with engine(layers, 2, 2, "2,1,1|1|2,1,1") as eng:
        loss = eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
    torch.testing.assert_close(loss, expected.detach())
    assert_grads_equal(layers, list(ref))
    assert sorted(freed) == [False] * 2 + [True] * 4


class _Doubled(torch.autograd.Function):
    """``2 x``; its backward makes a new gradient, after which the one it
    got is needed by nothing else."""

    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class _Checked(torch.autograd.Function):
    """The identity; its backward records whether the gradient ``_Late``
    saw arrive at the layer's output is still alive."""

    @staticmethod
    def forward(ctx, x, seen):
        ctx.seen = seen
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.seen["alive"].append(ctx.seen["grad"]() is not None)
        return g, None


class _Seen(dict):
    """What ``_Late`` layers saw, shared by the workers' copies of them."""

    def __deepcopy__(self, memo):
        return self


class _Late(nn.Module):
    """A layer whose output's gradient is used once, at the start of its
    backward (as a decoder block's residual path uses it)."""

    def __init__(self, seen: dict) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seen = seen

    def forward(self, x):
        out = _Doubled.apply(_Checked.apply(self.lin(x), self.seen))
        if out.requires_grad:
            out.register_hook(lambda g: self.seen.__setitem__("grad", weakref.ref(g)))
        return out


def test_autograd_frees_the_gradient_of_a_stage_output_once_it_has_used_it():
    """A backward stage hands the gradient of its output to autograd
    (``backward_handing_over``): the layers below the one that used it run
    their backward without it (on CPU workers the uploaded gradient is the
    stored one itself). Called as ``torch.autograd.backward(outs, grads)``
    it would be held to the end. Results equal plain PyTorch."""
    from lightning_roundpipe.runtime.worker import backward_handing_over

    seen = _Seen(alive=[])
    layer = _Late(seen)
    x = torch.randn(4, 8, requires_grad=True)
    for hand_over in (False, True):
        out = layer(x)
        grad = [torch.ones_like(out)]
        if hand_over:
            backward_handing_over([out], grad, inputs=[x])
            assert grad == []
        else:
            torch.autograd.backward([out], grad, inputs=[x])
    assert seen["alive"] == [True, False]
    torch.testing.assert_close(x.grad, 2 * (2 * torch.ones(4, 8)) @ layer.lin.weight)

    torch.manual_seed(0)
    top, below = _Seen(alive=[]), _Seen(alive=[])
    layers = [nn.Linear(8, 8), _Late(below), _Late(top), nn.Linear(8, 4)]
    ref = nn.Sequential(*copy.deepcopy(layers))
    xs, ys = torch.randn(8, 8), torch.randn(8, 4)
    expected = nn.functional.mse_loss(ref(xs), ys)
    expected.backward()
    top["alive"].clear()
    # backward stages [1, 2] and [0]; the fused one [3]; two micro-batches
    with engine(layers, 2, 2, "2,1|1|2,1") as eng:
        loss = eng.forward_backward(xs, labels=ys, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
    torch.testing.assert_close(loss, expected.detach())
    assert_grads_equal(layers, list(ref))
    # the top layer of stage [1, 2], each micro-batch: the stage output's
    # gradient, which came from the store, was freed before its layers went on
    assert top["alive"] == [False, False]


@pytest.mark.parametrize("path", ["failure", "interrupt"])
def test_pinned_memory_is_freed_only_after_every_device_is_idle(monkeypatch, path):
    """On the failure and interrupt paths (and so on a re-plan, which closes the
    engine) the master arena is released only after every worker has waited
    for its device's copies to finish."""
    from lightning_roundpipe.runtime import device as device_mod
    from lightning_roundpipe.runtime import host as host_mod

    events = []
    lock = threading.Lock()
    original_free = host_mod.HostState.free

    def synchronize(self):
        time.sleep(0.05)  # a copy still in flight
        with lock:
            events.append("sync")

    def free(self):
        with lock:
            events.append("free")
        original_free(self)

    monkeypatch.setattr(device_mod.DeviceContext, "synchronize", synchronize)
    monkeypatch.setattr(host_mod.HostState, "free", free)
    torch.manual_seed(0)
    fail = path == "failure"
    layers = [nn.Linear(8, 8), Boom(lambda x: fail), nn.Linear(8, 8), nn.Linear(8, 1)]
    eng = engine(layers, 3, 6, "1,2|1|2,1")
    try:
        if fail:
            with pytest.raises(WorkerError):
                eng.forward_backward(
                    torch.randn(12, 8), labels=torch.randn(12, 1), loss_fn=nn.functional.mse_loss
                )
                eng.synchronize()
        else:  # Ctrl-C while stages are in flight: Lightning closes the engine
            eng.forward_backward(
                torch.randn(12, 8), labels=torch.randn(12, 1), loss_fn=nn.functional.mse_loss
            )
    finally:
        eng.close()
    assert events == ["sync"] * 3 + ["free"]


@pytest.mark.parametrize("async_optimizer", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_a_gradient_factor_given_after_the_call(n, async_optimizer):
    """scale='later': the loss is returned first, the factor its gradients are
    added with comes afterwards (autograd reaching a loss the caller scaled or
    combined); a factor never given drops the call's gradients at the step."""
    layers = mlp()
    ref = copy.deepcopy(layers)
    xs = [torch.randn(8, 8) for _ in range(3)]
    ys = [torch.randn(8, 4) for _ in range(3)]
    total = 0.5 * nn.functional.mse_loss(nn.Sequential(*ref)(xs[0]), ys[0])
    total = total + 0.25 * nn.functional.mse_loss(nn.Sequential(*ref)(xs[1]), ys[1])
    total.backward()
    with engine(layers, n, 4, "3,3|1|2,2,2", async_optimizer=async_optimizer) as eng:
        losses = []
        for x, y, factor in zip(xs, ys, (0.5, 0.25, None), strict=True):
            loss = eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss, scale="later")
            losses.append(loss)
            if factor is not None:
                eng.scale_gradients(eng.iteration - 1, factor)
        with pytest.raises(RuntimeError, match="were already scaled"):
            eng.scale_gradients(0, 1.0)
        seen = {}

        def look():
            seen.update({i: p.grad.clone() for i, p in enumerate(eng.parameters())})

        eng.step(look).wait()
        eng.synchronize()
    torch.testing.assert_close(
        losses[0], nn.functional.mse_loss(nn.Sequential(*ref)(xs[0]), ys[0]).detach()
    )
    expected = [p.grad for layer in ref for p in layer.parameters()]
    for i, g in enumerate(expected):
        torch.testing.assert_close(seen[i], g)


def test_loop_thread_gradient_after_a_mid_window_synchronize_counts_once():
    """A weight penalty backpropagated on the caller's thread after
    synchronize() exposed the window's gradient (validation or a checkpoint
    in the middle of accumulation) is added once, as in plain PyTorch."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)]
    ref = copy.deepcopy(layers)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    loss = nn.functional.mse_loss(nn.Sequential(*ref)(x), y)
    (loss + 0.1 * ref[0].weight.square().sum()).backward()
    seen = {}
    with engine(layers, 2, 2) as eng:
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
        (0.1 * layers[0].weight.square().sum()).backward()
        eng.step(lambda: seen.update(g=layers[0].weight.grad.clone())).wait()
    torch.testing.assert_close(seen["g"], ref[0].weight.grad)


def test_a_factor_of_zero_gives_zero_gradients_and_a_dropped_loss_none():
    """(0 * loss).backward() gives zero gradients (momentum and weight decay
    still apply); a loss never backpropagated gives none."""
    layers = mlp()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    seen = []
    with engine(layers, 2, 2) as eng:
        for factor in (0.0, None):
            eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss, scale="later")
            if factor is not None:
                eng.scale_gradients(eng.iteration - 1, factor)
            eng.step(lambda: seen.append(layers[0].weight.grad)).wait()
    assert seen[0] is not None and not seen[0].any() and seen[1] is None


def test_an_fp16_overflow_in_input_gradients_skips_the_step():
    """Input gradients (a soft prompt) are checked like weight gradients: an
    fp16 overflow there skips the window's step and backs the scale off."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)]
    for p in (p for layer in layers for p in layer.parameters()):
        p.requires_grad_(False)
    prompt = torch.randn(12, 8, requires_grad=True)
    y = torch.randn(12, 4) * 50
    with engine(layers, 2, 4, precision="16-mixed") as eng:
        scale = eng.scaler.scale
        eng.forward_backward(
            prompt,
            labels=y,
            loss_fn=lambda o, t: nn.functional.mse_loss(o.float(), t.float()),
            input_grads=True,
        )
        eng.input_grads(eng.iteration - 1)
        handle = eng.step(lambda: None).wait()
        assert handle.skipped and eng.scaler.scale == scale / 2


def test_a_weight_frozen_after_building_gets_no_gradient_and_one_unfrozen_is_refused():
    """Frozen within a step (PEFT's disable_adapter() with trainable biases):
    the call gives it no gradient, as autograd would; unfrozen, it has no
    gradient buffer: refused by name, before anything runs."""
    layers = mlp()
    layers[2].weight.requires_grad_(False)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with engine(layers, 2, 2) as eng:
        assert eng.trainable_changed() == []
        layers[0].weight.requires_grad_(False)  # frozen after the engine was built
        assert eng.trainable_changed() == ["layers[0].weight"]
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
        assert layers[0].weight.grad is None and layers[0].bias.grad is not None
        layers[0].weight.requires_grad_(True)
        layers[2].weight.requires_grad_(True)  # frozen when it was built
        iteration = eng.iteration
        with pytest.raises(
            ValueError,
            match=r"^layers\[2\]\.weight requires a gradient but did not when the engine was "
            r"built .* Unfreeze weights between steps",
        ):
            eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        assert eng.iteration == iteration


def test_resuming_never_overwrites_a_frozen_weight():
    # a checkpoint saved while a layer trained, resumed with it frozen: its
    # saved one-behind weight is older than the parameter and must not win
    layers = mlp()
    for layer in layers:
        layer.to(torch.bfloat16)
    layers[0].requires_grad_(False)
    frozen = layers[0].weight.detach().clone()
    with engine(layers, 2, 2, precision="bf16-true", async_optimizer=True) as eng:
        stale = [t + 1 for t in eng.stale_weights()]
        eng.resume(stale)
        torch.testing.assert_close(layers[0].weight, frozen, atol=0, rtol=0)
        trained = eng._host.params[2]
        assert trained.trainable
        torch.testing.assert_close(trained.master, stale[2], atol=0, rtol=0)


_CALLS: list = []  # (module level: the engine's replicas are deep copies)


class _Logged(nn.Module):
    """A layer that logs its forward calls (with or without autograd) and the
    arrival of its output's gradient."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        out = torch.tanh(self.lin(x))
        grad = torch.is_grad_enabled()
        _CALLS.append(("fwd" if grad else "nograd", self.index))
        if grad:
            out.register_hook(lambda g: _CALLS.append(("bwd", self.index)))
        return out


@pytest.mark.parametrize("mode", ["", "layered", "rewalk"])
def test_a_layered_stage_recomputes_and_differentiates_one_layer_at_a_time(mode):
    log = _CALLS
    torch.manual_seed(0)
    layers = [_Logged(i) for i in range(4)]
    ref = copy.deepcopy(layers)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    expected = nn.functional.mse_loss(nn.Sequential(*ref)(x), y)
    expected.backward()
    log.clear()
    plan = "3|1|3" + (f"|{mode}" if mode else "")
    with engine(layers, 1, 1, plan, profile_iterations=0) as eng:
        loss = eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
    torch.testing.assert_close(loss, expected.detach())
    assert_grads_equal(layers, ref)
    b2 = log[log.index(("bwd", 3)) + 1 :]  # after the fused stage: B2, layers 0-2
    # layered: a first pass without autograd, then each layer's recompute
    # right before its backward (one layer's autograd state at a time);
    # rewalk: no layer input kept, each computed again from the stage input
    # right before that layer's recompute
    walk = {"layered": [], "rewalk": [("nograd", 0)]}
    if mode:
        assert b2 == [
            ("nograd", 0),
            ("nograd", 1),
            ("fwd", 2),
            ("bwd", 2),
            *walk[mode],
            ("fwd", 1),
            ("bwd", 1),
            ("fwd", 0),
            ("bwd", 0),
        ]
    else:
        assert b2 == [("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 2), ("bwd", 1), ("bwd", 0)]


def test_host_memory_for_boundaries_gets_a_layered_plan_that_trains_the_same():
    """expect_activations with a boundary size and an activation_memory the
    one-layer plan's boundary values exceed: the engine installs a layered
    plan before the first step, its iteration keeps fewer boundary bytes on
    the host, and training gives the same result as plain PyTorch."""
    layers = transformer(num_blocks=6, dropout=0.0)
    ref = copy.deepcopy(layers)
    ids, labels = lm_batch(4)
    expected = reference(ref, ids, labels, lm_loss, 1)
    n = len(layers)
    # one layer with its activations: 2e6 bytes; two plain layers 3e6, over the
    # limit; a layered stage of k layers 2e6 + (k - 1) inputs of 2e5: three at most
    saved, transient = [10**6] * n, [10**6] * n
    kept = {}
    for budget in (None, 600_000):  # one-layer stages keep 7 inputs: 1.4e6
        kw = {"device_memory_limit": 2_500_000, "activation_memory": budget}
        model = copy.deepcopy(layers)
        with engine(model, 1, 1, None, profile_iterations=0, **kw) as eng:
            peaks = eng.expect_activations(saved, transient, boundary=200_000)
            assert max(peaks) <= 2_500_000
            assert eng.plan.layered == (budget is not None)
            assert eng.plan.boundaries_per_microbatch() * 200_000 <= (budget or 10**9)
            assert max(st.num_layers for st in eng.plan.stages if st.kind != "forward") <= 3
            loss = eng.forward_backward(ids, labels=labels, loss_fn=lm_loss)
            eng.synchronize()
            kept[budget] = eng.boundary_bytes
        torch.testing.assert_close(loss, expected)
        assert_grads_equal(model, ref)
    assert 0 < kept[600_000] < kept[None] / 2
    with (
        pytest.raises(ValueError, match="boundary must be a number of bytes >= 0"),
        engine(mlp(), 1, 1) as eng,
    ):
        eng.expect_activations([0] * 7, [0] * 7, boundary=-1)


def test_activations_counted_larger_plan_smaller_stages_and_are_previewed_without_change():
    """activation_scale=2 plans as if every predicted saved and transient byte
    were two; plan_with_activations says what a scale would give, changing
    nothing; the scale is validated."""
    saved, transient = [200_000] * 7, [100_000] * 7
    plans = {}
    for scale in (1.0, 2.0):
        kw = {"device_memory_limit": 1_500_000, "activation_scale": scale}
        with engine(mlp(), 1, 1, None, profile_iterations=0, **kw) as eng:
            assert eng.plan_with_activations(2.0) is None  # nothing told yet
            peaks = eng.expect_activations(saved, transient)
            assert max(peaks) <= 1_500_000
            plans[scale] = (str(eng.plan), peaks)
            before = str(eng.plan)
            preview = eng.plan_with_activations(2 * scale)
            assert str(eng.plan) == before and eng.activation_scale == scale
    assert plans[1.0][0] != plans[2.0][0]
    assert str(preview.plan) != plans[2.0][0]  # counted four times: smaller again
    doubled = stage_peaks(
        StagePlan.parse(plans[2.0][0], 7),
        estimate_costs(mlp(), torch.float32),
        [2 * x for x in saved],
        [2 * x for x in transient],
    )
    assert plans[2.0][1] == doubled
    with pytest.raises(ValueError, match=r"activation_scale must be >= 1, got 0\.5"):
        RoundPipeEngine(mlp(), ["cpu"], 1, activation_scale=0.5)


@pytest.mark.parametrize(
    "plan", ["|5|", "|5||layered", "2|3|2|layered", "1,1|3|2|layered", "|5||rewalk", "2|3|2|rewalk"]
)
def test_running_statistics_count_one_update_per_microbatch_in_layered_stages(plan):
    """A layered stage's first pass runs its layers in training mode too; the
    buffers it changed are put back, so batch norms count each micro-batch
    once, as in plain PyTorch."""
    torch.manual_seed(0)
    layers = [
        nn.Linear(8, 8),
        nn.BatchNorm1d(8),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8),
        nn.Linear(8, 4),
    ]
    ref = nn.Sequential(*copy.deepcopy(layers))
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    expected = nn.functional.mse_loss(ref(x), y)
    expected.backward()
    with engine(layers, 1, 1, plan) as eng:
        loss = eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
    torch.testing.assert_close(loss, expected.detach())
    assert_grads_equal(layers, list(ref))
    for i in (1, 3):
        torch.testing.assert_close(layers[i].running_mean, ref[i].running_mean)
        torch.testing.assert_close(layers[i].running_var, ref[i].running_var)
        assert int(layers[i].num_batches_tracked) == 1


class _SlowForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(0.1)  # a slow forward, a backward of microseconds
        return torch.tanh(self.lin(x))


def test_a_layered_stages_measured_backward_leaves_out_the_recompute_below():
    """Between two layers' backward a layered stage recomputes the layer
    below: the profiler measures each layer's backward alone, so the clock,
    which adds the second forward itself, does not count it twice."""
    torch.manual_seed(0)
    layers = [_SlowForward() for _ in range(4)]
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with engine(layers, 1, 1, "3|1|3|layered", profile_iterations=1) as eng:
        for _ in range(2):
            eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
        costs = eng.measured_costs()
    assert all(f >= 0.1 for f in costs.forward)
    assert all(b < 0.05 for b in costs.backward), costs.backward


@pytest.mark.parametrize("where", ["OptimizerWorker", "Worker"])
def test_a_construction_that_fails_late_releases_the_arena_and_threads(monkeypatch, where):
    """A failure after the master copies are built (here: making the optimizer
    or a device worker) stops what started and gives the arena back; the
    model's parameters keep their values."""
    from lightning_roundpipe.runtime import engine as engine_mod
    from lightning_roundpipe.runtime import host as host_mod

    freed = []
    original_free = host_mod.HostState.free

    def free(self):
        freed.append(self)
        original_free(self)

    def broken(*args, **kwargs):
        raise RuntimeError(f"{where} could not start")

    monkeypatch.setattr(host_mod.HostState, "free", free)
    monkeypatch.setattr(engine_mod, where, broken)
    layers = mlp()
    before = [p.detach().clone() for layer in layers for p in layer.parameters()]
    threads = threading.active_count()
    with pytest.raises(RuntimeError, match=f"{where} could not start"):
        engine(layers, 2, 2)
    assert len(freed) == 1
    assert threading.active_count() == threads
    after = [p.detach() for layer in layers for p in layer.parameters()]
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b)


def test_float64_inputs_keep_their_dtype_and_ambiguous_batch_sizes_are_warned_about(caplog):
    """A layer computing with float64 on purpose gets float64 (it was cast
    to the compute dtype); inputs whose tensors differ in their first
    dimension say where the batch size came from, once."""

    class Seen(nn.Module):
        def forward(self, inputs, table):  # 1 where the inputs came as float64
            return (
                torch.full_like(inputs[:, :1], float(inputs.dtype == torch.float64))
                + 0 * table[0, 0]
            )

    eng = engine([Seen(), nn.Identity()], 1, 2)
    try:
        x, table = torch.randn(4, 8, dtype=torch.float64), torch.randn(3, 3)
        with caplog.at_level("WARNING", logger="lightning_roundpipe.runtime.engine"):
            out = eng.forward((x, table))
            eng.forward((x, table))
        assert out.tolist() == [[1.0]] * 4
        warned = [r.getMessage() for r in caplog.records if "batch size is taken" in r.message]
        assert (
            len(warned) == 1
            and "taken from the inputs' first tensor with a dimension, 4" in (warned[0])
        )
        assert "(3, 3)" in warned[0]
    finally:
        eng.close()

"""The engine on CUDA devices: same equivalences, bf16 tolerances, shared GPUs."""

import copy

import pytest
import torch
from torch import nn

from lightning_roundpipe.runtime import RoundPipeEngine

from .models import lm_batch, lm_loss, mlp, reference, transformer

pytestmark = pytest.mark.gpu


def _grads(layers):
    return [p.grad for m in layers for p in m.parameters()]


@pytest.mark.parametrize("devices", [[0], [0, 0, 0]])
@pytest.mark.parametrize("plan", [None, "1,1,1,1,1|1|1,1,1,1,1", "3,2|1|2,2,1"])
def test_transformer_fp32_on_cuda_matches_cpu_reference(devices, plan):
    layers = transformer()
    ref = copy.deepcopy(layers)
    ids, labels = lm_batch(12)
    expected = reference(ref, ids, labels, lm_loss, 6, seed=5)
    with RoundPipeEngine(
        layers, devices, 6, plan=plan, seed=5, microbatches_per_round=len(devices) * 2
    ) as eng:
        loss = eng.forward_backward(ids, labels=labels, loss_fn=lm_loss)
        eng.synchronize()
        assert eng.host_memory()["pinned"] > 0
    # CUDA dropout masks differ from CPU ones: compare without dropout effects
    torch.testing.assert_close(loss, expected, atol=0.5, rtol=0.1)
    assert all(g is not None and torch.isfinite(g).all() for g in _grads(layers))


@pytest.mark.parametrize("devices", [[0], [0, 0], [0, 0, 0, 0]])
def test_mlp_fp32_on_cuda_matches_plain(devices):
    layers = mlp()
    ref = copy.deepcopy(layers)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    expected = nn.functional.mse_loss(nn.Sequential(*ref)(x), y)
    expected.backward()
    with RoundPipeEngine(
        layers, devices, 8, plan="2,2,2|1|1,2,3", microbatches_per_round=max(2, len(devices))
    ) as eng:
        for _ in range(1):
            loss = eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-4, rtol=1e-4)
    for a, b in zip(_grads(layers), _grads(ref), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("plan", ["4,2|1|3,3|layered", "4,2|1|3,3|rewalk"])
def test_layered_and_rewalked_stages_on_cuda_match_plain(plan, prefetch):
    """Layer inputs kept on the device, or computed again from the stage
    input uploaded once more (rewalk), with the next stage and micro-batch
    prefetched or not (the last resort of long sequences): plain results."""
    layers = mlp()
    ref = copy.deepcopy(layers)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    expected = nn.functional.mse_loss(nn.Sequential(*ref)(x), y)
    expected.backward()
    with RoundPipeEngine(layers, [0, 0], 4, plan=plan, microbatches_per_round=4) as eng:
        eng._rt.prefetch = prefetch
        loss = eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
        assert eng.boundary_peak > 0
    torch.testing.assert_close(loss, expected.detach(), atol=1e-4, rtol=1e-4)
    for a, b in zip(_grads(layers), _grads(ref), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_bf16_on_cuda_is_close_and_device_count_independent():
    ids, labels = lm_batch(8)
    out = []
    for devices in ([0], [0, 0, 0, 0]):
        layers = transformer()
        with RoundPipeEngine(
            layers,
            devices,
            4,
            plan="1,1,1,1,1|1|1,1,1,1,1",
            precision="bf16-mixed",
            seed=1,
            microbatches_per_round=4,  # same on-device accumulation grouping in both runs
        ) as eng:
            loss = eng.forward_backward(ids, labels=labels, loss_fn=lm_loss)
            eng.synchronize()
        out.append((loss, _grads(layers)))
    torch.testing.assert_close(out[0][0], out[1][0])
    for a, b in zip(out[0][1], out[1][1], strict=True):
        torch.testing.assert_close(a, b)


def test_several_iterations_with_prefetch_and_steps():
    layers = mlp()
    ref = copy.deepcopy(layers)
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.05)
    opt_ref = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.05)
    with RoundPipeEngine(
        layers, [0, 0], 8, plan="1,1,1,1,1,1|1|1,1,1,1,1,1", microbatches_per_round=4
    ) as eng:
        for _ in range(5):
            x, y = torch.randn(16, 8), torch.randn(16, 4)
            nn.functional.mse_loss(nn.Sequential(*ref)(x), y).backward()
            opt_ref.step()
            opt_ref.zero_grad()
            eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
            eng.step(opt.step)
            opt.zero_grad()
    for a, b in zip(
        nn.Sequential(*layers).parameters(), nn.Sequential(*ref).parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_pinned_and_device_memory_return_to_their_start_after_close(cuda_allocated):
    from lightning_roundpipe.runtime import pinned_bytes

    pinned, allocated = pinned_bytes(), cuda_allocated()
    for i in range(5):
        layers = mlp()
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        opt = torch.optim.AdamW([p for m in layers for p in m.parameters()], lr=1e-3)
        with RoundPipeEngine(layers, [0, 0], 4, async_optimizer=bool(i % 2)) as eng:
            eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
            eng.step(opt.step)
            eng.synchronize()
            assert pinned_bytes() > pinned
        assert cuda_allocated() == allocated, f"run {i} left device memory"
        assert pinned_bytes() == pinned, f"run {i} left page-locked memory registered"


@pytest.mark.parametrize("devices", [[0], [0, 0]])
@pytest.mark.parametrize("double_buffer", [True, False], ids=["two-copies", "one-copy"])
def test_a_partly_frozen_model_trains_on_cuda_like_the_reference(devices, double_buffer):
    """Asynchronous steps on CUDA: each stage's weights go up from the frozen
    range and one version's trainable range (prefetched window by window on
    two workers), with one and with two master copies."""
    from .test_optimizer import check_partly_frozen

    # dropout off: CUDA dropout masks differ from the CPU reference's
    check_partly_frozen(
        double_buffer,
        devices=len(devices),
        device=torch.device("cuda", 0),
        dropout=0.0,
        atol=1e-4,
        rtol=1e-3,
    )


def test_the_hosts_activation_budget_leaves_room_for_gradient_staging(monkeypatch):
    """On CUDA each download of a stage's gradients takes a page-locked block
    of the caching host allocator that stays: the host memory left for
    boundary activations is what the state and those blocks leave (on CPU
    there is no staging: the same engine's budget is larger by exactly it)."""
    from lightning_roundpipe.runtime import engine as engine_module
    from lightning_roundpipe.runtime.host import gradient_bytes, plan_staging_bytes

    layers = transformer(num_blocks=2)
    monkeypatch.setattr(engine_module, "host_available", lambda: 10**9)
    with RoundPipeEngine(copy.deepcopy(layers), [torch.device("cpu")], 2) as cpu:
        cpu_limit = cpu._host_limit
    with RoundPipeEngine(copy.deepcopy(layers), [0], 2) as eng:
        staged = plan_staging_bytes(eng._initial[0], gradient_bytes(layers), 1)
        assert staged > 0
        assert cpu_limit - eng._host_limit == pytest.approx(0.8 * staged, abs=2)


def test_the_first_plan_has_smaller_stages_where_its_gradient_staging_would_not_fit(
    monkeypatch, caplog
):
    """The page-locked blocks the gradient downloads take grow with the
    stages: where the first plan's would not fit the host memory the
    training state leaves, the engine starts from smaller stages (and
    keeps them as its stage cap), as `plan estimate` predicts."""
    from lightning_roundpipe.runtime import engine as engine_mod
    from lightning_roundpipe.runtime.host import gradient_bytes, plan_staging_bytes

    layers = mlp()
    grads = gradient_bytes(layers)
    with RoundPipeEngine(copy.deepcopy(layers), [0], 4) as eng:
        first = eng.plan
    staged = plan_staging_bytes(first, grads, 1)
    room = int(0.75 * staged)
    monkeypatch.setattr(engine_mod, "_state_to_come", lambda *args, **kwargs: 0)
    monkeypatch.setattr(engine_mod, "host_available", lambda *args, **kwargs: room)
    with (
        caplog.at_level("INFO", logger="lightning_roundpipe.runtime.engine"),
        RoundPipeEngine(layers, [0], 4) as eng,
    ):
        assert str(eng.plan) != str(first)
        assert plan_staging_bytes(eng.plan, grads, 1) <= room
        assert eng.size_limit is not None
    assert f"instead of {first}: its stages' gradient downloads stage" in caplog.text

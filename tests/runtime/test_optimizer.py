"""Optimizer semantics: synchronous = ordinary training, asynchronous = a
hand-written staleness-1 reference; the five ordering rules are each needed."""

import copy
import time

import pytest
import torch
from torch import nn

from lightning_roundpipe.runtime import RoundPipeEngine, WorkerError
from lightning_roundpipe.runtime.optimizer import Chaos, Rules, all_finite

from .models import lm_batch, lm_loss, reference, transformer

CPU = torch.device("cpu")


def params_of(layers):
    return [p for m in layers for p in m.parameters()]


def make_adamw(params):
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))


def make_sgd(params):
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)


def batches(n, size=8, seed=11):
    return [lm_batch(size, seed=seed + i) for i in range(n)]


def staleness_reference(layers, data, make_opt, *, accumulate, clip, m, seed, stale):
    """Hand-written loop: window k computes gradients with the weights after
    k-1 updates (stale) or k updates (not stale); update k applies them."""
    params = params_of(layers)
    opt, sched = make_opt(params)
    compute = copy.deepcopy(layers)
    cparams = params_of(compute)
    history = [[p.detach().clone() for p in params]]
    it, norms, losses = 0, [], []
    for k in range(len(data) // accumulate):
        src = history[max(0, k - 1)] if stale else history[k]
        with torch.no_grad():
            for c, w in zip(cparams, src, strict=True):
                c.copy_(w)
                c.grad = None
        for ids, labels in data[k * accumulate : (k + 1) * accumulate]:
            losses.append(reference(compute, ids, labels, lm_loss, m, seed=seed, iteration=it))
            it += 1
        for p, c in zip(params, cparams, strict=True):
            p.grad = None if c.grad is None else c.grad.clone()  # (frozen: None)
        if clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
        sched.step()
        opt.zero_grad()
        history.append([p.detach().clone() for p in params])
    return losses, norms


class _Without(Rules):
    """The ordering rules with some removed (each condition always holds)."""

    def __init__(self, removed) -> None:
        self.removed = set(removed)
        self.copies_after_step = 5 not in self.removed

    def uses_done(self, proto, window, p):
        return 1 in self.removed or super().uses_done(proto, window, p)

    def weights_ready(self, proto, need, params):
        return 2 in self.removed or super().weights_ready(proto, need, params)

    def grads_complete(self, proto, window, p):
        return 3 in self.removed or super().grads_complete(proto, window, p)

    def buffer_free(self, proto, window, p):
        return 4 in self.removed or super().buffer_free(proto, window, p)


def without(removed):
    return _Without(removed) if removed else None


def run_engine(
    layers,
    data,
    make_opt,
    *,
    accumulate,
    clip,
    m,
    seed,
    async_mode,
    devices=2,
    plan="2,2,1|1|1,1,1,1,1",
    chaos=None,
    disabled=(),
    double_buffer=None,
    device=CPU,
):
    params = params_of(layers)
    opt, sched = make_opt(params)

    def update():
        opt.step()
        sched.step()
        opt.zero_grad()

    losses, handles = [], []
    with RoundPipeEngine(
        layers,
        [device] * devices,
        m,
        plan=plan,
        seed=seed,
        async_optimizer=async_mode,
        watchdog_timeout=60,
        chaos=chaos,
        rules=without(disabled),
        double_buffer=double_buffer,
    ) as eng:
        for k in range(len(data) // accumulate):
            for ids, labels in data[k * accumulate : (k + 1) * accumulate]:
                losses.append(eng.forward_backward(ids, labels=labels, loss_fn=lm_loss))
            handles.append(eng.step(update, clip_grad_norm=clip))
        eng.synchronize()
    return losses, [h.wait().grad_norm for h in handles]


def assert_same(a_layers, b_layers, **tolerance):
    for a, b in zip(params_of(a_layers), params_of(b_layers), strict=True):
        torch.testing.assert_close(a, b, **tolerance)


_CASES = [
    pytest.param(opt, mode, None, acc, clip, id=f"{acc}-{clip}-{name}-{mode_id}")
    for opt, name in ((make_adamw, "adamw"), (make_sgd, "sgd"))
    for mode, mode_id in ((True, "async"), (False, "sync"))
    for acc, clip in ((1, None), (2, 0.5))
] + [  # one master copy (double_buffer=False), on two of the settings
    pytest.param(make_adamw, True, False, 2, 0.5, id="2-0.5-async-one-copy-adamw"),
    pytest.param(make_sgd, True, False, 1, None, id="1-None-async-one-copy-sgd"),
]


@pytest.mark.parametrize(("make_opt", "async_mode", "double_buffer", "accumulate", "clip"), _CASES)
def test_ten_steps_match_the_reference(make_opt, async_mode, double_buffer, accumulate, clip):
    data = batches(10 * accumulate)
    layers = transformer()
    ref = copy.deepcopy(layers)
    ref_losses, ref_norms = staleness_reference(
        ref, data, make_opt, accumulate=accumulate, clip=clip, m=4, seed=3, stale=async_mode
    )
    losses, norms = run_engine(
        layers,
        data,
        make_opt,
        accumulate=accumulate,
        clip=clip,
        m=4,
        seed=3,
        async_mode=async_mode,
        double_buffer=double_buffer,
    )
    assert_same(layers, ref)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    if clip is not None:
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms))
    else:
        assert norms == [None] * len(norms)


def test_async_differs_from_sync():
    """The staleness is real: the two modes give different weights."""
    data = batches(4)
    a, b = transformer(), transformer()
    run_engine(a, data, make_sgd, accumulate=1, clip=None, m=4, seed=3, async_mode=True)
    run_engine(b, data, make_sgd, accumulate=1, clip=None, m=4, seed=3, async_mode=False)
    assert any(not torch.equal(x, y) for x, y in zip(params_of(a), params_of(b), strict=True))


CHAOS = {
    "upload": 0.002,
    "grad": 0.002,
    "g_copy": 0.001,
    "p_copy": 0.001,
    "step": 0.003,
    "download": 0.001,
}


def stress_case(seed):
    import random

    rng = random.Random(seed)
    devices = rng.randint(1, 4)
    plan = rng.choice(["2,2,1|1|1,1,1,1,1", "1,1,1,1,1|1|2,3", "|6|", "3,2|1|1,2,2", None])
    accumulate = rng.choice([1, 2])
    return devices, plan, accumulate


def test_stress_async_with_random_delays(stress_runs):
    for seed in range(stress_runs):
        devices, plan, accumulate = stress_case(seed)
        data = batches(3 * accumulate, size=4, seed=seed)
        layers = transformer(num_blocks=4, seed=seed)
        ref = copy.deepcopy(layers)
        staleness_reference(
            ref, data, make_sgd, accumulate=accumulate, clip=None, m=4, seed=seed, stale=True
        )
        run_engine(
            layers,
            data,
            make_sgd,
            accumulate=accumulate,
            clip=None,
            m=4,
            seed=seed,
            async_mode=True,
            devices=devices,
            plan=plan,
            chaos=Chaos(seed, CHAOS),
        )
        try:
            assert_same(layers, ref)
        except AssertionError as exc:
            raise AssertionError(
                f"seed {seed}: {devices} devices, plan {plan}, accumulate {accumulate}: {exc}"
            ) from exc


# Each rule, removed, lets a race through; the delays make the race certain.
RULE_CHAOS = {
    1: {"upload": 0.03},  # uploads late: an unguarded P copy overwrites first
    2: {"p_copy": 0.02},  # P copies late: an unguarded upload reads stale weights
    3: {"grad": 0.03},  # gradients late: an unguarded G copy reads partial sums
    4: {"g_copy": 0.03},  # G copy late: unguarded accumulation mixes windows
    # P copies before the step: masters lag an update; slow G copies delay the
    # step so the next window uploads the lagging masters
    5: {"g_copy": 0.01},
}


# Rule 1 is needed with one master copy. With two, an update writes the copy
# that only windows it already took every gradient from read (rule 3 covers
# their training tasks); what protects the running window there is the
# parity, shown by the next test.
@pytest.mark.parametrize(
    ("rule", "copies"), [(1, 1), (2, 1), (2, 2), (3, 1), (3, 2), (4, 1), (4, 2), (5, 1), (5, 2)]
)
def test_each_rule_is_needed(rule, copies):
    data = batches(4, size=4)
    layers = transformer(num_blocks=2)
    ref = copy.deepcopy(layers)
    guarded = copy.deepcopy(layers)
    staleness_reference(ref, data, make_sgd, accumulate=1, clip=None, m=4, seed=0, stale=True)

    def run(target, disabled=()):
        run_engine(
            target,
            data,
            make_sgd,
            accumulate=1,
            clip=None,
            m=4,
            seed=0,
            async_mode=True,
            devices=2,
            plan="1,1,1|1|1,1,1",
            chaos=Chaos(0, RULE_CHAOS[rule]),
            disabled=disabled,
            double_buffer=copies == 2,
        )

    # with the rule in place the same delays are harmless
    run(guarded)
    assert_same(guarded, ref)
    try:
        run(layers, disabled={rule})
    except WorkerError as exc:  # a detected violation: autograd saw a weight change under it
        assert "modified by an inplace operation" in str(exc)
        return
    assert_diverged(layers, ref, f"removing rule {rule}")


def assert_diverged(layers, ref, what):
    diverged = any(
        not torch.allclose(a, b) for a, b in zip(params_of(layers), params_of(ref), strict=True)
    )
    assert diverged, f"{what} went unnoticed"


def test_two_copies_need_the_other_parity(monkeypatch):
    """With two master copies, an update that wrote the copy the running
    window reads (as if there were one copy, but without rule 1's wait)
    would change weights under it: the parity is what keeps it consistent."""
    from lightning_roundpipe.runtime import host

    data = batches(4, size=4)
    layers = transformer(num_blocks=2)
    ref = copy.deepcopy(layers)
    staleness_reference(ref, data, make_sgd, accumulate=1, clip=None, m=4, seed=0, stale=True)
    chaos = {"upload": 0.03}  # uploads late: a P copy into the read copy lands first
    kwargs = dict(accumulate=1, clip=None, m=4, seed=0, async_mode=True, plan="1,1,1|1|1,1,1")
    guarded = copy.deepcopy(layers)
    run_engine(guarded, data, make_sgd, chaos=Chaos(0, chaos), **kwargs)
    assert_same(guarded, ref)
    # the weight copies of update w go to the copy of version w, not w + 1
    real = host._Param.master_for
    monkeypatch.setattr(
        host._Param, "master_for", lambda self, v: real(self, v - 1 if v > 0 else v)
    )
    try:
        run_engine(layers, data, make_sgd, chaos=Chaos(0, chaos), **kwargs)
    except WorkerError as exc:
        assert "modified by an inplace operation" in str(exc)
        return
    assert_diverged(layers, ref, "writing the copy the running window reads")


def test_two_copies_overlap_the_weight_copies_with_the_next_window():
    """Update 0's weight copies finish while window 1 is still open (with one
    copy they wait until window 1 is closed)."""
    data = batches(2, size=4)
    # (with one copy the copies cannot start before step(1): a short look suffices)
    for double, overlapped, look in ((True, True, 10.0), (False, False, 0.5)):
        layers = transformer(num_blocks=2)
        with RoundPipeEngine(
            layers,
            [CPU] * 2,
            4,
            plan="1,1,1|1|1,1,1",
            async_optimizer=True,
            double_buffer=double,
            watchdog_timeout=60,
        ) as eng:
            eng.forward_backward(data[0][0], labels=data[0][1], loss_fn=lm_loss)
            eng.step(lambda: None).wait()
            eng.forward_backward(data[1][0], labels=data[1][1], loss_fn=lm_loss)
            proto = eng._protocol
            deadline = time.monotonic() + look
            while time.monotonic() < deadline and min(proto.p_done) < 1:
                time.sleep(0.01)
            assert (min(proto.p_done) >= 1) == overlapped, f"double_buffer={double}"
            eng.step(lambda: None)
            eng.synchronize()


# ------------------------------------------------------------------ fp16
class Spike(nn.Module):
    """Multiplies by a huge factor on chosen iterations: fp16 gradients overflow."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.spike = False

    def forward(self, x):
        y = self.lin(x)
        return y * 6e4 if self.spike else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_finiteness_check_finds_every_nan_and_infinity(dtype):
    g = torch.randn(4099, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert all_finite(g) and all_finite(g[::3]) and all_finite(g[:0])
    for where in (0, 1, 2048, 4098):  # first, vectorised middle, last element
        for bad in (float("nan"), float("inf"), -float("inf")):
            h = g.clone()
            h[where] = bad
            assert not all_finite(h), (where, bad)
            assert not all_finite(h.view(1, -1).expand(2, -1))  # not contiguous
    assert all_finite(torch.tensor([torch.finfo(dtype).max, torch.finfo(dtype).min], dtype=dtype))
    sparse = torch.sparse_coo_tensor([[1]], [float("nan")], (3,))
    assert not all_finite(sparse) and all_finite(torch.sparse_coo_tensor([[1]], [1.0], (3,)))
    assert all_finite(torch.arange(3))
    assert not all_finite(torch.tensor([1 + 1j, complex("nan")]))


@pytest.mark.parametrize("async_mode", [False, True])
def test_fp16_overflow_skips_the_step_and_backs_off(async_mode):
    torch.manual_seed(0)
    spike = Spike()
    layers = [nn.Linear(8, 8), spike, nn.Linear(8, 1)]
    params = params_of(layers)
    opt = torch.optim.AdamW(params, lr=1e-2)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    with RoundPipeEngine(
        layers, [CPU] * 2, 2, plan="1,1|1|1,1", precision="16-mixed", async_optimizer=async_mode
    ) as eng:
        scale0 = eng.scaler.scale
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        h1 = eng.step(opt.step).wait()
        eng.synchronize()
        assert not h1.skipped
        before = [p.detach().clone() for p in params]
        state = copy.deepcopy(opt.state_dict())
        spike.spike = True
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        spike.spike = False
        h2 = eng.step(opt.step).wait()
        eng.synchronize()
        assert h2.skipped
        assert eng.scaler.scale == scale0 / 2
        for a, b in zip(before, params, strict=True):
            assert torch.equal(a, b)
        assert str(opt.state_dict()) == str(state)
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        h3 = eng.step(opt.step).wait()
        eng.synchronize()
        assert not h3.skipped
        assert any(not torch.equal(a, b) for a, b in zip(before, params, strict=True))


def test_fp16_gradients_are_unscaled():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)]
    ref = copy.deepcopy(layers)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    nn.functional.mse_loss(nn.Sequential(*ref)(x), y).backward()
    seen = {}
    with RoundPipeEngine(layers, [CPU], 2, plan="|3|", precision="16-mixed") as eng:
        eng.scaler.scale = 1024.0
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        h = eng.step(lambda: seen.update({id(p): p.grad.clone() for p in params_of(layers)}))
        assert not h.skipped
    for p, r in zip(params_of(layers), params_of(ref), strict=True):
        torch.testing.assert_close(seen[id(p)], r.grad, atol=2e-2, rtol=2e-2)


class HookFailed(Exception):
    pass


@pytest.mark.parametrize("async_mode", [False, True])
@pytest.mark.parametrize("where", ["prepare", "step"])
def test_a_failed_step_releases_its_gradients_and_fails_fast(async_mode, where):
    """The hook's own exception (sync) or one naming the step (async) reaches the
    caller; the step's gradients are released. Async: later calls fail at
    once, with the same error. Sync: the step counts as a skipped one and the
    engine goes on (an OnExceptionCheckpoint can save; it failed again with the
    hook's error), from the weights the failed step left."""
    layers = transformer(num_blocks=1)
    params = params_of(layers)
    opt = torch.optim.SGD(params, lr=0.1)
    seen = []

    def prepare():
        seen.append(sum(p.grad is not None for p in params))
        if where == "prepare":
            raise HookFailed("hook exploded")

    def fn():
        raise HookFailed("step exploded")

    ids, labels = lm_batch(4)
    before = [p.detach().clone() for p in params]
    eng = RoundPipeEngine(layers, [CPU] * 2, 2, async_optimizer=async_mode)
    try:
        eng.forward_backward(ids, labels=labels, loss_fn=lm_loss)
        if async_mode:
            h = eng.step(fn if where == "step" else opt.step, prepare=prepare)
            with pytest.raises(RuntimeError, match="optimizer step 0 failed: HookFailed") as info:
                h.wait()
            assert isinstance(info.value.__cause__, HookFailed)
        elif where == "prepare":
            with pytest.raises(HookFailed, match="hook exploded"):
                eng.step(opt.step, prepare=prepare)
        else:
            with pytest.raises(RuntimeError, match="optimizer step 0 failed") as info:
                eng.step(fn, prepare=prepare)
            assert isinstance(info.value.__cause__, HookFailed)
        assert seen == [len(params)]  # the hook saw every gradient
        assert all(p.grad is None for p in params)
        assert eng.host_memory()["step_grads"] == 0
        if async_mode:
            later = (
                f"optimizer step 0 failed: HookFailed: {where.replace('prepare', 'hook')} exploded"
            )
            with pytest.raises(RuntimeError, match=later):
                eng.forward_backward(ids, labels=labels, loss_fn=lm_loss)
        else:
            for p, b in zip(params, before, strict=True):
                assert torch.equal(p, b)  # (neither failure changed a weight)
            eng.synchronize()  # nothing waits for the failed step
            eng.forward_backward(ids, labels=labels, loss_fn=lm_loss)
            assert not eng.step(opt.step).skipped
            assert any(not torch.equal(p, b) for p, b in zip(params, before, strict=True))
    finally:
        eng.close()
    assert not eng._optimizer._grads


def test_clip_arguments_are_checked():
    with RoundPipeEngine(transformer(num_blocks=1), [CPU], 2) as eng:
        with pytest.raises(ValueError, match="give clip_grad_norm or clip_grad_value, not both"):
            eng.step(clip_grad_norm=1.0, clip_grad_value=1.0)
        with pytest.raises(ValueError, match="clip_grad_norm must be > 0"):
            eng.step(clip_grad_norm=0.0)


def test_clip_by_value_reports_the_norm():
    layers = transformer(num_blocks=1)
    ids, labels = lm_batch(4)
    seen = {}
    with RoundPipeEngine(layers, [CPU], 2) as eng:
        eng.forward_backward(ids, labels=labels, loss_fn=lm_loss)
        eng.synchronize()
        norm = float(
            torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad) for p in params_of(layers)])
            )
        )
        h = eng.step(
            lambda: seen.update(m=max(float(p.grad.abs().max()) for p in params_of(layers))),
            clip_grad_value=1e-3,
        )
    assert h.grad_norm == pytest.approx(norm)
    assert seen["m"] <= 1e-3 * (1 + 1e-6)


def test_use_fused_switches_adamw_and_keeps_the_update():
    from lightning_roundpipe.runtime import use_fused

    torch.manual_seed(0)
    a = [nn.Parameter(torch.randn(64, 64)) for _ in range(3)]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    opt_a = torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1)
    opt_b = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1)
    assert use_fused(opt_b)
    assert opt_b.param_groups[0]["fused"] is True
    for _ in range(3):
        for p, q in zip(a, b, strict=True):
            g = torch.randn_like(p)
            p.grad, q.grad = g, g.clone()
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    assert not use_fused(torch.optim.SGD(a, lr=0.1))


class Poison(nn.Module):
    """Turns its output into NaN when asked (in forward and in recompute)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.poison = False

    def forward(self, x):
        y = self.lin(x)
        return y * float("nan") if self.poison else y


@pytest.mark.parametrize("async_mode", [False, True])
def test_nonfinite_loss_raises_before_any_update(async_mode):
    from lightning_roundpipe.runtime import NonFiniteError

    torch.manual_seed(0)
    poison = Poison()
    layers = [nn.Linear(8, 8), poison, nn.Linear(8, 1)]
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    with RoundPipeEngine(layers, [CPU] * 2, 2, plan="1,1|1|1,1", async_optimizer=async_mode) as eng:
        poison.poison = True
        with pytest.raises(
            NonFiniteError,
            match=r"the loss of micro-batch\(es\) \[0, 1\] in "
            r"iteration 0 is not finite \(nan\); .*nonfinite='skip'",
        ):
            eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)


@pytest.mark.parametrize("async_mode", [False, True])
def test_nonfinite_gradient_skip_or_raise(async_mode):
    from lightning_roundpipe.runtime import NonFiniteError

    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Linear(8, 1)]
    params = params_of(layers)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    opt = torch.optim.SGD(params, lr=0.1)
    before = [p.detach().clone() for p in params]
    with RoundPipeEngine(
        layers, [CPU] * 2, 2, plan="1|1|1", async_optimizer=async_mode, nonfinite="skip"
    ) as eng:
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()  # the window's gradients are in the host buffers
        eng._host.params[0].grad[0, 0] = float("inf")  # a corrupted gradient
        h = eng.step(opt.step).wait()
        eng.synchronize()
        assert h.skipped
        assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    eng = RoundPipeEngine(layers, [CPU] * 2, 2, plan="1|1|1", async_optimizer=async_mode)
    try:
        eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
        eng._host.params[1].grad[0] = float("nan")
        with pytest.raises(
            (NonFiniteError, RuntimeError),
            match=r"non-finite gradient \(inf or NaN\) in layers\[0\]\.bias in "
            "optimizer step 0",
        ):
            eng.step(opt.step).wait()
        assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    finally:
        eng.close()
    assert not eng._optimizer._grads  # the failed step holds no gradients


def test_the_default_second_copy_gives_way_when_the_host_memory_is_short(monkeypatch, caplog):
    """``double_buffer=None`` keeps one master copy, and says why, where the
    second would not fit next to the rest of the state; ``True`` keeps two."""
    from lightning_roundpipe.runtime import engine as engine_module

    layers = transformer(num_blocks=2)
    trained = sum(p.numel() for m in layers for p in m.parameters() if p.requires_grad)
    # room for one master copy (fp32 here), gradients and moments, not a second copy
    monkeypatch.setattr(engine_module, "host_available", lambda: trained * (4 + 12) + 1)
    with (
        caplog.at_level("WARNING"),
        RoundPipeEngine(layers, [CPU], 2, async_optimizer=True) as eng,
    ):
        assert eng.double_buffer is False and eng._host.copies == 1
    assert "one master copy of the trainable weights (double_buffer off)" in caplog.text
    assert "set double_buffer=True to keep two copies anyway" in caplog.text
    caplog.clear()
    with RoundPipeEngine(layers, [CPU], 2, async_optimizer=True, double_buffer=True) as eng:
        assert eng.double_buffer is True and eng._host.copies == 2
    monkeypatch.setattr(engine_module, "host_available", lambda: trained * (8 + 12))
    with RoundPipeEngine(layers, [CPU], 2, async_optimizer=True) as eng:
        assert eng.double_buffer is True
    assert "double_buffer off" not in caplog.text


def test_the_default_activation_budgets_leave_room_for_the_training_state(monkeypatch, caplog):
    """The host memory left for activations by default is what is available
    less the master copies, gradient buffers and Adam-like moments still to
    be allocated; a state that cannot fit is said before anything runs."""
    from lightning_roundpipe.runtime import engine as engine_module
    from lightning_roundpipe.runtime.host import HOST_ACTIVATION_SHARE

    layers = transformer(num_blocks=2)
    trained = sum(p.numel() for m in layers for p in m.parameters() if p.requires_grad)
    state = trained * (2 * 4 + 12)  # fp32: two master copies, gradients, moments
    monkeypatch.setattr(engine_module, "host_available", lambda: state + 4_000_000)
    with RoundPipeEngine(layers, [CPU], 2, async_optimizer=True) as eng:
        assert eng.double_buffer
        assert eng.activation_memory == 1_000_000
        assert eng._host_limit == int(4_000_000 * HOST_ACTIVATION_SHARE)
    with RoundPipeEngine(layers, [CPU], 2, activation_memory=123) as eng:
        assert eng.activation_memory == 123 and eng._host_limit == 123
    # the optimizer's state already allocated (a rebuilt engine): not counted again
    monkeypatch.setattr(engine_module, "host_available", lambda: trained * 20 + 4_000_000)
    with RoundPipeEngine(layers, [CPU], 2, async_optimizer=True, optimizer_state=0) as eng:
        assert eng.double_buffer
        assert eng.activation_memory == (trained * 8 + 4_000_000) // 4
    # a state that cannot fit: said, and the budgets come from what is there
    monkeypatch.setattr(engine_module, "host_available", lambda: trained * 10)
    with (
        caplog.at_level("WARNING"),
        RoundPipeEngine(layers, [CPU], 2, async_optimizer=False) as eng,
    ):
        assert eng.activation_memory == trained * 10 // 4
    assert "the training state needs about" in caplog.text
    assert "the process may run out of host memory" in caplog.text
    # no reading (or a reading of 0): no default budget, as before
    monkeypatch.setattr(engine_module, "host_available", lambda: 0)
    with RoundPipeEngine(layers, [CPU], 2, async_optimizer=True) as eng:
        assert eng.activation_memory is None and eng._host_limit is None and eng.double_buffer


def partly_frozen(dropout: float = 0.1):
    """A transformer whose attention weights are frozen: every stage goes up
    from the frozen weights' range and a trainable one."""
    layers = transformer(num_blocks=2, dropout=dropout)
    layers[0].drop.p = dropout
    for block in layers[1:-1]:
        block.attn.requires_grad_(False)
    return layers


def check_partly_frozen(double_buffer, devices=2, device=CPU, dropout=0.1, **tolerance):
    """Four asynchronous steps of :func:`partly_frozen` match the staleness-1
    reference, and the frozen weights do not move."""
    data = batches(4)
    ref = partly_frozen(dropout)
    staleness_reference(ref, data, make_sgd, accumulate=1, clip=None, m=4, seed=3, stale=True)
    layers = partly_frozen(dropout)
    frozen = [p.detach().clone() for p in params_of(layers) if not p.requires_grad]
    run_engine(
        layers,
        data,
        make_sgd,
        accumulate=1,
        clip=None,
        m=4,
        seed=3,
        async_mode=True,
        double_buffer=double_buffer,
        plan="1,2|1|1,1,1",
        devices=devices,
        device=device,
    )
    assert_same(layers, ref, **tolerance)
    still = [p for p in params_of(layers) if not p.requires_grad]
    for a, b in zip(frozen, still, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("double_buffer", [True, False], ids=["two-copies", "one-copy"])
def test_a_partly_frozen_model_matches_the_reference(double_buffer):
    check_partly_frozen(double_buffer)


_THREADS_PROBE = """
import torch
from lightning_roundpipe.runtime import RoundPipeEngine

seen = []

class Probe(torch.nn.Linear):
    def forward(self, x):
        seen.append(torch.get_num_threads())
        return super().forward(x)

def run(threads):
    seen.clear()
    layers = [Probe(4, 4) for _ in range(3)]
    engine = RoundPipeEngine(
        layers, ["cpu"] * 2, 2, async_optimizer=True, optimizer_threads=threads,
        profile_iterations=0,
    )
    with engine as eng:
        opt = torch.optim.SGD([p for l in layers for p in l.parameters()], lr=0.1)
        for _ in range(3):
            x, y = torch.randn(4, 4), torch.randn(4, 4)
            eng.forward_backward(x, labels=y, loss_fn=torch.nn.functional.mse_loss)
            eng.step(opt.step)
        eng.synchronize()
    return sorted(set(seen))

before = run(None)
run(1)
print(before, run(None))
"""


def test_the_optimizer_threads_count_is_put_back_when_the_engine_closes():
    """(torch shares the count between all threads but the main one: an
    engine with optimizer_threads=1 left every later engine's CPU workers on
    one thread). In a process of its own: the tests' OMP_NUM_THREADS hides it."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", _THREADS_PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = out.stdout.strip().splitlines()[-1].split("] [")
    assert before + "]" == "[" + after


_SYNC_THREADS_PROBE = """
import torch
from lightning_roundpipe.runtime import RoundPipeEngine

layers = [torch.nn.Linear(4, 4) for _ in range(3)]
seen = []

class Counting(torch.optim.SGD):
    def step(self, closure=None):
        seen.append(torch.get_num_threads())
        return super().step(closure)

main = torch.get_num_threads()
with RoundPipeEngine(
    layers, ["cpu"] * 2, 2, async_optimizer=False, optimizer_threads=1, profile_iterations=0
) as eng:
    opt = Counting([p for l in layers for p in l.parameters()], lr=0.1)
    for _ in range(2):
        x, y = torch.randn(4, 4), torch.randn(4, 4)
        eng.forward_backward(x, labels=y, loss_fn=torch.nn.functional.mse_loss)
        eng.step(opt.step)
print(main, sorted(set(seen)), torch.get_num_threads())
"""


def test_optimizer_threads_apply_to_the_synchronous_step_too():
    """The synchronous step runs on the loop's thread: the count is set there
    for the step and put back after it (it was ignored)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", _SYNC_THREADS_PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "2 [1] 2"

"""Property-based: every batch structure and option combination either trains
exactly like plain PyTorch or fails fast with a clear error; nothing hangs."""

import copy
import threading
import time

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_roundpipe.runtime import RoundPipeEngine
from lightning_roundpipe.runtime.nested import call_layer, split_microbatches


class Entry(nn.Module):
    """Accepts a tensor, a tuple (x, scale) or a dict {"x", "w"}."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale=None, w=None):
        h = self.lin(x)
        if scale is not None:
            h = h * scale
        if w is not None:
            h = h * w
        return torch.tanh(h)


def layers():
    torch.manual_seed(0)
    return [Entry(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)]


def make_inputs(kind, batch):
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, 4, generator=g)
    if kind == "tensor":
        return x
    if kind == "tuple":
        return (x, torch.tensor(0.5))  # a 0-d tensor: replicated to every micro-batch
    return {"x": x, "w": torch.rand(batch, 1, generator=g) + 0.5}


PLANS = [None, "|4|", "1,1,1|1|1,1,1", "2,1|1|3", "1,2|1|2,1", "2|2|1,1"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["tensor", "tuple", "dict"]),
    batch=st.integers(1, 9),
    n=st.integers(1, 3),
    m=st.integers(1, 5),
    mr=st.one_of(st.none(), st.integers(1, 4)),
    plan=st.sampled_from(PLANS),
    async_mode=st.booleans(),
    precision=st.sampled_from(["32-true", "bf16-mixed"]),
    fit_to_batch=st.booleans(),
)
def test_every_combination_trains_or_fails_fast(
    kind, batch, n, m, mr, plan, async_mode, precision, fit_to_batch
):
    before = threading.active_count()
    model = layers()
    ref = copy.deepcopy(model)
    inputs = make_inputs(kind, batch)
    labels = torch.randn(batch, 1, generator=torch.Generator().manual_seed(7))
    t0 = time.monotonic()
    eng = RoundPipeEngine(  # any number of micro-batches and devices is allowed
        model,
        ["cpu"] * n,
        m,
        plan=plan,
        microbatches_per_round=mr,
        async_optimizer=async_mode,
        precision=precision,
        fit_to_batch=fit_to_batch,
        watchdog_timeout=20,
    )
    if fit_to_batch and batch < m:
        m = batch  # a short batch: one sample per micro-batch
    try:
        if batch < m:
            try:
                eng.forward_backward(inputs, labels=labels, loss_fn=nn.functional.mse_loss)
            except ValueError as exc:
                assert f"batch size ({batch}) is smaller than num_microbatches ({m})" in str(exc)
                return
            raise AssertionError("a batch smaller than num_microbatches must be refused")
        loss = eng.forward_backward(inputs, labels=labels, loss_fn=nn.functional.mse_loss)
        eng.synchronize()
    finally:
        eng.close()
    assert time.monotonic() - t0 < 30
    assert threading.active_count() == before
    # plain PyTorch, micro-batch by micro-batch, weighted by micro-batch share
    total = 0.0
    xs, ys = split_microbatches(inputs, m, batch), split_microbatches(labels, m, batch)
    for x, y in zip(xs, ys, strict=True):
        out = x
        for layer in ref:
            out = call_layer(layer, out)
        part = nn.functional.mse_loss(out, y) * (y.shape[0] / batch)
        part.backward()
        total += float(part)
    # bf16 compute against the fp32 reference: bf16's 8-bit mantissa
    tol = dict(rtol=1e-5, atol=1e-6) if precision == "32-true" else dict(rtol=4e-2, atol=2e-2)
    torch.testing.assert_close(float(loss), total, **tol)
    for a, b in zip(
        [p for mm in model for p in mm.parameters()],
        [p for mm in ref for p in mm.parameters()],
        strict=True,
    ):
        torch.testing.assert_close(a.grad, b.grad, **tol)

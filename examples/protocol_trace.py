"""The asynchronous optimizer's five ordering rules, drawn from a recorded trace.

Runs a small MLP through :class:`RoundPipeEngine` on two CPU workers with the
asynchronous optimizer and seeded delays (``Chaos``), records every hand-off of
one parameter (the first layer's weight) by wrapping the engine's ``Protocol``
methods, and plots the trace: one lane per thread, one marker per hand-off, and
an arrow for each rule dependency that actually occurred.

    python examples/protocol_trace.py               # docs/images/protocol-rules.png
    python examples/protocol_trace.py --out /tmp/fig --windows 4 --seed 1

The rules (see ``lightning_roundpipe/runtime/optimizer.py``), window ``w``
being the ``forward_backward`` calls before the ``w``-th ``step``:

1. the P copy of update ``w`` waits until window ``w + 1`` stops reading the
   master copy (worker ``after_use`` -> optimizer ``p_copied``);
2. window ``k`` reads the master copy only after the P copy of update ``k - 2``
   (``p_copied`` -> worker ``before_upload``);
3. the G copy of update ``w`` waits for every gradient of window ``w``
   (worker ``after_grad`` -> optimizer ``g_copied``);
4. window ``w + 1`` adds gradients only after the G copy of update ``w``
   (``g_copied`` -> worker ``before_grad``);
5. the optimizer thread runs G copies, step and P copies of each update in
   order, and the updates in order.

Timestamps: a producer is stamped just before it signals, a consumer just after
its wait returns, so a dependency that held reads as ``consumer >= producer``.
"""

from __future__ import annotations

import argparse
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lightning_roundpipe.runtime import RoundPipeEngine
from lightning_roundpipe.runtime.optimizer import Chaos

OPTIMIZER_THREAD = "roundpipe-optimizer"
OUT_NAME = "protocol-rules.png"

# seeded random delays (largest, in seconds) that spread the hand-offs out
CHAOS = {
    "upload": 0.004,
    "forward": 0.003,
    "backward": 0.003,
    "grad": 0.002,
    "g_copy": 0.001,
    "p_copy": 0.001,
    "step": 0.006,
}


@dataclass(frozen=True)
class Event:
    """One recorded hand-off.

    ``t`` is milliseconds since the first ``forward_backward``; ``kind`` is the
    ``Protocol`` method (``before_upload``/``before_grad``/``wait_grads``:
    when its wait returned; ``after_use``/``after_grad``/``g_copied``/``p_copied``:
    just before it signalled) or ``step_begin``/``step_end`` around the
    optimizer's ``step``; ``param`` names the tracked parameter (``""`` for steps).
    """

    t: float
    thread: str
    kind: str
    window: int
    param: str


def build_layers(seed: int = 0, width: int = 32, blocks: int = 4) -> list[nn.Module]:
    """``blocks`` x (Linear + Tanh), then a Linear to one output."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [
        nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)
    ]
    layers.append(nn.Linear(width, 1))
    return layers


class _Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def add(self, kind: str, window: int, param: str = "") -> None:
        t = (time.perf_counter() - self._t0) * 1e3
        name = threading.current_thread().name
        with self._lock:
            self.events.append(Event(t, name, kind, window, param))


def _instrument(protocol, tracked: dict[int, str], rec: _Recorder) -> None:
    """Wrap ``protocol``'s hand-off methods on the instance; each wrapper calls
    through to the original and records the tracked parameters' hand-offs."""

    def names(params) -> list[str]:
        return [tracked[p.index] for p in params if p.index in tracked]

    def consumer_many(orig: Callable) -> Callable:  # before_upload
        @functools.wraps(orig)
        def wrapper(window, params, block=True):
            result = orig(window, params, block)
            if block:  # the non-blocking form only asks (CUDA prefetch)
                for name in names(params):
                    rec.add(orig.__name__, window, name)
            return result

        return wrapper

    def producer_many(orig: Callable) -> Callable:  # after_use
        @functools.wraps(orig)
        def wrapper(window, params):
            for name in names(params):
                rec.add(orig.__name__, window, name)
            return orig(window, params)

        return wrapper

    def consumer_one(orig: Callable) -> Callable:  # before_grad, wait_grads
        @functools.wraps(orig)
        def wrapper(window, p):
            result = orig(window, p)
            if p.index in tracked:
                rec.add(orig.__name__, window, tracked[p.index])
            return result

        return wrapper

    def producer_one(orig: Callable) -> Callable:  # after_grad, g_copied, p_copied
        @functools.wraps(orig)
        def wrapper(window, p):
            if p.index in tracked:
                rec.add(orig.__name__, window, tracked[p.index])
            return orig(window, p)

        return wrapper

    protocol.before_upload = consumer_many(protocol.before_upload)
    protocol.after_use = producer_many(protocol.after_use)
    protocol.before_grad = consumer_one(protocol.before_grad)
    protocol.wait_grads = consumer_one(protocol.wait_grads)
    protocol.after_grad = producer_one(protocol.after_grad)
    protocol.g_copied = producer_one(protocol.g_copied)
    protocol.p_copied = producer_one(protocol.p_copied)


def record(windows: int = 3, seed: int = 0) -> list[Event]:
    """Run ``windows`` windows (one ``forward_backward`` and one ``step`` each)
    on two CPU workers with the asynchronous optimizer and return the trace of
    the first layer's weight (``"layer 0 weight"``) and the last layer's weight
    (``"layer 4 weight"``), sorted by time."""
    layers = build_layers(seed)
    width = layers[0][0].in_features
    tracked_params = {"layer 0 weight": layers[0][0].weight, "layer 4 weight": layers[-1].weight}
    params = [p for layer in layers for p in layer.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    gen = torch.Generator().manual_seed(seed)
    data = [
        (torch.randn(8, width, generator=gen), torch.randn(8, 1, generator=gen))
        for _ in range(windows)
    ]
    rec = _Recorder()

    def update(window: int) -> Callable[[], None]:
        def fn() -> None:
            rec.add("step_begin", window)
            opt.step()
            opt.zero_grad()
            rec.add("step_end", window)

        return fn

    with RoundPipeEngine(
        layers,
        ["cpu", "cpu"],
        2,
        async_optimizer=True,
        seed=seed,
        watchdog_timeout=60,
        profile_iterations=0,
    ) as eng:
        # the host parameter index is the position in eng.parameters()
        order = eng.parameters()
        tracked = {}
        for label, weight in tracked_params.items():
            tracked[next(i for i, q in enumerate(order) if q is weight)] = label
        proto = eng._protocol
        proto.chaos = Chaos(seed, CHAOS)
        _instrument(proto, tracked, rec)
        rec.start()
        for k, (x, y) in enumerate(data):
            eng.forward_backward(x, labels=y, loss_fn=nn.functional.mse_loss)
            eng.step(update(k))
        eng.synchronize()
    return sorted(rec.events, key=lambda e: e.t)


if __name__ == "__main__":
    for e in record():
        print(f"{e.t:8.2f} {e.thread:24s} {e.kind:12s} w{e.window} {e.param}")

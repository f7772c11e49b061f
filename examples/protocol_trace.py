"""The asynchronous optimizer's five ordering rules, drawn from a recorded trace.

Runs a small MLP through :class:`RoundPipeEngine` on two CPU workers with the
asynchronous optimizer and seeded delays (``Chaos``), records every hand-off of
one parameter (the first layer's weight) by wrapping the engine's ``Protocol``
methods, and plots the trace: one lane per thread, one marker per hand-off, and
an arrow for each rule dependency that actually occurred.

    python examples/protocol_trace.py               # docs/images/protocol-rules.png
    python examples/protocol_trace.py --out /tmp/fig --windows 4 --seed 1
    python examples/protocol_trace.py --copies 1    # one master copy (double_buffer=False)

The rules (see ``lightning_roundpipe/runtime/optimizer.py``), window ``w``
being the ``forward_backward`` calls before the ``w``-th ``step``:

1. the P copy of update ``w`` waits until the windows that read the master
   copy it writes have finished uploading it (worker ``after_use`` ->
   optimizer ``p_copied``): with two master copies (the default) windows
   ``w - 1`` and ``w``, so the copy overlaps window ``w + 1``; with one,
   window ``w + 1``;
2. window ``k`` reads the master copy only after the P copy of update ``k - 2``
   (``p_copied`` -> worker ``before_upload``);
3. the G copy of update ``w`` (the buffer lent to the step) waits for every
   gradient of window ``w`` (courier ``after_grad`` -> optimizer ``g_copied``);
4. a gradient of window ``w + 1`` is added only after update ``w`` has released
   the buffer (optimizer ``released`` -> courier ``before_add``);
5. the optimizer thread runs G copies, step and P copies of each update in
   order, and the updates in order.

Timestamps: a producer is stamped just before it signals, a consumer just after
the method returns (its wait, then its ``Chaos`` delay), so a dependency that
held reads as ``consumer >= producer``.
"""

# no ``from __future__ import annotations``: with string annotations ``@dataclass``
# needs the module in ``sys.modules``, which loading this file by path skips
import argparse
import functools
import re
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
    "upload": 0.003,
    "forward": 0.002,
    "backward": 0.002,
    "grad": 0.002,
    "g_copy": 0.003,
    "p_copy": 0.003,
    "step": 0.008,
}


@dataclass(frozen=True)
class Event:
    """One recorded hand-off.

    ``t`` is milliseconds since the first ``forward_backward``; ``kind`` is the
    ``Protocol`` method (``before_upload``/``before_add``/``wait_grads``:
    when the method returned, after its wait; ``after_use``/``after_grad``/
    ``g_copied``/``released``/``p_copied``: just before it signalled) or
    ``step_begin``/``step_end`` around the optimizer's ``step``; ``param``
    names the tracked parameter (``""`` for steps).
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
        def wrapper(window, version, params, block=True):
            result = orig(window, version, params, block)
            if block:  # the non-blocking form only asks (CUDA prefetch)
                for name in names(params):
                    rec.add(orig.__name__, window, name)
            return result

        return wrapper

    def producer_many(orig: Callable) -> Callable:  # after_use, released
        @functools.wraps(orig)
        def wrapper(window, params):
            for name in names(params):
                rec.add(orig.__name__, window, name)
            return orig(window, params)

        return wrapper

    def consumer_one(orig: Callable) -> Callable:  # before_add, wait_grads
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
    protocol.before_add = consumer_one(protocol.before_add)
    protocol.wait_grads = consumer_one(protocol.wait_grads)
    protocol.after_grad = producer_one(protocol.after_grad)
    protocol.g_copied = producer_one(protocol.g_copied)
    protocol.released = producer_many(protocol.released)
    protocol.p_copied = producer_one(protocol.p_copied)


def record(windows: int = 3, seed: int = 0, copies: int = 2) -> list[Event]:
    """Run ``windows`` windows (one ``forward_backward`` and one ``step`` each)
    on two CPU workers with the asynchronous optimizer (``copies`` master
    copies of the weights) and return the trace of the first layer's weight
    (``"layer 0 weight"``) and the last layer's weight (``"layer 4 weight"``),
    sorted by time."""
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
        double_buffer=copies == 2,
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


# ------------------------------------------------------------------ analysis
def _of(events: list[Event], kind: str, window: int, param: str) -> list[Event]:
    return [e for e in events if e.kind == kind and e.window == window and e.param == param]


def dependencies(
    events: list[Event], param: str, copies: int = 2
) -> list[tuple[int, Event, Event]]:
    """The rule 1-4 dependencies of ``param`` observed in ``events``, as
    ``(rule, producer, consumer)``: rule 1: last ``after_use`` of window
    ``w`` (one master copy: ``w + 1``) -> ``p_copied(w)``; rule 2: ``p_copied(w)`` -> first
    ``before_upload`` of window ``w + 2``; rule 3: last ``after_grad(w)`` ->
    ``g_copied(w)``; rule 4: ``released(w)`` -> first ``before_add(w + 1)``.
    A rule held where ``consumer.t >= producer.t``."""
    deps: list[tuple[int, Event, Event]] = []
    windows = sorted({e.window for e in events if e.param == param})
    for w in windows:
        for rule, (pk, pw, pick_p), (ck, cw, pick_c) in (
            (1, ("after_use", w + (copies == 1), max), ("p_copied", w, min)),
            (2, ("p_copied", w, min), ("before_upload", w + 2, min)),
            (3, ("after_grad", w, max), ("g_copied", w, min)),
            (4, ("released", w, min), ("before_add", w + 1, min)),
        ):
            prod, cons = _of(events, pk, pw, param), _of(events, ck, cw, param)
            if prod and cons:
                key = lambda e: e.t  # noqa: E731
                deps.append((rule, pick_p(prod, key=key), pick_c(cons, key=key)))
    return deps


def updates(events: list[Event], param: str) -> list[list[Event]]:
    """Rule 5: per update, the optimizer-thread events of ``param`` and the step,
    in recorded order (G copy, step, P copy)."""
    kinds = ("wait_grads", "g_copied", "step_begin", "step_end", "released", "p_copied")
    out = []
    for w in sorted({e.window for e in events if e.kind == "step_begin"}):
        out.append(
            [e for e in events if e.window == w and e.kind in kinds and e.param in ("", param)]
        )
    return out


def violations(events: list[Event], param: str, copies: int = 2) -> list[str]:
    """Every observed dependency of ``param`` that ran backwards in time."""
    bad = [
        f"rule {rule}: {c.kind}(window {c.window}) at {c.t:.2f} ms before "
        f"{p.kind}(window {p.window}) at {p.t:.2f} ms"
        for rule, p, c in dependencies(events, param, copies)
        if c.t < p.t
    ]
    order = ["wait_grads", "g_copied", "step_begin", "step_end", "released", "p_copied"]
    flat = [e for u in updates(events, param) for e in u]
    expect = sorted(flat, key=lambda e: (e.window, order.index(e.kind)))
    if [(e.kind, e.window) for e in flat] != [(e.kind, e.window) for e in expect]:
        bad.append("rule 5: optimizer events out of order")
    return bad


# ---------------------------------------------------------------------- plot
KINDS = {  # kind: (marker, colour, y offset in the lane, legend text)
    "before_upload": (">", "#2ca02c", 0.0, "before_upload returned: task uploads the weight"),
    "after_use": ("s", "#1f77b4", 0.0, "after_use: upload done, master copy free"),
    "before_add": ("v", "#ff7f0e", 0.2, "before_add: courier adds a gradient"),
    "after_grad": ("^", "#d62728", -0.2, "after_grad: gradient added to the buffer"),
    "g_copied": ("D", "#9467bd", 0.2, "g_copied: buffer lent to the step as .grad"),
    "released": ("P", "#17becf", -0.2, "released: the step is done with the buffer"),
    "p_copied": ("o", "#8c564b", 0.0, "p_copied: P copy done (weights -> master copy)"),
}
RULE_COLOURS = {1: "#0bb4c8", 2: "#d62f9d", 3: "#333333", 4: "#d9a400", 5: "#777777"}
WINDOW_SHADES = ["#dbe9f6", "#fde2c8", "#d9f0d3", "#e8dff1", "#f6d5d5"]


def _lane_name(thread: str) -> str:
    if thread == OPTIMIZER_THREAD:
        return "optimizer"
    m = re.fullmatch(r"roundpipe-worker-(\d+)-(.+)", thread)
    if m:
        return f"worker {m.group(1)} ({m.group(2)})"
    m = re.fullmatch(r"roundpipe-courier-(\d+)", thread)
    return f"courier {m.group(1)}" if m else thread


def plot(events: list[Event], path: Path, param: str = "layer 0 weight", copies: int = 2) -> Path:
    """Draw the trace of ``param`` (and the steps) into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    mine = [e for e in events if e.param in ("", param)]
    workers = sorted({e.thread for e in mine if e.thread != OPTIMIZER_THREAD})
    lanes = {t: len(workers) - i for i, t in enumerate(workers)}
    lanes[OPTIMIZER_THREAD] = 0

    def y(e: Event) -> float:
        return lanes[e.thread] + KINDS.get(e.kind, (None, None, 0.0))[2]

    # fixed geometry first: the arrow labels are placed in display coordinates
    fig = plt.figure(figsize=(11, 4.6), dpi=120)
    ax = fig.add_axes((0.1, 0.33, 0.88, 0.59))
    lo, hi = min(e.t for e in mine), max(e.t for e in mine)
    ax.set_xlim(lo - 0.015 * (hi - lo), hi + 0.06 * (hi - lo))
    ax.set_ylim(-1.0, len(workers) + 0.55)

    # uploads of the parameter: before_upload ... after_use on one worker
    for thread in workers:
        start: Event | None = None
        for e in (e for e in mine if e.thread == thread):
            if e.kind == "before_upload":
                start = e
            elif e.kind == "after_use" and start is not None:
                ax.broken_barh(
                    [(start.t, max(e.t - start.t, 0.3))],
                    (lanes[thread] - 0.38, 0.76),
                    facecolors=WINDOW_SHADES[e.window % len(WINDOW_SHADES)],
                    edgecolors="#999999",
                    linewidth=0.6,
                    zorder=1,
                )
                ax.text(
                    start.t,
                    lanes[thread] + 0.42,
                    f"w{e.window}",
                    ha="center",
                    va="bottom",
                    fontsize=6,
                    color="#444444",
                    zorder=2,
                )
                start = None

    # the optimizer's steps
    for e in mine:
        if e.kind == "step_begin":
            end = next(f for f in mine if f.kind == "step_end" and f.window == e.window)
            ax.broken_barh(
                [(e.t, max(end.t - e.t, 0.5))],
                (-0.3, 0.6),
                facecolors="#bbbbbb",
                edgecolors="#666666",
                linewidth=0.6,
                zorder=2,
            )
            ax.text(e.t, -0.33, f"step {e.window}", ha="center", va="top", fontsize=7, zorder=2)

    for kind, (marker, colour, _, _) in KINDS.items():
        pts = [e for e in mine if e.kind == kind]
        ax.scatter(
            [e.t for e in pts],
            [y(e) for e in pts],
            marker=marker,
            s=36,
            color=colour,
            edgecolors="black",
            linewidths=0.4,
            zorder=6,
        )

    # rules 1-4: one arrow per observed dependency, numbered at the arc's middle
    to_px, to_data = ax.transData.transform, ax.transData.inverted().transform
    bends = {1: 0.35, 2: 0.3, 3: -0.35, 4: 0.12}
    for rule, p, c in dependencies(events, param, copies):
        colour = RULE_COLOURS[rule]
        ax.annotate(
            "",
            xy=(c.t, y(c)),
            xytext=(p.t, y(p)),
            arrowprops={
                "arrowstyle": "-|>,head_length=0.5,head_width=0.25",
                "color": colour,
                "lw": 1.2,
                "shrinkA": 4,
                "shrinkB": 5,
                "connectionstyle": f"arc3,rad={bends[rule]}",
            },
            zorder=4,
        )
        # matplotlib's arc3 is a quadratic Bezier whose control point lies
        # rad * (dy, -dx) off the chord's middle; the curve's middle is half-way
        (x0, y0), (x1, y1) = to_px((p.t, y(p))), to_px((c.t, y(c)))
        f = bends[rule] / 2
        mx, my = to_data(((x0 + x1) / 2 + f * (y1 - y0), (y0 + y1) / 2 - f * (x1 - x0)))
        ax.text(
            mx,
            my,
            str(rule),
            ha="center",
            va="center",
            fontsize=7,
            color="white",
            fontweight="bold",
            bbox={"boxstyle": "circle,pad=0.15", "fc": colour, "ec": "none"},
            zorder=7,
        )

    # rule 5: each update's G copy, step and P copy, in order, on one thread
    for update in updates(events, param):
        if not update:
            continue
        lo, hi = update[0].t, update[-1].t
        ax.annotate(
            "",
            xy=(lo, -0.62),
            xytext=(hi, -0.62),
            arrowprops={
                "arrowstyle": "|-|,widthA=0.25,widthB=0.25",
                "color": RULE_COLOURS[5],
                "shrinkA": 0,
                "shrinkB": 0,
            },
        )
        ax.text(
            (lo + hi) / 2,
            -0.69,
            f"5: update {update[0].window}"
            + ("" if update[-1].kind == "p_copied" else " (P copy pending)"),
            ha="center",
            va="top",
            fontsize=7,
            color=RULE_COLOURS[5],
        )

    ax.set_yticks(list(lanes.values()), [_lane_name(t) for t in lanes])
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("time since the first forward_backward (ms)", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color="#eeeeee", zorder=0)
    ax.set_axisbelow(True)
    ax.set_title(
        f"Five ordering rules, recorded on "
        f"{sum(t.startswith('roundpipe-worker-') for t in workers)} CPU workers and their "
        f"couriers (parameter: {param})",
        fontsize=11,
    )
    handles = [
        Line2D(
            [],
            [],
            marker=m,
            color=c,
            markeredgecolor="black",
            markeredgewidth=0.4,
            linestyle="",
            markersize=6,
            label=text,
        )
        for m, c, _, text in KINDS.values()
    ]
    handles += [
        Patch(
            facecolor=WINDOW_SHADES[0],
            edgecolor="#999999",
            label="upload of the weight, window w",
        ),
        Patch(facecolor="#bbbbbb", edgecolor="#666666", label="optimizer step (fn)"),
    ]
    handles += [
        Line2D([], [], color=RULE_COLOURS[r], lw=1.4, label=text)
        for r, text in (
            (
                1,
                "1: P copy of update w waits for window w's uploads (two master copies)"
                if copies == 2
                else "1: P copy of update w waits for window w+1's uploads (one master copy)",
            ),
            (2, "2: window k uploads after the P copy of update k-2"),
            (3, "3: G copy of update w waits for window w's gradients"),
            (4, "4: window w+1's gradients are added after update w released the buffer"),
            (5, "5: one thread, per update: G copy, step, release, P copy"),
        )
    ]
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.45, -0.17),
        ncol=3,
        fontsize=7,
        frameon=False,
        columnspacing=1.5,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent.parent / "docs/images")
    parser.add_argument("--windows", type=int, default=4, help="optimizer steps to record")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the delays")
    parser.add_argument(
        "--copies", type=int, choices=(1, 2), default=2, help="master copies (double_buffer)"
    )
    args = parser.parse_args(argv)
    events = record(args.windows, args.seed, args.copies)
    broken = [
        f"{param}: {text}"
        for param in sorted({e.param for e in events if e.param})
        for text in violations(events, param, args.copies)
    ]
    if broken:  # the runtime broke an ordering rule: a bug, never a picture
        raise RuntimeError("ordering rule violated in the recorded trace:\n" + "\n".join(broken))
    return plot(events, args.out / OUT_NAME, copies=args.copies)


if __name__ == "__main__":
    print(f"wrote {main()}")

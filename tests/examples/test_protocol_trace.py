"""examples/protocol_trace.py: the recorded trace obeys the optimizer's five
ordering rules, and the diagram is written."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PARAMS = ("layer 0 weight", "layer 4 weight")
WINDOWS = 3


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def times(events, kind, window, param=""):
    return [e.t for e in events if e.kind == kind and e.window == window and e.param == param]


@pytest.mark.parametrize(("seed", "copies"), [(0, 2), (1, 1)])
def test_recorded_trace_obeys_the_five_rules(seed, copies):
    events = load("protocol_trace").record(windows=WINDOWS, seed=seed, copies=copies)
    opt = "roundpipe-optimizer"
    for e in events:
        on_optimizer = e.kind in (
            "wait_grads",
            "g_copied",
            "released",
            "p_copied",
            "step_begin",
            "step_end",
        )
        assert (e.thread == opt) == on_optimizer, e
        if e.kind in ("before_add", "after_grad"):  # gradients are added off the workers
            assert e.thread.startswith("roundpipe-courier-"), e
        elif not on_optimizer:
            assert e.thread.startswith("roundpipe-worker-"), e

    for param in PARAMS:

        def t(kind, window, param=param):
            return times(events, kind, window, param)

        # every window read, used and accumulated into the parameter; each
        # update's G copy ran once; with one master copy the P copy of update
        # w needs window w + 1 closed, so the last update's copy is still
        # pending; with two it is done (synchronize waits for it)
        for w in range(WINDOWS):
            for kind in ("before_upload", "after_use", "before_add", "after_grad"):
                assert t(kind, w), f"{param}: no {kind} in window {w}"
            assert len(t("g_copied", w)) == 1, f"{param}: G copies of update {w}"
        for w in range(WINDOWS - 1):
            assert len(t("p_copied", w)) == 1, f"{param}: P copies of update {w}"
        assert len(t("p_copied", WINDOWS - 1)) == (copies == 2)

        for w in range(WINDOWS):
            (g,) = t("g_copied", w)
            # rule 3: the G copy follows every gradient of its window
            assert g >= max(t("after_grad", w)), f"{param}: rule 3, window {w}"
            # rule 4: the next window's gradients are added only after the step
            # released the buffer
            (r,) = t("released", w)
            assert r >= g, f"{param}: released before its G copy, window {w}"
            if w + 1 < WINDOWS:
                assert min(t("before_add", w + 1)) >= r, f"{param}: rule 4, window {w + 1}"
        for w in range(WINDOWS - 1):
            (p,) = t("p_copied", w)
            # rule 1: the P copy follows every upload of the windows that read
            # the copy it writes: w - 1 and w (two copies) or w and w + 1 (one)
            readers = (w - 1, w) if copies == 2 else (w, w + 1)
            uses = [u for r in readers for u in t("after_use", r)]
            assert p >= max(uses), f"{param}: rule 1, {w}"
            # rule 2: window w + 2 reads the master copy only after it
            if w + 2 < WINDOWS:
                assert min(t("before_upload", w + 2)) >= p, f"{param}: rule 2, window {w + 2}"

        # rule 5: one thread runs G copy, step, P copy of each update, in order
        order = []
        for w in range(WINDOWS):
            order += t("wait_grads", w) + t("g_copied", w)
            order += times(events, "step_begin", w) + times(events, "step_end", w)
            order += t("released", w) + t("p_copied", w)
        assert len(order) == 6 * WINDOWS - (copies == 1)
        assert order == sorted(order), f"{param}: rule 5"


def test_violations_are_detected():
    """The example's own check finds a dependency that runs backwards."""
    mod = load("protocol_trace")
    events = mod.record(windows=WINDOWS)
    for param in PARAMS:
        assert mod.violations(events, param) == []
        deps = mod.dependencies(events, param)
        assert {rule for rule, _, _ in deps} == {1, 2, 3, 4}
    # move the P copy of update 0 before window 0's last upload of the copy it
    # writes: rule 1 is broken
    param = PARAMS[0]
    last_use = max(times(events, "after_use", 0, param))
    forged = [
        dataclasses.replace(e, t=last_use - 0.5)
        if e.kind == "p_copied" and e.window == 0 and e.param == param
        else e
        for e in events
    ]
    assert any(v.startswith("rule 1") for v in mod.violations(forged, param))


def test_diagram_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    path = load("protocol_trace").main(["--out", str(tmp_path)])
    assert path == tmp_path / "protocol-rules.png"
    data = path.read_bytes()
    assert data[:4] == b"\x89PNG" and len(data) > 10_000

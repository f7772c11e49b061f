import functools
import gc
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest


def _cores() -> int:
    """The cores this process may run on (a container's share, not the host's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config):
    """How many test processes ``-n auto`` (the default options) starts: one
    per core and one more, at most 4. Many tests wait (for child processes
    they started, watchdog timeouts, injected delays) while their process
    holds a core's share; the extra process keeps the cores busy then (on
    two cores, 2 processes kept them 91% busy and took 11:40 here, 3 kept
    them 96% busy and took 9:30 to 10:30). More would only compete for the
    cores: many tests run two CPU workers or child processes of their own."""
    return max(1, min(4, _cores() + 1))


def pytest_configure(config):
    """In a test process of several (pytest-xdist), torch computes with this
    process's share of the cores, and so do the child processes its tests
    start: the CPU workers' threads each run torch's intra-op threads, and
    oversubscribed they spin for their turn (a test several times slower)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    threads = max(1, _cores() // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        import torch
    except ImportError:  # the planning tests do not need torch
        return
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when no CUDA device is present; with one,
    run them one after another in one test process (they measure the
    device's memory)."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # the planning tests do not need torch
        has_cuda = False
    if has_cuda:
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.xdist_group("cuda"))
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cuda_allocated():
    """Measures the device memory the caching allocator counts as in use, with
    the device idle and cuBLAS's per-stream workspaces released: cuBLAS keeps
    one for every stream it ran on until they are cleared (Lightning clears
    them at teardown), which is not memory a run left behind."""
    import torch

    def measure() -> int:
        torch.cuda.synchronize()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        return torch.cuda.memory_allocated()

    return measure


@pytest.fixture(autouse=True)
def no_thread_leak():
    """Every test must leave no thread of its own running."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    for t in leaked:
        t.join(timeout=5)
    leaked = [t for t in leaked if t.is_alive()]
    assert not leaked, f"threads outlived the test: {[t.name for t in leaked]}"


def pytest_addoption(parser):
    parser.addoption(
        "--stress-runs",
        type=int,
        default=20,
        help="seeds for the optimizer-protocol stress test (CI runs the default)",
    )
    parser.addoption(
        "--chaos-runs",
        type=int,
        default=3,
        help="seeds for the Lightning-level chaos test (CI runs the default)",
    )


@pytest.fixture
def chaos_runs(request):
    return request.config.getoption("--chaos-runs")


@pytest.fixture
def stress_runs(request):
    return request.config.getoption("--stress-runs")


def _at_once(*calls):
    """Run zero-argument callables at once and return their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


@pytest.fixture
def concurrently():
    """:func:`_at_once`, for calls that each wait on a child process of their
    own (its start-up, importing torch and Lightning, is most of a short
    child's time)."""
    return _at_once


LONG_FIT = dict(
    vocab=32_000,
    hidden=64,
    mlp=2,
    layers=4,
    batch=1,
    tile_memory=8_000_000,
    device_memory_limit=2**34,
    live=True,
)
"""The one-step long-sequence fit whose peaks tests/test_memory.py and
tests/test_tiling.py both read: one sequence per micro-batch, a 32,000-token
vocabulary, the loss chunked and the MLPs tiled, fp32 on one CPU worker,
resident memory following the live tensors (``live``)."""


@pytest.fixture(scope="session")
def long_fit_peaks():
    """``{tokens: (measured peak growth, predicted peak stage bytes)}`` of
    :data:`LONG_FIT` at 256 and 8,192 tokens, each fit in a fresh process
    (benchmarks/long_context.py), the two at once and once per session: the
    fits cost most of a minute."""
    from test_benchmarks import load

    mod = load("long_context")
    seqs = (256, 8192)
    peaks = _at_once(*[functools.partial(mod.peak_growth, seq, **LONG_FIT) for seq in seqs])
    return dict(zip(seqs, peaks, strict=True))


def pytest_collection_finish(session):
    """Everything imported by now (torch, Lightning, transformers, the test
    modules: about half a million objects) leaves the garbage collector's
    view: each full collection scanned them all again (0.4 s), and
    Lightning's batch-size finder runs one per trial, the interpreter one
    whenever allocations pile up. Later objects are collected as usual."""
    gc.collect()
    gc.freeze()

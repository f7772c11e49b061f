import threading
from concurrent.futures import ThreadPoolExecutor

import pytest


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when no CUDA device is present."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # the planning tests do not need torch
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
        default=30,
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


@pytest.fixture
def concurrently():
    """Run zero-argument callables at once and return their results in order:
    for calls that each wait on a child process of their own (its start-up,
    importing torch and Lightning, is most of a short child's time)."""

    def run(*calls):
        with ThreadPoolExecutor(len(calls)) as pool:
            return [f.result() for f in [pool.submit(c) for c in calls]]

    return run

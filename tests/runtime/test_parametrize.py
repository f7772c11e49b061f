"""torch's parametrization cache, made per thread while stages run on several
threads (PEFT's LoRA on experts opens ``parametrize.cached()`` in every
forward)."""

import threading

import torch
from torch import nn
from torch.nn.utils import parametrize

from lightning_roundpipe.runtime import RoundPipeEngine
from lightning_roundpipe.runtime.parametrize import cached, install


class Plus(nn.Module):
    """A parametrization adding a tensor the test changes between calls."""

    def __init__(self) -> None:
        super().__init__()
        self.delta = torch.zeros(())

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + self.delta


def layer() -> tuple[nn.Linear, Plus]:
    lin = nn.Linear(2, 2, bias=False)
    plus = Plus()
    parametrize.register_parametrization(lin, "weight", plus)
    return lin, plus


def test_a_threads_cached_values_end_with_its_own_context():
    """Thread B caches inside its context, leaves it, changes the
    parametrization and enters again, while thread A's context stays open
    all along: B must see the new value. torch's global cache gave it the
    old one (only the last context to close empties it): a layer's next
    forward got the weights, and the freed graph, of the one before."""
    install()
    assert parametrize.cached is cached
    inside, done = threading.Event(), threading.Event()
    seen: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def a() -> None:
        with parametrize.cached():
            inside.set()
            done.wait(10)

    def b() -> None:
        try:
            inside.wait(10)
            lin, plus = layer()
            with parametrize.cached():
                seen.append(lin.weight.detach().clone())
            plus.delta = torch.ones(())
            with parametrize.cached():
                seen.append(lin.weight.detach().clone())
            # outside a context of its own, nothing is cached for it either
            plus.delta = torch.full((), 2.0)
            seen.append(lin.weight.detach().clone())
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and len(seen) == 3
    torch.testing.assert_close(seen[1], seen[0] + 1)
    torch.testing.assert_close(seen[2], seen[0] + 2)


def test_within_a_context_a_thread_computes_each_value_once():
    install()
    lin, plus = layer()
    calls = []
    original = plus.forward

    def counted(w):
        calls.append(1)
        return original(w)

    plus.forward = counted
    with parametrize.cached():
        with parametrize.cached():  # (nested: still the one cache)
            first = lin.weight
        assert lin.weight is first
    assert len(calls) == 1
    lin.weight  # noqa: B018 (outside: computed again)
    assert len(calls) == 2


def test_an_engine_installs_it(monkeypatch):
    from lightning_roundpipe.runtime import parametrize as ours

    monkeypatch.setattr(parametrize, "cached", ours._TORCH_CACHED)
    monkeypatch.setattr(parametrize, "_cache", {})
    with RoundPipeEngine([nn.Linear(2, 2)], ["cpu"], 1):
        assert parametrize.cached is cached
        assert parametrize._cache is ours._CACHE


def test_a_context_closed_on_another_thread_still_ends_its_own():
    """A context entered on one thread and closed on another (a generator
    finished elsewhere) ends the entering thread's cache: its next context
    computes afresh."""
    install()
    lin, plus = layer()
    ctx = parametrize.cached()
    ctx.__enter__()
    first = lin.weight.detach().clone()
    errors: list[BaseException] = []

    def close() -> None:
        try:
            ctx.__exit__(None, None, None)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=close)
    t.start()
    t.join(10)
    assert not errors
    plus.delta = torch.ones(())
    with parametrize.cached():
        torch.testing.assert_close(lin.weight.detach(), first + 1)

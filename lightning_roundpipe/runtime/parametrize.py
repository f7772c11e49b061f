"""A per-thread cache for ``torch.nn.utils.parametrize.cached``.

torch keeps the values of parametrized tensors that ``cached()`` computes in
one module-global dict, keyed by the module's ``id``, with one global count of
open contexts; the dict is emptied only when the count drops to zero. With
stages on several worker threads that is wrong: while one thread's context is
open, another thread's cached values outlive its own context, and its next
forward through the same layer finds them again: weights from the step before
and a graph autograd has already freed ("Trying to backward through the graph
a second time"). PEFT's LoRA on parameters (``target_parameters``, which it
also chooses for Mixture-of-Experts experts) opens such a context in every
forward, so two workers running adapted experts at once met it.

:func:`install` replaces ``cached`` and the dict with per-thread ones: inside
its own context a thread caches as before; outside it a thread computes every
value afresh, as torch does without a context, even while another thread's
context is open. Written here because torch has no thread-safe variant; a
single thread sees torch's behaviour unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from torch.nn.utils import parametrize as _parametrize

__all__ = ["cached", "install"]

_lock = threading.Lock()
_TORCH_CACHED = _parametrize.cached  # torch's own (tests restore it)


class _ThreadState:
    __slots__ = ("cache", "depth")

    def __init__(self) -> None:
        self.depth = 0
        self.cache: dict | None = None  # None: outside any context


class _PerThreadCache(dict):
    """Stands in for torch's cache dict: each thread's entries live in its
    own dict while it is inside :func:`cached` (the outer dict stays empty);
    outside, nothing is found and nothing kept."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def state(self) -> _ThreadState:
        """The calling thread's depth of contexts and its cache."""
        st = getattr(self.local, "state", None)
        if st is None:
            st = self.local.state = _ThreadState()
        return st

    def _own(self) -> dict | None:
        st = getattr(self.local, "state", None)
        return None if st is None else st.cache

    def get(self, key: Any, default: Any = None) -> Any:
        own = self._own()
        return default if own is None else own.get(key, default)

    def __getitem__(self, key: Any) -> Any:
        own = self._own()
        if own is None:
            raise KeyError(key)
        return own[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        own = self._own()
        if own is not None:
            own[key] = value

    def __contains__(self, key: object) -> bool:
        own = self._own()
        return own is not None and key in own


_CACHE = _PerThreadCache()


@contextlib.contextmanager
def cached() -> Iterator[None]:
    """``torch.nn.utils.parametrize.cached`` for the calling thread only."""
    # (the entering thread's own state: a context closed on another thread,
    # as a generator may be, still ends this thread's)
    st = _CACHE.state()
    if st.depth == 0:
        st.cache = {}
    st.depth += 1
    with _lock:
        # torch's getter consults the cache only while its global count is
        # non-zero; what it then finds is this thread's alone
        _parametrize._cache = _CACHE
        _parametrize._cache_enabled += 1
    try:
        yield
    finally:
        with _lock:
            _parametrize._cache_enabled -= 1
        st.depth -= 1
        if st.depth == 0:
            st.cache = None


def install() -> None:
    """Use :func:`cached` for ``torch.nn.utils.parametrize.cached`` (once per
    process; idempotent). PEFT and others call it through the module, so
    their contexts become per-thread. A reference to torch's own function
    taken before (``from torch.nn.utils.parametrize import cached``; none of
    torch's training code, transformers, PEFT or Lightning does) still opens
    torch's process-wide cache."""
    with _lock:
        if _parametrize.cached is not cached:
            _parametrize.cached = cached
            _parametrize._cache = _CACHE

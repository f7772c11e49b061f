"""Per-layer timing, measured while training, for the partitioner.

Workers time every layer's forward (in forward stages, the fused stage and
recomputes) and backward for one micro-batch: wall-clock on CPU devices, CUDA
events on GPUs (recorded on the compute stream, read once the task's work is
known complete). Backward times come from gradient hooks at layer boundaries:
the gradient reaching a layer's output marks the start of its backward, the
gradient reaching its input the end.

While profiling, the bytes each layer's forward saves for its backward (its
activations for one micro-batch, on the device that ran it) are counted too and
added to the size-based memory of weights and gradients, so a re-plan keeps
stages within the device memory limit including activations.

The first profiled iteration is discarded (allocator and kernel warm-up); the
remaining samples of each layer are reduced to their median, which shrugs off
the odd slow micro-batch. :meth:`Profiler.costs` turns them into
:class:`~lightning_roundpipe.plan.LayerCosts` for the partitioner.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..plan import LayerCosts

__all__ = ["LayerTimer", "Profiler", "Stopwatch", "saved_bytes"]


class LayerTimer:
    """Timing of one micro-batch through one stage: forward marks per layer,
    backward boundary marks (gradient arrival at each layer's input/output),
    and the bytes each layer's forward saved for its backward."""

    def __init__(self, watch: Stopwatch) -> None:
        self.watch = watch
        self.forward: dict[int, tuple[int, int]] = {}
        self.boundary: dict[int, int] = {}
        self.saved: dict[int, int] = {}

    def hook(self, boundary: int):
        def mark(grad: torch.Tensor) -> None:
            self.boundary.setdefault(boundary, self.watch.mark())

        return mark

    def samples(
        self, start: int, stop: int
    ) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        w = self.watch
        fwd = [(layer, w.elapsed(a, b)) for layer, (a, b) in self.forward.items()]
        bwd = []
        for layer in range(start, stop):
            top, bottom = self.boundary.get(layer + 1), self.boundary.get(layer)
            if top is not None and bottom is not None:
                bwd.append((layer, w.elapsed(top, bottom)))
        return fwd, bwd


def _footprint(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage address, data address, bytes) of a tensor, or None where it has
    no plain storage to ask about (wrapper subclasses, sparse or meta tensors):
    counting must never fail a step."""
    try:
        return t.untyped_storage().data_ptr(), t.data_ptr(), t.nbytes
    except Exception:
        return None


@contextmanager
def saved_bytes(module: torch.nn.Module, into: dict[int, int], key: int) -> Iterator[None]:
    """Count the bytes autograd saves for backward while the block runs (the
    activation memory a layer holds per micro-batch until its backward), each
    tensor once and the module's own parameters (and views of them) not at all;
    the total goes to ``into[key]``. Saved-tensor hooks are per thread, so
    workers do not mix. Tensors without plain storage are not counted."""
    skip = {f[0] for p in module.parameters() if (f := _footprint(p)) is not None}
    seen: set[tuple[int, int]] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        f = _footprint(t)
        # a view counts its own bytes (a micro-batch is a view of the batch on CPU)
        if f is not None and f[0] not in skip and f[1:] not in seen:
            seen.add(f[1:])
            total += f[2]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
    into[key] = total


class Stopwatch:
    """Marks on one device; ``elapsed(a, b)`` in seconds once resolved."""

    def __init__(self, cuda: bool, stream: Any = None) -> None:
        self.cuda = cuda
        self.stream = stream
        self.marks: list[Any] = []

    def mark(self) -> int:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def elapsed(self, a: int, b: int) -> float:
        if self.cuda:
            self.marks[a].synchronize()
            self.marks[b].synchronize()
            return self.marks[a].elapsed_time(self.marks[b]) / 1e3
        return self.marks[b] - self.marks[a]


class Profiler:
    """Collects per-layer forward/backward samples from all workers.

    Args:
        num_layers: layers in the pipeline.
        iterations: iterations to profile after the discarded first one.
    """

    def __init__(self, num_layers: int, iterations: int) -> None:
        self.num_layers = num_layers
        self.iterations = iterations
        self._lock = threading.Lock()
        self._fwd: dict[int, list[float]] = defaultdict(list)
        self._bwd: dict[int, list[float]] = defaultdict(list)
        self._saved: dict[int, int] = {}
        self._seen: set[int] = set()

    def wants(self, iteration: int) -> bool:
        """Whether this (non-negative) iteration is being profiled; the first is
        warm-up and is timed but dropped."""
        return 0 <= iteration <= self.iterations

    def add(
        self,
        iteration: int,
        forward: list[tuple[int, float]],
        backward: list[tuple[int, float]],
        saved: dict[int, int] | None = None,
    ) -> None:
        """Samples ``(layer, seconds)`` of one task and the bytes each layer saved
        for backward (``saved``); iteration 0 is warm-up."""
        if iteration == 0:
            return
        with self._lock:
            self._seen.add(iteration)
            for layer, nbytes in (saved or {}).items():
                self._saved[layer] = max(self._saved.get(layer, 0), nbytes)
            for layer, t in forward:
                self._fwd[layer].append(t)
            for layer, t in backward:
                self._bwd[layer].append(t)

    @property
    def complete(self) -> bool:
        with self._lock:
            return len(self._seen) >= self.iterations and all(
                self._fwd.get(i) and self._bwd.get(i) for i in range(self.num_layers)
            )

    def activation_bytes(self) -> list[int]:
        """Largest number of bytes each layer saved for backward for one
        micro-batch (0 where nothing was measured)."""
        with self._lock:
            return [self._saved.get(i, 0) for i in range(self.num_layers)]

    def costs(
        self, memory: list[float] | None = None, weight_bytes: list[float] | None = None
    ) -> LayerCosts:
        """Median forward and backward time of each layer for one micro-batch;
        ``memory`` (weights and gradients) gets the measured activation bytes
        added."""
        with self._lock:
            missing = [
                i for i in range(self.num_layers) if not self._fwd.get(i) or not self._bwd.get(i)
            ]
            if missing:
                raise RuntimeError(f"no timing yet for layers {missing}")
            fwd = [statistics.median(self._fwd[i]) for i in range(self.num_layers)]
            bwd = [max(0.0, statistics.median(self._bwd[i])) for i in range(self.num_layers)]
        if memory is not None:
            memory = [m + a for m, a in zip(memory, self.activation_bytes(), strict=True)]
        return LayerCosts(fwd, bwd, memory=memory, weight_bytes=weight_bytes)

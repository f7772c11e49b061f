"""Per-layer timing, measured while training, for the partitioner.

Workers time every layer's forward (in forward stages, the fused stage and
recomputes) and backward for one micro-batch: wall-clock on CPU devices, CUDA
events on GPUs (recorded on the compute stream, read once the task's work is
known complete). Backward times come from gradient hooks at layer boundaries:
the gradient reaching a layer's output marks the start of its backward, the
gradient reaching its input the end.

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
from typing import Any

import torch

from ..plan import LayerCosts

__all__ = ["LayerTimer", "Profiler", "Stopwatch"]


class LayerTimer:
    """Timing of one micro-batch through one stage: forward marks per layer and
    backward boundary marks (gradient arrival at each layer's input/output)."""

    def __init__(self, watch: Stopwatch) -> None:
        self.watch = watch
        self.forward: dict[int, tuple[int, int]] = {}
        self.boundary: dict[int, int] = {}

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
    ) -> None:
        """Samples ``(layer, seconds)`` of one task; iteration 0 is warm-up."""
        if iteration == 0:
            return
        with self._lock:
            self._seen.add(iteration)
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

    def costs(
        self, memory: list[float] | None = None, weight_bytes: list[float] | None = None
    ) -> LayerCosts:
        """Median forward and backward time of each layer for one micro-batch."""
        with self._lock:
            missing = [
                i for i in range(self.num_layers) if not self._fwd.get(i) or not self._bwd.get(i)
            ]
            if missing:
                raise RuntimeError(f"no timing yet for layers {missing}")
            fwd = [statistics.median(self._fwd[i]) for i in range(self.num_layers)]
            bwd = [max(0.0, statistics.median(self._bwd[i])) for i in range(self.num_layers)]
        return LayerCosts(fwd, bwd, memory=memory, weight_bytes=weight_bytes)

"""The RoundPipe engine: the controller that runs a stage plan on a pool of devices.

The caller's thread is the controller. ``forward_backward`` splits the batch
into micro-batches, puts their inputs into the host activation store, and
dispatches the iteration's stage slots round-robin to the device workers
(:mod:`.worker`); it returns the loss as soon as every micro-batch's loss is
known, while backward stages may still be running. The next call continues
the rotation where this one stopped. ``synchronize`` waits for all
outstanding work and exposes the accumulated fp32 gradients as ``.grad``;
``step(fn)`` runs an optimizer step on the host and refreshes the master copy.

    engine = RoundPipeEngine(layers, devices=[torch.device("cpu")] * 3, num_microbatches=4)
    loss = engine.forward_backward(inputs, labels=labels, loss_fn=loss_fn)
    engine.step(optimizer.step)
    engine.close()
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from ..plan import LayerCosts, PlanError, StagePlan, dispatch, partition, round_size
from ..plan.stages import Stage
from .device import pin
from .host import HostState
from .nested import batch_size_of, map_tensors, merge_microbatches, split_microbatches
from .optimizer import (
    PRECISIONS,
    HookError,
    LossScaler,
    NonFiniteError,
    OptimizerStepError,
    OptimizerWorker,
    Precision,
    Protocol,
    StepHandle,
    _Job,
)
from .profiler import Profiler
from .store import EngineFailure, HandoffTimeout, Store
from .worker import Call, Layout, Task, Worker, WorkerError

__all__ = ["EngineClosedError", "RoundPipeEngine", "estimate_costs"]

log = logging.getLogger(__name__)


class EngineClosedError(RuntimeError):
    """The engine was closed; create a new one."""


def estimate_costs(layers: Sequence[nn.Module], compute_dtype: torch.dtype) -> LayerCosts:
    """Size-based layer costs used until measurements exist.

    Forward time is taken proportional to a layer's parameter count (matmul
    FLOPs per token are ~2 x parameters) with a small floor so parameter-free
    layers still cost something; backward is twice the forward for layers with
    trainable weights (input and weight gradients) and equal to it otherwise.
    Memory is weights plus gradients in the compute dtype."""
    size = torch.empty(0, dtype=compute_dtype).element_size()
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    floor = max(1.0, 1e-3 * max(counts, default=1))
    fwd, bwd, mem = [], [], []
    for layer, n in zip(layers, counts, strict=True):
        f = n + floor
        trainable = any(p.requires_grad for p in layer.parameters())
        fwd.append(f)
        bwd.append(2 * f if trainable else f)
        grads = sum(p.numel() for p in layer.parameters() if p.requires_grad)
        mem.append((n + grads) * size)
    return LayerCosts(fwd, bwd, memory=mem, weight_bytes=[n * size for n in counts])


def tightest(*limits: float | None) -> float | None:
    """The smallest of the memory limits that are set (None when none is)."""
    given = [x for x in limits if x is not None]
    return min(given) if given else None


def _as_device(d: torch.device | str | int) -> torch.device:
    if isinstance(d, int):
        d = torch.device("cuda", d)
    elif not isinstance(d, torch.device):
        d = torch.device(d)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _check_uniform(devs: list[torch.device]) -> None:
    """All workers must draw the same dropout masks for the same seed: a layer's
    forward and its recompute may run on different devices."""
    kinds = sorted({d.type for d in devs})
    if len(kinds) > 1:
        raise ValueError(
            f"devices mix {' and '.join(kinds)}; random numbers (dropout) differ between "
            "device types, so a recompute would not match its forward. Use one device type"
        )
    if kinds == ["cuda"]:
        models = {}
        for d in devs:
            prop = torch.cuda.get_device_properties(d)
            models[(prop.name, prop.multi_processor_count)] = d
        if len(models) > 1:
            raise ValueError(
                f"devices are different GPU models ({', '.join(n for n, _ in models)}); "
                "their dropout masks differ for the same seed. Use identical GPUs"
            )


def _bandwidth(device: torch.device, nbytes: int = 64 << 20, repeat: int = 3) -> float:
    """Host-to-device bytes per second from page-locked memory (CUDA)."""
    with torch.cuda.device(device):  # events and copies on the same device
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst.copy_(src, non_blocking=True)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()  # note: a CPU-GPU sync point, once, at re-planning time
        ms = start.elapsed_time(end)
    return nbytes * repeat / max(ms / 1e3, 1e-9)


class _Runtime:
    """State shared by the controller and the workers.

    It holds no reference to the engine, so an engine that is dropped without
    ``close()`` is garbage collected and its finalizer stops the threads."""

    def __init__(self, host: HostState, store: Store) -> None:
        self.host = host
        self.store = store
        self.workers: list[Worker] = []
        self.optimizer: OptimizerWorker | None = None
        self.submitted = 0
        self.done = 0
        self.done_keys: set[tuple] = set()
        self.closed = False

    def task_done(self, task: Task) -> None:
        with self.store.lock:
            self.done += 1
            self.done_keys.add(task.key)
            self.store.lock.notify_all()

    def is_done(self, key: tuple) -> bool:
        return key in self.done_keys

    def shutdown(self, join_timeout: float = 30.0) -> list[str]:
        """Stop and join every worker; returns the names of threads that did not stop."""
        if self.closed:
            return []
        self.closed = True
        self.store.fail(EngineClosedError("the RoundPipe engine was closed"))
        for w in self.workers:
            w.stop()
            w.wake()
        threads = [w.thread for w in self.workers]
        if self.optimizer is not None and self.optimizer.thread is not None:
            self.optimizer.stop()
            threads.append(self.optimizer.thread)
        stuck = []
        deadline = time.monotonic() + join_timeout
        for t in threads:
            if t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                stuck.append(t.name)
        self.store.clear()
        if not stuck:  # a stuck worker may still be copying from page-locked memory
            self.host.free()
            if self.optimizer is not None:
                self.optimizer._grads.clear()
        return stuck


class RoundPipeEngine:
    """Runs a layer list as a RoundPipe pipeline on a pool of devices.

    Args:
        layers: the model as an ordered list of modules; the output of layer
            ``i`` (a tensor or a tuple/dict of tensors) is the input of layer
            ``i + 1``. Their parameters stay the optimizer copy, on the host.
        devices: one worker per entry (``torch.device``, ``"cuda:0"``, ``0``,
            ``"cpu"``); entries may repeat to let several workers share one
            device.
        num_microbatches: ``M``, micro-batches per ``forward_backward``; must be
            ``>= len(devices)``.
        plan: a :class:`StagePlan` or its compact text; default: the partitioner's
            plan from size-based estimates.
        microbatches_per_round: ``M_R`` (default: the number of devices).
            ``"auto"``: once per-layer times are measured, the smallest round
            whose compute hides every stage's weight upload at the measured
            host-to-device bandwidth (CUDA; CPU workers copy nothing).
        fit_to_batch: a batch smaller than ``num_microbatches`` (but at least
            ``len(devices)``) is split into one-sample micro-batches instead of
            being refused (for a short last batch of an epoch).
        precision: ``"32-true"`` (fp32 compute), ``"bf16-mixed"`` / ``"bf16-true"``
            (bf16 master copy and compute), ``"16-mixed"`` (fp16 with dynamic
            loss scaling). The optimizer copy keeps the parameters' own dtype.
        async_optimizer: run ``step`` on a host thread one step behind
            (staleness 1): window ``k`` computes with the weights after ``k-1``
            updates while the CPU applies update ``k-1``. ``False``: ordinary
            training semantics, ``step`` blocks.
        seed: base seed; layer randomness (dropout) depends only on
            ``(seed, iteration, layer, micro-batch)``.
        watchdog_timeout: seconds any hand-off may take before the wait fails
            with a description of what never arrived.
        device_memory_limit: bytes a stage may use on a CUDA device (default:
            half of the free memory at start, the other half being for the
            prefetched next stage and activations).
        size_limit: a cap on each stage's size-based estimate (weights and
            gradients, the unit of :func:`estimate_costs`) on top of
            ``device_memory_limit``, kept when re-partitioning from measurements.
            The strategy sets it after a stage ran out of device memory.
        optimizer_threads: intra-op threads for the asynchronous optimizer
            thread (``torch.set_num_threads`` there); default: unchanged. Keep
            some cores for the device workers.
        profile_iterations: iterations whose per-layer forward/backward times
            are measured after a discarded warm-up iteration (0: no profiling).
        replan_margin: once measurements exist, switch to the partitioner's plan
            for the measured costs if its objective is better than the current
            plan's by more than this fraction. A plan given by the caller is never
            changed.
        nonfinite: what a NaN/inf loss or gradient does in fp32/bf16:
            ``"raise"`` (a :class:`NonFiniteError` before the weights change),
            ``"skip"`` (the step is skipped, like an fp16 overflow) or
            ``"ignore"``. fp16 always skips and rescales. A step that raises
            (a non-finite gradient, the optimizer, a ``prepare`` hook) leaves
            the engine failed: later calls raise that error at once; build a
            new engine to go on.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        devices: Sequence[torch.device | str | int],
        num_microbatches: int,
        plan: StagePlan | str | None = None,
        *,
        microbatches_per_round: int | Literal["auto"] | None = None,
        fit_to_batch: bool = False,
        precision: Precision = "32-true",
        async_optimizer: bool = False,
        seed: int = 0,
        watchdog_timeout: float = 600.0,
        device_memory_limit: int | None = None,
        optimizer_threads: int | None = None,
        profile_iterations: int = 2,
        replan_margin: float = 0.05,
        nonfinite: Literal["raise", "skip", "ignore"] = "raise",
        size_limit: int | None = None,
    ) -> None:
        # ---- validate everything before touching any state
        if isinstance(layers, nn.Module) and not isinstance(layers, nn.Sequential | nn.ModuleList):
            raise TypeError("layers must be a sequence of nn.Module (e.g. an nn.Sequential)")
        layers = list(layers)
        if not layers:
            raise ValueError("layers is empty; the engine needs at least one layer")
        for i, layer in enumerate(layers):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"layers[{i}] is a {type(layer).__name__}, not an nn.Module")
        devs = [_as_device(d) for d in devices]
        if not devs:
            raise ValueError("devices is empty; give at least one device")
        for d in devs:
            if d.type not in ("cpu", "cuda"):
                raise ValueError(f"device {d} is not supported; use CUDA devices or 'cpu'")
            if d.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {d} requested but CUDA is not available")
        _check_uniform(devs)
        if precision not in PRECISIONS:
            raise ValueError(
                f"precision {precision!r} is not supported; use one of "
                f"{', '.join(repr(p) for p in PRECISIONS)}"
            )
        compute_dtype = PRECISIONS[precision]
        if optimizer_threads is not None and optimizer_threads < 1:
            raise ValueError(f"optimizer_threads must be >= 1, got {optimizer_threads}")
        if nonfinite not in ("raise", "skip", "ignore"):
            raise ValueError(f"nonfinite must be 'raise', 'skip' or 'ignore', got {nonfinite!r}")
        if profile_iterations < 0:
            raise ValueError(f"profile_iterations must be >= 0, got {profile_iterations}")
        if not replan_margin >= 0:
            raise ValueError(f"replan_margin must be >= 0, got {replan_margin!r}")
        user_plan = plan is not None
        if not watchdog_timeout > 0:
            raise ValueError(f"watchdog_timeout must be > 0, got {watchdog_timeout!r}")
        n, m = len(devs), num_microbatches
        if isinstance(plan, str):
            plan = StagePlan.parse(plan, len(layers))
        elif plan is not None:
            plan.validate(len(layers))
        if size_limit is not None and not size_limit > 0:
            raise ValueError(f"size_limit must be > 0, got {size_limit!r}")
        costs = estimate_costs(layers, compute_dtype)
        limit = self._memory_limit(devs, costs, device_memory_limit)
        if plan is None:
            # estimates hold no activations: both limits bound the same numbers
            plan = partition(costs, n, m, memory_limit=tightest(limit, size_limit))
        elif limit is not None:
            worst = max(range(plan.num_slots), key=lambda i: plan.stage_memory(costs)[i])
            need = plan.stage_memory(costs)[worst]
            if need > limit:
                raise PlanError(
                    f"stage {plan.stages[worst].label} of plan {plan} needs about {need} bytes "
                    f"of device memory but the limit is {limit}; give a plan with smaller "
                    "stages, or plan=None to let the partitioner respect the limit"
                )
        self._auto_round = microbatches_per_round == "auto"
        if self._auto_round:
            microbatches_per_round = None  # the number of devices until measured
        dispatch(plan, n, m, microbatches_per_round)  # validates M, M_R against N

        # ---- state
        self._user_plan = user_plan
        self._costs = costs
        self._limit = limit
        self.replan_margin = replan_margin
        self.size_limit = size_limit
        self._profiler = Profiler(len(layers), profile_iterations) if profile_iterations else None
        self._replanned = False
        self.plan = plan
        self.devices = devs
        self.num_microbatches = m
        self.microbatches_per_round = microbatches_per_round
        self.fit_to_batch = fit_to_batch
        self.seed = seed
        self.layers = layers
        self._iteration = 0
        self._g0 = 0
        self._set_plan(plan)
        self._eval_iteration = 0
        self._host = HostState(layers, compute_dtype, pinned=devs[0].type == "cuda")
        self._stateful = {
            st.index: st.kind != "backward" and self._host.stage_has_state(st.start, st.stop)
            for st in plan.stages
        }
        self._lock = threading.Lock()
        self.precision = precision
        self.async_optimizer = async_optimizer
        self._window = 0
        self._window_scale: dict[int, float] = {}
        self.wait_seconds = 0.0  # time the caller's thread spent waiting on the pipeline
        self._last_dispatch: tuple[int, Any] | None = None
        self._window_has_grads = False
        self._jobs = 0
        rt = self._rt = _Runtime(self._host, Store(watchdog_timeout))
        self._protocol = Protocol(self._host, rt.store, async_optimizer)
        self.scaler = LossScaler(enabled=precision == "16-mixed")
        names = {}
        for i, layer in enumerate(layers):
            for name, p in layer.named_parameters():
                for hp in self._host.params:
                    if hp.param is p and hp.index not in names:
                        names[hp.index] = f"layers[{i}].{name}"
        self.nonfinite = nonfinite
        rt.optimizer = self._optimizer = OptimizerWorker(
            self._host,
            rt.store,
            self._protocol,
            self.scaler,
            optimizer_threads,
            nonfinite=nonfinite,
            names=names,
        )
        for i, d in enumerate(devs):
            rt.workers.append(
                Worker(
                    i,
                    d,
                    self._host,
                    rt.store,
                    rt.task_done,
                    rt.is_done,
                    self._protocol,
                )
            )
        self._finalizer = weakref.finalize(self, rt.shutdown)
        for w in rt.workers:
            w.start()
        if async_optimizer:
            self._optimizer.start()
        log.info(
            "RoundPipe engine: %d layers, plan %s, %d workers on %s",
            len(layers),
            plan,
            n,
            ", ".join(map(str, devs)),
        )

    def _set_plan(self, plan: StagePlan) -> None:
        """Install a stage plan (between iterations, with nothing in flight)."""
        self.plan = plan
        self._layout = Layout.of(plan.stages)
        # forward-only slots (evaluation, outputs for a loss computed outside):
        # the forward stages, then the fused stage's layers run forward only
        top = plan.fused_stage
        self._forward_slots = [
            *plan.stages[: len(plan.forward)],
            Stage(len(plan.forward), "Ftop", "forward", *top),
        ]
        self._forward_layout = Layout.of(self._forward_slots, output_readers=1)
        self._last_task: dict[int, tuple] = {}
        if hasattr(self, "_host"):
            self._stateful = {
                st.index: st.kind != "backward" and self._host.stage_has_state(st.start, st.stop)
                for st in plan.stages
            }

    def measured_costs(self) -> LayerCosts | None:
        """Per-layer costs measured so far (median per micro-batch), with the
        size-based memory estimates; ``None`` before profiling is complete."""
        if self._profiler is None or not self._profiler.complete:
            return None
        return self._profiler.costs(
            memory=list(self._costs.memory) if self._costs.memory is not None else None,
            weight_bytes=list(self._costs.weight_bytes)
            if self._costs.weight_bytes is not None
            else None,
        )

    def _maybe_replan(self) -> None:
        """After profiling, switch to the measured plan if it is clearly better,
        or if the current plan's stages exceed the memory limit once their
        measured activations are counted."""
        if self._replanned or self._profiler is None or not self._profiler.complete:
            return
        self._replanned = True
        costs = self.measured_costs()
        n, m, limit = self.num_devices, self.num_microbatches, self._limit
        over = None
        if limit is not None and costs.memory is not None:
            need = self.plan.stage_memory(costs)
            worst = max(range(len(need)), key=need.__getitem__)
            if need[worst] > limit:
                over = (self.plan.stages[worst].label, int(need[worst]))
        if self._user_plan:
            if over is not None:
                log.warning(
                    "RoundPipe: stage %s of the given plan %s needs about %d bytes with its "
                    "measured activations, over the device memory limit of %d; expect an "
                    "out-of-memory error: give a plan with smaller stages or raise "
                    "num_microbatches",
                    over[0],
                    self.plan,
                    over[1],
                    limit,
                )
            return
        self._wait_tasks()  # an iteration boundary with nothing in flight
        try:
            new = self._partition_measured(costs)
        except PlanError as exc:
            log.warning(
                "RoundPipe kept plan %s: no plan fits the device memory limit with the measured "
                "activations (%s); raise num_microbatches (smaller micro-batches) or "
                "device_memory_limit",
                self.plan,
                exc,
            )
            return
        old_obj, new_obj = self.plan.objective(costs, n, m), new.objective(costs, n, m)
        if new != self.plan and (over is not None or new_obj < (1 - self.replan_margin) * old_obj):
            why = (
                f"stage {over[0]} needs about {over[1]} bytes with its measured activations, "
                f"over the limit of {limit}"
                if over is not None
                else f"objective {old_obj:.4g} -> {new_obj:.4g}"
            )
            log.info(
                "RoundPipe re-partitioned from measurements: %s -> %s (%s)", self.plan, new, why
            )
            self._set_plan(new)
        else:
            log.info(
                "RoundPipe kept plan %s after measuring (best %s, objective %.4g vs %.4g)",
                self.plan,
                new,
                old_obj,
                new_obj,
            )
        # the round size for the plan in use
        if self._auto_round and self.devices[0].type == "cuda":
            bandwidth = _bandwidth(self.devices[0])
            self.microbatches_per_round = round_size(
                self.plan, costs, n, bandwidth, max_microbatches=m
            )
            log.info(
                "RoundPipe: %.1f GB/s host to device; %d micro-batches per round",
                bandwidth / 1e9,
                self.microbatches_per_round,
            )

    def _partition_measured(self, costs: LayerCosts) -> StagePlan:
        """The partitioner's plan for measured costs: within the device memory
        limit with measured activations and, if set, within ``size_limit`` for
        the size-based estimates."""
        n, m, limit, cap, est = (
            self.num_devices,
            self.num_microbatches,
            self._limit,
            self.size_limit,
            self._costs,
        )
        plan = partition(costs, n, m, memory_limit=limit)
        if cap is None or max(plan.stage_memory(est)) <= cap:
            return plan

        def fits(p: StagePlan) -> bool:
            return max(p.stage_memory(est)) <= cap and (
                limit is None or max(p.stage_memory(costs)) <= limit
            )

        # the measured times with stages no larger than the cap; if that packs
        # too many activations together, a figure that bounds both at once:
        # within `limit` by max(measured, estimate * limit / cap) means within
        # `limit` measured and within `cap` estimated
        memories = [est.memory]
        if limit is not None:
            memories.append(
                [max(a, b * limit / cap) for a, b in zip(costs.memory, est.memory, strict=True)]
            )
        for memory, bound in zip(memories, (cap, limit), strict=False):
            sized = LayerCosts(
                costs.forward, costs.backward, memory=memory, weight_bytes=costs.weight_bytes
            )
            try:
                plan = partition(sized, n, m, memory_limit=bound)
            except PlanError:
                continue
            if fits(plan):
                return plan
        raise PlanError(
            f"no plan keeps every stage within size_limit {cap} (weights and gradients) "
            f"and within {limit} bytes with its measured activations"
        )

    @staticmethod
    def _memory_limit(devs: list[torch.device], costs: LayerCosts, limit: int | None) -> int | None:
        cuda = sorted({d for d in devs if d.type == "cuda"}, key=str)
        if not cuda and limit is None:
            return None  # CPU workers: no limit unless one is given
        if limit is None:
            # each worker holds a stage and the prefetched next one; workers
            # sharing a GPU share its free memory
            limit = min(torch.cuda.mem_get_info(d)[0] // (2 * devs.count(d)) for d in cuda)
        assert costs.memory is not None
        for i, need in enumerate(costs.memory):
            if need > limit:
                raise PlanError(
                    f"layer {i} needs about {int(need)} bytes of device memory (weights and "
                    f"gradients) but a stage may use {limit} bytes on "
                    f"{cuda[0] if cuda else devs[0]}; even one layer "
                    "at a time does not fit. Raise device_memory_limit or free device memory"
                )
        return limit

    # ----------------------------------------------------------------- props
    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def iteration(self) -> int:
        """Number of ``forward_backward`` calls so far."""
        return self._iteration

    @property
    def compute_dtype(self) -> torch.dtype:
        return self._host.compute_dtype

    @property
    def bytes_moved(self) -> int:
        """Bytes copied between host and devices so far (0 for CPU workers)."""
        return sum(w.ctx.bytes_moved for w in self._rt.workers if w.ctx is not None)

    def host_memory(self) -> dict[str, int]:
        """Bytes of host memory the engine holds (master copies, gradient buffers,
        and how much of it is page-locked)."""
        out = self._host.host_bytes()
        # gradients a step handed to the optimizer, while still attached (a step
        # releases them when it is done; zero between steps)
        attached = 0
        for p in self._host.params:
            g = p.param.grad  # read once: the optimizer thread may release it meanwhile
            if g is not None:
                attached += g.numel() * g.element_size()
        out["step_grads"] = attached
        return out

    # ------------------------------------------------------------------ work
    def _check(self) -> None:
        if self._rt.closed:
            failure = self._rt.store.failure
            if failure is not None and not isinstance(failure, EngineClosedError):
                raise EngineClosedError(
                    f"the engine was closed after a failure: {failure}"
                ) from failure
            raise EngineClosedError("the RoundPipe engine is closed; create a new one")
        self._raise_failure()

    def _raise_failure(self) -> None:
        failure = self._rt.store.failure
        if failure is None:
            return
        if isinstance(failure, WorkerError):
            raise WorkerError(
                str(failure),
                device=failure.device,
                worker=failure.worker,
                stage=failure.stage,
                layers=failure.layers,
                microbatch=failure.microbatch,
                iteration=failure.iteration,
            ) from failure.__cause__
        raise failure

    def _wait(self, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        except EngineFailure:
            self._raise_failure()
            raise
        except HandoffTimeout as exc:
            raise HandoffTimeout(f"{exc}\n{self._stuck_grid()}") from None
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def _stuck_grid(self) -> str:
        """The last dispatched iteration's grid, marked at its first unfinished step."""
        if self._last_dispatch is None:
            return "(nothing dispatched yet)"
        iteration, plan = self._last_dispatch
        with self._rt.store.lock:
            done = set(self._rt.done_keys)
        stuck = next(
            (i for i, st in enumerate(plan.steps) if (iteration, st.round, st.slot) not in done),
            None,
        )
        where = (
            ""
            if stuck is None
            else (
                f"first unfinished step: {plan.steps[stuck]} on device {plan.steps[stuck].device}\n"
            )
        )
        return f"iteration {iteration}, {where}{plan.grid(mark=stuck)}"

    def microbatches_for(self, batch_size: int) -> int:
        """How many micro-batches a batch of ``batch_size`` samples is split into."""
        m = self.num_microbatches
        if self.fit_to_batch and self.num_devices <= batch_size < m:
            return batch_size  # a short batch (the last of an epoch): one sample each
        return m

    def _split(self, inputs: Any) -> tuple[int, list[Any]]:
        bsz = batch_size_of(inputs)
        if bsz is None:
            raise ValueError(
                "cannot split inputs into micro-batches: they contain no tensor with a batch "
                "dimension"
            )
        m = self.microbatches_for(bsz)
        if bsz < m:
            low = f" or {self.num_devices} devices" if self.fit_to_batch else ""
            raise ValueError(
                f"batch size ({bsz}) is smaller than num_microbatches ({m}){low}; use a larger "
                "batch, lower num_microbatches, or drop a short last batch (drop_last=True in "
                "the DataLoader)"
            )
        return bsz, split_microbatches(inputs, m, bsz)

    def _to_host(self, value: Any, cast: bool) -> Any:
        """Detached host copies (page-locked on CUDA engines, so uploads are truly
        asynchronous); with ``cast`` floating tensors take the compute dtype."""
        dtype = self.compute_dtype
        on_cuda = self.devices[0].type == "cuda"

        def conv(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if cast and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            t = t.cpu()
            return pin(t) if on_cuda else t

        return map_tensors(conv, value)

    def _submit(self, call: Call, slots: Any, mbs: list[Any], train: bool) -> None:
        """Put the micro-batch inputs into the store and dispatch every slot.
        Caller holds ``self._lock``."""
        it, store, rt = call.iteration, self._rt.store, self._rt
        readers0 = call.layout.act_readers[0]
        mr = self.microbatches_per_round
        for j, x in enumerate(mbs):
            store.put((it, "act", 0, j), self._to_host(x, cast=True), readers0)
        plan = dispatch(
            slots,
            self.num_devices,
            len(mbs),
            None if mr is None else min(mr, len(mbs)),
            start_device=self._g0,
        )
        self._g0 = plan.next_device
        call.dispatch = plan
        self._last_dispatch = (call.iteration, plan)
        with store.lock:
            rt.done_keys = {k for k in rt.done_keys if not 0 <= k[0] < self._iteration - 2}
        for index, step in enumerate(plan.steps):
            stage = plan.stages[step.slot]
            task = Task(call, step.round, stage, step.microbatches)
            task.step = index
            if train and self._stateful[step.slot]:
                task.after = self._last_task.get(step.slot)
                self._last_task[step.slot] = task.key
            task.keep_buffers = train
            self._protocol.register(
                call.window,
                self._host.stage_params(stage.start, stage.stop),
                grads=stage.kind != "forward",
            )
            with store.lock:
                rt.submitted += 1
            rt.workers[step.device].submit(task)

    def reserve_iteration(self) -> int:
        """Take the next iteration number now (for a ``forward`` whose
        ``forward_backward`` follows later with the same dropout masks)."""
        with self._lock:
            it = self._iteration
            self._iteration += 1
            return it

    def forward(self, inputs: Any, iteration: int | None = None) -> Any:
        """Forward-only pass through every layer (no autograd), in the layers'
        current train/eval mode; returns the last layer's outputs for the whole
        batch (micro-batch outputs concatenated along dimension 0).

        ``iteration`` selects the dropout masks (use :meth:`reserve_iteration`
        to match a later ``forward_backward``); by default a separate counter is
        used so evaluation never shifts the masks of training iterations.
        Running statistics are not written back by this pass."""
        self._check()
        _, mbs = self._split(inputs)
        m = len(mbs)
        with self._lock:
            if iteration is None:
                self._eval_iteration -= 1
                iteration = self._eval_iteration
            call = Call(
                iteration,
                self._window,
                [None] * m,
                [1.0] * m,
                None,
                1.0,
                self.seed,
                self._forward_layout,
            )
            self._submit(call, self._forward_slots, mbs, train=False)
        store, top = self._rt.store, self.plan.num_layers
        outs = [
            self._wait(
                lambda j=j: store.take((iteration, "act", top, j), f"output of micro-batch {j}")[0]
            )
            for j in range(m)
        ]
        return merge_microbatches(outs)

    def forward_backward(
        self,
        inputs: Any,
        labels: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        scale: float = 1.0,
        loss_weights: Sequence[float] | None = None,
        iteration: int | None = None,
    ) -> torch.Tensor:
        """Run forward, loss and backward of one batch through the pipeline.

        Args:
            inputs: the first layer's input (tensor, tuple or dict); tensors
                whose first dimension is the batch size are split into
                micro-batches, everything else is given to every micro-batch.
            labels: split like ``inputs`` and passed to ``loss_fn``.
            loss_fn: ``loss_fn(output_mb, labels_mb)`` -> scalar; ``None`` when
                the last layer returns the loss.
            scale: gradients are those of ``scale * loss``.
            loss_weights: weight of each micro-batch's loss; default its share
                of the batch (``mb_size / batch_size``).
            iteration: a number from :meth:`reserve_iteration` (dropout masks of
                an earlier :meth:`forward`); default the next one.

        Returns:
            ``scale * sum_j weight_j * loss_j`` as a host float32 scalar (fp16
            loss scaling is internal and not included), available once every
            micro-batch's loss is known (backward stages may still be running;
            ``synchronize`` waits for them).
        """
        self._check()
        bsz, mbs = self._split(inputs)
        m = len(mbs)
        labs = [None] * m if labels is None else split_microbatches(labels, m, bsz)
        if loss_weights is None:
            weights = [batch_size_of(x) / bsz for x in mbs]
        else:
            weights = [float(w) for w in loss_weights]
            if len(weights) != m:
                raise ValueError(
                    f"loss_weights has {len(weights)} entries; give one per micro-batch ({m})"
                )
        labs = [None if y is None else self._to_host(y, cast=False) for y in labs]
        self._maybe_replan()
        with self._lock:
            if iteration is None:
                iteration = self._iteration
                self._iteration += 1
            window = self._window
            # the loss scale a window starts with unscales all of its gradients
            loss_scale = self._window_scale.setdefault(window, self.scaler.scale)
            self._window_has_grads = True
            call = Call(
                iteration,
                window,
                labs,
                weights,
                loss_fn,
                float(scale) * loss_scale,
                self.seed,
                self._layout,
                self._profiler if self._profiler and self._profiler.wants(iteration) else None,
            )
            self._submit(call, self.plan, mbs, train=True)
        store = self._rt.store
        losses = [
            self._wait(
                lambda j=j: store.take((iteration, "loss", 0, j), f"loss of micro-batch {j}")[0]
            )
            for j in range(m)
        ]
        per_mb = torch.stack([loss.reshape(()).float().cpu() for loss in losses])
        if (
            self.nonfinite == "raise"
            and not self.scaler.enabled
            and not bool(torch.isfinite(per_mb).all())
        ):
            bad = [j for j in range(m) if not bool(torch.isfinite(per_mb[j]))]
            raise NonFiniteError(
                f"the loss of micro-batch(es) {bad} in iteration {iteration} is not finite "
                f"({per_mb[bad[0]].item()}); the weights were not updated by it. Set "
                "nonfinite='skip' to skip such steps, or look for the cause (learning rate, "
                "data, precision)"
            )
        return per_mb.sum() * float(scale)

    def call(self, fn: Callable[[], Any]) -> StepHandle:
        """Run ``fn`` on the host in order with the optimizer steps (after the
        step queued last): for ``zero_grad`` and learning-rate scheduler steps,
        which must not race an asynchronous update. Synchronous mode: at once."""
        self._check()
        handle = StepHandle(-1, _store=self._rt.store)
        if not self.async_optimizer:
            try:
                self._protocol.chaos("call")
                handle.result = fn()
            except BaseException as exc:
                raise OptimizerStepError(
                    f"a queued call (zero_grad or scheduler step) failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            finally:
                handle._event.set()
            return handle
        self._optimizer.submit(_Job(-1, fn, 1.0, None, None, handle))
        return handle

    def _wait_tasks(self) -> None:
        rt = self._rt
        self._wait(
            lambda: rt.store.wait_until(
                lambda: rt.done >= rt.submitted, "all dispatched stages to finish"
            )
        )

    def synchronize(self) -> None:
        """Wait for all outstanding work: every dispatched stage and every queued
        optimizer step. Afterwards parameters hold the latest weights and each
        trainable parameter's ``.grad`` the gradient accumulated since the last
        ``step`` (fp32, in the parameter's dtype)."""
        self._check()
        self._wait_tasks()
        opt = self._optimizer
        self._wait(
            lambda: self._rt.store.wait_until(
                lambda: opt.applied >= self._jobs, "the optimizer worker to finish its steps"
            )
        )
        if self._window_has_grads:  # evaluation alone leaves .grad untouched
            self._host.expose_grads()

    def step(
        self,
        fn: Callable[[], Any] | None = None,
        *,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        prepare: Callable[[], dict[str, float] | None] | None = None,
    ) -> StepHandle:
        """Close the current window and apply an update on the host.

        ``fn`` (e.g. ``optimizer.step`` or a closure that also steps a scheduler
        and zeroes gradients) runs after the window's gradients have been moved
        into the parameters' ``.grad`` (unscaled, clipped if asked), and the new
        weights are copied into the master copy afterwards. Synchronous mode:
        blocks until done. Asynchronous mode: returns at once; the update runs
        on the optimizer thread while the next window computes.

        ``prepare``, if given, runs on the same thread just before clipping, with
        the window's (unscaled) gradients in ``.grad``; it may inspect or change
        them and may return ``{"clip_grad_norm": x}`` or ``{"clip_grad_value": x}``
        to set the clipping. After ``fn`` the gradients are released (``.grad``
        is ``None`` between steps, as after ``zero_grad(set_to_none=True)``).

        Returns a :class:`StepHandle` (``wait()``, ``grad_norm``: the total norm
        before clipping, ``skipped``: fp16 overflow, ``result``: what ``fn``
        returned).
        """
        self._check()
        if clip_grad_norm is not None and clip_grad_value is not None:
            raise ValueError("give clip_grad_norm or clip_grad_value, not both")
        for name, v in (("clip_grad_norm", clip_grad_norm), ("clip_grad_value", clip_grad_value)):
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        with self._lock:
            window = self._window
            self._window += 1
            scale = self._window_scale.pop(window, self.scaler.scale)
            handle = StepHandle(window, _store=self._rt.store)
            job = _Job(window, fn, scale, clip_grad_norm, clip_grad_value, handle, prepare)
            self._jobs += 1
            self._window_has_grads = False
            self._protocol.close_window(window)
        if self.async_optimizer:
            self._optimizer.submit(job)
            return handle
        self._wait_tasks()
        error: BaseException | None = None
        try:
            self._optimizer.run(job)
        except EngineFailure:
            self._raise_failure()
            raise
        except NonFiniteError as exc:
            error = exc
        except HookError as exc:
            error = exc.original  # the user's hook failed: its own exception, unchanged
        except BaseException as exc:
            error = OptimizerStepError(
                f"optimizer step {window} failed: {type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
        if error is not None:
            # the window's gradients are gone and its weight copies never ran: the
            # next window could not start, so later calls fail at once with this
            self._rt.store.fail(error)
            raise error
        return handle

    def stale_weights(self) -> list[torch.Tensor]:
        """The master copies (the weights the next window computes with; in
        asynchronous mode one update behind the parameters), one per distinct
        parameter in :meth:`parameters` order. Call after :meth:`synchronize`."""
        return [p.master for p in self._host.params]

    def parameters(self) -> list[nn.Parameter]:
        """The distinct parameters of the pipeline layers, in engine order."""
        return [p.param for p in self._host.params]

    def resume(self, stale: Sequence[torch.Tensor]) -> None:
        """Continue an asynchronous run from a checkpoint exactly.

        ``stale`` are the master copies saved with the checkpoint (the weights
        one update behind the parameters). The next window computes with them,
        and the copy of the parameters into the master copies, pending when the
        checkpoint was taken, runs once that window stops reading each weight,
        as it would have in the uninterrupted run."""
        if not self.async_optimizer:
            raise ValueError(
                "resume() is for the asynchronous optimizer; synchronous runs "
                "restart from the parameters alone"
            )
        if self._iteration or self._window:
            raise RuntimeError("resume() must be called before the first forward_backward")
        params = self._host.params
        if len(stale) != len(params):
            raise ValueError(f"resume() got {len(stale)} tensors for {len(params)} parameters")
        with torch.no_grad():
            for p, t in zip(params, stale, strict=True):
                if tuple(t.shape) != tuple(p.master.shape):
                    raise ValueError(
                        f"saved weight of shape {tuple(t.shape)} does not fit parameter "
                        f"{p.index} of shape {tuple(p.master.shape)}"
                    )
                p.master.copy_(t)
        # numbering as if a window 0 had run: window 1 is next, the G copy of
        # window 0 is done, and update 0's P copy (parameters -> masters) is pending
        proto = self._protocol
        with proto.cond:
            self._window = 1
            proto.closed = 0
            proto.g_done = [1] * len(params)
            proto.p_done = [0] * len(params)
        self._optimizer._pending = (0, list(params))

    def reload_weights(self) -> None:
        """Copy the parameters into the master copy again; call after changing
        parameters outside :meth:`step` (e.g. ``load_state_dict``)."""
        self.synchronize()
        self._host.refresh_masters()

    def zero_grad(self) -> None:
        """Drop the gradients accumulated in the current window (after waiting
        for every dispatched stage and queued step); ``.grad`` is ``None``
        afterwards, as between steps."""
        self.synchronize()
        self._host.zero_grads()
        self._host.detach_grads()
        self._window_has_grads = False

    def close(self) -> None:
        """Stop and join every worker thread and release pinned memory. Safe to
        call more than once; also runs when the engine is garbage collected."""
        stuck = self._finalizer() if self._finalizer.alive else []
        if stuck:
            raise RuntimeError(
                f"worker threads did not stop within 30 s: {', '.join(stuck)}; a layer may be "
                "blocked"
            )

    def __enter__(self) -> RoundPipeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The RoundPipe engine: the controller that runs a stage plan on a pool of devices.

The caller's thread is the controller. ``forward_backward`` splits the batch
into micro-batches, puts their inputs into the host activation store, lowers
the iteration to its tasks (:func:`~lightning_roundpipe.plan.lower`, the list
the simulator runs too) and hands each task to its device's worker
(:mod:`.worker`); it returns the loss as soon as every micro-batch's loss is
known, while backward stages may still be running. A round starts on the
device the engine's clock predicts to become free first. ``synchronize`` waits
for all outstanding work and exposes the accumulated fp32 gradients as
``.grad``; ``step(fn)`` runs an optimizer step on the host and refreshes the
master copy.

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
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ..plan import Clock, LayerCosts, PlanError, Schedule, StagePlan, lower
from ..plan.decide import (
    Predicted,
    after_measurement,
    initial_plan,
    plan_for_activations,
    stage_peaks,
    tightest,
)
from ..plan.policy import (
    RoundChoice,
    choose_round,
    exposed_uploads,
    hides_uploads,
    simulated_period,
)
from ..plan.replicas import gradient_buckets
from ..plan.schedule import Placement
from ..plan.stages import Stage
from .device import as_device, check_uniform, host_to_device_bandwidth, pin, stage_memory_limit
from .gradients import CallerGradients
from .host import (
    HOST_ACTIVATION_SHARE,
    HostState,
    _Param,
    gradient_bytes,
    host_available,
    plan_staging_bytes,
    state_bytes,
    within_staging,
)
from .nested import (
    batch_size_of,
    flatten_tensors,
    map_tensors,
    merge_microbatches,
    split_microbatches,
)
from .optimizer import (
    HookError,
    LossScaler,
    NonFiniteError,
    OptimizerStepError,
    OptimizerWorker,
    Protocol,
    Rules,
    StepHandle,
    _Job,
)
from .options import EngineOptions, NonFinite, Precision
from .parametrize import install as install_parametrize_cache
from .profiler import (
    TRAFFIC_KINDS,
    Profiler,
    TraceRecorder,
    TrafficReport,
    estimate_costs,
    named,
    write_trace,
)
from .replicas import GradientReducer, Replicas, gradient_layer_bytes
from .store import EngineClosedError, EngineFailure, HandoffTimeout, Key, Store
from .worker import (
    Call,
    Gain,
    Job,
    Runtime,
    Worker,
    WorkerError,
    describe_threads,
    running_now,
)

__all__ = ["EngineClosedError", "RoundPipeEngine", "TrafficReport", "estimate_costs"]

log = logging.getLogger(__name__)

#: tile_memory="auto" on CPU workers with no device_memory_limit
_CPU_TILE_MEMORY = 128 * 2**20


#: reserved forward passes remembered for their backward (older ones whose
#: backward never came are forgotten)
_RESERVED_KEPT = 64


def _state_to_come(
    layers: Sequence[nn.Module],
    compute_dtype: torch.dtype,
    copies: int,
    optimizer_state: int | None = None,
) -> int:
    """Host bytes the engine and the host optimizer will allocate for
    ``layers`` beyond the parameters themselves (:func:`state_bytes`):
    ``optimizer_state`` for the optimizer (default: two Adam moments per
    trainable weight, an assumption: the optimizer is not known yet)."""
    distinct = {id(p): p for layer in layers for p in layer.parameters()}.values()
    return state_bytes(
        ((p.numel(), p.dtype, p.requires_grad) for p in distinct),
        compute_dtype,
        copies,
        include_params=False,
        moments=optimizer_state is None,
    ) + (optimizer_state or 0)


def _second_copy_fits(
    layers: Sequence[nn.Module],
    compute_dtype: torch.dtype,
    available: int | None,
    optimizer_state: int | None = None,
) -> bool:
    """Whether the default second master copy of the trainable weights fits
    the host memory available now, after the state the engine and the
    optimizer will add anyway (one master copy, gradient buffers, optimizer
    state); where it does not, one copy is used and the reason logged."""
    if not available:  # (0: a reading to distrust, as no state could exist)
        return True
    rest = _state_to_come(layers, compute_dtype, 1, optimizer_state)
    second = _state_to_come(layers, compute_dtype, 2, optimizer_state) - rest
    if rest + second <= available:
        return True
    log.warning(
        "RoundPipe: one master copy of the trainable weights (double_buffer off): a second "
        "one (%.2f GiB) does not fit the %.2f GiB of host memory available next to the rest "
        "of the training state (%.2f GiB). Weight copies then wait for the next window; set "
        "double_buffer=True to keep two copies anyway",
        second / 2**30,
        available / 2**30,
        rest / 2**30,
    )
    return False


class RoundPipeEngine:
    """Runs a layer list as a RoundPipe pipeline on a pool of devices.

    Args:
        layers: the model as an ordered list of modules; the output of layer
            ``i`` (a tensor or a tuple/dict of tensors) is the input of layer
            ``i + 1`` (see ``spread_values``). Their parameters stay the
            optimizer copy, on the host.
        devices: one worker per entry (``torch.device``, ``"cuda:0"``, ``0``,
            ``"cpu"``); entries may repeat to let several workers share one
            device.
        num_microbatches: ``M``, micro-batches per ``forward_backward`` (fewer
            than devices is allowed: some devices idle).
        plan: a :class:`StagePlan` or its compact text; default: the plan with
            the shortest simulated iteration among the partitioner's best
            (:func:`~lightning_roundpipe.plan.choose_plan`), from size-based
            estimates.
        microbatches_per_round: ``M_R``, an integer, or ``None``/``"auto"``
            (default): the whole batch, so each stage's weights go up once per
            iteration, unless a round's stage-boundary activations would
            exceed ``activation_memory`` (then the largest round that fits),
            or a round of a multiple of the device count gives a simulated
            step at least 1% shorter while hiding the weight uploads
            (:func:`~lightning_roundpipe.plan.policy.choose_round`).
        activation_memory: host bytes one round's stage-boundary activations
            may take (default: a quarter of the host memory available when the
            engine starts, less what the training state will take: master
            copies, gradient buffers and, assumed, an Adam-like optimizer's
            two fp32 moments per trainable weight). The size of a
            micro-batch's activations comes from
            ``activation_estimate`` until the first training iteration has
            measured it. It also bounds one micro-batch's boundary values when
            :meth:`expect_activations` plans for long sequences (default
            there: 80% of that host memory): a plan over it is
            replaced by one with fewer, larger backward stages, layered (or
            rewalked) where their activations would not fit the device
            (:class:`~lightning_roundpipe.plan.StagePlan`).
        activation_estimate: bytes of one stage-boundary value of a micro-batch,
            given that micro-batch's input (a model adapter knows it: hidden
            size x tokens); None: measured in the first iteration.
        placement: ``"free-first"`` (default): each round starts on the device
            predicted to become free first; ``"rotate"``: a fixed rotation.
            Where work runs never changes what is computed.
        trace: record the real start and end of every operation per device
            (:meth:`trace_operations`, :meth:`chrome_trace`).
        costs: per-layer costs to plan and place rounds with until profiling
            measures them (e.g. ``LayerCosts.load`` of an earlier run's
            :meth:`measured_costs`); default: size-based estimates. Their
            ``memory``, if given, must be in bytes.
        forbid_host_sync: fail, naming the call, when a layer makes the worker
            wait for its device (``.item()``, ``bool()`` of a device tensor,
            ...; on GPUs every synchronizing call): a debugging aid for layers
            that stall the pipeline. See
            :func:`~lightning_roundpipe.runtime.scope.forbid_host_sync`.
        fit_to_batch: a batch smaller than ``num_microbatches`` is split into
            one-sample micro-batches instead of being refused (for a short last
            batch of an epoch).
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
            prefetched next stage; when predicted activations fit no plan in
            that half, more of it, the next stage's weights kept within the
            rest, or, at last, all of it with nothing prefetched:
            :func:`~lightning_roundpipe.plan.decide.plan_for_activations`).
        size_limit: a cap on each stage's size-based estimate (weights and
            gradients, the unit of :func:`estimate_costs`) on top of
            ``device_memory_limit``, kept when re-partitioning from measurements.
            The strategy sets it after a stage ran out of device memory.
        activation_scale: predicted activation bytes (saved and transient,
            :meth:`expect_activations`) count this many times over when
            planning (default 1). The strategy sets it after a stage whose
            activations were predicted ran out of device memory.
        optimizer_threads: intra-op threads (``torch.set_num_threads``) set
            by the asynchronous optimizer thread while the engine runs; default:
            unchanged. Torch shares that count between all threads but the main
            one, so the CPU device workers and gradient couriers use it too; the
            previous count is restored when the engine closes.
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
        tile_memory: bytes the transient working set of one sequence tile may
            take on a device: the LM loss then runs over chunks of tokens and
            per-token layers (a decoder block's MLP and norms) over sequence tiles whenever
            a micro-batch's whole working set would be larger (model adapters
            read :attr:`tile_budget`). ``"auto"`` (default): an eighth of a
            stage's device memory (``device_memory_limit``, or half the free
            memory of a GPU), 128 MiB on CPU workers without a limit;
            ``None``: never tile.
        double_buffer: asynchronous optimizer only: keep a second master copy
            of the trainable weights on the host, one per parity of the
            weights' version, so that an update's weight copies (P copies) go
            into the copy no running window reads and overlap the next window
            instead of waiting for it to close. Costs the trainable weights once
            more in the compute dtype (2 bytes per parameter in bf16/fp16, 4 in
            fp32; nothing for frozen weights such as a LoRA base). ``None``
            (default): on with the asynchronous optimizer where the host
            memory available at start holds it next to the rest of the
            training state (else off, with a warning); ``True`` with the
            synchronous one is refused.
        optimizer_state: host bytes the optimizer's state will still take,
            for the default budgets above (default: two fp32 moments per
            trainable weight, as Adam's, not yet allocated; 0 for an engine
            rebuilt while the optimizer's state exists).
        parameter_names: names for the parameters in errors (e.g. the
            LightningModule's ``named_parameters()``, as a dict from parameter
            to name); default ``layers[i].<name inside the layer>``.
        chaos: tests only: called with the name of each hand-off point
            (``"upload"``, ``"forward"``, ``"backward"``, ``"grad"``,
            ``"download"``, ``"store"``, ``"g_copy"``, ``"step"``, ``"p_copy"``,
            ``"call"``) as it is reached, to delay or fail there (see
            :class:`~lightning_roundpipe.runtime.optimizer.Chaos`); default:
            nothing.
        replicas: this engine is one of several replicas (one per server)
            joined by torch.distributed (a
            :class:`~lightning_roundpipe.runtime.replicas.Replicas`): each
            window's gradients are averaged over them, overlapped with the
            backward (see :mod:`~lightning_roundpipe.runtime.replicas`).
        spread_values: how a value reaches a layer: a tuple as positional
            arguments and a dict as keyword arguments (default; the layers
            of the model adapters), else the value as the one argument, as
            ``nn.Sequential`` passes it.
        rules: tests only: the ordering rules' conditions (a
            :class:`~lightning_roundpipe.runtime.optimizer.Rules`, the
            default); a subclass with a rule removed shows what it prevents.
        owners: modules that hold the layers (the LightningModule, the model,
            its layer list): a layer attribute that refers back to one shares
            it with the workers' copies of the layer instead of copying it.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        devices: Sequence[torch.device | str | int],
        num_microbatches: int,
        plan: StagePlan | str | None = None,
        *,
        microbatches_per_round: int | Literal["auto"] | None = None,
        activation_memory: int | None = None,
        activation_estimate: Callable[[Any], int] | None = None,
        placement: Placement = "free-first",
        trace: bool = False,
        costs: LayerCosts | None = None,
        forbid_host_sync: bool = False,
        fit_to_batch: bool = False,
        precision: Precision = "32-true",
        async_optimizer: bool = False,
        seed: int = 0,
        watchdog_timeout: float = 600.0,
        device_memory_limit: int | None = None,
        optimizer_threads: int | None = None,
        profile_iterations: int = 2,
        replan_margin: float = 0.05,
        nonfinite: NonFinite = "raise",
        size_limit: int | None = None,
        activation_scale: float = 1.0,
        tile_memory: int | Literal["auto"] | None = "auto",
        double_buffer: bool | None = None,
        optimizer_state: int | None = None,
        parameter_names: dict[nn.Parameter, str] | None = None,
        replicas: Replicas | None = None,
        chaos: Callable[[str], None] | None = None,
        rules: Rules | None = None,
        spread_values: bool = True,
        owners: Sequence[nn.Module] = (),
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
        devs = [as_device(d) for d in devices]
        if not devs:
            raise ValueError("devices is empty; give at least one device")
        for d in devs:
            if d.type not in ("cpu", "cuda"):
                raise ValueError(f"device {d} is not supported; use CUDA devices or 'cpu'")
            if d.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {d} requested but CUDA is not available")
        check_uniform(devs)
        # every scalar option, validated in one place (shared with the strategy)
        self.options = EngineOptions(
            precision=precision,
            async_optimizer=async_optimizer,
            microbatches_per_round=microbatches_per_round,
            activation_memory=activation_memory,
            placement=placement,
            trace=trace,
            forbid_host_sync=forbid_host_sync,
            fit_to_batch=fit_to_batch,
            seed=seed,
            watchdog_timeout=watchdog_timeout,
            device_memory_limit=device_memory_limit,
            size_limit=size_limit,
            activation_scale=activation_scale,
            optimizer_threads=optimizer_threads,
            profile_iterations=profile_iterations,
            replan_margin=replan_margin,
            nonfinite=nonfinite,
            tile_memory=tile_memory,
            double_buffer=double_buffer,
        )
        compute_dtype = self.options.compute_dtype
        # stages run on several threads: torch's parametrization cache must
        # be per thread (PEFT's LoRA on experts uses it in every forward)
        install_parametrize_cache()
        user_plan = plan is not None
        if (
            isinstance(num_microbatches, bool)
            or not isinstance(num_microbatches, int)
            or (num_microbatches < 1)
        ):
            raise PlanError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
        n, m = len(devs), num_microbatches
        if isinstance(plan, str):
            plan = StagePlan.parse(plan, len(layers))
        elif plan is not None:
            plan.validate(len(layers))
        if costs is not None:
            if not isinstance(costs, LayerCosts):
                raise TypeError(f"costs must be a LayerCosts, got {type(costs).__name__}")
            if costs.num_layers != len(layers):
                raise PlanError(
                    f"costs has {costs.num_layers} layers but the model has {len(layers)}; "
                    "give one cost per pipeline layer"
                )
            if costs.memory is None:  # the size-based memory still bounds the stages
                est = estimate_costs(layers, compute_dtype)
                costs = replace(costs, memory=est.memory, weight_bytes=est.weight_bytes)
        else:
            costs = estimate_costs(layers, compute_dtype)
        limit = stage_memory_limit(devs, costs, device_memory_limit)
        plan = initial_plan(
            costs,
            n,
            m,
            given=plan,
            async_optimizer=async_optimizer,
            memory_limit=limit,
            size_limit=size_limit,
            round_size=self.options.microbatches_per_round,
        )

        # ---- state
        self._user_plan = user_plan
        self._costs = costs
        self._limit = limit
        # what a new engine with these options starts from (re-plan previews)
        self._initial = (plan, limit)
        # the memory limit the tiles are sized from (the stage limit may grow
        # for long sequences, the tiles stay)
        self._tile_limit = limit
        # a worker's device bytes in all when the limit is half of them (from
        # the GPUs' free memory); None when the limit was given or on CPU
        self._budget = 2 * limit if limit is not None and device_memory_limit is None else None
        # with a stage limit past half the budget: what no stage's weights may
        # exceed (the room left for the next stage, prefetched)
        self._weight_cap: float | None = None
        self.replan_margin = replan_margin
        self.size_limit = size_limit
        self.activation_scale = self.options.activation_scale
        # the last activations told (expect_activations), as predicted
        self._expected: tuple[list[float], list[float]] | None = None
        self._profiler = Profiler(len(layers), profile_iterations) if profile_iterations else None
        self._replanned = False
        #: predicted peak device memory of each slot (:meth:`expect_activations`)
        self.predicted_peaks: list[float] | None = None
        self.devices = devs
        self.num_microbatches = m
        self.microbatches_per_round = self.options.microbatches_per_round
        available = host_available()
        self.double_buffer = self.options.double_buffered
        if self.double_buffer and self.options.double_buffer is None:
            self.double_buffer = _second_copy_fits(
                layers, compute_dtype, available, optimizer_state
            )
        # what is left for activations once the training state is allocated
        room = available or None
        if room is not None:
            copies = 2 if self.double_buffer else 1
            state = _state_to_come(layers, compute_dtype, copies, optimizer_state)
            if any(d.type == "cuda" for d in devs):
                # and the page-locked blocks the gradient downloads take: where
                # those of the first plan's stages would not fit, smaller stages
                grads = gradient_bytes(layers)
                if not user_plan and state < room:
                    smaller, cap = within_staging(
                        plan,
                        lambda cap: initial_plan(
                            costs,
                            n,
                            m,
                            given=None,
                            async_optimizer=async_optimizer,
                            memory_limit=limit,
                            size_limit=int(tightest(size_limit, cap)),
                            round_size=self.options.microbatches_per_round,
                        ),
                        costs,
                        grads,
                        n,
                        room - state,
                    )
                    if cap is not None:
                        log.info(
                            "RoundPipe: plan %s instead of %s: its stages' gradient downloads "
                            "stage %.2f GiB of page-locked host memory, not %.2f GiB, within the "
                            "%.2f GiB the training state leaves",
                            smaller,
                            plan,
                            plan_staging_bytes(smaller, grads, n) / 2**30,
                            plan_staging_bytes(plan, grads, n) / 2**30,
                            (room - state) / 2**30,
                        )
                        plan = smaller
                        self.size_limit = size_limit = int(tightest(size_limit, cap))
                        self._initial = (plan, limit)
                state += plan_staging_bytes(plan, grads, n)
            if state < room:
                room -= state
            else:  # no room then: budgets from what is there, and a warning
                log.warning(
                    "RoundPipe: the training state needs about %.2f GiB of host memory beyond "
                    "the parameters (master copies, gradient buffers, the optimizer's "
                    "state, page-locked staging of gradient downloads) and %.2f GiB are "
                    "available: the process may run out of host memory. Train fewer "
                    "weights (LoRA, frozen layers), load frozen weights in the compute "
                    "dtype, or use a machine with more memory",
                    state / 2**30,
                    available / 2**30,
                )
        self.activation_memory = (
            activation_memory
            if activation_memory is not None
            else (max(room // 4, 1) if room else None)
        )
        # what one micro-batch's boundary values may take on the host before
        # a plan with fewer boundaries is chosen (expect_activations)
        self._host_limit = (
            activation_memory
            if activation_memory is not None
            else (max(int(room * HOST_ACTIVATION_SHARE), 1) if room else None)
        )
        #: bytes of one boundary value of a micro-batch (expect_activations)
        self._boundary: float | None = None
        self.activation_estimate = activation_estimate
        self.placement = placement
        self.fit_to_batch = fit_to_batch
        self.seed = seed
        self.layers = layers
        self.precision = precision
        self.async_optimizer = async_optimizer
        self._iteration = 0
        self._eval_iteration = 0
        # reserved iterations' forward-only passes: the layers' structures and
        # modes their backward runs with (as autograd would: those of the
        # forward), and whether they wrote running statistics
        self._reserved: dict[int, Call] = {}
        self._serial = 0
        self._window = 0
        self._window_scale: dict[int, float] = {}
        # (the first window and the loss scale this engine's windows start from)
        self._scale_start: tuple[int, float] | None = None
        self._continued_scale: float | None = None  # (see continue_from)
        self.wait_seconds = 0.0  # time the caller's thread spent waiting on the pipeline
        self._last_schedule: tuple[Call, Schedule] | None = None
        self._last_train: Schedule | None = None
        self._boundary_per_sample: float | None = None  # measured activation bytes
        self.round: RoundChoice | None = None
        self._bandwidth: float | None = None
        self._window_has_grads = False
        self._jobs = 0
        # synchronous steps whose window failed before they ran (weights unchanged)
        self._steps_not_run = 0
        # inputs whose tensors differ in their first dimension were warned about
        self._warned_ambiguous = False
        # the thread running a synchronous step (its hooks may save a checkpoint:
        # synchronize() then must not wait for the step it is called from)
        self._stepping: int | None = None
        self._calls = 0  # calls queued on the optimizer thread
        # while evaluating with the newest weights: the master copies the next
        # training window computes with (asynchronous mode), by parameter index
        self._training_masters: dict[int, torch.Tensor] | None = None
        # evaluating with the newest weights (use_newest_weights)
        self._newest = False
        # ... until use_training_weights() is called itself (use_newest_weights(hold=True))
        self._holding = False
        self._reloaded_for_evaluation = False  # (see reload_weights)
        # parameters changed in place during an evaluation (asynchronous mode):
        # their master copy's values before (see reload_weights)
        self._before_evaluation: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._host = HostState(
            layers,
            compute_dtype,
            pinned=devs[0].type == "cuda",
            copies=2 if self.double_buffer else 1,
            owners=owners,
        )
        try:
            store = Store(watchdog_timeout)
            self._protocol = Protocol(self._host, store, async_optimizer, rules)
            if chaos is not None:
                self._protocol.chaos = chaos
            rt = self._rt = Runtime(self._host, store, self._protocol)
            if trace:
                rt.trace = TraceRecorder()
            rt.forbid_host_sync = forbid_host_sync
            rt.spread_values = spread_values
            self._set_plan(plan)
            self.scaler = LossScaler(enabled=precision == "16-mixed")
            self._caller_grads = CallerGradients(rt, self.scaler, nonfinite, self._wait)
            index = {id(hp.param): hp.index for hp in self._host.params}
            names: dict[int, str] = {}
            given = {id(p): n for p, n in (parameter_names or {}).items()}
            for i, layer in enumerate(layers):
                for name, p in layer.named_parameters():
                    names.setdefault(index[id(p)], given.get(id(p), f"layers[{i}].{name}"))
            self.nonfinite = nonfinite
            self._names = names
            rt.optimizer = self._optimizer = OptimizerWorker(
                self._host,
                store,
                self._protocol,
                self.scaler,
                optimizer_threads,
                nonfinite=nonfinite,
                names=names,
            )
            rt.workers.extend(Worker(i, d, rt) for i, d in enumerate(devs))
            self.replicas = replicas
            self._reducer: GradientReducer | None = None
            if replicas is not None and replicas.world_size > 1:
                self._protocol.replicated = True
                buckets = gradient_buckets(gradient_layer_bytes(self._host), replicas.bucket_bytes)
                rt.reducer = self._reducer = GradientReducer(
                    self._host, store, self._protocol, replicas, buckets
                )
            rt.hooks = self._outside_gradient_hooks(names)
            self._finalizer = weakref.finalize(self, rt.shutdown)
            for w in rt.workers:
                w.start()
            if async_optimizer:
                self._optimizer.start()
            if self._reducer is not None:
                self._reducer.start()
        except BaseException:
            # nothing may keep the model's copy (or page-locked memory) after a
            # failed construction: threads already started stop, the arena goes
            rt = self.__dict__.get("_rt")
            if rt is not None:
                rt.shutdown()
            else:
                self._host.free()
            raise
        log.info(
            "RoundPipe engine: %d layers, plan %s, %d workers on %s",
            len(layers),
            plan,
            n,
            ", ".join(map(str, devs)),
        )

    @classmethod
    def from_options(
        cls,
        layers: Sequence[nn.Module],
        devices: Sequence[torch.device | str | int],
        num_microbatches: int,
        options: EngineOptions,
        **kwargs: Any,
    ) -> RoundPipeEngine:
        """An engine with ``options`` (validated when they were made);
        ``kwargs``: the arguments that are not options (``plan``, ``costs``,
        ``activation_estimate``, ``optimizer_state``, ``parameter_names``,
        ``spread_values``, ``owners``, ``chaos``, ``rules``)."""
        return cls(layers, devices, num_microbatches, **options.as_kwargs(), **kwargs)

    def _outside_gradient_hooks(self, names: dict[int, str]) -> list[Any]:
        """Autograd on the caller's thread reaching a pipeline parameter (a
        weight penalty, a tied weight used outside the layers): in synchronous
        mode its gradient joins the window's, exactly as in the unsplit model;
        in asynchronous mode it is refused before it is written, since the
        optimizer thread owns ``.grad`` and the weights while the caller runs."""
        engine = weakref.ref(self)  # the parameters must not keep the engine alive
        handles = []
        for p in self._host.trainable:
            name = names.get(p.index, f"parameter {p.index}")
            if self.async_optimizer:

                def refuse(grad: torch.Tensor, name: str = name) -> None:
                    raise RuntimeError(
                        f"pipeline parameter {name} got a gradient from autograd on the "
                        "training loop's thread (a weight penalty, a tied weight used outside "
                        "the layer stack, or the stack's layers called one by one instead of the "
                        "stack itself). With the asynchronous optimizer the optimizer thread "
                        "updates it meanwhile, so the loop would read and write it in a race. "
                        "Use strategy='roundpipe_sync' (async_optimizer=False), which adds such "
                        "gradients to the pipeline's exactly, or compute the term inside a "
                        "pipeline layer"
                    )

                handles.append(p.param.register_hook(refuse))
            else:
                # before accumulation: the incoming gradient alone goes into the
                # window's buffer and autograd accumulates zeros (``.grad`` may be
                # the exposed buffer itself, after a mid-window synchronize)
                was_none = [False]

                def add(grad: torch.Tensor, p: _Param = p, was_none: list = was_none) -> Any:
                    eng = engine()
                    if eng is None:
                        return None
                    with eng._lock:
                        scale = eng._window_scale.setdefault(eng._window, eng.scaler.scale)
                        eng._window_has_grads = True
                    with torch.no_grad():
                        g = grad.detach()
                        g = g.to_dense() if g.is_sparse else g
                        eng._host.accumulate(p, g * scale if scale != 1.0 else g)
                    was_none[0] = p.param.grad is None
                    return torch.zeros_like(grad)

                def clear(param: torch.Tensor, was_none: list = was_none) -> None:
                    if was_none[0]:  # the zeros autograd put there: not a gradient
                        param.grad = None

                handles.append(p.param.register_hook(add))
                handles.append(p.param.register_post_accumulate_grad_hook(clear))
        return handles

    def _set_plan(self, plan: StagePlan, costs: LayerCosts | None = None) -> None:
        """Install a stage plan and a fresh clock for the costs in use. A new
        plan is installed between iterations with nothing in flight; the same
        plan only gets the new clock (its running-statistics order is kept)."""
        same = getattr(self, "plan", None) == plan
        self.plan = plan
        self._plan_costs = costs if costs is not None else self._costs
        self._periods: dict[tuple[int, int], float] = {}  # (M, round size) -> step
        self._clock = Clock(
            costs if costs is not None else self._costs,
            self.num_devices,
            async_optimizer=self.async_optimizer,
            double_buffer=self.double_buffer,
        )
        if same:
            return
        # forward-only slots (evaluation, outputs for a loss computed outside):
        # the forward stages, then the fused stage's layers run forward only
        top = plan.fused_stage
        self._forward_slots = [
            *plan.stages[: len(plan.forward)],
            Stage(len(plan.forward), "Ftop", "forward", *top),
        ]
        # slots with running statistics run their rounds in micro-batch order
        self._ordered = {
            st.index
            for st in plan.stages
            if st.kind != "backward" and self._host.stage_has_state(st.start, st.stop)
        }
        self._forward_ordered = {
            st.index for st in self._forward_slots if self._host.stage_has_state(st.start, st.stop)
        }
        self._last_ordered: dict[int, tuple] = {}

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
        """After profiling, install what :func:`~lightning_roundpipe.plan.decide.after_measurement`
        decides (between iterations, with nothing in flight); the clock predicts
        with the measured times from then on."""
        if self._replanned or self._profiler is None or not self._profiler.complete:
            return
        self._replanned = True
        costs = self.measured_costs()
        assert costs is not None
        if not self._user_plan:
            self._wait_tasks()  # an iteration boundary with nothing in flight
        decision = after_measurement(
            self.plan,
            costs,
            self._costs,
            self.num_devices,
            self.num_microbatches,
            user_plan=self._user_plan,
            async_optimizer=self.async_optimizer,
            round_size=self.microbatches_per_round,
            memory_limit=self._limit,
            size_limit=self.size_limit,
            margin=self.replan_margin,
            weight_cap=self._weight_cap,
            boundary=self._boundary,
            host_limit=self._host_limit,
        )
        (log.warning if decision.warning else log.info)("RoundPipe %s", decision.reason)
        self._set_plan(decision.plan, costs)
        if self.devices[0].type == "cuda" and not self._user_plan:
            # for the report: whether a round's compute hides its weight uploads
            self._bandwidth = host_to_device_bandwidth(self.devices[0])
            log.info("RoundPipe: %.1f GB/s host to device", self._bandwidth / 1e9)

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
    def memory_limit(self) -> int | None:
        """Bytes a stage may use on a device (``device_memory_limit``, or from
        the free memory of the GPUs); None: no limit (CPU workers)."""
        return self._limit

    @property
    def prefetch(self) -> bool:
        """Whether a worker uploads the next stage's weights and the next
        micro-batch's input while a stage runs (False once long sequences
        leave a stage all of the device's usable memory:
        :func:`~lightning_roundpipe.plan.decide.plan_for_activations`)."""
        return self._rt.prefetch

    def expect_activations(
        self,
        saved: Sequence[float],
        transient: Sequence[float],
        boundary: float | None = None,
    ) -> list[float]:
        """Tell the engine the activation memory its layers are predicted to
        need for the coming micro-batches: ``saved[i]`` bytes layer ``i`` keeps
        for its backward, ``transient[i]`` bytes it works with on top while it
        runs (model adapters predict them from the call's shape, see
        :mod:`lightning_roundpipe.models.memory`), and ``boundary`` bytes of
        one layer's input value (the same at every layer; None: not known).
        Before per-layer measurements exist, a plan whose stages would not fit
        the memory limit, or whose boundary values of one micro-batch would
        not fit ``activation_memory`` on the host, is replaced now, before
        anything runs (a given plan is kept, with a warning; see
        :func:`~lightning_roundpipe.plan.decide.plan_for_activations`).
        Both count ``activation_scale`` times over. Returns each slot's
        predicted peak device memory (:attr:`predicted_peaks`)."""
        n = self._costs.num_layers
        if len(saved) != n or len(transient) != n:
            raise ValueError(f"expect_activations needs one value per pipeline layer ({n})")
        if boundary is not None and not boundary >= 0:
            raise ValueError(f"boundary must be a number of bytes >= 0, got {boundary!r}")
        if boundary is not None:
            self._boundary = boundary
        self._expected = (list(saved), list(transient))
        if self._replanned:  # measured activations decide the plan from now on
            self.predicted_peaks = stage_peaks(
                self.plan, self._costs, *self._scaled(self.activation_scale), self._boundary
            )
            return self.predicted_peaks
        decision = self._for_activations(
            self.activation_scale, self.plan, self._limit, self._weight_cap, self._rt.prefetch
        )
        if decision.memory_limit != self._limit:
            # long sequences: stages take more of the device, the prefetched
            # next stage's weights less, or nothing is prefetched (the limit
            # holds for measurements too)
            self._limit = int(decision.memory_limit)
            self._weight_cap = decision.weight_cap
            if not decision.prefetch:
                self._wait_tasks()  # (workers read the switch between tasks)
            self._rt.prefetch = decision.prefetch
        if decision.plan != self.plan:
            self._wait_tasks()  # an iteration boundary with nothing in flight
            self._set_plan(decision.plan)
            log.info("RoundPipe %s", decision.reason)
        elif decision.warning:
            log.warning("RoundPipe %s", decision.reason)
        self.predicted_peaks = decision.peaks
        return decision.peaks

    def plan_with_activations(self, scale: float) -> Predicted | None:
        """What :func:`~lightning_roundpipe.plan.decide.plan_for_activations`
        decides on a new engine with these options (from the plan, stage
        limit and prefetching this one started with) for the activations
        last told to :meth:`expect_activations` counted ``scale`` times
        over; nothing changes. None before any were told."""
        if self._expected is None:
            return None
        plan, limit = self._initial
        return self._for_activations(scale, plan, limit, None, True)

    def _scaled(self, scale: float) -> tuple[list[float], list[float]]:
        """The saved and transient bytes last told, counted ``scale`` times over."""
        assert self._expected is not None
        saved, transient = ([scale * x for x in v] for v in self._expected)
        return saved, transient

    def _for_activations(
        self,
        scale: float,
        plan: StagePlan,
        limit: int | None,
        weight_cap: float | None,
        prefetch: bool,
    ) -> Predicted:
        """plan_for_activations from this state, for the activations last
        told counted ``scale`` times over."""
        return plan_for_activations(
            plan,
            self._costs,
            *self._scaled(scale),
            self.num_devices,
            self.num_microbatches,
            user_plan=self._user_plan,
            async_optimizer=self.async_optimizer,
            memory_limit=limit,
            size_limit=self.size_limit,
            device_budget=self._budget,
            weight_cap=weight_cap,
            boundary=self._boundary,
            host_limit=self._host_limit,
            prefetch=prefetch,
        )

    @property
    def reduction(self) -> dict[str, float] | None:
        """With replicas: ``windows`` (optimizer steps) whose gradients were
        averaged, ``bytes`` of gradients this replica all-reduced (launched),
        ``busy_seconds`` with an all-reduce in flight, and ``wait_seconds`` the
        optimizer waited for the average after this replica's own gradients
        were complete: added to the step with the synchronous optimizer; with
        the asynchronous one hidden while it fits in the next window's
        compute. None on one server."""
        if self._reducer is None:
            return None
        return {
            "windows": float(self._reducer.windows),
            "bytes": float(self._reducer.bytes),
            "busy_seconds": self._reducer.seconds,
            "wait_seconds": self._protocol.reduction_wait,
        }

    @property
    def tile_budget(self) -> int | None:
        """Bytes one sequence tile's transient working set may take on a device
        (see ``tile_memory``); None: never tile."""
        tm = self.options.tile_memory
        if tm != "auto":
            return tm
        if self._tile_limit is None:  # CPU workers without a limit: the host's memory
            return _CPU_TILE_MEMORY
        return max(1, self._tile_limit // 8)

    @property
    def bytes_moved(self) -> int:
        """Bytes copied between host and devices so far (on CPU workers: the bytes
        a device would have moved)."""
        return self._rt.traffic.bytes

    def traffic(self, iteration: int | None = None) -> dict[str, int]:
        """Bytes one (recent) iteration moved, by kind (default: the last
        training iteration). See :class:`~lightning_roundpipe.runtime.profiler.Traffic`."""
        if iteration is None:
            if self._last_train is None:
                return dict.fromkeys(TRAFFIC_KINDS, 0)
            iteration = self._last_train.iteration
        return self._rt.traffic.of(iteration)

    def traffic_report(self) -> TrafficReport | None:
        """The last training iteration's traffic against the least its schedule
        could move (call after :meth:`synchronize`); None before any."""
        sched = self._last_train
        if sched is None or self.round is None:
            return None
        host = self._host
        weights = grads = 0
        for st in sched.stages:
            span = host.span(st.start, st.stop)
            weights += span.nbytes + sum(p.nbytes for p in span.outside)
            if st.kind != "forward":
                grads += 4 * sum(
                    p.master.numel() for p in host.stage_params(st.start, st.stop) if p.trainable
                )
        hidden, exposed = None, []
        costs = self.measured_costs()
        if self._bandwidth and costs is not None:
            exposed = exposed_uploads(
                sched.stages, costs, sched.round_size, self._bandwidth, self._rt.prefetch
            )
            hidden = not exposed
        return TrafficReport(
            sched.iteration,
            self.traffic(sched.iteration),
            weights,
            grads,
            sched.num_rounds,
            self.round,
            hidden,
            tuple(exposed),
        )

    # ---------------------------------------------------------------- trace
    def trace_operations(self) -> list[dict[str, Any]]:
        """Real start and end of every recorded operation (needs ``trace=True``);
        see :meth:`~lightning_roundpipe.runtime.profiler.TraceRecorder.operations`."""
        if self._rt.trace is None:
            raise RuntimeError("the engine records no trace; create it with trace=True")
        return self._rt.trace.operations()

    def chrome_trace(self) -> dict[str, Any]:
        """The recorded operations as a Chrome/Perfetto trace (``trace=True``)."""
        if self._rt.trace is None:
            raise RuntimeError("the engine records no trace; create it with trace=True")
        return self._rt.trace.chrome_trace()

    def write_trace(self, directory: str | Path, iterations: int = 3) -> list[Path]:
        """Write the recorded trace (``trace=True``): measured and simulated
        timeline pictures of the last ``iterations`` training iterations and a
        Chrome/Perfetto trace; see
        :func:`~lightning_roundpipe.runtime.profiler.write_trace`."""
        if self._rt.trace is None:
            raise RuntimeError("the engine records no trace; create it with trace=True")
        self._wait_tasks()
        measured = self.measured_costs() is not None
        return write_trace(self._rt.trace, directory, iterations, measured_costs=measured)

    @property
    def boundary_bytes(self) -> int:
        """Host bytes of the stage-boundary values the last training
        iteration's forward stages wrote for later stages (0 before any; call
        after :meth:`synchronize`). With one micro-batch and one device it is
        about what the host held at the iteration's peak."""
        sched = self._last_train
        if sched is None:
            return 0
        with self._rt.store.lock:
            return int(self._rt.kept.get(sched.iteration, 0))

    @property
    def boundary_peak(self) -> int:
        """The most host bytes of training stage-boundary values held at once
        since the engine started (written by a stage, not yet taken by their
        last reader)."""
        with self._rt.store.lock:
            return int(self._rt.held_peak)

    @property
    def last_schedule(self) -> Schedule | None:
        """The schedule of the last training iteration (with the clock's
        prediction of its timeline when recording a trace)."""
        return self._last_train

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

    @property
    def healthy(self) -> bool:
        """Open, and no worker or optimizer step has failed: waiting for its
        outstanding work (:meth:`synchronize`) can succeed."""
        return not self._rt.closed and self._rt.store.failure is None

    @property
    def updates_applied(self) -> bool:
        """Whether every optimizer step submitted so far has been applied (also
        after a failure: a failed forward or backward leaves the weights those
        of the last step, a step that failed midway leaves them of none)."""
        return self._optimizer.applied + self._steps_not_run >= self._jobs

    @property
    def failure(self) -> BaseException | None:
        """What failed (a worker's or the optimizer's error), None while healthy."""
        return self._rt.store.failure

    @property
    def failure_raised(self) -> bool:
        """Whether :attr:`failure` was raised to a caller (not only recorded
        by the thread it happened on)."""
        return self._rt.store.raised

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
        self._rt.store.raised = True
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
            # the thread this one waited on times out about now too, with what
            # it waited for in turn (a stage's input, an optimizer step): that
            # failure names the cause, this wait only its effect
            store = self._rt.store
            deadline = time.monotonic() + min(store.timeout, 2.0)
            with store.lock:  # (Store.fail notifies it)
                while store.failure is None and (left := deadline - time.monotonic()) > 0:
                    store.lock.wait(left)
            self._raise_failure()
            running = running_now(self._rt.workers)
            running = f"; {running}" if running else ""
            raise HandoffTimeout(f"{exc}{running}\n{self._stuck_grid()}") from None
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def _stuck_grid(self) -> str:
        """The last submitted iteration's grid, marked at its first unfinished task."""
        if self._last_schedule is None:
            return "(nothing dispatched yet)"
        call, sched = self._last_schedule
        with self._rt.store.lock:
            done = set(self._rt.done_keys)
        stuck = next(
            (i for i in range(len(sched.tasks)) if (call.serial, i) not in done),
            None,
        )
        where = (
            ""
            if stuck is None
            else f"first unfinished task: {sched.tasks[stuck]} on device "
            f"{sched.tasks[stuck].device}\n"
        )
        return f"iteration {call.iteration}, {where}{sched.grid(mark=stuck)}"

    def microbatches_for(self, batch_size: int, training: bool = True) -> int:
        """How many micro-batches a batch of ``batch_size`` samples is split into:
        ``num_microbatches``, or one sample each when the batch is shorter (for
        evaluation always; for training with ``fit_to_batch``)."""
        m = self.num_microbatches
        if batch_size < m and (self.fit_to_batch or not training):
            return max(1, batch_size)  # a short batch (the last of an epoch): one sample each
        return m

    def _split(self, inputs: Any, training: bool = True) -> tuple[int, list[Any]]:
        bsz = batch_size_of(inputs)
        if bsz is None:
            raise ValueError(
                "cannot split inputs into micro-batches: they contain no tensor with a batch "
                "dimension"
            )
        if not self._warned_ambiguous and (
            firsts := {tuple(t.shape) for t in flatten_tensors(inputs) if t.shape[:1] != (bsz,)}
            - {()}
        ):
            self._warned_ambiguous = True  # (once: sequence lengths vary)
            log.warning(
                "RoundPipe: the batch size is taken from the inputs' first tensor with a "
                "dimension, %d; tensors of shapes %s are given whole to every micro-batch. If "
                "one of them holds the batch, put it first in the inputs",
                bsz,
                ", ".join(map(str, sorted(firsts))),
            )
        m = self.microbatches_for(bsz, training)
        if bsz < m:
            raise ValueError(
                f"batch size ({bsz}) is smaller than num_microbatches ({m}); use a larger "
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
            # (float64 stays: a layer computes with it on purpose, timestamps say)
            if cast and t.is_floating_point() and t.dtype not in (dtype, torch.float64):
                t = t.to(dtype)
            t = t.cpu()
            return pin(t) if on_cuda else t

        return map_tensors(conv, value)

    def _round_size(self, mbs: list[Any], train: bool) -> int:
        """Micro-batches per round: as given, else the whole batch within the
        host activation budget."""
        m = len(mbs)
        if not train:
            return min(self.microbatches_per_round or m, m)  # nothing is kept for a backward
        if self.microbatches_per_round is not None:
            given = self.microbatches_per_round
            mr = min(given, m)
            reason = (
                f"microbatches_per_round={given} as given"
                if mr == given
                else f"microbatches_per_round={given} given, {mr} used (the batch has {m} "
                f"micro-batch{'es' if m != 1 else ''})"
            )
            self.round = RoundChoice(mr, None, self.activation_memory, reason)
            return mr
        per_mb = None
        largest = max(batch_size_of(x) or 1 for x in mbs)
        if self._boundary_per_sample is not None:  # measured in an earlier iteration
            per_mb = int(self._boundary_per_sample * largest)
        elif self.activation_estimate is not None:
            kept = self.plan.boundaries_per_microbatch()
            per_mb = int(self.activation_estimate(mbs[0]) * kept)
        self.round = self._choose_round(m, per_mb, self.activation_memory)
        return self.round.round_size

    def _choose_round(self, m: int, per_mb: int | None, budget: int | None) -> RoundChoice:
        """:func:`~lightning_roundpipe.plan.policy.choose_round` with this
        plan's simulated step per round size (cached until the plan changes)
        and, once the link is measured, the rounds whose compute hides the
        weight uploads."""
        costs, n = self._plan_costs, self.num_devices

        def period(g: int) -> float:
            key = (m, g)
            if key not in self._periods:
                self._periods[key] = simulated_period(
                    costs, self.plan, n, m, async_optimizer=self.async_optimizer, round_size=g
                )
            return self._periods[key]

        hidden = None
        measured = self.measured_costs() if self._bandwidth else None
        if measured is not None and measured.weight_bytes is not None:
            bandwidth, prefetch = self._bandwidth, self._rt.prefetch

            def hidden(g: int) -> bool:
                if not prefetch:  # (nothing overlaps an upload: the fewest rounds)
                    return False
                return hides_uploads(self.plan, measured, g, bandwidth)

        return choose_round(
            m, boundary_bytes=per_mb, budget=budget, num_devices=n, period=period, hidden=hidden
        )

    def planned_round_size(self) -> int:
        """Micro-batches per round of a full training batch, as far as known
        before it runs (its activations' size aside): for reports."""
        if self.microbatches_per_round is not None:
            return min(self.microbatches_per_round, self.num_microbatches)
        return self._choose_round(self.num_microbatches, None, None).round_size

    def _submit(self, call: Call, slots: Any, mbs: list[Any], train: bool) -> None:
        """Lower the iteration, put the micro-batch inputs into the store and hand
        every task to its worker. Caller holds ``self._lock``.

        An exception once some tasks are handed out (a ``KeyboardInterrupt``
        between two hand-offs) fails the engine: the handed-out tasks wait for
        ones that never come, and a later wait for them would last until the
        watchdog."""
        rt = self._rt
        before = rt.submitted
        try:
            self._hand_out(call, slots, mbs, train)
        except BaseException as exc:
            if rt.submitted != before:
                rt.store.fail(exc)
            raise

    def _hand_out(self, call: Call, slots: Any, mbs: list[Any], train: bool) -> None:
        """:meth:`_submit`'s work."""
        store, rt = self._rt.store, self._rt
        sched = lower(
            slots,
            self.num_devices,
            len(mbs),
            round_size=self._round_size(mbs, train),
            clock=self._clock,
            iteration=call.iteration,
            window=call.window,
            training=train,
            ordered_slots=(
                () if not call.writes_state else self._ordered if train else self._forward_ordered
            ),
            output_readers=0 if train else 1,
            placement=self.placement,
            predict=rt.trace is not None,  # kept for the trace's simulated timeline
        )
        call.schedule = sched
        for j, x in enumerate(mbs):
            store.put(
                Key(call.iteration, "act", 0, j), self._to_host(x, cast=True), sched.readers[0]
            )
        self._last_schedule = (call, sched)
        if train:
            self._last_train = sched
            if rt.trace is not None:
                rt.trace.add_schedule(sched)
        rt.forget(call.serial - 4, call.iteration - 4, set(self._last_ordered.values()))
        stateful = self._ordered if train else self._forward_ordered
        jobs = [Job(call, task, index) for index, task in enumerate(sched.tasks)]
        # registered in micro-batch order: the order gradients are added in,
        # whichever device is done first
        for job in sorted(jobs, key=lambda j: (j.task.mb_start, j.index)):
            task = job.task
            job.turns = self._protocol.register(
                call.window,
                self._host.stage_params(task.start, task.stop),
                grads=task.needs_grad,
                gain=call.gain,
            )
        for job in jobs:
            task = job.task
            if task.ordered:
                job.after = self._last_ordered.get(task.slot)
                self._last_ordered[task.slot] = job.key
            elif task.kind != "backward" and task.slot in stateful:
                # reads the running statistics the slot's last writer leaves
                job.after = self._last_ordered.get(task.slot)
            with store.lock:
                rt.submitted += 1
            rt.workers[task.device].submit(job)

    def _call(
        self,
        iteration: int,
        labels: list[Any],
        weights: list[float],
        loss_fn: Callable[..., torch.Tensor] | None,
        scale: float,
        train: bool,
        forward: Call | None = None,
    ) -> Call:
        """A call record (its schedule is filled in by :meth:`_submit`).
        ``forward``: the forward-only pass of the same reserved iteration,
        whose layers' structures and modes this call runs with. Caller holds
        ``self._lock``."""
        if forward is not None:
            structures, modes = forward.structures, forward.modes
        else:
            # (raises LayoutChanged before anything is counted)
            structures = [info.structure() for info in self._host.layers]
            modes = [st.modes() for st in structures]
        for st in structures:
            st.refresh()
        self._serial += 1
        profiler = self._profiler
        call = Call(
            iteration,
            self._window,
            self._serial,
            labels,
            weights,
            loss_fn,
            scale,
            self.seed,
            None,  # type: ignore[arg-type]
            train,
            modes,
            structures,
            profiler if train and profiler is not None and profiler.wants(iteration) else None,
        )
        if self._stepping == threading.get_ident():
            # a call from a synchronous step's own hooks (on_before_optimizer_step):
            # the step waits for them, so its window's weights, which the
            # parameters hold then as under Lightning (the next window's would
            # wait for this step: a deadlock until the watchdog)
            if train:
                raise RuntimeError(
                    f"a training call (forward and backward) came from inside optimizer step "
                    f"{self._window - 1}, e.g. from on_before_optimizer_step: the pipeline's "
                    "gradients of that step are already taken. Compute it in training_step, or "
                    "under torch.no_grad() in the hook"
                )
            call.version = self._protocol.read_version(self._window - 1)
        else:
            call.version = self._protocol.read_version(self._window, newest=self._newest)
        call.writes_state = train
        call.frozen = (
            forward.frozen
            if forward is not None
            else frozenset(
                p.index for p in self._host.params if p.trainable and not p.param.requires_grad
            )
        )
        return call

    def _check_trainable(self) -> None:
        """Refuses a call that would compute gradients while some pipeline
        weights require one that did not when the engine was built (they have
        no gradient buffers). Weights frozen since then get no gradient from
        the call, as under autograd (PEFT's ``disable_adapter()``)."""
        unfrozen = [
            self._names[p.index]
            for p in self._host.params
            if p.param.requires_grad and not p.trainable
        ]
        if unfrozen:
            raise ValueError(
                f"{', '.join(unfrozen[:3])}"
                f"{f' and {len(unfrozen) - 3} more' if len(unfrozen) > 3 else ''} "
                f"require{'s' if len(unfrozen) == 1 else ''} a gradient but did not when the "
                "engine was built (it fixes which weights get gradient buffers and updates). "
                "Unfreeze weights between steps (RoundPipeStrategy then builds a new engine "
                "itself, e.g. for BaseFinetuning; outside it, close this engine and build a new "
                "one)"
            )

    def wants_gradients(self) -> bool:
        """Whether any pipeline weight requires a gradient now. None does under
        PEFT's ``disable_adapter()`` with the base model frozen: a call there
        records nothing for autograd, so it runs forward only."""
        return any(p.param.requires_grad for p in self._host.params)

    def reserve_iteration(self) -> int:
        """Take the next iteration number now (for a ``forward`` whose
        ``forward_backward`` follows later with the same dropout masks)."""
        self._leave_newest()
        with self._lock:
            it = self._iteration
            self._iteration += 1
            return it

    def forward(
        self, inputs: Any, iteration: int | None = None, per_microbatch: bool = False
    ) -> Any:
        """Forward-only pass through every layer (no autograd), in the layers'
        current train/eval mode; returns the last layer's outputs for the whole
        batch (micro-batch outputs concatenated along dimension 0; a tensor
        whose first dimension is not its micro-batch's size is refused unless
        ``per_microbatch``: values of each micro-batch, such as router
        statistics, concatenated as they are).

        ``iteration`` selects the dropout masks (use :meth:`reserve_iteration`
        to match a later ``forward_backward``); by default a separate counter is
        used so evaluation never shifts the masks of training iterations.

        Layers with running statistics (batch norm) in training mode update
        them, as their own forward would (``torch.optim.swa_utils.update_bn``,
        a pass without a backward); a ``forward_backward`` of the same
        reserved iteration then leaves them alone (its forward computes the
        batch again for the gradients)."""
        self._check()
        bsz, mbs = self._split(inputs, training=False)
        m = len(mbs)
        reserved = iteration is not None
        if reserved:  # (its backward follows)
            self._check_trainable()
        with self._lock:
            if iteration is None:
                self._eval_iteration -= 1
                iteration = self._eval_iteration
            call = self._call(iteration, [None] * m, [1.0] * m, None, 1.0, train=False)
            call.writes_state = any(
                info.has_state and any(modes)
                for info, modes in zip(self._host.layers, call.modes, strict=True)
            )
            if reserved:
                # (one whose backward never came is forgotten after a while)
                recent = iteration - _RESERVED_KEPT
                self._reserved = {i: c for i, c in self._reserved.items() if i > recent}
                self._reserved[iteration] = call
            call.again = reserved  # its forward_backward computes these layers again
            self._submit(call, self._forward_slots, mbs, train=False)
        store, top = self._rt.store, self.plan.num_layers
        outs = [
            self._wait(
                lambda j=j: store.take(Key(iteration, "act", top, j), f"output of micro-batch {j}")[
                    0
                ]
            )
            for j in range(m)
        ]
        # (torch.tensor_split's sizes: the first bsz % m one larger)
        sizes = [bsz // m + (j < bsz % m) for j in range(m)]
        return merge_microbatches(outs, None if per_microbatch else sizes)

    def forward_backward(
        self,
        inputs: Any,
        labels: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        scale: float | Literal["later"] = 1.0,
        loss_weights: Sequence[float] | Callable[[list[Any]], Sequence[float]] | None = None,
        iteration: int | None = None,
        input_grads: bool = False,
        with_outputs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """Run forward, loss and backward of one batch through the pipeline.

        Args:
            inputs: the first layer's input (tensor, tuple or dict); tensors
                whose first dimension is the batch size are split into
                micro-batches, everything else is given to every micro-batch.
            labels: split like ``inputs`` and passed to ``loss_fn``.
            loss_fn: ``loss_fn(output_mb, labels_mb)`` -> scalar; ``None`` when
                the last layer returns the loss.
            scale: gradients are those of ``scale * loss``. ``"later"``: the
                factor is not known yet; give it with :meth:`scale_gradients`
                (e.g. when autograd reaches the returned loss, which may have
                been scaled or combined with other terms). The weight gradients
                wait on the host until then; a window's :meth:`step` (or
                :meth:`zero_grad`) takes a factor never given as 0, as autograd
                would for a loss nothing was backpropagated through.
            loss_weights: weight of each micro-batch's loss, or a function of
                the micro-batches' labels (as the batch is split) that returns
                them (e.g. each micro-batch's share of the batch's real
                tokens); default its share of the batch (``mb_size / batch_size``).
            iteration: a number from :meth:`reserve_iteration` (dropout masks of
                an earlier :meth:`forward`); default the next one.
            input_grads: also compute the gradient with respect to the
                floating-point tensors of ``inputs`` (embeddings from a trainable
                module outside the pipeline); take it with :meth:`input_grads`.
            with_outputs: ``loss_fn`` returns ``(loss, output)``: ``output``
                (tensors of the micro-batch, small ones such as a classifier's
                pooled logits; a copy, without gradient) comes back to the host
                with the loss, and the call returns ``(loss, outputs)``, the
                micro-batches' outputs concatenated along dimension 0.

        Returns:
            ``scale * sum_j weight_j * loss_j`` (without ``scale`` when it is
            ``"later"``) as a host float32 scalar (fp16
            loss scaling is internal and not included), available once every
            micro-batch's loss is known (backward stages may still be running;
            ``synchronize`` waits for them); with ``with_outputs``, ``(loss,
            outputs)``.
        """
        self._check()
        if iteration not in self._reserved:  # (else checked by its forward)
            self._check_trainable()
        later = isinstance(scale, str)
        if later and scale != "later":
            raise ValueError(f"scale must be a number or 'later', got {scale!r}")
        bsz, mbs = self._split(inputs)
        self._leave_newest()
        m = len(mbs)
        labs = [None] * m if labels is None else split_microbatches(labels, m, bsz)
        if loss_weights is None:
            weights = [batch_size_of(x) / bsz for x in mbs]
        else:
            given = loss_weights(labs) if callable(loss_weights) else loss_weights
            weights = [float(w) for w in given]
            if len(weights) != m:
                raise ValueError(
                    f"loss_weights has {len(weights)} entries; give one per micro-batch ({m})"
                )
        labs = [None if y is None else self._to_host(y, cast=False) for y in labs]
        self._maybe_replan()
        # (the window only changes in step(), on this thread; waited for
        # outside the lock)
        starting = self._window_scale.get(self._window)
        if starting is None:
            starting = self._scale_for(self._window)
        with self._lock:
            if iteration is None:
                iteration = self._iteration
                self._iteration += 1
            window = self._window
            # the loss scale a window starts with unscales all of its gradients
            loss_scale = self._window_scale.setdefault(window, starting)
            self._window_has_grads = True
            seed = loss_scale if later else float(scale) * loss_scale
            forward = self._reserved.pop(iteration, None)
            call = self._call(iteration, labs, weights, loss_fn, seed, True, forward)
            if forward is not None and forward.writes_state:
                call.writes_state = False  # (its forward-only pass wrote them)
            call.input_grad = input_grads
            call.with_outputs = with_outputs
            if later:
                call.gain = Gain(iteration, window)
            self._submit(call, self.plan, mbs, train=True)
            # registered once submitted: nothing waits for a call that never ran
            if input_grads:
                self._caller_grads.want_inputs(iteration, inputs, m, bsz, loss_scale, window)
            if later:
                self._caller_grads.track(call.gain)
        store = self._rt.store
        with named(f"RP wait losses of iteration {iteration}"):
            losses = [
                self._wait(
                    lambda j=j: store.take(
                        Key(iteration, "loss", 0, j), f"loss of micro-batch {j}"
                    )[0]
                )
                for j in range(m)
            ]
        # every forward stage is done: the host memory one sample's activations take
        with store.lock:
            kept = self._rt.kept.get(iteration, 0)
        if kept:
            per_sample = kept / bsz
            self._boundary_per_sample = max(self._boundary_per_sample or 0.0, per_sample)
        outputs = None
        if with_outputs:
            outputs = [out for _, out in losses]
            losses = [loss for loss, _ in losses]
        per_mb = torch.stack([loss.reshape(()).float().cpu() for loss in losses])
        if (
            self.nonfinite == "raise"
            and not self.scaler.enabled
            and not bool(torch.isfinite(per_mb).all())
        ):
            bad = [j for j in range(m) if not bool(torch.isfinite(per_mb[j]))]
            self._caller_grads.forget_inputs(iteration)
            raise NonFiniteError(
                f"the loss of micro-batch(es) {bad} in iteration {iteration} is not finite "
                f"({per_mb[bad[0]].item()}); the weights were not updated by it. Set "
                "nonfinite='skip' to skip such steps, or look for the cause (learning rate, "
                "data, precision)"
            )
        total = per_mb.sum() if later else per_mb.sum() * float(scale)
        if outputs is None:
            return total
        return total, merge_microbatches(outputs, [batch_size_of(x) for x in mbs])

    def input_grads(self, iteration: int) -> list[torch.Tensor | None]:
        """The gradient of a ``forward_backward(..., input_grads=True)`` call's
        loss (times its ``scale``, unless that was ``"later"``) with respect to
        each tensor of its ``inputs``, in ``flatten_tensors(inputs)`` order (None
        for tensors that are not floating point). Waits for the
        first layer's backward of every micro-batch; once per iteration. A
        non-finite one skips the window's step or raises, per ``nonfinite``."""
        return self._caller_grads.input_grads(iteration)

    def scale_gradients(self, iteration: int, factor: float) -> None:
        """The factor for the weight gradients of ``iteration``, a
        ``forward_backward(..., scale="later")``: its gradients are added into
        the window's as ``factor`` times those of its loss. Once per iteration."""
        self._caller_grads.scale(iteration, factor)

    def call(self, fn: Callable[[], Any]) -> StepHandle:
        """Run ``fn`` on the host in order with the optimizer steps (after the
        step queued last): for ``zero_grad``, or anything else that must not
        race an asynchronous update (the strategy's schedulers step on the
        loop's thread instead, see :mod:`lightning_roundpipe.groups`).
        Synchronous mode: at once."""
        self._check()
        handle = StepHandle(-1, _store=self._rt.store)
        if not self.async_optimizer:
            try:
                self._protocol.chaos("call")
                handle.result = fn()
            except (KeyboardInterrupt, SystemExit):
                raise  # an interrupt stays one
            except BaseException as exc:
                raise OptimizerStepError(
                    f"a queued call (engine.call, e.g. zero_grad) failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            finally:
                handle.finish()
            return handle
        with self._lock:
            self._calls += 1
        self._optimizer.submit(_Job(-1, fn, 1.0, None, None, handle))
        return handle

    def _scale_for(self, window: int) -> float:
        """The fp16 loss scale ``window`` starts with. Asynchronous: the scale
        after update ``window - 2``, the last one its weights hold (waited
        for: its tasks wait for that update anyway), so which steps an
        overflow skips does not depend on the threads' timing; the engine's
        first two windows start with the scale it started with. Otherwise
        the current scale (every earlier update is done)."""
        scaler = self.scaler
        if not scaler.enabled or not self.async_optimizer:
            return scaler.scale
        if self._scale_start is None:
            if self._continued_scale is None:
                self._scale_start = (window, scaler.scale)
            else:
                # a run that goes on (continue_from): this window starts with
                # the scale its predecessor's window would have, the next one
                # with the scale after the predecessor's last update
                self._scale_start = (window - 1, self._continued_scale)
                scaler.after.setdefault(window - 1, scaler.scale)
        first, start = self._scale_start
        prior = window - 2
        if prior < first:
            return start
        store = self._rt.store
        self._wait(
            lambda: store.wait_until(
                lambda: prior in scaler.after, f"the loss scale after optimizer step {prior}"
            )
        )
        return scaler.after[prior]

    def counters(self) -> dict[str, Any]:
        """What a run that continues on another engine goes on with: the next
        training call's number (``"iteration"``: dropout masks are seeded by
        it) and the fp16 loss scale (``"loss_scale"``,
        :meth:`LossScaler.state_dict`). Checkpoints save them."""
        out = {"iteration": self._iteration, "loss_scale": self.scaler.state_dict()}
        window_scale = self._next_window_scale()
        if window_scale is not None:
            out["window_scale"] = window_scale
        return out

    def _next_window_scale(self) -> float | None:
        """Asynchronous fp16: the scale the current window starts (or started)
        with, when it is known without waiting (None otherwise, and without
        loss scaling or an asynchronous optimizer)."""
        scaler, w = self.scaler, self._window
        if not scaler.enabled or not self.async_optimizer:
            return None
        if w in self._window_scale:
            return self._window_scale[w]
        if self._scale_start is None:
            return self._continued_scale if self._continued_scale is not None else scaler.scale
        first, start = self._scale_start
        return start if w - 2 < first else scaler.after.get(w - 2)

    def continue_from(self, counters: dict[str, Any]) -> None:
        """Go on with another engine's :meth:`counters` (a new engine of a run
        that continues: rebuilt when the trainable parameters change, or
        resumed from a checkpoint): the next training call's dropout masks are
        those of the uninterrupted run and the fp16 loss scale goes on. Call
        before the first ``forward_backward``."""
        if self._iteration:
            raise RuntimeError("continue_from() must be called before the first forward_backward")
        # (none: a checkpoint of another strategy, whose loss scale goes on)
        self._iteration = int(counters.get("iteration", 0))
        self.scaler.load_state_dict(counters["loss_scale"])
        # (asynchronous fp16: the next window's scale is the one before the last
        # update's; None: it starts with the loaded scale, as before)
        scale = counters.get("window_scale")
        self._continued_scale = None if scale is None else float(scale)

    def trainable_changed(self) -> list[str]:
        """Names of the parameters whose ``requires_grad`` is not what it was
        when the engine was built (freezing or unfreezing, e.g. by Lightning's
        ``BaseFinetuning``)."""
        return [
            self._names[p.index] for p in self._host.params if p.param.requires_grad != p.trainable
        ]

    def refresh_derived(self) -> None:
        """Compute again, on the host layers, the attributes their forward
        pre-hooks derive from the weights (pruning's masked weight); every
        call does so when it is submitted. For readers of the layers after
        the weights settled (:meth:`synchronize`) without a call since."""
        for info in self._host.layers:
            info.structure().refresh()

    def layout_changed(self) -> list[str]:
        """Pipeline layers whose parameters or buffers are not those the
        engine was built with (pruning's reparametrization adds a mask buffer
        and renames the weight; a parameter replaced by a new one), each
        with what changed; calls through the engine then raise
        :class:`LayoutChanged` until a new engine is built."""
        return [
            f"layer {info.index}: {change}"
            for info in self._host.layers
            if (change := info.layout_change()) is not None
        ]

    def own_gradient_hooks(self) -> set[int]:
        """Ids of the gradient hooks the engine put on the parameters (its
        handles' ids, the keys of the parameters' hook tables)."""
        return {h.id for h in self._rt.hooks}

    @property
    def has_pending_gradients(self) -> bool:
        """Whether the current window holds gradients a step has not taken
        (training calls since the last :meth:`step` or :meth:`zero_grad`)."""
        return self._window_has_grads

    @property
    def awaiting_backward(self) -> bool:
        """Whether a training call of the current window still waits for its
        loss's backward (``scale="later"``): its gradients are not the
        earlier batches' yet."""
        return self._caller_grads.awaiting(self._window)

    @property
    def estimates(self) -> LayerCosts:
        """The per-layer costs planned with before measurements (size-based
        estimates, or the ``costs`` given), in the unit of :func:`estimate_costs`."""
        return self._costs

    def wait_stages(self) -> None:
        """Wait until every dispatched stage is done (its compute and copies;
        gradients of a ``scale="later"`` call whose factor is not given yet may
        still wait on the host). Raises a stage's failure."""
        self._wait_tasks()

    def _wait_tasks(self) -> None:
        rt = self._rt
        self._wait(
            lambda: rt.store.wait_until(
                lambda: rt.done >= rt.submitted, "all dispatched stages to finish"
            )
        )

    def synchronize(self) -> None:
        """Wait for all outstanding work: every dispatched stage, every queued
        optimizer step and every queued :meth:`call` (with two master copies,
        the steps' weight copies too). Afterwards parameters hold
        the latest weights and each trainable parameter's ``.grad`` the gradient
        accumulated since the last ``step`` (fp32, in the parameter's dtype;
        ``None`` where nothing reached the parameter)."""
        self._check()
        self._wait_tasks()
        self._caller_grads.wait_settled()
        opt = self._optimizer
        # with two master copies nothing holds back an update's weight copies:
        # they are done too, so the master copies are settled afterwards
        copies = self._protocol.double_buffer
        # called from a synchronous step's own hooks (on_before_optimizer_step
        # saving a checkpoint): that step has not run yet and cannot until this
        # returns; the parameters hold the weights before it, as with Lightning
        jobs = self._jobs - (self._stepping == threading.get_ident())
        self._wait(
            lambda: self._rt.store.wait_until(
                lambda: (
                    opt.applied >= jobs
                    and opt.calls_done >= self._calls
                    and (not copies or opt.copies_done())
                ),
                "the optimizer worker to finish its steps, weight copies and queued calls",
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
        prepare: Callable[[], dict[str, Any] | None] | None = None,
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
        to set the clipping, and ``{"nonfinite": name}`` when a gradient
        outside the pipeline (``name``'s) is not finite: the step then counts
        as an overflow (fp16) or a non-finite step (``nonfinite``). After ``fn``
        the gradients are released (``.grad`` is ``None`` between steps, as
        after ``zero_grad(set_to_none=True)``).

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
        self.use_training_weights()
        self._caller_grads.settle(self._window)
        with self._lock:
            window = self._window
            self._window += 1
            scale = self._window_scale.pop(window, self.scaler.scale)
            handle = StepHandle(window, _store=self._rt.store)
            job = _Job(window, fn, scale, clip_grad_norm, clip_grad_value, handle, prepare)
            job.skip = self._caller_grads.take_skip(window)
            self._jobs += 1
            self._window_has_grads = False
            self._protocol.close_window(window)
            self._clock.step(window)
            if self._reducer is not None:  # averaged over the servers as it completes
                self._reducer.submit(window, job.skip)
        if self.async_optimizer:
            self._optimizer.submit(job)
            return handle
        try:
            self._wait_tasks()
        except BaseException as exc:
            # (a KeyboardInterrupt in the wait) the window is closed and its
            # update counted but will never run: waiting for it would last
            # until the watchdog, so the engine fails. The weights stay those
            # of the last applied step (a checkpoint may save them)
            self._steps_not_run += 1
            self._rt.store.fail(exc)
            raise
        error: BaseException | None = None
        self._stepping = threading.get_ident()
        try:
            self._optimizer.run(job)
        except EngineFailure:
            self._raise_failure()
            raise
        except NonFiniteError as exc:
            error = exc
        except HookError as exc:
            error = exc.original  # the user's hook failed: its own exception, unchanged
        except (KeyboardInterrupt, SystemExit) as exc:
            error = exc  # an interrupt stays one (Lightning shuts down gracefully on it)
        except BaseException as exc:
            error = OptimizerStepError(
                f"optimizer step {window} failed: {type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
        finally:
            self._stepping = None
        if error is not None:
            if not job.settled:
                # the window's gradients are gone and its weight copies never ran: the
                # next window could not start, so later calls fail at once with this
                self._rt.store.fail(error)
            # else the step failed after taking its gradients (a hook, a non-finite
            # gradient, the optimizer itself) and was settled as a skipped one:
            # the engine is whole, so an on_exception checkpoint can still be saved
            raise error
        return handle

    def use_newest_weights(self, hold: bool = False) -> None:
        """Until the next training call, forward passes compute with the newest
        weights: those in the parameters, which a checkpoint saves. ``hold``:
        until :meth:`use_training_weights` is called (an evaluation: a forward
        with autograd inside it, for an input gradient, computes with them
        too; no step may be taken meanwhile).

        For validation, test and predict. In asynchronous mode the master copies
        devices read are one update behind the parameters; this waits for every
        queued step (the last step is then not overlapped with compute), keeps
        the one-update-behind copies of the trainable weights aside (host memory:
        those weights once more, in the compute dtype) and copies the
        parameters in. :meth:`use_training_weights` (or the next
        :meth:`forward_backward`, :meth:`reserve_iteration` or :meth:`step`)
        puts them back, so training goes on exactly as if nothing had been
        evaluated. Synchronous mode: nothing to do after
        :meth:`synchronize`, the master copies are the parameters."""
        self.synchronize()
        self._holding = self._holding or hold
        if self.double_buffer:  # a master copy holds them (or will: rule 2 waits)
            self._newest = True
            return
        behind = self._optimizer.pending_copies()  # their masters are one update behind
        if not self.async_optimizer or not behind or self._training_masters is not None:
            return
        kept = {}
        with torch.no_grad():
            for p in behind:
                if p.trainable:  # frozen weights never change
                    kept[p.index] = p.master.clone()
                    p.master.copy_(p.param.detach())
        self._training_masters = kept

    def use_training_weights(self) -> None:
        """End of an evaluation: forward passes compute with the weights the
        next training window uses again (puts back the master copies
        :meth:`use_newest_weights` set aside; the evaluation's outputs were all
        taken, so nothing reads them any more). Training calls do this
        themselves.

        Asynchronous mode: a parameter changed in place during the evaluation
        (:meth:`reload_weights` with ``evaluation=True``) and put back to its
        values before (a callback that swapped weights in for the evaluation)
        gets its master copies back, the one-update-behind one included, so
        training goes on as if nothing had been evaluated; one still changed
        goes into every master copy (training computes with it from the next
        window)."""
        self._newest = self._holding = False
        before, self._before_evaluation = self._before_evaluation, {}
        changed = [p for p in self._host.params if p.index in before] if before else []
        with torch.no_grad():  # (every training call comes here: nothing to do mostly)
            for p in changed:
                value = before[p.index]
                if torch.equal(p.param.detach().to(value.dtype), value):
                    for m in p.masters:  # (the training copy: from kept below)
                        m.copy_(value)
                else:
                    self._host.refresh_masters([p])
                    if self._training_masters is not None:
                        self._training_masters.pop(p.index, None)
        kept, self._training_masters = self._training_masters, None
        if self._reloaded_for_evaluation:
            # weights loaded for the evaluation only (an average swapped in and
            # out again through .data): the parameters into every copy again
            self._reloaded_for_evaluation = False
            self._host.refresh_masters()
        if kept:
            version = self._protocol.read_version(self._window)
            with torch.no_grad():
                for p in self._host.params:
                    if p.index in kept:
                        p.master_for(version).copy_(kept[p.index])

    def _leave_newest(self) -> None:
        """A training call: back to the training weights, unless an
        evaluation holds the newest ones (:meth:`use_newest_weights`)."""
        if not self._holding:
            self.use_training_weights()

    def release_newest_weights(self) -> None:
        """End a hold of :meth:`use_newest_weights` without leaving them yet:
        the next training call goes back to the training weights (a hook's
        forward with autograd between steps computed with the newest ones)."""
        self._holding = False

    def stale_weights(self) -> list[torch.Tensor]:
        """The master copies (the weights the next window computes with; in
        asynchronous mode one update behind the parameters), one per distinct
        parameter in :meth:`parameters` order. Call after :meth:`synchronize`;
        they are views of the engine's host memory, valid while it is open
        (clone what must outlive it)."""
        kept = self._training_masters or {}
        version = self._protocol.read_version(self._window)
        return [kept.get(p.index, p.master_for(version)) for p in self._host.params]

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
        self._training_masters = None
        self._newest = False
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
                # a frozen weight never changes (its master may be the parameter
                # itself: a weight saved while it trained must not overwrite it);
                # window 1, next, reads version 0
                if p.trainable:
                    p.master_for(0).copy_(t)
        # numbering as if a window 0 had run: window 1 is next, the G copy of
        # window 0 is done, and update 0's P copy (parameters -> masters) is pending
        self._window = 1
        self._protocol.resume_after_window_zero()
        self._optimizer.resume_pending(0)

    def reload_weights(
        self,
        params: Sequence[nn.Parameter] | None = None,
        layers: bool = False,
        evaluation: bool = False,
    ) -> None:
        """Copy the parameters into their master copies again; call after
        changing parameters outside :meth:`step` (``load_state_dict``, a hook
        loading or clamping weights). The next forward computes with them.

        ``params``: only these (default: every one); the others keep the
        weights the next window would have computed with. ``layers``: the
        workers also copy the layers again (an attribute object changed in
        place: a plain tensor, a config's field). ``evaluation``: the weights
        are for an evaluation alone (a weight-averaging callback's average):
        with the asynchronous optimizer the weights the next training window
        reads are set aside, and :meth:`use_training_weights` puts them back
        with the parameters (the training weights by then) everywhere else;
        with ``params``, those of them put back to their values by then get
        their master copies back, the one-update-behind ones included."""
        self.synchronize()
        if layers:
            for info in self._host.layers:
                info.forget_structures()
        if params is None and evaluation and self.async_optimizer:
            if self._training_masters is None:
                version = self._protocol.read_version(self._window)
                self._training_masters = {
                    p.index: p.master_for(version).clone() for p in self._host.params if p.trainable
                }
            self._reloaded_for_evaluation = True
            self._host.refresh_masters()
            return
        if params is None:
            self._training_masters = None
            self._newest = False
            self._host.refresh_masters()
            return
        ids = {id(p) for p in params}
        chosen = [hp for hp in self._host.params if id(hp.param) in ids]
        if evaluation and self.async_optimizer:
            # for this evaluation, perhaps: use_training_weights puts the master
            # copies back if the parameters are put back by then
            version = self._protocol.read_version(self._window)
            kept = self._training_masters
            if kept is None:
                kept = self._training_masters = {}
            for hp in chosen:
                if hp.index not in self._before_evaluation:
                    newest = hp.master_for(self._protocol.read_version(self._window, newest=True))
                    self._before_evaluation[hp.index] = newest.clone()
                    if hp.trainable and hp.index not in kept:
                        kept[hp.index] = hp.master_for(version).clone()
        else:
            kept = self._training_masters or {}
            for hp in chosen:  # set aside for an evaluation: the new weights replace them
                kept.pop(hp.index, None)
        self._host.refresh_masters(chosen)

    @property
    def steps_submitted(self) -> int:
        """How many :meth:`step` calls this engine has taken (queued ones
        included): the optimizer may have written the parameters since the
        count was last read only if it changed."""
        return self._jobs

    def zero_grad(self) -> None:
        """Drop the gradients accumulated in the current window (after waiting
        for every dispatched stage and queued step); ``.grad`` is ``None``
        afterwards, as between steps."""
        self._caller_grads.settle(self._window)
        self.synchronize()
        self._host.zero_grads()
        self._host.detach_grads()
        self._window_has_grads = False

    def close(self) -> None:
        """Stop and join every worker thread and release pinned memory. Safe to
        call more than once; also runs when the engine is garbage collected."""
        stuck = self._finalizer() if self._finalizer.alive else []
        if stuck:
            # each with what it runs now and what may block it: a device
            # worker's layer, a courier's copy or gradient add, an optimizer step
            raise RuntimeError(
                f"RoundPipe threads did not stop within 30 s: {describe_threads(self._rt, stuck)}"
            )

    def __enter__(self) -> RoundPipeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""``RoundPipeStrategy``: ``Trainer(strategy="roundpipe")`` for unmodified LightningModules.

One process drives every device. At ``setup`` the strategy finds the module's
layer stack (:mod:`.models`), builds a :class:`~lightning_roundpipe.runtime.RoundPipeEngine`
over it and intercepts calls to that model, so ``training_step`` runs the
pipeline as written. Weights, gradients and optimizer state stay on the host;
the module never moves to a device, batches stay on the host too (the engine
uploads each micro-batch). The optimizer step and ``zero_grad`` are routed
through the engine so that, with the asynchronous optimizer, they run in order
on the optimizer thread while devices compute; scheduler steps run on the
loop's thread, the thread's updates with param_groups of their own
(:mod:`lightning_roundpipe.groups`).
"""

from __future__ import annotations

import datetime
import functools
import inspect
import itertools
import logging
import os
import time
import typing
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment, LightningEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from lightning.pytorch.core import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.utils import (  # (DDP's: rank 0's weights to all)
    _sync_module_states,
    _verify_param_shape_across_processes,
)
from torch.optim import Optimizer
from typing_extensions import override

from .models import find_adapter
from .models.finding import trained_outside
from .plan import PlanError, StagePlan, choose_microbatches, simulate
from .plan.decide import tightest
from .precision import RoundPipePrecision
from .retry import FirstBatchRetry
from .runtime import RoundPipeEngine, estimate_costs, use_fused
from .runtime.options import PRECISIONS, EngineOptions, NonFinite, check_types, plain_int
from .runtime.replicas import ReplicaError, Replicas

__all__ = ["RoundPipeStrategy"]

log = logging.getLogger(__name__)


@functools.cache
def _option_hints() -> dict[str, Any]:
    """The annotated types of the strategy's own keyword options (the
    Trainer sets ``cluster_environment`` and the positional ones)."""
    hints = typing.get_type_hints(RoundPipeStrategy.__init__)
    params = inspect.signature(RoundPipeStrategy.__init__).parameters.values()
    own = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    return {name: hints[name] for name in own if name != "cluster_environment"}


class RoundPipeStrategy(ParallelStrategy):
    """Train with RoundPipe: host-resident state, devices as a stateless pool.

    Args:
        accelerator: set by the Trainer (``accelerator=``).
        parallel_devices: set by the Trainer (``devices=``).
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer (``precision=``).
        async_optimizer: run optimizer steps on a host thread one step behind
            (staleness 1), overlapping them with device compute. ``False`` gives
            ordinary training semantics.
        num_microbatches: micro-batches per batch. ``"auto"``: the fewest
            (largest micro-batches) among ``N, 2N, 4N, ... 8N`` for ``N``
            workers whose simulated bubble is at most 5% (with the asynchronous
            optimizer usually ``N``), else the fewest within a tenth of the
            smallest bubble; doubled if the first batch runs out of
            device memory (``oom_replans``). A batch with fewer samples (the
            last of an epoch, an uneven validation set, ``batch_size=1``) is
            split into one-sample micro-batches, whatever the setting; fewer
            micro-batches than workers simply leave some workers idle.
        microbatches_per_round: micro-batches per round; ``None``/``"auto"``
            (default): the whole batch, so each stage's weights go up once per
            batch, unless a round's stage-boundary activations would exceed
            ``activation_memory`` (then the largest round that fits), or a
            round of a multiple of the device count gives a simulated step
            at least 1% shorter while hiding the weight uploads.
        activation_memory: host bytes one round's stage-boundary activations
            may take (default: a quarter of the host memory available at
            setup, less what the training state will take: master copies,
            gradient buffers and an Adam-like optimizer's moments). Hugging
            Face models estimate them from the batch before the first step;
            other models measure them in the first step. For Hugging Face
            models it also bounds one micro-batch's boundary values (default
            there: 80% of that host memory): at
            sequences whose one-layer stages would keep more, the plan gets
            fewer, larger backward stages that recompute one layer at a time
            (a layered plan, ``"...|layered"``, or, where even their layer
            inputs would not fit the device, a rewalked one, ``"...|rewalk"``).
        plan: a stage plan in compact form (``"7,7|1|3,3,3,3,2"`` for 15 layers, with
            ``"|layered"`` appended: backward stages that recompute one layer
            at a time; ``"|rewalk"``: and compute each layer's input again
            from the stage input instead of keeping it), or
            ``"auto"`` for the plan with the shortest simulated step among the
            partitioner's best.
        trace_dir: record the real start and end of every stage on every
            device and, when training ends, write ``timeline-measured.png``
            next to ``timeline-simulated.png`` (the same iterations as the
            planner predicted them) and ``trace.json`` (Chrome/Perfetto) there.
            Every task also runs inside ``torch.profiler.record_function``
            ranges named by its plan string (``RP 3:0.F2@1:0-3``) whenever a
            torch profiler records.
        layers: attribute path of the layer stack (``"model"``, ``"net"``) when
            automatic detection needs help.
        device_memory_limit: bytes one stage may use on a GPU (default: half
            the free memory at start, the rest holding the next stage's
            prefetched weights; more when long sequences need it and the
            weights fit a smaller share).
        tile_memory: bytes one sequence tile may take on a device: Hugging
            Face causal LMs then compute the loss over chunks of tokens (the
            full-vocabulary logits never exist) and each decoder block's MLP
            and norms over sequence tiles, whenever a micro-batch would need
            more.
            ``"auto"`` (default): an eighth of a stage's device memory (128 MiB
            on CPU workers); ``None``: never tile. The result is the same either
            way.
        double_buffer: with the asynchronous optimizer, keep the trainable
            weights' master copy (compute dtype, host memory) twice, so that a
            step's weight copies overlap the next window instead of waiting
            for it to finish: 2 more host bytes per trainable parameter in
            bf16 (nothing for frozen weights such as a LoRA base). ``None``
            (default): on with the asynchronous optimizer where the host memory
            holds it next to the rest of the training state (else off, with a
            warning); ``False`` saves the memory; ``True`` keeps it regardless;
            with ``async_optimizer=False`` it is refused.
        optimizer_threads: intra-op threads (``torch.set_num_threads``) the
            optimizer thread sets while the engine runs; torch shares the count
            between all threads but the main one (CPU device workers too);
            restored when the engine closes. Synchronous: the loop's thread
            has it during each step.
        fuse_optimizer: switch Adam/AdamW to torch's fused CPU kernel (same
            update, several times faster on the host).
        seed: base seed for dropout masks; default: torch's initial seed (set
            by ``seed_everything``).
        watchdog_timeout: seconds a hand-off may take before the run fails with
            what never arrived (``float("inf")``: never).
        log_every_n_steps: how often the strategy logs its own metrics to the
            Trainer's logger (``roundpipe/step_time``, ``roundpipe/wait_fraction``:
            the share of the step the training loop spent waiting on the
            pipeline, ``roundpipe/simulated_bubble``, ``roundpipe/slots``,
            ``roundpipe/transfer_gb_per_s``: host-device bytes per second);
            default: the Trainer's ``log_every_n_steps``; 0 turns it off.
        workers_per_device: pipeline workers per device (several workers may
            share one GPU, e.g. to test a many-GPU plan on one card).
        nonfinite: a NaN/inf loss or gradient (fp32/bf16) ``"raise"``-s before
            the weights change, ``"skip"``-s the step, or is ``"ignore"``-d
            (stepped with, as plain training would); fp16 always skips.
        profile_iterations: training iterations whose per-layer times are
            measured (after one warm-up iteration); 0 turns profiling off.
        replan_margin: switch to the measured plan when its objective is better
            by more than this fraction (never when ``plan`` is given).
        oom_replans: when a device runs out of memory during the fit's first
            training batch, re-plan up to this many times instead of failing:
            where the failed stage's activations were predicted (a supported
            causal LM), they count larger than predicted from then on (at
            least by the room the stage had), so the plan for activations
            cuts, layers or rewalks the stages or stops prefetching; else
            stages at most half the size of the one that failed (a cap on
            weights and gradients per stage, never below the largest layer, kept
            when re-partitioning from measurements), or, when that stage cannot
            be cut and ``num_microbatches="auto"``, twice the micro-batches. The
            batch's ``training_step`` then runs again, so the result is the same
            as a run that fitted at once. Never changes a given ``plan`` or
            integer ``num_microbatches``. ``0`` fails at once.
        reduce_bucket_bytes: with several servers (``Trainer(num_nodes=N)``,
            one process per server): gradient bytes per all-reduce between the
            servers (whole layers; default 25 MiB). Smaller buckets start
            earlier in the backward, larger ones pay less per-message cost.
        cluster_environment: set by the Trainer (where ranks and the
            rendezvous address come from: torchrun, SLURM, ...).

    Several servers: ``Trainer(strategy="roundpipe", devices=<GPUs of one
    server>, num_nodes=N)``, one process per server (``torchrun --nnodes=N
    --nproc-per-node=1``, or one SLURM task per server). Each server runs one
    replica; ranks, ``world_size`` and the data shards count servers, and each
    window's gradients are averaged over the servers in host memory (gloo),
    overlapped with the backward (:mod:`lightning_roundpipe.runtime.replicas`).
    """

    strategy_name = "roundpipe"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        *,
        async_optimizer: bool = True,
        num_microbatches: int | Literal["auto"] = "auto",
        microbatches_per_round: int | Literal["auto"] | None = None,
        activation_memory: int | None = None,
        plan: str | Literal["auto"] = "auto",
        trace_dir: str | os.PathLike | None = None,
        layers: str | None = None,
        device_memory_limit: int | None = None,
        tile_memory: int | Literal["auto"] | None = "auto",
        double_buffer: bool | None = None,
        optimizer_threads: int | None = None,
        fuse_optimizer: bool = True,
        seed: int | None = None,
        watchdog_timeout: float = 600.0,
        log_every_n_steps: int | None = None,
        workers_per_device: int = 1,
        nonfinite: NonFinite = "raise",
        profile_iterations: int = 2,
        replan_margin: float = 0.05,
        oom_replans: int = 3,
        reduce_bucket_bytes: int = 25 * 2**20,
        cluster_environment: ClusterEnvironment | None = None,
    ) -> None:
        given = dict(locals())
        check_types({k: given[k] for k in _option_hints()}, _option_hints())
        # (NumPy integers, which the type check accepts, as plain ints)
        num_microbatches, oom_replans, reduce_bucket_bytes = map(
            plain_int, (num_microbatches, oom_replans, reduce_bucket_bytes)
        )
        workers_per_device, seed, log_every_n_steps = map(
            plain_int, (workers_per_device, seed, log_every_n_steps)
        )
        if plan != "auto":  # (its layer counts are checked at setup, against the model)
            try:
                StagePlan.parse(plan)
            except PlanError as exc:
                raise ValueError(f"plan={plan!r} cannot be read: {exc}") from None
        if log_every_n_steps is not None and log_every_n_steps < 0:
            raise ValueError(
                f"log_every_n_steps must be >= 0 (0 turns the strategy's own metrics off) or "
                f"None (the Trainer's), got {log_every_n_steps!r}"
            )
        if num_microbatches != "auto" and (
            isinstance(num_microbatches, bool)
            or not isinstance(num_microbatches, int)
            or num_microbatches < 1
        ):
            raise ValueError(
                f"num_microbatches must be a positive integer or 'auto', got {num_microbatches!r}"
            )
        if workers_per_device < 1:
            raise ValueError(f"workers_per_device must be >= 1, got {workers_per_device}")
        if seed is not None and not -(2**63) <= seed < 2**64:
            # (torch.manual_seed's range: past it the seeds wrapped around, 2**64 ran as 0)
            raise ValueError(f"seed must be in [-2**63, 2**64) or None, got {seed!r}")
        if isinstance(oom_replans, bool) or not isinstance(oom_replans, int) or oom_replans < 0:
            raise ValueError(f"oom_replans must be an integer >= 0, got {oom_replans!r}")
        if (
            isinstance(reduce_bucket_bytes, bool)
            or not isinstance(reduce_bucket_bytes, int)
            or reduce_bucket_bytes < 1
        ):
            raise ValueError(
                "reduce_bucket_bytes must be a positive number of bytes, got "
                f"{reduce_bucket_bytes!r}"
            )
        # the engine's options, validated here once; setup adds precision, seed,
        # tracing and what an out-of-memory failure teaches
        self.options = EngineOptions(
            async_optimizer=async_optimizer,
            microbatches_per_round=microbatches_per_round,
            activation_memory=activation_memory,
            fit_to_batch=True,  # a short batch: one sample per micro-batch
            watchdog_timeout=watchdog_timeout,
            device_memory_limit=device_memory_limit,
            tile_memory=tile_memory,
            double_buffer=double_buffer,
            optimizer_threads=optimizer_threads,
            profile_iterations=profile_iterations,
            replan_margin=replan_margin,
            nonfinite=nonfinite,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.async_optimizer = async_optimizer
        self.num_microbatches = num_microbatches
        self.trace_dir = trace_dir
        self.plan = plan
        self.layers = layers
        self.fuse_optimizer = fuse_optimizer
        self.seed = seed
        self.log_every_n_steps = log_every_n_steps
        self.workers_per_device = workers_per_device
        self.nonfinite = nonfinite
        self.oom_replans = oom_replans
        self.reduce_bucket_bytes = reduce_bucket_bytes
        self._num_nodes = 1
        self._replicas: Replicas | None = None
        self.engine: RoundPipeEngine | None = None
        self._bubble: float | None = None
        self._last_step: tuple[float, float, int] | None = None  # time, waited, bytes
        self._stage_plan: StagePlan | None = None
        self._reported_plan: StagePlan | None = None  # (the last plan the log named)
        self.pipeline_layers: list[torch.nn.Module] = []
        self.microbatches: int | None = None
        self._final_stale: dict[str, Tensor] | None = None
        self._fitting = False  # the engine is a fit's (not an evaluation's)
        # the optimizer switched to the fused kernel, with its own fused/foreach
        # settings (defaults, each group's): checkpoints keep those
        self._unfused: tuple[Optimizer, tuple[Any, list[Any]]] | None = None
        self._chaos: Callable[[str], None] | None = None
        self._stale: dict[str, Tensor] | None = None
        self._adapter = None
        self._stack_called = False  # the fit's first training step is checked
        self._restore: list[Callable[[], None]] = []
        # callbacks of the strategy's own for the fit (see _add_fit_callback)
        self._fit_callbacks: list[tuple[Any, list[Callback], Callback]] = []
        # each pipeline parameter's version counter and storage when the engine
        # last wrote or copied it, with the engine's step count then
        self._noted: tuple[int, list[tuple[int, int]]] | None = None
        self._averaging = False  # a weight-averaging callback swaps weights through .data
        self._evaluating = False  # an evaluation's first step has yet to run
        self._evaluated = False  # training resumes after an evaluation
        # wait_for_updates held the newest weights for the hooks until the next step
        self._held_for_hooks = False
        # from a training step's start to the end of its backward: the model
        # calls there are the batch's own, never a hook's
        self._in_batch = False
        # out-of-memory re-planning during the fit's first training batch
        self._retry = FirstBatchRetry(
            self,
            oom_replans,
            close=self._close,
            build=self._rebuild,
            microbatches=self._microbatch_count,
        )

    # ----------------------------------------------------------- registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "roundpipe",
            cls,
            description="RoundPipe with the asynchronous optimizer",
            async_optimizer=True,
        )
        strategy_registry.register(
            "roundpipe_sync",
            cls,
            description="RoundPipe with a synchronous optimizer (ordinary training semantics)",
            async_optimizer=False,
        )

    # -------------------------------------------------------- precision
    @property
    @override
    def precision_plugin(self) -> RoundPipePrecision:
        if self._precision_plugin is None:
            self._precision_plugin = RoundPipePrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # None stays None so that Trainer(precision=...) still chooses; any plugin
        # Lightning picks is turned into ours (or refused with the choices)
        self._precision_plugin = None if plugin is None else RoundPipePrecision.from_plugin(plugin)

    # ------------------------------------------------ one process per server
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[0]

    @property
    def num_nodes(self) -> int:
        """Servers (``Trainer(num_nodes=...)``), one replica and one process each."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def is_distributed(self) -> bool:
        """Several servers: Lightning then shards the data by server."""
        return self._num_nodes > 1

    @property
    @override
    def world_size(self) -> int:
        return self._num_nodes

    @property
    @override
    def global_rank(self) -> int:
        if self._num_nodes == 1 or self.cluster_environment is None:
            return 0
        return self.cluster_environment.global_rank()

    @property
    @override
    def local_rank(self) -> int:
        return 0  # one process per server drives all of its devices

    @property
    @override
    def node_rank(self) -> int:
        return self.global_rank

    @property
    @override
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """Ranks count servers (Lightning calls this while it sets up)."""
        env = self.cluster_environment
        if env is not None and self._num_nodes > 1:
            env.set_world_size(self._num_nodes)
            env.set_global_rank(env.node_rank())
        rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        if self._num_nodes > 1:
            self._join_servers()
            return
        env = self.cluster_environment
        launched = env.world_size() if env is not None else 1
        if launched > 1:  # (each process would train alone on all the data)
            raise ValueError(
                f"{launched} processes were launched ({type(env).__name__}) but "
                "Trainer(num_nodes=1): RoundPipe runs one process per server that drives all of "
                "its GPUs (devices=...). Launch one process (python train.py, or torchrun "
                "--nproc-per-node=1), or, across servers, set num_nodes to the number of servers "
                "with one process each"
            )

    def _join_servers(self) -> None:
        """The process group of the servers (gloo: the tensors it carries live
        on the host) and, on its own group, the replicas' gradient reduction."""
        env = self.cluster_environment
        assert env is not None
        launched = env.world_size()
        if launched != self._num_nodes:
            raise ValueError(
                f"Trainer(num_nodes={self._num_nodes}) but {launched} processes were launched "
                f"({type(env).__name__}); RoundPipe runs one process per server that drives all "
                "of its GPUs: launch with torchrun --nproc-per-node=1 (or one SLURM task per "
                "server, --ntasks-per-node=1), or set num_nodes to the number of servers"
            )
        if isinstance(env, LightningEnvironment) and "MASTER_PORT" not in os.environ:
            raise ValueError(
                f"Trainer(num_nodes={self._num_nodes}) needs the servers' rendezvous: launch "
                "one process per server with torchrun --nnodes=N --nproc-per-node=1, under "
                "SLURM with one task per server, or set MASTER_ADDR, MASTER_PORT and NODE_RANK "
                "on every server"
            )
        # (float("inf"), no watchdog: the longest wait timedelta and gloo take)
        timeout = datetime.timedelta(seconds=min(self.options.watchdog_timeout, 1e9))
        _init_dist_connection(env, "gloo", timeout=timeout)
        rank_zero_only.rank = self.global_rank
        # the reducer times each all-reduce against watchdog_timeout itself (it
        # looks twice per heartbeat) and names what it waited for; gloo's own
        # limit on the group is a backstop a few heartbeats later, so that it
        # never races that message (a process leaves only once gloo gives up)
        group = dist.new_group(backend="gloo", timeout=timeout + datetime.timedelta(seconds=5))
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # private in torch: without it errors say less, nothing breaks
            store = None
        self._replicas = Replicas(
            group,
            self.global_rank,
            self.world_size,
            store=store,
            bucket_bytes=self.reduce_bucket_bytes,
            prefix=_join_prefix(),
        )
        log.info(
            "RoundPipe: replica %d of %d (one per server), gradients averaged over gloo",
            self.global_rank,
            self.world_size,
        )

    def _distributed(self) -> bool:
        return self._num_nodes > 1 and dist.is_available() and dist.is_initialized()

    @contextmanager
    def _with_servers(self, what: str) -> Generator[None, None, None]:
        """A collective of the training loop's thread: when another server
        failed or stopped, say which (a bare gloo error names an address)."""
        try:
            yield
        except RuntimeError as exc:
            if self._replicas is None:
                raise
            raise self._replicas.error(what, exc) from exc

    def _alone(self) -> bool:
        """Whether this server's fit was interrupted (an error, here or on
        another server): collectives of its loop (a checkpoint's barrier, a
        path broadcast) would wait for servers that may never come, each
        stuck in another collective of its own; its failure is in the
        rendezvous store, whence the others' errors name it."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED

    @override
    def barrier(self, name: str | None = None) -> None:
        if self._distributed() and not self._alone():
            with self._with_servers(f"a barrier ({name})" if name else "a barrier"):
                dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._distributed() or self._alone():
            return obj
        box = [obj]
        with self._with_servers("a broadcast"):
            dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor) and self._distributed():
            with self._with_servers("reducing a logged value (sync_dist=True)"):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        if self._distributed():
            with self._with_servers("all_gather"):
                return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)
        return tensor  # one process: no added dimension, as Lightning's strategies

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not self._distributed():
            return decision
        return super().reduce_boolean_decision(decision, all=all)

    @override
    def model_to_device(self) -> None:
        pass  # the module stays on the host

    @override
    def batch_to_device(
        self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0
    ) -> Any:
        # the engine uploads each micro-batch to the device that runs it: the
        # batch stays on the host, where the module's and the datamodule's
        # transfer_batch_to_device / on_before_ / on_after_batch_transfer
        # hooks still run (with the host as the device)
        module = self.lightning_module
        if module is None:
            return batch
        host = torch.device("cpu")
        return module._apply_batch_transfer_handler(
            batch, device=host, dataloader_idx=dataloader_idx
        )

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        with torch.device("cpu"), self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------- setup
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        if self._layer_sync is not None:
            raise ValueError(
                "Trainer(sync_batchnorm=True) is not supported by RoundPipe: batch norm layers "
                "normalise each micro-batch on its own, not the batch across devices; set "
                "sync_batchnorm=False, and num_microbatches=1 for whole-batch statistics"
            )
        if self.trace_dir is not None:  # found out now, not after the whole fit
            try:
                os.makedirs(self.trace_dir, exist_ok=True)
            except OSError as exc:
                raise ValueError(
                    f"trace_dir={str(self.trace_dir)!r} cannot be created ({exc}); give a "
                    "writable folder for the trace, or trace_dir=None"
                ) from exc
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self._stack_called = False
            self.setup_optimizers(trainer)
            self._check_optimizers()
        self.setup_precision_plugin()
        self._retry.reset()
        # (a checkpoint's counters come after setup); a Trainer that fits again
        # goes on from its last fit's counters (dropout masks, fp16 loss scale),
        # as it goes on from its steps
        plugin = self.precision_plugin
        again = trainer.state.fn == TrainerFn.FITTING and trainer.global_step > 0
        plugin.carried = dict(plugin.final) if again and plugin.final else None
        plugin.in_batch = self._in_training_batch
        plugin.device_type = self.root_device.type
        if self._replicas is not None and trainer.state.fn == TrainerFn.FITTING:
            self._check_same_settings(trainer)
        self._build_engine(trainer)

    def _in_training_batch(self) -> bool:
        """Whether a training batch's step has started and is not done (the
        Trainer's batch progress; a checkpoint saved meanwhile is resumed by
        running the batch again)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return False
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        return progress.started == progress.ready > progress.processed

    def _check_same_settings(self, trainer: Any) -> None:
        """Servers whose models or settings differ would reduce mismatched
        gradient buckets (gloo aborts the process, or worse, the sizes agree
        and other layers' gradients are averaged): compared with rank 0's
        before anything is reduced, naming what differs."""
        module = self.lightning_module
        mine = {
            "trainable parameters (name, shape)": [
                (n, tuple(p.shape)) for n, p in module.named_parameters() if p.requires_grad
            ],
            "reduce_bucket_bytes": self.reduce_bucket_bytes,
            "async_optimizer": self.async_optimizer,
            "precision": self.precision_plugin.precision,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
        }
        if any(getattr(m, "track_running_stats", False) for m in module.modules()):
            rank_zero_warn(
                "RoundPipe: running statistics (batch norm) are not synchronised between "
                "servers: each keeps those of its own data, which its validation uses; rank "
                "0's are the ones its checkpoints hold"
            )
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        first = everyone[0]
        for rank, theirs in enumerate(everyone):
            for key, value in first.items():
                if theirs[key] != value:
                    raise ValueError(
                        f"the servers were started with different models or settings: {key} "
                        f"differs between rank 0 and rank {rank} ("
                        f"{_difference(value, theirs[key])}); start every server "
                        "with the same model, the same trainable parameters and the same "
                        "strategy and Trainer settings"
                    )
        # every replica starts from rank 0's weights and buffers, as DDP's do (a
        # head initialised without a seed, LoRA's random A: each server would
        # apply the same averaged updates to different weights; a resumed
        # fit's checkpoint, loaded before this, is the same file everywhere)
        with self._with_servers("sending rank 0's weights to the servers"):
            # (every parameter and buffer, frozen ones too: a mismatch is named)
            _verify_param_shape_across_processes(
                self._replicas.group, [*module.parameters(), *module.buffers()]
            )
            _sync_module_states(
                module,
                self._replicas.group,
                broadcast_bucket_size=self.reduce_bucket_bytes,
                src=0,
                params_and_buffers_to_ignore=(),
            )

    def _check_optimizers(self) -> None:
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ValueError(
                "RoundPipeStrategy supports automatic optimization only, with one optimizer; "
                "set self.automatic_optimization = True (manual optimization cannot be "
                "pipelined). Modules that need several optimizers (GANs, alternating updates), "
                "which Lightning trains with manual optimization only, cannot use RoundPipe"
            )
        if len(self.optimizers) != 1:
            raise ValueError(
                f"RoundPipeStrategy supports exactly one optimizer, configure_optimizers returned "
                f"{len(self.optimizers)}; put the parameters in one optimizer (with a param "
                "group each where their settings differ)"
            )
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError(
                "no parameter of the LightningModule requires a gradient, so there is nothing "
                "to train; unfreeze what should train (requires_grad_(True)), e.g. LoRA "
                "adapters or the layers to fine-tune"
            )
        opt = self.optimizers[0]
        closure = inspect.signature(opt.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise ValueError(
                f"{type(opt).__name__}.step needs a closure: it evaluates the loss several "
                "times per step (as LBFGS does), while RoundPipe runs each batch's forward and "
                "backward through the pipeline once and steps afterwards. Return an optimizer "
                "from configure_optimizers whose step takes no closure (AdamW, SGD, ...)"
            )
        if isinstance(opt, torch.optim.SparseAdam):
            raise ValueError(
                "torch.optim.SparseAdam needs sparse gradients, and RoundPipe accumulates every "
                "gradient densely in host memory (an nn.Embedding(sparse=True) gets a dense "
                "one); use an optimizer for dense gradients (Adam, AdamW, SGD, Adagrad)"
            )
        owned = {id(p) for p in module.parameters()}
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in owned:
                    raise ValueError(
                        "the optimizer holds a parameter that is not a parameter of the "
                        "LightningModule; build the optimizer from self.parameters()"
                    )

    def _build_engine(self, trainer: Any) -> None:
        devices = list(self.parallel_devices or [torch.device("cpu")])
        cuda = [d for d in devices if d.type == "cuda"]
        if len(set(cuda)) != len(cuda):
            raise ValueError(
                f"devices lists a GPU more than once ({', '.join(map(str, devices))}); to run "
                "several pipeline workers on one GPU pass workers_per_device=k"
            )
        devices = [d for d in devices for _ in range(self.workers_per_device)]
        n = len(devices)
        _refuse_lazy_parameters(self.lightning_module)
        adapter = find_adapter(self.lightning_module, self.layers)
        _refuse_renormed_embeddings(adapter.layers(), self.lightning_module)
        _refuse_prefix_tuning(self.lightning_module)
        if trainer.state.fn == TrainerFn.FITTING:
            _refuse_gradient_hooks(self.lightning_module, adapter.layers())
        trained = None  # a stack the optimizer trains, left out of the pipeline
        if self.layers is None and trainer is not None and self.optimizers:
            optimized = {id(p) for g in self.optimizers[0].param_groups for p in g["params"]}
            trained = trained_outside(self.lightning_module, adapter, optimized)
        if self.async_optimizer and trainer is not None and self.optimizers:
            self._check_outside_parameters(adapter, trained)
        elif trained is not None:
            rank_zero_warn(
                f"RoundPipe pipelines '{adapter.name}', the largest layer stack, but the "
                f"optimizer updates none of its parameters (it runs forward only); it updates "
                f"those of '{trained}', which trains on the host, outside the pipeline. To "
                f"pipeline the stack being trained pass layers={trained!r} to "
                f"RoundPipeStrategy; to keep this choice, and silence this warning, pass "
                f"layers={adapter.name!r}"
            )
        self._restore.extend(_compiled(adapter.layers(), self.lightning_module))
        _warn_low_precision(adapter.layers(), self.precision_plugin.precision)
        costs = estimate_costs(adapter.layers(), PRECISIONS[self.precision_plugin.precision])
        seed = self.seed if self.seed is not None else torch.initial_seed()
        try:
            limit = tightest(self._retry.size_limit, self.options.device_memory_limit)
            m = self._microbatch_count(costs, n, limit)
            options = replace(
                self.options,
                precision=self.precision_plugin.precision,
                seed=seed,
                trace=self.trace_dir is not None,
                # learned from an out-of-memory error, in size-estimate units
                size_limit=self._retry.size_limit,
                activation_scale=self._retry.activation_scale,
            )
            self.engine = RoundPipeEngine.from_options(
                adapter.layers(),
                devices,
                m,
                options,
                plan=None if self.plan == "auto" else self.plan,
                activation_estimate=adapter.boundary_estimate(options.compute_dtype),
                # a rebuilt engine (re-plan, unfreezing): the optimizer's state
                # is already in host memory, the default budgets count it once
                optimizer_state=0 if any(opt.state for opt in self.optimizers) else None,
                parameter_names={p: n for n, p in self.lightning_module.named_parameters()},
                spread_values=adapter.spread_values,
                owners=_owners(self.lightning_module, adapter.layers()),
                replicas=self._replicas,
                chaos=self._chaos,  # tests: delays or faults at the hand-offs
            )
        except PlanError as exc:
            # plans count the embedding and the head as layers: say which is which
            raise PlanError(f"{exc}. Pipeline layers: {adapter.describe_layers()}") from exc
        self._adapter = adapter
        self.precision_plugin.engine = self.engine
        if self._replicas is not None and trainer.state.fn == TrainerFn.FITTING:
            self.precision_plugin.after_backward = self._outside_reducer(adapter)
        self._stage_plan = self._reported_plan = self.engine.plan
        self._last_step = None  # (a new engine's counters start at 0)
        self._fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        self.pipeline_layers = adapter.layers()
        self.microbatches = m
        adapter.attach(self.engine, self.lightning_module)
        self._restore.append(adapter.detach)
        sim = simulate(
            "roundpipe",
            costs,
            n,
            m,
            plan=self.engine.plan,
            microbatches_per_round=self.engine.planned_round_size(),
            async_optimizer=self.async_optimizer,
        )
        self._bubble = sim.async_bubble_ratio if self.async_optimizer else sim.bubble_ratio
        rank_zero_info(
            f"RoundPipe: {adapter.kind} '{adapter.name}', {len(adapter.layers())} pipeline "
            f"layers ({adapter.describe_layers()}), plan {self.engine.plan} on {n} device(s) "
            f"({', '.join(map(str, devices))}), {m} micro-batches, "
            f"{'asynchronous' if self.async_optimizer else 'synchronous'} optimizer; "
            f"simulated bubble {self._bubble:.1%} (size-based estimates)"
        )
        self._averaging = any(isinstance(cb, _AVERAGING) for cb in trainer.callbacks)
        self._note_weights()
        if trainer.state.fn == TrainerFn.FITTING:
            self._warn_microbatch_split(adapter, m)
            self._route_optimizer_calls(trainer)
            if not self._fit_callbacks:  # (once a fit, whatever engines it builds)
                if self._replicas is not None:
                    self._add_fit_callback(trainer, _ReportFailure(self._replicas))
                if self.async_optimizer:
                    self._settle_for_callbacks(trainer)
            self._resume_stale()
            # a rebuild within the fit, or of a resumed one: go on counting
            if self.precision_plugin.carried is not None:
                self.engine.continue_from(self.precision_plugin.carried)
            self._retry.arm()

    def _warn_microbatch_split(self, adapter: Any, m: int) -> None:
        """Layers that several micro-batches would train differently: one
        normalising over the samples of its input (batch norm) sees one
        micro-batch at a time, so the result differs from whole-batch training
        and follows the count; a module taking its input sequence-first would
        see its sequences cut when the batch is split along dimension 0."""
        if m == 1:
            return
        found = [
            f"{type(mod).__name__} (layer {i}{'.' + name if name else ''})"
            for i, layer in enumerate(adapter.layers())
            for name, mod in layer.named_modules()
            if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm)
        ]
        if found:
            shown = ", ".join(found[:3]) + (" ..." if len(found) > 3 else "")
            how = "num_microbatches='auto'" if self.num_microbatches == "auto" else "as given"
            rank_zero_warn(
                f"{shown} normalise over the samples of each micro-batch: with {m} micro-batches "
                f"per batch ({how}) their statistics, and so the training, differ from "
                "whole-batch training and change with the count; set num_microbatches=1 for "
                "whole-batch statistics, or a fixed integer so that runs on different numbers "
                "of devices agree"
            )
        # torch's sequence-first modules (an outer one speaks for those inside it)
        seq_first: list[str] = []
        for i, layer in enumerate(adapter.layers()):
            inner: set[int] = set()
            for name, mod in layer.named_modules():
                if id(mod) not in inner and _sequence_first(mod):
                    inner.update(id(sub) for sub in mod.modules())
                    where = f"{i}.{name}" if name else f"{i}"
                    seq_first.append(f"{type(mod).__name__} (layer {where})")
        if seq_first:
            shown = ", ".join(seq_first[:3]) + (" ..." if len(seq_first) > 3 else "")
            rank_zero_warn(
                f"{shown} take(s) batch_first=False, but RoundPipe splits every batch into "
                f"{m} micro-batches along dimension 0 (each tensor whose first dimension is the "
                "batch size): if sequences reach these modules sequence-first, the split cuts "
                "the sequences instead of the batch. Build them with batch_first=True, or set "
                "num_microbatches=1"
            )

    def _check_outside_parameters(self, adapter: Any, trained: str | None = None) -> None:
        """With the asynchronous optimizer the training loop must never read a
        parameter the optimizer thread may be writing: every optimized
        parameter has to live in the pipeline (whose devices read master copies).
        ``trained``: the layer stack outside the pipeline that the optimizer
        trains, when it updates nothing in the pipelined one."""
        inside = {id(p) for layer in adapter.layers() for p in layer.parameters()}
        optimized = {id(p) for g in self.optimizers[0].param_groups for p in g["params"]}
        outside = [
            n
            for n, p in self.lightning_module.named_parameters()
            if id(p) in optimized and id(p) not in inside
        ]
        if outside:
            shown = ", ".join(outside[:5]) + (" ..." if len(outside) > 5 else "")
            if trained is not None:
                raise ValueError(
                    f"the optimizer updates parameters outside the pipeline ({shown}): "
                    f"RoundPipe pipelines '{adapter.name}', the largest layer stack, whose "
                    f"parameters the optimizer does not update, while it trains '{trained}'. "
                    f"Pass layers={trained!r} to RoundPipeStrategy to pipeline the stack being "
                    "trained (or use strategy='roundpipe_sync' to train it on the host)"
                )
            raise ValueError(
                f"the optimizer updates parameters outside the pipeline ({shown}); with the "
                "asynchronous optimizer the training loop would read them while they change. "
                "Use strategy='roundpipe_sync' (async_optimizer=False), or move them into the "
                "layer stack"
            )

    def _outside_reducer(self, adapter: Any) -> Callable[[], None]:
        """Several servers, synchronous optimizer: the gradients of optimized
        parameters outside the pipeline (which autograd on this thread
        computes) averaged over the servers, on the training loop's process
        group, before Lightning's pre-step hooks and clipping see them."""
        inside = {id(p) for layer in adapter.layers() for p in layer.parameters()}
        optimizer = self.optimizers[0]

        def average() -> None:
            # read per step: BaseFinetuning adds groups and unfreezes parameters
            outside = [
                p
                for g in optimizer.param_groups
                for p in g["params"]
                if id(p) not in inside and p.requires_grad
            ]
            if not outside:
                return
            grads = [p.grad for p in outside]
            flat = torch.cat(
                [
                    (g if g is not None else torch.zeros_like(p)).detach().reshape(-1).float()
                    for p, g in zip(outside, grads, strict=True)
                ]
                + [torch.tensor([float(g is not None) for g in grads])]
            )
            with self._with_servers("averaging the gradients of parameters outside the pipeline"):
                dist.all_reduce(flat)
            flat[: -len(outside)] /= self.world_size
            offset = 0
            for k, p in enumerate(outside):
                n = p.numel()
                if flat[-len(outside) + k] > 0:  # some server's backward reached it
                    p.grad = flat[offset : offset + n].view_as(p).to(p.dtype).clone()
                offset += n

        return average

    def _route_optimizer_calls(self, trainer: Any) -> None:
        """``zero_grad`` runs in order with the (asynchronous) optimizer
        steps, never racing them."""
        engine = self.engine
        opt = self.optimizers[0]
        if self.fuse_optimizer and self._fuse(opt):
            log.info("RoundPipe: optimizer switched to torch's fused CPU kernel")
        original_zero = opt.zero_grad
        cleared = [False]  # (a zero_grad ran: see optimizer_zero_grad below)

        def drop_window() -> None:
            # between the batches of an accumulation window the window's gradients
            # are in the engine's buffers, not in .grad: drop them there, as
            # zero_grad drops the earlier batches' in plain training (not while a
            # batch's backward is to come: Lightning zeroes between a window's
            # first training_step and its backward, which .grad does not see yet)
            cleared[0] = True
            if engine.has_pending_gradients and not engine.awaiting_backward:
                engine.zero_grad()

        def zero_grad(set_to_none: bool = True) -> None:
            drop_window()
            engine.call(lambda: original_zero(set_to_none=set_to_none))

        opt.zero_grad = zero_grad
        self._restore.append(lambda: opt.__dict__.pop("zero_grad", None))
        # Lightning calls zero_grad on its LightningOptimizer wrapper (a copy of the
        # optimizer's attributes made before this patch), through the module's
        # optimizer_zero_grad hook: route both, or the training loop would drop
        # gradients the optimizer thread is still stepping with
        for lopt in self._lightning_optimizers:
            lopt.zero_grad = zero_grad
            self._restore.append(lambda lo=lopt: lo.__dict__.pop("zero_grad", None))
        module = self.lightning_module
        own = type(module).optimizer_zero_grad
        overridden = own is not LightningModule.optimizer_zero_grad

        def optimizer_zero_grad(epoch: int, batch_idx: int, optimizer: Any) -> None:
            if not overridden:
                zero_grad(set_to_none=True)
                return
            cleared[0] = False
            own(module, epoch, batch_idx, optimizer)  # (its zero_grad calls are routed)
            if not cleared[0]:
                raise MisconfigurationException(
                    f"{type(module).__name__}.optimizer_zero_grad did not clear the gradients "
                    f"(batch {batch_idx}): RoundPipe releases them after every optimizer step, "
                    "so they cannot be carried into the next one; step less often with "
                    "Trainer(accumulate_grad_batches=...) instead"
                )

        module.optimizer_zero_grad = optimizer_zero_grad
        self._restore.append(lambda: module.__dict__.pop("optimizer_zero_grad", None))
        # the module's own zero_grad (Lightning calls it when validation starts
        # during fit) must not drop gradients a queued step is about to use
        original_module_zero = module.zero_grad

        def module_zero_grad(set_to_none: bool = True) -> None:
            drop_window()
            engine.call(lambda: original_module_zero(set_to_none=set_to_none))

        module.zero_grad = module_zero_grad
        self._restore.append(lambda: module.__dict__.pop("zero_grad", None))
        # (scheduler steps run on this thread: an asynchronous update steps with
        # the optimizer thread's own param_groups, see ThreadGroups)
        if self.async_optimizer:
            _warn_gradient_hooks(trainer, module)
        _warn_after_backward(trainer, module)

    def _fuse(self, opt: Optimizer) -> bool:
        """``use_fused``, remembering the optimizer's own settings the first
        time (a checkpoint saves those, so that a run under another strategy
        resumes with what the user configured)."""
        if self._unfused is not None and self._unfused[0] is opt:
            original = self._unfused[1]
        else:

            def settings(group: dict[str, Any]) -> Any:
                return group.get("fused"), group.get("foreach")

            original = (settings(opt.defaults), [settings(g) for g in opt.param_groups])
        if not use_fused(opt):
            return False
        self._unfused = (opt, original)

        def put_back() -> None:  # (after the fit, the optimizer is as the user made it)
            default, groups = original
            opt.defaults["fused"], opt.defaults["foreach"] = default
            for group, flags in zip(opt.param_groups, groups, strict=False):
                group["fused"], group["foreach"] = flags

        self._restore.append(put_back)
        return True

    def _settle_for_callbacks(self, trainer: Any) -> None:
        """Under the asynchronous optimizer, the queued update is applied
        before any callback's ``on_train_epoch_end`` and ``on_train_end`` (and
        ``on_train_batch_end`` where a weight-averaging callback reads the
        weights after every batch): such hooks would otherwise read weights the
        optimizer thread is writing, and ``on_train_end``'s final weights (an
        average copied in) would get the last update on top. The callback
        stays for the fit, whatever engines it builds (the Tuner reads the
        first callback of the list it swaps in while it searches)."""
        readers = [type(cb).__name__ for cb in trainer.callbacks if isinstance(cb, _PER_STEP)]
        every_batch = bool(readers)
        if every_batch:
            names = ", ".join(readers)
            rank_zero_info(
                f"RoundPipe: {names} reads the weights after every batch; each asynchronous "
                "update is applied before it (the update no longer overlaps the next batch)"
            )
        self._add_fit_callback(trainer, _SettleUpdates(self, every_batch))

    def _add_fit_callback(self, trainer: Any, callback: Callback) -> None:
        """``callback`` first in the trainer's list (before the user's), for
        the fit: whatever engines it builds, out again at its end."""
        callbacks = trainer.callbacks
        callbacks.insert(0, callback)
        self._fit_callbacks.append((trainer, callbacks, callback))

    def _end_fit_callbacks(self) -> None:
        """The fit's own callbacks out of the trainer's list (the fit is over)."""
        added, self._fit_callbacks = self._fit_callbacks, []
        for trainer, callbacks, callback in added:
            # (the Tuner swaps the trainer's callback list while it searches)
            for found in (callbacks, trainer.callbacks):
                if any(cb is callback for cb in found):
                    found.remove(callback)

    def _note_weights(self) -> None:
        """Remember what the engine's master copies hold: each pipeline
        parameter's version counter and storage, with the engine's step count
        (after it was built, drained, or took a synchronous step)."""
        engine = self.engine
        if engine is None:
            self._noted = None
            return
        seen = [(p._version, p.data_ptr()) for p in engine.parameters()]
        self._noted = (engine.steps_submitted, seen)

    def _follow_weights(self, everything: bool = False, evaluation: bool = False) -> None:
        """Parameters changed in place outside the optimizer step since the
        engine last saw them (a hook loading or clamping weights, a callback
        swapping in averaged ones) go into its master copies, so the next
        forward computes with them, as without RoundPipe. Seen by version
        counter and storage; ``everything``: copy all of them (a change through
        ``.data``, which PyTorch does not count). Under the asynchronous
        optimizer only while no step was queued since the engine last drained:
        a hook that changes weights between such points races the optimizer
        thread, which writes them. ``evaluation``: for the evaluation alone
        (an average swapped in), training goes on with its own weights."""
        engine, noted = self.engine, self._noted
        if engine is None or noted is None or engine.steps_submitted != noted[0]:
            return
        params = engine.parameters()
        if everything:
            engine.reload_weights(evaluation=evaluation)
        else:
            changed = [
                p
                for p, (version, ptr) in zip(params, noted[1], strict=True)
                if p._version != version or p.data_ptr() != ptr
            ]
            if not changed:
                return
            engine.reload_weights(changed, evaluation=evaluation)
            log.debug("RoundPipe: %d parameter(s) changed outside a step, reloaded", len(changed))
        self._note_weights()

    def reload_weights(self) -> None:
        """Make the next forward compute with the module's current parameters.

        RoundPipe computes with its own copies of the weights. It sees a
        parameter changed in place outside the optimizer step (``load_state_dict``
        or ``copy_`` in a hook, ``nn.init``) by its version counter, and
        Lightning's weight-averaging callbacks are handled; a change through
        ``.data`` (``p.data.copy_(w)``) is invisible to it. Call this after
        making one. The workers' copies of the layers are made again too,
        for an attribute object changed in place (a plain tensor attribute,
        a field of a layer's config), which they follow only when the
        attribute is assigned. Waits for queued optimizer steps."""
        if self.engine is not None:
            self.engine.reload_weights(layers=True)
            self._note_weights()

    def _start_window(self) -> None:
        """Lightning zeroes the gradients before the first batch of each
        accumulation window. The engine's window still holding gradients then
        means no step took them (an ``optimizer_step`` override that skipped
        ``optimizer.step()``): they are dropped before this batch dispatches,
        as Lightning's ``zero_grad`` drops them in plain training."""
        engine = self.engine
        trainer = self.lightning_module.trainer
        if engine is None or not engine.has_pending_gradients or trainer is None:
            return
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx
        if batch_idx % trainer.accumulate_grad_batches == 0:
            engine.zero_grad()

    # -------------------------------------------------------- optimizing
    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """Through the precision plugin's ``optimizer_step`` (the closure,
        Lightning's pre-step hooks, the engine's step)."""
        model = model or self.lightning_module
        earlier = self.engine.has_pending_gradients

        def run_closure() -> Any:
            out = closure()
            self._retry.end()  # also when training_step returned None
            return out

        result = self.precision_plugin.optimizer_step(
            optimizer, model=model, closure=run_closure, **kwargs
        )
        if not self.async_optimizer:  # the step wrote the weights and their copies
            self._note_weights()
        if result is not None or earlier:  # a step was taken
            self._log_metrics(model.trainer)
        self._report_replan()
        return result

    def _report_replan(self) -> None:
        """Say when the engine re-planned from measured costs (the start-up
        line named the plan of the size-based estimates)."""
        engine, before = self.engine, self._reported_plan
        if engine is None or before is None or engine.plan == before:
            return
        self._reported_plan = engine.plan
        rank_zero_info(
            f"RoundPipe: re-planned from the measured costs: plan {engine.plan} (was {before})"
        )

    @property
    def stage_plan(self) -> StagePlan | None:
        """The stage plan the engine runs now (it may re-plan from measured
        costs), or the last one's after the engine closed (None before any)."""
        if self.engine is not None:
            self._stage_plan = self.engine.plan
        return self._stage_plan

    def _log_metrics(self, trainer: Any) -> None:
        now, waited, moved = time.perf_counter(), self.engine.wait_seconds, self.engine.bytes_moved
        last, self._last_step = self._last_step, (now, waited, moved)
        every = self.log_every_n_steps
        if every is None:
            every = trainer.log_every_n_steps
        if last is None or not every or not trainer.loggers:
            return
        if (trainer.global_step + 1) % every:
            return
        step_time = now - last[0]
        metrics = {
            "roundpipe/step_time": step_time,
            "roundpipe/wait_fraction": (waited - last[1]) / step_time if step_time else 0.0,
            "roundpipe/simulated_bubble": self._bubble or 0.0,
            "roundpipe/slots": float(self.engine.plan.num_slots),
            # host <-> device bytes per second of step time, all workers together
            "roundpipe/transfer_gb_per_s": (moved - last[2]) / step_time / 1e9
            if step_time
            else 0.0,
        }
        for logger in trainer.loggers:  # (every one of them, as self.log does)
            logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """As Lightning's: ``on_before_backward``, the module's ``backward`` hook
        (which runs the pipelined backward), ``on_after_backward``."""
        self.pre_backward(closure_loss)
        module = self.lightning_module
        precision = self.precision_plugin
        closure_loss = precision.pre_backward(closure_loss, module)
        try:
            if not self._retry.open:
                precision.backward(closure_loss, module, optimizer, *args, **kwargs)
            else:
                # the fit's first batch: wait for every stage, so that running out
                # of memory surfaces here, where the batch can still be run again
                self._retry.backward(
                    lambda loss: precision.backward(loss, module, optimizer, *args, **kwargs),
                    closure_loss,
                )
        finally:
            self._in_batch = False
        closure_loss = precision.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    # ------------------------------------------------------ out of memory
    def _recover(self) -> None:
        """A new engine in place of one that failed where the loop caught the
        error and went on (the Tuner's batch-size search catches a trial's
        out-of-memory error, and runs the next trial): every call through the
        failed one would raise its error again. The weights are those of the
        last applied step, as after such an error without RoundPipe (the
        asynchronous optimizer's one-behind weights go with the engine);
        warned when a queued step was not applied."""
        engine = self.engine
        # (a failure not raised to the loop yet, an interrupt on the optimizer
        # thread: the next call through the engine raises it, as it should)
        if engine is None or engine.healthy or not engine.failure_raised:
            return
        failure = engine.failure
        if self._replicas is not None and failure is not None:
            # (a failure of several servers, or of another one: not this
            # server's to go on from alone)
            if isinstance(failure, ReplicaError):
                raise failure
            raise RuntimeError(
                f"RoundPipe cannot go on: the engine failed ({type(failure).__name__}: "
                f"{failure}), and with several servers a failed step is not run again on one "
                "of them alone"
            ) from failure
        if engine.updates_applied:
            rank_zero_info(
                f"RoundPipe: the engine failed ({type(failure).__name__}) and the loop went on; "
                "starting a new engine from the weights of the last applied step"
            )
        else:
            # (the batch-size search, whose trials' weights its final restore
            # throws away, goes on from such a failure too)
            rank_zero_warn(
                f"RoundPipe: the engine failed ({type(failure).__name__}) before every optimizer "
                "step it had queued was applied (the asynchronous optimizer's last one, or a "
                "step that failed midway), and the loop went on: a new engine starts from the "
                "module's weights as they are, which are not those of the last step. Restore "
                "them from a checkpoint if the run must go on exactly"
            )
        self.precision_plugin.carried = engine.counters()
        self._final_stale = None
        self._close()
        self._rebuild(None)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._recover()
        if self._held_for_hooks:
            # (the batch's model call goes back to the training weights itself)
            self._held_for_hooks = False
            if self.engine is not None:
                self.engine.release_newest_weights()
        self._in_batch = True
        self._follow_trainable()
        # after an evaluation that averaged weights were swapped in for (and
        # out again, through .data): the training weights back, all of them
        self._follow_weights(everything=self._evaluated)
        self._evaluated = False
        self._start_window()
        first = not self._stack_called
        if first and self.engine is not None:  # (hooks registered after setup: on_train_start)
            ours = self.engine.own_gradient_hooks()
            _refuse_gradient_hooks(self.lightning_module, self.pipeline_layers, ours)
        before = self.engine.iteration if self.engine is not None else 0
        calls = getattr(self._adapter, "calls", 0)
        # a checkpoint saved before this batch is done is resumed by running
        # the batch again: with the dropout masks of its first try
        self.precision_plugin.batch_start = before
        if not self._retry.open:
            out = super().training_step(*args, **kwargs)
        else:
            out = self._retry.training_step(super().training_step, *args, **kwargs)
        if out is None or (isinstance(out, Mapping) and out.get("loss") is None):
            self._in_batch = False  # (no backward follows)
        if first and self.engine is not None and self._adapter is not None:
            self._stack_called = True
            # (a call without gradients, a frozen backbone's, counts too)
            if self._adapter.calls == calls:
                a = self._adapter
                rank_zero_warn(
                    f"the first training step never called {a.name} ({a.kind}), the layer "
                    "stack RoundPipe pipelines: whatever of its layers ran, ran on the training "
                    f"loop's thread outside the pipeline (on the host, not on the devices). Call "
                    f"{a.name}(...) itself rather than its layers one by one (iterating over an "
                    "nn.Sequential, calling a model's inner modules), or name the module the "
                    "step calls with layers='attribute.path'"
                )
        return out

    def _follow_trainable(self, evaluating: bool = False) -> None:
        """A new engine when parameters were frozen or unfrozen since it was
        built (Lightning's ``BaseFinetuning`` does so at epoch starts), or when
        a pipeline layer's parameters or buffers changed (pruning adds a mask
        and renames the weight): the engine fixes which weights get gradient
        buffers, traffic and updates. Between steps only: the window's
        gradients would be lost. ``evaluating``: the layers only (evaluation
        computes no gradients)."""
        engine = self.engine
        if engine is None:
            return
        changed = [] if evaluating else engine.trainable_changed()
        layout = self._layers_changed()
        if not changed and not layout:
            return
        if engine.has_pending_gradients:
            what = (
                f"requires_grad of {changed[0]} changed"
                if changed
                else f"the pipeline's layers changed ({layout[0]})"
            )
            raise ValueError(
                f"{what} in the middle of a gradient accumulation window; freeze, unfreeze "
                "or prune parameters between optimizer steps (e.g. in on_train_epoch_start, as "
                "BaseFinetuning does)"
            )
        self._drain()
        # the one-behind weights of what stays trainable (async): the run goes
        # on exactly; a newly trainable weight was frozen, its master is current
        stale = self._stale_by_name()
        # iteration numbers (dropout masks) and the fp16 loss scale go on too
        self.precision_plugin.carried = engine.counters()
        self._close()
        self._rebuild(stale)
        if changed:
            rank_zero_info(
                f"RoundPipe: requires_grad of {len(changed)} parameter(s) changed "
                f"({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}); "
                "rebuilt the engine for the new set of trainable weights"
            )
        if layout:
            rank_zero_info(
                f"RoundPipe: the pipeline's layers changed ({'; '.join(layout[:3])}"
                f"{' ...' if len(layout) > 3 else ''}); rebuilt the engine for them"
            )

    def _rebuild(self, resumed: dict[str, Tensor] | None) -> None:
        """A new engine after a re-plan (the old one is closed), resuming an
        asynchronous run from ``resumed`` again."""
        self._stale = resumed
        self._build_engine(self.lightning_module.trainer)

    def _microbatch_count(self, costs: Any, n: int, limit: int | None) -> int:
        if self.num_microbatches != "auto":
            return self.num_microbatches
        return self._retry.microbatches or choose_microbatches(
            costs,
            n,
            async_optimizer=self.async_optimizer,
            plan=None if self.plan == "auto" else self.plan,
            memory_limit=limit,
        )

    # --------------------------------------------------------- evaluation
    def _newest_weights(self) -> None:
        """Validation, test and predict see the weights a checkpoint saved now
        would hold (with the asynchronous optimizer: after the queued step)."""
        if self.engine is not None:
            # (drained: the groups too; held: a forward with autograd inside the
            # evaluation computes with them as well)
            self.engine.use_newest_weights(hold=True)
            self.precision_plugin.merge_groups()
            # weights changed in place since they were noted (a callback's
            # on_validation_start, which runs before this one) are what the
            # evaluation computes with: noting them alone would hide them (put
            # back by its end, training goes on as if they never changed)
            self._follow_weights(evaluation=True)
            self._note_weights()
            self._evaluating = True

    def _layers_changed(self) -> list[str]:
        """What changed in the pipeline's layers that the engine cannot follow
        (their parameters or buffers, a layer of the stack replaced by another
        module: ``net[1] = nn.ReLU()``): a new engine is needed."""
        if self.engine is None:
            return []
        changes = self.engine.layout_changed()
        if self._adapter is not None:
            now = self._adapter.layers()
            if len(now) != len(self.pipeline_layers) or any(
                a is not b for a, b in zip(now, self.pipeline_layers, strict=False)
            ):
                changes.append("a layer of the stack replaced, added or removed")
        return changes

    def _evaluation_step(self) -> None:
        """Weights changed since the evaluation started (a weight-averaging
        callback swaps in its average when the validation epoch starts, after
        ``on_validation_start``) are what the evaluation computes with; a
        layer whose parameters or buffers changed, a new engine."""
        if self._layers_changed():
            self._follow_trainable(evaluating=True)
            self._newest_weights()
        self._follow_weights(everything=self._evaluating and self._averaging, evaluation=True)
        self._evaluating = False

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._evaluation_step()
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._evaluation_step()
        return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._evaluation_step()
        return super().predict_step(*args, **kwargs)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._recover()
        self._newest_weights()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._recover()
        self._newest_weights()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._recover()
        self._newest_weights()

    def _training_weights(self) -> None:
        """After evaluation, what runs before the next training step (a
        generation in a callback) sees the weights training computes with."""
        if self.engine is not None:
            # changes after the evaluation's last step (on_validation_epoch_end)
            # too; then each weight changed during the evaluation is settled: put
            # back (training goes on as if it never changed), or in every master copy
            self._follow_weights(evaluation=True)
            self.engine.use_training_weights()
            self._note_weights()
            self._evaluating = False
            # (asynchronous: the engine put the training weights back itself,
            # the one-update-behind ones where the next window reads them)
            self._evaluated = self._averaging and not self.async_optimizer

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        self._training_weights()
        self._last_step = None  # (the next step's time would include the validation)

    @override
    def on_test_end(self) -> None:
        super().on_test_end()
        self._training_weights()

    @override
    def on_predict_end(self) -> None:
        super().on_predict_end()
        self._training_weights()

    # -------------------------------------------------------- checkpoints
    def _drain(self) -> None:
        engine = self.engine
        if engine is not None and not engine.healthy:
            # a checkpoint taken after the engine failed (OnExceptionCheckpoint
            # runs before the strategy's own on_exception): the module is
            # released here, whatever Lightning runs next, and saved as its
            # parameters are when they hold the last step's weights
            applied, failure = engine.updates_applied, engine.failure
            self._final_stale = None  # (the one-behind weights are gone with it)
            self._close()
            if not applied:
                # (with several servers: whose failure came first)
                first = "" if self._replicas is None else self._replicas.reported()
                raise RuntimeError(
                    "RoundPipe cannot save the model's state: "
                    + (f"{first}; " if first else "")
                    + f"the engine failed ({type(failure).__name__}: {failure}) before every "
                    "optimizer step it had queued was applied (the asynchronous optimizer's "
                    "last one, or a step that failed midway), so the weights are not those of "
                    "the last step. Resume from a checkpoint saved before the failure"
                ) from failure
            return
        if engine is not None:
            self.engine.synchronize()
            self.precision_plugin.merge_groups()
            # in-place changes since the weights were last noted (a clamp in
            # on_train_batch_end, an edit in on_validation_epoch_end) go into
            # the master copies first: noting them alone would hide them
            self._follow_weights()
            self._note_weights()

    def wait_for_updates(self) -> None:
        """Wait until every queued optimizer step is applied (under
        ``roundpipe_sync`` none is ever left queued). Until the next training
        step, the module's weights, the optimizer's state and what the
        optimizer wrote into its ``param_groups`` are then those after the
        last step: a per-batch hook may read or change them without racing
        the asynchronous optimizer (a change of the weights in place is taken
        into the master copies at the next step), and a forward in it
        computes with them. The strategy does this itself before
        ``on_train_epoch_end``, ``on_train_end``, validation and checkpoints;
        a call from a per-batch hook costs that batch its overlap with the
        optimizer."""
        self._drain()
        engine = self.engine
        if engine is not None and not engine.layout_changed():
            # (global pruning ranks by the masked weights: the settled ones)
            engine.refresh_derived()
            # a forward in the hooks after this (text sampled at the end of an
            # epoch) computes with these weights, as the module holds them, also
            # with autograd on (held: such a call is not the next training
            # call); the next training step goes back to the one-update-behind
            # copies. Called inside a training step (before its backward), the
            # step's own model calls are training calls: not held
            hold = not self._in_batch
            engine.use_newest_weights(hold=hold)
            self._held_for_hooks = hold

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict once the queued optimizer step is applied
        (what a checkpoint saves now); with the asynchronous optimizer, the
        way for a per-batch hook to read settled weights."""
        self._drain()  # the optimizer copy holds the latest completed step
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        self._drain()
        state = super().optimizer_state(optimizer)
        opt = getattr(optimizer, "_optimizer", optimizer)  # (a LightningOptimizer)
        if self._unfused is not None and self._unfused[0] is opt:
            default, groups = self._unfused[1]
            for k, group in enumerate(state["param_groups"]):
                group["fused"], group["foreach"] = groups[k] if k < len(groups) else default
        return state

    _STALE_KEY = "roundpipe_stale_weights"

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        # the weights the next window computes with (one update behind), so an
        # asynchronous run resumes exactly; ordinary loaders ignore the key. A
        # weights-only checkpoint (no optimizer state) resumes nothing: none
        stale = None
        if "optimizer_states" in checkpoint:
            stale = self._stale_by_name() if self.engine is not None else self._final_stale
        if stale:
            checkpoint[self._STALE_KEY] = stale
        # Lightning's checkpoint IO writes atomically (a crash leaves the
        # previous file intact), locally and on remote filesystems
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _stale_by_name(self) -> dict[str, Tensor] | None:
        if self.engine is None or not self.async_optimizer:
            return None
        self._drain()
        if self.engine is None:  # (it had failed: closed, nothing one behind to keep)
            return None
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        # trainable ones only: a frozen weight's master is the parameter itself
        # (a LoRA base model would otherwise be saved, and cloned, twice)
        return {
            names[id(p)]: t.detach().clone()
            for p, t in zip(self.engine.parameters(), self.engine.stale_weights(), strict=True)
            if id(p) in names and p.requires_grad
        }

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        engine = self.engine
        # a checkpoint restored into an asynchronous fit that has trained (the
        # Tuner's lr_find and scale_batch_size go back to where they started):
        # the queued work finishes, then a new engine starts from the restored
        # weights, as a resumed fit would (a running one cannot go back)
        # (an engine that failed, its error caught by the loop: a new one too,
        # the weights it held are being replaced anyway)
        failed = engine is not None and not engine.healthy
        restart = engine is not None and (failed or (self.async_optimizer and engine.iteration > 0))
        if restart and not failed:
            self._drain()
        super().load_model_state_dict(checkpoint, strict=strict)
        # resumed by a fit only (validate/test/predict from a checkpoint leave
        # nothing behind for a later fit to start from)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        self._stale = checkpoint.get(self._STALE_KEY) if fitting else None
        if restart:
            # (the checkpoint's counters come with the precision plugin's state)
            self.precision_plugin.carried = None
            self._close()
            self._rebuild(self._stale)
            return
        if self.engine is not None:
            self.engine.reload_weights()
            self._note_weights()
            self._resume_stale()

    def _resume_stale(self) -> None:
        stale, self._stale = self._stale, None
        self._retry.resumed = stale  # a re-plan before the first step resumes again
        if not stale or self.engine is None or not self.async_optimizer:
            return
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        tensors = [
            stale.get(names.get(id(p)), t)
            for p, t in zip(self.engine.parameters(), self.engine.stale_weights(), strict=True)
        ]
        self.engine.resume(tensors)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # keep optimizer state on the host, where the optimizer runs
        for opt, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            opt.load_state_dict(state)
            if self._unfused is not None and self._unfused[0] is opt:
                use_fused(opt)  # the loaded groups carry the checkpoint's settings

    # ----------------------------------------------------------- teardown
    def _report(self) -> None:
        """At the end of training: the traffic of the last step against the
        least its schedule could move, and the trace pictures (``trace_dir``)."""
        engine = self.engine
        if engine is None:
            return
        report = engine.traffic_report()
        if report is not None:
            rank_zero_info(f"RoundPipe traffic, {report}")
        if self.trace_dir is not None and engine.last_schedule is not None:
            try:
                paths = engine.write_trace(self.trace_dir)
            except ImportError as exc:  # matplotlib missing: the Chrome trace is there
                rank_zero_warn(f"RoundPipe wrote no timeline pictures: {exc}")
            else:
                rank_zero_info(f"RoundPipe trace: {', '.join(map(str, paths))}")

    def _close(self) -> None:
        self.precision_plugin.after_backward = None
        undos, self._restore = self._restore, []
        failed: BaseException | None = None
        try:
            for undo in reversed(undos):
                try:
                    undo()
                except Exception as exc:  # (every undo runs, the engine closes)
                    failed = failed or exc
        finally:
            if self.engine is not None:
                engine, self.engine = self.engine, None
                self._stage_plan = engine.plan  # (what it ran last, for reports)
                self.precision_plugin.engine = None
                engine.close()
                if self._fitting:  # for a checkpoint saved after the fit (steps are done)
                    self.precision_plugin.final = engine.counters()
        if failed is not None:
            raise failed

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._replicas is not None:  # the other servers' errors say why they stop
            _report(self._replicas, exception)
        try:
            # the user's step, a callback or an interrupt failed, not the engine:
            # the updates already queued (the asynchronous optimizer's last one)
            # still go into the weights, so the module matches global_step
            if self.engine is not None and self._fitting:
                self._final_stale = None  # (a failed engine: nothing to resume from)
            if self.engine is not None and self.engine.healthy:
                # (with several servers too: the queued step's gradients were
                # reduced with the others' already, or the reducer names why not)
                try:
                    self._drain()
                    if self._fitting:  # for a checkpoint saved after the failure
                        self._final_stale = self._stale_by_name()
                except Exception as exc:  # (the engine failed meanwhile: nothing to keep)
                    if self.async_optimizer:
                        log.warning("RoundPipe: queued optimizer steps not applied: %s", exc)
                    else:  # (nothing is ever queued: the stages still running failed)
                        log.warning("RoundPipe: the engine failed while shutting down: %s", exc)
        finally:
            try:
                self._close()
            finally:
                self._end_fit_callbacks()

    @override
    def teardown(self) -> None:
        try:
            self._drain()
            if self.engine is not None and self._fitting:  # for a checkpoint saved after fit
                self._final_stale = self._stale_by_name()
            self._stale = None  # (a checkpoint's, never used: nothing trained)
            self._report()
        finally:
            try:
                self._close()
            finally:
                self._end_fit_callbacks()
                self._leave_servers()
        super().teardown()

    def _leave_servers(self) -> None:
        """Drop the reduction's process group (the default group stays, as
        Lightning's DDP leaves it, for whatever runs after the fit)."""
        replicas, self._replicas = self._replicas, None
        if replicas is not None and self._distributed():
            replicas.report_finished()  # (a server still training names it)
            dist.destroy_process_group(replicas.group)


def _sequence_first(module: torch.nn.Module) -> bool:
    """One of torch's modules that take sequence-first input by default, built so."""
    nn = torch.nn
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return module.self_attn.batch_first is False  # (the layer keeps no flag of its own)
    kinds = (nn.MultiheadAttention, nn.RNNBase, nn.Transformer)
    return isinstance(module, kinds) and getattr(module, "batch_first", True) is False


try:  # Lightning >= 2.6: EMA and other averages, swapped in for validation through .data
    from lightning.pytorch.callbacks import WeightAveraging

    _PER_STEP: tuple[type, ...] = (WeightAveraging,)
except ImportError:  # pragma: no cover - older Lightning
    _PER_STEP = ()
_AVERAGING = (StochasticWeightAveraging, *_PER_STEP)


class _ReportFailure(Callback):
    """The first callback with several servers: a failure of this one is in
    the rendezvous store before any other callback's ``on_exception`` runs
    (an OnExceptionCheckpoint's save waits at a barrier for the other
    servers, which, waiting for this one's gradients, would otherwise learn
    of it only from their watchdog, minutes later)."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        _report(self.replicas, exception)


def _report(replicas: Replicas, exception: BaseException) -> None:
    """This server's failure, for the others' errors (the first report stays)."""
    replicas.report_failure(f"{type(exception).__name__}: {exception}"[:2000])


class _SettleUpdates(Callback):
    """The first callback under the asynchronous optimizer: the queued update
    is applied before the hooks after it read or change the weights
    (:meth:`RoundPipeStrategy._settle_for_callbacks`)."""

    def __init__(self, strategy: RoundPipeStrategy, every_batch: bool) -> None:
        self.strategy = strategy
        self.every_batch = every_batch

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self.every_batch:
            self.strategy._drain()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._settle()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._settle()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # before the other callbacks' (the strategy's own hook runs after them):
        # one that keeps the weights to put them back after the validation
        # keeps the updated ones, not those before the queued update
        self.strategy._newest_weights()

    def _settle(self) -> None:
        self.strategy.wait_for_updates()


def _difference(ours: Any, theirs: Any) -> str:
    """Two servers' values of a setting, for an error message: of two lists,
    the first entry that differs (or the lengths)."""
    if isinstance(ours, list) and isinstance(theirs, list):
        for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
            if a != b:
                return f"entry {i}: {a!r} against {b!r}"
        return f"{len(ours)} entries against {len(theirs)}"
    return f"{ours!r} against {theirs!r}"


_JOINS = itertools.count()


def _join_prefix() -> str:
    """The rendezvous store keys' prefix of this joining of the servers: the
    same on every server (each runs the same fits in order) and new for each
    fit and each restart of the launcher, so an earlier fit's failure report
    (left in the store, which outlives the fit) is not taken for this one's."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"roundpipe/{restart}.{next(_JOINS)}/"


def _owners(root: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """The modules of ``root`` that hold a pipeline layer (``root`` itself,
    the model, its layer list): ancestors in the module tree of each layer's
    topmost modules in it (an adapter's layer wraps the model's own block)."""
    parent: dict[int, nn.Module] = {}
    for m in root.modules():
        for child in m._modules.values():
            if child is not None:
                parent.setdefault(id(child), m)
    found: dict[int, nn.Module] = {id(root): root}
    for layer in layers:
        own = {id(m) for m in layer.modules()}
        for m in layer.modules():
            up = parent.get(id(m))
            if up is None or id(up) in own:
                continue
            while up is not None and id(up) not in found:
                found[id(up)] = up
                up = parent.get(id(up))
    return list(found.values())


def _warn_low_precision(layers: list[nn.Module], precision: str) -> None:
    """Under ``"32-true"`` every weight goes up and computes in fp32: bf16 or
    fp16 parameters (a model loaded with ``dtype=torch.bfloat16``) compute
    differently than they would with the default strategy: say so."""
    if precision != "32-true":
        return
    low = sorted(
        {
            str(p.dtype).removeprefix("torch.")
            for layer in layers
            for p in layer.parameters()
            if p.is_floating_point() and p.dtype != torch.float32
        }
    )
    if low:
        rank_zero_warn(
            f"RoundPipe: pipeline parameters in {', '.join(low)} under precision='32-true' are "
            "uploaded and computed in fp32 (the compute dtype), not in their own dtype as with "
            "the default strategy; use Trainer(precision='bf16-true') to compute a bf16 model "
            "in bf16, or 'bf16-mixed' for bf16 compute with an fp32 optimizer copy"
        )


def _compiled(layers: list[nn.Module], module: nn.Module) -> list[Callable[[], None]]:
    """``Module.compile()`` on a pipeline layer's module is not carried to the
    workers' copies (``copy.deepcopy`` drops it), and ``torch.compile`` of a
    module holding the stack traces the pipeline's own dispatch (locks,
    threads), breaking its graph and recompiling on every call: say so. A
    holder compiled in place (``Module.compile()`` on the stack or the Hugging
    Face model) runs uncompiled while the engine is attached, which changes
    nothing but the speed; the undos returned compile it again."""
    ours = {id(p) for layer in layers for p in layer.parameters()}
    inside = {id(m) for layer in layers for m in layer.modules()}
    undo: list[Callable[[], None]] = []
    for name, m in module.named_modules():
        impl = m.__dict__.get("_compiled_call_impl")
        if impl is None or id(m) in inside or not any(id(p) in ours for p in m.parameters()):
            continue
        rank_zero_warn(
            f"RoundPipe: {name or type(m).__name__} was compiled with Module.compile() and holds "
            "the pipeline's layers: compiled, it would trace the pipeline's dispatch (its graph "
            "breaks at every hand-off, many times slower), while the layers run uncompiled on "
            "the workers anyway; it runs uncompiled while RoundPipe runs it (compiled again "
            "after the fit)"
        )
        m._compiled_call_impl = None
        undo.append(lambda m=m, impl=impl: setattr(m, "_compiled_call_impl", impl))
    holders = [
        name or type(module).__name__
        for name, m in module.named_modules()
        if isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
        and any(id(p) in ours for p in m.parameters())
    ]
    if holders:
        rank_zero_warn(
            f"RoundPipe: {', '.join(holders[:3])} was compiled with torch.compile and holds the "
            "pipeline's layers: the compiler would trace the pipeline's dispatch (its graph "
            "breaks at every hand-off and it recompiles, many times slower), while the layers "
            "run uncompiled on the workers anyway; leave the model uncompiled under RoundPipe"
        )
    compiled = sorted(
        {
            type(m).__name__
            for layer in layers
            for m in layer.modules()
            if getattr(m, "_compiled_call_impl", None) is not None
        }
    )
    if compiled:
        rank_zero_warn(
            f"RoundPipe: modules of the pipeline layers were compiled with Module.compile() "
            f"({', '.join(compiled[:3])}{', ...' if len(compiled) > 3 else ''}); the workers "
            "run private copies of the layers, which run uncompiled"
        )
    return undo


def _refuse_lazy_parameters(module: Any) -> None:
    """Lazy modules' weights have no size before their first forward, and the
    pipeline sizes, plans and places every weight before the first step."""
    for name, p in module.named_parameters():
        if torch.nn.parameter.is_lazy(p):
            raise ValueError(
                f"{name} is an uninitialized parameter of a lazy module (nn.LazyLinear, ...); "
                "RoundPipe sizes, plans and places every weight before the first step. Run one "
                "forward with an example batch in the LightningModule's __init__ or setup() "
                "(self.net(example)) so the lazy modules take their sizes, or give them"
            )


def _refuse_renormed_embeddings(layers: list[torch.nn.Module], root: Any) -> None:
    """``nn.Embedding(max_norm=...)`` renormalizes its weight's rows in place
    during the forward: on a worker's copy, which the host never sees."""
    names = {id(m): n for n, m in root.named_modules()}
    for layer in layers:
        for m in layer.modules():
            if isinstance(m, torch.nn.Embedding) and m.max_norm is not None:
                raise ValueError(
                    f"{names.get(id(m), type(m).__name__)} is an nn.Embedding with "
                    f"max_norm={m.max_norm}, which renormalizes its weight's rows in place during "
                    "the forward; RoundPipe's layers compute with copies of the weights, so the "
                    "renormalization would be lost. Set max_norm=None and renormalize the "
                    "weight after each optimizer step (on_train_batch_end), or use another "
                    "strategy"
                )


def _refuse_prefix_tuning(module: Any) -> None:
    """PEFT's prefix tuning hands the model a key-value cache of its prompt,
    which the pipeline's layers cannot take: refused at setup in both modes
    (the asynchronous optimizer's refusal of its prompt parameters pointed at
    roundpipe_sync, which then refused the cache)."""
    for name, m in module.named_modules():
        config = getattr(m, "active_peft_config", None) if hasattr(m, "peft_config") else None
        if getattr(config, "peft_type", None) == "PREFIX_TUNING":  # (a str enum)
            raise TypeError(
                f"{name or 'the module'} uses PEFT prefix tuning, which passes the model a "
                "key-value cache (past_key_values) of its prompt; RoundPipe's pipeline keeps no "
                "such cache. Use prompt tuning or P-tuning (with strategy='roundpipe_sync'), "
                "LoRA, or strategy='auto' for prefix tuning"
            )


def _refuse_gradient_hooks(
    module: Any, layers: list[torch.nn.Module], ours: set[int] | None = None
) -> None:
    """Hooks on the gradients of pipeline parameters would never run: the
    pipeline computes those gradients on its workers' own copies of the
    weights. Refused, naming them, rather than ignored. ``ours``: ids of the
    engine's own hooks, left out."""
    inside = {id(p) for layer in layers for p in layer.parameters()}
    ours = ours or set()

    def hooked_by_user(p: torch.Tensor) -> bool:
        tables = (p._backward_hooks, getattr(p, "_post_accumulate_grad_hooks", None))
        return any(k not in ours for table in tables if table for k in table)

    hooked = [
        name for name, p in module.named_parameters() if id(p) in inside and hooked_by_user(p)
    ]
    if hooked:
        more = f" and {len(hooked) - 3} more" if len(hooked) > 3 else ""
        raise ValueError(
            f"gradient hooks (register_hook / register_post_accumulate_grad_hook) are set on "
            f"pipeline parameter(s) {', '.join(hooked[:3])}{more}: RoundPipe computes their "
            "gradients on its workers' copies of the weights, so such hooks would never run. "
            "Remove them; to read or change gradients use on_before_optimizer_step with "
            "strategy='roundpipe_sync'"
        )


def _overridden(
    trainer: Any, module: Any, module_hooks: tuple[str, ...], callback_hook: str
) -> list[str]:
    """``Class.hook`` for each of ``module_hooks`` the module overrides and each
    callback overriding ``callback_hook``."""
    users = [
        f"{type(module).__name__}.{hook}"
        for hook in module_hooks
        if is_overridden(hook, module, LightningModule)
    ]
    return users + [
        f"{type(cb).__name__}.{callback_hook}"
        for cb in trainer.callbacks
        if is_overridden(callback_hook, cb, Callback)
    ]


def _warn_after_backward(trainer: Any, module: Any) -> None:
    """``on_after_backward`` runs after every backward, when the pipeline's
    gradients are still in the engine's buffers (``.grad`` is None there, in
    both modes): say so when the module or a callback overrides it."""
    users = _overridden(trainer, module, ("on_after_backward",), "on_after_backward")
    if users:
        rank_zero_warn(
            f"{', '.join(users)} {'is' if len(users) == 1 else 'are'} overridden. Under "
            "RoundPipe the pipeline layers' gradients are in its own buffers after a backward, "
            "so their `.grad` there is None; read or change them in `on_before_optimizer_step` "
            "with strategy='roundpipe_sync'."
        )


def _warn_gradient_hooks(trainer: Any, module: Any) -> None:
    """With the asynchronous optimizer a window's gradients are collected on the
    optimizer thread after the hooks Lightning runs before a step have run on
    the caller's thread, so those hooks cannot see them: say so when the module
    or a callback overrides one."""
    users = _overridden(
        trainer,
        module,
        ("on_before_optimizer_step", "configure_gradient_clipping"),
        "on_before_optimizer_step",
    )
    if users:
        rank_zero_warn(
            f"{', '.join(users)} {'is' if len(users) == 1 else 'are'} overridden. With "
            "strategy='roundpipe' (asynchronous optimizer) these hooks run before the "
            "step's gradients reach the host, so `.grad` there is not this step's gradient "
            "(it may be None). Use strategy='roundpipe_sync' (or "
            "RoundPipeStrategy(async_optimizer=False)) to inspect or change gradients in "
            "them; clipping through the Trainer, or `self.clip_gradients(...)` in "
            "`configure_gradient_clipping`, works in both modes."
        )

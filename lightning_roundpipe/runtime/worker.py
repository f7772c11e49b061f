"""Device workers: one thread per device entry, running its lowered tasks in order.

The controller lowers each iteration (:func:`~lightning_roundpipe.plan.lower`)
and hands every :class:`~lightning_roundpipe.plan.Task` to the worker of its
device. For a task (one stage for the micro-batches of one round) a worker
uploads the stage's weights as one copy of its range of the master arena,
binds them into its private layer replicas and runs every micro-batch:

* forward stage: ``no_grad`` forward; writes the boundaries later stages read;
* fused stage: forward with autograd, loss, backward; writes the loss and the
  gradient of the stage input;
* backward stage: recompute from the saved input as soon as it is there, then
  wait for the output gradient and run backward; writes the gradient of the
  stage input.

Weight gradients are added, as each micro-batch's backward produces them, into
an fp32 accumulator on the device (so low-precision gradients are summed
in fp32 whatever the rounds), which goes down once per task; the host adds
the rounds' sums in micro-batch order.

The worker thread never waits for the host to finish anything: a per-worker
*courier* thread waits for each copy to complete and then publishes the value
to the activation store, adds the gradient into the host fp32 buffer (holding
it while the previous step still uses that buffer, ordering rule 4), signals
that an upload has finished reading the master copy (rule 1) and writes running
statistics back. On CPU workers copies are synchronous, so values are published
at once; gradients still go through the courier.

CUDA ordering (no-ops on CPU devices): the compute stream waits for the weight
upload and for each micro-batch's activation upload; every download waits for
the compute that produced it; the next micro-batch's input is uploaded while
the current one computes, and the next task's weights are uploaded in windows,
one after each micro-batch's activation upload.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..plan.schedule import Task
from .calls import Call, Gain, Job, Runtime
from .courier import Courier
from .device import (
    DeviceContext,
    LayerRandomness,
    draws_random,
    holding_generator,
    is_out_of_memory,
    layer_seed,
    own_checkpoints,
)
from .host import _STRUCTURES, LayerReplica, _Param, _Structure
from .nested import call_layer, flatten_tensors, map_tensors
from .profiler import (
    LayerTimer,
    Stopwatch,
    named,
    saved_bytes,
)
from .scope import forbid_host_sync, stage_scope
from .store import EngineFailure, HandoffTimeout, Key

__all__ = ["Call", "Gain", "Job", "Runtime", "Worker", "WorkerError"]

log = logging.getLogger(__name__)


# autograd nodes that keep neither their inputs nor their output
_KEEPS_NOTHING = frozenset({"AddBackward0", "SubBackward0"})


def release_output(out: torch.Tensor) -> bool:
    """Free the memory of a stage's output before its backward when nothing
    can read it: made by an out-of-place sum (a decoder block's residual
    add: its node keeps nothing), never written since, not a view. Its
    backward needs only its graph node and its shape, so the stage holds one
    hidden-sized value less while its backward runs. Torch frees a tensor's
    memory only with its last reference, and the call to backward holds one,
    hence the storage is resized (as FSDP frees parameters). Returns whether
    it was freed."""
    node = out.grad_fn
    if node is None or type(node).__name__ not in _KEEPS_NOTHING:
        return False
    if out._base is not None or out._version != 0:
        return False
    out.untyped_storage().resize_(0)
    return True


class _HandOver(torch.autograd.Function):
    """Where a stage's backward starts: it hands autograd the gradients of
    the stage's outputs (from ``box``) as theirs, so autograd holds each only
    until it has used it. (Called as ``torch.autograd.backward(outs,
    grads)``, the caller's frame keeps them to the end: a hidden-sized value
    for all of the backward of a decoder block, though its residual path
    has used it at the start.)"""

    @staticmethod
    def forward(ctx: Any, box: list, *outs: torch.Tensor) -> torch.Tensor:
        ctx.box = box
        return torch.zeros((), device=outs[0].device)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple:
        return (None, *ctx.box.pop())


def backward_handing_over(
    outs: list[torch.Tensor],
    grads: list[torch.Tensor],
    inputs: list[torch.Tensor] | None = None,
) -> None:
    """``torch.autograd.backward(outs, grads, inputs=inputs)``, except that
    ``grads`` is emptied and autograd frees each gradient once it has used
    it, if nothing else holds it (:class:`_HandOver`)."""
    box = [tuple(grads)]
    grads.clear()
    torch.autograd.backward(_HandOver.apply(box, *outs), inputs=inputs)


def _grads(leaves: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The gradients that arrived at a layer input's leaves (:meth:`Worker._leaves`)."""
    return [None if v is None else v.grad for v in leaves]


class WorkerError(RuntimeError):
    """A failure inside a device worker, with where it happened.

    Attributes:
        device, worker, stage, layers, microbatch, iteration: the context.
    """

    def __init__(
        self,
        message: str,
        *,
        device: str,
        worker: int,
        stage: str,
        layers: tuple[int, int],
        microbatch: int | None,
        iteration: int,
    ) -> None:
        super().__init__(message)
        self.device = device
        self.worker = worker
        self.stage = stage
        self.layers = layers
        self.microbatch = microbatch
        self.iteration = iteration


@dataclass
class _Accumulator:
    """A task's fp32 gradients on the device (one flat buffer) and the
    indices of the weights a backward reached."""

    flat: torch.Tensor
    reached: set[int] = field(default_factory=set)


@dataclass
class _Staged:
    """A stage's weights on the device and the event that says they are there."""

    tensors: dict[int, torch.Tensor]
    ready: Any


@dataclass
class _Prefetch:
    """The next job's weights, being uploaded window by window."""

    job: Job
    params: list[_Param]
    flat: torch.Tensor
    src: list[tuple[int, torch.Tensor]]  # host ranges and where they go in flat
    windows: list[tuple[int, int]]  # byte ranges of the span, one per window
    tensors: dict[int, torch.Tensor]
    outside: list[_Param]
    issued: int = 0  # windows copied so far


@dataclass
class _Uploaded:
    """A stage input on its way to the device.

    Attributes:
        value: the device value.
        ready: the event that says it is there.
        host: its host value, kept by a rewalked stage, which uploads its
            input again for each layer (None otherwise).
        held: host bytes such a stage releases once done with it.
    """

    value: Any
    ready: Any
    host: Any = None
    held: int = 0


class _Rewalk:
    """A rewalked stage's layer inputs (:class:`~lightning_roundpipe.plan.stages.StagePlan`),
    popped from the top as a layered stage pops the ones it kept: each is
    computed when asked, from the stage input uploaded again, and nothing
    of it stays on the device."""

    def __init__(self, count: int, walk: Callable[[int], Any]) -> None:
        self._count, self._walk = count, walk

    def __len__(self) -> int:
        return self._count

    def pop(self) -> Any:
        """The input of the stage's layer ``count - 1`` (the top one left)."""
        self._count -= 1
        return self._walk(self._count)


def _rewalked(t: Task) -> bool:
    """Whether ``t`` computes its layers' inputs again from its own
    (:class:`~lightning_roundpipe.plan.stages.StagePlan`)."""
    return t.rewalk and t.kind != "forward" and t.stop - t.start > 1


def _check_state(replicas: list[LayerReplica], recomputed: bool) -> None:
    """Refuse a layer whose forward changed state the pipeline cannot follow
    (:meth:`LayerReplica.state_change`), before its results are used."""
    for rep in replicas:
        change = rep.state_change(recomputed)
        if change is None:
            continue
        if re.search(r"rope_type=.*'dynamic'", change):  # (also in a per-layer-type dict)
            hint = (
                " rope_type='dynamic' rescales its frequencies when a sequence is longer than "
                "any before: train with sequences of at most max_position_embeddings tokens, or "
                "use 'linear' or 'yarn' rope scaling."
            )
        elif "rope_type=" in change:
            hint = (
                " Its rope scaling updates the frequencies during the forward in a way RoundPipe "
                "does not follow: use 'linear', 'yarn' or 'longrope' rope scaling."
            )
        else:
            hint = (
                " Keep such state outside the pipeline's layers, or update it outside the "
                "forward (in a callback)."
            )
        raise RuntimeError(
            f"pipeline layer {rep.info.index} ({type(rep.module).__name__}) {change} during its "
            "forward. RoundPipe runs each layer on a private copy per worker and, in training, "
            "computes a stage again for its backward, so state a forward changes and reads "
            "(other than normalization running statistics) cannot be followed." + hint
        )


def _copy_range(
    flat: torch.Tensor, sources: list[tuple[int, torch.Tensor]], a: int, b: int
) -> None:
    """Bytes ``[a, b)`` of a stage's device buffer from its host ranges
    (:meth:`HostState.sources`; bytes between the ranges are padding)."""
    for at, src in sources:
        lo, hi = max(a, at), min(b, at + src.numel())
        if lo < hi:
            flat[lo:hi].copy_(src[lo - at : hi - at], non_blocking=True)


class _Waiting:
    """While a worker waits outside a layer: what for (:meth:`Worker.activity`)."""

    __slots__ = ("what", "worker")

    def __init__(self, worker: Worker, what: str) -> None:
        self.worker, self.what = worker, what

    def __enter__(self) -> None:
        w = self.worker
        w._waiting, w._since = self.what, time.monotonic()

    def __exit__(self, *exc: object) -> None:
        w = self.worker
        w._waiting, w._since = None, time.monotonic()


def running_now(workers: list[Worker], skip: Worker | None = None) -> str:
    """What the device workers (but ``skip``) run now, those computing first:
    ``"still running: device cpu (worker 0) stage F1, layer 2, micro-batch 5,
    for 1.0 s; ..."``, or ``""`` when every one is idle. For an error message
    after a hand-off timed out: the slow one is named, not only the waiter."""
    now = time.monotonic()
    busy = [
        (w._waiting is not None, a) for w in workers if w is not skip and (a := w.activity(now))
    ]
    if not busy:
        return ""
    return "still running: " + "; ".join(a for _, a in sorted(busy, key=lambda b: b[0]))


def describe_threads(rt: Runtime, names: list[str]) -> str:
    """The threads named ``names`` (that did not stop), each with what it
    may be blocked in, for the engine's shutdown error."""
    now = time.monotonic()
    out = []
    for name in names:
        why = "it may be blocked"
        for w in rt.workers:
            if name == w.thread.name:
                doing = w.activity(now)
                why = (f"running {doing}: " if doing else "") + (
                    "a layer may be blocked"
                    if doing is None or w._layer is not None
                    else "a copy or a wait outside the layers may be blocked"
                )
            elif name == w.courier.thread.name:
                job = w.courier._adding
                why = f"device {w.device}'s courier (worker {w.index}): a copy or a gradient add"
                why += f" (stage {job.task.stage})" if job is not None else ""
                why += " may be blocked"
        opt = rt.optimizer
        if opt is not None and name == getattr(opt.thread, "name", None):
            n = opt.applied
            why = (
                f"the optimizer thread, {n} step{'' if n == 1 else 's'} applied so far: an "
                "optimizer step, its weight copies or a queued call (engine.call) may be blocked"
            )
        reducer = rt.reducer
        if reducer is not None and name == getattr(reducer.thread, "name", None):
            why = "the gradient reduction across servers may be blocked"
        out.append(f"{name} ({why})")
    return "; ".join(out)


class Worker:
    """One device worker thread (and its courier)."""

    def __init__(self, index: int, device: torch.device, rt: Runtime) -> None:
        self.index = index
        self.device = device
        self.rt = rt
        self.host = rt.host
        self.store = rt.store
        self.protocol = rt.protocol
        self._queue: deque[Job | None] = deque()
        self._cond = threading.Condition()
        # each layer's replicas, one per state of its modules, the newest first
        self._replicas: dict[int, list[LayerReplica]] = {}
        self._rng: dict[int, LayerRandomness] = {}
        self._checkpointing = False  # a layer with gradient checkpointing ran here
        self._prefetch: _Prefetch | None = None
        self._ahead: dict[Key, Any] = {}  # inputs uploaded one micro-batch ahead
        self.ctx: DeviceContext | None = None
        # what the thread runs now, for error messages (plain attributes, read
        # without a lock by other threads: :meth:`activity`)
        self._job: Job | None = None  # the task
        self._mb: list[int | None] = [None]  # its micro-batch
        self._layer: int | None = None  # the layer
        self._waiting: str | None = None  # what it waits for, outside a layer
        self._since = time.monotonic()  # when the above last changed
        self._layers_cpu = 0.0  # CPU time inside layer marks of the task being timed
        self.courier = Courier(self)
        self.thread = threading.Thread(
            target=self._main, name=f"roundpipe-worker-{index}-{device}", daemon=True
        )

    # ------------------------------------------------------------ queueing
    def start(self) -> None:
        self.thread.start()
        self.courier.thread.start()

    def submit(self, job: Job | None) -> None:
        with self._cond:
            self._queue.append(job)
            self._cond.notify()

    def stop(self) -> None:
        """Ask the threads to finish after the jobs already queued."""
        self.submit(None)

    def _next(self) -> Job | None:
        with self._cond:
            while not self._queue:
                if self.store.failure is not None:
                    return None
                self._cond.wait(0.5)
            return self._queue.popleft()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    @property
    def threads(self) -> list[threading.Thread]:
        return [self.thread, self.courier.thread]

    def activity(self, now: float | None = None) -> str | None:
        """What this worker runs now (None: idle), as ``"device cpu (worker 0)
        stage F1, layer 2, micro-batch 5, for 1.0 s"``. Read from plain
        attributes without a lock (another thread's view: may be a moment old)."""
        job, layer, mb, waiting = self._job, self._layer, self._mb[0], self._waiting
        since = self._since
        if job is None:
            return None
        t = job.task
        text = f"device {self.device} (worker {self.index}) stage {t.stage}"
        if layer is not None:
            text += f", layer {layer}"
        if mb is not None:
            text += f", micro-batch {mb}"
        if waiting is not None:
            text += f", waiting for {waiting}"
        elapsed = (time.monotonic() if now is None else now) - since
        return f"{text}, for {max(0.0, elapsed):.1f} s"

    # ---------------------------------------------------------------- main
    def _main(self) -> None:
        job: Job | None = None
        mb = self._mb
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self.ctx = DeviceContext(self.device)
            while True:
                job = self._next()
                if job is None or self.store.failure is not None:
                    break
                mb[0] = None
                self._layer = None
                self._waiting = None
                self._since = time.monotonic()
                self._job = job
                self._run(job, mb)
                self._job = job = None
        except (EngineFailure, HandoffTimeout) as exc:
            if isinstance(exc, HandoffTimeout):
                self.store.fail(self.wrap_failure(exc, job, mb[0]))
        except BaseException as exc:  # every failure must reach the caller
            self.store.fail(self.reported(exc, job, mb[0]))
        finally:
            self._job = None  # (no longer running it: activity)
            if self.ctx is not None:
                try:  # no copy may still read host memory once the engine frees it
                    self.ctx.synchronize()
                except Exception:  # a broken device: the failure is reported already
                    log.debug("could not synchronize %s at exit", self.device, exc_info=True)
            self.courier.stop()
            for reps in self._replicas.values():
                for rep in reps:
                    rep.unbind()
            self._replicas.clear()
            self._prefetch = None
            self._ahead.clear()

    def reported(
        self, exc: BaseException, job: Job | None, mb: int | None, courier: bool = False
    ) -> BaseException:
        """What the caller's thread raises for ``exc``: a :class:`WorkerError`
        naming where it happened, or, for a ``KeyboardInterrupt`` or
        ``SystemExit`` raised in a layer or hook, that exception itself with
        where as a note: an interrupt stays one, so Lightning shuts down as it
        does when the layer runs on its own thread."""
        err = self.wrap_failure(exc, job, mb, courier)
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return err
        try:
            exc.add_note(f"(raised on a RoundPipe worker thread: {err})")
        except Exception:  # (a note is only a courtesy)
            log.debug("could not note where %r was raised", exc, exc_info=True)
        return exc

    def wrap_failure(
        self, exc: BaseException, job: Job | None, mb: int | None, courier: bool = False
    ) -> WorkerError:
        """The :class:`WorkerError` that takes ``exc`` to the caller, naming
        the device, stage and micro-batch; never raises itself (a failure the
        worker cannot report would leave the caller waiting for the watchdog)."""
        try:
            return self._wrap_failure(exc, job, mb, courier)
        except Exception:
            log.debug("could not describe a failure on %s", self.device, exc_info=True)
        t = None if job is None else job.task
        err = WorkerError(
            f"device {self.device} (worker {self.index}) failed"
            + ("" if t is None else f" in stage {t.stage} (layers {t.start}-{t.stop - 1})")
            + ("" if mb is None else f", micro-batch {mb}")
            + f": {type(exc).__name__}: {_message(exc)}",
            device=str(self.device),
            worker=self.index,
            stage="-" if t is None else t.stage,
            layers=(0, 0) if t is None else (t.start, t.stop),
            microbatch=mb,
            iteration=-1 if job is None else job.call.iteration,
        )
        err.__cause__ = exc
        return err

    def _wrap_failure(
        self, exc: BaseException, job: Job | None, mb: int | None, courier: bool
    ) -> WorkerError:
        text = _message(exc)
        if job is None:
            err = WorkerError(
                f"device {self.device} (worker {self.index}) failed outside a stage: "
                f"{type(exc).__name__}: {text}",
                device=str(self.device),
                worker=self.index,
                stage="-",
                layers=(0, 0),
                microbatch=None,
                iteration=-1,
            )
        else:
            t, call = job.task, job.call
            where = "" if self._layer is None or courier else f", layer {self._layer}"
            if courier:  # completing the task's copies, after its compute
                where += ", completing its transfers"
            where += "" if mb is None else f", micro-batch {mb}"
            extra = ""
            if is_out_of_memory(exc):
                extra = self._oom_advice(t)
            if isinstance(exc, HandoffTimeout):
                # what the others run now: the one that is slow, not only this waiter
                running = (
                    ""
                    if exc.optimizer is not None
                    else running_now(self.rt.workers, None if courier else self)
                )
                extra = ("; " + running if running else "") + "\n"
                extra += call.schedule.grid(mark=job.index)
            if isinstance(exc, ValueError) and "more than 1 value per channel" in text:
                # (batch norm in training, a micro-batch of one sample: a batch of
                # 5 in 3 micro-batches is cut 2, 2, 1)
                extra += (
                    " (this micro-batch holds one sample: give num_microbatches at most half "
                    "the smallest batch, the epoch's last one included, or drop that one "
                    "with drop_last=True)"
                )
            dtype = self.host.compute_dtype
            if (
                dtype != torch.float32
                and isinstance(exc, RuntimeError)
                and ("dtype" in text or "scalar type" in text)
            ):
                extra = (
                    f" (the pipeline's layers compute in {str(dtype).removeprefix('torch.')}, "
                    "their weights cast to it, without autocast: a layer that mixes a "
                    "floating-point buffer or tensor of its own into its activations must cast "
                    "it to the activations' dtype, e.g. x + self.pe.to(x.dtype))"
                )
            if "leaf Variable that requires grad is being used in an in-place" in text:
                extra = (
                    " (a stage's first layer gets its input itself when its class sets "
                    "input_intact = True: a layer that writes its input in place must not)"
                )
            what = f"device {self.device} (worker {self.index}) failed in stage"
            if isinstance(exc, HandoffTimeout) and exc.optimizer is not None:
                # the optimizer is late, not this worker: say so first
                what = (
                    f"optimizer step {exc.optimizer} did not finish in time: device "
                    f"{self.device} (worker {self.index}) waited for it in stage"
                )
            err = WorkerError(
                f"{what} {t.stage} "
                f"(layers {t.start}-{t.stop - 1}, {t.kind}){where}, round {t.round}, "
                # (evaluation calls count down from -1 internally: not a number to show)
                f"{'an evaluation pass' if call.iteration < 0 else f'iteration {call.iteration}'}: "
                f"{type(exc).__name__}: {text}{extra}",
                device=str(self.device),
                worker=self.index,
                stage=t.stage,
                layers=(t.start, t.stop),
                microbatch=mb,
                iteration=call.iteration,
            )
        err.__cause__ = exc
        return err

    def _oom_advice(self, t: Task) -> str:
        try:
            return self._oom_text(t)
        except Exception:  # advice must never hide the error itself
            return ""

    def _oom_text(self, t: Task) -> str:
        params = self.host.stage_params(t.start, t.stop)
        # weights in the compute dtype, plus an fp32 gradient accumulator
        need = sum(p.nbytes + (p.master.numel() * 4 if p.trainable else 0) for p in params)
        if self.device.type == "cuda":
            free = f"{torch.cuda.mem_get_info(self.device)[0] / 2**30:.2f} GiB free"
        else:
            free = "host memory"
        return (
            f". Stage {t.stage} needs about {need / 2**30:.2f} GiB for weights and gradients "
            f"plus activations; the device has {free}. Raise num_microbatches (smaller "
            "micro-batches), lower device_memory_limit so the partitioner cuts smaller stages, "
            "or give a plan with smaller stages"
        )

    # ---------------------------------------------------------------- task
    def _replica(self, layer: int, structure: _Structure) -> LayerReplica:
        """This worker's copy of ``layer`` in the state a call saw it in (a
        layer whose attributes or hooks changed outside the pipeline gets a
        new one; the few latest are kept, for a state it goes back to)."""
        reps = self._replicas.setdefault(layer, [])
        for k, rep in enumerate(reps):
            if rep.structure is structure:
                if k:
                    reps.insert(0, reps.pop(k))
                return rep
        rep = LayerReplica(self.host.layers[layer], structure, self.host.compute_dtype)
        if rep.checkpointed:
            own_checkpoints(rep.module, self.device)
        reps.insert(0, rep)
        del reps[_STRUCTURES:]
        if layer not in self._rng:
            # the modes in which a worker saw the layer draw are shared by the
            # device's workers: a draw one of them sees (randomness that
            # depends on the data) seeds every worker's calls from then on
            self._rng[layer] = LayerRandomness(
                self.device,
                f"layer {layer}",
                draws_random(rep.module, any_mode=True),
                seen=self.rt.randomness.setdefault((str(self.device), layer), {}),
            )
        return rep

    def _run(self, job: Job, mb: list[int | None]) -> None:
        t, call = job.task, job.call
        # while profiling, a CPU worker's own host work per micro-batch: its
        # thread's CPU time outside the layers' marks (LayerCosts.task_overhead;
        # not of a layered stage, whose extra forwards run outside the marks)
        timed = call.profiler is not None and not self.ctx.is_cuda and not t.layered
        if timed:
            self._layers_cpu, begin = 0.0, time.thread_time()
        with named(f"RP {call.iteration}:{t}"):
            if job.after is not None:
                # running statistics of the previous round of this slot must be on
                # the host before this round uploads them
                what = f"stage {t.stage} of the previous round (running statistics)"
                with named("RP wait running statistics"), _Waiting(self, what):
                    self.store.wait_until(lambda: job.after in self.rt.written, what)
            params = self.host.stage_params(t.start, t.stop)
            self._run_stage(job, mb, params)
            self.courier.finish(job)
        if timed:
            own = time.thread_time() - begin - self._layers_cpu
            call.profiler.add_overhead(call.iteration, own / max(1, len(t.microbatches)))

    def _run_stage(self, job: Job, mb: list[int | None], params: list[_Param]) -> None:
        ctx, t, call = self.ctx, job.task, job.call
        it = call.iteration
        pf = self._prefetch
        if pf is not None and pf.job is job:
            staged = self._finish_prefetch(pf)
        else:
            staged = self._upload_weights(job, params)
        self._prefetch = None
        needs_grad = t.needs_grad
        # ``.data``: each weight its own version counter. The staged weights are
        # views of one flat buffer, whose shared counter an in-place write to
        # any of them (PEFT's expert adapters re-register a parametrization per
        # call) would bump for all, failing autograd's check on the others
        weights = {
            p.index: nn.Parameter(
                staged.tensors[p.index].data,
                requires_grad=needs_grad and p.trainable and p.index not in call.frozen,
            )
            for p in params
        }
        replicas = [self._replica(i, call.structures[i]) for i in range(t.start, t.stop)]
        nbuf = 0
        for rep in replicas:
            host_bufs = rep.structure.buffers
            bufs = [ctx.upload(b, ctx.weight_up, fresh=True) for b in host_bufs]
            nbuf += sum(b.numel() * b.element_size() for b in host_bufs)
            rep.bind(weights, bufs, call.modes[rep.info.index])
        if nbuf:
            self.rt.traffic.add(it, "buffers", nbuf)
        # compute waits for this stage's weights and buffers (weights up -> compute)
        ctx.compute.wait_event(staged.ready)
        ctx.compute.wait_event(ctx.record(ctx.weight_up))
        acc, hooks = self._accumulators(params, weights) if needs_grad else (None, [])
        nxt = self._plan_prefetch(len(t.microbatches))
        try:
            run = {"forward": self._forward, "fused": self._fused, "backward": self._backward}
            mbs = t.microbatches
            recomputed = call.again or (call.train and t.kind == "forward")
            for w, j in enumerate(mbs):
                mb[0] = j
                with stage_scope():
                    run[t.kind](job, j, replicas, mbs[w + 1] if w + 1 < len(mbs) else None)
                # (after each micro-batch: the failure names the one that changed it)
                _check_state(replicas, recomputed=recomputed)
                if nxt is not None:  # after the urgent activation upload
                    self._prefetch_window(nxt, w)
            mb[0] = None
            if (
                call.writes_state
                and t.kind != "backward"
                and self.host.stage_has_state(t.start, t.stop)
            ):
                self._write_buffers(job, replicas)
            if acc is not None:  # the task's last courier item: it ends the task
                self._send_grads(job, params, acc)
        finally:
            for h in hooks:
                h.remove()
            for rep in replicas:
                rep.unbind()
            self._ahead.clear()
        self._prefetch = nxt

    # ------------------------------------------------------------ weights
    def _upload_weights(self, job: Job, params: list[_Param]) -> _Staged:
        """The stage's weights, uploaded now: one copy of its arena range."""
        ctx, t = self.ctx, job.task
        version = job.call.version
        # rule 2: the master copies hold the weights this call must see
        step = version - 1
        what = f"the weight copies (P copies) of optimizer step {step}"
        with named("RP wait weights (rule 2)"), _Waiting(self, what):
            try:
                self.protocol.before_upload(job.call.window, version, params)
            except HandoffTimeout:
                # the optimizer is late (the step, or the copies after it), not a stage
                raise HandoffTimeout(
                    f"waited {self.store.timeout:g} s for {what} (window {job.call.window} "
                    f"computes with its weights): optimizer step {step} has not finished (the "
                    "step or its weight copies); the optimizer, or a call queued before it, is "
                    "slow or stuck. Raise watchdog_timeout if optimizer steps are this slow",
                    optimizer=step,
                ) from None
        span = self.host.span(t.start, t.stop)
        with ctx.on(ctx.weight_up):
            flat = torch.empty(span.nbytes, dtype=torch.uint8, device=ctx.device)
            _copy_range(flat, self.host.sources(span, version), 0, span.nbytes)
        if ctx.is_cuda:  # used by compute: not reused before those kernels ran
            flat.record_stream(ctx.compute)
        tensors = span.views(flat, self.host.compute_dtype)
        for p in span.outside:  # tied weights introduced by an earlier layer
            tensors[p.index] = ctx.upload(p.master_for(version), ctx.weight_up, fresh=True)
        ready = ctx.record(ctx.weight_up)
        self.rt.traffic.add(
            job.call.iteration, "weights_up", span.nbytes + sum(p.nbytes for p in span.outside)
        )
        self._uploaded(ready, job, params)
        return _Staged(tensors, ready)

    def _uploaded(self, ready: Any, job: Job, params: list[_Param]) -> None:
        """Rule 1 producer: once the upload is complete, this window no longer
        reads these master copies."""
        window = job.call.window

        def done() -> None:
            self.protocol.after_use(window, params)

        if self.ctx.is_cuda:
            self.courier.put(ready, done, job)
        else:
            done()

    def _plan_prefetch(self, num_windows: int) -> _Prefetch | None:
        """On CUDA, start the next queued job's weight upload: its arena range
        split into ``num_windows`` pieces, one after each micro-batch of this
        task (CPU workers copy synchronously: nothing to overlap)."""
        ctx = self.ctx
        if not ctx.is_cuda or not self.rt.prefetch:
            return None
        with self._cond:
            nxt = self._queue[0] if self._queue else None
        if nxt is None:
            return None
        t = nxt.task
        params = self.host.stage_params(t.start, t.stop)
        version = nxt.call.version
        if not params or not self.protocol.before_upload(
            nxt.call.window, version, params, block=False
        ):
            return None  # rule 2 not yet met: upload at the task's start instead
        span = self.host.span(t.start, t.stop)
        align = 512
        step = -(-span.nbytes // (num_windows * align)) * align
        bounds = [
            (a, min(a + step, span.nbytes)) for a in range(0, max(span.nbytes, 1), max(step, 1))
        ]
        with ctx.on(ctx.weight_up):
            flat = torch.empty(span.nbytes, dtype=torch.uint8, device=ctx.device)
        return _Prefetch(
            nxt,
            params,
            flat,
            self.host.sources(span, version),
            bounds,
            span.views(flat, self.host.compute_dtype),
            list(span.outside),
        )

    def _prefetch_window(self, pf: _Prefetch, w: int) -> None:
        ctx = self.ctx
        # a window follows its micro-batch's activation upload, so a large weight
        # copy never delays an urgent activation (activations up -> weights up)
        ctx.weight_up.wait_event(ctx.record(ctx.act_up))
        with ctx.on(ctx.weight_up):
            if w < len(pf.windows):
                _copy_range(pf.flat, pf.src, *pf.windows[w])
                pf.issued = w + 1
            if w == 0:
                self._upload_outside(pf)

    def _finish_prefetch(self, pf: _Prefetch) -> _Staged:
        """Windows the previous task had no micro-batch for, then the event that
        says the weights are complete."""
        ctx = self.ctx
        with ctx.on(ctx.weight_up):
            for a, b in pf.windows[pf.issued :]:
                _copy_range(pf.flat, pf.src, a, b)
            self._upload_outside(pf)
        ready = ctx.record(ctx.weight_up)
        pf.flat.record_stream(ctx.compute)
        job = pf.job
        self.rt.traffic.add(
            job.call.iteration, "weights_up", pf.flat.numel() + sum(p.nbytes for p in pf.outside)
        )
        self._uploaded(ready, job, pf.params)
        return _Staged(pf.tensors, ready)

    def _upload_outside(self, pf: _Prefetch) -> None:
        """The prefetched stage's tied weights (introduced by an earlier layer),
        each on its own, once (on the weight-upload stream)."""
        version = pf.job.call.version
        for p in pf.outside:
            if p.index not in pf.tensors:
                pf.tensors[p.index] = self.ctx.upload(
                    p.master_for(version), self.ctx.weight_up, fresh=True
                )

    # ---------------------------------------------------------- gradients
    def _accumulators(
        self, params: list[_Param], weights: dict[int, nn.Parameter]
    ) -> tuple[_Accumulator | None, list]:
        """An fp32 accumulator on the device for the stage's trainable weights,
        one flat buffer (so it goes down in one copy). Each micro-batch's
        gradient is added into it as autograd produces it, so low-precision
        gradients are summed in fp32 whatever the rounds: fp32 weights get a
        view of it as ``.grad`` (autograd adds in place); lower-precision
        weights a hook that adds their gradient in fp32 and drops it. The
        weights a backward reached are noted: the others keep no gradient (as
        under autograd, which leaves their ``.grad`` None, and optimizers skip
        them, weight decay included)."""
        train = [p for p in params if p.trainable]
        if not train:
            return None, []
        ctx = self.ctx
        sizes = [p.master.numel() for p in train]
        with ctx.on(ctx.compute):
            acc = _Accumulator(torch.zeros(sum(sizes), dtype=torch.float32, device=ctx.device))
        hooks, off = [], 0
        for p, n in zip(train, sizes, strict=True):
            view = acc.flat[off : off + n].view(p.master.shape)
            off += n
            w = weights[p.index]
            if not w.requires_grad:  # (frozen for this call: no gradient from it)
                continue
            if w.dtype == torch.float32:
                w.grad = view

                def reached(w: torch.Tensor, index: int = p.index) -> None:
                    acc.reached.add(index)

                hooks.append(w.register_post_accumulate_grad_hook(reached))
                continue

            def add(w: torch.Tensor, view: torch.Tensor = view, index: int = p.index) -> None:
                g = w.grad
                if g is not None:
                    view.add_(g.to_dense() if g.is_sparse else g)
                    acc.reached.add(index)
                w.grad = None

            hooks.append(w.register_post_accumulate_grad_hook(add))
        return acc, hooks

    def _send_grads(self, job: Job, params: list[_Param], acc: _Accumulator) -> None:
        """One download of the task's fp32 gradients; the courier adds those
        of the weights a backward reached (the others: None)."""
        ctx = self.ctx
        train = [p for p in params if p.trainable]
        # gradient downloads wait for the stage's last backward (compute -> grads down)
        ctx.grad_down.wait_event(ctx.record(ctx.compute))
        host = ctx.download(acc.flat, ctx.grad_down)
        self.rt.traffic.add(job.call.iteration, "grads_down", acc.flat.numel() * 4)
        items, off = [], 0
        for p in train:
            n = p.master.numel()
            reached = p.index in acc.reached
            items.append((p, host[off : off + n].view(p.master.shape) if reached else None))
            off += n
        self.courier.grads(ctx.record(ctx.grad_down) if ctx.is_cuda else None, job, items)

    def _write_buffers(self, job: Job, replicas: list[LayerReplica]) -> None:
        """Running statistics back to the host, then the next round may read them."""
        self.protocol.chaos("state")
        ctx = self.ctx
        ctx.act_down.wait_event(ctx.record(ctx.compute))
        copies, nbytes = [], 0
        for rep in replicas:
            for host_buf, dev_buf, keep in zip(
                rep.structure.buffers, rep.current_buffers(), rep.info.persistent, strict=True
            ):
                if keep and dev_buf is not None:
                    copies.append((host_buf, ctx.download(dev_buf, ctx.act_down)))
                    nbytes += dev_buf.numel() * dev_buf.element_size()
        self.rt.traffic.add(job.call.iteration, "buffers", nbytes)

        def write() -> None:
            with torch.no_grad():
                for host_buf, value in copies:
                    host_buf.copy_(value)
            self.rt.mark_written(job)

        if ctx.is_cuda:
            self.courier.put(ctx.record(ctx.act_down), write, job)
        else:
            write()

    # ------------------------------------------------------- activations
    def _fetch(self, job: Job, name: str, j: int) -> Any:
        return self._fetch_uploaded(job, name, j).value

    def _fetch_uploaded(self, job: Job, name: str, j: int) -> _Uploaded:
        key = job.store_key(name, j)
        up = self._ahead.pop(key) if key in self._ahead else self._upload_input(job, key, name, j)
        # compute waits for this micro-batch's inputs when it uses them, not
        # when they were uploaded ahead (activations up -> compute)
        self.ctx.compute.wait_event(up.ready)
        return up

    def _fetch_ahead(self, job: Job, j: int | None) -> None:
        """Upload micro-batch ``j``'s saved input now, while the current one
        computes (activation uploads run one micro-batch ahead), unless
        nothing is prefetched (the stage has the device's room to itself)."""
        if j is None or not self.rt.prefetch:
            return
        name = job.task.reads[0]
        key = job.store_key(name, j)
        if key not in self._ahead:
            self._ahead[key] = self._upload_input(job, key, name, j)

    def _upload_input(self, job: Job, key: Key, name: str, j: int) -> _Uploaded:
        """Take a value from the store and start its upload. A rewalked
        stage's input is kept on the host too (read ``name`` is its input),
        until the stage is done."""
        ctx = self.ctx
        self.protocol.chaos("store")
        what = f"{name} of {job.task.stage}, micro-batch {j}"
        # a reader before the last gets its own copy, made before the last
        # reader can take the value and write it in place (a CPU worker's
        # upload is the host value itself; on CUDA layers write device copies)
        copy = None if ctx.is_cuda else (lambda v: map_tensors(torch.clone, v))
        with named(f"RP wait {name} mb{j}"), _Waiting(self, what):
            host, last = self.store.take(key, what, copy)
        self.protocol.chaos("upload")
        if host is None:
            return _Uploaded(None, ctx.record(ctx.act_up))
        t_ = job.task
        dev, nbytes = self._upload_value(job, host, fresh=False)
        ready = ctx.record(ctx.act_up)
        wrote = last and job.call.train and key.kind == "act" and key.layer > 0  # (by a stage)
        held = nbytes if wrote else 0
        if _rewalked(t_) and name == t_.reads[0]:  # kept until the stage is done
            return _Uploaded(dev, ready, host, held)
        self._release(held)
        return _Uploaded(dev, ready)

    def _upload_value(self, job: Job, host: Any, fresh: bool) -> tuple[Any, int]:
        """Start the upload of a host value; returns it and its bytes."""
        ctx, nbytes = self.ctx, 0

        def up(t: torch.Tensor) -> torch.Tensor:
            nonlocal nbytes
            nbytes += t.nbytes
            return ctx.upload(t, ctx.act_up, fresh=fresh)

        dev = map_tensors(up, host)
        self.rt.traffic.add(job.call.iteration, "acts_up", nbytes)
        return dev, nbytes

    def _release(self, nbytes: int) -> None:
        """Boundary values of ``nbytes`` are no longer held on the host."""
        if nbytes:
            with self.store.lock:
                self.rt.hold(-nbytes)

    def _save(self, job: Job, name: str, j: int, value: Any, fresh: bool) -> None:
        """Write ``value`` for its readers: on CUDA a download the courier
        publishes once complete; on CPU at once. ``fresh``: the value may still
        be changed in place by the layers after it, so copy it first."""
        ctx, call = self.ctx, job.call
        key = job.store_key(name, j)
        readers = call.schedule.readers.get(key.layer, 0) if key.kind == "act" else 1
        nbytes = 0

        def down(t: torch.Tensor) -> torch.Tensor:
            nonlocal nbytes
            nbytes += t.nbytes
            return ctx.download(t.detach(), ctx.act_down)

        if fresh:  # still computed on by the stage's later layers: copy it first
            with ctx.on(ctx.compute):
                value = map_tensors(lambda t: t.detach().clone(), value)
        # the download waits for the compute that produced the value, the copy
        # included (compute -> act down)
        ctx.act_down.wait_event(ctx.record(ctx.compute))
        host = map_tensors(down, value)
        self.rt.traffic.add(call.iteration, "acts_down", nbytes)
        if key.kind == "act" and call.train:
            with self.store.lock:  # host memory the round's activations take
                self.rt.kept[call.iteration] = self.rt.kept.get(call.iteration, 0) + nbytes
                self.rt.hold(nbytes)

        def publish() -> None:
            self.protocol.chaos("download")
            self.store.put(key, host, readers)

        if ctx.is_cuda:
            self.courier.put(ctx.record(ctx.act_down), publish, job)
        else:
            publish()

    # ------------------------------------------------------------- layers
    def _layers(
        self,
        job: Job,
        j: int,
        replicas: list[LayerReplica],
        x: Any,
        save: Callable[[int, Any], None] | None = None,
        timer: LayerTimer | None = None,
        finish: Callable[[Any], Any] | None = None,
        first: int | None = None,
    ) -> Any:
        """Run ``replicas`` (the stage's layers from layer ``first``, default
        its first) on ``x``. ``finish`` (the loss) runs on the last layer's
        output as part of that layer: with its random numbers, inside its
        guard, in its measured time (a chunked loss computes the head there)."""
        job_start = job.task.start if first is None else first
        call = job.call
        last = len(replicas) - 1
        for off, rep in enumerate(replicas):
            layer = job_start + off
            self._layer, self._since = layer, time.monotonic()
            self.protocol.chaos("forward")
            seed = layer_seed(call.seed, call.iteration, layer, j)
            checkpointed = rep.checkpointed and rep.module.training
            # (from then on its backwards hold the generator: see _backward_guard)
            self._checkpointing = self._checkpointing or checkpointed
            with (
                self.ctx.on(self.ctx.compute),
                self._rng[layer](seed, rep.module.training, checkpointed),
            ):
                counting = (
                    saved_bytes(rep.module, timer.saved, layer)
                    if timer is not None and torch.is_grad_enabled()
                    else nullcontext()
                )
                with counting, self._guard():  # (bytes kept for backward: profiling only)
                    if timer is not None:
                        a = timer.watch.mark()
                    x = call_layer(rep.module, x) if self.rt.spread_values else rep.module(x)
                    if finish is not None and off == last:
                        x = finish(x)
                    if timer is not None:
                        timer.forward[layer] = (a, timer.watch.mark())
            if timer is not None and torch.is_grad_enabled():
                # this layer's backward starts when its output's gradient arrives
                first = next((v for v in flatten_tensors(x) if v.requires_grad), None)
                if first is not None:
                    first.register_hook(timer.hook(layer + 1))
            if save is not None:
                save(layer + 1, x)
        self._layer, self._since = None, time.monotonic()
        return x

    def _guard(self) -> Any:
        """Inside a layer: fail on calls that wait for the device (if asked)."""
        return forbid_host_sync(self.device) if self.rt.forbid_host_sync else nullcontext()

    def _backward_guard(self) -> Any:
        """Around autograd's backward: :meth:`_guard`, and, once a layer with
        gradient checkpointing ran here, the device's generator, which the
        checkpoint's recompute sets to the state its forward drew from."""
        if not self._checkpointing:
            return self._guard()
        stack = ExitStack()
        stack.enter_context(holding_generator(self.device))
        stack.enter_context(self._guard())
        return stack

    def _mark(self) -> Any:
        trace = self.rt.trace
        return None if trace is None else trace.mark(self.device, self.ctx.compute)

    def _record(self, job: Job, j: int, kind: str, start: Any) -> None:
        trace = self.rt.trace
        if trace is not None and start is not None:
            t = job.task
            trace.add(
                self.index,
                self.device,
                job.call.iteration,
                str(t),
                t.stage,
                j,
                kind,
                start,
                trace.mark(self.device, self.ctx.compute),
            )

    def _forward(self, job: Job, j: int, replicas: list[LayerReplica], nxt: int | None) -> None:
        t = job.task
        x = self._fetch(job, t.reads[0], j)
        writes = set(t.writes)

        def save(boundary: int, value: Any) -> None:
            name = f"act{boundary}"
            if boundary < t.stop and name in writes:  # inside the stage: still computed on
                self._save(job, name, j, value, fresh=True)

        timer = self._timer(job)
        mark = self._mark()
        with torch.no_grad():
            out = self._layers(job, j, replicas, x, save, timer)
        self._record(job, j, "F", mark)
        self._report(job, timer)
        if f"act{t.stop}" in writes:
            self._save(job, f"act{t.stop}", j, out, fresh=False)
        self._fetch_ahead(job, nxt)

    def _leaves(self, x: Any, copy: bool = True) -> tuple[Any, list[torch.Tensor | None]]:
        """The stage input as autograd leaves (whose ``.grad`` is the input
        gradient) and, for the layers, with ``copy`` a copy of each: a first
        layer that writes its input in place (``ReLU(inplace=True)``,
        ``x.mul_()``) is then legal, as it is in the unsplit model, and never
        changes the leaf. Without (a layer that declares ``input_intact``):
        the leaves themselves, one stage input on the device instead of two."""
        flat: list[torch.Tensor | None] = []

        def leaf(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if t.is_floating_point() or t.is_complex():
                t.requires_grad_(True)
                flat.append(t)
                return t.clone() if copy else t
            flat.append(None)
            return t

        with torch.enable_grad(), self.ctx.on(self.ctx.compute):
            return map_tensors(leaf, x), flat

    def _input_grad(self, job: Job, j: int, leaves: list) -> None:
        t = job.task
        if t.start == 0 and not job.call.input_grad:
            return
        name = f"grad{t.start}"
        job.names.setdefault(name, ("grad", t.start))  # grad0: for the caller
        self._save(job, name, j, _grads(leaves), fresh=False)

    def _first_pass(
        self, job: Job, j: int, replicas: list[LayerReplica]
    ) -> tuple[list[Any] | _Rewalk, int]:
        """The stage input's value(s) (:class:`~lightning_roundpipe.plan.stages.StagePlan`),
        and the host bytes to release once the stage is done. A layered
        stage starts with its layers but the top one forward without
        autograd, each on a copy of its input (a layer may write its input
        in place), and keeps every layer's input for the recompute one layer
        at a time; a rewalked one keeps none but computes each when its turn
        comes (:class:`_Rewalk`). Without layering: just the stage input."""
        t = job.task
        if _rewalked(t):
            up = self._fetch_uploaded(job, t.reads[0], j)
            first, up.value = [up.value], None  # (the first walk's: uploaded, maybe ahead)

            def walk(n: int) -> Any:
                # layers run on a copy of the stage input: on a CPU worker its
                # upload is the host value itself, which the next walk reads
                if first:
                    x = first.pop()
                    if n > 0 and not self.ctx.is_cuda:
                        x = map_tensors(torch.clone, x)
                else:
                    x = self._upload_again(job, up.host, fresh=n > 0)
                with torch.no_grad():
                    for off, rep in enumerate(replicas[:n]):
                        x = self._layer_again(job, j, rep, x, t.start + off, copy=False)
                return x

            return _Rewalk(len(replicas), walk), up.held
        inputs = [self._fetch(job, t.reads[0], j)]
        if not t.layered or len(replicas) < 2:
            return inputs, 0
        with torch.no_grad():
            for off, rep in enumerate(replicas[:-1]):
                inputs.append(self._layer_again(job, j, rep, inputs[-1], t.start + off, copy=True))
        return inputs, 0

    def _layer_again(
        self, job: Job, j: int, rep: LayerReplica, x: Any, layer: int, copy: bool
    ) -> Any:
        """Layer ``layer`` forward once more (autograd as the caller has it),
        on a copy of ``x`` if ``copy``, with its buffers put back afterwards:
        running statistics count the recompute's update only, as in a stage
        that is not layered."""
        with self.ctx.on(self.ctx.compute):
            value = map_tensors(torch.clone, x) if copy else x
            buffers = [b.clone() for b in rep.current_buffers()]
        out = self._layers(job, j, [rep], value, first=layer)
        rep.restore_buffers(buffers)
        return out

    def _upload_again(self, job: Job, host: Any, fresh: bool) -> Any:
        """A rewalked stage's input uploaded once more; compute waits for it."""
        ctx = self.ctx
        value, _ = self._upload_value(job, host, fresh=fresh)
        ctx.compute.wait_event(ctx.record(ctx.act_up))
        return value

    def _top_input(
        self, job: Job, inputs: list[Any], replicas: list[LayerReplica]
    ) -> tuple[int, Any, list]:
        """Where the autograd part of a stage starts (its first layer, or a
        layered stage's top one), its input and that input's leaves."""
        t = job.task
        base = t.start + len(inputs) - 1
        value = inputs.pop()
        if base > 0 or job.call.input_grad:  # the layer below (or the caller) needs its gradient
            first = replicas[base - t.start].module
            return (base, *self._leaves(value, copy=not getattr(first, "input_intact", False)))
        return base, value, []

    def _differentiate(self, out: Any, g: list, timer: LayerTimer | None, boundary: int) -> None:
        """Backward from ``out`` with the gradient ``g`` of its tensors (the
        output of the layers below ``boundary``); ``g`` is emptied, so that
        autograd frees each gradient once used (:func:`backward_handing_over`)."""
        # (a comprehension: no loop variable is left holding a gradient)
        pairs = [(o, gg) for o, gg in zip(flatten_tensors(out), g, strict=True)]
        outs = [o for o, gg in pairs if gg is not None and o.requires_grad]
        grads = [gg for o, gg in pairs if gg is not None and o.requires_grad]
        del pairs
        if isinstance(g, list):  # (the caller's: autograd is to hold the gradients alone)
            g.clear()
        if outs:
            if len(outs) == 1:
                release_output(outs[0])  # (one output: no other reads it)
            with self.ctx.on(self.ctx.compute):
                if timer is not None:
                    timer.boundary[boundary] = timer.watch.mark()
                self.protocol.chaos("backward")
                with self._backward_guard():
                    backward_handing_over(outs, grads)

    def _descend(
        self,
        job: Job,
        j: int,
        replicas: list[LayerReplica],
        inputs: list[Any],
        upper: list[list],
        timer: LayerTimer | None,
    ) -> list:
        """The rest of a layered stage below its top layer: from the top down,
        each layer recomputed from the input its first pass kept, with
        autograd, and differentiated at once (one layer's autograd state on
        the device at a time). ``upper``: the top layer's input leaves, in a
        list this pops (so that nothing else keeps them and their gradients
        alive). Returns the stage input's leaves."""
        t = job.task
        leaves = upper.pop()
        while inputs:
            g = _grads(leaves)
            # the layer above's input goes before the next one is made (a
            # rewalked stage computes it now)
            leaves = None
            layer, x, leaves = self._top_input(job, inputs, replicas)
            with torch.enable_grad():
                rep = replicas[layer - t.start : layer - t.start + 1]
                out = self._layers(job, j, rep, x, timer=timer, first=layer)
                del x
                start = timer.watch.mark() if timer is not None else None
                self._differentiate(out, g, None, layer + 1)
            del out, g
            if timer is not None:  # this layer's backward alone (not the recompute below)
                timer.backward[layer] = (start, timer.watch.mark())
        return leaves

    def _fused(self, job: Job, j: int, replicas: list[LayerReplica], nxt: int | None) -> None:
        t, call = job.task, job.call
        mark = self._mark()
        inputs, held = self._first_pass(job, j, replicas)
        base, x, leaves = self._top_input(job, inputs, replicas)
        timer = self._timer(job, leaves, base)
        labels, loss_fn, finish = call.labels[j], call.loss_fn, None
        if loss_fn is not None:
            if labels is not None:
                ctx = self.ctx
                labels = map_tensors(lambda v: ctx.upload(v, ctx.act_up), labels)
                ctx.compute.wait_event(ctx.record(ctx.act_up))  # labels up -> compute

            def finish(out: Any) -> Any:
                return loss_fn(out, labels)

        with torch.enable_grad():
            top = replicas[base - t.start :]
            loss = self._layers(job, j, top, x, timer=timer, finish=finish, first=base)
            del x
            kept = None
            with self.ctx.on(self.ctx.compute), self._guard():
                if call.with_outputs:
                    if not isinstance(loss, tuple) or len(loss) != 2:
                        raise TypeError(
                            "with with_outputs=True, loss_fn must return (loss, output), got "
                            f"{type(loss).__name__}"
                        )
                    loss, kept = loss
                    # (a copy: nothing computed later may change it in place)
                    kept = map_tensors(lambda v: v.detach().clone(), kept)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    what = (
                        type(loss).__name__
                        if not isinstance(loss, torch.Tensor)
                        else (f"a tensor of shape {tuple(loss.shape)}")
                    )
                    src = "loss_fn" if call.loss_fn is not None else "the last layer"
                    raise TypeError(
                        f"{src} must return a scalar loss tensor, got {what}; pass loss_fn= or "
                        "make the last layer return the loss"
                    )
                weighted = loss.reshape(()) * call.weights[j]
                value = weighted.detach().float()
                self._save(job, "loss", j, value if kept is None else (value, kept), fresh=False)
                self._record(job, j, "F", mark)
                mark = self._mark()
                if timer is not None:
                    timer.boundary[t.stop] = timer.watch.mark()  # the loss's backward
                if weighted.requires_grad:  # False only when nothing below is trainable
                    self.protocol.chaos("backward")
                    # in fp32: an fp16 loss times a 2^16 loss scale would overflow
                    with self._backward_guard():
                        (weighted.float() * call.scale).backward()
            del loss, weighted, kept
        if inputs:
            box, leaves = [leaves], []
            leaves = self._descend(job, j, replicas, inputs, box, timer)
        self._release(held)
        self._record(job, j, "B", mark)
        self._report(job, timer)
        self._input_grad(job, j, leaves)
        self._fetch_ahead(job, nxt)

    def _backward(self, job: Job, j: int, replicas: list[LayerReplica], nxt: int | None) -> None:
        t = job.task
        mark = self._mark()
        inputs, held = self._first_pass(job, j, replicas)
        base, x, leaves = self._top_input(job, inputs, replicas)
        timer = self._timer(job, leaves, base)
        with torch.enable_grad():
            # recompute from the saved input: it is there long before the gradient
            out = self._layers(job, j, replicas[base - t.start :], x, timer=timer, first=base)
            del x
            self._record(job, j, "R", mark)
            if not inputs:  # the next input goes up meanwhile (a layered
                self._fetch_ahead(job, nxt)  # stage: once its layers are done)
            g = self._fetch(job, t.reads[1], j)
            mark = self._mark()
            self._differentiate(out, g, timer, t.stop)
            del out, g
        if inputs:
            box, leaves = [leaves], []
            leaves = self._descend(job, j, replicas, inputs, box, timer)
            self._fetch_ahead(job, nxt)
        self._release(held)
        self._record(job, j, "B", mark)
        self._report(job, timer)
        self._input_grad(job, j, leaves)

    # ------------------------------------------------------------ profiling
    def _timer(
        self, job: Job, leaves: list | None = None, start: int | None = None
    ) -> LayerTimer | None:
        if job.call.profiler is None:
            return None
        timer = LayerTimer(Stopwatch(self.ctx.is_cuda, self.ctx.compute))
        first = next((v for v in leaves or () if v is not None), None)
        if first is not None:  # the backward from ``start`` up ends when its input gradient arrives
            first.register_hook(timer.hook(job.task.start if start is None else start))
        return timer

    def _report(self, job: Job, timer: LayerTimer | None) -> None:
        if timer is None:
            return
        t = job.task
        if t.kind != "forward" and t.start not in timer.boundary:
            timer.boundary[t.start] = timer.watch.mark()  # nothing below: backward is done
        fwd, bwd = timer.samples(t.start, t.stop)
        job.call.profiler.add(job.call.iteration, fwd, bwd, timer.saved)
        if not self.ctx.is_cuda:
            self._layers_cpu += timer.layers_cpu(t.start, t.stop)


def _message(exc: BaseException) -> str:
    """``str(exc)``, or, where that itself raises (a user's exception class
    whose ``__str__`` fails), its ``repr`` or at least a note: the failure
    still reaches the user at once, not after the watchdog."""
    for show in (str, repr):
        try:
            return show(exc)
        except Exception:
            continue
    return "(its message could not be formatted)"

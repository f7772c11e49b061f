"""Device workers: one thread per device entry, running dispatched stage slots.

A worker runs its tasks in dispatch order. For a task (one stage slot for the
micro-batches of one round) it uploads the stage's weights, binds them into
its private layer replicas, runs every micro-batch, and sends the results to
the activation store:

* forward stage: ``no_grad`` forward; saves the input of every layer where a
  later stage starts, and the stage output;
* fused stage: forward with autograd, loss, backward; saves the loss and the
  gradient of the stage input;
* backward stage: recompute from the saved input, backward from the saved
  output gradient; saves the gradient of the stage input.

Weight gradients accumulate on the device over the round's micro-batches and
are added into the host fp32 buffers once at the end of the task.

CUDA ordering (no-ops on CPU devices): the compute stream waits for the weight
upload event and for each micro-batch's activation upload event; activation
downloads wait for the compute event of their micro-batch and are published
one micro-batch behind, so the thread never stalls the compute stream; the
next micro-batch's input is uploaded while the current one computes.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..plan.stages import Stage
from ..plan.windows import transfer_windows
from .device import DeviceContext, layer_seed, seeded
from .host import HostState, LayerReplica
from .nested import call_layer, flatten_tensors, map_tensors
from .optimizer import Protocol
from .profiler import LayerTimer, Profiler, Stopwatch, saved_bytes
from .store import EngineFailure, HandoffTimeout, Store

__all__ = ["Layout", "Task", "Worker", "WorkerError"]

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class Layout:
    """Who reads which stage-boundary value, derived from a stage plan."""

    act_readers: dict[int, int]  # layer index -> readers of its input activation
    saves: dict[int, tuple[int, ...]]  # forward slot -> boundaries strictly inside it to save

    @classmethod
    def of(cls, stages: Sequence[Stage], output_readers: int = 0) -> Layout:
        """``output_readers``: readers of the last layer's output (the
        controller, for forward-only runs)."""
        readers: dict[int, int] = {}
        for st in stages:
            readers[st.start] = readers.get(st.start, 0) + 1
        if output_readers:
            top = max(st.stop for st in stages)
            readers[top] = readers.get(top, 0) + output_readers
        saves = {
            st.index: tuple(i for i in range(st.start + 1, st.stop) if i in readers)
            for st in stages
            if st.kind == "forward"
        }
        return cls(readers, saves)


@dataclass
class Call:
    """What one ``forward_backward`` call asks of every task of its iteration."""

    iteration: int
    window: int
    labels: list[Any]
    weights: list[float]
    loss_fn: Callable[..., torch.Tensor] | None
    scale: float
    seed: int
    layout: Layout
    profiler: Profiler | None = None  # set while this iteration is being profiled
    dispatch: Any = None  # the iteration's DispatchPlan, for error messages


@dataclass
class Task:
    """One dispatched slot: ``stage`` for micro-batches ``microbatches``."""

    call: Call
    round: int
    stage: Stage
    microbatches: range
    after: tuple | None = None  # task key that must be done first (buffer updates)
    keep_buffers: bool = True  # write running statistics back (not for forward-only runs)
    step: int = -1  # index in the iteration's dispatch plan
    key: tuple = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.call.iteration, self.round, self.stage.index)


@dataclass
class _Prefetch:
    """The next task's weights, being uploaded window by window."""

    key: tuple
    tensors: dict[int, torch.Tensor]
    pieces: list[list[tuple[Any, int, int]]]  # per window: (param, first element, count)


class Worker:
    """One device worker thread."""

    def __init__(
        self,
        index: int,
        device: torch.device,
        host: HostState,
        store: Store,
        on_done: Callable[[Task], None],
        is_done: Callable[[tuple], bool],
        protocol: Protocol,
    ) -> None:
        self.index = index
        self.protocol = protocol
        self.device = device
        self.host = host
        self.store = store
        self._on_done = on_done
        self._is_done = is_done
        self._queue: deque[Task | None] = deque()
        self._cond = threading.Condition()
        self._replicas: dict[int, LayerReplica] = {}
        self._prefetched: dict[tuple, tuple[dict[int, torch.Tensor], Any]] = {}
        self._ahead: dict[tuple, Any] = {}  # inputs uploaded one micro-batch ahead
        self.ctx: DeviceContext | None = None
        self._layer: int | None = None  # the layer running now, for error messages
        self.thread = threading.Thread(
            target=self._main, name=f"roundpipe-worker-{index}-{device}", daemon=True
        )

    # ------------------------------------------------------------ queueing
    def start(self) -> None:
        self.thread.start()

    def submit(self, task: Task | None) -> None:
        with self._cond:
            self._queue.append(task)
            self._cond.notify()

    def stop(self) -> None:
        """Ask the thread to finish after the tasks already queued."""
        self.submit(None)

    def _next(self) -> Task | None:
        with self._cond:
            while not self._queue:
                if self.store.failure is not None:
                    return None
                self._cond.wait(0.5)
            return self._queue.popleft()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ---------------------------------------------------------------- main
    def _main(self) -> None:
        task: Task | None = None
        mb: list[int | None] = [None]
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self.ctx = DeviceContext(self.device)
            while True:
                task = self._next()
                if task is None or self.store.failure is not None:
                    break
                mb[0] = None
                self._layer = None
                self._run(task, mb)
                self._on_done(task)
        except (EngineFailure, HandoffTimeout) as exc:
            if isinstance(exc, HandoffTimeout):
                self.store.fail(self._wrap(exc, task, mb[0]))
        except BaseException as exc:  # every failure must reach the caller
            self.store.fail(self._wrap(exc, task, mb[0]))
        finally:
            for rep in self._replicas.values():
                rep.unbind()
            self._replicas.clear()
            self._prefetched.clear()
            self._ahead.clear()

    def _wrap(self, exc: BaseException, task: Task | None, mb: int | None) -> WorkerError:
        if task is None:
            err = WorkerError(
                f"device {self.device} (worker {self.index}) failed before running a stage: "
                f"{type(exc).__name__}: {exc}",
                device=str(self.device),
                worker=self.index,
                stage="-",
                layers=(0, 0),
                microbatch=None,
                iteration=-1,
            )
        else:
            st = task.stage
            where = "" if self._layer is None else f", layer {self._layer}"
            where += "" if mb is None else f", micro-batch {mb}"
            extra = ""
            if isinstance(exc, torch.OutOfMemoryError):
                extra = self._oom_advice(st)
            if isinstance(exc, HandoffTimeout) and task.call.dispatch is not None:
                extra = "\n" + task.call.dispatch.grid(mark=task.step if task.step >= 0 else None)
            err = WorkerError(
                f"device {self.device} (worker {self.index}) failed in stage {st.label} "
                f"(layers {st.start}-{st.stop - 1}, {st.kind}){where}, round {task.round}, "
                f"iteration {task.call.iteration}: {type(exc).__name__}: {exc}{extra}",
                device=str(self.device),
                worker=self.index,
                stage=st.label,
                layers=(st.start, st.stop),
                microbatch=mb,
                iteration=task.call.iteration,
            )
        err.__cause__ = exc
        return err

    def _oom_advice(self, st: Stage) -> str:
        try:
            return self._oom_text(st)
        except Exception:  # advice must never hide the error itself
            return ""

    def _oom_text(self, st: Stage) -> str:
        params = self.host.stage_params(st.start, st.stop)
        need = sum(
            p.master.numel() * p.master.element_size() * (2 if p.trainable else 1) for p in params
        )
        if self.device.type == "cuda":
            free = f"{torch.cuda.mem_get_info(self.device)[0] / 2**30:.2f} GiB free"
        else:
            free = "host memory"
        return (
            f". Stage {st.label} needs about {need / 2**30:.2f} GiB for weights and gradients "
            f"plus activations; the device has {free}. Raise num_microbatches (smaller "
            "micro-batches), lower device_memory_limit so the partitioner cuts smaller stages, "
            "or give a plan with smaller stages"
        )

    # ---------------------------------------------------------------- task
    def _replica(self, layer: int) -> LayerReplica:
        rep = self._replicas.get(layer)
        if rep is None:
            rep = self._replicas[layer] = LayerReplica(self.host.layers[layer], self.host.params)
        return rep

    def _run(self, task: Task, mb: list[int | None]) -> None:
        st = task.stage
        if task.after is not None:
            # buffer updates (running statistics) of the previous round of this
            # slot must have reached the host before this round uploads them
            self.store.wait_until(
                lambda: self._is_done(task.after),
                f"stage {st.label} of the previous round (buffer hand-off)",
            )
        needs_grad = st.kind != "forward"
        params = self.host.stage_params(st.start, st.stop)
        try:
            self._run_stage(task, mb, params, needs_grad)
        finally:
            # rule 1 producer: this task no longer reads these master copies
            self.protocol.after_use(task.call.window, params)

    def _run_stage(self, task: Task, mb: list[int | None], params: list, needs_grad: bool) -> None:
        ctx, st = self.ctx, task.stage
        staged = self._prefetched.pop(task.key, None)
        if staged is None:
            # rule 2: the master copies hold this window's weights
            self.protocol.before_upload(task.call.window, params)
        if staged is None:
            staged = {p.index: ctx.upload(p.master, ctx.weight_up) for p in params}
            ready = ctx.record(ctx.weight_up)
        else:
            staged, ready = staged
            for t in staged.values():
                t.record_stream(ctx.compute)
        weights = {
            p.index: nn.Parameter(staged[p.index], requires_grad=needs_grad and p.trainable)
            for p in params
        }
        del staged
        replicas = [self._replica(i) for i in range(st.start, st.stop)]
        for rep in replicas:
            bufs = [ctx.upload(b, ctx.weight_up, fresh=True) for b in rep.info.buffers]
            rep.bind(weights, bufs)
        # compute waits for this stage's weights (weights up -> compute)
        ctx.compute.wait_event(ready)
        ctx.compute.wait_event(ctx.record(ctx.weight_up))  # and its buffers
        prefetch = self._plan_prefetch(len(task.microbatches))
        try:
            pending: list[tuple[Any, tuple, Any, int]] = []
            run = {"forward": self._forward, "fused": self._fused, "backward": self._backward}
            mbs = task.microbatches
            for w, j in enumerate(mbs):
                mb[0] = j
                run[st.kind](task, j, replicas, pending)
                # on CUDA publish the previous micro-batch's downloads, one behind,
                # so this thread never waits on a copy queued behind running compute
                self._publish(pending, keep_last=ctx.is_cuda)
                if w + 1 < len(mbs):
                    mb[0] = mbs[w + 1]
                    self._fetch_ahead(task, mbs[w + 1])
                if prefetch is not None:  # after the urgent activation upload
                    self._prefetch_window(prefetch, w)
            self._publish(pending, keep_last=False)
            mb[0] = None
            if needs_grad:
                self._download_grads(task.call.window, params, weights)
            if (
                task.keep_buffers
                and st.kind != "backward"
                and self.host.stage_has_state(st.start, st.stop)
            ):
                self._download_buffers(replicas)
        finally:
            for rep in replicas:
                rep.unbind()
            if prefetch is not None:
                # weights of the next task are complete once the last window is
                # (weights up -> next task's compute)
                self._prefetched[prefetch.key] = (prefetch.tensors, ctx.record(ctx.weight_up))

    # ------------------------------------------------------------ prefetch
    def _plan_prefetch(self, num_windows: int) -> _Prefetch | None:
        """On CUDA, plan the upload of the next queued task's weights in
        ``num_windows`` LPT windows, one after each micro-batch of this task."""
        ctx = self.ctx
        if not ctx.is_cuda:
            return None  # CPU workers compute on the master copy itself
        with self._cond:
            nxt = self._queue[0] if self._queue else None
        if nxt is None or nxt.key in self._prefetched:
            return None
        params = self.host.stage_params(nxt.stage.start, nxt.stage.stop)
        if not params or not self.protocol.before_upload(nxt.call.window, params, block=False):
            return None  # rule 2 not yet met: upload at the task's start instead
        size = params[0].master.element_size()
        wins = transfer_windows(
            [(str(p.index), p.master.numel() * size) for p in params], num_windows, align=size
        )
        with ctx.on(ctx.weight_up):
            tensors = {
                p.index: torch.empty(p.master.shape, dtype=p.master.dtype, device=ctx.device)
                for p in params
            }
        by_index = {p.index: p for p in params}
        pieces = [
            [(by_index[int(pc.name)], pc.offset // size, pc.nbytes // size) for pc in w.pieces]
            for w in wins
        ]
        return _Prefetch(nxt.key, tensors, pieces)

    def _prefetch_window(self, pf: _Prefetch, w: int) -> None:
        ctx = self.ctx
        # a window follows its micro-batch's activation upload, so a large weight
        # copy never delays an urgent activation (activations up -> weights up)
        ctx.weight_up.wait_event(ctx.record(ctx.act_up))
        with ctx.on(ctx.weight_up):
            for p, start, count in pf.pieces[w]:
                dst = pf.tensors[p.index].view(-1)[start : start + count]
                dst.copy_(p.master.view(-1)[start : start + count], non_blocking=True)

    def _publish(self, pending: list, keep_last: bool) -> None:
        """Publish completed downloads: ``(event, key, value, readers)``.

        With ``keep_last`` the newest micro-batch's entries stay pending (its
        copy was just queued behind its compute)."""
        if not pending:
            return
        last_mb = pending[-1][1][3]
        keep = [e for e in pending if keep_last and e[1][3] == last_mb]
        for ev, key, value, readers in pending:
            if keep_last and key[3] == last_mb:
                continue
            ev.synchronize()  # host copy complete: safe to hand to other workers
            self.protocol.chaos("download")
            self.store.put(key, value, readers)
        pending[:] = keep

    @staticmethod
    def _inputs(task: Task, j: int) -> list[tuple[tuple, str]]:
        """Store keys a micro-batch of ``task`` reads, with what they are."""
        st, it = task.stage, task.call.iteration
        keys = [((it, "act", st.start, j), f"input of {st.label}, micro-batch {j}")]
        if st.kind == "backward":
            keys.append(
                ((it, "grad", st.stop, j), f"output gradient of {st.label}, micro-batch {j}")
            )
        return keys

    def _fetch_ahead(self, task: Task, j: int) -> None:
        """Upload micro-batch ``j``'s inputs now, while the previous micro-batch
        computes (activation uploads run one micro-batch ahead)."""
        for key, what in self._inputs(task, j):
            self._ahead[key] = self._upload_input(key, what)

    def _fetch(self, key: tuple, what: str) -> Any:
        if key in self._ahead:
            return self._ahead.pop(key)
        return self._upload_input(key, what)

    def _upload_input(self, key: tuple, what: str) -> Any:
        ctx = self.ctx
        self.protocol.chaos("store")
        host, last = self.store.take(key, what)
        self.protocol.chaos("upload")
        if host is None:
            return None
        # a reader before the last gets its own copy, in case a layer writes in place
        dev = map_tensors(lambda t: ctx.upload(t, ctx.act_up, fresh=not last), host)
        # compute waits for this micro-batch's activations (activations up -> compute)
        ctx.compute.wait_event(ctx.record(ctx.act_up))
        return dev

    def _save(self, pending: list, key: tuple, value: Any, readers: int, fresh: bool) -> None:
        ctx = self.ctx
        # the download waits for the compute that produced the value (compute -> act down)
        ctx.act_down.wait_event(ctx.record(ctx.compute))

        def down(t: torch.Tensor) -> torch.Tensor:
            out = ctx.download(t.detach(), ctx.act_down)
            return out.clone() if fresh and not ctx.is_cuda else out

        host = map_tensors(down, value)
        pending.append((ctx.record(ctx.act_down), key, host, readers))

    def _layers(
        self,
        task: Task,
        j: int,
        replicas: list[LayerReplica],
        x: Any,
        save: Callable[[int, Any], None] | None = None,
        timer: LayerTimer | None = None,
    ) -> Any:
        st = task.stage
        for off, rep in enumerate(replicas):
            layer = st.start + off
            self._layer = layer
            self.protocol.chaos("forward")
            with (
                self.ctx.on(self.ctx.compute),
                seeded(self.device, layer_seed(task.call.seed, task.call.iteration, layer, j)),
            ):
                # marks inside the RNG lock: waiting for it is not the layer's time
                counting = (
                    saved_bytes(rep.module, timer.saved, layer)
                    if timer is not None and torch.is_grad_enabled()
                    else nullcontext()
                )
                with counting:  # activation bytes kept for backward (profiling only)
                    if timer is not None:
                        a = timer.watch.mark()
                    x = call_layer(rep.module, x)
                    if timer is not None:
                        timer.forward[layer] = (a, timer.watch.mark())
            if timer is not None and torch.is_grad_enabled():
                # this layer's backward starts when its output's gradient arrives
                first = next((t for t in flatten_tensors(x) if t.requires_grad), None)
                if first is not None:
                    first.register_hook(timer.hook(layer + 1))
            if save is not None:
                save(layer + 1, x)
        self._layer = None
        return x

    def _forward(self, task: Task, j: int, replicas: list[LayerReplica], pending: list) -> None:
        st, it = task.stage, task.call.iteration
        x = self._fetch(*self._inputs(task, j)[0])
        inner = set(task.call.layout.saves.get(st.index, ()))

        def save(boundary: int, value: Any) -> None:
            if boundary in inner:
                readers = task.call.layout.act_readers[boundary]
                self._save(pending, (it, "act", boundary, j), value, readers, fresh=True)

        timer = self._timer(task)
        with torch.no_grad():
            out = self._layers(task, j, replicas, x, save, timer)
        self._report(task, timer)
        readers = task.call.layout.act_readers.get(st.stop, 0)
        if readers:
            self._save(pending, (it, "act", st.stop, j), out, readers, fresh=False)

    @staticmethod
    def _leaves(x: Any) -> tuple[Any, list[torch.Tensor | None]]:
        flat: list[torch.Tensor | None] = []

        def leaf(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if t.is_floating_point() or t.is_complex():
                t.requires_grad_(True)
                flat.append(t)
            else:
                flat.append(None)
            return t

        return map_tensors(leaf, x), flat

    def _input_grad(self, task: Task, j: int, leaves: list, pending: list) -> None:
        st, it = task.stage, task.call.iteration
        if st.start == 0:
            return
        grads = [None if t is None else t.grad for t in leaves]
        self._save(pending, (it, "grad", st.start, j), grads, 1, fresh=False)

    def _fused(self, task: Task, j: int, replicas: list[LayerReplica], pending: list) -> None:
        st, call = task.stage, task.call
        it = call.iteration
        x = self._fetch(*self._inputs(task, j)[0])
        x, leaves = self._leaves(x) if st.start > 0 else (x, [])
        timer = self._timer(task, leaves)
        with torch.enable_grad():
            out = self._layers(task, j, replicas, x, timer=timer)
            labels = call.labels[j]
            if call.loss_fn is not None and labels is not None:
                ctx = self.ctx
                labels = map_tensors(lambda t: ctx.upload(t, ctx.act_up), labels)
                ctx.compute.wait_event(ctx.record(ctx.act_up))  # labels up -> compute
            with self.ctx.on(self.ctx.compute):
                loss = out if call.loss_fn is None else call.loss_fn(out, labels)
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
                self._save(pending, (it, "loss", 0, j), weighted.detach().float(), 1, False)
                if timer is not None:
                    timer.boundary[st.stop] = timer.watch.mark()  # the loss's backward
                if weighted.requires_grad:  # False only when nothing below is trainable
                    self.protocol.chaos("backward")
                    # in fp32: an fp16 loss times a 2^16 loss scale would overflow
                    (weighted.float() * call.scale).backward()
        self._report(task, timer)
        self._input_grad(task, j, leaves, pending)

    def _backward(self, task: Task, j: int, replicas: list[LayerReplica], pending: list) -> None:
        st = task.stage
        (xk, xw), (gk, gw) = self._inputs(task, j)
        x, g = self._fetch(xk, xw), self._fetch(gk, gw)
        x, leaves = self._leaves(x) if st.start > 0 else (x, [])
        timer = self._timer(task, leaves)
        with torch.enable_grad():
            out = self._layers(task, j, replicas, x, timer=timer)
            outs, grads = [], []
            for o, gg in zip(flatten_tensors(out), g, strict=True):
                if gg is not None and o.requires_grad:
                    outs.append(o)
                    grads.append(gg)
            if outs:
                with self.ctx.on(self.ctx.compute):
                    if timer is not None:
                        timer.boundary[st.stop] = timer.watch.mark()
                    self.protocol.chaos("backward")
                    torch.autograd.backward(outs, grads)
        self._report(task, timer)
        self._input_grad(task, j, leaves, pending)

    # ------------------------------------------------------------ profiling
    def _timer(self, task: Task, leaves: list | None = None) -> LayerTimer | None:
        if task.call.profiler is None:
            return None
        timer = LayerTimer(Stopwatch(self.ctx.is_cuda, self.ctx.compute))
        first = next((t for t in leaves or () if t is not None), None)
        if first is not None:  # the stage's backward ends when its input's gradient arrives
            first.register_hook(timer.hook(task.stage.start))
        return timer

    def _report(self, task: Task, timer: LayerTimer | None) -> None:
        if timer is None:
            return
        st = task.stage
        if st.kind != "forward" and st.start not in timer.boundary:
            timer.boundary[st.start] = timer.watch.mark()  # nothing below: backward is done
        fwd, bwd = timer.samples(st.start, st.stop)
        task.call.profiler.add(task.call.iteration, fwd, bwd, timer.saved)

    def _download_grads(self, window: int, params: list, weights: dict[int, nn.Parameter]) -> None:
        ctx = self.ctx
        # gradient downloads wait for the stage's last backward (compute -> grads down)
        ctx.grad_down.wait_event(ctx.record(ctx.compute))
        out = []
        for p in params:
            w = weights[p.index]
            if p.trainable:
                g = w.grad
                out.append((p, None if g is None else ctx.download(g, ctx.grad_down)))
            w.grad = None
        ctx.record(ctx.grad_down).synchronize()  # host copies complete before accumulating
        for p, g in out:
            if g is not None:
                self.protocol.before_grad(window, p)  # rule 4: buffer emptied by the G copy
                self.host.accumulate(p, g)
            self.protocol.after_grad(window, p)  # rule 3 producer

    def _download_buffers(self, replicas: list[LayerReplica]) -> None:
        ctx = self.ctx
        ctx.act_down.wait_event(ctx.record(ctx.compute))
        copies = []
        for rep in replicas:
            for host_buf, dev_buf, keep in zip(
                rep.info.buffers, rep.current_buffers(), rep.info.persistent, strict=True
            ):
                if keep and dev_buf is not None:
                    copies.append((host_buf, ctx.download(dev_buf, ctx.act_down)))
        ctx.record(ctx.act_down).synchronize()
        with torch.no_grad():
            for host_buf, value in copies:
                host_buf.copy_(value)

"""Command line for the planning layer.

``python -m lightning_roundpipe.plan partition ...`` prints the partitioner's
plan; ``python -m lightning_roundpipe.plan simulate ...`` prints a bubble table
for one or more schedules and can write timeline PNGs (RoundPipe with the
plan and round size the runtime would choose, unless ``--plan`` and
``--round-size`` fix them);
``python -m lightning_roundpipe.plan estimate CONFIG --gpu-memory 80 ...``
prints the plan, memory, longest sequence and simulated throughput of a
Hugging Face causal LM (it needs torch and transformers, imported only then);
with ``--servers N`` also the gradient all-reduce between servers over a
``--network-gbps`` link and the throughput of all servers together. Costs
come inline (``--forward 0.1,1x12,3 --backward 0.2,2x12,6``; ``VxK`` repeats
``V`` ``K`` times) or from a JSON file (``--costs costs.json`` with
``forward``, ``backward`` and optionally ``memory`` lists).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from .costs import LayerCosts, PlanError
from .partition import LayerTooLarge, partition
from .simulate import SCHEDULES, SimulationResult, check_within_limit, simulate
from .stages import StagePlan

__all__ = ["main"]


def _numbers(text: str) -> list[float]:
    out: list[float] = []
    tokens = [tok.strip() for tok in text.split(",")]
    if not any(tokens):
        return out
    for tok in tokens:
        if not tok:
            raise argparse.ArgumentTypeError(
                f"{text!r} has an empty entry: give one number or VALUExCOUNT between "
                "each pair of commas"
            )
        value, _, count = tok.partition("x")
        try:
            v = float(value)
            k = int(count) if count else 1
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{tok!r} is not a number or VALUExCOUNT (e.g. 1.5 or 2x12)"
            ) from None
        if k < 1:
            raise argparse.ArgumentTypeError(
                f"{tok!r}: the COUNT of VALUExCOUNT must be an integer >= 1"
            )
        out.extend([v] * k)
    return out


def _positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a number of ``kind`` above zero (argparse names the
    flag in its error)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        # (NaN is not > 0 either; infinity is no amount of memory or time)
        if value is None or not value > 0 or not math.isfinite(value):
            what = "an integer" if kind is int else "a finite number"
            raise argparse.ArgumentTypeError(f"must be {what} > 0, got {text!r}")
        return value

    return parse


_count, _amount = _positive(int), _positive(float)


def _time(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _ints(text: str) -> list[int]:
    vals = _numbers(text)
    if any(not v.is_integer() for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: expected integer layer counts")
    return [int(v) for v in vals]


def _add_common(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("layer costs")
    src.add_argument("--costs", type=Path, help="JSON file with forward/backward[/memory] lists")
    src.add_argument("--forward", type=_numbers, help="forward time per layer, e.g. 0.1,1x12,3")
    src.add_argument("--backward", type=_numbers, help="backward time per layer (no recompute)")
    src.add_argument("--memory", type=_numbers, help="device memory per layer and micro-batch")
    src.add_argument(
        "--task-overhead",
        type=_time,
        help="time each stage pays per micro-batch on top of its layers (forward's unit)",
    )
    p.add_argument("-N", "--devices", type=_count, required=True, help="number of devices")
    p.add_argument("-M", "--microbatches", type=_count, required=True, help="micro-batches")
    p.add_argument("--memory-limit", type=_amount, help="device memory per stage (memory's unit)")


def _costs(args: argparse.Namespace) -> LayerCosts:
    overhead = args.task_overhead
    if args.costs is not None:
        if args.forward or args.backward or args.memory:
            raise PlanError("give either --costs FILE or --forward/--backward, not both")
        costs = LayerCosts.load(args.costs)
        return costs if overhead is None else replace(costs, task_overhead=overhead)
    if not args.forward or not args.backward:
        raise PlanError("layer costs needed: --costs FILE, or --forward and --backward lists")
    return LayerCosts(args.forward, args.backward, args.memory, task_overhead=overhead or 0.0)


def _limit(args: argparse.Namespace, costs: LayerCosts) -> float | None:
    lim = args.memory_limit
    if lim is not None and costs.memory is None:
        raise PlanError(
            '--memory-limit needs the layers\' memory: give --memory (or a "memory" list in '
            "--costs), or drop --memory-limit"
        )
    return None if lim is None else (int(lim) if float(lim).is_integer() else lim)


def _cmd_partition(args: argparse.Namespace, out) -> None:
    costs = _costs(args)
    t0 = time.perf_counter()
    plan = partition(costs, args.devices, args.microbatches, memory_limit=_limit(args, costs))
    took = time.perf_counter() - t0
    n, m, s = args.devices, args.microbatches, plan.num_slots
    out.write(f"{plan}\n")
    out.write(plan.describe(costs) + "\n")
    out.write(
        f"t_max {plan.max_stage_time(costs):.6g}, objective (M*S + N*(N-1)) * t_max = "
        f"{plan.objective(costs, n, m):.6g}, ideal bubble N(N-1)/(M*S+N(N-1)) = "
        f"{n * (n - 1) / (m * s + n * (n - 1)):.2%}\n"
    )
    out.write(f"partitioned {costs.num_layers} layers in {took * 1e3:.3f} ms\n")


def _row(res: SimulationResult) -> list[str]:
    shape = str(res.plan) if res.plan is not None else ",".join(map(str, res.stages or ()))
    asy = "-" if res.async_bubble_ratio is None else f"{res.async_bubble_ratio:.2%}"
    return [
        res.schedule,
        f"{res.makespan:.6g}",
        f"{res.bubble_ratio:.2%}",
        f"{res.fill_ratio:.2%}",
        f"{res.drain_ratio:.2%}",
        f"{res.steady_ratio:.2%}",
        asy,
        shape,
    ]


def format_table(results: Sequence[SimulationResult]) -> str:
    """A plain-text bubble table, one row per result."""
    head = ["schedule", "makespan", "bubble", "fill", "drain", "steady", "async", "stages"]
    rows = [head] + [_row(r) for r in results]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cmd_simulate(args: argparse.Namespace, out) -> None:
    costs = _costs(args)
    names = args.schedule or list(SCHEDULES)
    every = "all" in names or not args.schedule  # (none named one by one)
    if "all" in names:
        names = list(SCHEDULES)
    # options of schedules that are not simulated would be ignored: refused
    baselines = [n for n in names if n != "roundpipe"]
    for flag, given, wanted in (
        ("--plan", args.plan, "roundpipe" in names),
        ("--round-size", args.round_size, "roundpipe" in names),
        ("--async", args.async_optimizer or None, "roundpipe" in names),
        ("--memory-limit", args.memory_limit, "roundpipe" in names),
        ("--stages", args.stages, bool(baselines)),
        (
            "--stages-per-device",
            args.stages_per_device,
            any(n not in ("gpipe", "1f1b") for n in baselines),
        ),
    ):
        if given is not None and not wanted:
            raise PlanError(
                f"{flag} applies to none of the schedules simulated ({', '.join(names)}); drop "
                "it, or add a schedule it applies to with --schedule"
            )
    if args.round_size is not None and args.round_size > args.microbatches:
        raise PlanError(
            f"--round-size {args.round_size} is more than the {args.microbatches} micro-batches "
            "of an iteration (-M); a round holds at most all of them"
        )
    results, skipped, notes = [], [], []
    for name in names:
        rp = name == "roundpipe"
        plan, round_size = None, None
        if rp:
            plan, round_size, why = _roundpipe_setup(args, costs)
            notes.append(f"roundpipe: {why}")
        try:
            result = simulate(
                name,
                costs,
                args.devices,
                args.microbatches,
                comm_time=args.comm_time,
                plan=plan,
                async_optimizer=rp and args.async_optimizer,
                stages=None if rp else args.stages,
                microbatches_per_round=round_size,
                stages_per_device=None
                if rp or name in ("gpipe", "1f1b")
                else args.stages_per_device,
                memory_limit=_limit(args, costs) if rp else None,
            )
        except PlanError as exc:
            if rp or not every:
                raise
            skipped.append(f"{name}: not simulated: {exc}")  # a baseline this case does not fit
            continue
        results.append(result)
    out.write(format_table(results) + "\n")
    for line in notes + skipped:
        out.write(line + "\n")
    if args.png is not None:
        from .plot import plot_timeline

        for res in results:
            path = args.png
            if not path.suffix:  # (what the plot is saved as: the path printed is that)
                path = path.with_name(f"{path.name}.png")
            if len(results) > 1:
                path = path.with_name(f"{path.stem}-{res.schedule}{path.suffix}")
            plot_timeline(res, path, time_unit="the unit of the given costs")
            out.write(f"wrote {path}\n")


def _roundpipe_setup(args: argparse.Namespace, costs: LayerCosts) -> tuple[StagePlan, int, str]:
    """RoundPipe's plan and round size as the runtime would choose them, and
    a line saying which round and why: ``--plan`` (checked against
    ``--memory-limit``) or the plan the runtime chooses
    (:func:`~lightning_roundpipe.plan.choose_plan`); ``--round-size`` or the
    round the runtime chooses (:func:`~lightning_roundpipe.plan.choose_round`
    with the plan's simulated step per round size). What the runtime alone
    knows is left out: no host activation budget (a whole batch's
    activations fit) and every weight upload hidden behind compute."""
    from .policy import choose_plan, choose_round, simulated_period

    n, m, asyn, comm = args.devices, args.microbatches, args.async_optimizer, args.comm_time
    limit = _limit(args, costs)
    if args.plan:
        plan = StagePlan.parse(args.plan, costs.num_layers)
        check_within_limit(
            plan,
            costs,
            limit,
            plan_option="--plan",
            limit_option="--memory-limit",
            chosen="drop --plan",
        )
    else:
        kw = {"async_optimizer": asyn, "memory_limit": limit, "comm_time": comm}
        plan = choose_plan(costs, n, m, round_size=args.round_size, **kw)
    if args.round_size is not None:
        why = f"{args.round_size} of {m} micro-batches per round (--round-size)"
        return plan, args.round_size, why

    def period(g: int) -> float:
        kw = {"async_optimizer": asyn, "round_size": g, "comm_time": comm}
        return simulated_period(costs, plan, n, m, **kw)

    chosen = choose_round(m, num_devices=n, period=period)
    why = chosen.reason
    if chosen.round_size == m:
        why = f"{m} of {m} micro-batches per round, the {why}"
    return plan, chosen.round_size, f"{why}, as the runtime chooses (--round-size to fix it)"


def _model_name(source: str) -> str:
    """What the estimate calls the model: a config file's name, or its folder's
    for a ``config.json`` (``.../Llama-3.1-8B/config.json``), else ``source``."""
    path = Path(source)
    if not path.is_file():
        return source
    if path.stem == "config" and path.resolve().parent.name:
        return path.resolve().parent.name
    return path.stem


def _with_warnings(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with the estimate's logged warnings written to stderr as
    ``warning: ...`` (what the config left to defaults)."""
    logger = logging.getLogger("lightning_roundpipe.models.estimate")
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    logger.addHandler(handler)
    try:
        return fn(*args)
    finally:
        logger.removeHandler(handler)


def _cmd_estimate(args: argparse.Namespace, out) -> None:
    # (torch and transformers: the rest of the planning layer needs neither)
    import torch

    from ..models.estimate import ConfigError, GiB, estimate, load_config

    config = _with_warnings(load_config, args.config)
    try:
        result = estimate(
            config,
            gpu_memory=args.gpu_memory * GiB,
            gpus=args.gpus,
            host_memory=None if args.host_memory is None else args.host_memory * GiB,
            seq=args.seq,
            micro_batch=args.micro_batch,
            num_microbatches=args.microbatches,
            precision=args.precision,
            lora_rank=args.lora_rank,
            tflops=args.tflops,
            link_gbps=args.link_gbps,
            async_optimizer=not args.sync,
            name=_model_name(args.config),
            servers=args.servers,
            network_gbps=args.network_gbps,
            optimizer_gbps=args.optimizer_gbps,
            frozen_dtype=None if args.frozen_dtype is None else getattr(torch, args.frozen_dtype),
        )
    except ConfigError as exc:  # (named by its file, as load_config's errors)
        raise ValueError(f"{args.config}: {exc}") from exc
    out.write(result.report() + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_roundpipe.plan",
        description="RoundPipe planning: partition layers into stages, simulate schedules.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("partition", help="print the partitioner's stage plan")
    _add_common(p)
    s = sub.add_parser("simulate", help="simulate schedules and print a bubble table")
    _add_common(s)
    s.add_argument(
        "--schedule",
        action="append",
        choices=[*SCHEDULES, "all"],
        help="schedule to simulate (repeatable; default all)",
    )
    s.add_argument(
        "--plan",
        help="RoundPipe plan in compact form, e.g. 3,3|1|2,2,2 (checked against "
        "--memory-limit; default: the plan the runtime chooses)",
    )
    s.add_argument("--stages", type=_ints, help="baselines: layers per stage, e.g. 4,3,3,3")
    s.add_argument("--stages-per-device", type=_count, help="looped baselines (default 2)")
    s.add_argument(
        "--round-size",
        type=_count,
        help="RoundPipe micro-batches per round (default: the round the runtime chooses, "
        "choose_round over the plan's simulated step, with no host activation budget and "
        "weight uploads assumed hidden)",
    )
    s.add_argument("--comm-time", type=_time, default=0.0, help="activation hop time")
    s.add_argument(
        "--async",
        dest="async_optimizer",
        action="store_true",
        help="RoundPipe with the asynchronous optimizer (iterations overlap)",
    )
    s.add_argument("--png", type=Path, help="write timeline PNG(s) to this path")
    e = sub.add_parser(
        "estimate",
        help="plan, memory, longest sequence and throughput of a Hugging Face causal LM",
    )
    e.add_argument("config", help="config.json path, or a model name whose config is cached")
    e.add_argument("--gpu-memory", type=_amount, required=True, help="GiB of memory per GPU")
    e.add_argument("--gpus", type=_count, default=1, help="GPUs (default 1)")
    e.add_argument("--host-memory", type=_amount, help="GiB of host memory (checked if given)")
    e.add_argument(
        "--seq",
        type=_count,
        help="tokens per sequence (default: the longest that fits, at most the "
        "config's max_position_embeddings)",
    )
    e.add_argument("--micro-batch", type=_count, default=1, help="sequences per micro-batch")
    e.add_argument("--microbatches", type=_count, help="micro-batches per step (default: GPUs)")
    e.add_argument("--precision", default="bf16-mixed", help="as Trainer(precision=...)")
    e.add_argument("--lora-rank", type=_count, help="LoRA of this rank on every linear layer")
    e.add_argument(
        "--frozen-dtype",
        choices=["float32", "bfloat16", "float16"],
        help="dtype the frozen (LoRA base) weights are loaded in (default float32, or the "
        "precision's for *-true); in the compute dtype they are held once on the host",
    )
    e.add_argument(
        "--tflops", type=_amount, default=200.0, help="sustained TFLOP/s per GPU (default 200)"
    )
    e.add_argument(
        "--link-gbps", type=_amount, default=25.0, help="host-GPU GB/s per GPU (default 25)"
    )
    e.add_argument("--sync", action="store_true", help="synchronous optimizer")
    e.add_argument(
        "--servers",
        type=_count,
        default=1,
        help="servers, one replica each, gradients all-reduced every step (default 1)",
    )
    e.add_argument(
        "--network-gbps",
        type=_amount,
        default=100.0,
        help="link between servers in gigabits per second (default 100, i.e. 100 Gb/s)",
    )
    e.add_argument(
        "--optimizer-gbps",
        type=_amount,
        default=20.0,
        help="host GB/s of an update: the optimizer step (16 bytes per trainable parameter), "
        "the gradient check and weight copies (10 more in bf16) (default 20)",
    )
    return parser


def main(argv: Sequence[str] | None = None, out=None) -> int:
    """Run the command line; returns the exit status."""
    out = out or sys.stdout
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "partition":
            _cmd_partition(args, out)
        elif args.command == "estimate":
            _cmd_estimate(args, out)
        else:
            _cmd_simulate(args, out)
    except (PlanError, ImportError, OSError, ValueError) as exc:
        message = str(exc)
        if isinstance(exc, LayerTooLarge) and args.command != "estimate":
            # in this command's flags, not the strategy's options
            message = exc.advice(
                "Raise --memory-limit, or give the --memory of a smaller micro-batch"
            )
        sys.stderr.write(f"error: {message}\n")
        return 2
    return 0

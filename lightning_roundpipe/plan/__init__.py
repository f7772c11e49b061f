"""Planning layer: pure Python, no CUDA calls, no threads.

What to run where, decided before anything runs: per-layer costs, the stage
plan, its partitioner and the policy that chooses among plans and round
sizes, the decisions that change the plan (:mod:`.decide`: at the start,
after measurement, after running out of memory), the lowering of an
iteration to the tasks that run (with the clock that places them), transfer
windows, and a schedule simulator that executes the same lowered tasks, with
the baselines RoundPipe is compared against; and, for data parallelism
across servers, the all-reduce of gradients timed against the backward
(:mod:`.replicas`).
"""

from .costs import LayerCosts, PlanError, decoder_costs
from .partition import balanced_partition, frontier, partition, partition_exhaustive
from .plot import plot_timeline
from .policy import (
    ExposedUpload,
    RoundChoice,
    choose_plan,
    choose_round,
    exposed_uploads,
    hides_uploads,
    simulated_period,
)
from .replicas import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    GradientTimes,
    ReductionEstimate,
    allreduce_seconds,
    estimate_reduction,
    gradient_buckets,
    gradient_ready_times,
    overlap_reduction,
)
from .schedule import Clock, Copies, Schedule, Task, lower
from .simulate import SCHEDULES, Segment, SimulationResult, choose_microbatches, simulate
from .stages import Stage, StagePlan
from .windows import TransferPiece, TransferWindow, transfer_windows

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "SCHEDULES",
    "Bucket",
    "Clock",
    "Copies",
    "ExposedUpload",
    "GradientTimes",
    "LayerCosts",
    "PlanError",
    "ReductionEstimate",
    "RoundChoice",
    "Schedule",
    "Segment",
    "SimulationResult",
    "Stage",
    "StagePlan",
    "Task",
    "TransferPiece",
    "TransferWindow",
    "allreduce_seconds",
    "balanced_partition",
    "choose_microbatches",
    "choose_plan",
    "choose_round",
    "decoder_costs",
    "estimate_reduction",
    "exposed_uploads",
    "frontier",
    "gradient_buckets",
    "gradient_ready_times",
    "hides_uploads",
    "lower",
    "overlap_reduction",
    "partition",
    "partition_exhaustive",
    "plot_timeline",
    "simulate",
    "simulated_period",
    "transfer_windows",
]

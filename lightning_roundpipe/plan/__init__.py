"""Planning layer: pure Python, no CUDA calls, no threads.

What to run where, decided before anything runs: per-layer costs, the stage
plan and its partitioner, the round-robin dispatch, transfer windows, and a
schedule simulator with the baselines RoundPipe is compared against.
"""

from .costs import LayerCosts, PlanError, decoder_costs
from .schedule import Clock, Schedule, Task, lower
from .partition import balanced_partition, partition, partition_exhaustive, round_size
from .plot import plot_timeline
from .simulate import SCHEDULES, Segment, SimulationResult, choose_microbatches, simulate
from .stages import Stage, StagePlan
from .windows import TransferPiece, TransferWindow, transfer_windows

__all__ = [
    "SCHEDULES",
    "DispatchPlan",
    "DispatchStep",
    "LayerCosts",
    "PlanError",
    "Segment",
    "SimulationResult",
    "Stage",
    "StagePlan",
    "TransferPiece",
    "TransferWindow",
    "balanced_partition",
    "choose_microbatches",
    "decoder_costs",
    "dispatch",
    "partition",
    "partition_exhaustive",
    "plot_timeline",
    "round_size",
    "simulate",
    "transfer_windows",
]

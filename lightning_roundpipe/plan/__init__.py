from .costs import LayerCosts, PlanError
from .partition import balanced_partition, partition
from .stages import Stage, StagePlan
from .dispatch import DispatchPlan, DispatchStep, dispatch
from .simulate import SCHEDULES, Segment, SimulationResult, simulate
from .windows import TransferPiece, TransferWindow, transfer_windows

"""Runtime: host-resident state, device workers, streams and the controller."""

from .device import layer_seed
from .engine import EngineClosedError, RoundPipeEngine, estimate_costs
from .host import LayoutChanged, pinned_bytes
from .optimizer import NonFiniteError, OptimizerStepError, StepHandle, use_fused
from .options import EngineOptions
from .store import HandoffTimeout
from .worker import WorkerError

__all__ = [
    "EngineClosedError",
    "EngineOptions",
    "HandoffTimeout",
    "LayoutChanged",
    "NonFiniteError",
    "OptimizerStepError",
    "RoundPipeEngine",
    "StepHandle",
    "WorkerError",
    "estimate_costs",
    "layer_seed",
    "pinned_bytes",
    "use_fused",
]

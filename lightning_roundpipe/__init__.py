"""lightning_roundpipe: RoundPipe pipeline training as a PyTorch Lightning strategy.

Importing the package registers ``Trainer(strategy="roundpipe")`` (asynchronous
optimizer) and ``"roundpipe_sync"`` (ordinary training semantics).

- :mod:`lightning_roundpipe.plan`: partitioner, dispatch plan, simulator (pure Python).
- :mod:`lightning_roundpipe.runtime`: the engine (host state, device workers, optimizer).
- :class:`RoundPipeStrategy`, :class:`RoundPipePrecision`: the Lightning integration.
- The errors a fit can raise, importable from here (``except lightning_roundpipe.WorkerError``).
"""

# first, before Lightning: an unusable transformers is refused at once
from . import _requirements  # noqa: F401, I001
from lightning.pytorch.strategies import StrategyRegistry

from .precision import ClosureRequiredError, RoundPipePrecision
from .strategy import RoundPipeStrategy
from .models import LayerStackNotFound
from .plan import PlanError
from .runtime import (
    EngineClosedError,
    HandoffTimeout,
    LayoutChanged,
    NonFiniteError,
    OptimizerStepError,
    WorkerError,
)
from .runtime.replicas import ReplicaError
from .runtime.scope import HostSyncError

__version__ = "0.1.0.dev0"

if "roundpipe" not in StrategyRegistry:
    RoundPipeStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "ClosureRequiredError",
    "EngineClosedError",
    "HandoffTimeout",
    "HostSyncError",
    "LayerStackNotFound",
    "LayoutChanged",
    "NonFiniteError",
    "OptimizerStepError",
    "PlanError",
    "ReplicaError",
    "RoundPipePrecision",
    "RoundPipeStrategy",
    "WorkerError",
    "__version__",
]

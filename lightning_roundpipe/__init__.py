"""lightning_roundpipe: RoundPipe pipeline training as a PyTorch Lightning strategy.

The planning layer (:mod:`lightning_roundpipe.plan`) is pure Python. The runtime
and the Lightning strategy build on it.
"""

__version__ = "0.1.0.dev0"

__all__ = ["__version__"]

"""The main job's LightningCLI twin.

    python examples/train_tiny_lm_cli.py fit --config examples/train_tiny_lm.yaml

The YAML names the strategy by class path (``lightning_roundpipe.RoundPipeStrategy``
with ``init_args``); ``trainer.strategy: roundpipe`` works as well, because this
script imports ``lightning_roundpipe``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

import lightning_roundpipe  # noqa: F401  (registers strategy="roundpipe")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_lm import TinyLM, TinyTextData


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(TinyLM, TinyTextData, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()

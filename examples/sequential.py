"""A plain nn.Sequential model (not a language model) with Trainer(strategy="roundpipe").

    python examples/sequential.py [--steps 200] [--devices 3]

A regression MLP: the strategy finds the ``nn.Sequential`` attribute, pipelines
its children, and ``training_step`` computes the loss from the outputs as usual
(the pipeline re-runs the forward during backward). ``roundpipe_sync`` gives
ordinary training semantics, so the result matches ``strategy="auto"``.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_roundpipe  # noqa: F401  (registers strategy="roundpipe_sync")


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(16, 64),
            nn.GELU(),
            nn.Linear(64, 64),
            nn.GELU(),
            nn.Linear(64, 64),
            nn.GELU(),
            nn.Linear(64, 1),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def data(n: int = 1024) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True)).sin() + 0.05 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=g)


def main(argv: list[str] | None = None) -> L.Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--devices", type=int, default=3)
    args = parser.parse_args(argv)
    L.seed_everything(0)
    loader = data()
    trainer = L.Trainer(
        strategy="roundpipe_sync",
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.steps,
        max_epochs=-(-args.steps // len(loader)),  # (else the progress bar shows "Epoch 0/-2")
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(Regressor(), loader)
    return trainer


if __name__ == "__main__":
    main()

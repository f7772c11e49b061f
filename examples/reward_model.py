"""A reward model (a sequence classifier) trained on preference pairs under
Trainer(strategy="roundpipe").

    python examples/reward_model.py [--model-path DIR] [--steps N] [--devices N]

The model is a Hugging Face ``*ForSequenceClassification`` with one label: its
score of a sequence is the reward. Each batch holds pairs (a preferred and a
rejected sequence); the Bradley-Terry loss ``-log sigmoid(r_chosen -
r_rejected)`` is computed from the rewards the model returns (called without
``labels=``: the pipeline then runs the backward of whatever loss the step
builds from them). Without ``--model-path`` a tiny Qwen3 is built from a
config and the pairs are synthetic: the preferred sequence of a pair is the
one that ends on an even token, which the model learns in a few dozen steps.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_roundpipe  # noqa: F401  (registers strategy="roundpipe")

PAD = 0


def pairs(n: int, seq: int, vocab: int, seed: int = 0) -> TensorDataset:
    """Preference pairs: sequences padded on the right, the preferred one
    ending on an even token, the rejected one on an odd token."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randint(1, vocab, (n, seq), generator=g)
    rejected = torch.randint(1, vocab, (n, seq), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (n,), generator=g)
    rows = torch.arange(n)
    chosen[rows, lengths - 1] = 2 * torch.randint(1, vocab // 2, (n,), generator=g)
    rejected[rows, lengths - 1] = 2 * torch.randint(1, vocab // 2, (n,), generator=g) - 1
    mask = torch.arange(seq) < lengths[:, None]
    return TensorDataset(chosen.masked_fill(~mask, PAD), rejected.masked_fill(~mask, PAD), mask)


class RewardModel(L.LightningModule):
    def __init__(self, model_path: str | None = None, lr: float = 1e-3) -> None:
        super().__init__()
        from transformers import AutoModelForSequenceClassification, Qwen3Config

        if model_path is not None:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                model_path, num_labels=1
            )
        else:
            config = Qwen3Config(
                vocab_size=64,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                num_labels=1,
                pad_token_id=PAD,
            )
            torch.manual_seed(0)
            self.model = AutoModelForSequenceClassification.from_config(config)
        self.lr = lr

    def rewards(self, chosen, rejected, mask):
        """Both sequences of every pair scored in one call (one pipeline pass)."""
        ids = torch.cat([chosen, rejected])
        scores = self.model(input_ids=ids, attention_mask=torch.cat([mask, mask])).logits
        return scores.squeeze(-1).float().chunk(2)

    def training_step(self, batch, batch_idx):
        r_chosen, r_rejected = self.rewards(*batch)
        loss = -torch.nn.functional.logsigmoid(r_chosen - r_rejected).mean()
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_accuracy", (r_chosen > r_rejected).float().mean())
        return loss

    def validation_step(self, batch, batch_idx):
        r_chosen, r_rejected = self.rewards(*batch)
        self.log("val_accuracy", (r_chosen > r_rejected).float().mean())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> L.Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="a local Hugging Face checkpoint (default: tiny)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args(argv)
    module = RewardModel(args.model_path)
    vocab = module.model.config.vocab_size
    train = DataLoader(pairs(256, 16, vocab), batch_size=8, shuffle=True)
    val = DataLoader(pairs(64, 16, vocab, seed=1), batch_size=16)
    trainer = L.Trainer(
        strategy="roundpipe",
        accelerator="auto",
        devices=args.devices,
        max_steps=args.steps,
        # the epochs the steps take (else the progress bar shows "Epoch 0/-2")
        max_epochs=-(-args.steps // max(1, len(train))),
        val_check_interval=min(args.steps, 30),
        check_val_every_n_epoch=None,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, train, val)
    return trainer


if __name__ == "__main__":
    main()

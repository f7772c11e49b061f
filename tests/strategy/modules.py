"""LightningModules used by the strategy tests (importable by subprocesses)."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 97


def lm_data(n: int = 32, seq: int = 12, seed: int = 0, pad: bool = True) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, seq), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[::3, seq - 4 :] = 0  # every third row is padded: different real-token counts
    labels = ids.masked_fill(mask == 0, -100)
    return TensorDataset(ids, mask, labels)


def loader(ds: TensorDataset, batch_size: int = 8) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size)


def cpu_trainer(strategy, devices: int = 2, **kw) -> L.Trainer:
    """A quiet Trainer on CPU workers (one device for ``"auto"``), seeded."""
    L.seed_everything(0)
    kw.setdefault("enable_checkpointing", False)
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1 if strategy == "auto" else devices,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the module's state dict (to compare runs)."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


#: the tiny sizes of the test causal LMs (any family's config takes them)
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def hf_model(kind: str = "qwen3", layers: int = 3, **config) -> nn.Module:
    """A tiny causal LM; ``config``: settings over the tiny defaults."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    kw = {**TINY, "num_hidden_layers": layers, **config}
    torch.manual_seed(0)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=8, **kw))
    return LlamaForCausalLM(LlamaConfig(**kw))


class CausalLM(L.LightningModule):
    """A Hugging Face causal LM; the loss comes from the model (labels=)."""

    def __init__(self, kind: str = "qwen3", lr: float = 1e-3, lora: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = hf_model(kind)
        if lora:
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(1)
            self.model = get_peft_model(
                self.model,
                LoraConfig(
                    r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
                ),
            )

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        ids, mask, labels = batch
        self.log("val_loss", self.model(input_ids=ids, attention_mask=mask, labels=labels).loss)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.hparams.lr)


class LogitsLM(CausalLM):
    """The loss is computed in training_step from the model's logits."""

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        target = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), target.reshape(-1))
        self.log("train_loss", loss)
        return loss


class SeqModule(L.LightningModule):
    def __init__(self, lr: float = 1e-2, extra: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
        )
        # a parameter outside the pipeline, with its own loss term
        self.extra = nn.Linear(1, 1) if extra else None

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        loss = nn.functional.mse_loss(out, y)
        if self.extra is not None:
            loss = loss + 0.1 * self.extra.weight.square().sum()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def seq_data(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


class DropoutSeq(L.LightningModule):
    """An ``nn.Sequential`` with dropout, validated on the mean squared error."""

    def __init__(self, lr: float = 1e-2, p: float = 0.3) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 32),
            nn.Dropout(p),
            nn.Tanh(),
            nn.Linear(32, 32),
            nn.Dropout(p),
            nn.Tanh(),
            nn.Linear(32, 1),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class PenalizedSeq(SeqModule):
    """A weight penalty on the pipeline's parameters, and a linear map outside
    the layer stack that shares (ties) the stack's last weight."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__(lr=lr, extra=False)
        self.tied = nn.Linear(16, 1, bias=False)
        self.tied.weight = self.net[4].weight

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        penalty = sum(p.square().sum() for p in self.net.parameters())
        return loss + 1e-2 * penalty + 0.1 * self.tied(torch.ones(1, 16)).square().sum()

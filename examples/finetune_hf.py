"""Full fine-tuning of a Hugging Face causal LM with Trainer(strategy="roundpipe").

    python examples/finetune_hf.py                          # a small Qwen3 from a config
    python examples/finetune_hf.py --family llama --steps 50
    python examples/finetune_hf.py --model-path /path/to/local/checkpoint   # real weights

Nothing is downloaded: by default the model is built from a config
(``from_config``); ``--model-path`` loads weights from a local directory with
``from_pretrained``. The data is the generated text of ``train_tiny_lm.py``,
byte-level (ids 0..255, so any vocabulary of at least 256 tokens works).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_lm import TinyTextData

import lightning_roundpipe  # noqa: F401  (registers strategy="roundpipe")
from lightning_roundpipe import RoundPipeStrategy


def build(
    family: str, model_path: str | None, lora: bool = False, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The model with its weights in ``dtype`` (LoRA adapters stay fp32)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    if model_path:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    else:
        kw = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        )
        config = Qwen3Config(head_dim=16, **kw) if family == "qwen3" else LlamaConfig(**kw)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
        )
    return model


class FineTune(L.LightningModule):
    """An ordinary causal-LM LightningModule; nothing RoundPipe-specific."""

    def __init__(
        self,
        family: str = "qwen3",
        model_path: str | None = None,
        lora: bool = False,
        lr: float = 2e-3,
        base_dtype: str = "float32",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build(family, model_path, lora, getattr(torch, base_dtype))

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log(
            "val_loss",
            self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss,
            prog_bar=True,
        )

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.hparams.lr)


def main(
    argv: list[str] | None = None, lora: bool = False, description: str | None = None
) -> L.Trainer:
    parser = argparse.ArgumentParser(description=description or __doc__.splitlines()[0])
    parser.add_argument("--family", choices=["qwen3", "llama"], default="qwen3")
    parser.add_argument("--model-path", help="local directory with weights (from_pretrained)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--devices", type=int, default=None)
    if lora:
        parser.add_argument("--save", help="directory to save the trained LoRA adapter in")
    args = parser.parse_args(argv)
    L.seed_everything(0)
    gpu = torch.cuda.is_available()
    devices = args.devices or (torch.cuda.device_count() if gpu else 2)
    data = TinyTextData(batch_size=8)
    data.setup("fit")
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(num_microbatches=max(4, devices)),
        accelerator="gpu" if gpu else "cpu",
        devices=devices,
        precision="bf16-mixed" if gpu else "32-true",
        max_steps=args.steps,
        # the epochs the steps take (else the progress bar shows "Epoch 0/-2")
        max_epochs=-(-args.steps // max(1, len(data.train_dataloader()))),
        limit_val_batches=2,
        val_check_interval=max(1, args.steps // 2),
        enable_checkpointing=False,
        logger=False,
    )
    # LoRA under bf16-mixed: a base loaded in bf16 is its own master copy (the
    # host holds it once); full fine-tuning keeps fp32 weights for the optimizer
    base = "bfloat16" if lora and gpu else "float32"
    module = FineTune(args.family, args.model_path, lora, base_dtype=base)
    trainer.fit(module, data)
    if lora and args.save:
        module.model.save_pretrained(args.save)  # the adapter alone (PEFT's format)
    return trainer


if __name__ == "__main__":
    main()

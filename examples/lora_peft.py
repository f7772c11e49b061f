"""LoRA fine-tuning with PEFT under Trainer(strategy="roundpipe").

    python examples/lora_peft.py [--family llama] [--model-path DIR] [--steps N] [--save DIR]

The same module as ``finetune_hf.py`` with the model wrapped by
``peft.get_peft_model``: the frozen base weights never get gradient buffers or
gradient traffic; only the LoRA matrices are trained (with ``--save DIR``,
saved there with ``save_pretrained``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finetune_hf import main as _main


def main(argv: list[str] | None = None):
    return _main(argv, lora=True, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    main()

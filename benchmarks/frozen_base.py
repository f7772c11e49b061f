"""Host memory of LoRA under RoundPipe with the base loaded in fp32 or in bf16.

    python benchmarks/frozen_base.py [--hidden 1024 --layers 12] [--append docs/benchmarks.md]

A Llama-shaped model (random weights from a config) with LoRA r=32 on every
linear layer, trained one step with AdamW under bf16-mixed on two CPU workers.
Each variant runs in its own process; the process's resident memory is read
(``/proc/self/statm``, after ``malloc_trim``) before the model is built, after
it is built and after the step, and compared with ``plan estimate``'s model of
the host state (:func:`host_state_bytes`). The baseline is the same model with
its base in fp32: the parameters plus a bf16 master copy.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit

MIB = 2**20


def resident() -> int:
    """Resident bytes of this process, after giving freed heap pages back."""
    with contextlib.suppress(OSError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trial(hidden: int, layers: int, base: str, vocab: int = 32000) -> dict:
    """One variant, in this process."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from lightning_roundpipe.models.causal_lm import CausalLMAdapter
    from lightning_roundpipe.models.estimate import host_state_bytes
    from lightning_roundpipe.runtime import RoundPipeEngine

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    start = resident()
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, base))
    lora = LoraConfig(r=32, lora_alpha=64, target_modules="all-linear")
    model = get_peft_model(model, lora).get_base_model()  # adapters fp32 (peft's default)
    built = resident()
    predicted = host_state_bytes(model, "bf16-mixed", getattr(torch, base), double_buffer=False)
    adapter = CausalLMAdapter(model, "model")
    ids = torch.randint(0, vocab, (2, 64))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    with RoundPipeEngine(adapter.layers(), ["cpu"] * 2, 2, precision="bf16-mixed") as eng:
        adapter.attach(eng)
        try:
            model(input_ids=ids, labels=ids).loss.backward()
            eng.step(opt.step)
            eng.synchronize()
            trained = resident()
            held = eng.host_memory()
        finally:
            adapter.detach()
    return {
        "base": base,
        "parameters": sum(p.numel() for p in model.parameters()),
        "frozen": sum(p.numel() for p in model.parameters() if not p.requires_grad),
        "model_mib": (built - start) / MIB,
        "after_step_mib": (trained - start) / MIB,
        "predicted_mib": predicted / MIB,
        "shared_mib": held["shared"] / MIB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--append", type=Path)
    parser.add_argument("--trial", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trial:
        print(json.dumps(trial(args.hidden, args.layers, args.trial, args.vocab)))
        return
    rows = []
    # both trials at once, each in its own process (resident memory is per
    # process; nothing here is timed)
    procs = []
    for base in ("float32", "bfloat16"):
        cmd = [sys.executable, __file__, "--hidden", str(args.hidden), "--layers"]
        cmd += [str(args.layers), "--vocab", str(args.vocab), "--trial", base]
        procs.append(
            (cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        )
    for cmd, proc in procs:
        out, err = proc.communicate(timeout=900)
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)
        rows.append(json.loads(out.strip().splitlines()[-1]))
    n = rows[0]["parameters"]
    lines = [
        "| base loaded in | model built (MiB) | after one step (MiB) | predicted state (MiB) "
        "| bytes per parameter | base held as its own master (MiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['base']} | {r['model_mib']:.0f} | {r['after_step_mib']:.0f} | "
            f"{r['predicted_mib']:.0f} | {r['after_step_mib'] * MIB / n:.2f} | "
            f"{r['shared_mib']:.0f} |"
        )
    ratio = rows[1]["after_step_mib"] / rows[0]["after_step_mib"]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, no GPU"
    out = (
        f"### Host memory of LoRA with the base in fp32 or bf16 ({datetime.date.today()})\n\n"
        f"`python benchmarks/frozen_base.py --hidden {args.hidden} --layers {args.layers} "
        f"--vocab {args.vocab}` on "
        f"{machine}: a Llama-shaped model of {n / 1e6:.0f}M parameters "
        f"({rows[0]['frozen'] / 1e6:.0f}M frozen), LoRA r=32 on every linear layer, one "
        "AdamW step under bf16-mixed on 2 CPU workers; process resident memory above its "
        "start, each variant in its own process.\n\n"
        + "\n".join(lines)
        + f"\n\nThe bf16 base takes {ratio:.2f}x the host memory of the fp32 base.\n"
    )
    emit(out, args.append)


if __name__ == "__main__":
    main()

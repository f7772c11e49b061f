"""Long sequences on one GPU: the predicted device memory against the
measured peak, and tokens/s at long sequences (issue 18's GPU rows).

    python benchmarks/long_context_gpu.py memory [--layers 2] [--seqs 65536 262144 1048576]
        [--activation-memory GIB] [--device-memory-limit GIB]
    python benchmarks/long_context_gpu.py throughput [--seqs 8192 32768 131072]
        [--json F] [--append F] [--budget SECONDS]
    python benchmarks/long_context_gpu.py memory --smoke   # tiny, CPU: the wiring only

``memory``: Llama-3.1-8B's blocks (shapes from its public config, random
weights, LoRA r = 32 on every linear layer, the base in bf16, bf16-mixed)
with the depth cut to ``--layers``: a one-layer stage's peak does not depend
on the depth (the host's boundary values do, and one full-depth step at 1M
tokens takes hours). One step at micro-batch 1 per length under
``roundpipe_sync``, each in a fresh process. Reported: the plan, the
engine's prediction of the device's peak (each slot's predicted peak plus the
next slot's weights, uploaded meanwhile; the largest) and the measured
``torch.cuda.max_memory_allocated()``. The goal: within 15%. With
``--activation-memory`` the boundary values of a micro-batch get that much
host memory, fewer than one-layer stages keep: the plan's backward stages
grow, layered or, where their layer inputs would not fit, rewalked. At 1M
tokens with 10 GiB and ``--device-memory-limit 71`` the plan is
``2|2|2|rewalk`` on any card (predicted on CPU: 70.0 GiB for the rewalked
stages; a layered plan would need 78.0).

``throughput``: Qwen3-1.7B's shape, full fine-tuning, full depth, bf16-mixed,
``roundpipe`` (asynchronous optimizer), micro-batch 1: tokens/s over the
steps after the first.

Every trial runs in its own process with a time limit (``--trial-timeout``),
and the part stops starting trials when ``--budget`` seconds are spent
(their rows say so): a device call has ten minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import child_result, emit

GIB = 2**30
LORA_RANK = 32
#: public config values: hidden, intermediate, layers, heads, key/value heads,
#: head size, vocabulary, rope theta
SHAPES = {
    "llama-3.1-8b": ("llama", 4096, 14336, 32, 32, 8, 128, 128256, 500000.0),
    "qwen3-1.7b": ("qwen3", 2048, 6144, 28, 16, 8, 128, 151936, 1000000.0),
    "tiny": ("llama", 64, 128, 2, 4, 2, 16, 256, 10000.0),
}


def config_for(name: str, layers: int | None, seq: int) -> Any:
    """The model's config (``layers`` blocks instead of its own when given)."""
    import transformers

    kind, hidden, inter, depth, heads, kv, head_dim, vocab, theta = SHAPES[name]
    cls = transformers.LlamaConfig if kind == "llama" else transformers.Qwen3Config
    return cls(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers or depth,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        vocab_size=vocab,
        rope_theta=theta,
        max_position_embeddings=max(seq, 2048),
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )


def run_trial(spec: dict[str, Any]) -> dict[str, Any]:
    """One fit in this process: ``spec`` has ``model``, ``layers``, ``lora``
    (rank or None), ``seq``, ``steps`` and ``strategy`` (``roundpipe`` or
    ``roundpipe_sync``). Returns the row's numbers (``"oom": True`` when the
    device ran out of memory)."""
    import lightning as L
    import torch
    import transformers
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_roundpipe import RoundPipeStrategy

    transformers.logging.set_verbosity_error()
    gpu = torch.cuda.is_available()
    config = config_for(spec["model"], spec.get("layers"), spec["seq"])
    torch.manual_seed(0)
    # a LoRA base loaded in the compute dtype, as from_pretrained(dtype=...) would
    base = {"dtype": torch.bfloat16} if spec.get("lora") and gpu else {}
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa", **base
    )
    if spec.get("lora"):
        from peft import LoraConfig, get_peft_model

        r = spec["lora"]
        lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear")
        model = get_peft_model(model, lora).get_base_model()
    seen: dict[str, Any] = {"times": []}

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def on_train_batch_start(self, batch, batch_idx):
            if gpu:
                torch.cuda.synchronize()
            seen["t0"] = time.perf_counter()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if gpu:
                torch.cuda.synchronize()
            seen["times"].append(time.perf_counter() - seen["t0"])
            engine = self.trainer.strategy.engine
            if engine.predicted_peaks:
                weights = engine.estimates.weight_bytes or [0.0] * engine.estimates.num_layers
                stages = engine.plan.stages
                # while a slot runs, the next slot's weights go up (unless
                # nothing is prefetched: the slot has the device to itself)
                nxt = [
                    sum(weights[s.start : s.stop]) if engine.prefetch else 0.0
                    for s in [*stages[1:], stages[0]]
                ]
                seen["predicted"] = max(
                    p + w for p, w in zip(engine.predicted_peaks, nxt, strict=True)
                )
                seen["stage_limit"] = engine.memory_limit
            seen["plan"] = str(engine.plan)
            seen["prefetch"] = engine.prefetch

        def configure_optimizers(self):
            trainable = [p for p in self.parameters() if p.requires_grad]
            return torch.optim.AdamW(trainable, lr=1e-5)

    steps = spec.get("steps", 1)
    ids = torch.randint(0, config.vocab_size, (steps, spec["seq"]))
    host, device = spec.get("activation_memory_gib"), spec.get("device_memory_limit_gib")
    strategy = RoundPipeStrategy(
        async_optimizer=spec.get("strategy", "roundpipe_sync") == "roundpipe",
        num_microbatches=1,
        activation_memory=None if host is None else int(host * GIB),
        device_memory_limit=None if device is None else int(device * GIB),
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        precision="bf16-mixed" if gpu else "32-true",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated() if gpu else 0
    try:
        trainer.fit(LM(), DataLoader(TensorDataset(ids), batch_size=1))
    except torch.OutOfMemoryError as exc:
        return {"oom": True, "error": str(exc).splitlines()[0][:200]}
    out: dict[str, Any] = {"plan": seen.get("plan"), "step_seconds": seen["times"]}
    out["prefetch"] = seen.get("prefetch")
    if "predicted" in seen:
        out["predicted_bytes"] = int(seen["predicted"])
        out["stage_limit_bytes"] = seen["stage_limit"]
    if gpu:
        out["measured_bytes"] = int(torch.cuda.max_memory_allocated() - start)
    later = seen["times"][1:] or seen["times"]
    out["tokens_per_second"] = spec["seq"] / (sum(later) / len(later))
    return out


def trial(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """:func:`run_trial` in a fresh process, within ``timeout`` seconds."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "child", json.dumps(spec)]
    return child_result(cmd, timeout)


def run_part(
    specs: list[dict[str, Any]], trial_timeout: float, budget: float, runner: Any = trial
) -> list[dict[str, Any]]:
    """Each spec's result in order, each trial within ``trial_timeout`` and
    all within ``budget`` seconds (later ones are skipped)."""
    began = time.monotonic()
    results = []
    for spec in specs:
        left = budget - (time.monotonic() - began)
        if left < 30:
            results.append({"skipped": f"the part's {budget:.0f} s budget was spent"})
            continue
        results.append(runner(spec, min(trial_timeout, left)))
    return results


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


def _outcome(r: dict[str, Any]) -> str:
    if r.get("oom"):
        return "out of memory"
    return r.get("skipped") or r.get("error") or "ran"


def memory_rows(seqs: list[int], results: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| tokens | plan | predicted peak (GiB) | measured peak (GiB) | measured / predicted "
        "| step (s) | outcome |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for seq, r in zip(seqs, results, strict=True):
        p, m = r.get("predicted_bytes"), r.get("measured_bytes")
        ratio = f"{m / p:.3f}" if p and m else "-"
        step = f"{r['step_seconds'][-1]:.1f}" if r.get("step_seconds") else "-"
        plan = "`" + r["plan"].replace("|", "\\|") + "`" if r.get("plan") else "-"  # (a cell)
        rows.append(
            f"| {seq} | {plan} | {_gib(p)} | {_gib(m)} | {ratio} | {step} | {_outcome(r)} |"
        )
    return rows


def throughput_rows(seqs: list[int], results: list[dict[str, Any]]) -> list[str]:
    rows = ["| tokens | tokens/s | measured peak (GiB) | outcome |", "|---:|---:|---:|---|"]
    for seq, r in zip(seqs, results, strict=True):
        tps = f"{r['tokens_per_second']:.0f}" if "tokens_per_second" in r else "-"
        rows.append(f"| {seq} | {tps} | {_gib(r.get('measured_bytes'))} | {_outcome(r)} |")
    return rows


def machine() -> dict[str, str]:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return {"device": gpu, "torch": torch.__version__, "host": platform.machine()}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        sys.stdout.write(json.dumps(run_trial(json.loads(argv[1]))) + "\n")
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["memory", "throughput"])
    parser.add_argument("--seqs", type=int, nargs="+")
    parser.add_argument("--layers", type=int, default=2, help="memory: blocks kept")
    parser.add_argument(
        "--device-memory-limit",
        type=float,
        help="memory: GiB a stage may use (the same plan on any card)",
    )
    parser.add_argument(
        "--activation-memory",
        type=float,
        help="memory: GiB of host memory for one micro-batch's boundary values (fewer than "
        "one-layer stages keep: a layered or rewalked plan)",
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny model (CPU wiring check)")
    parser.add_argument("--trial-timeout", type=float, default=540.0)
    parser.add_argument("--budget", type=float, default=570.0, help="seconds for the part")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--append", type=Path)
    args = parser.parse_args(argv)
    if args.part == "memory":
        model = "tiny" if args.smoke else "llama-3.1-8b"
        seqs = args.seqs or ([128, 256] if args.smoke else [65536, 262144, 1048576])
        base = dict(model=model, layers=args.layers, lora=LORA_RANK, steps=1)
        key = f"{model}-lora{LORA_RANK}-{args.layers}-layers"
        if args.activation_memory is not None:
            base["activation_memory_gib"] = args.activation_memory
            key += f"-host-{args.activation_memory:g}-gib"
        if args.device_memory_limit is not None:
            base["device_memory_limit_gib"] = args.device_memory_limit
            key += f"-stage-{args.device_memory_limit:g}-gib"
        specs = [dict(base, seq=s, strategy="roundpipe_sync") for s in seqs]
    else:
        model = "tiny" if args.smoke else "qwen3-1.7b"
        seqs = args.seqs or ([128, 256] if args.smoke else [8192, 32768, 131072])
        specs = [dict(model=model, seq=s, steps=3, strategy="roundpipe") for s in seqs]
        key = f"{model}-full"
    results = run_part(specs, args.trial_timeout, args.budget)
    info = machine()
    rows = (memory_rows if args.part == "memory" else throughput_rows)(seqs, results)
    title = "predicted and measured device memory" if args.part == "memory" else "tokens/s"
    text = (
        f"### Long sequences on one GPU: {title} ({datetime.date.today()})\n\n"
        f"`python benchmarks/long_context_gpu.py {' '.join(argv)}` on {info['device']} "
        f"(torch {info['torch']}; model `{key}`, micro-batch 1).\n\n" + "\n".join(rows) + "\n"
    )
    emit(text, args.append)
    if args.json:
        record = {
            "date": str(datetime.date.today()),
            **info,
            "setting": {
                "precision": "32-true" if info["device"] == "no GPU" else "bf16-mixed",
                "micro_batch": 1,
                "part": args.part,
            },
            "results": {key: {str(s): r for s, r in zip(seqs, results, strict=True)}},
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()

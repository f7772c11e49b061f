"""One training run of a Qwen3-style causal LM under one strategy, in its own process.

Used by ``throughput.py`` and ``max_seqlen.py``: each trial runs as
``python benchmarks/lm_runner.py --strategy NAME --size SIZE --seq S ...`` and
prints one JSON line (tokens/s, or ``"oom": true``), so an out-of-memory error
or a distributed strategy's process group cannot affect the next trial.

Strategies: ``roundpipe`` (asynchronous), ``roundpipe_sync``,
``roundpipe_one_copy`` (asynchronous, one master copy), ``auto`` (the
model on one device, activation checkpointing on), ``fsdp_offload``
(FSDPStrategy with CPU offload, CUDA only) and ``deepspeed_offload`` (ZeRO
stage 3 with CPU offload, when ``deepspeed`` is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import child_result

SIZES = {  # hidden, intermediate, layers, heads, kv heads, vocab (llama-*: Llama, else Qwen3)
    "tiny": (64, 128, 4, 4, 2, 256),
    "llama-tiny": (64, 224, 4, 4, 2, 256),
    "llama-8b": (4096, 14336, 32, 32, 8, 128256),  # Llama-3.1-8B
    "0.6b": (1024, 3072, 28, 16, 8, 151936),
    "1.7b": (2048, 6144, 28, 16, 8, 151936),
    "4b": (2560, 9728, 36, 32, 8, 151936),
    "8b": (4096, 12288, 36, 32, 8, 151936),
}
STRATEGIES = ("roundpipe", "roundpipe_sync", "auto", "fsdp_offload", "deepspeed_offload")
#: RoundPipe variants measured on request only: ``roundpipe_one_copy`` is the
#: asynchronous optimizer with one master copy (``double_buffer=False``)
ABLATIONS = ("roundpipe_one_copy",)


def build_model(size: str, lora: int = 0, base_dtype=None):
    """A causal LM of ``size`` from its config (random weights); ``lora``: the
    rank of LoRA adapters on every linear layer (PEFT), the base frozen and
    built in ``base_dtype`` (default fp32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    h, m, n, a, k, v = SIZES[size]
    shape = dict(
        vocab_size=v,
        hidden_size=h,
        intermediate_size=m,
        num_hidden_layers=n,
        num_attention_heads=a,
        num_key_value_heads=k,
        head_dim=h // a,
        max_position_embeddings=1 << 20,
        tie_word_embeddings=False,
    )
    if size.startswith("llama"):
        config, cls = LlamaConfig(rope_theta=500000.0, **shape), LlamaForCausalLM
    else:
        config, cls = Qwen3Config(**shape), Qwen3ForCausalLM
    dtype = base_dtype or torch.float32
    started = time.perf_counter()
    model = _random_model(cls, config, dtype)
    print(f"built {size} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    if lora:
        from peft import LoraConfig, get_peft_model

        adapters = LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear")
        model = get_peft_model(model, adapters)  # (adapters in fp32)
    return model


def _random_model(cls, config, dtype):
    """``cls`` from ``config`` with random weights in ``dtype``, on the CPU.

    With a GPU, the weights are drawn there and copied down: PyTorch draws
    CPU random numbers on one thread (about 60 M parameters/s through
    transformers' init), so an 8B model took over two minutes to build on the
    GPU machine, more than a benchmark trial's time limit. A model too large
    for the GPU is drawn on the CPU.
    """
    import torch

    if torch.cuda.is_available():
        try:
            with torch.device("cuda"):
                model = cls._from_config(config, dtype=dtype)
            model = model.to("cpu")
        except torch.OutOfMemoryError:
            model = None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the trial's peak is its own
        if model is not None:
            return model
    return cls._from_config(config, dtype=dtype)


def build_module(
    size: str, lr: float = 1e-4, cpu_adam: bool = False, lora: int = 0, base_dtype=None
):
    """The LM of ``size`` as a LightningModule; ``cpu_adam``: AdamW as
    DeepSpeed's CPU Adam (its ZeRO offload refuses a torch optimizer)."""
    import lightning as L
    import torch

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(size, lora, base_dtype)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            if cpu_adam:
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(self.trainable(), lr=lr, adamw_mode=True)
            return torch.optim.AdamW(self.trainable(), lr=lr)

        def trainable(self):
            return [p for p in self.parameters() if p.requires_grad]

    return LM()


def run_one(
    strategy: str,
    size: str,
    seq: int,
    batch: int,
    micro: int,
    steps: int,
    devices: int,
    lora: int = 0,
    profile: str | None = None,
) -> dict:
    """One fit; ``lora``: LoRA rank (0: full fine-tuning); ``profile``: a folder
    for a ``torch.profiler`` trace of steps 3 and 4 (of at least 5) with its
    summary and timeline (``trace_summary.py``)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_roundpipe
    from lightning_roundpipe import RoundPipeStrategy

    gpu = torch.cuda.is_available()
    why = cannot_run(strategy)
    if why is not None:
        return {"skipped": why}
    # a LoRA base in the compute dtype where the strategy takes mixed dtypes
    # (RoundPipe holds it once on the host; FSDP flattens one dtype per unit)
    base = (
        torch.bfloat16
        if lora and gpu and (strategy.startswith("roundpipe") or strategy == "auto")
        else None
    )
    module = build_module(
        size, cpu_adam=strategy == "deepspeed_offload", lora=lora, base_dtype=base
    )
    vocab = SIZES[size][5]
    data = TensorDataset(torch.randint(0, vocab, ((steps + 1) * batch, seq)))
    loader = DataLoader(data, batch_size=batch if strategy.startswith("roundpipe") else micro)
    accumulate = 1 if strategy.startswith("roundpipe") else batch // micro
    if strategy.startswith("roundpipe"):
        strat = RoundPipeStrategy(
            async_optimizer=strategy != "roundpipe_sync",
            double_buffer=False if strategy == "roundpipe_one_copy" else None,
            num_microbatches=max(batch // micro, devices),
        )
    elif strategy == "auto":
        module.model.gradient_checkpointing_enable()
        strat, devices = "auto", 1
    elif strategy == "fsdp_offload":
        from lightning.pytorch.strategies import FSDPStrategy
        from torch.distributed.fsdp import CPUOffload

        module.model.gradient_checkpointing_enable()
        strat = FSDPStrategy(cpu_offload=CPUOffload(offload_params=True))
    elif strategy == "deepspeed_offload":
        module.model.gradient_checkpointing_enable()
        strat = "deepspeed_stage_3_offload"
    else:
        known = ", ".join(STRATEGIES + ABLATIONS)
        raise SystemExit(f"unknown strategy {strategy!r}; choose from {known}")
    assert lightning_roundpipe  # registers "roundpipe"

    times: list[float] = []
    engine_stats: list[tuple[float, float, int]] = []  # RoundPipe: (time, waited, bytes moved)

    traced = (2 * accumulate, 4 * accumulate)  # the batches of steps 3 and 4
    if profile and steps < 5:
        raise SystemExit("--profile traces steps 3 and 4: give --steps 5 or more")

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if profile and batch_idx == traced[0]:
                self.prof = _start_profiler(gpu)
            if profile and batch_idx == traced[1]:
                self.trace = _stop_profiler(self.prof, Path(profile), gpu)
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = time.perf_counter()
            times.append(now - self.t0)
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:
                engine_stats.append((now, engine.wait_seconds, engine.bytes_moved))
                self.traffic = engine.traffic()  # one iteration's bytes by kind

    timer = Timer()
    trainer = L.Trainer(
        strategy=strat,
        accelerator="gpu" if gpu else "cpu",
        devices=devices,
        precision="bf16-mixed" if gpu else "32-true",
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    try:
        trainer.fit(module, loader)
    except torch.OutOfMemoryError:
        return {"oom": True}
    except RuntimeError as exc:
        if "out of memory" in str(exc).lower():
            return {"oom": True}
        raise
    step_seconds = [sum(times[i : i + accumulate]) for i in range(0, len(times), accumulate)]
    # steady state: the median step after the first (which warms up), so that
    # one slow step (such as the asynchronous optimizer's first update, which
    # creates the optimizer's state) does not count as the rate; the mean is
    # kept for comparison with earlier records
    steady = step_seconds[1:] or step_seconds
    per_step = statistics.median(steady) if steady else 0.0
    mean = sum(steady) / len(steady) if steady else 0.0
    result = {
        "tokens_per_second": batch * seq / per_step if per_step else float("nan"),
        "tokens_per_second_mean": batch * seq / mean if mean else float("nan"),
        "step_seconds": [round(t, 4) for t in step_seconds],
    }
    if len(engine_stats) > 2:  # after the warm-up step: the host waited, bytes moved
        (t0, w0, b0), (t1, w1, b1) = engine_stats[1], engine_stats[-1]
        result["wait_fraction"] = round((w1 - w0) / (t1 - t0), 4)
        result["transfer_gb_per_s"] = round((b1 - b0) / (t1 - t0) / 1e9, 2)
        result["plan"] = str(getattr(trainer.strategy, "stage_plan", None))
        result["traffic_bytes"] = getattr(timer, "traffic", None)
    if profile and hasattr(timer, "trace"):
        result["profile"] = timer.trace
    if gpu:
        result["peak_device_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return result


def _start_profiler(gpu: bool):
    import torch
    from torch.profiler import ProfilerActivity, profile

    if gpu:
        torch.cuda.synchronize()
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)  # workers' ranges
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    prof = profile(activities=activities, experimental_config=config)
    prof.__enter__()
    return prof


def _stop_profiler(prof, folder: Path, gpu: bool) -> dict:
    """Stop, write ``trace.json.gz`` and ``timeline.png`` into ``folder``;
    returns the trace's summary."""
    import gzip
    import shutil

    import torch

    if gpu:
        torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    folder.mkdir(parents=True, exist_ok=True)
    raw = folder / "trace.json"
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(folder / "trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    import trace_summary

    events = trace_summary.load(folder / "trace.json.gz")
    if events:
        trace_summary.picture(events, folder / "timeline.png", "two training steps")
    return trace_summary.summary(events)


def cannot_run(strategy: str) -> str | None:
    """Why ``strategy`` cannot run on this machine (a peer that needs CUDA, or
    a package that is not installed), or None."""
    import importlib.util

    import torch

    if strategy == "fsdp_offload" and not torch.cuda.is_available():
        return "FSDP CPU offload needs CUDA"
    if strategy == "deepspeed_offload" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed"
    return None


def trial(
    strategy: str,
    size: str,
    seq: int,
    batch: int,
    micro: int,
    steps: int,
    devices: int,
    timeout: float | None = None,
    lora: int = 0,
    profile: str | None = None,
) -> dict:
    """Run one trial in a fresh process; returns its JSON result. ``timeout``
    (default: ``$ROUNDPIPE_TRIAL_TIMEOUT`` seconds, else an hour) bounds it; a
    trial that runs out of time is reported, not raised."""
    why = cannot_run(strategy)
    if why is not None:  # (known here: no process to start)
        return {"skipped": why}
    if timeout is None:
        timeout = float(os.environ.get("ROUNDPIPE_TRIAL_TIMEOUT", 3600))
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--strategy",
        strategy,
        "--size",
        size,
        "--seq",
        str(seq),
        "--batch",
        str(batch),
        "--micro",
        str(micro),
        "--steps",
        str(steps),
        "--devices",
        str(devices),
        "--lora",
        str(lora),
    ]
    if profile:
        cmd += ["--profile", profile]
    return child_result(cmd, timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES + ABLATIONS, required=True)
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--profile", help="a folder for a trace of steps 3 and 4")
    args = parser.parse_args()
    result = run_one(
        args.strategy,
        args.size,
        args.seq,
        args.batch,
        args.micro,
        args.steps,
        args.devices,
        args.lora,
        args.profile,
    )
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()

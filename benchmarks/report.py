"""Shared output for the benchmark scripts: print a report, optionally append
it to a markdown file (``--append docs/benchmarks.md``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def emit(text: str, append: Path | None) -> None:
    sys.stdout.write(text)
    if append:
        with open(append, "a", encoding="utf-8") as fh:
            fh.write("\n" + text)


def _keep(log: str, cmd: list[str], how: str, out, err) -> None:
    def text(x) -> str:
        return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")

    with open(log, "a") as f:
        f.write(f"==== {' '.join(cmd[1:])}: {how}\n{text(out)[-4000:]}\n{text(err)[-12000:]}\n")


def child_result(cmd: list[str], timeout: float) -> dict[str, Any]:
    """Run a trial's child process, which prints its result as one JSON line,
    within ``timeout`` seconds: that result, ``{"oom": True}`` when it died
    of an out-of-memory error, else ``{"error": ...}`` with its last line (a
    trial that runs out of time is reported, not raised)."""
    log = os.environ.get("ROUNDPIPE_TRIAL_LOG")  # a file that keeps every trial's output
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        if log:
            _keep(log, cmd, f"timed out after {timeout:.0f} s", exc.stdout, exc.stderr)
        return {"error": f"timed out after {timeout:.0f} s"}
    if log:
        _keep(log, cmd, f"exit {proc.returncode}", proc.stdout, proc.stderr)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr or proc.stdout)[-2000:].strip()
    if "out of memory" in tail.lower():
        return {"oom": True}
    return {"error": tail.splitlines()[-1][:300] if tail else f"exit {proc.returncode}"}


def measured_fit(code: str, *args: str, timeout: float = 1200) -> dict[str, Any]:
    """Run ``python -c code *args`` (a measured fit in a fresh process: its
    peak memory says nothing about the next one's) and return the JSON it
    printed after ``RESULT``; a failure raises with the child's stderr."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"the measured fit failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.split("RESULT")[-1])


#: for a benchmark's child process (its code is ``RESIDENT + ...``): ``status``
#: reads a /proc field (KiB; Linux) and ``restart_peak`` restarts the resident
#: high-water mark (``VmHWM``), so what imports and set-up peaked at earlier
#: does not hide part of what is measured; it returns the resident bytes now
RESIDENT = """
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def restart_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS") * 1024
"""


#: for a benchmark's child process (``LLAMA + ...``): ``llama(s, seq)``, a
#: seeded Llama with sdpa attention of ``s["layers"]`` blocks, ``s["hidden"]``
#: wide, an MLP ``2 x s.get("mlp", 1)`` times that, ``s["vocab"]`` tokens
LLAMA = """
def llama(s, seq):
    import torch, transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"],
        intermediate_size=2 * s["hidden"] * s.get("mlp", 1), num_hidden_layers=s["layers"],
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=seq, bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
"""

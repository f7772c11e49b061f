"""Where the time goes, from a ``torch.profiler`` Chrome trace of a few steps.

    python benchmarks/trace_summary.py runs/gpu/trace.json.gz --picture docs/images/gpu-timeline.png

Reads the trace that ``lm_runner.py --profile DIR`` writes (two steady
training steps, every thread's ranges) and reports, over the traced window:

- ``gpu_busy_fraction``: the time some kernel ran, over the window;
- ``h2d_gb_per_s`` / ``d2h_gb_per_s``: bytes copied each way over the window,
  and ``h2d_busy_fraction`` / ``d2h_busy_fraction``: the time a copy ran;
- ``optimizer_step_seconds``, ``weight_copy_seconds``: the host optimizer's
  ranges (``RP optimizer step``, ``RP optimizer weight copies``);
- ``waits``: the seconds each kind of RoundPipe wait range took
  (``RP wait weights (rule 2)``: a device thread waiting for the optimizer's
  weight copies, the optimizer time the pipeline did not hide);
- ``gpu_idle_seconds``: the window less the kernel time;
- ``gpu_gaps``: the stretches of at least 0.1 s with no kernel running
  (start in seconds from the window's start, length);
- ``host_stalls``: CUDA runtime calls other than waits (allocations, page
  registration) that blocked a host thread for 50 ms or more, by thread role:
  on the first GPU profile a pinned allocation of the gradients' download
  buffer held the device thread for 3.6 s while the GPU idled.

With ``--picture`` it draws the timeline: kernels per CUDA stream, the copies
each way, and the RoundPipe ranges per host thread. The trace format is
torch's own (``export_chrome_trace``); nothing else reads it here.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def load(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        doc = json.load(fh)
    return [e for e in doc.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _direction(e: dict[str, Any]) -> str | None:
    name = e.get("name", "")
    if "HtoD" in name:
        return "h2d"
    if "DtoH" in name:
        return "d2h"
    return None


def summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of the module docstring (seconds, GB/s, fractions)."""
    if not events:
        return {"window_seconds": 0.0}
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    window = (end - start) / 1e6
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    copies: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "gpu_memcpy" and _direction(e):
            copies[_direction(e)].append(e)
    out: dict[str, Any] = {"window_seconds": round(window, 6)}
    busy = _union(kernels) / 1e6
    out["gpu_busy_fraction"] = round(busy / window, 4) if window else 0.0
    out["gpu_idle_seconds"] = round(window - busy, 6)
    for way in ("h2d", "d2h"):
        got = copies.get(way, [])
        nbytes = sum(int(e.get("args", {}).get("bytes", 0)) for e in got)
        spans = _union([(e["ts"], e["ts"] + e["dur"]) for e in got]) / 1e6
        out[f"{way}_gb"] = round(nbytes / 1e9, 3)
        out[f"{way}_gb_per_s"] = round(nbytes / 1e9 / window, 2) if window else 0.0
        out[f"{way}_busy_fraction"] = round(spans / window, 4) if window else 0.0
        out[f"{way}_gb_per_s_while_copying"] = round(nbytes / 1e9 / spans, 2) if spans else 0.0
    ranges: dict[str, float] = defaultdict(float)
    for e in events:
        name = e.get("name", "")
        if name.startswith("RP "):
            kind = re.sub(r"\s+\d+(:\S*)?$", "", re.sub(r" mb\d+$", "", name))
            ranges[kind] += e["dur"] / 1e6
    out["optimizer_step_seconds"] = round(ranges.pop("RP optimizer step", 0.0), 6)
    out["weight_copy_seconds"] = round(ranges.pop("RP optimizer weight copies", 0.0), 6)
    out["waits"] = {k: round(v, 6) for k, v in sorted(ranges.items()) if k.startswith("RP wait")}
    out["gpu_gaps"] = [
        [round((a - start) / 1e6, 3), round((b - a) / 1e6, 3)]
        for a, b in _gaps(kernels)
        if b - a >= GAP_US
    ]
    roles = _roles(events)
    out["host_stalls"] = [
        {
            "call": e["name"],
            "thread": f"{roles.get(e.get('tid'), 'thread')} {e.get('tid')}",
            "start": round((e["ts"] - start) / 1e6, 3),
            "seconds": round(e["dur"] / 1e6, 3),
        }
        for e in sorted(_stalls(events), key=lambda e: e["ts"])
    ]
    return out


#: a stretch without kernels, and a blocking runtime call, worth naming (µs)
GAP_US = 100_000
STALL_US = 50_000
#: runtime calls that wait for the device by design (the RP wait ranges say why)
_WAITS = ("Synchronize", "EventQuery", "StreamQuery")


def _stalls(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        e
        for e in events
        if e.get("cat") == "cuda_runtime"
        and e["dur"] >= STALL_US
        and not any(w in e.get("name", "") for w in _WAITS)
    ]


def _gaps(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The stretches between the union of ``(start, end)`` intervals."""
    gaps, end = [], None
    for a, b in sorted(intervals):
        if end is not None and a > end:
            gaps.append((end, a))
        end = b if end is None else max(end, b)
    return gaps


def _roles(events: list[dict[str, Any]]) -> dict[Any, str]:
    """A host thread's role from the RoundPipe ranges it records (the trace
    names threads by number only)."""
    roles: dict[Any, str] = {}
    for e in events:
        name = e.get("name", "")
        if name.startswith("RP optimizer"):
            roles[e.get("tid")] = "optimizer"
        elif re.match(r"RP \d+:", name) or name.startswith("RP wait weights"):
            roles.setdefault(e.get("tid"), "device worker")
        elif name.startswith("RP wait losses"):
            roles.setdefault(e.get("tid"), "training loop")
    return roles


def picture(events: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Lanes: kernels per stream, copies each way, RoundPipe ranges per thread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = min(e["ts"] for e in events)
    roles = _roles(events)
    lanes: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        span = ((e["ts"] - start) / 1e6, e["dur"] / 1e6)
        if e.get("cat") == "kernel":
            lanes[f"kernels, stream {e.get('args', {}).get('stream', e.get('tid'))}"].append(span)
        elif e.get("cat") == "gpu_memcpy" and _direction(e):
            lanes[f"copies {_direction(e)}"].append(span)
        elif e.get("name", "").startswith("RP "):
            what = "waits" if e["name"].startswith("RP wait") else "work"
            lanes[f"{roles.get(e.get('tid'), 'thread')} {e.get('tid')}: {what}"].append(span)
    for e in _stalls(events):
        span = ((e["ts"] - start) / 1e6, e["dur"] / 1e6)
        who = f"{roles.get(e.get('tid'), 'thread')} {e.get('tid')}"
        lanes[f"{who}: blocking CUDA calls"].append(span)
    names = sorted(lanes, key=lambda n: (not n.startswith("kernels"), n))
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(names) + 1.2))
    for i, name in enumerate(names):
        color = (
            "C3"
            if "waits" in name
            else "C1"
            if "blocking" in name
            else "C0"
            if name.startswith("kernels")
            else "C2"
        )
        ax.broken_barh(lanes[name], (i - 0.4, 0.8), color=color, linewidth=0)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=7)
    ax.set_xlabel("seconds")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--picture", type=Path)
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    events = load(args.trace)
    sys.stdout.write(json.dumps(summary(events), indent=1) + "\n")
    if args.picture and events:
        picture(events, args.picture, args.title)


if __name__ == "__main__":
    main()

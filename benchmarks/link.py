"""Host-device link bandwidth: page-locked and pageable copies, each direction.

    python benchmarks/link.py --json runs/link.json

The ceiling for RoundPipe's weight, gradient and activation traffic; the
throughput record compares the runtime's measured transfer rate with it.
Medians of CUDA-event timings over repeated 1 GiB copies (``--mib``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def measure(mib: int = 1024, repeat: int = 8) -> dict[str, float]:
    """GB/s (10^9 bytes) per copy kind."""
    import torch

    n = mib << 20
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out: dict[str, float] = {}
    for name, pinned in (("pinned", True), ("pageable", False)):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)  # touch the pages
        for direction in ("h2d", "d2h"):
            dst, src = (dev, host) if direction == "h2d" else (host, dev)
            times = []
            for _ in range(repeat + 1):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                dst.copy_(src, non_blocking=pinned)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            out[f"{name}_{direction}_gb_s"] = round(n / statistics.median(times[1:]) / 1e9, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.stdout.write("no CUDA device: nothing to measure\n")
        return
    result = {"device": torch.cuda.get_device_name(0), **measure(args.mib, args.repeat)}
    sys.stdout.write(json.dumps(result) + "\n")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

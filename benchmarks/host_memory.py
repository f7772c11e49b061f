"""Host memory of the page-locked master copies: exact arena vs the caching
host allocator's power-of-two rounding.

    python benchmarks/host_memory.py [--append docs/benchmarks.md]

For Qwen3-style models (shapes from their configs; bf16 master copies) it
computes the bytes each scheme allocates: the engine's single registered arena
(every tensor 512-byte aligned), ``pin_memory()`` per tensor and per layer
(each block rounded up to a power of two by torch's caching host allocator).
Allocation sizes are computed, not measured with a driver, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit

CONFIGS = {  # hidden, intermediate, layers, heads, kv heads, head dim, vocab
    "Qwen3-0.6B": (1024, 3072, 28, 16, 8, 128, 151936),
    "Qwen3-1.7B": (2048, 6144, 28, 16, 8, 128, 151936),
    "Qwen3-8B": (4096, 12288, 36, 32, 8, 128, 151936),
    "Qwen3-32B": (5120, 25600, 64, 64, 8, 128, 151936),
}


def layers(h: int, m: int, n: int, a: int, k: int, d: int, v: int) -> list[list[int]]:
    block = [h * a * d, h * k * d, h * k * d, a * d * h, m * h, m * h, h * m, h, h, d, d]
    return [[v * h], *[block] * n, [h, v * h]]  # embedding, blocks, norm + untied head


def next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def table(size: int = 2) -> str:
    rows = [
        "| model | weights (GiB) | arena, 512-B aligned | pin_memory per tensor | "
        "pin_memory per layer |",
        "|---|---:|---:|---:|---:|",
    ]
    gib = float(1 << 30)
    for name, cfg in CONFIGS.items():
        tensors = [[n * size for n in layer] for layer in layers(*cfg)]
        exact = sum(sum(t) for t in tensors)
        arena = sum(-(-b // 512) * 512 for t in tensors for b in t)
        per_tensor = sum(next_pow2(b) for t in tensors for b in t)
        per_layer = sum(next_pow2(sum(t)) for t in tensors)

        def pct(x: int, exact: int = exact) -> str:
            return f"{x / gib:.2f} GiB (+{(x - exact) / exact:.1%})"

        rows.append(
            f"| {name} | {exact / gib:.2f} | {pct(arena)} | {pct(per_tensor)} | {pct(per_layer)} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--append", type=Path)
    args = parser.parse_args()
    out = (
        f"### Page-locked master copies ({datetime.date.today()})\n\n"
        "`python benchmarks/host_memory.py`: bf16 master copies; allocation sizes "
        "computed from the model shapes.\n\n" + table() + "\n"
    )
    emit(out, args.append)


if __name__ == "__main__":
    main()

"""The paper's Figure 1 case: 12 layers plus an LM head on 4 devices, 8 micro-batches.

Simulates RoundPipe (with the partitioner's plan, synchronous and with the
asynchronous optimizer) against Looped BFS and the other stage-bound schedules,
prints the bubble table, and writes timeline PNGs.

    python examples/figure1_timeline.py                # PNGs into docs/images/
    python examples/figure1_timeline.py --out /tmp/fig --head 1

Block layers cost forward 1 / backward 2; the LM head costs ``--head`` times a
block (default 3, a realistic head for a large vocabulary). RoundPipe runs in
rounds of 4 micro-batches, one per device, as in the paper's figure (the
runtime's default is one round per batch, which moves each stage's weights
once per step; for a single iteration it leaves the devices less evenly loaded
when the slots do not divide among them).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_roundpipe.plan import LayerCosts, partition, plot_timeline, simulate
from lightning_roundpipe.plan.cli import format_table

NUM_DEVICES = 4
NUM_MICROBATCHES = 8


def run(out: Path, head: float = 3.0, png: bool = True) -> list:
    costs = LayerCosts.uniform(
        13, forward=1.0, backward=2.0, head_forward=head, head_backward=2.0 * head
    )
    plan = partition(costs, NUM_DEVICES, NUM_MICROBATCHES)
    # RoundPipe in rounds of one micro-batch per device, as in the paper's figure
    rp = dict(plan=plan, async_optimizer=True, microbatches_per_round=NUM_DEVICES)
    results = [
        simulate("roundpipe", costs, NUM_DEVICES, NUM_MICROBATCHES, **rp),
        simulate("looped-bfs", costs, NUM_DEVICES, NUM_MICROBATCHES, stages_per_device=2),
        simulate("interleaved-1f1b", costs, NUM_DEVICES, NUM_MICROBATCHES, stages_per_device=2),
        simulate("1f1b", costs, NUM_DEVICES, NUM_MICROBATCHES),
        simulate("gpipe", costs, NUM_DEVICES, NUM_MICROBATCHES),
    ]
    print(
        f"12 layers + LM head ({head:g}x a layer), {NUM_DEVICES} devices, "
        f"{NUM_MICROBATCHES} micro-batches; RoundPipe plan {plan}"
    )
    print(format_table(results))
    if png:
        tag = f"head{head:g}"
        for res in results[:2]:
            path = plot_timeline(res, out / f"figure1-{tag}-{res.schedule}.png")
            print(f"wrote {path}")
        overlapped = simulate("roundpipe", costs, NUM_DEVICES, NUM_MICROBATCHES, iterations=2, **rp)
        path = plot_timeline(
            overlapped,
            out / f"figure1-{tag}-roundpipe-async-2iter.png",
            title="roundpipe, 2 iterations with the asynchronous optimizer",
        )
        print(f"wrote {path}")
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent.parent / "docs/images")
    parser.add_argument(
        "--head",
        type=float,
        action="append",
        help="LM head cost in blocks (repeatable; default 3 and 1)",
    )
    parser.add_argument("--no-png", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    for head in args.head or [3.0, 1.0]:
        run(args.out, head, png=not args.no_png)
        print()


if __name__ == "__main__":
    main()

"""Transfer windows: spreading a stage's weight/gradient copies over its micro-batches.

A stage that runs ``M`` micro-batches opens ``M`` transfer windows, one per
micro-batch, between the urgent activation copies. Weight uploads (and
gradient downloads) are packed into those windows so that no window carries
much more than ``total / M`` bytes and a large copy never delays an activation.

Packing is longest-processing-time first (Graham, 1969): tensors larger than
``chunk_bytes`` are first split into pieces (so a huge LM head cannot make one
window far heavier than the rest), pieces are sorted by size, largest first,
and each goes to the window with the fewest bytes so far. LPT guarantees the
heaviest window is at most ``4/3 - 1/(3M)`` times the best possible packing,
and at most ``total/M + (1 - 1/M) * largest piece``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .costs import PlanError

__all__ = ["TransferPiece", "TransferWindow", "transfer_windows"]


@dataclass(frozen=True)
class TransferPiece:
    """Bytes ``[offset, offset + nbytes)`` of tensor ``name``."""

    name: str
    offset: int
    nbytes: int


@dataclass
class TransferWindow:
    """The pieces copied during one micro-batch's window."""

    index: int
    pieces: list[TransferPiece] = field(default_factory=list)
    nbytes: int = 0


def transfer_windows(
    tensors: Sequence[tuple[str, int]],
    num_windows: int,
    chunk_bytes: int | None = None,
    align: int = 1,
) -> list[TransferWindow]:
    """Pack tensors ``(name, bytes)`` into ``num_windows`` windows, LPT first.

    Args:
        tensors: the stage's tensors and their sizes in bytes.
        num_windows: ``M``, one window per micro-batch.
        chunk_bytes: tensors larger than this are split into pieces of at most
            this size first. Default: ``ceil(total / num_windows)`` rounded up
            to ``align``, so that no single tensor can overload a window.
        align: piece boundaries fall on multiples of this many bytes (an
            element size, or a copy-engine friendly size such as 512).

    Returns:
        ``num_windows`` windows; every byte of every tensor is in exactly one
        piece. Deterministic: equal sizes keep the input order, equal windows
        go to the lowest index.
    """
    if isinstance(num_windows, bool) or not isinstance(num_windows, int) or num_windows < 1:
        raise PlanError(f"num_windows must be an integer >= 1, got {num_windows!r}")
    if align < 1:
        raise PlanError(f"align must be >= 1, got {align}")
    names = set()
    for name, nbytes in tensors:
        if name in names:
            raise PlanError(f"tensor name {name!r} appears twice; names must be unique")
        names.add(name)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise PlanError(f"tensor {name!r} has size {nbytes!r}; sizes are integers >= 0")
    total = sum(n for _, n in tensors)
    if chunk_bytes is None:
        chunk_bytes = max(1, math.ceil(total / num_windows))
    if chunk_bytes < 1:
        raise PlanError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    chunk_bytes = math.ceil(chunk_bytes / align) * align

    pieces: list[tuple[int, int, TransferPiece]] = []
    for order, (name, nbytes) in enumerate(tensors):
        offset = 0
        while offset < nbytes:
            size = min(chunk_bytes, nbytes - offset)
            pieces.append((-size, order, TransferPiece(name, offset, size)))
            offset += size
    pieces.sort(key=lambda p: (p[0], p[1], p[2].offset))

    windows = [TransferWindow(i) for i in range(num_windows)]
    heap = [(0, i) for i in range(num_windows)]  # (bytes so far, window index)
    for neg, _, piece in pieces:
        load, i = heapq.heappop(heap)
        windows[i].pieces.append(piece)
        windows[i].nbytes = load - neg
        heapq.heappush(heap, (load - neg, i))
    return windows

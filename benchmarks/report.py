"""Shared output for the benchmark scripts: print a report, optionally append
it to a markdown file (``--append docs/benchmarks.md``)."""

from __future__ import annotations

import sys
from pathlib import Path


def emit(text: str, append: Path | None) -> None:
    sys.stdout.write(text)
    if append:
        with open(append, "a", encoding="utf-8") as fh:
            fh.write("\n" + text)

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

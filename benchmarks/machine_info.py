"""One line describing the machine a benchmark ran on, for every results page.

CPU model, cores, memory, and the library versions given (numpy, zarr, torch by default):
speeds are only comparable between runs on the same line.
"""

from __future__ import annotations

import importlib
import os
import platform
from pathlib import Path


def describe(libraries: tuple[str, ...] = ("numpy", "zarr", "torch")) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    versions = ", ".join(f"{name} {importlib.import_module(name).__version__}" for name in libraries)
    return f"{cpu}, {os.cpu_count()} cores{mem}, no GPU; Python {platform.python_version()}, {versions}"

"""What every benchmark's results share: the machine it ran on, how busy it was, its clocks.

``describe``: one line with the CPU model, cores, memory, and the library versions given
(numpy, zarr, torch by default): speeds are only comparable between runs on the same line.
``load_average``: the 1-minute load, which every page quotes beside its times (the benchmark
machine's cores are shared). ``timed``, ``best_of`` and ``dir_bytes``: the wall-clock and
bytes-on-disk measures the benchmarks each defined again (issue 45, item 4), in one place so
they measure the same way.
"""

from __future__ import annotations

import importlib
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


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


def load_average() -> float:
    """The 1-minute load average (NaN where the platform has none): 2 means both cores busy."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """One call of ``fn``: its wall-clock seconds and what it returned."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def best_of(fn: Callable[[], T], repeats: int) -> tuple[float, T]:
    """The fastest of ``repeats`` calls (the least disturbed by other jobs) and the last result."""
    if repeats < 1:
        raise ValueError(f"best_of needs at least one call, got repeats={repeats}")
    runs = [timed(fn) for _ in range(repeats)]
    return min(seconds for seconds, _ in runs), runs[-1][1]


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path``: what a store or a checkpoint folder takes on disk."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

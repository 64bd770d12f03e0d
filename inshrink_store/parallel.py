"""One way to run a function over many items on a thread pool: the writer's tensors, a
restore's reads. numpy, zstd and I/O release the GIL, so threads use the cores (or wait on
an object store side by side).
Layer: helpers (``layout`` | ``dtypes`` | ``parallel``), above only ``errors``.

Results come back in the items' order, and a failure is raised only after every call
ended (nothing is left running behind the caller), the first failure in the items' order:
the same inputs give the same outcome whatever the thread count or the timing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from inshrink_store.errors import FormatError

T = TypeVar("T")
R = TypeVar("R")


def map_in_order(fn: Callable[[T], R], items: Sequence[T], workers: int, name: str) -> list[R]:
    """``[fn(item) for item in items]`` on up to ``workers`` threads named ``name``."""
    workers = min(workers, len(items))
    if workers <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(workers, thread_name_prefix=name) as pool:
        futures = [pool.submit(fn, item) for item in items]
        for future in futures:
            future.exception()  # wait for every call before raising any failure
        return [future.result() for future in futures]


def write_threads() -> int:
    """Threads for a pass over a state's tensors (the writer's, and the policy's planning,
    scoring and estimates): ``INSHRINK_WRITE_THREADS`` if set, else the cores (at most 8)."""
    configured = os.environ.get("INSHRINK_WRITE_THREADS")
    if configured is not None:
        if not configured.isdigit() or int(configured) < 1:
            raise FormatError(
                f"Expected INSHRINK_WRITE_THREADS to be a whole number >= 1. Got {configured!r} instead."
            )
        return int(configured)
    return max(1, min(8, os.cpu_count() or 1))

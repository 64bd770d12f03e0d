"""A byte-bounded LRU cache, safe across threads: the object store keeps decoded payloads in
it, so the bases of a delta chain are decoded once while a snapshot is read, and the small
float chunks it wrote, so the next version's chunk deltas against them without a read.
Layer: helpers (with layout, dtypes and parallel), below everything that stores.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

_V = TypeVar("_V")


class ByteBoundedLRU(Generic[_V]):
    """Values by key, bounded in their total bytes (``size`` of each value; a value larger
    than the bound is not kept), least recently used dropped first; safe across threads."""

    def __init__(self, max_bytes: int, size: Callable[[_V], int]) -> None:
        self.max_bytes = max_bytes
        self._size_of = size
        self._items: OrderedDict[str, tuple[_V, int]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> _V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: str, value: _V) -> None:
        n = self._size_of(value)
        if n > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = (value, n)
            self._size += n
            while self._size > self.max_bytes:
                _, (_, old) = self._items.popitem(last=False)
                self._size -= old

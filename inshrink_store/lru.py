"""A byte-bounded LRU cache, safe across threads: the object store keeps decoded payloads in
it, so the bases of a delta chain are decoded once while a snapshot is read.
Layer: helpers (with layout, dtypes and parallel), below everything that stores.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class ByteBoundedLRU:
    """Values by key, bounded in their total bytes (a value larger than the bound is not
    kept), least recently used dropped first; safe across threads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: str, value: bytes) -> None:
        if len(value) > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = value
            self._size += len(value)
            while self._size > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._size -= len(old)

"""A store in this process's memory (``memory://``): fast tests, nothing durable."""

from __future__ import annotations

import threading

from inshrink_store.storage.base import Storage

# the memory filesystem is one process-global dict: one lock makes create check-and-set
_LOCK = threading.Lock()


class MemoryStorage(Storage):
    def write(self, path: str, data: bytes) -> None:
        self._call("write", path, lambda: self.fs.pipe_file(self._full(path), data))

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Check and write under one process-wide lock (fsspec's own create is check-then-set)."""
        full = self._full(path)
        with _LOCK:
            if self.fs.exists(full):
                raise FileExistsError(full)
            self.fs.pipe_file(full, data)

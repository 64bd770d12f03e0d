"""A store on an object store through fsspec (S3, GCS, ...).

Writes of whole objects are atomic on every object store; exclusive create is a
conditional put (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``) through
``pipe_file(mode="create")``, which the server decides. Listings are never cached
(``use_listings_cache=False`` and an explicit invalidation before each listing).
"""

from __future__ import annotations

from inshrink_store.storage.base import Storage


class ObjectStorage(Storage):
    def write(self, path: str, data: bytes) -> None:
        self._call("write", path, lambda: self.fs.pipe_file(self._full(path), data))

    def create_exclusive(self, path: str, data: bytes) -> None:
        self._call("create", path, lambda: self.fs.pipe_file(self._full(path), data, mode="create"))

"""A store on an object store through fsspec (S3, GCS, ...).
Layer: storage (with codecs and structure), above the helpers.

Writes of whole objects are atomic on every object store; exclusive create is a
conditional put (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``) through
``pipe_file(mode="create")``, which the server decides. Listings are never cached
(``use_listings_cache=False`` and an explicit invalidation before each listing).
"""

from __future__ import annotations

import inspect
from typing import Any, cast

from inshrink_store.errors import NotFoundError, StorageError
from inshrink_store.storage.base import FsspecStorage, protocol_of

_BUCKETED = frozenset({"s3", "s3a", "gs", "gcs"})


class ObjectStorage(FsspecStorage):
    """Every operation is as few requests as the backend allows: on an object store a
    request costs tens of milliseconds, and a lazy read of one tensor should cost a
    handful of them (the request table in docs/benchmarks.md).

    Capabilities (see :class:`~inshrink_store.storage.base.Storage`): no rename (a "move"
    is a copy and a delete), but a whole-object PUT is atomic, so no write needs one; an
    exclusive create is a conditional put the server decides (the only protocols a store
    opens here, :data:`~inshrink_store.storage.base.SUPPORTED_PROTOCOLS`, have one); S3
    and GCS list strongly consistently, and fsspec's listing cache is off (see the module
    docstring)."""

    is_remote = True
    supports_rename = False
    atomic_create = True
    listing_consistent = True

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url, storage_options)
        # s3fs HEADs every whole-object read first, to split objects over its block size
        # (50 MiB) into parallel ranged GETs; ours are smaller, so that HEAD only doubles
        # the requests of every read.
        cat = getattr(type(self.fs), "_cat_file", None)
        takes = inspect.signature(cat).parameters if cat is not None else {}
        self._whole_read: dict[str, Any] = {"max_concurrency": 1} if "max_concurrency" in takes else {}

    def read(self, path: str) -> bytes:
        return self._call("read", path, lambda: cast(bytes, self.fs.cat_file(self._full(path), **self._whole_read)))

    def exists(self, path: str) -> bool:
        """One ranged GET of the first byte. fsspec's ``exists`` HEADs the key and, when it
        is absent, lists it as a folder too: two requests for every absent object, which is
        every new chunk a save writes."""
        try:
            self.read_range(path, 0, 1)
        except FileNotFoundError:
            return False
        except StorageError:
            return super().exists(path)  # an empty file refuses a range on some servers
        return True

    def write(self, path: str, data: bytes) -> None:
        self._call("write", path, lambda: self.fs.pipe_file(self._full(path), data))

    def create_exclusive(self, path: str, data: bytes) -> None:
        self._call("create", path, lambda: self.fs.pipe_file(self._full(path), data, mode="create"))

    def require_bucket(self) -> None:
        """One request for the bucket (``info``, not ``exists``: that answers False for a
        closed endpoint too); only a backend that says "no such bucket" raises, any other
        failure leaves the caller's error to be reported as it is. Only S3 and GCS URLs
        name a bucket first; another protocol's first path part may be just a folder."""
        bucket = self.root.split("/", 1)[0]
        if protocol_of(self.url) not in _BUCKETED or not bucket:
            return
        try:
            self.fs.info(bucket)
        except FileNotFoundError:
            raise NotFoundError(
                f"Expected the bucket {bucket!r} of {self.url!r} to exist. Got no such bucket instead "
                f"(bucket {bucket} does not exist); create the bucket first, or check the URL's spelling."
            ) from None
        except Exception:  # noqa: BLE001, S110 - only a diagnosis: the caller's error stands
            pass

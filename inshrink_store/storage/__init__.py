"""Storage: one URL -> one rooted filesystem with the few operations the store needs.
Layer: codecs, storage and structure (siblings, none importing another), above the helpers.

The store only ever needs: read a file (or a byte range of it), write a
content-addressed file (idempotent, so a plain overwrite is safe), create a file
exclusively (the commit point), list a prefix with sizes, and delete (gc). Keeping
the surface this small is what lets every backend give the same guarantees.

:func:`open_storage` picks the backend from the URL: :class:`LocalStorage` for paths and
``file://``, :class:`MemoryStorage` for ``memory://``, :class:`ObjectStorage` for
``s3://`` and ``gs://``; any other scheme is an InvalidInputError naming the supported
ones (:func:`require_supported`). Every backend is a :class:`Storage` (a protocol, with
capability flags that say what the backend guarantees) built on :class:`FsspecStorage`.
Missing files raise the built-in ``FileNotFoundError`` and a lost exclusive create
``FileExistsError`` on every backend; any other backend failure (credentials, network,
permissions) is a :class:`~inshrink_store.errors.StorageError` naming the operation, the
path and the cause.

The factory lives here, above the backends, so that ``base`` (the protocol and the shared
implementation) imports none of them: the package has no import cycle.
"""

from __future__ import annotations

from typing import Any

from inshrink_store.errors import InvalidInputError
from inshrink_store.storage.base import (
    SCHEMES,
    SUPPORTED_PROTOCOLS,
    FsspecStorage,
    Scheme,
    Storage,
    filesystem,
    local_path,
    protocol_of,
    remote_service,
    require_supported,
    scheme_of,
)
from inshrink_store.storage.local import LocalStorage
from inshrink_store.storage.memory import MemoryStorage
from inshrink_store.storage.remote import ObjectStorage

__all__ = [
    "BACKENDS",
    "SCHEMES",
    "SUPPORTED_PROTOCOLS",
    "FsspecStorage",
    "LocalStorage",
    "MemoryStorage",
    "ObjectStorage",
    "Scheme",
    "Storage",
    "filesystem",
    "local_path",
    "open_storage",
    "protocol_of",
    "remote_service",
    "require_supported",
    "scheme_of",
]

#: the backend class of each kind of scheme in :data:`SCHEMES`
BACKENDS: dict[str, type[FsspecStorage]] = {"local": LocalStorage, "memory": MemoryStorage, "object": ObjectStorage}


def backend_for(url: str) -> type[FsspecStorage]:
    """The backend class :func:`open_storage` builds for ``url`` (a path or ``file://``: the
    local disk; ``memory://``: this process's memory; any other scheme: an object store,
    which refuses a scheme it does not support when it is built)."""
    scheme = scheme_of(url)
    return ObjectStorage if scheme is None else BACKENDS[scheme.backend]


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """The storage of the store at ``url`` (a path, ``file://``, ``memory://``, ``s3://``,
    ``gs://``), its backend picked by the URL's scheme; ``storage_options`` go to fsspec
    (credentials, an endpoint). Connects to nothing: the first request is the first
    operation. Raises :class:`~inshrink_store.errors.InvalidInputError` for an empty URL or
    an unsupported scheme."""
    if not isinstance(url, str) or not url:
        raise InvalidInputError(f"Expected a store URL or path. Got {url!r} instead.")
    return backend_for(url)(url, storage_options)

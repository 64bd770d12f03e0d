"""Storage: one URL -> one rooted filesystem with the few operations the store needs.

The store only ever needs: read a file (or a byte range of it), write a
content-addressed file (idempotent, so a plain overwrite is safe), create a file
exclusively (the commit point), list a prefix with sizes, and delete (gc). Keeping
the surface this small is what lets every backend give the same guarantees.

``Storage(url)`` picks the backend from the URL: :class:`LocalStorage` for paths and
``file://``, :class:`MemoryStorage` for ``memory://``, :class:`ObjectStorage` for
``s3://`` and ``gs://``; any other scheme is an InvalidInputError naming the supported
ones (:func:`require_supported`). Missing files raise the built-in
``FileNotFoundError`` and a lost exclusive create ``FileExistsError`` on every backend;
any other backend failure (credentials, network, permissions) is a
:class:`~inshrink_store.errors.StorageError` naming the operation, the path and the cause.
"""

from inshrink_store.storage.base import SUPPORTED_PROTOCOLS, Storage, require_supported
from inshrink_store.storage.local import LocalStorage
from inshrink_store.storage.memory import MemoryStorage
from inshrink_store.storage.remote import ObjectStorage

__all__ = ["SUPPORTED_PROTOCOLS", "LocalStorage", "MemoryStorage", "ObjectStorage", "Storage", "require_supported"]

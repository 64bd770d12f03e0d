"""The Storage protocol and what every backend shares (fsspec underneath, rooted paths)."""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import fsspec

from inshrink_store.errors import (
    InshrinkError,
    InvalidInputError,
    MissingDependencyError,
    NotFoundError,
    StorageError,
)
from inshrink_store.layout import is_temp

_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
T = TypeVar("T")


#: the schemes a store may live at. Why only these: a commit is an exclusive create, which a
#: local disk (a link), memory (a lock) and S3 and GCS (a conditional put the server decides)
#: make atomic; another fsspec backend would fail late (ftp://, http://: a connection error
#: that names no cause) or create racily
SUPPORTED_PROTOCOLS = ("file", "local", "memory", "s3", "s3a", "gs", "gcs")
SUPPORTED_URLS = "a file path (or file://), memory://, s3:// (or s3a://) or gs:// (or gcs://)"


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


def require_supported(url: str) -> None:
    """Refuse a URL whose scheme no backend here supports, before anything connects."""
    protocol = protocol_of(url)
    if protocol not in SUPPORTED_PROTOCOLS:
        raise InvalidInputError(
            f"Expected a store URL that is {SUPPORTED_URLS}. Got {url!r} instead: {protocol}:// is not "
            "supported (a store needs an atomic exclusive create to commit); use one of those.")


def _filesystem(url: str, storage_options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    require_supported(url)
    protocol = protocol_of(url)
    if protocol in _EXTRAS:
        # Refs are found by listing, and another writer may add one at any moment:
        # a cached listing would hide its commit (a stale head, a missed conflict).
        storage_options = {"use_listings_cache": False, **storage_options}
    try:
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
    except ImportError as exc:
        extra = _EXTRAS.get(protocol, protocol)
        raise MissingDependencyError(
            f"Expected the fsspec backend for {protocol}:// to be installed. Got an ImportError "
            f"instead ({exc}). Install it with: pip install 'inshrink-store[{extra}]'"
        ) from exc
    except ValueError as exc:
        raise InvalidInputError(f"Expected a store URL fsspec understands. Got {url!r} instead ({exc}).") from exc
    return fs, root.rstrip("/")


class Storage:
    """A filesystem rooted at the store's URL; every path argument is relative to the root.

    Calling ``Storage(url, storage_options)`` returns the backend for that URL (see the
    package docstring); subclasses implement ``write`` and ``create_exclusive``.
    """

    is_local = False

    def __new__(cls, url: str, storage_options: dict[str, Any] | None = None) -> Storage:
        if cls is Storage:
            from inshrink_store.storage.local import LocalStorage
            from inshrink_store.storage.memory import MemoryStorage
            from inshrink_store.storage.remote import ObjectStorage

            protocol = protocol_of(url) if isinstance(url, str) else ""
            backend: type[Storage] = (
                LocalStorage if protocol in ("file", "local") else MemoryStorage if protocol == "memory" else ObjectStorage
            )
            return super().__new__(backend)
        return super().__new__(cls)

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        if not isinstance(url, str) or not url:
            raise InvalidInputError(f"Expected a store URL or path. Got {url!r} instead.")
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = _filesystem(url, self.storage_options)
        self.protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __getnewargs__(self) -> tuple[str, dict[str, Any]]:  # pickling for process pools
        return self.url, self.storage_options

    def _full(self, path: str) -> str:
        return posixpath.join(self.root, path) if path else self.root

    @contextlib.contextmanager
    def _wrapped(self, op: str, path: str) -> Iterator[None]:
        """Backend failures other than missing/existing files become one StorageError."""
        try:
            yield
        except (FileNotFoundError, FileExistsError, InshrinkError):
            raise
        except Exception as exc:  # noqa: BLE001 - every backend raises its own types
            raise StorageError(
                f"Expected to {op} {path or '/'} in {self.url!r}. Got {type(exc).__name__}: "
                f"{str(exc)[:300]} instead; check the path, credentials, endpoint and network."
            ) from exc

    def _call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        with self._wrapped(op, path):
            return fn()

    # -- the protocol ----------------------------------------------------------------------
    def read(self, path: str) -> bytes:
        """Whole file; ``FileNotFoundError`` if absent."""
        return self._call("read", path, lambda: self.fs.cat_file(self._full(path)))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of a file (fewer if it is shorter); one ranged request."""
        return self._call("read", path, lambda: self.fs.cat_file(self._full(path), start=start, end=end))

    def size(self, path: str) -> int:
        """Bytes of the file ``path``; FileNotFoundError if absent (callers ask about files only)."""
        return int(self._call("stat", path, lambda: self.fs.size(self._full(path))))

    def exists(self, path: str) -> bool:
        """Whether the file ``path`` exists. Callers ask about files only: what a folder
        answers differs between backends (the memory backend says False)."""
        return bool(self._call("check", path, lambda: self.fs.exists(self._full(path))))

    def exists_durably(self, path: str) -> bool:
        """Whether ``path`` exists, and if so that it stays after a crash: what a writer asks
        before it *relies* on an object another writer may have stored (dedup), because its
        commit will name it. On an object store an object that is listed is durable, so
        this is :meth:`exists`; a local disk makes the folder entry durable first."""
        return self.exists(path)

    def write(self, path: str, data: bytes) -> None:
        """Write or overwrite (atomically: a reader sees the old or the new file)."""
        raise NotImplementedError

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Create ``path`` only if it does not exist yet: the single atomic step of a commit.

        Raises ``FileExistsError`` when another writer created it first, and in no case
        leaves a partly written file under ``path``."""
        raise NotImplementedError

    def list(self, prefix: str) -> dict[str, int]:
        """All files under ``prefix`` (recursive) as relative path -> size, sorted by path;
        temp files of writes in progress are never listed."""
        return {rel: size for rel, (size, _mtime) in self._find(prefix).items() if not is_temp(rel)}

    def temp_files(self) -> dict[str, tuple[int, float | None]]:
        """Temp files a crashed local write left behind: path -> (size, mtime)."""
        return {}

    def _find(self, prefix: str) -> dict[str, tuple[int, float | None]]:
        full = self._full(prefix)
        with self._wrapped("list", prefix):
            self.fs.invalidate_cache(full)  # listings must reflect other writers, never a cache
            try:
                found = self.fs.find(full, detail=True)
            except FileNotFoundError:
                return {}
        out = {}
        for name, info in found.items():
            rel = self._relative(name)
            if rel is not None:
                mtime = info.get("mtime")
                out[rel] = (int(info.get("size") or 0), None if mtime is None else _seconds(mtime))
        return dict(sorted(out.items()))

    def _relative(self, name: str) -> str | None:
        root = self.fs._strip_protocol(self.root).rstrip("/")
        name = self.fs._strip_protocol(name)
        if root in ("", "/"):
            return name.lstrip("/")
        if not name.startswith(root + "/"):
            return None
        return name[len(root) + 1 :]

    def delete(self, path: str) -> None:
        """Remove a file; a missing one is fine (gc and lease releases may race)."""
        with self._wrapped("delete", path), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._full(path))

    def require_bucket(self) -> None:
        """Raise :class:`NotFoundError` when the bucket the store's URL names does not exist.

        Why: in a missing bucket every read is "no such file" and every write fails, so
        without this a user is told to ``inshrink init`` a store that cannot be made there.
        A filesystem has no bucket: nothing to check (see ``ObjectStorage``)."""

    def require_exists(self, marker: str) -> None:
        if not self.exists(marker):
            self.require_bucket()  # no store in a missing bucket: say the bucket, not `init`
            raise NotFoundError(
                f"Expected an inshrink store at {self.url!r}. Got no {marker} there instead; "
                f"create one with `inshrink init {self.url}`."
            )


def _seconds(mtime: Any) -> float:
    return float(mtime.timestamp()) if hasattr(mtime, "timestamp") else float(mtime)

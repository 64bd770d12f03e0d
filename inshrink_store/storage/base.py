"""The :class:`Storage` protocol, and :class:`FsspecStorage`: what every backend shares
(fsspec underneath, rooted paths).
Layer: storage (with codecs and structure), above the helpers.

This module knows no backend: the backends (``local``, ``memory``, ``remote``) subclass
:class:`FsspecStorage` here, and :func:`inshrink_store.storage.open_storage` picks one for a
URL, so nothing in the storage package imports what imports it.
"""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, Protocol, TypeVar, cast, runtime_checkable

import fsspec

from inshrink_store.errors import (
    InshrinkError,
    InvalidInputError,
    MissingDependencyError,
    NotFoundError,
    StorageError,
)
from inshrink_store.layout import is_temp

T = TypeVar("T")


@dataclass(frozen=True)
class Scheme:
    """What the store knows of one URL scheme: the ``backend`` that serves it (a local disk,
    this process's memory, or an object store), the pip ``extra`` that installs its fsspec
    backend (None: fsspec's own), and the cloud ``service`` whose settings and credentials
    its URLs take (``"s3"``, ``"gcs"``; None off the cloud)."""

    backend: Literal["local", "memory", "object"]
    extra: str | None = None
    service: Literal["s3", "gcs"] | None = None


#: the schemes a store may live at, the one table of them: the backend is picked from it
#: (:func:`~inshrink_store.storage.backend_for`), and so are the extra a missing backend names,
#: what a URL names on this machine (:func:`local_path`) and the cloud service whose
#: settings it takes (:func:`remote_service`). Why only these: a commit is an exclusive
#: create, which a local disk (a link), memory (a lock) and S3 and GCS (a conditional put the
#: server decides) make atomic; another fsspec backend would fail late (ftp://, http://: a
#: connection error that names no cause) or create racily
SCHEMES: Mapping[str, Scheme] = MappingProxyType({
    "file": Scheme("local"),
    "local": Scheme("local"),
    "memory": Scheme("memory"),
    "s3": Scheme("object", "s3", "s3"),
    "s3a": Scheme("object", "s3", "s3"),
    "gs": Scheme("object", "gcs", "gcs"),
    "gcs": Scheme("object", "gcs", "gcs"),
})
SUPPORTED_PROTOCOLS = tuple(SCHEMES)
SUPPORTED_URLS = "a file path (or file://), memory://, s3:// (or s3a://) or gs:// (or gcs://)"


def protocol_of(url: str) -> str:
    """The scheme of a store URL; ``"file"`` for a plain path."""
    return url.split("://", 1)[0] if "://" in url else "file"


def scheme_of(url: str) -> Scheme | None:
    """The table's entry for ``url``'s scheme; None for a scheme no store may live at."""
    return SCHEMES.get(protocol_of(url))


def local_path(url: str) -> str | None:
    """The path on this machine's disk a store URL names (a plain path, or a ``file://``
    URL's path); None for memory, an object store or an unsupported scheme."""
    scheme = scheme_of(url)
    if scheme is None or scheme.backend != "local":
        return None
    return url.split("://", 1)[1] if "://" in url else url


def remote_service(url: str) -> Literal["s3", "gcs"] | None:
    """The cloud service whose settings a store URL takes (``"s3"`` for s3:// and s3a://,
    ``"gcs"`` for gs:// and gcs://); None for a path, memory or an unsupported scheme."""
    scheme = scheme_of(url)
    return None if scheme is None else scheme.service


def require_supported(url: str) -> None:
    """Refuse a URL whose scheme no backend here supports, before anything connects."""
    protocol = protocol_of(url)
    if protocol not in SUPPORTED_PROTOCOLS:
        raise InvalidInputError(
            f"Expected a store URL that is {SUPPORTED_URLS}. Got {url!r} instead: {protocol}:// is not "
            "supported (a store needs an atomic exclusive create to commit); use one of those.")


def filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of a store URL and the store's root in it, as the store's own
    :class:`Storage` gets them: for a tool that manages the files *around* a store (the demo
    empties the folder it made). The store's own modules reach files only through
    :class:`Storage`'s methods, which check, bound and wrap every access."""
    require_supported(url)
    storage_options = dict(storage_options or {})
    protocol = protocol_of(url)
    if SCHEMES[protocol].backend == "object":
        # Refs are found by listing, and another writer may add one at any moment:
        # a cached listing would hide its commit (a stale head, a missed conflict).
        storage_options = {"use_listings_cache": False, **storage_options}
    try:
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
    except ImportError as exc:
        extra = SCHEMES[protocol].extra or protocol
        raise MissingDependencyError(
            f"Expected the fsspec backend for {protocol}:// to be installed. Got an ImportError "
            f"instead ({exc}). Install it with: pip install 'inshrink-store[{extra}]'"
        ) from exc
    except ValueError as exc:
        raise InvalidInputError(f"Expected a store URL fsspec understands. Got {url!r} instead ({exc}).") from exc
    return fs, root.rstrip("/")


@runtime_checkable
class Storage(Protocol):
    """A filesystem rooted at a store's URL: the few operations the store needs, every path
    relative to the root. :func:`~inshrink_store.storage.open_storage` returns one for a URL.

    Missing files raise the built-in ``FileNotFoundError`` and a lost exclusive create
    ``FileExistsError``; any other backend failure is a
    :class:`~inshrink_store.errors.StorageError` naming the operation, the path and the cause.

    The capability flags say what a backend guarantees, so callers ask them instead of the
    backend's type:

    ``supports_rename``
        The backend moves a file into place atomically (``os.replace``/``os.link`` on a local
        disk), so its writes go through a temp file (``*.tmp-<uuid>``) and a rename. Why it
        matters: only there can a crash leave temp files behind (:meth:`temp_files`, which gc
        sweeps), and only there may code rely on a rename. Where False, a write is one atomic
        put (an object store's whole-object PUT, a ``memory://`` dict entry) and there is no
        atomic rename (fsspec's ``mv`` there is a copy, then a delete).
    ``atomic_create``
        :meth:`create_exclusive` is decided atomically by the backend (a hard link, a lock, a
        conditional put that the server decides): of two racing writers exactly one wins,
        and the loser gets ``FileExistsError``. Why it matters: every commit point (a ref,
        a fence, a lease, the store's settings) is one exclusive create; without this two
        writers could both believe they committed. A store is only opened on a backend
        that has it (:data:`SUPPORTED_PROTOCOLS`).
    ``listing_consistent``
        :meth:`list` shows every file whose write returned before it, whoever wrote it
        (no listing cache; S3 and GCS list strongly consistently). Why it matters: branch
        heads, tags, leases and fences are found by listing; a stale listing would hide
        another writer's commit (a stale head, a missed conflict) or a lease gc must
        respect.

    ``is_local`` says something else: the store is a path on this machine's disk
    (``root`` is a local path, and writes pay a fsync rather than a request). ``is_remote``:
    every operation is a request over a network (an object store), which waits far longer
    than it computes, so callers run several at once rather than one per core. A store in
    this process's memory is neither.
    """

    url: str
    storage_options: dict[str, Any]
    #: the store's root: a local path where ``is_local``, else the backend's own path
    root: str
    protocol: str
    is_local: bool
    is_remote: bool
    supports_rename: bool
    atomic_create: bool
    listing_consistent: bool

    def read(self, path: str) -> bytes:
        """Whole file; ``FileNotFoundError`` if absent."""
        ...

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of a file (fewer if it is shorter); one ranged request."""
        ...

    def read_start(self, path: str, length: int) -> bytes:
        """The first ``length`` bytes of a file (fewer if it is shorter), streamed in one block
        of ``length`` bytes: what a caller falls back on where :meth:`read_range` failed (no
        ranged requests there), still never a whole-file download."""
        ...

    def size(self, path: str) -> int:
        """Bytes of the file ``path``; ``FileNotFoundError`` if absent."""
        ...

    def exists(self, path: str) -> bool:
        """Whether the file ``path`` exists (callers ask about files only)."""
        ...

    def exists_durably(self, path: str) -> bool:
        """Whether ``path`` exists, and if so that it stays after a crash (a dedup check)."""
        ...

    def write(self, path: str, data: bytes) -> None:
        """Write or overwrite (atomically: a reader sees the old or the new file)."""
        ...

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Create ``path`` only if it does not exist yet: the single atomic step of a commit;
        ``FileExistsError`` when another writer created it first."""
        ...

    def list(self, prefix: str) -> dict[str, int]:
        """All files under ``prefix`` (recursive) as relative path -> size, sorted by path."""
        ...

    def temp_files(self) -> dict[str, tuple[int, float | None]]:
        """Temp files a crashed write left behind: path -> (size, mtime)."""
        ...

    def delete(self, path: str) -> None:
        """Remove a file; a missing one is fine."""
        ...

    def require_bucket(self) -> None:
        """Raise :class:`NotFoundError` when the bucket the store's URL names does not exist."""
        ...

    def require_exists(self, marker: str) -> None:
        """Raise :class:`NotFoundError` naming the store when ``marker`` is missing."""
        ...


class FsspecStorage:
    """:class:`Storage` over an fsspec filesystem rooted at the store's URL: what every backend
    shares. Subclasses implement ``write`` and ``create_exclusive`` and set the capability
    flags (see :class:`Storage`); build one through
    :func:`~inshrink_store.storage.open_storage`, which picks the subclass for a URL."""

    is_local: bool = False
    is_remote: bool = False
    supports_rename: bool = False
    atomic_create: bool = False
    listing_consistent: bool = False

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        if not isinstance(url, str) or not url:
            raise InvalidInputError(f"Expected a store URL or path. Got {url!r} instead.")
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = filesystem(url, self.storage_options)
        self.protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

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
        return self._call("read", path, lambda: cast(bytes, self.fs.cat_file(self._full(path))))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of a file (fewer if it is shorter); one ranged request."""
        return self._call("read", path, lambda: cast(bytes, self.fs.cat_file(self._full(path), start=start, end=end)))

    def read_start(self, path: str, length: int) -> bytes:
        """The first ``length`` bytes of a file through a file handle whose block is ``length``
        bytes (one request of that size on an object store, not a ranged one)."""
        def read() -> bytes:
            with self.fs.open(self._full(path), "rb", block_size=length) as handle:
                return bytes(handle.read(length))

        return self._call("read", path, read)

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
        """Temp files a crashed write left behind: path -> (size, mtime). Only a backend
        whose writes go through a rename (``supports_rename``) makes temp files; on any other
        a write is one atomic put, so there are none to look for (and no listing is spent)."""
        if not self.supports_rename:
            return {}
        return {rel: info for rel, info in self._find("").items() if is_temp(rel)}

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

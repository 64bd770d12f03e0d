"""fsspec adapter: one URL -> one rooted filesystem with the few operations the store needs.

The store only ever needs: read a file, write a content-addressed file (idempotent,
so a plain overwrite is safe), create a file exclusively (the commit point), list
a prefix with sizes, and delete (gc). Keeping the surface this small is what lets
every fsspec backend give the same guarantees. Missing files raise the built-in
``FileNotFoundError`` on every backend; exclusive create raises ``FileExistsError``.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import threading
import uuid
from typing import Any

import fsspec

from inshrink_store.errors import FormatError, IntegrityError, MissingDependencyError, NotFoundError

_MEMORY_LOCK = threading.Lock()
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def _filesystem(url: str, storage_options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in _EXTRAS:
        # Refs are found by listing, and another writer may add one at any moment:
        # a cached listing would hide its commit (a stale head, a missed conflict).
        storage_options = {"use_listings_cache": False, **storage_options}
    try:
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
    except ImportError as exc:
        protocol = url.split("://", 1)[0]
        extra = _EXTRAS.get(protocol, protocol)
        raise MissingDependencyError(
            f"Expected the fsspec backend for {protocol}:// to be installed. Got an ImportError "
            f"instead ({exc}). Install it with: pip install 'inshrink-store[{extra}]'"
        ) from exc
    except ValueError as exc:
        raise FormatError(f"Expected a store URL fsspec understands. Got {url!r} instead ({exc}).") from exc
    return fs, root.rstrip("/")


def _fsync_directory(directory: str) -> None:
    """Make a new directory entry durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Storage:
    """A filesystem rooted at the store's URL; every path argument is relative to the root."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        if not isinstance(url, str) or not url:
            raise FormatError(f"Expected a store URL or path. Got {url!r} instead.")
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = _filesystem(url, self.storage_options)
        self.protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.is_local = self.protocol in ("file", "local")

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def _full(self, path: str) -> str:
        return posixpath.join(self.root, path) if path else self.root

    def read(self, path: str) -> bytes:
        """Whole file; ``FileNotFoundError`` if absent."""
        full = self._full(path)
        if self.is_local and os.path.exists(full):
            self._inside(full)
        return self.fs.cat_file(full)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._full(path)))

    def _inside(self, full: str) -> None:
        """Local stores: refuse a folder that a symlink leads out of the store's root.

        Every path we build is relative and checked, but the folders on disk are not ours
        alone: ``objects/ab -> /etc`` would make a write land outside the store."""
        directory = os.path.realpath(os.path.dirname(full))
        root = os.path.realpath(self.root or ".")
        if directory != root and not directory.startswith(root.rstrip(os.sep) + os.sep):
            raise IntegrityError(
                f"Expected {os.path.dirname(full)!r} to be a folder inside the store {self.url!r}. "
                f"Got a symlink that leads to {directory!r} instead; nothing was written there. "
                "Remove the link (stores never create links)."
            )

    def write(self, path: str, data: bytes) -> None:
        """Write or overwrite; atomic on a local disk (temp file, then rename)."""
        full = self._full(path)
        if self.is_local:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            self._inside(full)
            tmp = f"{full}.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, full)
        else:
            self.fs.pipe_file(full, data)

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Create ``path`` only if it does not exist yet: the single atomic step of a commit.

        Raises ``FileExistsError`` when another writer created it first, and in no
        case leaves a partly written file under ``path``: a reader sees either no
        ref or the whole ref.

        - local disk: write and fsync a temp file, then ``os.link`` it into place;
          a hard link fails atomically if the name exists, and a crash before it
          leaves only an ignored temp file (never an empty ref, as O_EXCL-then-write
          would);
        - ``memory://``: one process-wide lock around check and write (the memory
          filesystem is a process-global dict; fsspec's own create is check-then-set);
        - object stores: a conditional put (S3 ``If-None-Match: *``, GCS
          ``ifGenerationMatch=0``) through ``pipe_file(mode="create")``, which the
          server decides atomically.
        """
        full = self._full(path)
        if self.is_local:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            self._inside(full)
            self._create_exclusive_local(full, data)
        elif self.protocol == "memory":
            with _MEMORY_LOCK:
                if self.fs.exists(full):
                    raise FileExistsError(full)
                self.fs.pipe_file(full, data)
        else:
            self.fs.pipe_file(full, data, mode="create")

    @staticmethod
    def _create_exclusive_local(full: str, data: bytes) -> None:
        directory = os.path.dirname(full)
        os.makedirs(directory, exist_ok=True)
        tmp = f"{full}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            try:
                os.link(tmp, full)
            except FileExistsError:
                raise
            except OSError:
                # A filesystem without hard links: O_EXCL still decides the race,
                # at the cost of a window where the file exists but is empty.
                fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.write(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _fsync_directory(directory)

    def list(self, prefix: str) -> dict[str, int]:
        """All files under ``prefix`` (recursive) as relative path -> size, sorted by path."""
        full = self._full(prefix)
        self.fs.invalidate_cache(full)  # listings must reflect other writers, never a cache
        try:
            found = self.fs.find(full, detail=True)
        except FileNotFoundError:
            return {}
        base = self.root + "/" if self.root else ""
        out = {}
        for name, info in found.items():
            name = name if not name.startswith(self.fs._strip_protocol(base)) else name
            rel = self._relative(name)
            if rel is not None and ".tmp-" not in rel:
                out[rel] = int(info.get("size") or 0)
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
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._full(path))

    def require_exists(self, marker: str) -> None:
        if not self.exists(marker):
            raise NotFoundError(
                f"Expected an inshrink store at {self.url!r}. Got no {marker} there instead; "
                f"create one with `inshrink init {self.url}`."
            )

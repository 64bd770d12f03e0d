"""A store on a local (or mounted) disk.
Layer: storage (with codecs and structure), above the helpers.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from typing import Any

from inshrink_store.errors import IntegrityError
from inshrink_store.storage.atomic import atomic_write, fsync_directory
from inshrink_store.storage.base import FsspecStorage


class LocalStorage(FsspecStorage):
    """Atomic writes through a temp file (see ``atomic.py``); never through a symlink that
    leads out of the store.

    Capabilities (see :class:`~inshrink_store.storage.base.Storage`): a rename
    (``os.replace``) puts every write in place, so a crash can leave temp files (gc sweeps
    them); an exclusive create is an ``os.link`` the filesystem decides (on a filesystem
    without hard links ``O_EXCL`` still decides the race, see ``atomic.py``); a listing
    reads the folders themselves, so it shows every write that returned."""

    is_local = True
    supports_rename = True
    atomic_create = True
    listing_consistent = True

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url, storage_options)
        self._checked_folders: set[str] = set()
        self._real_root: str | None = None
        #: folders whose own name in their parent this handle knows to be durable, and the
        #: parents to fsync (at the next commit point) for the others it wrote into
        self._durable_folders: set[str] = set()
        self._pending_parents: set[str] = set()
        self._durability_lock = threading.Lock()
        self._sync_lock = threading.Lock()  # one sync_folders at a time (see there)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for process pools without its locks; the copy starts knowing no folder
        durable or checked (it fsyncs and checks again: safe, at most a few more calls)."""
        state = dict(self.__dict__)
        for name in ("_durability_lock", "_sync_lock"):
            del state[name]
        state.update(_checked_folders=set(), _durable_folders=set(), _pending_parents=set())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._durability_lock = threading.Lock()
        self._sync_lock = threading.Lock()

    def _inside(self, full: str, writing: bool = False) -> None:
        """Refuse a folder that a symlink leads out of the store's root.

        Every path we build is relative and checked, but the folders on disk are not ours
        alone: ``objects/ab -> /etc`` would make a write land outside the store. A write
        checks every time (``writing``): a folder swapped for a link after this handle
        first wrote into it must not take the next write out of the store, and below the
        root that is one ``lstat`` per folder level (two for an object), against the
        temp file, fsync and rename of the write itself. A read trusts a folder it found
        inside once: a restore reads hundreds of objects from the same 256 folders, and
        a read through a link writes nothing."""
        folder = os.path.dirname(full)
        if not writing and folder in self._checked_folders:
            return
        if self._linked_below_root(folder, trust_checked=not writing):
            self._refuse_outward(folder)
        self._checked_folders.add(folder)

    def _refuse_outward(self, folder: str) -> None:
        """Raise unless ``folder``, links resolved, is the store's root or inside it."""
        directory = os.path.realpath(folder)
        if self._real_root is None:
            self._real_root = os.path.realpath(self.root or ".")
        root = self._real_root
        if directory != root and not directory.startswith(root.rstrip(os.sep) + os.sep):
            raise IntegrityError(
                f"Expected {folder!r} to be a folder inside the store {self.url!r}. "
                f"Got a symlink that leads to {directory!r} instead; nothing was written there. "
                "Remove the link (stores never create links)."
            )

    def _linked_below_root(self, folder: str, trust_checked: bool = True) -> bool:
        """Whether a folder between the store's root and ``folder`` (itself included) is a
        symlink, or ``folder`` is not below the root as written (then the caller resolves it).
        With ``trust_checked`` the folders this handle checked before are skipped (reads).

        Why not ``realpath`` alone: it checks every component from ``/`` down, six or more
        system calls per folder, and a fresh store's first save meets a new folder for
        nearly every object (a quarter of its non-coding CPU went there). Below the root
        only the components need one ``lstat`` each; the root itself may be a link
        (it is resolved once, for the comparison)."""
        root = (self.root or ".").rstrip(os.sep) or os.sep
        if not folder.startswith(root + os.sep):
            return folder != root
        parts = folder[len(root) + 1:].split(os.sep)
        if any(part in ("", os.curdir, os.pardir) for part in parts):
            return True  # not a plain path below the root (".." could climb out of it)
        at = root
        for part in parts:
            at = os.path.join(at, part)
            if trust_checked and at in self._checked_folders:
                continue
            try:
                mode = os.lstat(at).st_mode
            except FileNotFoundError:
                return False  # nothing below a missing folder exists yet, links included
            if stat.S_ISLNK(mode):
                return True
        return False

    def read(self, path: str) -> bytes:
        full = self._full(path)
        if os.path.exists(full):
            self._inside(full)
        return super().read(path)

    def read_mapped(self, path: str) -> bytes | memoryview:
        """:meth:`read` of a file that is never rewritten in place (a content-addressed
        object), as a read-only view of the file mapped into memory: the page cache's own
        pages, not a copy of them into fresh memory (reading an ``export --all``'s 790 MiB of
        objects into new bytes was a fifth of its CPU time, issue 43 item 10). The mapping
        lives as long as the view; a file cut short while mapped would fault on access, so
        only a reader that drops the view at once (a chunk's decode) should ask for one. A
        file system that cannot map files is read as :meth:`read` reads."""
        full = self._full(path)
        if os.path.exists(full):
            self._inside(full)

        def read() -> bytes | memoryview:
            with open(full, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return b""  # nothing to map
                try:
                    return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                except (OSError, ValueError):  # no mmap there (some network and FUSE mounts)
                    return f.read()

        return self._call("read", path, read)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        full = self._full(path)
        if os.path.exists(full):
            self._inside(full)
        return super().read_range(path, start, end)

    def read_start(self, path: str, length: int) -> bytes:
        full = self._full(path)
        if os.path.exists(full):
            self._inside(full)
        return super().read_start(path, length)

    def exists_durably(self, path: str) -> bool:
        """:meth:`exists`, then a fsync of the file's folder when it is there (the folder's
        own name is made durable at the next commit point, see :meth:`sync_folders`).

        Why: a writer renames a fsynced temp file into place and only then fsyncs the folder,
        so for a moment an object is visible but its name not yet durable. Another writer
        that dedups against it in that moment and commits could, after a power loss on a
        filesystem that logs each file on its own (btrfs), name an object that is gone. The
        fsync closes that window; on a folder with nothing pending it costs ~50 us, and a
        lookup that finds the file is rare (a chunk equal to the parent's is taken without
        one)."""
        full = self._full(path)

        def check() -> bool:
            if not os.path.exists(full):
                return False
            self._inside(full)
            fsync_directory(os.path.dirname(full))
            self._note_folder(full)  # the folder itself may be new: its parent at the commit point
            return True

        return self._call("check", path, check)

    def _note_folder(self, full: str) -> None:
        """Remember that the folders from ``full``'s up to the store's root (and the root's
        own name) must be durable before the next commit point, unless known to be."""
        folder = os.path.dirname(full)
        if folder in self._durable_folders:
            return
        with self._durability_lock:
            while folder and folder not in self._durable_folders:
                parent = os.path.dirname(folder)
                if parent == folder:
                    break
                self._pending_parents.add(parent)
                self._durable_folders.add(folder)  # once its parent is fsynced (sync_folders)
                if folder == self.root.rstrip(os.sep):
                    break
                folder = parent

    def sync_folders(self) -> None:
        """fsync the parents of every folder this handle wrote into whose name in its parent
        is not known durable yet: ``objects/`` once for all the new ``objects/<xx>/``.

        Why here: a file's name is durable when its write returns (its folder is fsynced),
        but a folder made a moment ago, by this writer or another, has its own name in its
        parent, which only a fsync of that parent makes durable. Doing it per write cost one
        more fsync per new folder (a fresh store's first save makes ~80); every commit point
        (a fence, a ref, the store's settings: the exclusive creates) runs this first, so
        whatever a published ref names is durable, with a handful of fsyncs per commit."""
        # serialized: a second commit point in another thread must not return while the
        # parents it would have fsynced are still being fsynced by the first
        with self._sync_lock:
            with self._durability_lock:
                parents = sorted(self._pending_parents, key=len, reverse=True)  # deepest first
                self._pending_parents.clear()
            for parent in parents:
                with self._wrapped("write", parent):
                    fsync_directory(parent)

    def _write(self, path: str, data: bytes, exclusive: bool) -> None:
        full = self._full(path)
        with self._wrapped("write", path):
            self._inside(full, writing=True)  # before anything is created: the write makes a missing folder
            if exclusive:
                self.sync_folders()  # an exclusive create is a commit point: see sync_folders
            atomic_write(full, data, exclusive=exclusive)
            self._note_folder(full)
            if exclusive:
                self.sync_folders()  # and the new file's own folder (a new branch's refs folder)

    def write(self, path: str, data: bytes) -> None:
        self._write(path, data, exclusive=False)

    def create_exclusive(self, path: str, data: bytes) -> None:
        """``os.link`` of a fsynced temp file: fails atomically if the name exists."""
        self._write(path, data, exclusive=True)

    @property
    def directory(self) -> str:
        """The store's folder on disk."""
        return self.root

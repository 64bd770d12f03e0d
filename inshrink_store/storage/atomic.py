"""The one atomic-write helper for local disks: a fsynced temp file, then into place.
Layer: storage (with codecs and structure), above the helpers.

``replace`` (``os.replace``) gives an atomic overwrite; ``exclusive`` (``os.link``)
gives an atomic create that fails if the name exists. Either way a crash leaves at
most a temp file (``*.tmp-<uuid>``, never listed, collected by gc), never a half file;
and once the call returns, the file and its name in its folder are durable. The folder's
own name in its parent is the caller's (``LocalStorage`` makes it durable before its next
commit point). The one exception is a filesystem without hard links, where an exclusive
create falls back to ``O_EXCL``: there a crash can leave an empty or partial file under
the name (see the fallback below).
"""

from __future__ import annotations

import contextlib
import os
import uuid

from inshrink_store.layout import TEMP_MARKER


def fsync_directory(directory: str) -> None:
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


def atomic_write(full: str, data: bytes, *, exclusive: bool) -> None:
    """Write ``data`` to ``full`` atomically; with ``exclusive``, ``FileExistsError`` if
    ``full`` exists (decided by the filesystem, so two racing writers cannot both win)."""
    directory = os.path.dirname(full)
    tmp = f"{full}{TEMP_MARKER}{uuid.uuid4().hex}"
    try:  # the folder nearly always exists: try first, create it only when missing
        f = open(tmp, "wb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        os.makedirs(directory, exist_ok=True)
        f = open(tmp, "wb")  # noqa: SIM115
    with f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        if not exclusive:
            os.replace(tmp, full)
        else:
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
    fsync_directory(directory)

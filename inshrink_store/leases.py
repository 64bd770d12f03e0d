"""Leases: writers and gc announce themselves, so gc never deletes an in-flight commit.

A commit writes its objects, trees and snapshot first and makes them reachable last (the
ref). To gc, everything before that moment looks unreachable, and a chunk the writer
skipped because an old version already stored it may be exactly what gc is deleting.
So both sides take a lease, a small file under ``leases/``, and check the other's:

- a writer creates ``leases/writers/<id>`` and *then* looks for ``leases/gc``;
- gc creates ``leases/gc`` (exclusively) and *then* lists ``leases/writers/``.

Whichever of the two comes second sees the first (every backend we support is strongly
consistent for a read after a write), so a gc and a commit never overlap: the writer
gets a ``ConflictError`` before it writes anything, or gc refuses naming the writers.
A lease older than ``stale_after`` seconds (default one hour) is taken to belong to a
process that died: it is ignored, and gc deletes it. Leases carry their creation time,
host and pid in JSON, so no backend's mtime semantics matter.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from inshrink_store.errors import ConflictError

LEASES = "leases"
WRITERS = f"{LEASES}/writers"
GC_LEASE = f"{LEASES}/gc"
STALE_AFTER = 3600.0


@dataclass(frozen=True)
class Lease:
    path: str
    created: float
    host: str
    pid: int

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.created

    def describe(self) -> str:
        return f"{self.path} (host {self.host}, pid {self.pid}, {self.age():.0f} s old)"


def _payload() -> bytes:
    return json.dumps({"created": time.time(), "host": socket.gethostname(), "pid": os.getpid()},
                      sort_keys=True).encode()


def _read(storage: Any, path: str) -> Lease | None:
    """The lease at ``path``; None if it is gone. An unreadable lease counts as fresh
    from now (safer than deleting under a live writer); gc will age it out."""
    try:
        raw = storage.read(path)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        return Lease(path, float(doc["created"]), str(doc["host"]), int(doc["pid"]))
    except (ValueError, KeyError, TypeError):
        return Lease(path, time.time(), "?", -1)


def acquire_writer(storage: Any, stale_after: float = STALE_AFTER) -> str:
    """Announce a writer; raise ConflictError (having written nothing else) if gc runs."""
    path = f"{WRITERS}/{time.time_ns():020d}-{uuid.uuid4().hex}"
    storage.write(path, _payload())
    gc = _read(storage, GC_LEASE)
    if gc is not None and gc.age() < stale_after:
        release(storage, path)
        raise ConflictError(
            f"Expected no gc running on {storage.url!r} while committing. Got a gc lease "
            f"{gc.describe()} instead; nothing was written: retry when it finishes (if that gc "
            f"died, its lease expires after {stale_after:.0f} s, or delete {GC_LEASE})."
        )
    return path


def release(storage: Any, path: str | None) -> None:
    if path is not None:
        storage.delete(path)


def writers(storage: Any) -> list[Lease]:
    """Every writer lease, oldest first."""
    found = [_read(storage, p) for p in storage.list(WRITERS)]
    return sorted((lease for lease in found if lease is not None), key=lambda lease: lease.path)


def acquire_gc(storage: Any, stale_after: float = STALE_AFTER) -> tuple[str, list[Lease]]:
    """Take the gc lease; return it and the stale writer leases gc may delete.

    Raises ConflictError naming them if another gc or a live writer holds a lease."""
    for _ in range(2):
        try:
            storage.create_exclusive(GC_LEASE, _payload())
            break
        except FileExistsError:
            other = _read(storage, GC_LEASE)
            if other is not None and other.age() < stale_after:
                raise ConflictError(
                    f"Expected no other gc running on {storage.url!r}. Got its lease "
                    f"{other.describe()} instead; nothing was deleted."
                ) from None
            storage.delete(GC_LEASE)  # a gc that died: its lease has expired
    else:
        raise ConflictError(f"Expected to take the gc lease on {storage.url!r}. Got another gc first.")
    found = writers(storage)
    live = [lease for lease in found if lease.age() < stale_after]
    if live:
        release(storage, GC_LEASE)
        names = "; ".join(lease.describe() for lease in live)
        raise ConflictError(
            f"Expected no commit in progress on {storage.url!r} while collecting garbage. Got "
            f"{len(live)} writer lease(s) instead: {names}. Nothing was deleted; run gc when the "
            f"writers are done (a writer that died is ignored once its lease is {stale_after:.0f} s old)."
        )
    return GC_LEASE, [lease for lease in found if lease.age() >= stale_after]

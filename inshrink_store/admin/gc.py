"""gc: delete what no ref reaches, safely beside any number of writers and gc runs.
Layer: admin, below the facade (which delegates to it) and above the write session.

The protocol and why it never loses a version: docs/reference/format.md ("gc protocol").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

from inshrink_store import leases, residual
from inshrink_store.admin.reachability import (
    load_kept_residual,
    reachable,
    reading,
    residuals_near_heads,
    with_bases,
)
from inshrink_store.errors import (
    ConflictError,
    FormatError,
    IntegrityError,
    InvalidInputError,
    NotFoundError,
)
from inshrink_store.layout import (
    BRANCHES,
    OBJECTS,
    RESIDUALS,
    SNAPSHOTS,
    TREES,
    branch_ref_path,
    classify,
    object_path,
    parse_branch_listing,
)
from inshrink_store.object_format import HEADER_SIZE
from inshrink_store.parts import StoreParts
from inshrink_store.storage import Storage

Progress = Callable[[str, int, int], None]


@dataclass
class GcReport:
    dry_run: bool
    kept_snapshots: int
    deleted: dict[str, list[str]]
    freed_bytes: int
    #: refs naming a snapshot that does not exist: reported (see `inshrink verify`), never fatal
    dangling: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        """Counts and bytes, two example paths: a gc deletes thousands of paths, and the full
        lists (in ``deleted``) made ``ck.last_gc`` in a notebook a screen of object names."""
        counts = ", ".join(f"{len(paths)} {group}" for group, paths in self.deleted.items() if paths) or "nothing"
        examples = [p for paths in self.deleted.values() for p in paths[:2]][:2]
        shown = f" (e.g. {', '.join(examples)})" if examples else ""
        more = ", ..." if len(self.dangling) > 1 else ""
        dangling = f", dangling: {len(self.dangling)} ({self.dangling[0]}{more})" if self.dangling else ""
        return (f"GcReport(dry_run={self.dry_run}, kept_snapshots={self.kept_snapshots}, "
                f"freed_bytes={self.freed_bytes}, deleted: {counts}{shown}{dangling})")

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "kept_snapshots": self.kept_snapshots,
                "deleted": {k: len(v) for k, v in self.deleted.items()}, "freed_bytes": self.freed_bytes,
                "dangling": list(self.dangling)}


class GcOptions(TypedDict, total=False):
    """The keywords of :class:`GarbageCollector` besides ``keep_last`` (what
    ``Repository.garbage_collector(**options)`` passes on)."""

    stale_after: float
    wait: float
    progress: Progress | None
    on_wait: Callable[[str], None] | None
    keep_alive: bool
    residuals_only: bool


class GarbageCollector:
    """One gc run in explicit steps: ``start`` (lease), ``mark``, ``sweep``, ``finish``.

    ``run()`` does them in order; the steps exist so tests can interleave a gc with
    writers, tags and other gc runs at every point where it talks to the store.

    Why a run never loses a version (docs/reference/format.md has the full argument):
    the lease is taken before writer leases are read, reachability is computed only
    after every writer is known to be finished or fenced off, and each delete happens
    only while the lease is valid by this process's own clock. Deletion goes top-down
    (ref files, snapshots, trees, then objects, deltas before their bases), so a gc cut
    short never leaves an existing document whose parts are gone — which is what lets
    a writer trust "this object exists" when it dedups.
    """

    def __init__(self, parts: StoreParts, keep_last: int | None = None, *, stale_after: float = leases.STALE_AFTER,
                 wait: float = 0.0, progress: Progress | None = None,
                 on_wait: Callable[[str], None] | None = None, keep_alive: bool = True,
                 residuals_only: bool = False) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise InvalidInputError(f"Expected keep_last to be an integer >= 1. Got {keep_last!r} instead.")
        self.parts, self.keep_last, self.stale_after = parts, keep_last, stale_after
        #: only drop restore residuals no version keeps any more (see :func:`_plan_residuals`)
        self.residuals_only = residuals_only
        self.wait, self.progress, self.on_wait, self.keep_alive = wait, progress, on_wait, keep_alive
        self.lease: leases.HeldLease | None = None
        self.dead: list[leases.Lease] = []
        self.report: GcReport | None = None
        self._queue: list[str] = []
        self._done = 0

    def start(self) -> None:
        self.lease, self.dead = leases.acquire_gc(
            self.parts.storage, wait=self.wait, stale_after=self.stale_after, on_wait=self.on_wait)
        if self.keep_alive:
            self.lease.keep_alive()

    def mark(self, *, dry_run: bool = False) -> GcReport:
        """Decide what to delete (nothing is deleted here)."""
        if not dry_run:
            self._check_lease("marking")
        self.report = (_plan_residuals(self.parts, dry_run) if self.residuals_only else
                       _plan(self.parts, self.keep_last, self.dead, dry_run=dry_run, stale_after=self.stale_after))
        self._queue = [p for group in ("refs", "snapshots", "trees", "residuals", "objects", "temp", "leases")
                       for p in self.report.deleted[group]]
        return self.report

    def sweep(self, limit: int | None = None) -> int:
        """Delete up to ``limit`` more paths (all by default); returns how many are left."""
        storage = self.parts.storage
        stop = len(self._queue) if limit is None else min(len(self._queue), self._done + limit)
        while self._done < stop:
            self._check_lease("deleting")
            path = self._queue[self._done]
            storage.delete(path)
            self._done += 1
            if self.progress:
                self.progress(path, self._done, len(self._queue))
        return len(self._queue) - self._done

    def finish(self) -> None:
        if self.lease is not None:
            self.lease.release()

    def run(self, *, dry_run: bool = False) -> GcReport:
        if dry_run:
            return self.mark(dry_run=True)
        self.start()
        try:
            report = self.mark()
            self.sweep()
            return report
        finally:
            self.finish()

    def _check_lease(self, doing: str) -> None:
        lease = self.lease
        if lease is None:
            raise ConflictError("Expected gc to hold its lease. Got none: call start() first.")
        if not lease.keep_alive_running():
            lease.renew()  # no keeper thread (tests): renew here, which refuses once lapsed
        if not lease.valid():
            raise ConflictError(
                f"Expected gc's lease {lease.path} on {self.parts.url!r} to be valid while {doing}. "
                "Got it lapsed (not renewed in time) or broken by a writer that judged this gc "
                "dead instead; gc stopped. What it deleted so far was unreachable garbage; run "
                "gc again."
            )


def gc(parts: StoreParts, keep_last: int | None = None, *, dry_run: bool = False,
       progress: Progress | None = None, stale_after: float = leases.STALE_AFTER,
       wait: float = 0.0, on_wait: Callable[[str], None] | None = None) -> GcReport:
    """Delete unreachable snapshots, trees, objects, stale ref files and dead leases.

    Fails closed: any error reading what decides what to keep stops it before it deletes
    anything, with an error naming what could not be read (see
    :mod:`~inshrink_store.admin.reachability`). Safe beside any number of writers, tag and
    branch creations and other gc runs (see :class:`GarbageCollector`). Refuses with ``ConflictError`` (nothing deleted) while a
    commit is in progress or another gc runs, after waiting up to ``wait`` seconds. A
    writer lease unrenewed for ``stale_after`` seconds (or whose process is gone) is
    fenced off: that writer can no longer publish. A dry run takes no lease.
    """
    return GarbageCollector(parts, keep_last, stale_after=stale_after, wait=wait, progress=progress,
                            on_wait=on_wait).run(dry_run=dry_run)


def _plan(parts: StoreParts, keep_last: int | None, dead: list[leases.Lease], *, dry_run: bool,
          stale_after: float) -> GcReport:
    live = reachable(parts, keep_last, progress=None)
    keep_objects = with_bases(parts, live.objects)
    storage = parts.storage
    listing = storage.list("")
    deleted: dict[str, list[str]] = {"refs": [], "snapshots": [], "trees": [], "residuals": [], "objects": []}
    garbage_objects: list[str] = []
    for path in listing:
        found = classify(path)
        if found is None:
            continue
        kind, ident = found
        if kind == SNAPSHOTS and ident not in live.snapshots:
            deleted["snapshots"].append(path)
        elif kind == TREES and ident not in live.trees:
            deleted["trees"].append(path)
        elif kind == RESIDUALS and ident not in live.residuals:
            deleted["residuals"].append(path)
        elif kind == OBJECTS and ident not in keep_objects:
            garbage_objects.append(ident)
    deleted["objects"] = [object_path(oid) for oid in _deltas_first(parts, garbage_objects)]
    for branch, seqs in parse_branch_listing([p for p in listing if p.startswith(BRANCHES + "/")]).items():
        for seq in seqs[:-1]:  # the highest seq stays: it is the branch head and the commit counter
            path = branch_ref_path(branch, seq)
            try:
                with reading(f"ref file {path}"):
                    target = parts.refs.read(path)
            except (NotFoundError, IntegrityError):
                continue  # gone, or malformed (verify's to report, not gc's to guess): kept
            if target not in live.snapshots:
                deleted["refs"].append(path)
    temp = _temp_leftovers(storage, stale_after)
    deleted["temp"] = sorted(temp)
    if dry_run:
        dead = [w for w in leases.writers(storage) if w.process_gone() or w.wall_age() >= stale_after]
    deleted["leases"] = leases.leftovers(storage, dead)
    listing = {**listing, **temp}
    freed = sum(listing.get(p, 0) for group in deleted.values() for p in group)
    return GcReport(dry_run, len(live.snapshots), deleted, freed, live.dangling)


def _plan_residuals(parts: StoreParts, dry_run: bool) -> GcReport:
    """Only the restore residuals no version keeps any more, and their pieces.

    The kept residuals are found near the branch heads
    (:func:`inshrink_store.residual.near_heads`; a document shared by several versions is kept
    while any of them keeps it), and a dropped document's pieces are deleted
    unless a kept document lists them, the object starts with
    :data:`~inshrink_store.residual.PIECE_MAGIC`, and no committed version reaches it. Why the
    last: objects are addressed by content, so a lossless float chunk whose raw bits equal a
    piece (magic first) is the same object; when there is a piece to delete, the sweep marks
    what every ref reaches, as gc does, and keeps it. Run under the gc lease like any gc, so
    the commit protocol's argument covers it (a residual becomes needed only by a commit)."""
    storage = parts.storage
    kept = residuals_near_heads(parts)
    keep_pieces: set[str] = set()
    for rid, sids in kept.items():  # an error here stops the sweep: a shared piece would go
        for array in (load_kept_residual(parts, rid, sids) or {}).values():
            keep_pieces.update(array.pieces)
    listing = storage.list(RESIDUALS)
    deleted: dict[str, list[str]] = {"refs": [], "snapshots": [], "trees": [], "residuals": [], "objects": [],
                                     "temp": [], "leases": []}
    sizes = dict(listing)
    pieces: list[str] = []
    for path in sorted(listing):
        found = classify(path)
        if found is None or found[0] != RESIDUALS or found[1] in kept:
            continue
        deleted["residuals"].append(path)
        try:  # a dropped document's pieces; one that cannot be read stops the sweep (retried)
            with reading(f"dropped restore residual {found[1]}"):
                arrays = residual.load(storage, found[1])
        except (NotFoundError, IntegrityError, FormatError):
            continue  # gone or damaged: its pieces stay until a full gc finds them unreached
        for array in arrays.values():
            pieces.extend(oid for oid in array.pieces if oid not in keep_pieces and oid not in pieces)
    for oid in pieces:
        path = object_path(oid)
        try:
            with reading(f"the head of residual piece {oid}"):
                head = bytes(storage.read_range(path, HEADER_SIZE, HEADER_SIZE + len(residual.PIECE_MAGIC)))
                size = storage.size(path)
        except NotFoundError:
            continue  # already gone
        if head == residual.PIECE_MAGIC:
            deleted["objects"].append(path)
            sizes[path] = size
    deleted["objects"] = _unreached(parts, deleted["objects"])
    freed = sum(sizes.get(p, 0) for group in deleted.values() for p in group)
    return GcReport(dry_run, len(kept), deleted, freed, [])


def _unreached(parts: StoreParts, paths: list[str]) -> list[str]:
    """The object ``paths`` no committed version reaches (chunks, kept pieces, their delta
    bases). Only computed when there is something to delete: it reads every kept version's
    trees, which a sweep with nothing to delete need not."""
    if not paths:
        return paths
    kept = {object_path(oid) for oid in with_bases(parts, reachable(parts, None).objects)}
    return [path for path in paths if path not in kept]


def _deltas_first(parts: StoreParts, oids: list[str]) -> list[str]:
    """Garbage objects deepest delta first, so a gc cut short never strands a delta without
    its base (a writer that dedups against an existing object must be able to read it)."""
    def depth(oid: str) -> int:
        try:
            with reading(f"the header of garbage object {oid} (to delete deltas first)"):
                return int(parts.objects.header(oid).depth)
        except NotFoundError:
            return 0  # gone already
        except (IntegrityError, FormatError):
            return 1 << 30  # damaged: delete it first, nothing can use it
    return sorted(oids, key=lambda oid: (-depth(oid), oid))


def _temp_leftovers(storage: Storage, stale_after: float) -> dict[str, int]:
    """Temp files of local atomic writes that a crash interrupted (``list`` hides them).

    Only those older than ``stale_after``: a younger one may be a write in progress (a
    writer's lease is itself written through a temp file, before gc can see the lease)."""
    now = time.time()
    return {rel: size for rel, (size, mtime) in storage.temp_files().items()
            if mtime is None or now - mtime >= stale_after}

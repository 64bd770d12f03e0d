"""Whole-store operations: diff, verify, gc and du.

They work on any repository-like object (``storage``, ``objects``, ``resolve``,
``snapshot``, ``branches``, ``tags``, ``checkout``) so this module sits below
``repository`` in the layering and ``Repository`` simply delegates to it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inshrink_store import leases
from inshrink_store.arrays import SnapshotReader
from inshrink_store.cas import ObjectStore, object_path
from inshrink_store.errors import (
    ConflictError,
    FormatError,
    InshrinkError,
    IntegrityError,
    NotFoundError,
)
from inshrink_store.refs import branch_ref_path, parse_branch_listing
from inshrink_store.zarr_store import SnapshotChunks, load_node, load_root, tree_path

Progress = Callable[[str, int, int], None]


# -- diff -----------------------------------------------------------------------------
@dataclass
class TensorChange:
    path: str
    status: str  # added | removed | changed | unchanged
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    chunks_changed: int = 0
    chunks_total: int = 0
    new_bytes: int = 0
    storage_b: str | None = None
    max_abs_change: float | None = None
    rel_l2_change: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass
class DiffReport:
    a: str
    b: str
    tensors: list[TensorChange]

    def by_status(self, status: str) -> list[TensorChange]:
        return [t for t in self.tensors if t.status == status]

    @property
    def new_bytes(self) -> int:
        return sum(t.new_bytes for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        counts = {s: len(self.by_status(s)) for s in ("added", "removed", "changed", "unchanged")}
        return {"a": self.a, "b": self.b, "counts": counts, "new_bytes": self.new_bytes,
                "tensors": [t.to_dict() for t in self.tensors]}


def diff(repo: Any, ref_a: str, ref_b: str, *, values: bool = False) -> DiffReport:
    a, b = repo.checkout(ref_a), repo.checkout(ref_b)
    infos_a, infos_b = a.arrays(), b.arrays()
    objects_a = {oid for info in infos_a.values() for oid in info.chunk_ids.values()}
    sizes = repo.storage.list("objects")
    out = []
    for path in sorted(set(infos_a) | set(infos_b)):
        ia, ib = infos_a.get(path), infos_b.get(path)
        change = TensorChange(path, "unchanged")
        if ia is not None:
            change.shape_a, change.dtype_a = ia.shape, ia.dtype
        if ib is not None:
            change.shape_b, change.dtype_b, change.storage_b = ib.shape, ib.dtype, ib.storage
            change.chunks_total = len(ib.chunk_ids)
            fresh = {o for o in ib.chunk_ids.values() if o not in objects_a}
            change.new_bytes = sum(sizes.get(object_path(o), 0) for o in fresh)
        if ia is None:
            change.status = "added"
        elif ib is None:
            change.status = "removed"
        else:
            differing = {k for k in set(ia.chunk_ids) | set(ib.chunk_ids)
                         if ia.chunk_ids.get(k) != ib.chunk_ids.get(k)}
            change.chunks_changed = len(differing)
            if differing or ia.shape != ib.shape or ia.dtype != ib.dtype:
                change.status = "changed"
            if values and ia.shape == ib.shape:
                change.max_abs_change, change.rel_l2_change = _value_change(a, b, path)
        out.append(change)
    return DiffReport(a.id, b.id, out)


def _value_change(a: SnapshotReader, b: SnapshotReader, path: str) -> tuple[float, float]:
    va = a.read_float(path).astype(np.float64)
    vb = b.read_float(path).astype(np.float64)
    if va.size == 0:
        return 0.0, 0.0
    delta = vb - va
    finite = np.isfinite(delta)
    max_abs = float(np.max(np.abs(delta[finite]))) if finite.any() else math.nan
    norm = float(np.linalg.norm(va[np.isfinite(va)]))
    rel = float(np.linalg.norm(delta[finite]) / norm) if norm > 0 else (0.0 if max_abs == 0 else math.inf)
    return max_abs, rel


# -- reachability -------------------------------------------------------------------------
@dataclass
class Reachable:
    snapshots: set[str] = field(default_factory=set)
    trees: set[str] = field(default_factory=set)
    objects: dict[str, set[tuple[str, str]]] = field(default_factory=dict)  # oid -> {(snap, tensor)}
    #: refs whose snapshot is missing ("tag best -> 1f2e..."): reported, never fatal
    dangling: list[str] = field(default_factory=list)


def _ref_targets(repo: Any, keep_last: int | None) -> dict[str, str]:
    """Every ref gc must honour, as 'tag NAME' / 'branch NAME' / a ref file path -> snapshot id."""
    targets = {f"tag {name}": sid for name, sid in repo.tags().items()}
    targets.update({f"branch {name}": sid for name, sid in repo.branches().items()})
    if keep_last is None:  # old ref files also name versions (e.g. before a restore)
        for branch, seqs in parse_branch_listing(list(repo.storage.list("refs/branches"))).items():
            for seq in seqs:
                path = branch_ref_path(branch, seq)
                with contextlib.suppress(FileNotFoundError):
                    targets[path] = repo.read_ref(path)
    return targets


def _snapshot_closure(repo: Any, keep_last: int | None, dangling: list[str] | None = None) -> set[str]:
    """Snapshots kept: every tag's, and per branch the head's history (its last N if asked);
    without ``keep_last``, also the history of every older ref file of a branch.

    A ref naming a missing snapshot is listed in ``dangling`` (when given) and skipped."""
    kept: set[str] = set()
    heads = {f"branch {name}" for name in repo.branches()}
    for name, sid in _ref_targets(repo, keep_last).items():
        if dangling is not None and not repo.storage.exists(f"snapshots/{sid}"):
            if name in heads or name.startswith("tag ") or keep_last is None:
                dangling.append(f"{name} -> {sid} (snapshot missing)")
            continue
        limit = keep_last if name in heads else (1 if name.startswith("tag ") else None)
        _walk(repo, sid, kept, limit)
    return kept


def _walk(repo: Any, start: str, kept: set[str], limit: int | None) -> None:
    """Add ``start`` and up to ``limit`` - 1 ancestors to ``kept``.

    ``start`` is always added (a ref naming a missing or corrupt snapshot is a problem
    verify must report); a missing *parent* is history an earlier ``gc(keep_last=...)``
    removed, so the walk ends there instead of naming a snapshot that no longer exists.
    """
    current: str | None = start
    count = 0
    while current is not None and (limit is None or count < limit):
        if limit is None and count and current in kept:
            return  # the rest of this history is already kept
        kept.add(current)
        count += 1
        try:
            parent = repo.snapshot(current).parent
        except InshrinkError:
            return
        if parent is not None and not repo.storage.exists(f"snapshots/{parent}"):
            return
        current = parent


def reachable(repo: Any, keep_last: int | None = None, progress: Progress | None = None) -> Reachable:
    dangling: list[str] = []
    out = Reachable(snapshots=_snapshot_closure(repo, keep_last, dangling), dangling=dangling)
    for i, sid in enumerate(sorted(out.snapshots)):
        info = repo.snapshot(sid)
        out.trees.add(info.root)
        root = load_root(repo.objects, info.root)
        for path, tid in root.nodes.items():
            out.trees.add(tid)
            for oid in load_node(repo.objects, tid).chunks.values():
                out.objects.setdefault(oid, set()).add((sid, path))
        if progress:
            progress(sid, i + 1, len(out.snapshots))
    return out


# -- verify -----------------------------------------------------------------------------
@dataclass
class Problem:
    kind: str  # object | tree | snapshot | ref
    id: str
    error: str
    used_by: list[tuple[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "id": self.id, "error": self.error,
                "used_by": [{"snapshot": s, "tensor": t} for s, t in self.used_by]}


@dataclass
class VerifyReport:
    snapshots: int
    trees: int
    objects: int
    deltas: int
    problems: list[Problem]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "snapshots": self.snapshots, "trees": self.trees,
                "objects": self.objects, "deltas": self.deltas,
                "problems": [p.to_dict() for p in self.problems]}


def verify(repo: Any, progress: Progress | None = None) -> VerifyReport:
    problems: list[Problem] = []
    fresh = ObjectStore(repo.storage, keyframe_interval=repo.objects.keyframe_interval)
    snapshots: set[str] = set()
    for sid in sorted(_safe_closure(repo, problems)):
        try:
            repo.snapshot(sid)
            snapshots.add(sid)
        except InshrinkError as exc:
            problems.append(Problem("snapshot", sid, str(exc)))
    users: dict[str, set[tuple[str, str]]] = {}
    trees = 0
    for sid in sorted(snapshots):
        try:
            info = repo.snapshot(sid)
            view = SnapshotChunks(fresh, info.root, sid)
            for path, (_tid, tree) in view.node_trees().items():
                trees += 1
                for oid in tree.chunks.values():
                    users.setdefault(oid, set()).add((sid, path))
            SnapshotReader(info, view).arrays()  # every zarr.json parses and fits its chunks
        except InshrinkError as exc:
            problems.append(Problem("tree", sid, str(exc)))
    deltas = 0
    for i, oid in enumerate(sorted(users)):
        try:
            if fresh.header(oid).is_delta:
                deltas += 1
            fresh.get(oid)
        except InshrinkError as exc:
            problems.append(Problem("object", oid, str(exc), sorted(users[oid])))
        if progress:
            progress(oid, i + 1, len(users))
    return VerifyReport(len(snapshots), trees, len(users), deltas, problems)


def _safe_closure(repo: Any, problems: list[Problem]) -> set[str]:
    try:
        return _snapshot_closure(repo, None)
    except InshrinkError as exc:
        problems.append(Problem("ref", "refs", str(exc)))
        return set()


# -- gc -------------------------------------------------------------------------------
@dataclass
class GcReport:
    dry_run: bool
    kept_snapshots: int
    deleted: dict[str, list[str]]
    freed_bytes: int
    #: refs naming a snapshot that does not exist: reported (see `inshrink verify`), never fatal
    dangling: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "kept_snapshots": self.kept_snapshots,
                "deleted": {k: len(v) for k, v in self.deleted.items()}, "freed_bytes": self.freed_bytes,
                "dangling": list(self.dangling)}


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

    def __init__(self, repo: Any, keep_last: int | None = None, *, stale_after: float = leases.STALE_AFTER,
                 wait: float = 0.0, progress: Progress | None = None,
                 on_wait: Callable[[str], None] | None = None, keep_alive: bool = True) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise FormatError(f"Expected keep_last to be an integer >= 1. Got {keep_last!r} instead.")
        self.repo, self.keep_last, self.stale_after = repo, keep_last, stale_after
        self.wait, self.progress, self.on_wait, self.keep_alive = wait, progress, on_wait, keep_alive
        self.lease: leases.HeldLease | None = None
        self.dead: list[leases.Lease] = []
        self.report: GcReport | None = None
        self._queue: list[str] = []
        self._done = 0

    def start(self) -> None:
        self.lease, self.dead = leases.acquire_gc(
            self.repo.storage, wait=self.wait, stale_after=self.stale_after, on_wait=self.on_wait)
        if self.keep_alive:
            self.lease.keep_alive()

    def mark(self, *, dry_run: bool = False) -> GcReport:
        """Decide what to delete (nothing is deleted here)."""
        if not dry_run:
            self._check_lease("marking")
        self.report = _plan(self.repo, self.keep_last, self.dead, dry_run=dry_run, stale_after=self.stale_after)
        self._queue = [p for group in ("refs", "snapshots", "trees", "objects", "temp", "leases")
                       for p in self.report.deleted[group]]
        return self.report

    def sweep(self, limit: int | None = None) -> int:
        """Delete up to ``limit`` more paths (all by default); returns how many are left."""
        storage = self.repo.storage
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
                f"Expected gc's lease {lease.path} on {self.repo.url!r} to be valid while {doing}. "
                "Got it lapsed (not renewed in time) or broken by a writer that judged this gc "
                "dead instead; gc stopped. What it deleted so far was unreachable garbage; run "
                "gc again."
            )


def gc(repo: Any, keep_last: int | None = None, *, dry_run: bool = False,
       progress: Progress | None = None, stale_after: float = leases.STALE_AFTER,
       wait: float = 0.0, on_wait: Callable[[str], None] | None = None) -> GcReport:
    """Delete unreachable snapshots, trees, objects, stale ref files and dead leases.

    Safe beside any number of writers, tag/branch creations and other gc runs (see
    :class:`GarbageCollector`). Refuses with ``ConflictError`` (nothing deleted) while a
    commit is in progress or another gc runs, after waiting up to ``wait`` seconds. A
    writer lease unrenewed for ``stale_after`` seconds (or whose process is gone) is
    fenced off: that writer can no longer publish. A dry run takes no lease.
    """
    return GarbageCollector(repo, keep_last, stale_after=stale_after, wait=wait, progress=progress,
                            on_wait=on_wait).run(dry_run=dry_run)


def _plan(repo: Any, keep_last: int | None, dead: list[leases.Lease], *, dry_run: bool,
          stale_after: float) -> GcReport:
    live = reachable(repo, keep_last, progress=None)
    keep_objects: set[str] = set()
    for oid in live.objects:
        try:
            keep_objects.update(repo.objects.chain(oid))
        except InshrinkError:
            keep_objects.add(oid)
    storage = repo.storage
    listing = storage.list("")
    deleted: dict[str, list[str]] = {"refs": [], "snapshots": [], "trees": [], "objects": []}
    garbage_objects: list[str] = []
    for path in listing:
        kind, _, rest = path.partition("/")
        ident = rest.replace("/", "")
        if kind == "snapshots" and rest not in live.snapshots:
            deleted["snapshots"].append(path)
        elif kind == "trees" and ident not in live.trees:
            deleted["trees"].append(path)
        elif kind == "objects" and ident not in keep_objects:
            garbage_objects.append(ident)
    deleted["objects"] = [object_path(oid) for oid in _deltas_first(repo, garbage_objects)]
    for branch, seqs in parse_branch_listing([p for p in listing if p.startswith("refs/branches/")]).items():
        for seq in seqs[:-1]:  # the highest seq stays: it is the branch head and the commit counter
            path = branch_ref_path(branch, seq)
            try:
                target = repo.read_ref(path)
            except (FileNotFoundError, InshrinkError):
                continue  # a malformed old ref file is verify's to report, not gc's to guess
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


def _deltas_first(repo: Any, oids: list[str]) -> list[str]:
    """Garbage objects deepest delta first, so a gc cut short never strands a delta without
    its base (a writer that dedups against an existing object must be able to read it)."""
    def depth(oid: str) -> int:
        try:
            return int(repo.objects.header(oid).depth)
        except InshrinkError:
            return 1 << 30  # unreadable: delete it first, nothing can use it
    return sorted(oids, key=lambda oid: (-depth(oid), oid))


def _temp_leftovers(storage: Any, stale_after: float) -> dict[str, int]:
    """Temp files of local atomic writes that a crash interrupted (``list`` hides them).

    Only those older than ``stale_after``: a younger one may be a write in progress (a
    writer's lease is itself written through a temp file, before gc can see the lease)."""
    if not storage.is_local:
        return {}
    found = storage.fs.find(storage.root, detail=True)
    now = time.time()
    out = {}
    for name, info in found.items():
        rel = storage._relative(name)
        if rel is None or ".tmp-" not in rel:
            continue
        mtime = info.get("mtime")
        if mtime is not None and now - float(mtime) < stale_after:
            continue
        out[rel] = int(info.get("size") or 0)
    return out


# -- du -------------------------------------------------------------------------------
@dataclass
class UsageRow:
    snapshot: str
    step: int | None
    message: str
    logical_bytes: int
    new_stored_bytes: int
    cumulative_stored_bytes: int
    cumulative_logical_bytes: int
    new_objects: int
    delta_objects: int

    @property
    def ratio(self) -> float:
        return self.logical_bytes / self.new_stored_bytes if self.new_stored_bytes else math.inf

    @property
    def cumulative_ratio(self) -> float:
        c = self.cumulative_stored_bytes
        return self.cumulative_logical_bytes / c if c else math.inf

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["ratio"] = None if math.isinf(self.ratio) else self.ratio
        d["cumulative_ratio"] = None if math.isinf(self.cumulative_ratio) else self.cumulative_ratio
        return d


def du(repo: Any, ref: str, prefix: str = "") -> list[UsageRow]:
    """Storage per version along ``ref``'s history, oldest first; bytes are counted where first used.

    ``prefix`` (e.g. ``"model/"``) counts only the tensors under it and no tree objects, so a
    training state's weights and optimizer can be reported apart.
    """
    history = list(reversed(repo.log(ref)))
    sizes = repo.storage.list("")
    seen: set[str] = set()
    rows: list[UsageRow] = []
    cumulative = cumulative_logical = 0
    for info in history:
        reader = repo.checkout(info.id)
        view = reader.view
        new_bytes = new_objects = deltas = 0
        for tid in [info.root, *view.root.nodes.values()]:
            if tid not in seen and not prefix:
                seen.add(tid)
                new_bytes += sizes.get(tree_path(tid), 0)
        arrays = [a for p, a in reader.arrays().items() if p.startswith(prefix)]
        for array in arrays:
            for oid in array.chunk_ids.values():
                if oid in seen:
                    continue
                seen.add(oid)
                new_objects += 1
                new_bytes += sizes.get(object_path(oid), 0)
                with contextlib.suppress(IntegrityError, NotFoundError):
                    deltas += repo.objects.header(oid).is_delta
        logical = sum(a.logical_bytes for a in arrays)
        cumulative += new_bytes
        cumulative_logical += logical
        rows.append(UsageRow(info.id, info.step, info.message, logical, new_bytes, cumulative,
                             cumulative_logical, new_objects, deltas))

    return rows

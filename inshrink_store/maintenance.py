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
from inshrink_store.errors import InshrinkError, IntegrityError, NotFoundError
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


def _snapshot_closure(repo: Any, keep_last: int | None) -> set[str]:
    """Snapshots kept: every tag, and per branch the head's history (its last N if asked)."""
    kept: set[str] = set(repo.tags().values())
    for head in repo.branches().values():
        _walk(repo, head, kept, keep_last)
    if keep_last is None:  # old ref files also name versions (e.g. before a restore)
        for branch, seqs in parse_branch_listing(list(repo.storage.list("refs/branches"))).items():
            for seq in seqs:
                sid = repo.storage.read(branch_ref_path(branch, seq)).decode().strip()
                _walk(repo, sid, kept, None)
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
    out = Reachable(snapshots=_snapshot_closure(repo, keep_last))
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
            view = SnapshotChunks(fresh, repo.snapshot(sid).root, sid)
            for path, (_tid, tree) in view.node_trees().items():
                trees += 1
                for oid in tree.chunks.values():
                    users.setdefault(oid, set()).add((sid, path))
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

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "kept_snapshots": self.kept_snapshots,
                "deleted": {k: len(v) for k, v in self.deleted.items()}, "freed_bytes": self.freed_bytes}


def gc(repo: Any, keep_last: int | None = None, *, dry_run: bool = False,
       progress: Progress | None = None, stale_after: float = leases.STALE_AFTER) -> GcReport:
    """Delete unreachable snapshots, trees, objects and stale ref files.

    Safe beside writers: gc takes the gc lease and refuses (``ConflictError``, nothing
    deleted) while any commit holds a writer lease, and commits refuse while gc holds
    its lease (see leases.py). Leases older than ``stale_after`` seconds belong to dead
    processes and are deleted. A dry run takes no lease and deletes nothing.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"Expected keep_last >= 1. Got {keep_last} instead.")
    storage = repo.storage
    if dry_run:
        stale = [w for w in leases.writers(storage) if w.age() >= stale_after]
        return _collect(repo, keep_last, stale, dry_run=True, progress=progress, stale_after=stale_after)
    _, stale = leases.acquire_gc(storage, stale_after)
    try:
        return _collect(repo, keep_last, stale, dry_run=False, progress=progress, stale_after=stale_after)
    finally:
        leases.release(storage, leases.GC_LEASE)


def _collect(repo: Any, keep_last: int | None, stale: list[leases.Lease], *, dry_run: bool,
             progress: Progress | None, stale_after: float) -> GcReport:
    live = reachable(repo, keep_last, progress=None)
    keep_objects: set[str] = set()
    for oid in live.objects:
        try:
            keep_objects.update(repo.objects.chain(oid))
        except InshrinkError:
            keep_objects.add(oid)
    storage = repo.storage
    listing = storage.list("")
    deleted: dict[str, list[str]] = {"snapshots": [], "trees": [], "objects": [], "refs": []}
    for path in listing:
        kind, _, rest = path.partition("/")
        ident = rest.replace("/", "")
        if (kind == "snapshots" and rest not in live.snapshots) or (
            kind == "trees" and ident not in live.trees) or (
            kind == "objects" and ident not in keep_objects):
            deleted[kind].append(path)
    for branch, seqs in parse_branch_listing([p for p in listing if p.startswith("refs/branches/")]).items():
        for seq in seqs[:-1]:  # the highest seq stays: it is the branch head and the commit counter
            path = branch_ref_path(branch, seq)
            if storage.read(path).decode().strip() not in live.snapshots:
                deleted["refs"].append(path)
    temp = _temp_leftovers(storage, stale_after)
    deleted["temp"] = sorted(temp)
    deleted["leases"] = sorted(lease.path for lease in stale)
    listing = {**listing, **temp}
    paths = [p for group in deleted.values() for p in group]
    freed = sum(listing.get(p, 0) for p in paths)
    if not dry_run:
        for i, path in enumerate(paths):
            storage.delete(path)
            if progress:
                progress(path, i + 1, len(paths))
    return GcReport(dry_run, len(live.snapshots), deleted, freed)


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

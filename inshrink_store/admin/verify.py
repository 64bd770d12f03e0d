"""verify: read every reachable object end to end and name what is wrong and who uses it.
Layer: admin, below the facade (which delegates to it) and above the write session."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inshrink_store import residual
from inshrink_store.admin.reachability import kept_residuals, snapshot_closure
from inshrink_store.cas import ObjectStore
from inshrink_store.dcp_document import check_attributes
from inshrink_store.errors import InshrinkError, NotFoundError
from inshrink_store.history import SnapshotInfo
from inshrink_store.manifest import NodeTree
from inshrink_store.object_format import ObjectHeader
from inshrink_store.parallel import map_in_order
from inshrink_store.parts import StoreParts

Progress = Callable[[str, int, int], None]
_PARALLEL_REQUESTS = 8  # objects read at once from an object store (each waits on requests)


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


def verify(parts: StoreParts, progress: Progress | None = None) -> VerifyReport:
    problems: list[Problem] = []
    fresh = ObjectStore(parts.storage, keyframe_interval=parts.objects.keyframe_interval)
    infos: dict[str, SnapshotInfo] = {}
    for sid in sorted(_closure(parts, problems)):
        try:
            infos[sid] = parts.history.get(sid)
        except InshrinkError as exc:
            problems.append(Problem("snapshot", sid, str(exc)))
    snapshots = set(infos)
    users: dict[str, set[tuple[str, str]]] = {}
    trees = 0
    checked: dict[str, NodeTree] = {}  # node trees read (and checked) in this run, by id
    for sid in sorted(snapshots):
        try:
            reader = parts.reader(infos[sid], objects=fresh)
            reader.index.adopt(checked)  # versions share most trees: read each from storage once
            for path, (tid, tree) in reader.index.node_trees().items():
                checked[tid] = tree
                trees += 1
                for oid in tree.chunks.values():
                    users.setdefault(oid, set()).add((sid, path))
            reader.arrays()  # every zarr.json parses and fits its chunks
            check_attributes(reader.attributes, f"snapshot {sid[:12]}")  # a DCP document as a load checks it
        except InshrinkError as exc:
            problems.append(Problem("tree", sid, str(exc)))
    kept = kept_residuals(parts, snapshots, strict=False)
    children = _children(infos)
    for rid, sids in kept.items():  # the newest versions' restore residuals
        try:
            for path, array in residual.load(parts.storage, rid).items():
                for oid in array.pieces:
                    users.setdefault(oid, set()).update((sid, f"residual of {path}") for sid in sids)
        except NotFoundError as exc:  # rightly collected, unless a version still needs it
            needing = [sid for sid in sorted(sids) if _still_needs_residual(infos[sid], children)]
            if needing:
                problems.append(Problem("residual", rid, str(exc), [(sid, "restore residual") for sid in needing]))
        except InshrinkError as exc:
            problems.append(Problem("residual", rid, str(exc), [(sid, "restore residual") for sid in sorted(sids)]))
    errors, deltas = _check_objects(fresh, sorted(users), progress)
    problems.extend(Problem("object", oid, errors[oid], sorted(users[oid])) for oid in sorted(errors))
    problems.extend(_residual_mismatches(parts, fresh, kept, {p.id for p in problems if p.kind == "object"}))
    return VerifyReport(len(snapshots), trees, len(users), deltas, problems)


def _check_objects(fresh: ObjectStore, oids: list[str], progress: Progress | None) -> tuple[dict[str, str], int]:
    """Read every object of ``oids`` end to end (its delta chain resolved, every checksum and
    id checked: :meth:`ObjectStore.get`); returns (oid -> error of each that fails, the number
    of deltas among them).

    Each object is decoded once: the objects are grouped by delta chain (from their headers)
    and each group is read base first, so a delta finds its base's payload in ``fresh``'s
    cache instead of decoding its chain again; groups are read side by side on the cores
    (:func:`map_in_order`). Why: read in id order, the bases of most deltas had left the cache
    (a store's versions are many times its size), and every delta decoded its whole chain, up
    to the keyframe interval's eight objects. What is checked and the errors are as before:
    an object whose header does not read fails with that error, any other with ``get``'s."""
    headers = map_in_order(lambda oid: _header(fresh, oid), oids, _workers(fresh), "inshrink-verify")
    error: dict[str, str] = {oid: h for oid, h in zip(oids, headers, strict=True) if isinstance(h, str)}
    base = {oid: h.base for oid, h in zip(oids, headers, strict=True) if isinstance(h, ObjectHeader)}
    deltas = sum(1 for h in headers if isinstance(h, ObjectHeader) and h.is_delta)
    children: dict[str, list[str]] = {}
    for oid, parent in base.items():
        if parent is not None and parent in base:
            children.setdefault(parent, []).append(oid)
    roots = [oid for oid in oids if oid in base and (base[oid] is None or base[oid] not in base)]
    groups: list[list[str]] = []
    placed = 0
    for root in roots:  # each root, then the deltas on it depth first (a base before its deltas)
        group, stack = [], [root]
        while stack:
            oid = stack.pop()
            group.append(oid)
            stack.extend(reversed(children.get(oid, [])))
        groups.append(group)
        placed += len(group)
    if placed < len(base):  # a loop of bases no root reaches (a corrupt store): one at a time
        reached = {oid for group in groups for oid in group}
        groups.extend([oid] for oid in oids if oid in base and oid not in reached)

    def read(group: list[str]) -> dict[str, str]:
        failed = {}
        for oid in group:
            try:
                fresh.get(oid)
            except InshrinkError as exc:
                failed[oid] = str(exc)
        return failed

    done = len(error)
    batch = 4 * _workers(fresh)
    for start in range(0, len(groups), batch):  # batches: progress is reported as they end
        chosen = groups[start:start + batch]
        for failed in map_in_order(read, chosen, _workers(fresh), "inshrink-verify"):
            error.update(failed)
        if progress:
            for group in chosen:
                for oid in group:
                    done += 1
                    progress(oid, done, len(oids))
    return error, deltas


def _header(fresh: ObjectStore, oid: str) -> ObjectHeader | str:
    """The header of ``oid``, or the error reading it gave."""
    try:
        return fresh.header(oid)
    except InshrinkError as exc:
        return str(exc)


def _workers(fresh: ObjectStore) -> int:
    """Threads for reading objects: the cores on a local disk or in memory, several requests
    at once on an object store (numpy, zstd, hashing and I/O release the GIL)."""
    storage = fresh.storage
    local = not storage.is_remote
    return (os.cpu_count() or 1) if local else _PARALLEL_REQUESTS


def _residual_mismatches(parts: StoreParts, fresh: ObjectStore, kept: dict[str, set[str]],
                         bad: set[str]) -> list[Problem]:
    """Every kept residual applied to the stored tensors of each version keeping it (identical
    saves share a document, and each version's tensors must match it), each checked against
    its checksum. Why: pieces that all decode can still belong to other stored bits (a rebase
    that kept the old parent's entry for a tensor it took from the new head did that), and
    then only an exact restore would find out. Damaged objects (``bad``) and unreadable
    documents and snapshots are reported already: skipped here."""
    problems: list[Problem] = []
    for rid, sids in sorted(kept.items()):
        try:
            arrays = residual.load(parts.storage, rid)
        except InshrinkError:
            continue
        for sid in sorted(sids):
            problems.extend(_version_mismatches(parts, fresh, rid, sid, arrays, bad))
    return problems


def _version_mismatches(parts: StoreParts, fresh: ObjectStore, rid: str, sid: str,
                        arrays: dict[str, residual.ResidualArray], bad: set[str]) -> list[Problem]:
    """The entries of document ``rid`` that do not restore snapshot ``sid``'s tensors."""
    problems: list[Problem] = []
    try:
        reader = parts.reader(parts.history.get(sid), objects=fresh)
        infos = reader.arrays()
    except InshrinkError:
        return problems
    for path, array in sorted(arrays.items()):
        error = _residual_error(reader, infos.get(path), fresh, array, bad, path)
        if error is not None:
            problems.append(Problem("residual", rid, (
                f"Expected residual {rid} of snapshot {sid[:12]} to restore its tensor {path!r}. Got "
                f"{error} instead: the entry belongs to other stored bits; the stored values still read "
                "(load_state(exact=False)), save the state again for an exact restore."),
                [(sid, f"residual of {path}")]))
    return problems


def _residual_error(reader: Any, info: Any, fresh: ObjectStore, array: residual.ResidualArray,
                    bad: set[str], path: str) -> str | None:
    """Why ``array`` does not turn ``reader``'s tensor ``path`` (``info``: its ArrayInfo, None
    if the version has none) back into its saved bits, or None (also where a damaged object
    already explains it)."""
    if info is None:
        return "no such tensor in that snapshot"
    if bad.intersection(array.pieces) or bad.intersection(info.chunk_ids.values()):
        return None
    try:
        residual.apply(fresh, array, reader.read(path), path)
    except InshrinkError as exc:
        return f"an error ({exc})"
    return None


def _children(infos: dict[str, SnapshotInfo]) -> dict[str, list[str]]:
    """Snapshot id -> the versions committed on top of it, among ``infos``."""
    out: dict[str, list[str]] = {}
    for sid, info in infos.items():
        if info.parent is not None:
            out.setdefault(info.parent, []).append(sid)
    return out


def _still_needs_residual(info: SnapshotInfo, children: dict[str, list[str]]) -> bool:
    """Whether version ``info`` must still have its restore residual: fewer than its
    ``keep_newest`` versions have been committed on top of it on every line of history verify
    sees. Once one line holds that many, the version fell out of the newest of that branch
    when they were written, and a gc may have collected its residual; a branch or tag made
    at it later (``create_branch("old", "main~2")``) does not bring it back, so its absence
    is no problem (reads then return the stored values and say so)."""
    ref = residual.ResidualRef.from_metadata(info.metadata, info.id)
    level = {info.id}
    for _ in range(0 if ref is None else ref.keep_newest):
        level = {child for sid in level for child in children.get(sid, ())}
        if not level:
            return True
    return False


def _closure(parts: StoreParts, problems: list[Problem]) -> set[str]:
    try:
        return snapshot_closure(parts, None, strict=False)
    except InshrinkError as exc:
        problems.append(Problem("ref", "refs", str(exc)))
        return set()

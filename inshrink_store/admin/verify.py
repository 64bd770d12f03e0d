"""verify: read every reachable object end to end and name what is wrong and who uses it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inshrink_store import residual
from inshrink_store.admin.reachability import kept_residuals, snapshot_closure
from inshrink_store.cas import ObjectStore
from inshrink_store.errors import InshrinkError
from inshrink_store.manifest import NodeTree
from inshrink_store.parts import StoreParts

Progress = Callable[[str, int, int], None]


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
    snapshots: set[str] = set()
    for sid in sorted(_closure(parts, problems)):
        try:
            parts.history.get(sid)
            snapshots.add(sid)
        except InshrinkError as exc:
            problems.append(Problem("snapshot", sid, str(exc)))
    users: dict[str, set[tuple[str, str]]] = {}
    trees = 0
    checked: dict[str, NodeTree] = {}  # node trees read (and checked) in this run, by id
    for sid in sorted(snapshots):
        try:
            reader = parts.reader(parts.history.get(sid), objects=fresh)
            reader.index.adopt(checked)  # versions share most trees: read each from storage once
            for path, (tid, tree) in reader.index.node_trees().items():
                checked[tid] = tree
                trees += 1
                for oid in tree.chunks.values():
                    users.setdefault(oid, set()).add((sid, path))
            reader.arrays()  # every zarr.json parses and fits its chunks
        except InshrinkError as exc:
            problems.append(Problem("tree", sid, str(exc)))
    for rid, sid in kept_residuals(parts, snapshots).items():  # the newest versions' restore residuals
        try:
            for path, array in residual.load(parts.storage, rid).items():
                for oid in array.pieces:
                    users.setdefault(oid, set()).add((sid, f"residual of {path}"))
        except InshrinkError as exc:
            problems.append(Problem("residual", rid, str(exc), [(sid, "restore residual")]))
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


def _closure(parts: StoreParts, problems: list[Problem]) -> set[str]:
    try:
        return snapshot_closure(parts, None)
    except InshrinkError as exc:
        problems.append(Problem("ref", "refs", str(exc)))
        return set()

"""Snapshot history: reading committed versions and walking their parents.
Layer: refs, history and policy (siblings, none importing another), below ``parts``.

A snapshot is immutable and addressed by the hash of its bytes, so this module only
reads; the write session creates snapshots and the refs make them reachable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inshrink_store.errors import NotFoundError
from inshrink_store.layout import SNAPSHOTS, snapshot_path
from inshrink_store.manifest import Snapshot
from inshrink_store.storage import Storage


@dataclass(frozen=True)
class SnapshotInfo:
    """A committed version as ``log`` shows it."""

    id: str
    parent: str | None
    time: str
    message: str
    step: int | None
    metrics: Mapping[str, float]
    metadata: Mapping[str, Any]
    root: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "parent": self.parent, "time": self.time, "message": self.message,
            "step": self.step, "metrics": dict(self.metrics), "metadata": dict(self.metadata),
        }


class History:
    """Read snapshots of one store."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage

    def exists(self, snapshot_id: str) -> bool:
        return self._storage.exists(snapshot_path(snapshot_id))

    def get(self, snapshot_id: str) -> SnapshotInfo:
        """One snapshot; NotFoundError if gc removed it or it was never committed."""
        try:
            raw = self._storage.read(snapshot_path(snapshot_id))
        except FileNotFoundError:
            raise NotFoundError(
                f"Expected snapshot {snapshot_id} in {self._storage.url!r}. Got nothing instead "
                "(removed by gc, or never committed)."
            ) from None
        snap = Snapshot.from_bytes(raw, snapshot_id)
        return SnapshotInfo(snapshot_id, snap.parent, snap.time, snap.message, snap.step,
                            snap.metrics, snap.metadata, snap.root)

    def ids(self) -> list[str]:
        """Every snapshot id in the store, reachable or not."""
        return sorted(p.split("/", 1)[1] for p in self._storage.list(SNAPSHOTS))

    def walk(self, start: str, limit: int | None = None) -> list[SnapshotInfo]:
        """``start`` and its ancestors, newest first, until the first version or what gc
        kept (a missing *ancestor* ends the walk; a missing ``start`` is NotFoundError)."""
        out: list[SnapshotInfo] = []
        current: str | None = start
        while current is not None and (limit is None or len(out) < limit):
            try:
                info = self.get(current)
            except NotFoundError:
                if not out:
                    raise
                break
            out.append(info)
            current = info.parent
        return out

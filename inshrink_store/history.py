"""Snapshot history: reading committed versions and walking their parents.
Layer: refs, history and policy (siblings, none importing another), below ``parts``.

A snapshot is immutable and addressed by the hash of its bytes, so this module only
reads; the write session creates snapshots and the refs make them reachable.

A history is followed by :meth:`History.lineage`: parent after parent, and where gc removed a
parent from the middle of a branch while versions below it are still kept (a tag keeps them:
Lightning's ``save_top_k`` dropping one of its checkpoints, a Checkpointer's ``keep-<step>``
and ``best-…`` tags), on to the newest older version *committed on that branch* that is still
there, read from the branch's ref files (see :class:`_Journal`). ``log``, ``du`` and ``main~N``
read histories this way; gc's own walk does not (a missing parent ends what ``keep_last``
counts there), and nothing here changes what any ref keeps.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from inshrink_store.errors import IntegrityError, NotFoundError
from inshrink_store.layout import (
    BRANCHES,
    SNAPSHOTS,
    branch_ref_path,
    check_id,
    parse_branch_listing,
    snapshot_path,
)
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
        """``start`` and the versions before it, newest first (:meth:`lineage`), at most
        ``limit`` of them; a missing ``start`` is NotFoundError."""
        return list(itertools.islice(self.lineage(start), limit))

    def lineage(self, start: str) -> Iterator[SnapshotInfo]:
        """``start``, then each version before it, newest first, lazily: its parent, or where
        gc removed the parent, the version the branch's ref files say was committed before it
        and is still kept (:meth:`_kept_before`). Ends at the first version, at a removed
        parent with nothing kept before it, or where the ref files cannot say which version
        came before (a branch moved back to an older version there). A missing ``start`` is
        NotFoundError at the first ``next``.

        Why the ref files: a commit on a branch writes ref file ``seq + 1`` naming the version
        whose parent is the head at ``seq``, and gc deletes a ref file only with its version,
        so the ref files of a branch are its commits, in order, that are still kept. Without
        them a version dropped from the middle of a branch (Lightning's ``save_top_k``
        evicting a checkpoint older than others it keeps) cut ``log`` and ``main~N`` there,
        although the versions below it are kept and tagged."""
        info: SnapshotInfo | None = self.get(start)
        journal = _Journal(self._storage)
        seen: set[str] = set()
        while info is not None and info.id not in seen:
            yield info
            seen.add(info.id)
            info = self._previous(info, journal)

    def _previous(self, info: SnapshotInfo, journal: _Journal) -> SnapshotInfo | None:
        if info.parent is None:
            return None
        try:
            return self.get(info.parent)
        except NotFoundError:
            return self._kept_before(info, journal)

    def _kept_before(self, info: SnapshotInfo, journal: _Journal) -> SnapshotInfo | None:
        """The version before ``info`` (whose parent gc removed) that is still kept: on each
        branch whose ref file ``s`` names ``info``, the newest version named by a ref file
        below ``s`` that exists. Taken only where ref file ``s - 1`` is gone or names the
        removed parent (``info`` was committed on the head then, not on an older version a
        restore went back to, which would make the version before it in the ref files no
        ancestor), and only when every such branch agrees; else None: the history ends here,
        as it did before. Only a confirmed absence skips a version; any other error reading
        one propagates. Limit: once the head a restore's commit replaced is gone as well (its
        ``.replaced-`` branch deleted and collected), nothing in the store says a restore
        happened there, and a version of the replaced line that a tag keeps is taken."""
        found: dict[str, SnapshotInfo] = {}
        for branch, seq in journal.naming(info.id):
            if journal.at(branch, seq - 1) not in (None, info.parent):
                continue  # a restore's commit (or a damaged ref file): its parent is not the one before
            for older in journal.below(branch, seq - 2):
                sid = journal.at(branch, older)
                if sid == _UNREADABLE:
                    break
                if sid is None or sid == info.parent:
                    continue
                try:
                    found[sid] = self.get(sid)
                    break
                except NotFoundError:
                    continue  # collected (its ref file not yet): older ones may be kept
        return next(iter(found.values())) if len(found) == 1 else None


#: what :meth:`_Journal.at` says of a ref file that exists but holds no snapshot id (damage,
#: which verify reports): no id, so a walk never passes it
_UNREADABLE = "(unreadable)"


class _Journal:
    """The ref files of every branch (``refs/branches/<name>/<seq>``), read once a walk and
    only when a walk meets a removed parent: which branch and ``seq`` name a version, and
    which version a ``seq`` names. A ref file deleted since the listing reads as None."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._seqs: dict[str, list[int]] | None = None
        self._ids: dict[tuple[str, int], str | None] = {}

    def _listing(self) -> dict[str, list[int]]:
        if self._seqs is None:
            self._seqs = parse_branch_listing(list(self._storage.list(BRANCHES)))
        return self._seqs

    def at(self, branch: str, seq: int) -> str | None:
        """The snapshot id ref file ``seq`` of ``branch`` names; None where there is none,
        :data:`_UNREADABLE` where it holds no id."""
        if seq < 0 or seq not in self._listing().get(branch, []):
            return None
        key = (branch, seq)
        if key not in self._ids:
            path = branch_ref_path(branch, seq)
            try:
                raw = self._storage.read(path)
                self._ids[key] = check_id(raw.decode("ascii", "replace").strip(), "snapshot", f"ref file {path}")
            except FileNotFoundError:
                self._ids[key] = None
            except IntegrityError:
                self._ids[key] = _UNREADABLE
        return self._ids[key]

    def below(self, branch: str, seq: int) -> list[int]:
        """``branch``'s ref file numbers up to ``seq``, newest first."""
        return [s for s in reversed(self._listing().get(branch, [])) if s <= seq]

    def naming(self, snapshot_id: str) -> list[tuple[str, int]]:
        """Every (branch, seq) whose ref file names ``snapshot_id``."""
        return [(branch, seq) for branch, seqs in self._listing().items() for seq in seqs
                if self.at(branch, seq) == snapshot_id]

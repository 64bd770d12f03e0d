"""The typed parts of one open store, shared by the facade, the write session and admin.
Layer: parts, below the write session, above refs, history and policy.

``Repository`` is a short facade over a :class:`StoreParts`; ``admin`` (diff, verify, gc,
du) and the write session take the parts they need, typed, instead of a whole repository.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, replace

from inshrink_store.cas import ObjectStore
from inshrink_store.errors import InvalidInputError, NotFoundError
from inshrink_store.gc_scope import BranchScope, Keep, Trim
from inshrink_store.history import History, SnapshotInfo
from inshrink_store.reader import SnapshotReader
from inshrink_store.refs import Refs, maybe_name, parse_expression
from inshrink_store.storage import Storage
from inshrink_store.zarr_store import SnapshotChunks

DEFAULT_BRANCH = "main"


@dataclass(frozen=True)
class StoreParts:
    storage: Storage
    objects: ObjectStore
    refs: Refs
    history: History

    @property
    def url(self) -> str:
        return self.storage.url

    def branch_scope(self, branch: str, *, keep: Keep | None = None, trim: Trim | None = None,
                     memo: MutableMapping[str, tuple[bool, str | None]] | None = None) -> StoreParts:
        """These parts for a gc that trims ``branch`` alone (:class:`~inshrink_store.gc_scope.BranchScope`
        as the refs): what ``Repository.gc(branch=...)`` hands the gc."""
        return replace(self, refs=BranchScope(self.storage, self.history, branch, keep=keep, trim=trim, memo=memo))

    def resolve(self, ref: str) -> str:
        """Branch, tag, snapshot id or unique id prefix, with ``~N`` / ``^`` suffixes."""
        base, back = parse_expression(ref)
        snapshot_id = self._resolve_base(base)
        if not back:
            return snapshot_id
        # ~N walks the history as log shows it: past a parent gc removed to the kept one before
        lineage = self.history.lineage(snapshot_id)
        next(lineage)
        for i in range(back):
            found = next(lineage, None)
            if found is None:
                raise NotFoundError(
                    f"Expected {ref!r} to name a version. Got a history only {i} versions deep "
                    f"before {base!r} instead (see `inshrink log`)."
                )
            snapshot_id = found.id
        return snapshot_id

    def _resolve_base(self, base: str) -> str:
        head = self.refs.head(base) if maybe_name(base) else None
        if head is not None:
            return head[1]
        tagged = self.refs.tag_target(base)
        if tagged is not None:
            return tagged
        if all(c in "0123456789abcdef" for c in base) and len(base) >= 4:
            if len(base) == 32 and self.history.exists(base):
                return base
            matches = [s for s in self.history.ids() if s.startswith(base)]
            if len(matches) == 1:
                return matches[0]
            if len(matches) > 1:
                raise InvalidInputError(
                    f"Expected a unique snapshot id prefix. Got {base!r}, which matches "
                    f"{len(matches)} snapshots instead; give more digits."
                )
        known = ", ".join(sorted(self.refs.branch_seqs())) or "none"
        raise NotFoundError(
            f"Expected a branch, tag or snapshot id in {self.url!r}. Got {base!r} instead "
            f"(branches: {known}; see `inshrink log`)."
        )

    def reader(self, info: SnapshotInfo, objects: ObjectStore | None = None) -> SnapshotReader:
        """A lazy reader of one version. ``objects`` (e.g. a fresh store for verify) also
        bypasses the process-wide snapshot index cache: every tree is read from storage."""
        store = objects or self.objects
        return SnapshotReader(info, SnapshotChunks(store, info.root, info.id, cached=objects is None))

    def checkout(self, ref: str = DEFAULT_BRANCH) -> SnapshotReader:
        return self.reader(self.history.get(self.resolve(ref)))

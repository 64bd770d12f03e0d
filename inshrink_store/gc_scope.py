"""A gc that trims one branch: the refs it reads, with every version kept as a tag that the
trimmed branch's ``keep_last`` must not collect.
Layer: its own, below :mod:`~inshrink_store.parts` (which builds the gc's parts with it), above refs
and history.

``Repository.gc(keep_last=N)`` keeps the N newest versions of *every* branch. A training
loop's retention trims its own branch only, and Lightning's plugin collects only the
checkpoints it wrote; both are ``Repository.gc(keep_last, branch=..., keep=..., trim=...)``,
which runs the store's one gc over :class:`BranchScope`'s view of the refs instead of the
store's. The extra tags exist only in this view, never in the store; gc reads them while it
marks, under its lease, when no commit is in progress, so a version committed since is its
branch's head and kept.

Why a view of the refs and not a gc of its own: the gc's argument that it never loses a
version (docs/reference/format.md) stays one argument; a scope only adds to what it keeps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, MutableMapping

from inshrink_store.errors import NotFoundError
from inshrink_store.history import History, SnapshotInfo
from inshrink_store.layout import branch_ref_path
from inshrink_store.refs import Refs
from inshrink_store.storage import Storage

__all__ = ["BranchScope", "Keep", "Trim"]

#: which versions of the trimmed branch outlive its ``keep_last`` (asked once per version)
Keep = Callable[[SnapshotInfo], bool]
#: which other branches are trimmed like it (their history is not kept whole)
Trim = Callable[[str], bool]


class BranchScope(Refs):
    """The store's refs, plus, as tags: every version in the history of every other branch
    (from its head and its older ref files) that ``trim`` does not name, and every version of
    ``branch`` that ``keep`` keeps (``keep(info)`` is asked once per version and remembered in
    ``memo``, snapshot id -> (kept, parent), across gc runs: a version never changes).

    Why every ref file of the branch for ``keep``, not just its head: a gc deletes the
    versions between a kept one and the head, so a walk from the head stops at the first gap;
    a kept version keeps the ref file its commit wrote (gc deletes old ref files only when
    their version goes), so a walk from each ref file reaches every kept version still there."""

    def __init__(self, storage: Storage, history: History, branch: str, *, keep: Keep | None = None,
                 trim: Trim | None = None, memo: MutableMapping[str, tuple[bool, str | None]] | None = None) -> None:
        super().__init__(storage)
        self.history, self.branch, self.keep, self.trim = history, branch, keep, trim
        self.memo: MutableMapping[str, tuple[bool, str | None]] = {} if memo is None else memo

    def tags(self) -> dict[str, str]:
        kept = self._kept_by_keep() if self.keep is not None else {}
        return {**kept, **self._other_branches(), **super().tags()}

    def _other_branches(self) -> dict[str, str]:
        kept: set[str] = set()
        for name, seqs in self.branch_seqs().items():
            if self._keeps_history(name):
                for seq in seqs:
                    try:
                        start = self.read(branch_ref_path(name, seq))
                    except FileNotFoundError:
                        continue  # deleted since the listing
                    self._walk(start, kept)
        return {f"{sid} (another branch's)": sid for sid in kept}

    def _keeps_history(self, name: str) -> bool:
        """Whether branch ``name``'s whole history is kept: every branch but the one trimmed
        and those ``trim`` names."""
        return name != self.branch and not (self.trim is not None and self.trim(name))

    def _walk(self, start: str | None, kept: set[str]) -> None:
        """Add ``start`` and its ancestors to ``kept``, up to one already there or missing.

        Only a confirmed absence ends the walk (NotFoundError: a parent an earlier gc removed,
        or a dangling ref, verify's to report). Any other error propagates and stops the gc
        reading these tags before it deletes anything: ended here, a transient error on one
        snapshot would let the gc sweep that branch's older versions (gc fails closed)."""
        while start is not None and start not in kept:
            try:
                parent = self.history.get(start).parent
            except NotFoundError:
                return
            kept.add(start)
            start = parent

    def _kept_by_keep(self) -> dict[str, str]:
        """The versions of ``branch`` that ``keep`` keeps, walked from each of its ref files.

        Fails closed, as :meth:`_walk` does: only a confirmed absence (a ref file deleted
        since the listing, a version collected by an earlier gc) ends a walk. Any other
        error (a transient read error, a snapshot that does not parse) propagates and
        stops the gc before it deletes anything; skipped, it let the gc sweep a version
        ``keep`` keeps after one failed read."""
        present = set(self.history.ids())
        for gone in set(self.memo) - present:  # collected since: not to be walked through
            del self.memo[gone]
        kept: set[str] = set()
        seen: set[str] = set()
        for seq in self.branch_seqs().get(self.branch, []):
            with contextlib.suppress(FileNotFoundError, NotFoundError):  # deleted since the listing
                current: str | None = self.read(branch_ref_path(self.branch, seq))
                while current is not None and current not in seen:
                    seen.add(current)
                    found = self._version(current) if current in present else None
                    if found is None:
                        break  # gone: collected by an earlier gc, this history ends here
                    keep, parent = found
                    if keep:
                        kept.add(current)
                    current = parent
        return {f"{sid} (kept on its branch)": sid for sid in kept}

    def _version(self, snapshot_id: str) -> tuple[bool, str | None] | None:
        """(kept by ``keep``, parent) of a version, or None where it is missing."""
        found = self.memo.get(snapshot_id)
        if found is None:
            assert self.keep is not None
            try:
                info = self.history.get(snapshot_id)
            except NotFoundError:  # collected since the listing; any other error stops the gc
                return None
            found = self.memo[snapshot_id] = (self.keep(info), info.parent)
        return found

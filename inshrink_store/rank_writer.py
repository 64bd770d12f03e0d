"""Where one rank of a distributed save (:mod:`inshrink_store.torch.dcp`) writes its shards.
Layer: write session (beside :mod:`~inshrink_store.session`, which commits what it writes),
below ``admin`` and the facade; the torch layer's DCP writer uses it through this module only.

Zarr arrays in a pending view of its own over the parent version, whose chunk objects go straight
into the store (write-once, content-addressed: ranks need no coordination). The rank holds
no write session (the coordinator does); what the coordinator needs to commit each array,
its zarr.json and chunk ids (:meth:`RankArrays.node`), travels back in DCP's write results
and becomes the version through
:meth:`~inshrink_store.session.WriteSession.stage_array`.

Why in the store, not in ``torch/``: it is a store writer (a pending view over the parent,
delta bases, write-once objects), built from the store's internals; beside the write
session it keeps those internals out of the clients (issue 45's two doors).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from inshrink_store.cas import ObjectStore
from inshrink_store.index import Entry, SnapshotIndex
from inshrink_store.plans import ArrayPlan
from inshrink_store.storage import open_storage
from inshrink_store.writer import write_arrays
from inshrink_store.zarr_store import InshrinkStore, PendingChunks, SnapshotChunks

if TYPE_CHECKING:
    from inshrink_store.history import SnapshotInfo

__all__ = ["RankArrays", "ShardStore"]


class _ParentEntries(Mapping[str, Entry]):
    """The parent's entries, each read when asked for: only the node trees of the keys asked
    about are read (a rank asks about its own shards, not the whole checkpoint)."""

    def __init__(self, index: SnapshotIndex) -> None:
        self._index = index

    def __getitem__(self, key: str) -> Entry:
        found = self._index.entry(key)
        if found is None:
            raise KeyError(key)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self._index.entries())

    def __len__(self) -> int:
        return len(self._index.entries())


class _RankChunks(PendingChunks):
    """One rank's pending arrays over the parent version. Unlike a write session's view, it
    reads the parent's trees only for the arrays this rank writes (adoption and delta bases),
    not all of them: with N ranks, each reads 1/N of the parent's trees."""

    def __init__(self, objects: ObjectStore, parent: SnapshotChunks | None) -> None:
        super().__init__(objects, None, inherit=False)
        self.parent = parent
        if parent is not None:
            self._parent_entries = _ParentEntries(parent.index)


class RankArrays:
    """One rank's arrays of one save: written as a write session writes them (unchanged
    lossless shards adopted from the parent without encoding, the others delta-coded against
    the parent's chunk at the same key), committed by nobody here."""

    def __init__(self, objects: ObjectStore, parent: SnapshotChunks | None) -> None:
        self._view = _RankChunks(objects, parent)
        self._store = InshrinkStore(self._view)

    def write(self, arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str],
              plans: Mapping[str, ArrayPlan] | None = None) -> None:
        """Write ``arrays`` (path -> array, dtype names in ``dtypes``); ``plans``: those stored lossy."""
        write_arrays(self._store, arrays, dtypes=dtypes, plans=plans)

    def node(self, path: str) -> dict[str, Any]:
        """Array ``path`` as JSON-native data for the coordinator: ``{"metadata": zarr.json
        text (None if this rank has no such array), "chunks": chunk key -> object id}``."""
        metadata, chunks = self._view.node(path)
        return {"metadata": None if metadata is None else metadata.decode(), "chunks": chunks}


class ShardStore:
    """One writer's object store (its own cache, kept across its saves; objects are shared
    by content anyway) and the arrays of each save's rank over its parent."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None, keyframe_interval: int) -> None:
        self.objects = ObjectStore(open_storage(url, dict(storage_options or {}) or None),
                                   keyframe_interval=keyframe_interval)

    def arrays(self, parent: SnapshotInfo | None) -> RankArrays:
        """A rank's arrays of a save whose parent version is ``parent`` (``repo.snapshot(id)``;
        None: the first)."""
        view = None
        if parent is not None:
            view = SnapshotChunks(self.objects, parent.root, parent.id)
        return RankArrays(self.objects, view)

"""Reading one committed version: tensors as zarr arrays, decoded in full on request.
Layer: reader and writer (siblings), below refs, history and policy, above the zarr view.

Everything known from metadata (names, shapes, dtypes, chunk ids) comes from the
snapshot's :class:`~inshrink_store.index.SnapshotIndex`, so listing or opening tensors
reads no tree twice. Before a large array is allocated, its declared size is bounded by
the chunk objects that back it: a damaged or crafted store cannot make a reader
allocate what its bytes cannot justify.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import zarr

from inshrink_store import dtypes, object_format, whole_read
from inshrink_store.dtypes import bf16_to_float32  # noqa: F401 - re-exported
from inshrink_store.errors import InshrinkError, IntegrityError, NotFoundError
from inshrink_store.index import (  # noqa: F401 - MAX_MISSING_CHUNKS re-exported
    MAX_MISSING_CHUNKS,
    METADATA_KEY,
    SPARSE_LIMIT,
    ArrayInfo,
    SnapshotIndex,
)
from inshrink_store.parallel import map_in_order
from inshrink_store.structure import PARAM_NAMES_ATTR, STRUCTURE_ATTR, optimizer_param_names
from inshrink_store.whole_read import WholeArray
from inshrink_store.zarr_store import InshrinkStore, SnapshotChunks

_T = TypeVar("_T")

#: the most bytes one chunk may decode to per stored byte of its object (defined with the
#: objects, whose writer keeps to it)
MAX_CHUNK_EXPANSION = object_format.MAX_CHUNK_EXPANSION
_PARALLEL_READS = 8  # tensors read at once by read_many from an object store (waits on requests)
_PARALLEL_SIZES = 8


def iter_array_docs(view: SnapshotChunks) -> list[tuple[str, dict[str, Any]]]:
    """(path, zarr.json document) of every array node of ``view``, sorted by path.

    A node whose zarr.json is not a JSON object is an :class:`IntegrityError` naming it.
    Prefer ``view.index.array_docs()``."""
    return view.index.array_docs()


def match_name(name: str, paths: Sequence[str], snapshot: str, same: Mapping[str, str] | None = None) -> str:
    """The path of the one tensor among ``paths`` ending in ``/name`` or ``.name`` (whole path
    components or module names, never the end of a word); NotFoundError listing the
    candidates or close names. ``same`` maps a spelling among ``paths`` to the stored path it
    names (an alias), so a tensor matched by its path and its alias counts once."""
    same = same or {}
    ending = sorted({same.get(p, p) for p in paths if p.endswith(f"/{name}") or p.endswith(f".{name}")})
    if len(ending) == 1:
        return ending[0]
    if ending:
        shown = ", ".join(repr(p) for p in ending[:4]) + (f" and {len(ending) - 4} more" if len(ending) > 4 else "")
        raise NotFoundError(
            f"Expected {name!r} to name one tensor of snapshot {snapshot[:12]}. Got {len(ending)} "
            f"tensors ending in it instead ({shown}); give more of the path.")
    close = difflib.get_close_matches(name, list(paths), n=3, cutoff=0.6)
    if not close:  # compare with the end of each path too: "wieght" -> "model/0.weight"
        short = {p.rsplit("/", 1)[-1]: p for p in paths}
        close = [short[s] for s in difflib.get_close_matches(name, list(short), n=3, cutoff=0.6)]
    tensors = len({same.get(p, p) for p in paths})
    count = f"{tensors} tensor{'' if tensors == 1 else 's'}"
    hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close else
            f"list the {count} with `inshrink ls` (or SnapshotReader.names()).")
    raise NotFoundError(
        f"Expected a tensor named {name!r} in snapshot {snapshot[:12]}. Got no such tensor instead; {hint}")


class SnapshotReader:
    """One version, read lazily: ``reader["layer.weight"]`` is a zarr.Array.

    ``index`` is the snapshot's :class:`SnapshotIndex` (every metadata query); ``view``,
    the zarr key view, stays public only until its last users move to ``index``."""

    def __init__(self, info: Any, view: SnapshotChunks) -> None:
        self.info = info
        self.id: str = info.id
        self.view = view
        self.index: SnapshotIndex = view.index
        self.store = InshrinkStore(view, read_only=True)
        self._whole: dict[str, WholeArray | None] = {}
        self._param_names: dict[int, str] | None = None

    def __repr__(self) -> str:
        return f"SnapshotReader({self.id[:12]}, {len(self.arrays())} tensors)"

    @property
    def group(self) -> zarr.Group:
        return self._zarr("the root group", lambda: zarr.open_group(store=self.store, mode="r"))

    def _zarr(self, what: str, action: Callable[[], _T]) -> _T:
        """Run a zarr call on this snapshot; zarr's own errors on malformed metadata or chunk
        bytes become an IntegrityError naming ``what`` (ours pass through unchanged)."""
        try:
            return action()
        except (InshrinkError, MemoryError):
            raise
        except Exception as exc:  # zarr parsing hostile metadata raises almost anything
            raise IntegrityError(
                f"Expected zarr to read {what} of snapshot {self.id}. Got "
                f"{type(exc).__name__}: {str(exc)[:200]} instead: its metadata or chunks are "
                "corrupt. Run `inshrink verify`."
            ) from exc

    @property
    def attributes(self) -> dict[str, Any]:
        group = self.group
        return self._zarr("the root group's attributes", lambda: dict(group.attrs))

    def arrays(self) -> dict[str, ArrayInfo]:
        """Path -> shape, dtype, chunking, storage kind, from metadata only (no chunk reads).

        Every array's zarr.json is validated first: shape and chunk_shape are lists of
        integers (>= 0, >= 1) of one rank, the dtype is known, and an array whose declared
        size or chunk size is over :data:`SPARSE_LIMIT` bytes must have every chunk of its
        grid in its node tree (keys checked against the grid and the chunk key encoding).
        The writer stores every chunk; only small arrays written by plain zarr (whose
        default skips chunks equal to the fill value) may miss up to
        :data:`MAX_MISSING_CHUNKS` chunks, read as the fill value. Otherwise an
        IntegrityError (or a FormatError for an unsupported dtype) names the tensor,
        before anything is allocated.
        """
        return self.index.arrays()

    def _info(self, path: str) -> ArrayInfo:
        info = self.index.array(path)
        assert info is not None, path  # resolve_name found it
        return info

    def names(self) -> list[str]:
        return sorted(self.arrays())

    def resolve_name(self, name: str) -> str:
        """The stored path ``name`` means, by the one rule every entry point follows (the CLI's
        ``show`` too; docs/reference/names.md): the exact path, else ``model/`` + ``name`` (a
        state-dict key), else a moment's alias ``optimizer/state/<param name>/exp_avg``
        (:meth:`aliases`), else the one path or alias ending in ``/name`` or ``.name`` (a
        wrapped model's ``model/0.auto_model.encoder...`` by ``encoder...``). Why the last: a
        model saved inside a wrapper gets a prefix its users never type. A NotFoundError lists
        the paths when several end in ``name``, or the close ones when none does."""
        for candidate in (name, f"model/{name}"):
            if self.index.array(candidate) is not None:  # reads that tensor's tree only
                return candidate
        aliases = self.aliases()
        if name in aliases:
            return aliases[name]
        return match_name(name, [*self.names(), *aliases], self.id, aliases)

    def param_names(self) -> dict[int, str]:
        """Optimizer parameter index -> parameter name (the model's state-dict key), where
        the version says: recorded by the Checkpointer, which knows the model, or the
        ``param_names`` of a named optimizer's ``param_groups``; ``{}`` otherwise."""
        if self._param_names is None:
            attributes = self.attributes
            recorded = attributes.get(PARAM_NAMES_ATTR)
            if isinstance(recorded, dict):
                self._param_names = {int(i): n for i, n in recorded.items()
                                     if isinstance(i, str) and i.isdigit() and isinstance(n, str)}
            else:
                self._param_names = optimizer_param_names(attributes.get(STRUCTURE_ATTR))
        return self._param_names

    def aliases(self) -> dict[str, str]:
        """``optimizer/state/<param name>/<key>`` -> ``optimizer/state/<index>/<key>`` for every
        optimizer tensor whose parameter has a name (:meth:`param_names`): the names users
        know a moment by. An alias that is also a stored path is left out (the path wins)."""
        names = self.param_names()
        paths = self.names() if names else []
        out: dict[str, str] = {}
        for path in paths:
            parts = path.split("/", 3)
            if len(parts) == 4 and parts[:2] == ["optimizer", "state"] and parts[2].isdigit():
                name = names.get(int(parts[2]))
                if name is not None:
                    out[f"optimizer/state/{name}/{parts[3]}"] = path
        stored = set(paths)
        return {alias: path for alias, path in out.items() if alias not in stored}

    def param_of(self, path: str) -> str | None:
        """The parameter name of an ``optimizer/state/<index>/...`` path (None for any other)."""
        parts = path.split("/", 3)
        if len(parts) < 3 or parts[:2] != ["optimizer", "state"] or not parts[2].isdigit():
            return None
        return self.param_names().get(int(parts[2]))

    def __getitem__(self, name: str) -> zarr.Array[Any]:
        path = self.resolve_name(name)
        return self._zarr(f"tensor {path!r}",
                          lambda: zarr.open_array(store=self.store, path=path, mode="r"))

    def __contains__(self, name: object) -> bool:
        """Whether :meth:`resolve_name` finds exactly one tensor for ``name``."""
        if not isinstance(name, str):
            return False
        try:
            self.resolve_name(name)
        except NotFoundError:
            return False
        return True

    def read_region(self, name: str, region: tuple[slice, ...]) -> np.ndarray:
        """``self[name][region]`` as numpy: a part of one tensor, read from the chunks it
        overlaps only (a DCP rank reads its shard of a stored tensor); zarr's errors become
        the IntegrityError every read raises."""
        array = self[name]
        return np.asarray(self._zarr(f"tensor {name!r}", lambda: array[region]))

    def read(self, name: str, *, writable: bool = True, cache: bool = True) -> np.ndarray:
        """The stored array (BF16 as uint16 bit patterns), decoded in full. ``writable=False``
        allows a read-only array (no copy of a one-chunk tensor's decoded bytes: for readers
        that only look, such as ``diff --values``). ``cache=False``: the chunks are decoded
        for this read alone, not kept in the object store's cache (:meth:`ObjectStore.take`),
        and a one-chunk tensor's memory is its decoded chunk (no copy): for a reader that reads
        each tensor once and hands it on, such as an export; a restore keeps the cache, which
        the next save's deltas read as their bases.

        Before allocating, an array over :data:`SPARSE_LIMIT` bytes must be backed by chunk
        objects that can hold it: each chunk may decode to at most
        :data:`MAX_CHUNK_EXPANSION` bytes per stored byte of its object (checked from the
        objects' stored sizes); otherwise an IntegrityError names the tensor and chunk.
        """
        path = self.resolve_name(name)
        info = self._info(path)
        self._check_backing(info)
        whole = self._whole_plan(path)
        if whole is not None:
            fetch = self.view.get if cache else self.view.take
            return self._zarr(f"tensor {path!r}", lambda: whole.read(
                lambda key: fetch(f"{path}/{key}"), self._map_chunks, writable))
        array = self[path]
        if math.prod(info.shape) == 0:
            return np.zeros(info.shape, dtype=array.dtype)
        return self._zarr(f"tensor {path!r}", lambda: np.asarray(array[...]))

    def _whole_plan(self, path: str) -> WholeArray | None:
        """How to read array ``path`` whole without zarr's event loop (None: through zarr),
        from its zarr.json (parsed once per reader)."""
        if path not in self._whole:
            doc = self.view.get(f"{path}/{METADATA_KEY}")
            found = None if doc is None else self._zarr(f"tensor {path!r}", lambda: whole_read.plan(doc))
            self._whole[path] = found
        return self._whole[path]

    def _map_chunks(self, fn: Callable[[Any], np.ndarray], items: Sequence[Any]) -> list[np.ndarray]:
        """Decode the chunks of one array: on the cores of a local disk, or several requests
        at once on an object store."""
        storage = self.view.objects.storage
        local = not storage.is_remote
        return map_in_order(fn, items, (os.cpu_count() or 1) if local else _PARALLEL_READS, "inshrink-chunks")

    def _check_backing(self, info: ArrayInfo) -> None:
        if max(info.logical_bytes, info.chunk_bytes) <= SPARSE_LIMIT:
            return
        need = -(-info.chunk_bytes // MAX_CHUNK_EXPANSION)  # stored bytes one chunk needs
        oids = sorted({oid for key, oid in info.chunk_ids.items() if key != METADATA_KEY})
        objects = self.view.objects
        if len(oids) == 1:  # most tensors: one chunk, no pool to start
            sizes = {oids[0]: objects.stored_size(oids[0])}
        else:
            with ThreadPoolExecutor(_PARALLEL_SIZES) as pool:
                sizes = dict(zip(oids, pool.map(objects.stored_size, oids), strict=True))
        for key, oid in sorted(info.chunk_ids.items()):
            if key != METADATA_KEY and sizes[oid] < need:
                raise IntegrityError(
                    f"Expected chunk {key!r} of tensor {info.path!r} in snapshot {self.id} "
                    f"(chunks of {info.chunk_bytes} bytes) to be stored in at least {need} bytes "
                    f"(one stored byte per {MAX_CHUNK_EXPANSION} decoded). Got object {oid} of "
                    f"{sizes[oid]} bytes instead: the array's metadata is corrupt (refusing to "
                    "allocate it). Run `inshrink verify`."
                )

    def read_float(self, name: str, *, writable: bool = True) -> np.ndarray:
        """Values as float (dtypes carried as bits, such as BF16, widened to float32), for
        statistics and comparisons. Complex tensors come back complex: they have no float
        value, and a cast to float would drop the imaginary part. ``writable``: as for
        :meth:`read`."""
        path = self.resolve_name(name)
        data = self.read(path, writable=writable)
        entry = dtypes.REGISTRY.get(self._info(path).dtype)
        if entry is not None and entry.carried_as_bits:
            return entry.to_float32(data)
        return data

    def read_many(self, names: list[str], transform: Callable[[str, np.ndarray], np.ndarray] | None = None,
                  *, cache: bool = True) -> dict[str, np.ndarray]:
        """:meth:`read` of each name (then ``transform(path, array)``; ``cache`` as there),
        several tensors at once: on an object store each read waits on requests, and a
        restore reads every tensor. The first failure in the order of ``names`` is raised,
        after every read ended."""
        def one(name: str) -> np.ndarray:
            array = self.read(name) if cache else self.read(name, cache=False)
            return transform(name, array) if transform is not None else array

        storage = self.view.objects.storage
        # an object store waits on requests; a local disk or memory on the cores
        local = not storage.is_remote
        arrays = map_in_order(one, names, (os.cpu_count() or 1) if local else _PARALLEL_READS, "inshrink-read")
        return dict(zip(names, arrays, strict=True))

    def load(self) -> dict[str, np.ndarray]:
        return self.read_many(self.names())

    def dtypes(self) -> dict[str, str]:
        return {p: i.dtype for p, i in self.arrays().items()}

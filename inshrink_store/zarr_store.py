"""A zarr v3 ``Store`` over one snapshot (read-only) or one pending transaction (writable).
Layer: zarr view (``zarr_store`` | ``whole_read`` | ``plans``), above the snapshot index.

Zarr sees a flat key -> bytes mapping; underneath, every value is a content-addressed
object (chunks) or inline text in a node tree (``zarr.json``). Because the store,
unlike a Zarr codec, knows each chunk's key, it is where a quantized chunk is
delta-coded against the chunk at the same key in the parent snapshot. Reading
through it is plain Zarr: ``zarr.open_group(store=repo.snapshot_store("main"))``.
A snapshot's keys come from its :class:`~inshrink_store.index.SnapshotIndex`, shared
with the reader and the writer, so its trees are read once per process.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import json
import posixpath
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any, TypeVar

import numpy as np
from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from inshrink_store import manifest
from inshrink_store.cas import ClosedLoopCoding, ObjectStore
from inshrink_store.errors import IntegrityError, NotFoundError, WriteCheckError
from inshrink_store.index import (  # noqa: F401 - load_root, load_node, tree_path re-exported
    ATTR,
    METADATA_KEY,
    Entry,
    SnapshotIndex,
    load_node,
    load_root,
)
from inshrink_store.layout import tree_path  # noqa: F401 - re-exported
from inshrink_store.manifest import NodeTree, RootTree

#: a chunk's payload as :meth:`SnapshotChunks.get` or :meth:`SnapshotChunks.take` reads it
_Value = TypeVar("_Value", bytes, np.ndarray)


def _node_of(key: str, nodes: set[str]) -> str:
    """The deepest node path (a folder holding zarr.json, or '') that contains ``key``."""
    folder = posixpath.dirname(key)
    while folder:
        if folder in nodes:
            return folder
        folder = posixpath.dirname(folder)
    return ""


class SnapshotChunks:
    """Read-only key -> entry view of one committed root tree.

    Keys come from the snapshot's :class:`SnapshotIndex` (the process-wide one, or with
    ``cached=False`` a private one that reads storage afresh: what ``verify`` needs);
    chunk bytes come from ``objects``. The root tree is read here, so a missing or
    corrupt root fails at once, naming it."""

    writable = False

    def __init__(
        self, objects: ObjectStore, root_id: str, snapshot_id: str | None = None, *,
        cached: bool = True,
    ) -> None:
        self.objects, self.root_id, self.snapshot_id = objects, root_id, snapshot_id
        self.cached = cached
        self.index = (
            SnapshotIndex.of(objects, root_id, snapshot_id) if cached
            else SnapshotIndex(objects.storage, root_id, snapshot_id)
        )
        self.root: RootTree = self.index.root

    def __getstate__(self) -> dict[str, Any]:
        """Pickle what names the snapshot; the index (a lock, parsed trees) is found again."""
        return {"objects": self.objects, "root_id": self.root_id,
                "snapshot_id": self.snapshot_id, "cached": self.cached}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["objects"], state["root_id"], state["snapshot_id"],  # type: ignore[misc]
                      cached=state["cached"])

    def node_trees(self) -> dict[str, tuple[str, NodeTree]]:
        """Node path -> (tree id, tree), from the index (read once, in parallel)."""
        return self.index.node_trees()

    @property
    def entries(self) -> Mapping[str, Entry]:
        """Key -> entry (read-only: the index's own mapping)."""
        return self.index.entries()

    def get(self, key: str) -> bytes | None:
        return self._value(key, self.objects.get)

    def take(self, key: str) -> bytes | np.ndarray | None:
        """:meth:`get`, a chunk object's payload as a new writable array of the caller's own,
        not cached (:meth:`ObjectStore.take`); an inline value as stored."""
        return self._value(key, self.objects.take)

    def _value(self, key: str, read: Callable[[str], _Value]) -> bytes | _Value | None:
        entry = self.index.entry(key)  # reads only the node tree that holds the key
        if entry is None:
            return None
        if entry.inline is not None:
            return entry.inline
        assert entry.oid is not None
        try:
            return read(entry.oid)
        except (IntegrityError, NotFoundError) as exc:
            where = f" in snapshot {self.snapshot_id}" if self.snapshot_id else ""
            raise type(exc)(f"Chunk {key!r}{where}: {exc}") from exc

    def keys(self) -> list[str]:
        return self.index.keys()

    def has(self, key: str) -> bool:
        return self.index.entry(key) is not None


@functools.lru_cache(maxsize=4096)
def raw_float_element(zarr_json: bytes) -> str | None:
    """See :meth:`PendingChunks._float_element`: from one array's zarr.json (cached: every
    chunk of an array asks)."""
    try:
        doc = json.loads(zarr_json)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("node_type") != "array":
        return None
    codecs = doc.get("codecs")
    if not isinstance(codecs, list) or len(codecs) != 1 or not isinstance(codecs[0], dict):
        return None
    codec = codecs[0]
    config = codec.get("configuration") or {}
    if codec.get("name") != "bytes" or not isinstance(config, dict) or config.get("endian", "little") != "little":
        return None
    data_type = doc.get("data_type")
    attributes = doc.get("attributes")
    ours = attributes.get(ATTR) if isinstance(attributes, dict) else None
    declared = ours.get("dtype") if isinstance(ours, dict) else None
    if data_type in ("float32", "float16") and declared in (None, "F32" if data_type == "float32" else "F16"):
        return str(data_type)
    if data_type == "uint16" and declared == "BF16":
        return "bfloat16"
    return None


def compact_json(text: bytes) -> bytes:
    """A zarr.json document without its indentation (zarr writes 2-space indented JSON; it is
    stored inline in every node tree of every version that changes the array, and on a small
    model those documents were a fifth to a half of all stored bytes). Same document, key
    order kept; text that is not JSON is kept as it is (zarr reads whatever it wrote)."""
    try:
        return json.dumps(json.loads(text), separators=(",", ":")).encode()
    except (ValueError, RecursionError):
        return text


class SortedEntries(dict[str, Entry]):
    """A key -> :class:`Entry` dict that also keeps its keys sorted, so every key under a
    prefix is found by bisection.

    Why: each array written into a version that inherits its parent's keys first drops
    whatever the parent held under the array's path; scanning every key for that made a
    save of N tensors cost N x (keys) string tests, quadratic in the tensor count (a
    state dict of thousands of tensors spent seconds there). Every way a dict changes
    goes through the overrides below, so the order cannot go stale, whoever writes."""

    def __init__(self, items: Mapping[str, Entry] | None = None) -> None:
        super().__init__(items or {})
        self._order = sorted(super().keys())

    def __reduce__(self) -> Any:
        return (SortedEntries, (dict(self),))

    def __setitem__(self, key: str, value: Entry) -> None:
        if key not in self:
            bisect.insort(self._order, key)
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        del self._order[bisect.bisect_left(self._order, key)]

    def pop(self, key: str, *default: Any) -> Any:
        if key in self:
            value = super().__getitem__(key)
            del self[key]
            return value
        return super().pop(key, *default)

    def popitem(self) -> tuple[str, Entry]:
        key, value = super().popitem()
        del self._order[bisect.bisect_left(self._order, key)]
        return key, value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return super().__getitem__(key)

    def update(self, *others: Any, **kwargs: Entry) -> None:
        items = dict(*others, **kwargs)
        fresh = sum(1 for key in items if key not in self)
        if fresh > 16 and fresh * 8 > len(self):  # many new keys: one sort, not an insort each
            super().update(items)
            self._order = sorted(super().keys())
            return
        for key, value in items.items():
            self[key] = value

    def clear(self) -> None:
        super().clear()
        self._order.clear()

    def __ior__(self, other: Any) -> SortedEntries:  # type: ignore[override, misc]
        self.update(other)
        return self

    def sorted_keys(self) -> list[str]:
        """Every key, sorted (a copy)."""
        return list(self._order)

    def keys_under(self, prefix: str) -> list[str]:
        """Every key that starts with ``prefix``, sorted (found by bisection)."""
        start = end = bisect.bisect_left(self._order, prefix)
        while end < len(self._order) and self._order[end].startswith(prefix):
            end += 1
        return self._order[start:end]

    def delete_under(self, prefix: str) -> None:
        """Remove every key that starts with ``prefix``."""
        start = bisect.bisect_left(self._order, prefix)
        end = start
        while end < len(self._order) and self._order[end].startswith(prefix):
            end += 1
        for key in self._order[start:end]:
            super().__delitem__(key)
        del self._order[start:end]


class PendingChunks:
    """A writable view that starts as a copy of its parent's entries (or empty)."""

    writable = True

    def __init__(
        self, objects: ObjectStore, parent: SnapshotChunks | None = None, inherit: bool = True
    ) -> None:
        self.objects = objects
        self.parent = parent
        self.entries = SortedEntries(parent.entries if parent and inherit else None)
        self._parent_entries: Mapping[str, Entry] = parent.entries if parent else {}
        self.new_stored_bytes = 0
        # the writer stores several tensors at once: changes and listings take turns
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_lock"]  # a lock does not pickle; the copy gets its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        if entry.inline is not None:
            return entry.inline
        assert entry.oid is not None
        return self.objects.get(entry.oid)

    def keys(self) -> list[str]:
        with self._lock:
            return self.entries.sorted_keys()

    def has(self, key: str) -> bool:
        return key in self.entries

    def put(self, key: str, value: bytes | memoryview, closed: ClosedLoopCoding | None = None) -> None:
        """Store chunk (or zarr.json) ``key``; ``closed``: a planner's closed-loop coding of
        the chunk (see :meth:`ObjectStore.put`)."""
        if posixpath.basename(key) == METADATA_KEY and _is_text(bytes(value)):
            with self._lock:
                self.entries[key] = Entry(inline=compact_json(bytes(value)))
            return
        previous = self._parent_entries.get(key)
        base = previous.oid if previous is not None else None
        # outside the lock: objects in parallel
        try:
            result = self.objects.put(value, base=base, element=self._float_element(key), closed=closed)
        except WriteCheckError as exc:
            tensor, _, chunk = key.partition("/c/")
            raise WriteCheckError(f"Tensor {tensor!r}, chunk {chunk or key!r}: {exc}") from exc
        with self._lock:
            self.new_stored_bytes += result.stored_bytes
            self.entries[key] = Entry(oid=result.oid)

    def _float_element(self, key: str) -> str | None:
        """The float element type of chunk ``key`` when its array stores raw floats (zarr's
        ``bytes`` codec alone, little-endian float32, float16, or bfloat16 bits as the
        writer declares them): the object store then codes it (coder 3, against the parent's
        chunk where that is smaller). None for anything else, stored as zarr encoded it."""
        parts = key.split("/")
        for cut in range(len(parts) - 1, 0, -1):
            entry = self.entries.get("/".join(parts[:cut]) + "/" + METADATA_KEY)
            if entry is not None and entry.inline is not None:
                return raw_float_element(entry.inline)
        return None

    def delete_prefix(self, prefix: str) -> None:
        """Remove every key under ``prefix`` (an array being written anew)."""
        with self._lock:
            self.entries.delete_under(prefix)

    def delete(self, key: str) -> None:
        with self._lock:
            self.entries.pop(key, None)

    def node(self, path: str) -> tuple[bytes | None, dict[str, str]]:
        """Node ``path`` as this view holds it: its zarr.json text (None when it has none) and
        its chunk object ids (key relative to ``path``, e.g. ``c/0/0`` -> id), without the keys
        of nodes below it (a group's members): what
        :meth:`~inshrink_store.session.WriteSession.stage_array` takes to put the node into
        another version. Keys are found by bisection, so asking about each of many arrays
        costs a lookup each, not a pass over every key."""
        prefix = f"{path}/" if path else ""
        with self._lock:
            found = {key: self.entries[key] for key in self.entries.keys_under(prefix)}
        nodes = {path} | {posixpath.dirname(key) for key in found if posixpath.basename(key) == METADATA_KEY}
        metadata, chunks = None, {}
        for key, entry in found.items():
            is_doc = posixpath.basename(key) == METADATA_KEY
            if (posixpath.dirname(key) if is_doc else _node_of(key, nodes)) != path:
                continue  # a key of a node below this one
            if is_doc and entry.inline is not None:
                metadata = entry.inline
            elif entry.oid is not None:
                chunks[key[len(prefix):]] = entry.oid
        return metadata, chunks

    def adopt_from_parent(self, path: str) -> bool:
        """Take array ``path`` as the parent stores it (its zarr.json, every chunk id, and the
        documents of the groups above it this view lacks); False if the parent has no node
        ``path``. Nothing is read but the parent's trees: its objects are stored already."""
        if self.parent is None:
            return False
        found = self.parent.index.node(path)
        if found is None or found[1].metadata is None:
            return False
        tree, metadata = found[1], found[1].metadata
        adopted = {f"{path}/{METADATA_KEY}": Entry(inline=metadata.encode())}
        adopted.update({f"{path}/{rel}": Entry(oid=oid) for rel, oid in tree.chunks.items()})
        parts = path.split("/")
        for cut in range(len(parts)):
            group = "/".join(parts[:cut])
            key = f"{group}/{METADATA_KEY}" if group else METADATA_KEY
            above = self.parent.index.node(group)
            if above is not None and above[1].metadata is not None:
                adopted.setdefault(key, Entry(inline=above[1].metadata.encode()))
        with self._lock:
            for key, entry in adopted.items():
                if key.endswith(METADATA_KEY) and key != f"{path}/{METADATA_KEY}" and key in self.entries:
                    continue  # a group this save already wrote keeps its own document
                self.entries[key] = entry
        return True

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()

    def build_trees(self) -> tuple[RootTree, dict[str, NodeTree]]:
        """Group keys by node; returns the root tree (holding the small nodes inline) and the
        node trees to store as files, keyed by tree id."""
        nodes = {""} | {
            posixpath.dirname(k) for k, e in self.entries.items()
            if posixpath.basename(k) == METADATA_KEY
        }
        grouped: dict[str, dict[str, Entry]] = {n: {} for n in nodes}
        for key, entry in self.entries.items():
            node = _node_of(key, nodes) if posixpath.basename(key) != METADATA_KEY else posixpath.dirname(key)
            rel = key[len(node) + 1 :] if node else key
            grouped[node][rel] = entry
        trees: dict[str, NodeTree] = {}
        root_nodes: dict[str, str] = {}
        inline_nodes: dict[str, NodeTree] = {}
        inline_bytes = 0
        for node, items in sorted(grouped.items()):
            meta = items.pop(METADATA_KEY, None)
            inline = meta.inline.decode() if meta is not None and meta.inline is not None else None
            chunks = {rel: e.oid for rel, e in sorted(items.items()) if e.oid is not None}
            if meta is not None and meta.oid is not None:
                chunks[METADATA_KEY] = meta.oid
            if node and inline is None and not chunks:
                continue
            tree = NodeTree(metadata=inline, chunks=chunks)
            size = len(inline or "") + 64 * len(chunks)  # what it adds to the root, about
            if tree.inlinable and inline_bytes + size <= manifest.INLINE_MAX_ROOT_BYTES:
                inline_nodes[node] = tree  # kept in the root tree: no file of its own (NodeTree.inlinable)
                inline_bytes += size
                continue
            trees[tree.id] = tree
            root_nodes[node] = tree.id
        return RootTree(nodes=root_nodes, inline=inline_nodes), trees


def _as_bytes(value: Buffer) -> bytes:
    """The bytes of ``value``: the ``bytes`` object itself where the buffer is a view of a
    whole one (what a codec's ``from_bytes`` output is), else a copy. The object store keeps
    a payload as ``bytes``; copying a codec's output once more cost a pass over every chunk."""
    array = value.as_numpy_array()
    base = array.base
    if isinstance(base, bytes) and array.ndim == 1 and array.nbytes == len(base) and array.flags.c_contiguous:
        return base
    return value.to_bytes()


def _is_text(value: bytes) -> bool:
    try:
        bytes(value).decode()
    except UnicodeDecodeError:
        return False
    return True


def _slice(value: bytes, byte_range: ByteRequest | None) -> bytes:
    if byte_range is None:
        return value
    if isinstance(byte_range, RangeByteRequest):
        return value[byte_range.start : byte_range.end]
    if isinstance(byte_range, OffsetByteRequest):
        return value[byte_range.offset :]
    if isinstance(byte_range, SuffixByteRequest):
        return value[-byte_range.suffix :] if byte_range.suffix else b""
    raise TypeError(  # zarr's suite matches "Unexpected byte_range, got"
        f"Unexpected byte_range, got {byte_range!r}. Expected a zarr ByteRequest (RangeByteRequest, "
        f"OffsetByteRequest or SuffixByteRequest). Got {type(byte_range).__name__} instead."
    )


class InshrinkStore(Store):
    """zarr Store over a :class:`SnapshotChunks` (read-only) or :class:`PendingChunks` view."""

    supports_writes = True
    supports_deletes = True
    supports_listing = True
    supports_partial_writes = False
    supports_consolidated_metadata = False

    def __init__(self, view: SnapshotChunks | PendingChunks, *, read_only: bool = False) -> None:
        super().__init__(read_only=read_only or not view.writable)
        self._view = view

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, InshrinkStore)
            and (other._view is self._view or _same_view(other._view, self._view))
            and other.read_only == self.read_only
        )

    def __repr__(self) -> str:
        kind = "snapshot" if isinstance(self._view, SnapshotChunks) else "transaction"
        return f"InshrinkStore({kind} of {self._view.objects.storage.url!r})"

    @property
    def view(self) -> SnapshotChunks | PendingChunks:
        """The snapshot or write session this store reads and writes."""
        return self._view

    def adopt_from_parent(self, path: str) -> bool:
        """See :meth:`PendingChunks.adopt_from_parent` (False on a read-only snapshot)."""
        return isinstance(self._view, PendingChunks) and self._view.adopt_from_parent(path)

    def with_read_only(self, read_only: bool = False) -> InshrinkStore:
        return type(self)(self._view, read_only=read_only)

    def __getstate__(self) -> dict[str, Any]:
        return {"view": self._view, "read_only": self.read_only, "open": False}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._view = state["view"]
        self._read_only = state["read_only"]
        self._is_open = False

    async def clear(self) -> None:
        self._check_writable()
        assert isinstance(self._view, PendingChunks)
        self._view.clear()

    async def get(
        self, key: str, prototype: BufferPrototype | None = None, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        prototype = prototype or default_buffer_prototype()
        if not self._is_open:
            await self._open()
        if isinstance(self._view, PendingChunks):
            # a key this session has not got, or a zarr.json it holds inline, is answered at
            # once: no storage to wait on, so no thread hop (zarr asks for every parent's
            # zarr.json of every array it creates)
            entry = self._view.entries.get(key)
            if entry is None:
                return None
            if entry.inline is not None:
                return prototype.buffer.from_bytes(_slice(entry.inline, byte_range))
        value = await asyncio.to_thread(self._view.get, key)
        if value is None:
            return None
        return prototype.buffer.from_bytes(_slice(value, byte_range))

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    async def exists(self, key: str) -> bool:
        return self._view.has(key)

    async def set(self, key: str, value: Buffer, byte_range: tuple[int, int] | None = None) -> None:
        self._check_writable()
        await self._ensure_open()
        if not isinstance(value, Buffer):
            raise TypeError(f"Expected a zarr Buffer for {key!r}. Got {type(value).__name__} instead.")
        assert isinstance(self._view, PendingChunks)
        data = _as_bytes(value)
        if posixpath.basename(key) == METADATA_KEY and _is_text(data):
            self._view.put(key, data)  # kept inline in the node tree: no storage, no thread hop
        else:
            await asyncio.to_thread(self._view.put, key, data)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        if not self._view.has(key):
            await self.set(key, value)

    async def delete(self, key: str) -> None:
        self._check_writable()
        assert isinstance(self._view, PendingChunks)
        self._view.delete(key)

    async def list(self) -> AsyncIterator[str]:
        for key in self._view.keys():
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in self._view.keys():
            if key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        prefix = prefix.rstrip("/")
        start = f"{prefix}/" if prefix else ""
        seen: set[str] = set()
        for key in self._view.keys():
            if key.startswith(start):
                child = key[len(start) :].split("/", 1)[0]
                if child and child not in seen:
                    seen.add(child)
                    yield child


def _same_view(a: object, b: object) -> bool:
    if isinstance(a, SnapshotChunks) and isinstance(b, SnapshotChunks):
        return a.root_id == b.root_id and a.objects.storage.url == b.objects.storage.url
    if isinstance(a, PendingChunks) and isinstance(b, PendingChunks):
        return a.objects.storage.url == b.objects.storage.url and a.entries == b.entries
    return False

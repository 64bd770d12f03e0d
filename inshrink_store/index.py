"""What one committed snapshot holds, read from storage once per process and then kept.
Layer: snapshot index and residual (``index`` | ``residual``), under the zarr view, above ``cas``.

A snapshot's root tree names one node tree per zarr node; together they hold every
``zarr.json`` and every chunk key -> object id. Reading a tensor needs some of that,
listing tensors needs the rest, and before this index every caller (the zarr store view,
the reader, the writer's parent view, the codebook lookup) read the trees again: about
five reads of every tree to read one tensor. Trees are immutable and content-addressed
(a tree's id is the hash of its bytes, checked on every read), so a parsed tree can
never go stale: the :class:`SnapshotIndex` of a root tree is built once, lazily and
under a lock, and kept in a process-wide LRU keyed by store and root tree id. A store
that was damaged *after* a tree was cached still reads correctly here; ``verify``
checks storage itself and should open its views with ``cached=False``.

Also here, because every query returns them: :class:`Entry` (what a store key holds)
and :class:`ArrayInfo` (an array's zarr.json checked against its chunks).
"""

from __future__ import annotations

import copy
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

import numpy as np

from inshrink_store import dtypes
from inshrink_store.cas import ObjectStore
from inshrink_store.codecs import nuq
from inshrink_store.errors import FormatError, IntegrityError, NotFoundError
from inshrink_store.layout import tree_path
from inshrink_store.manifest import NodeTree, RootTree
from inshrink_store.storage import Storage
from inshrink_store.structure import METADATA_KEY as METADATA_KEY  # re-exported

ATTR = "inshrink"
#: arrays up to this many declared bytes may miss chunks (zarr reads them as the fill value)
SPARSE_LIMIT = 64 << 20
#: at most this many chunks of a (small) array may be missing: zarr visits each one
MAX_MISSING_CHUNKS = 4096
#: snapshots whose index the process keeps (each holds its trees and parsed zarr.json)
DEFAULT_CACHE_SIZE = 32
_MAX_RANK = 64
_PARALLEL_READS = 8
T = TypeVar("T")


# -- reading trees ------------------------------------------------------------------------


def _read_tree(storage: Storage, tree_id: str) -> bytes:
    try:
        return storage.read(tree_path(tree_id))
    except FileNotFoundError:
        raise NotFoundError(
            f"Expected tree {tree_id} at {tree_path(tree_id)}. Got nothing there instead: "
            "the store is missing data. Run `inshrink verify`."
        ) from None


def load_root(objects: ObjectStore, root_id: str) -> RootTree:
    """Root tree ``root_id`` read from storage now (no cache): for gc and verify."""
    return RootTree.from_bytes(_read_tree(objects.storage, root_id), root_id)


def load_node(objects: ObjectStore, tree_id: str) -> NodeTree:
    """Node tree ``tree_id`` read from storage now (no cache): for gc and verify."""
    return NodeTree.from_bytes(_read_tree(objects.storage, tree_id), tree_id)


class Entry:
    """What a store key holds: inline metadata text, or an object id."""

    __slots__ = ("inline", "oid")

    def __init__(self, inline: bytes | None = None, oid: str | None = None) -> None:
        self.inline, self.oid = inline, oid

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Entry) and (self.inline, self.oid) == (other.inline, other.oid)

    def __repr__(self) -> str:
        return f"Entry(oid={self.oid!r})" if self.oid is not None else "Entry(inline)"


# -- array metadata -----------------------------------------------------------------------


@dataclass(frozen=True)
class ArrayInfo:
    """One array as its metadata describes it, checked against its node tree's chunks."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    storage: str
    attributes: Mapping[str, Any]
    chunk_ids: Mapping[str, str]

    @property
    def itemsize(self) -> int:
        entry = dtypes.REGISTRY.get(self.dtype)
        return entry.carrier.itemsize if entry is not None else 1

    @property
    def logical_bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def chunk_bytes(self) -> int:
        """Bytes one whole chunk decodes to."""
        return math.prod(self.chunks) * self.itemsize


def inshrink_attributes(doc: Mapping[str, Any]) -> dict[str, Any]:
    """``attributes.inshrink`` of a zarr.json document ({} when absent or not an object)."""
    attributes = doc.get("attributes", {})
    ours = attributes.get(ATTR, {}) if isinstance(attributes, dict) else {}
    return dict(ours) if isinstance(ours, dict) else {}


def _bad_array(path: str, what: str, got: Any) -> IntegrityError:
    shown = repr(got)
    shown = shown if len(shown) <= 80 else shown[:80] + "..."
    return IntegrityError(
        f"Expected {what} in the zarr.json of tensor {path!r}. Got {shown} instead: the "
        "array's metadata is corrupt or not an array inshrink-store can read. Run `inshrink verify`."
    )


def _int_list(value: Any, path: str, what: str, minimum: int) -> tuple[int, ...]:
    if (
        not isinstance(value, list) or len(value) > _MAX_RANK
        or not all(type(v) is int and minimum <= v < 1 << 62 for v in value)
    ):
        raise _bad_array(path, f"{what} as a list of at most {_MAX_RANK} integers >= {minimum}", value)
    return tuple(value)


def _itemsize(doc: Mapping[str, Any], declared: str, path: str) -> int:
    entry = dtypes.REGISTRY.get(declared)
    if entry is not None:
        return entry.carrier.itemsize
    data_type = doc.get("data_type")
    try:
        dtype = np.dtype(data_type) if isinstance(data_type, str) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.itemsize == 0 or dtype.hasobject:
        carriers = sorted({d.carrier.name for d in dtypes.REGISTRY.values()})
        raise FormatError(
            f"Expected tensor {path!r} to have a fixed-size numeric data_type (one of "
            f"{carriers}). Got {str(data_type)[:80]!r} instead; "
            "this store's array is not readable by inshrink-store."
        )
    return dtype.itemsize


def _key_encoding(doc: Mapping[str, Any], path: str) -> tuple[str, str]:
    enc = doc.get("chunk_key_encoding", {"name": "default"})
    name = enc.get("name") if isinstance(enc, dict) else None
    config = enc.get("configuration", {}) if isinstance(enc, dict) else None
    if name not in ("default", "v2") or not isinstance(config, dict):
        raise _bad_array(path, "chunk_key_encoding 'default' or 'v2'", enc)
    separator = config.get("separator", "/" if name == "default" else ".")
    if separator not in ("/", "."):
        raise _bad_array(path, "a chunk key separator '/' or '.'", separator)
    return name, separator


def _grid_index(key: str, encoding: tuple[str, str], grid: tuple[int, ...]) -> bool:
    """Whether ``key`` names a chunk inside ``grid`` under the chunk key encoding."""
    name, sep = encoding
    if name == "default":
        if key == "c":
            return not grid
        if not key.startswith("c" + sep):
            return False
        key = key[2:]
    elif not grid:
        return key == "0"
    parts = key.split(sep)
    if len(parts) != len(grid):
        return False
    return all(p.isdigit() and p.isascii() and int(p) < n for p, n in zip(parts, grid, strict=True))


def array_info(path: str, doc: Mapping[str, Any], chunk_ids: Mapping[str, str]) -> ArrayInfo:
    """Validate one array's zarr.json against its chunks (see ``SnapshotReader.arrays``):
    shape and chunk_shape are integer lists of one rank, the dtype is known, and an array
    over :data:`SPARSE_LIMIT` bytes (or missing over :data:`MAX_MISSING_CHUNKS` chunks)
    has every chunk of its grid stored. IntegrityError (FormatError for an unreadable
    data_type) naming the tensor otherwise, before anything is allocated."""
    shape = _int_list(doc.get("shape"), path, "shape", 0)
    grid_doc = doc.get("chunk_grid")
    config = grid_doc.get("configuration") if isinstance(grid_doc, dict) else None
    if not isinstance(grid_doc, dict) or grid_doc.get("name") != "regular" or not isinstance(config, dict):
        raise _bad_array(path, "a regular chunk_grid", grid_doc)
    chunks = _int_list(config.get("chunk_shape"), path, "chunk_shape", 1)
    if len(chunks) != len(shape):
        raise _bad_array(path, f"a chunk_shape of rank {len(shape)} like the shape {list(shape)}",
                         list(chunks))
    attrs = inshrink_attributes(doc)
    declared = attrs.get("dtype", str(doc.get("data_type")))
    if "dtype" in attrs and (not isinstance(declared, str) or declared not in dtypes.REGISTRY):
        raise _bad_array(path, f"attributes.inshrink.dtype in {sorted(dtypes.REGISTRY)}", declared)
    storage = attrs.get("storage", "lossless")
    if not isinstance(storage, str):
        raise _bad_array(path, "attributes.inshrink.storage as a string", storage)
    itemsize = _itemsize(doc, declared, path)
    nbytes = math.prod(shape) * itemsize
    grid = tuple(-(-s // c) for s, c in zip(shape, chunks, strict=True))
    needed = math.prod(grid)
    encoding = _key_encoding(doc, path)
    present = sum(1 for key in chunk_ids if key != METADATA_KEY and _grid_index(key, encoding, grid))
    chunk_bytes = math.prod(chunks) * itemsize
    if needed > present and (
        max(nbytes, chunk_bytes) > SPARSE_LIMIT or needed - present > MAX_MISSING_CHUNKS
    ):
        raise IntegrityError(
            f"Expected tensor {path!r} (shape {list(shape)}, chunks {list(chunks)}, {nbytes} "
            f"bytes) to have all {needed} of its chunks stored, as every array over "
            f"{SPARSE_LIMIT >> 20} MiB (or missing over {MAX_MISSING_CHUNKS} chunks) must. Got "
            f"{present} instead: its metadata or node tree is corrupt (refusing to allocate it). "
            "Run `inshrink verify`."
        )
    return ArrayInfo(path, shape, declared, chunks, storage, attrs, dict(chunk_ids))


def _node_doc(path: str, text: str, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        reason = "nesting too deep" if isinstance(exc, RecursionError) else str(exc)[:120]
        raise IntegrityError(
            f"Expected the zarr.json of node {path!r}{where} to be JSON. Got {reason} "
            "instead: the node tree is corrupt. Run `inshrink verify`."
        ) from None
    if not isinstance(doc, dict):
        raise IntegrityError(
            f"Expected the zarr.json of node {path!r}{where} to be a JSON object. Got a "
            f"{type(doc).__name__} instead: the node tree is corrupt. Run `inshrink verify`."
        )
    return doc


def _nuq_config(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``inshrink.nuq`` codec configuration of an array document, if it has one."""
    found = None
    codecs = doc.get("codecs")
    for codec in codecs if isinstance(codecs, list) else []:
        if isinstance(codec, dict) and codec.get("name") == nuq.CODEC_ID:
            config = codec.get("configuration", {})
            found = config if isinstance(config, dict) else {}
    return found


# -- the index ----------------------------------------------------------------------------


class SnapshotIndex:
    """Everything one root tree says, parsed on first use and kept: obtain one with
    :meth:`of` (shared per process) or build a private one with ``SnapshotIndex(...)``.

    Every query is computed once under the index's lock, so any number of threads asking
    the same snapshot read each tree once. Failed builds (a missing or corrupt tree) are
    not kept: the next query reads again and fails again, naming the tree. Returned
    mappings are the index's own: read them, never change them.
    """

    def __init__(self, storage: Storage, root_id: str, snapshot_id: str | None = None) -> None:
        self.storage, self.root_id, self.snapshot_id = storage, root_id, snapshot_id
        self._lock = threading.RLock()
        self._built: dict[str, Any] = {}
        #: node trees read one at a time (by :meth:`node`), by tree id
        self._one_tree: dict[str, NodeTree] = {}
        self._gates: dict[str, threading.Lock] = {}
        #: guards the two dicts above; never held while reading (builds hold ``_lock`` and
        #: read trees on a pool, so the pool's threads must not need ``_lock``)
        self._trees_lock = threading.Lock()
        #: arrays validated one at a time (by :meth:`array`), by path
        self._one_array: dict[str, ArrayInfo] = {}

    @classmethod
    def of(cls, objects: ObjectStore, root_id: str, snapshot_id: str | None = None) -> SnapshotIndex:
        """The process-wide index of ``root_id`` in ``objects``' store (built on first use)."""
        return CACHE.get(objects.storage, root_id, snapshot_id)

    def __repr__(self) -> str:
        return f"SnapshotIndex({self.storage.url!r}, root {self.root_id[:12]})"

    def _once(self, name: str, build: Callable[[], T]) -> T:
        if name in self._built:
            return self._built[name]  # type: ignore[no-any-return]
        with self._lock:
            if name not in self._built:
                self._built[name] = build()
            return self._built[name]  # type: ignore[no-any-return]

    @property
    def _where(self) -> str:
        return f" in snapshot {self.snapshot_id}" if self.snapshot_id else f" of root tree {self.root_id}"

    # -- trees ---------------------------------------------------------------------------
    @property
    def root(self) -> RootTree:
        return self._once("root", lambda: RootTree.from_bytes(
            _read_tree(self.storage, self.root_id), self.root_id))

    def node_trees(self) -> dict[str, tuple[str, NodeTree]]:
        """Node path -> (tree id, tree), sorted by path; read in parallel on first use."""
        return dict(self._once("nodes", self._read_nodes))

    def _read_nodes(self) -> dict[str, tuple[str, NodeTree]]:
        """Every node: the trees stored as files, read in parallel, and the ones the root
        holds inline (named by their :attr:`~NodeTree.inline_id`)."""
        root = self.root
        items = sorted(root.nodes.items())
        ids = sorted({tid for _path, tid in items})  # equal nodes (empty groups) share a tree
        trees: dict[str, NodeTree] = {}
        if ids:
            with ThreadPoolExecutor(_PARALLEL_READS) as pool:
                trees = dict(zip(ids, pool.map(self._tree, ids), strict=True))
        found = {path: (tid, trees[tid]) for path, tid in items}
        found.update({path: (tree.inline_id, tree) for path, tree in root.inline.items()})
        return dict(sorted(found.items()))

    def _tree(self, tid: str) -> NodeTree:
        """Node tree ``tid``, read at most once however many threads ask (one gate per tree,
        so reads of different trees still run in parallel)."""
        with self._trees_lock:
            tree = self._one_tree.get(tid)
            if tree is not None:
                return tree
            gate = self._gates.setdefault(tid, threading.Lock())
        with gate:
            with self._trees_lock:
                tree = self._one_tree.get(tid)
            if tree is None:
                tree = NodeTree.from_bytes(_read_tree(self.storage, tid), tid)
                with self._trees_lock:
                    self._one_tree[tid] = tree
                    self._gates.pop(tid, None)
        return tree

    def seed(self, root: RootTree, trees: Mapping[str, NodeTree]) -> None:
        """Take the root tree and node trees (keyed by the ids they were stored under) that a
        writer just stored, so this process reads none of them back."""
        if root.id != self.root_id:
            raise IntegrityError(f"Expected root tree {self.root_id} to seed the index. Got {root.id} instead.")
        with self._lock:
            self._built.setdefault("root", root)
        with self._trees_lock:
            for tid in set(root.nodes.values()):
                tree = trees.get(tid)
                if tree is not None:
                    self._one_tree.setdefault(tid, tree)

    def adopt(self, trees: Mapping[str, NodeTree]) -> None:
        """Take node trees (by id) that another index of this store read (and checked against
        their ids, as every read does), e.g. in the same ``verify`` run."""
        with self._trees_lock:
            for tid, tree in trees.items():
                self._one_tree.setdefault(tid, tree)

    def node(self, path: str) -> tuple[str, NodeTree] | None:
        """(tree id, tree) of node ``path``, or None if the snapshot has no such node.

        Reads that one tree (not all of them): opening one tensor of a large snapshot on an
        object store costs a request for its tree, not one per tensor."""
        inline = self.root.inline.get(path)
        if inline is not None:
            return inline.inline_id, inline
        tid = self.root.nodes.get(path)
        if tid is None:
            return None
        nodes = self._built.get("nodes")
        if nodes is not None:
            return nodes[path]  # type: ignore[no-any-return]
        return tid, self._tree(tid)

    def entry(self, key: str) -> Entry | None:
        """What store key ``key`` holds, reading only the node tree that holds it."""
        entries = self._built.get("entries")
        if entries is not None:
            return entries.get(key)  # type: ignore[no-any-return]
        parts = key.split("/")
        # the key's node is the longest of its parent paths that is a node
        for cut in range(len(parts) - 1, -1, -1):
            path = "/".join(parts[:cut])
            if not self.root.has_node(path):
                continue
            found = self.node(path)
            assert found is not None
            tree, rel = found[1], "/".join(parts[cut:])
            if rel == METADATA_KEY:
                return Entry(inline=tree.metadata.encode()) if tree.metadata is not None else None
            oid = tree.chunks.get(rel)
            return Entry(oid=oid) if oid is not None else None  # a key belongs to its deepest node
        return None

    def array(self, path: str) -> ArrayInfo | None:
        """:class:`ArrayInfo` of array ``path`` (validated), or None if it is not an array:
        reads that array's tree only."""
        arrays = self._built.get("arrays")
        if arrays is not None:
            return arrays.get(path)  # type: ignore[no-any-return]
        with self._lock:
            info = self._one_array.get(path)
        if info is not None:
            return info
        found = self.node(path)
        if found is None or found[1].metadata is None:
            return None
        doc = _node_doc(path, found[1].metadata, self._where)
        if doc.get("node_type") != "array":
            return None
        info = array_info(path, doc, found[1].chunks)
        with self._lock:
            return self._one_array.setdefault(path, info)

    def entries(self) -> Mapping[str, Entry]:
        """Store key -> :class:`Entry` (inline zarr.json text or chunk object id)."""
        return self._once("entries", self._build_entries)

    def _build_entries(self) -> Mapping[str, Entry]:
        entries: dict[str, Entry] = {}
        for path, (_tid, tree) in self._once("nodes", self._read_nodes).items():
            prefix = f"{path}/" if path else ""
            if tree.metadata is not None:
                entries[prefix + METADATA_KEY] = Entry(inline=tree.metadata.encode())
            for rel, oid in tree.chunks.items():
                entries[prefix + rel] = Entry(oid=oid)
        return MappingProxyType(entries)

    def keys(self) -> list[str]:
        """Every store key, sorted (a copy)."""
        return list(self._once("keys", lambda: sorted(self.entries())))

    # -- arrays --------------------------------------------------------------------------
    def _docs(self) -> dict[str, dict[str, Any]]:
        return self._once("docs", self._parse_docs)

    def _parse_docs(self) -> dict[str, dict[str, Any]]:
        docs = {}
        for path, (_tid, tree) in self._once("nodes", self._read_nodes).items():
            if tree.metadata is None:
                continue
            doc = _node_doc(path, tree.metadata, self._where)
            if doc.get("node_type") == "array":
                docs[path] = doc
        return docs

    def array_docs(self) -> list[tuple[str, dict[str, Any]]]:
        """(path, zarr.json document) of every array node, sorted by path (copies).

        A node whose zarr.json is not a JSON object is an IntegrityError naming it."""
        return [(path, copy.deepcopy(doc)) for path, doc in self._docs().items()]

    def array_doc(self, path: str) -> dict[str, Any]:
        """The zarr.json document (a copy) of array ``path``; NotFoundError naming it if none."""
        doc = self._docs().get(path)
        if doc is None:
            raise NotFoundError(
                f"Expected an array {path!r}{self._where}. Got no such array instead "
                f"({len(self._docs())} arrays; list them with `inshrink ls`)."
            )
        return copy.deepcopy(doc)

    def arrays(self) -> dict[str, ArrayInfo]:
        """Path -> :class:`ArrayInfo` of every array, each validated (see :func:`array_info`)."""
        return dict(self._once("arrays", self._build_arrays))

    def _build_arrays(self) -> dict[str, ArrayInfo]:
        nodes = self._once("nodes", self._read_nodes)
        return {path: array_info(path, doc, nodes[path][1].chunks) for path, doc in self._docs().items()}

    def chunk_ids(self, path: str) -> dict[str, str]:
        """Chunk key (relative to the node) -> object id of node ``path`` (a copy)."""
        found = self.node(path)
        if found is None:
            raise NotFoundError(
                f"Expected a node {path!r}{self._where}. Got no such node instead "
                "(list the tensors with `inshrink ls`)."
            )
        return dict(found[1].chunks)

    def quantization_codecs(self) -> dict[str, dict[str, Any]]:
        """Path -> {"codec": nuq configuration, "attributes": inshrink attributes} of every
        quantized array: the previous codebooks a planner may reuse (copies)."""
        return copy.deepcopy(self._once("nuq", self._find_nuq))

    def _find_nuq(self) -> dict[str, dict[str, Any]]:
        out = {}
        for path, doc in self._docs().items():
            config = _nuq_config(doc)
            if config is not None:
                out[path] = {"codec": config, "attributes": inshrink_attributes(doc)}
        return out


# -- the process-wide cache ---------------------------------------------------------------


def _store_key(storage: Storage) -> tuple[str, str]:
    """Which store a storage reaches: its URL and options (one URL may name two endpoints)."""
    return storage.url, repr(sorted(storage.storage_options.items()))


class IndexCache:
    """Process-wide LRU of :class:`SnapshotIndex` by (store, root tree id), bounded in count."""

    def __init__(self, max_entries: int = DEFAULT_CACHE_SIZE) -> None:
        self.max_entries = max_entries
        self._items: OrderedDict[tuple[tuple[str, str], str], SnapshotIndex] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, storage: Storage, root_id: str, snapshot_id: str | None = None) -> SnapshotIndex:
        key = (_store_key(storage), root_id)
        with self._lock:
            index = self._items.get(key)
            if index is not None:
                self._items.move_to_end(key)
                return index
            index = SnapshotIndex(storage, root_id, snapshot_id)
            if self.max_entries > 0:
                self._items[key] = index
                while len(self._items) > self.max_entries:
                    self._items.popitem(last=False)
            return index

    def resize(self, max_entries: int) -> None:
        """Keep at most ``max_entries`` snapshots (0 turns the cache off)."""
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 0:
            raise FormatError(f"Expected a cache size >= 0. Got {max_entries!r} instead.")
        with self._lock:
            self.max_entries = max_entries
            while len(self._items) > max_entries:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


CACHE = IndexCache()

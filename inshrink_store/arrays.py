"""Tensors <-> zarr arrays inside one version: naming, dtypes, chunking, codec choice, reading.

Each tensor is one zarr array at a '/'-separated path. Lossless tensors use
bytes + byte-shuffle + zstd (Blosc); tensors a planner quantizes use the
``inshrink.nuq`` serializer and no compressor, because the store entropy-codes
(and delta-codes) quantized payloads itself. zarr has no bfloat16: such tensors
are uint16 arrays of bit patterns with ``attributes["inshrink"]["dtype"] == "BF16"``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, BytesCodec

from inshrink_store.errors import FormatError, InshrinkError, IntegrityError, NotFoundError
from inshrink_store.zarr_store import METADATA_KEY, InshrinkStore, SnapshotChunks

CHUNK_BYTES = 4 << 20  # see docs/understanding/chunking.md
#: arrays up to this many declared bytes may miss chunks (zarr reads them as the fill value)
SPARSE_LIMIT = 64 << 20
#: the most bytes one chunk may decode to per stored byte of its object (the writer's worst
#: case, an all-zero quantized chunk, is about 42,000; blosc'd zeros about 4,000)
MAX_CHUNK_EXPANSION = 1 << 17
#: at most this many chunks of a (small) array may be missing: zarr visits each one
MAX_MISSING_CHUNKS = 4096
_MAX_RANK = 64
ATTR = "inshrink"
NUQ_NAME = "inshrink.nuq"

#: logical dtype name (safetensors spelling) -> numpy dtype that carries it in zarr
DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "uint16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}
_NUMPY_NAMES = {np.dtype(v): k for k, v in DTYPES.items() if k != "BF16"}


def dtype_name(array: np.ndarray, declared: str | None, path: str) -> str:
    """The logical dtype of a tensor; BF16 must be declared and carried as uint16."""
    if declared is not None:
        if declared not in DTYPES:
            raise FormatError(
                f"Expected a dtype in {sorted(DTYPES)} for tensor {path!r}. Got {declared!r} instead."
            )
        if np.dtype(DTYPES[declared]) != array.dtype:
            raise FormatError(
                f"Expected tensor {path!r} declared {declared} to be carried as {DTYPES[declared]}. "
                f"Got {array.dtype} instead."
            )
        return declared
    name = _NUMPY_NAMES.get(array.dtype)
    if name is None:
        raise FormatError(
            f"Expected tensor {path!r} to have one of the dtypes {sorted(DTYPES)}. Got "
            f"{array.dtype} instead (complex and object arrays are not supported)."
        )
    return name


def check_path(path: str) -> str:
    """Array paths: '/'-separated components, none empty, '.', '..', or starting with '__'."""
    if not isinstance(path, str) or not path:
        raise FormatError(f"Expected a non-empty tensor name. Got {path!r} instead.")
    for part in path.split("/"):
        if part in ("", ".", "..") or part.startswith("__") or "\\" in part or part == "zarr.json":
            raise FormatError(
                f"Expected tensor name {path!r} to have no empty, '.', '..', '__*' or 'zarr.json' "
                f"parts and no backslash. Got the part {part!r} instead; rename the tensor."
            )
    return path


def check_no_nesting(paths: Iterable[str]) -> None:
    """A tensor cannot also be a group: 'a' and 'a/b' together have no zarr layout."""
    known = set(paths)
    for b in sorted(known):
        parts = b.split("/")
        for cut in range(1, len(parts)):
            a = "/".join(parts[:cut])
            if a not in known:
                continue
            raise FormatError(
                f"Expected no tensor name to be a prefix group of another. Got {a!r} and {b!r} "
                "instead; rename one of them."
            )


def default_chunks(shape: tuple[int, ...], itemsize: int, target: int | None = None) -> tuple[int, ...]:
    """Split along leading axes into chunks of about ``target`` bytes (rows stay whole if they fit)."""
    target = CHUNK_BYTES if target is None else target
    chunks = [max(1, s) for s in shape]
    for axis in range(len(chunks)):
        inner = math.prod(chunks[axis + 1 :]) * itemsize
        if inner * chunks[axis] <= target:
            break
        if inner <= target:
            chunks[axis] = max(1, target // inner)
            break
        chunks[axis] = 1
    return tuple(chunks)


def lossless_codecs(array: np.ndarray) -> dict[str, Any]:
    shuffle = "shuffle" if array.dtype.itemsize > 1 else "noshuffle"
    return {
        "serializer": BytesCodec(),
        "compressors": [BloscCodec(cname="zstd", clevel=3, shuffle=shuffle, typesize=array.dtype.itemsize)],
    }


@dataclass(frozen=True)
class ArrayPlan:
    """How a planner wants one tensor stored: the values to write and the zarr serializer."""

    values: np.ndarray
    serializer: Any
    attributes: Mapping[str, Any] = field(default_factory=dict)


def write_arrays(
    store: InshrinkStore,
    tensors: Mapping[str, np.ndarray],
    *,
    attributes: Mapping[str, Any] | None = None,
    dtypes: Mapping[str, str] | None = None,
    planner: Any = None,
    previous: Mapping[str, dict[str, Any]] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> None:
    """Write every tensor as an array of ``store``; nothing is committed here."""
    dtypes = dict(dtypes or {})
    arrays = {check_path(p): np.asarray(a) for p, a in tensors.items()}
    names = {p: dtype_name(a, dtypes.get(p), p) for p, a in arrays.items()}
    check_no_nesting(arrays)
    zarr.open_group(store=store, mode="a").attrs.update(dict(attributes or {}))
    plans: Mapping[str, ArrayPlan] = planner.plan(arrays, names, previous or {}) if planner else {}
    for i, (path, array) in enumerate(sorted(arrays.items())):
        plan = plans.get(path)
        meta: dict[str, Any] = {"dtype": names[path], "storage": "quantized" if plan else "lossless"}
        if plan is not None:
            meta.update(plan.attributes)
            data, codecs = plan.values, {"serializer": plan.serializer, "compressors": None}
        else:
            data, codecs = array, lossless_codecs(array)
        z = zarr.create_array(
            store=store, name=path, shape=data.shape, dtype=data.dtype,
            chunks=default_chunks(data.shape, data.dtype.itemsize), fill_value=0,
            attributes={ATTR: meta}, overwrite=True, config={"write_empty_chunks": True}, **codecs,
        )
        if data.size:
            z[...] = data
        if progress:
            progress(path, i + 1, len(arrays))


def previous_codecs(view: SnapshotChunks | None) -> dict[str, dict[str, Any]]:
    """Path -> {"codec": nuq configuration, "attributes": inshrink attrs} of quantized arrays."""
    if view is None:
        return {}
    out = {}
    for path, doc in iter_array_docs(view):
        codecs = doc.get("codecs")
        for codec in codecs if isinstance(codecs, list) else []:
            if isinstance(codec, dict) and codec.get("name") == NUQ_NAME:
                config = codec.get("configuration", {})
                out[path] = {"codec": config if isinstance(config, dict) else {},
                             "attributes": _attrs(doc)}
    return out


def _node_doc(path: str, text: str, snapshot: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        reason = "nesting too deep" if isinstance(exc, RecursionError) else str(exc)[:120]
        raise IntegrityError(
            f"Expected the zarr.json of node {path!r}{snapshot} to be JSON. Got {reason} "
            "instead: the node tree is corrupt. Run `inshrink verify`."
        ) from None
    if not isinstance(doc, dict):
        raise IntegrityError(
            f"Expected the zarr.json of node {path!r}{snapshot} to be a JSON object. Got a "
            f"{type(doc).__name__} instead: the node tree is corrupt. Run `inshrink verify`."
        )
    return doc


def iter_array_docs(view: SnapshotChunks) -> list[tuple[str, dict[str, Any]]]:
    """(path, zarr.json document) of every array node, sorted by path.

    A node whose zarr.json is not a JSON object is an :class:`IntegrityError` naming it.
    """
    out = []
    snapshot = f" in snapshot {view.snapshot_id}" if view.snapshot_id else ""
    for path, (_tid, tree) in sorted(view.node_trees().items()):
        if tree.metadata is None:
            continue
        doc = _node_doc(path, tree.metadata, snapshot)
        if doc.get("node_type") == "array":
            out.append((path, doc))
    return out


def _attrs(doc: Mapping[str, Any]) -> dict[str, Any]:
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
    if declared == "BF16":
        return 2
    if declared in DTYPES:
        return np.dtype(DTYPES[declared]).itemsize
    data_type = doc.get("data_type")
    try:
        dtype = np.dtype(data_type) if isinstance(data_type, str) else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.itemsize == 0 or dtype.hasobject:
        raise FormatError(
            f"Expected tensor {path!r} to have a fixed-size numeric data_type (one of "
            f"{sorted(set(DTYPES.values()))}). Got {str(data_type)[:80]!r} instead; "
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


def _array_info(path: str, doc: Mapping[str, Any], chunk_ids: Mapping[str, str]) -> ArrayInfo:
    """Validate one array's zarr.json against its chunks; see :meth:`SnapshotReader.arrays`."""
    shape = _int_list(doc.get("shape"), path, "shape", 0)
    grid_doc = doc.get("chunk_grid")
    config = grid_doc.get("configuration") if isinstance(grid_doc, dict) else None
    if not isinstance(grid_doc, dict) or grid_doc.get("name") != "regular" or not isinstance(config, dict):
        raise _bad_array(path, "a regular chunk_grid", grid_doc)
    chunks = _int_list(config.get("chunk_shape"), path, "chunk_shape", 1)
    if len(chunks) != len(shape):
        raise _bad_array(path, f"a chunk_shape of rank {len(shape)} like the shape {list(shape)}",
                         list(chunks))
    attrs = _attrs(doc)
    declared = attrs.get("dtype", str(doc.get("data_type")))
    if "dtype" in attrs and (not isinstance(declared, str) or declared not in DTYPES):
        raise _bad_array(path, f"attributes.inshrink.dtype in {sorted(DTYPES)}", declared)
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


@dataclass(frozen=True)
class ArrayInfo:
    path: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    storage: str
    attributes: Mapping[str, Any]
    chunk_ids: Mapping[str, str]

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype == "BF16" else np.dtype(DTYPES.get(self.dtype, "uint8")).itemsize

    @property
    def logical_bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def chunk_bytes(self) -> int:
        """Bytes one whole chunk decodes to."""
        return math.prod(self.chunks) * self.itemsize


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


class SnapshotReader:
    """One version, read lazily: ``reader["layer.weight"]`` is a zarr.Array."""

    def __init__(self, info: Any, view: SnapshotChunks) -> None:
        self.info = info
        self.id: str = info.id
        self.view = view
        self.store = InshrinkStore(view, read_only=True)
        self._infos: dict[str, ArrayInfo] | None = None

    def __repr__(self) -> str:
        return f"SnapshotReader({self.id[:12]}, {len(self.arrays())} tensors)"

    @property
    def group(self) -> zarr.Group:
        return self._zarr("the root group", lambda: zarr.open_group(store=self.store, mode="r"))

    def _zarr(self, what: str, action: Callable[[], Any]) -> Any:
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
        if self._infos is None:
            trees = self.view.node_trees()
            self._infos = {
                path: _array_info(path, doc, trees[path][1].chunks)
                for path, doc in iter_array_docs(self.view)
            }
        return self._infos

    def names(self) -> list[str]:
        return sorted(self.arrays())

    def resolve_name(self, name: str) -> str:
        infos = self.arrays()
        for candidate in (name, f"model/{name}"):
            if candidate in infos:
                return candidate
        close = [p for p in infos if name.split("/")[-1] in p][:5]
        hint = f" Similar: {', '.join(close)}." if close else ""
        raise NotFoundError(
            f"Expected a tensor named {name!r} in snapshot {self.id[:12]}. Got no such tensor "
            f"instead ({len(infos)} tensors; list them with `inshrink ls`).{hint}"
        )

    def __getitem__(self, name: str) -> zarr.Array:
        path = self.resolve_name(name)
        return self._zarr(f"tensor {path!r}",
                          lambda: zarr.open_array(store=self.store, path=path, mode="r"))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self.arrays() or f"model/{name}" in self.arrays())

    def read(self, name: str) -> np.ndarray:
        """The stored array (BF16 as uint16 bit patterns), decoded in full.

        Before allocating, an array over :data:`SPARSE_LIMIT` bytes must be backed by chunk
        objects that can hold it: each chunk may decode to at most
        :data:`MAX_CHUNK_EXPANSION` bytes per stored byte of its object (checked from the
        objects' stored sizes); otherwise an IntegrityError names the tensor and chunk.
        """
        path = self.resolve_name(name)
        info = self.arrays()[path]
        self._check_backing(info)
        array = self[path]
        if math.prod(info.shape) == 0:
            return np.zeros(info.shape, dtype=array.dtype)
        return self._zarr(f"tensor {path!r}", lambda: np.asarray(array[...]))

    def _check_backing(self, info: ArrayInfo) -> None:
        if max(info.logical_bytes, info.chunk_bytes) <= SPARSE_LIMIT:
            return
        need = -(-info.chunk_bytes // MAX_CHUNK_EXPANSION)  # stored bytes one chunk needs
        oids = sorted({oid for key, oid in info.chunk_ids.items() if key != METADATA_KEY})
        objects = self.view.objects
        with ThreadPoolExecutor(8) as pool:
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

    def read_float(self, name: str) -> np.ndarray:
        """Values as float (BF16 decoded), for statistics and comparisons."""
        path = self.resolve_name(name)
        data = self.read(path)
        if self.arrays()[path].dtype == "BF16":
            return bf16_to_float32(data)
        return data

    def load(self) -> dict[str, np.ndarray]:
        return {path: self.read(path) for path in self.names()}

    def dtypes(self) -> dict[str, str]:
        return {p: i.dtype for p, i in self.arrays().items()}

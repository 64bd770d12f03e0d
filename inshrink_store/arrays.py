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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, BytesCodec

from inshrink_store.errors import FormatError, NotFoundError
from inshrink_store.zarr_store import InshrinkStore, SnapshotChunks

CHUNK_BYTES = 4 << 20  # see docs/understanding/chunking.md
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
        for codec in doc.get("codecs", []):
            if codec.get("name") == NUQ_NAME:
                out[path] = {"codec": codec.get("configuration", {}), "attributes": _attrs(doc)}
    return out


def iter_array_docs(view: SnapshotChunks) -> list[tuple[str, dict[str, Any]]]:
    """(path, zarr.json document) of every array node, sorted by path."""
    out = []
    for path, (_tid, tree) in sorted(view.node_trees().items()):
        if tree.metadata is None:
            continue
        try:
            doc = json.loads(tree.metadata)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("node_type") == "array":
            out.append((path, doc))
    return out


def _attrs(doc: Mapping[str, Any]) -> dict[str, Any]:
    return dict(doc.get("attributes", {}).get(ATTR, {}))


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
    def logical_bytes(self) -> int:
        itemsize = 2 if self.dtype == "BF16" else np.dtype(DTYPES.get(self.dtype, "uint8")).itemsize
        return math.prod(self.shape) * itemsize


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
        return zarr.open_group(store=self.store, mode="r")

    @property
    def attributes(self) -> dict[str, Any]:
        return dict(self.group.attrs)

    def arrays(self) -> dict[str, ArrayInfo]:
        """Path -> shape, dtype, chunking, storage kind, from metadata only (no chunk reads)."""
        if self._infos is None:
            infos = {}
            trees = self.view.node_trees()
            for path, doc in iter_array_docs(self.view):
                grid = doc.get("chunk_grid", {}).get("configuration", {})
                attrs = _attrs(doc)
                infos[path] = ArrayInfo(
                    path, tuple(doc["shape"]), attrs.get("dtype", str(doc.get("data_type"))),
                    tuple(grid.get("chunk_shape", ())), attrs.get("storage", "lossless"), attrs,
                    dict(trees[path][1].chunks),
                )
            self._infos = infos
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
        return zarr.open_array(store=self.store, path=path, mode="r")

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self.arrays() or f"model/{name}" in self.arrays())

    def read(self, name: str) -> np.ndarray:
        """The stored array (BF16 as uint16 bit patterns), decoded in full."""
        path = self.resolve_name(name)
        info = self.arrays()[path]
        array = self[path]
        if math.prod(info.shape) == 0:
            return np.zeros(info.shape, dtype=array.dtype)
        return np.asarray(array[...])

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

"""Whole-array reads without zarr's event loop, for the codec chains the store writes.
Layer: zarr view (``zarr_store`` | ``whole_read`` | ``plans``), above the snapshot index.

Why: a restore decodes every chunk of every tensor. Through zarr, each chunk travels from
the caller's thread to zarr's event loop, to a worker thread for the store read, back, to
another for the codec, and back again; on a checkpoint of 1 MiB tensors that machinery
cost more CPU than reading, checking and decoding the chunks (``docs/benchmarks.md``,
"where a restore spends its time"). Here a whole-array read fetches each chunk object
itself and runs the *same* zarr codec objects, parsed from the array's own zarr.json,
through their synchronous decode, then places the chunks in one output array.

Only chains made of codecs we know decode the same way synchronously are taken (the
store's ``inshrink.nuq`` and ``inshrink.bytegroup``, zarr's ``bytes``, ``blosc`` and
``zstd``: the chains the writer produces); any other array is read by zarr as before, so
an array written by another tool reads exactly as zarr reads it. Lazy and partial reads
(``reader[name][...]``) always go through zarr. Both paths give the same values (tested
against each other), and chunk errors name the tensor and chunk as before.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from zarr.codecs import BloscCodec, BytesCodec, ZstdCodec
from zarr.core.array_spec import ArrayConfig
from zarr.core.buffer import default_buffer_prototype
from zarr.core.metadata.v3 import ArrayV3Metadata

from inshrink_store.codecs.bytegroup import ByteGroupZarrCodec
from inshrink_store.codecs.nuq import NUQZarrCodec

#: serializers (array -> bytes) and compressors (bytes -> bytes) decoded here; each has
#: zarr's ``_decode_sync``, which its asynchronous decode calls
ARRAY_BYTES = (BytesCodec, NUQZarrCodec)
BYTES_BYTES = (BloscCodec, ZstdCodec, ByteGroupZarrCodec)


class WholeArray:
    """How to decode every chunk of one array directly; build with :func:`plan`."""

    def __init__(self, metadata: ArrayV3Metadata) -> None:
        self.metadata = metadata
        self.shape: tuple[int, ...] = tuple(metadata.shape)
        self.chunks: tuple[int, ...] = tuple(metadata.chunk_grid.chunk_shape)  # type: ignore[attr-defined]
        self.dtype = np.dtype(metadata.data_type.to_native_dtype())
        # Any: zarr types the chain as codec base classes, which do not declare _decode_sync
        self.serializer: Any = metadata.codecs[0]
        self.compressors: tuple[Any, ...] = tuple(metadata.codecs[1:])
        self.spec = metadata.get_chunk_spec(
            (0,) * len(self.shape), ArrayConfig.from_dict({}), default_buffer_prototype())

    def keys(self) -> list[tuple[tuple[int, ...], str]]:
        """(chunk coordinates, chunk key relative to the array) of every chunk of the grid."""
        grid = [range(-(-s // c)) for s, c in zip(self.shape, self.chunks, strict=True)]
        return [(coords, self.metadata.encode_chunk_key(coords)) for coords in itertools.product(*grid)]

    def decode(self, raw: bytes | np.ndarray | None) -> np.ndarray:
        """One whole chunk (chunk shape) from its stored bytes (a writable uint8 array stays
        the chunk's memory); None is the fill value."""
        if raw is None:
            return np.full(self.chunks, self.metadata.fill_value, dtype=self.dtype)
        prototype = self.spec.prototype
        data: Any = prototype.buffer.from_bytes(raw if isinstance(raw, bytes) else raw.data)
        for codec in reversed(self.compressors):
            data = codec._decode_sync(data, self.spec)  # noqa: SLF001 - zarr's own sync decode
        array = self.serializer._decode_sync(data, self.spec)  # noqa: SLF001
        values = np.asarray(array.as_numpy_array())
        if values.shape != self.chunks:
            values = values.reshape(self.chunks)
        return values

    def read(self, fetch: Callable[[str], bytes | np.ndarray | None],
             run: Callable[[Callable[[Any], np.ndarray], Sequence[Any]], list[np.ndarray]],
             writable: bool = True) -> np.ndarray:
        """The whole array: ``fetch(chunk key)`` gives a chunk's stored bytes (or None), or
        a writable uint8 array the caller may keep (an array of one chunk is then that memory:
        no copy), ``run(fn, items)`` maps over the chunks (in order; a thread pool or a plain
        loop). ``writable=False``: an array of one chunk may come back read-only (the decoded
        bytes themselves, not a copy of them)."""
        keys = self.keys()
        if len(keys) == 1 and self.chunks == self.shape:  # one chunk is the array: no copy
            values = self.decode(fetch(keys[0][1]))
            keep = values.flags.c_contiguous and (values.flags.writeable or not writable)
            return values if keep else values.copy()
        out = np.empty(self.shape, dtype=self.dtype)

        def place(item: tuple[tuple[int, ...], str]) -> np.ndarray:
            coords, key = item
            values = self.decode(fetch(key))
            where = tuple(slice(i * c, min((i + 1) * c, s))
                          for i, c, s in zip(coords, self.chunks, self.shape, strict=True))
            out[where] = values[tuple(slice(0, w.stop - w.start) for w in where)]
            return values[:0]

        run(place, keys)
        return out


def plan(zarr_json: bytes) -> WholeArray | None:
    """A :class:`WholeArray` for an array whose codec chain decodes here, else None (read
    it through zarr). Metadata zarr itself would refuse raises as zarr raises it.

    Plans are shared between arrays whose zarr.json differ in their attributes only (a
    plan never reads them: its metadata's attributes are empty). Why: zarr's parsing and
    validation of a document took 0.1-0.4 ms, 2-6 % of an ``export --all`` of a few hundred
    tensors (issue 43, item 10), and a version's tensors have a handful of distinct shapes
    and codec chains; zarr keeps attributes as given without checking them, so every
    document still fails or passes as when parsed whole."""
    document = json.loads(zarr_json)
    if isinstance(document, dict):
        document.pop("attributes", None)
    return _plan(json.dumps(document, sort_keys=True))


@functools.lru_cache(maxsize=256)
def _plan(document: str) -> WholeArray | None:
    """:func:`plan` of a zarr.json without attributes, as canonical JSON (errors are not cached)."""
    metadata = ArrayV3Metadata.from_dict(json.loads(document))
    codecs = metadata.codecs
    if not codecs or not isinstance(codecs[0], ARRAY_BYTES):
        return None
    if not all(isinstance(c, BYTES_BYTES) for c in codecs[1:]):
        return None
    if not all(hasattr(c, "_decode_sync") for c in codecs):  # a zarr release without it
        return None
    if not hasattr(metadata.chunk_grid, "chunk_shape") or math.prod(metadata.shape) == 0:
        return None
    return WholeArray(metadata)

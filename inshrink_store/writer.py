"""Tensors -> zarr arrays of one pending version: naming, dtypes, chunking, codec choice.
Layer: reader and writer (siblings), below refs, history and policy, above the zarr view.

Each tensor is one zarr array at a '/'-separated path. Lossless float32, float16 and
bfloat16 tensors use bytes + ``inshrink.bytegroup`` (byte planes coded apart: 4-5 % smaller
than Blosc on trained weights, and faster); other lossless tensors (integers, bool,
float64) use bytes + byte-shuffle + zstd (Blosc). Tensors a planner quantizes use the
``inshrink.nuq`` serializer and no compressor, because the store entropy-codes (and
delta-codes) quantized payloads itself. :func:`lossless_codecs` is the one place that
picks a lossless codec: the ratio estimate of the policy layer measures through it. A dtype zarr has no type for (bfloat16)
is written as its carrier (uint16 bit patterns) with the logical dtype in
``attributes["inshrink"]["dtype"]``; :mod:`inshrink_store.dtypes` says which.

zarr writes every array's zarr.json and every chunk of the other codecs. The chunks of
lossless float tensors skip zarr's codec pipeline: the writer encodes them with the same
codec function and stores them under the same keys itself, every chunk of the save on
one queue of encoder threads and put threads (:class:`_ChunkPipeline`, which says why);
the stored bytes are the same either way.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import numpy as np
import xxhash
import zarr
from zarr.codecs import BloscCodec, BytesCodec
from zarr.core.array import AsyncArray
from zarr.core.array_spec import ArrayConfig
from zarr.core.buffer import default_buffer_prototype
from zarr.core.dtype import get_data_type_from_native_dtype
from zarr.core.group import GroupMetadata
from zarr.core.metadata.v3 import ArrayV3Metadata

from inshrink_store import dtypes, object_format
from inshrink_store.cas import ClosedLoopCoding
from inshrink_store.codecs.bytegroup import ELEMENT_DTYPES as BYTEGROUP_DTYPES
from inshrink_store.codecs.bytegroup import ByteGroupZarrCodec, carrier
from inshrink_store.codecs.nuq import NUQZarrCodec
from inshrink_store.errors import FormatError, InshrinkError
from inshrink_store.index import ATTR, METADATA_KEY, SnapshotIndex
from inshrink_store.parallel import map_in_order, write_threads
from inshrink_store.plans import ArrayPlan, ObjectCoder
from inshrink_store.zarr_store import InshrinkStore, PendingChunks, SnapshotChunks

CHUNK_BYTES = 4 << 20  # see docs/understanding/chunking.md
#: zstd level of the lossless float coding (the object store's coder 3)
LOSSLESS_LEVEL = object_format.LOSSLESS_LEVEL
Chunking = Callable[[tuple[int, ...], int], tuple[int, ...]]


def dtype_name(array: np.ndarray, declared: str | None, path: str) -> str:
    """The logical dtype of tensor ``path`` (see :func:`inshrink_store.dtypes.of_array`):
    ``declared`` checked against the array's carrier, or inferred (BF16 must be declared)."""
    return dtypes.of_array(array, declared, path).name


def check_path(path: str) -> str:
    """Array paths: '/'-separated components, none empty, '.', '..', or starting with '__'."""
    if not isinstance(path, str) or not path:
        raise FormatError(f"Expected a non-empty tensor name. Got {path!r} instead.")
    for part in path.split("/"):
        if part in ("", ".", "..") or part.startswith("__") or "\\" in part or part == METADATA_KEY:
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


def lossless_codecs(array: np.ndarray, dtype: str | None = None) -> dict[str, Any]:
    """The zarr serializer and compressors of a tensor stored exactly. ``dtype`` is its logical
    dtype (``"BF16"`` for uint16 bfloat16 bits; inferred from the array when None).

    float32, float16 and bfloat16 are stored as their raw little-endian bits (zarr's
    ``bytes`` codec alone): the object store codes them itself (``inshrink.bytegroup``
    planes, object coder 3), against the parent version's chunk where XORed planes code
    smaller, which a codec inside zarr could not see. Every other dtype goes through
    Blosc zstd + shuffle."""
    entry = dtypes.of_array(array, dtype)
    if entry.codec_name in BYTEGROUP_DTYPES:
        return {"serializer": BytesCodec(endian="little"), "compressors": None}
    shuffle: Literal["shuffle", "noshuffle"] = "shuffle" if array.dtype.itemsize > 1 else "noshuffle"
    return {
        "serializer": BytesCodec(),
        "compressors": [BloscCodec(cname="zstd", clevel=3, shuffle=shuffle, typesize=array.dtype.itemsize)],
    }


def create_array(store: Any, path: str | None, data: np.ndarray, codecs: Mapping[str, Any],
                 chunking: Chunking | None = None, attributes: Mapping[str, Any] | None = None) -> zarr.Array[Any]:
    """One array of ``data`` as the writer lays it out (chunk grid, fill value, every chunk
    written), its values written; ``store`` is any zarr store (the ratio estimate measures
    on a memory store through this same function)."""
    z = _create_metadata(store, path, data, codecs, chunking, attributes)
    if data.size:
        z[...] = data
    return z


def _create_metadata(store: Any, path: str | None, data: np.ndarray, codecs: Mapping[str, Any],
                     chunking: Chunking | None = None, attributes: Mapping[str, Any] | None = None) -> zarr.Array[Any]:
    """The array of :func:`create_array`, its zarr.json written and no chunk yet."""
    chunking = chunking or default_chunks
    return zarr.create_array(
        store=store, name=path, shape=data.shape, dtype=data.dtype,
        chunks=chunking(data.shape, data.dtype.itemsize), fill_value=0,
        attributes=dict(attributes or {}), overwrite=True, config={"write_empty_chunks": True}, **codecs,
    )


def array_metadata(data: np.ndarray, codecs: Mapping[str, Any], chunking: Chunking | None = None,
                   attributes: Mapping[str, Any] | None = None) -> ArrayV3Metadata | None:
    """The zarr.json that :func:`create_array` writes for ``data``, built without a store
    (zarr's own constructor and defaults), or None for a dtype zarr has no v3 type for."""
    chunking = chunking or default_chunks
    try:
        dtype = _zarr_dtype(data.dtype)
    except (TypeError, ValueError):
        return None
    chain = (*(codecs.get("filters") or ()), codecs["serializer"], *(codecs.get("compressors") or ()))
    return AsyncArray._create_metadata_v3(  # noqa: SLF001 - what zarr.create_array builds
        data.shape, dtype, chunking(data.shape, data.dtype.itemsize), fill_value=0, codecs=chain,
        attributes=dict(attributes or {}))


@functools.lru_cache(maxsize=64)
def _zarr_dtype(dtype: np.dtype[Any]) -> Any:
    """zarr's data type for a numpy dtype (its registry lookup costs ~0.7 ms; the types are
    immutable values, so one per numpy dtype serves every array)."""
    return get_data_type_from_native_dtype(dtype)


def _put_metadata(view: PendingChunks, path: str, metadata: ArrayV3Metadata) -> None:
    """Write array ``path``'s zarr.json into ``view`` as ``zarr.create_array(...,
    overwrite=True)`` does: what the view held under ``path`` (the parent version's array,
    inherited) goes first, and each missing parent gets an empty group's zarr.json.

    Why not zarr: creating an array through zarr takes about 2 ms of Python holding the
    GIL (store round trips on its event loop, listing the store to delete the old array),
    a large share of a save of many small tensors."""
    view.delete_prefix(f"{path}/")
    parts = path.split("/")
    for cut in range(1, len(parts)):
        key = "/".join(parts[:cut]) + "/" + METADATA_KEY
        if not view.has(key):
            view.put(key, _EMPTY_GROUP)
    # the document zarr's to_buffer_dict writes, without its indentation (the view stores
    # zarr.json compact anyway): json's C encoder instead of its Python one
    view.put(f"{path}/{METADATA_KEY}", json.dumps(metadata.to_dict(), allow_nan=True, separators=(",", ":")).encode())


#: an empty group's zarr.json, as zarr writes it for a missing parent
_EMPTY_GROUP = GroupMetadata().to_buffer_dict(default_buffer_prototype())[METADATA_KEY].to_bytes()


#: chunk objects the direct path stores at once on an object store, at least: a put waits
#: on a request, not on a core, so there are more of them than encoders (twice the encoders
#: where that is more: zarr's pipeline had cores + 4, up to 32)
PUT_THREADS = 8
#: put threads beyond the encoders' on a local disk (see :class:`_ChunkPipeline`)
LOCAL_SPARE_PUTS = 2


#: encodes one chunk, given its elements' C-order bytes, to the bytes zarr's pipeline would store
ChunkEncoder = Callable[[np.ndarray], bytes | memoryview]


def _direct_codec(store: Any, data: np.ndarray, codecs: Mapping[str, Any],
                  metadata: ArrayV3Metadata | None = None) -> ChunkEncoder | None:
    """How ``data``'s chunks may skip zarr's codec pipeline (see :class:`_ChunkPipeline`), or
    None: a write session's store and one of the two chains the writer itself picks, with
    elements already in the codec's little-endian carrier:

    - zarr's ``bytes`` serializer and the bytegroup codec alone (lossless floats);
    - the ``inshrink.nuq`` serializer and no compressor (quantized tensors): the quantizer
      the codec itself would use for the array of ``metadata`` (needed for this chain), its
      :meth:`~inshrink_store.codecs.nuq.Quantizer.encode_array` on the chunk's elements,
      as ``NUQZarrCodec``'s zarr encode calls it."""
    compressors: Sequence[Any] = codecs.get("compressors") or ()
    serializer = codecs.get("serializer")
    if (
        not isinstance(store, InshrinkStore) or not isinstance(store.view, PendingChunks)
        or set(codecs) != {"serializer", "compressors"} or not data.size
    ):
        return None
    if isinstance(serializer, BytesCodec) and len(compressors) == 1 and isinstance(compressors[0], ByteGroupZarrCodec):
        codec = compressors[0]
        return codec.encode_bytes if data.dtype == carrier(codec.dtype) else None  # '>f4': zarr's byte swap
    if isinstance(serializer, BytesCodec) and not compressors:
        # raw bits: the chunk's bytes are the payload (the object store codes floats itself)
        little = data.dtype.byteorder in ("<", "|") or (data.dtype.byteorder == "=" and sys.byteorder == "little")
        return _raw_bytes if little else None
    if isinstance(serializer, NUQZarrCodec) and not compressors and metadata is not None:
        spec = metadata.get_chunk_spec((0,) * data.ndim, ArrayConfig.from_dict({}), default_buffer_prototype())
        quantizer = serializer._quantizer(spec)  # noqa: SLF001 - the codec's own choice, validated
        element = dtypes.by_codec_name(quantizer.dtype).carrier.newbyteorder("<")
        if data.dtype.kind not in "fu" or data.dtype.itemsize != element.itemsize or data.dtype.byteorder == ">":
            return None

        def encode(chunk: np.ndarray) -> bytes:
            return np.asarray(quantizer.encode_array(chunk.view(element))).tobytes()
        return encode
    return None


def _raw_bytes(chunk: np.ndarray) -> memoryview:
    """A raw chunk's payload: a view of its bytes (the object store reads it, copies nothing)."""
    return np.ascontiguousarray(chunk).reshape(-1).data


class _ChunkPipeline:
    """Chunks encoded and stored outside zarr's codec pipeline, every chunk of every tensor
    of one ``write_arrays`` call through one queue.

    Why (measured on a pretrained CNN, 2 cores, local disk): zarr's pipeline copies each
    chunk of a multi-chunk array into a fresh chunk buffer on its one event-loop thread,
    hands the encoded bytes to the store as another copy, encodes on its executor's threads
    (cores + 4 of them on a small machine) and works one array per writer thread, so a save
    alternated between every core encoding and cores waiting on fsyncs. Here a chunk of a
    C-contiguous tensor is a view of it (an edge chunk or a strided tensor is copied once).
    ``encoders`` threads (the writer's thread count) run the zarr codec's part (quantizing a
    chunk; nothing for raw floats, whose view is the payload), and put threads hand each
    payload to the object store, which codes it (raw floats as bytegroup planes, against the
    parent's chunk where smaller; quantized payloads with zstd or as a delta) and writes it.
    In memory there is one put thread per encoder, since coding is a core's work; on a local
    disk :data:`LOCAL_SPARE_PUTS` more, since each put ends in two fsyncs during which its
    core would idle (on a pretrained CNN, 2 cores: saves 6-9 % faster with 2 spares, slower
    with 6); on an object store ``max(PUT_THREADS, 2 * encoders)``, since a put mostly
    waits on its request. At most twice as many payloads as put threads wait for a put, and
    at most as many chunks as there are encoders are queued or encoding (a writer thread queueing
    more waits): each up to a chunk's size, that bounds the memory whatever the storage's speed.

    The stored bytes are those of zarr's pipeline: the same codec function on the same
    C-order bytes of each chunk, an edge chunk padded with the fill value 0 as zarr pads it,
    under the key zarr gives it (tests/test_repository/test_lossless_floats.py compares the
    two paths). Every object is stored before :meth:`wait` returns, so before any commit."""

    def __init__(self, view: PendingChunks, encoders: int) -> None:
        self._view, self._encoders_wanted = view, max(1, encoders)
        # in memory a put is mostly the object store coding raw floats (a core's work), so one
        # per encoder; a local disk adds spares for the fsyncs; an object store's put mostly
        # waits on its request
        storage = view.objects.storage
        if storage.is_remote:
            self._puts_wanted = max(PUT_THREADS, 2 * self._encoders_wanted)
        elif storage.is_local:  # a put blocked in fsync leaves its core idle: spares fill the gap
            self._puts_wanted = self._encoders_wanted + LOCAL_SPARE_PUTS
        else:  # in this process's memory
            self._puts_wanted = self._encoders_wanted
        self._encoders: ThreadPoolExecutor | None = None
        self._putters: ThreadPoolExecutor | None = None
        self._slots = threading.BoundedSemaphore(2 * self._puts_wanted)
        #: chunks queued for an encoder or being encoded, at most (see :meth:`submit`)
        self._queued = threading.BoundedSemaphore(self._encoders_wanted)
        self._lock = threading.Lock()
        #: (path, chunk index) -> the encode future, whose result is the put future
        self._jobs: dict[tuple[str, int], Future[Future[None]]] = {}

    def submit(self, path: str, metadata: ArrayV3Metadata, data: np.ndarray, codec: ChunkEncoder,
               done: Callable[[], None], object_coder: ObjectCoder | None = None) -> None:
        """Queue every chunk of tensor ``path`` (its zarr.json, ``metadata``, already written)
        with values ``data``; ``done()`` runs once its last chunk is stored. ``object_coder``
        (a closed-loop plan's): chunk coordinates and shape -> the object store's coding of
        that chunk, computed on the encoder threads."""
        chunk_shape = tuple(metadata.chunks)
        grid = list(itertools.product(*(range(-(-size // c)) for size, c in zip(data.shape, chunk_shape, strict=True))))
        prefix = f"{path}/"
        left = [len(grid)]

        def stored() -> None:
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                done()

        with self._lock:
            if self._encoders is None:
                self._encoders = ThreadPoolExecutor(self._encoders_wanted, thread_name_prefix="inshrink-encode")
                self._putters = ThreadPoolExecutor(self._puts_wanted, thread_name_prefix="inshrink-put")
            encoders = self._encoders
        for i, coords in enumerate(grid):
            key = prefix + metadata.encode_chunk_key(coords)
            # back-pressure, taken holding no lock: the writer thread waits while the encoders
            # are behind, so planned tensors (a quantized tensor's values are a new array)
            # never pile up in the queue when puts are slow (an object store)
            self._queued.acquire()
            try:
                job = encoders.submit(self._encode, key, data, chunk_shape, coords, codec, stored, object_coder)
            except BaseException:
                self._queued.release()
                raise
            with self._lock:
                self._jobs[(path, i)] = job

    def _encode(self, key: str, data: np.ndarray, chunk_shape: tuple[int, ...], coords: tuple[int, ...],
                codec: ChunkEncoder, stored: Callable[[], None], object_coder: ObjectCoder | None) -> Future[None]:
        try:
            payload = codec(chunk_bytes(data, chunk_shape, coords))
            closed = None if object_coder is None else object_coder(coords, chunk_shape)
            self._slots.acquire()  # wait while the most encoded chunks allowed wait for a put
            assert self._putters is not None
            try:
                return self._putters.submit(self._put, key, payload, stored, closed)
            except BaseException:
                self._slots.release()
                raise
        finally:
            self._queued.release()

    def _put(self, key: str, payload: bytes | memoryview, stored: Callable[[], None],
             closed: ClosedLoopCoding | None = None) -> None:
        try:
            if closed is None:
                self._view.put(key, payload)
            else:
                self._view.put(key, payload, closed=closed)
        finally:
            self._slots.release()
        stored()

    def wait(self) -> dict[str, BaseException]:
        """Wait for every queued chunk; path -> the first failure of its chunks (in chunk order)."""
        failures: dict[str, BaseException] = {}
        for (path, _i), encoded in sorted(self._jobs.items(), key=lambda item: item[0]):
            exc = encoded.exception()
            if exc is None:
                exc = encoded.result().exception()
            if exc is not None:
                failures.setdefault(path, exc)
        for pool in (self._encoders, self._putters):
            if pool is not None:
                pool.shutdown()
        return failures


def chunk_bytes(data: np.ndarray, chunk_shape: tuple[int, ...], coords: tuple[int, ...]) -> np.ndarray:
    """The bytes zarr encodes for chunk ``coords`` of ``data``: its elements in C order (a view
    when they are contiguous), an edge chunk padded to ``chunk_shape`` with the fill value 0."""
    region = tuple(slice(i * c, min((i + 1) * c, size)) for i, c, size in zip(coords, chunk_shape, data.shape, strict=True))
    index: tuple[Any, ...] = (*region, ...)  # with the Ellipsis a 0-d tensor gives an array, not a scalar
    part = data[index]
    if part.shape != chunk_shape:
        padded = np.zeros(chunk_shape, data.dtype)
        padded[tuple(slice(0, n) for n in part.shape)] = part
        part = padded
    return np.ascontiguousarray(part).reshape(-1).view(np.uint8)


def write_arrays(
    store: InshrinkStore,
    tensors: Mapping[str, np.ndarray],
    *,
    attributes: Mapping[str, Any] | None = None,
    dtypes: Mapping[str, str] | None = None,
    plans: Mapping[str, ArrayPlan] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    chunking: Chunking | None = None,
    threads: int | None = None,
) -> None:
    """Write every tensor as an array of ``store``; nothing is committed here.

    ``plans`` (path -> :class:`ArrayPlan`, made beforehand) says which tensors are stored lossy
    and how; every other tensor is stored lossless. ``chunking(shape, itemsize)`` picks chunk
    shapes (:func:`default_chunks` by default)."""
    chunking = chunking or default_chunks
    arrays, names = prepare_arrays(tensors, dtypes)
    zarr.open_group(store=store, mode="a").attrs.update(dict(attributes or {}))
    plans = plans or {}
    unknown = sorted(set(plans) - set(arrays))
    if unknown:
        raise FormatError(f"Expected a plan only for tensors being written. Got plans for {unknown[:5]} too, "
                          "which are not among them; nothing was written.")
    order = sorted(arrays)
    workers = threads or write_threads()
    done = 0
    done_lock = threading.Lock()
    view = getattr(store, "view", None)
    chunks = _ChunkPipeline(view, workers) if isinstance(view, PendingChunks) else None
    failures: dict[str, BaseException] = {}

    def written(path: str) -> None:
        nonlocal done
        if progress:
            with done_lock:
                done += 1
                progress(path, done, len(order))

    def write_one(path: str) -> None:
        array, plan = arrays[path], plans.get(path)
        meta: dict[str, Any] = {"dtype": names[path], "storage": "quantized" if plan else "lossless"}
        if plan is not None:
            meta.update(plan.attributes)
            data, codecs = plan.values, {"serializer": plan.serializer, "compressors": None}
        else:
            data, codecs = array, lossless_codecs(array, names[path])
            meta["content"] = lossless_digest(array, names[path], codecs, chunking(array.shape, array.dtype.itemsize))
        # the parent stored these exact bits the same way: take its chunks, encode nothing
        adopted = plan is None and _parent_content(store, path) == meta["content"] and store.adopt_from_parent(path)
        if not adopted:
            metadata = None if chunks is None else array_metadata(data, codecs, chunking, {ATTR: meta})
            direct = None if metadata is None else _direct_codec(store, data, codecs, metadata)
            coder = None if plan is None else plan.object_coder
            if coder is not None and direct is not _raw_bytes:
                raise FormatError(
                    f"Expected tensor {path!r}'s closed-loop plan to be written as raw float32 chunks into a "
                    "write session. Got another codec chain or store instead; nothing was written for it.")
            if direct is not None:
                assert chunks is not None and metadata is not None and isinstance(store.view, PendingChunks)
                _put_metadata(store.view, path, metadata)
                chunks.submit(path, metadata, data, direct, lambda: written(path), coder)
                return
            create_array(store, path, data, codecs, chunking, {ATTR: meta})
        written(path)

    def recorded(path: str) -> None:
        try:
            write_one(path)
        except BaseException as exc:  # raised below, once every chunk is stored or failed
            with done_lock:
                failures.setdefault(path, exc)

    # Tensors are written side by side: most are one chunk, so one at a time would code on
    # one core; the chunks of lossless float tensors go on to one queue of encoders and
    # puts (_ChunkPipeline). What is stored does not depend on the order (chunks are
    # addressed by their bytes, trees are sorted), so the snapshot is the same for any
    # number of threads. As with map_in_order, nothing is left running when this returns,
    # and the failure raised is the first in path order (then chunk order), whatever the timing.
    try:
        map_in_order(recorded, order, workers, "inshrink-write")
    finally:
        if chunks is not None:
            for path, exc in chunks.wait().items():
                failures.setdefault(path, exc)
    if failures:
        raise failures[min(failures)]


def prepare_arrays(tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str] | None = None
                   ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``tensors`` as the writer takes them (checked paths -> arrays, no array nested under
    another) and each one's logical dtype name (``dtypes`` names those an array cannot carry):
    what a planner is handed, so it sees exactly what is written."""
    declared = dict(dtypes or {})
    arrays = {check_path(p): np.asarray(a) for p, a in tensors.items()}
    names = {p: dtype_name(a, declared.get(p), p) for p, a in arrays.items()}
    check_no_nesting(arrays)
    return arrays, names


def lossless_digest(array: np.ndarray, dtype: str, codecs: Mapping[str, Any], chunks: tuple[int, ...]) -> str:
    """xxh3-128 of a lossless tensor's bits and of how the writer stores them (dtype, shape,
    chunks, codec settings), kept in its zarr.json as ``attributes.inshrink.content``: the
    next save of the same bits with the same settings adopts the parent's chunks instead of
    encoding them again (frozen layers, an unchanged state saved again)."""
    h = xxhash.xxh3_128()
    described = [c.to_dict() for c in (codecs["serializer"], *(codecs.get("compressors") or ()))]
    h.update(json.dumps([dtype, list(array.shape), list(chunks), described], sort_keys=True).encode())
    h.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def _parent_content(store: InshrinkStore, path: str) -> str | None:
    """``attributes.inshrink.content`` of array ``path`` in the parent of ``store``'s session."""
    parent = getattr(store.view, "parent", None)
    if parent is None:
        return None
    try:
        info = parent.index.array(path)
    except InshrinkError:
        return None  # a damaged parent tree: write the tensor afresh
    content = info.attributes.get("content") if info is not None else None
    return content if isinstance(content, str) else None


def previous_codecs(parent: SnapshotChunks | SnapshotIndex | Any | None) -> dict[str, dict[str, Any]]:
    """Path -> {"codec": nuq configuration, "attributes": inshrink attrs} of the quantized
    arrays of the parent version (a view, reader or index; None for none): the codebooks a
    planner may reuse. Read from the parent's shared index, so its trees are read once."""
    if parent is None:
        return {}
    index = parent if isinstance(parent, SnapshotIndex) else parent.index
    return index.quantization_codecs()

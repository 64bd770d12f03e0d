"""The stored form of one object: its header, its checksum, its body's coders and the bounds a
reader checks, as pure functions over bytes (no storage, no cache, no chain).
Layer: under the object store (``cas``), over the codecs and the content id (``manifest``).

Why apart from :mod:`inshrink_store.cas`: the object store decides *where* objects live and
*which* form to write (dedup, delta chains, the keyframe interval, read-your-writes); this
module says what an object's bytes *are*. The policy's ratio estimates, the reader's bounds,
``verify``, ``gc`` and the format tests need the second without the first.

An object's id is the xxh3-128 of its *logical* payload (the bytes Zarr wrote), so
identical chunks in any tensor or version are stored once whether they are kept
whole or as a delta. The stored form starts with a fixed header::

    0   4  magic        b"ISO\\x02" (format 2; b"ISO\\x01", format 1, is still read)
    4   1  kind         0 = whole (keyframe), 1 = delta against ``base``
    5   1  coder        0 = none, 1 = zstd, 2 = zstd of the payload with its level ids
                        packed two per byte (keyframes of <= 31 levels, ids from 15
                        escaped above 16; see ``codecs/_nibbles``; written when smaller),
                        3 = an ``inshrink.bytegroup`` chunk (format 2) of the payload's
                        float elements; in a delta, planes may be XORed with the base's
                        payload (raw float bits of the parent version's chunk); raw
                        floats that code no smaller are stored whole with coder 0
                        4 = closed loop: raw float32 bits coded by a planner as a
                        quantized residual (``codecs/closed_loop``), on its own in a
                        keyframe, added to the base's payload in a delta
    6   2  depth        0 for whole, base depth + 1 for a delta (bounds chains)
    8   8  logical length
    16 16  base id      raw 16 bytes of the base's id, zeros when whole
    32  8  checksum     xxh3-64 of header bytes 0..32 followed by the body
                        (format 1: of the body only)
    40  .. body

Every read checks the checksum, bounds every declared size by the object's real
size before allocating (a raw keyframe's logical length is its body length; a
zstd body can expand at most ``MAX_ZSTD_EXPANSION`` times and is decompressed in
bounded steps that stop as soon as the output passes the declared length), and the
object store resolves the chain (with loop and depth guards, never a hang) and checks
the logical id, so corruption is an :class:`IntegrityError` naming the object, never
silently wrong numbers or an unbounded allocation. The bounds are defined here once and
checked by the writer too (:func:`stream_limit`), so a stored object always reads back.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from inshrink_store.codecs import _nibbles, _payload, _planes, _zstd, bytegroup, closed_loop
from inshrink_store.codecs._payload import is_quantized_payload
from inshrink_store.codecs.vdelta import VDelta
from inshrink_store.errors import FormatError, IntegrityError, WriteCheckError

MAGIC_V1 = b"ISO\x01"  # checksum over the body only; still read, never written
MAGIC_V2 = b"ISO\x02"  # checksum over header bytes 0..32 and the body
MAGIC = MAGIC_V2
VERSIONS = {MAGIC_V1: 1, MAGIC_V2: 2}
CHECKED_HEADER = 32  # format 2: header bytes covered by the checksum (all but the checksum)
MAX_ZSTD_EXPANSION = _zstd.MAX_EXPANSION  # zstd's largest expansion, rounded up
HEADER = struct.Struct("<4sBBHQ16sQ")
HEADER_SIZE = HEADER.size  # 40
KIND_WHOLE, KIND_DELTA = 0, 1
CODER_NONE, CODER_ZSTD, CODER_PACKED_ZSTD, CODER_BYTEGROUP, CODER_CLOSED_LOOP = 0, 1, 2, 3, 4
CODERS = (CODER_NONE, CODER_ZSTD, CODER_PACKED_ZSTD, CODER_BYTEGROUP, CODER_CLOSED_LOOP)
#: float element types coder 3 codes (a payload of raw little-endian elements of one of them)
ELEMENTS = bytegroup.ELEMENT_DTYPES
#: a bytegroup body decodes to at most this many bytes per stored byte (its planes' worst
#: coder, packed ranks, times the widest element)
MAX_BYTEGROUP_EXPANSION = 4 * _planes.PACKED_MAX_EXPANSION
#: zstd level of whole quantized payloads (one level id per byte). Level 1 both codes them
#: smaller than level 3 on trained weights (2.18x vs 1.96x at 16 levels, 2.81x vs 2.54x at
#: 8 levels pruned 30 %) and runs 3-10x faster; level 3 was the store's first choice.
ZSTD_LEVEL = 1
#: zstd level of coder 3's planes (level 1: smaller and faster than 3 on trained weights,
#: benchmarks/bench_bytegroup.py)
LOSSLESS_LEVEL = 1
#: raw float payloads of at most this many bytes are stored as they are (coder 0), not coded:
#: sixteen float32 values code to more than their own bytes
RAW_FLOATS_MAX = 64
#: the most bytes a chunk may decode to per stored byte of its object: a reader refuses to
#: allocate a large array whose objects are smaller (``reader``), so the writer pads a
#: closed-loop object up to it (an all-zero quantized chunk is about 42,000; blosc'd zeros
#: about 4,000; a closed-loop residual with every element pruned could pass it)
MAX_CHUNK_EXPANSION = 1 << 17
MAX_CHAIN = 4096  # far above any keyframe interval; only a corrupt store gets here


@dataclass(frozen=True)
class ObjectHeader:
    """The 40-byte header of a stored object, parsed (:func:`parse_header`)."""

    kind: int
    coder: int
    depth: int
    logical_length: int
    base: str | None
    checksum: int
    version: int = 2

    @property
    def is_delta(self) -> bool:
        return self.kind == KIND_DELTA


def parse_header(oid: str, data: bytes, stored_size: int | None = None) -> ObjectHeader:
    """Parse and check the 40-byte header of object ``oid``.

    With ``stored_size`` (the object's whole stored length) the declared logical length
    is bounded by what the body can really hold, before anything is allocated:
    a raw keyframe's logical length equals its body length, a zstd body expands at most
    :data:`MAX_ZSTD_EXPANSION` times, and a delta rebuilds at most a payload header plus
    two bytes per delta symbol. The checksum is not checked here (see :func:`checked_body`).
    """
    if len(data) < HEADER_SIZE or bytes(data[:4]) not in VERSIONS:
        raise IntegrityError(
            f"Expected object {oid} to start with an object magic ({MAGIC_V2!r} or {MAGIC_V1!r}). "
            f"Got {bytes(data[:4])!r} ({len(data)} bytes) instead: the object is corrupt. "
            "Run `inshrink verify` to find what uses it."
        )
    magic, kind, coder, depth, length, base, checksum = HEADER.unpack_from(data, 0)
    if kind not in (KIND_WHOLE, KIND_DELTA) or coder not in CODERS \
            or (kind == KIND_DELTA and coder == CODER_PACKED_ZSTD):
        raise IntegrityError(
            f"Expected kind 0 or 1 and coder 0-4 (2 for keyframes only) in object {oid}. Got kind {kind}, coder "
            f"{coder} instead: the object is corrupt. Run `inshrink verify` to find what uses it."
        )
    if (
        (kind == KIND_WHOLE and (depth != 0 or any(base)))
        or (kind == KIND_DELTA and not 1 <= depth <= MAX_CHAIN)
    ):
        raise IntegrityError(
            f"Expected object {oid}'s header to be consistent (a keyframe has depth 0 and no "
            f"base, a delta depth 1..{MAX_CHAIN}). Got kind {kind}, depth {depth} instead: the "
            "object is corrupt. Run `inshrink verify` to find what uses it."
        )
    if stored_size is not None:
        _check_length(oid, kind, coder, length, stored_size - HEADER_SIZE)
    base_id = base.hex() if kind == KIND_DELTA else None
    return ObjectHeader(kind, coder, depth, length, base_id, checksum, VERSIONS[bytes(magic)])


def _max_logical(kind: int, coder: int, body_len: int) -> int:
    """The largest logical payload a body of ``body_len`` bytes can decode to."""
    if coder == CODER_BYTEGROUP:  # keyframe or XOR delta: the same bound
        return body_len * MAX_BYTEGROUP_EXPANSION
    if coder == CODER_CLOSED_LOOP:  # keyframe or residual delta: one float32 per id
        return closed_loop.max_logical(body_len)
    if coder == CODER_ZSTD:
        body_len *= MAX_ZSTD_EXPANSION
    elif coder == CODER_PACKED_ZSTD:  # unpacking at most doubles the ids
        body_len *= 2 * MAX_ZSTD_EXPANSION
    if kind == KIND_DELTA:  # vdelta: every zstd'd symbol (1 or 2 bytes) -> one id of <= 2 bytes
        return _payload.HEADER_SIZE + 2 * MAX_ZSTD_EXPANSION * body_len
    return body_len


def stream_limit(kind: int, coder: int, logical_length: int, body_len: int) -> int:
    """The most bytes the zstd frame of a coder 1 or 2 body may decompress to.

    The one definition of that bound: the reader decompresses with it as the limit, and the
    writer checks every stream against it before it stores the object (:func:`keyframe_body`),
    so a committed object is never one its reader refuses. A whole zstd keyframe holds the
    payload itself (its logical length); a packed keyframe (coder 2) holds the payload with
    its ids two to a byte, which escapes can make longer than the payload
    (:func:`_nibbles.max_packed_length`); a zstd delta holds a vdelta stream, bounded by
    zstd's own expansion of the body."""
    if coder == CODER_PACKED_ZSTD:
        return _nibbles.max_packed_length(logical_length)
    if kind == KIND_DELTA:
        return body_len * MAX_ZSTD_EXPANSION
    return logical_length


def _check_stream(coder: int, logical_length: int, stream: bytes | memoryview) -> None:
    """Writer side of :func:`stream_limit` for a keyframe's stream (the writer zstd-codes no
    delta): a stream past the reader's bound is a bug here, raised before anything is
    stored, never a version committed that cannot be read back."""
    limit = stream_limit(KIND_WHOLE, coder, logical_length, 0)
    if memoryview(stream).nbytes > limit:
        raise WriteCheckError(
            f"Expected the coder {coder} stream of a {logical_length}-byte payload to hold at "
            f"most {limit} bytes, the reader's bound. Got {memoryview(stream).nbytes} instead; "
            "nothing was stored. This is a bug in inshrink-store: please report it.")


def _check_length(oid: str, kind: int, coder: int, length: int, body_len: int) -> None:
    exact = kind == KIND_WHOLE and coder == CODER_NONE
    if body_len < 0 or (length != body_len if exact else length > _max_logical(kind, coder, body_len)):
        bound = f"equal to its body length {body_len}" if exact else (
            f"at most {_max_logical(kind, coder, max(body_len, 0))} bytes for a "
            f"{max(body_len, 0)}-byte {'zstd ' if coder != CODER_NONE else ''}"
            f"{'delta' if kind == KIND_DELTA else 'keyframe'} body"
        )
        raise IntegrityError(
            f"Expected object {oid} to declare a logical length {bound}. Got {length} instead: "
            "the object is corrupt. Run `inshrink verify` to find what uses it."
        )


def keyframe_body(payload: bytes | memoryview, element: str | None = None) -> tuple[int, bytes]:
    """(coder, body) of a payload stored whole: raw floats of ``element`` as a bytegroup
    chunk (coder 3); a quantized payload zstd-compressed, as it is or with its ids two per
    byte (whichever is smaller; the plain form on a tie); anything else raw. The search's
    ratio estimate calls this too, so it measures what is stored."""
    if element is not None:
        check_floats(payload, element)
        if len(payload) <= RAW_FLOATS_MAX:
            return CODER_NONE, bytes(payload)
        return float_keyframe(payload, bytegroup.encode_chunk(np.frombuffer(payload, np.uint8), element,
                                                               LOSSLESS_LEVEL, "zstd+huffman"))
    if not is_quantized_payload(payload):
        return CODER_NONE, bytes(payload)
    body = _zstd.compress(payload, ZSTD_LEVEL)
    if _nibbles.packable(payload):
        stream = _nibbles.pack(payload)
        _check_stream(CODER_PACKED_ZSTD, len(payload), stream)
        # a packed stream longer than its payload is never written, though readers take it:
        # releases e41198a..a828d53 refuse such objects, and a store may be read by one
        # not yet upgraded (such streams are rare: most ids escaped)
        packed = _zstd.compress(stream, ZSTD_LEVEL) if len(stream) <= len(payload) else body
        if len(packed) < len(body):
            return CODER_PACKED_ZSTD, packed
    return CODER_ZSTD, body


def float_keyframe(payload: bytes | memoryview, coded: bytes) -> tuple[int, bytes]:
    """(coder, body) of raw floats stored whole: their bytegroup coding, or the raw bits
    (coder 0) where the coding is no smaller (a few elements: its plane headers outweigh
    what coding saves; a 4-byte step counter took 72 bytes coded)."""
    if len(coded) >= len(payload):
        return CODER_NONE, bytes(payload)
    return CODER_BYTEGROUP, coded


def check_floats(payload: bytes | memoryview, element: str) -> None:
    """A payload of raw floats must be whole elements of a type coder 3 codes."""
    if element not in ELEMENTS:
        raise FormatError(f"Expected a float element type in {list(ELEMENTS)}. Got {element!r} instead.")
    if len(payload) % bytegroup.carrier(element).itemsize:
        raise FormatError(f"Expected whole {element} elements. Got a payload of {len(payload)} bytes instead.")


def frame(
    kind: int, coder: int, depth: int, payload: bytes | memoryview, base: str | None, body: bytes,
    version: int = 2,
) -> bytes:
    """Header + body; ``version=1`` writes the old format (only tests need it)."""
    base_raw = bytes.fromhex(base) if base else bytes(16)
    magic = MAGIC_V2 if version == 2 else MAGIC_V1
    head = HEADER.pack(magic, kind, coder, depth, len(payload), base_raw, 0)[:CHECKED_HEADER]
    checksum = object_checksum(head if version == 2 else b"", body)
    return head + struct.pack("<Q", checksum) + body


def object_checksum(head: bytes | memoryview, body: bytes | memoryview) -> int:
    """The stored checksum: xxh3-64 of the checked header bytes (none in format 1) and the body."""
    hasher = xxhash.xxh3_64()
    hasher.update(head)
    hasher.update(body)
    return hasher.intdigest()


def checked_body(oid: str, header: ObjectHeader, stored: bytes | memoryview) -> memoryview:
    """The body of stored object ``oid`` once its checksum matches; IntegrityError otherwise."""
    view = memoryview(stored)
    body = view[HEADER_SIZE:]
    head = view[:CHECKED_HEADER] if header.version == 2 else b""
    if object_checksum(head, body) != header.checksum:
        raise IntegrityError(
            f"Expected object {oid} to match its stored checksum. Got a mismatch instead: "
            "the object's bytes are corrupt. Run `inshrink verify` to find what uses it."
        )
    return body


def _bounded_zstd(oid: str, body: bytes | memoryview, limit: int) -> bytes:
    """Decompress one zstd frame in steps, failing as soon as the output passes ``limit``."""
    try:
        return _zstd.decompress(body, limit, f"the body of object {oid}")
    except FormatError as exc:
        raise IntegrityError(
            f"{exc} Object {oid} is corrupt. Run `inshrink verify` to find what uses it."
        ) from None


def decode_body(
    oid: str, header: ObjectHeader, body: bytes | memoryview, base: bytes | None, delta: VDelta
) -> bytes:
    """The logical payload of one link ``oid`` from its checked body (and its base's payload
    when a delta); any decoder's failure is an IntegrityError naming the object."""
    try:
        if header.coder in (CODER_ZSTD, CODER_PACKED_ZSTD):
            limit = stream_limit(header.kind, header.coder, header.logical_length, len(body))
            body = _bounded_zstd(oid, body, limit)
            if header.coder == CODER_PACKED_ZSTD:  # a keyframe (parse_header refuses packed deltas)
                body = _nibbles.unpack(body)
        elif header.coder == CODER_BYTEGROUP:
            return _decode_floats(oid, header, body, base)
        elif header.coder == CODER_CLOSED_LOOP:
            if header.is_delta and base is None:
                raise IntegrityError(f"Expected a base for delta object {oid}. Got none.")
            return closed_loop.decode(body, header.logical_length, base)
        if header.is_delta:
            if base is None:
                raise IntegrityError(f"Expected a base for delta object {oid}. Got none.")
            return bytes(delta.decode(body, base=base))
        return bytes(body)
    except (IntegrityError, MemoryError):
        raise
    except Exception as exc:  # FormatError, zstd's, numpy's on a hostile body or base: any of them
        raise undecodable(oid, exc) from exc


def undecodable(oid: str, exc: BaseException) -> IntegrityError:
    """The one error for an object (or residual piece) ``oid`` that does not decode, whatever
    the decoder raised: every reader, ``verify`` and the residual's pieces name the object
    alike. Why one definition: a coder-4 delta on a base of odd length raised numpy's raw
    ValueError in ``verify`` while a read (through zarr) wrapped it without naming the object."""
    return IntegrityError(
        f"Expected object {oid} to decode. Got {type(exc).__name__}: {exc} instead: the object is corrupt. "
        "Run `inshrink verify` to find what uses it.")


def _decode_floats(oid: str, header: ObjectHeader, body: bytes | memoryview, base: bytes | None) -> bytes:
    """Coder 3: the raw float payload of a bytegroup body (a delta's XOR planes against its
    base's payload); the element type is the chunk's own, its size the header's."""
    data = np.frombuffer(body, np.uint8)
    code = bytegroup.parse(data)[0]
    base_data = None
    if header.is_delta:
        if base is None:
            raise IntegrityError(f"Expected a base for delta object {oid}. Got none.")
        base_data = np.frombuffer(base, np.uint8)
    return bytegroup.decode_to_bytes(data, bytegroup.DTYPE_NAMES[code], base=base_data, size=header.logical_length)

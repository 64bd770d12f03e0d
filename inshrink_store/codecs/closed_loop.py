"""The body of a closed-loop object (object coder 4): float32 values as a quantized residual.
Layer: codecs, storage and structure (siblings, none importing another), above the helpers.

Why: a weight re-quantized to a few levels at every checkpoint (open loop) hands a lossy
restore the whole quantization error, and over restores the damage adds up. Coding each
version instead as ``Q(W_t - R_{t-1})``, the quantized difference from what the store
already holds for the previous version (its reconstruction ``R_{t-1}``), keeps every
reconstruction within one residual's coding error of the truth, and the error does not
accumulate; the residual of one training interval is small, so few levels at a fine
absolute resolution cost few bits (ExCP, Li et al., ICML 2024, codes this way).

The object's logical payload is the reconstruction itself, raw little-endian float32, so
its id, the array's zarr.json (``bytes`` alone) and every reader see an ordinary float
tensor; only the object store knows how it was coded. A keyframe (object kind 0) decodes
to the residual's values alone; a delta (kind 1) adds them, element by element in float32,
to its base object's payload (the same chunk one version back). One IEEE addition per
element, rounded to nearest: every reader, numpy or a GPU, gets the same bits.

Layout of a body (integers little-endian)::

    0   4  magic         b"ICL\\x01"
    4   1  inner coder   1 = zstd of the payload, 2 = zstd of the payload with its ids
                         two per byte (``_nibbles``)
    5   1  element       0 = float32 (the only one)
    6   2  reserved      0
    8   4  K             codebook centres, 1..65534
    12  4K centres       float32, strictly ascending, finite
    ..     stream        one zstd frame of an ``inshrink.nuq`` payload (28-byte header,
                         level ids, protected values) of the residual: id ``i < K`` is
                         ``centres[i]``, id ``K`` a protected value

The stream decompresses to at most :func:`max_payload_length` bytes (packed: that bound
through :func:`_nibbles.max_packed_length`), the one bound its reader and writer share.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from inshrink_store.codecs import _nibbles, _payload, _zstd
from inshrink_store.codecs.nuq import quantizer
from inshrink_store.errors import FormatError

MAGIC = b"ICL\x01"
HEADER = struct.Struct("<4sBBHI")
HEADER_SIZE = HEADER.size  # 12
INNER_ZSTD, INNER_PACKED = 1, 2
ELEMENT_FLOAT32 = 0
MAX_CENTRES = 65534
#: zstd level of the residual's payload (level 1, as the store's quantized keyframes)
ZSTD_LEVEL = 1
_F32 = np.dtype("<f4")


def max_payload_length(count: int) -> int:
    """The longest quantized payload of ``count`` elements: two-byte ids, every one protected
    in float32."""
    return _payload.HEADER_SIZE + count * (2 + 4)


def encode(payload: bytes | memoryview, centres: np.ndarray) -> bytes:
    """The body holding quantized ``payload`` (an ``inshrink.nuq`` payload whose centres are
    ``centres``, float32): its zstd frame, packed or plain, whichever is smaller."""
    centres = np.ascontiguousarray(centres, _F32)
    parsed = _payload.unpack(payload)
    if parsed.levels != centres.size + 1:
        raise FormatError(
            f"Expected a payload of {centres.size + 1} levels for {centres.size} centres. "
            f"Got {parsed.levels} instead.")
    inner, stream = INNER_ZSTD, _zstd.compress(payload, ZSTD_LEVEL)
    if _nibbles.packable(payload):
        packed = _nibbles.pack(payload)
        if len(packed) <= len(payload):  # see object_format.keyframe_body: never longer than the payload
            coded = _zstd.compress(packed, ZSTD_LEVEL)
            if len(coded) < len(stream):
                inner, stream = INNER_PACKED, coded
    head = HEADER.pack(MAGIC, inner, ELEMENT_FLOAT32, 0, centres.size)
    return head + centres.tobytes() + stream


def parse(body: bytes | memoryview) -> tuple[int, np.ndarray, memoryview]:
    """(inner coder, centres, stream) of a body; a malformed one is a :class:`FormatError`."""
    view = memoryview(body).cast("B")
    if len(view) < HEADER_SIZE:
        raise FormatError(f"Expected a closed-loop body of at least {HEADER_SIZE} bytes. Got {len(view)}.")
    magic, inner, element, reserved, k = HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise FormatError(f"Expected closed-loop magic {MAGIC!r}. Got {bytes(magic)!r} instead.")
    if inner not in (INNER_ZSTD, INNER_PACKED) or element != ELEMENT_FLOAT32 or reserved:
        raise FormatError(
            f"Expected inner coder 1 or 2, element 0 (float32) and reserved 0 in a closed-loop body. "
            f"Got {inner}, {element}, {reserved} instead.")
    if not 1 <= k <= MAX_CENTRES or len(view) < HEADER_SIZE + 4 * k:
        raise FormatError(
            f"Expected 1..{MAX_CENTRES} centres that fit the {len(view)}-byte closed-loop body. Got {k}.")
    centres = np.frombuffer(view[HEADER_SIZE:HEADER_SIZE + 4 * k], _F32)
    return inner, centres, view[HEADER_SIZE + 4 * k:]


def residual(body: bytes | memoryview, count: int) -> np.ndarray:
    """The ``count`` float32 residual values a body holds (decompressed within the shared
    bound, ids checked against the centres)."""
    inner, centres, stream = parse(body)
    limit = max_payload_length(count)
    if inner == INNER_PACKED:
        payload = _nibbles.unpack(_zstd.decompress(stream, _nibbles.max_packed_length(limit),
                                                   "a closed-loop packed stream"))
    else:
        payload = _zstd.decompress(stream, limit, "a closed-loop stream")
    parsed = _payload.unpack(payload)
    if parsed.count != count or parsed.levels != centres.size + 1:
        raise FormatError(
            f"Expected a residual of {count} elements and {centres.size + 1} levels. Got "
            f"{parsed.count} elements and {parsed.levels} levels instead.")
    q = quantizer(tuple(float(c) for c in centres), 0.0, parsed.protected_dtype, "float32")
    return np.asarray(q.decode(payload), _F32)


def decode(body: bytes | memoryview, logical_length: int, base: bytes | memoryview | None) -> bytes:
    """The payload (raw float32 bits) of a closed-loop object: the residual alone for a
    keyframe, added to ``base`` (its base object's payload) for a delta."""
    if logical_length % 4:
        raise FormatError(f"Expected a float32 payload length (a multiple of 4). Got {logical_length}.")
    values = residual(body, logical_length // 4)
    if base is None:
        return values.tobytes()
    before = np.frombuffer(base, _F32)
    if before.size != values.size:
        raise FormatError(
            f"Expected a base payload of {values.size} float32 elements. Got {len(base)} bytes instead.")
    restored: np.ndarray = reconstruct(before, values)  # numpy in, numpy out
    return restored.tobytes()


def reconstruct(base: Any, values: Any) -> Any:
    """``base + values`` in float32, element by element (numpy or CuPy: the same bits)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return base.astype(_F32, copy=False) + values.astype(_F32, copy=False)


def max_logical(body_len: int) -> int:
    """The largest payload a body of ``body_len`` bytes may declare: one float32 per id byte
    its stream can expand to (packed ids: two per byte)."""
    return 4 * 2 * _zstd.MAX_EXPANSION * max(body_len, 0)

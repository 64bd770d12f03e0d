"""The quantized chunk payload: the byte layout `inshrink.nuq` writes and `inshrink.vdelta` reads.

Layout (all integers little-endian), see ``codecs/inshrink.nuq/README.md``::

    0   4  magic            b"INQ\\x01"
    4   1  format version   1
    5   1  id width         1 (uint8 ids) or 2 (uint16 ids)
    6   1  protected dtype  0 = bfloat16, 1 = float32
    7   1  reserved         0
    8   8  element count    n
    16  4  level count B    K + 1 (K codebook centres, id K = protected)
    20  8  protected count  P (number of ids equal to K)
    28  n*width             level ids
    ..  P*2 or P*4          protected values, in element order

Ids are whole bytes (never bit-packed) so that deltas, regrouping and the entropy
coder see whole symbols. Everything needed to split the payload is in it, so a
malformed payload is detected here, once, for every codec that reads one.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from inshrink_store import dtypes
from inshrink_store.errors import FormatError

MAGIC = b"INQ\x01"
VERSION = 1
HEADER = struct.Struct("<4sBBBBQIQ")
HEADER_SIZE = HEADER.size  # 28
#: the on-disk code of each protected word format (part of the format: never renumber)
PROTECTED_DTYPES = {0: "bfloat16", 1: "float32"}
PROTECTED_CODES = {name: code for code, name in PROTECTED_DTYPES.items()}


def protected_word(name: str) -> np.dtype:
    """The little-endian numpy dtype of one protected word (its dtype's carrier)."""
    return dtypes.by_codec_name(name).carrier.newbyteorder("<")


PROTECTED_ITEMSIZE = {name: protected_word(name).itemsize for name in PROTECTED_CODES}


def id_width_for(levels: int) -> int:
    """Bytes per level id: uint8 while B <= 255, uint16 above (B counts the protected level)."""
    if levels < 1 or levels > 65535:
        raise FormatError(f"Expected a level count B in 1..65535. Got {levels} instead.")
    return 1 if levels <= 255 else 2


def id_dtype(width: int) -> np.dtype:
    return np.dtype("<u1") if width == 1 else np.dtype("<u2")


def is_quantized_payload(data: bytes | memoryview) -> bool:
    """Cheap sniff used by the store to decide whether a chunk can be delta-coded."""
    return len(data) >= HEADER_SIZE and bytes(data[:4]) == MAGIC


@dataclass(frozen=True)
class Payload:
    """A parsed payload: ids (uint8/uint16 view), protected values as raw little-endian words."""

    levels: int
    ids: np.ndarray
    protected_dtype: str
    protected: np.ndarray  # uint16 bit patterns (bfloat16) or float32

    @property
    def count(self) -> int:
        return int(self.ids.size)

    def to_bytes(self) -> bytes:
        return pack(self.levels, self.ids, self.protected_dtype, self.protected)


def pack(levels: int, ids: np.ndarray, protected_dtype: str, protected: np.ndarray) -> bytes:
    """Serialise ids and protected values; the inverse of :func:`unpack`."""
    width = id_width_for(levels)
    if protected_dtype not in PROTECTED_CODES:
        raise FormatError(
            f"Expected protected dtype 'bfloat16' or 'float32'. Got {protected_dtype!r} instead."
        )
    ids = np.ascontiguousarray(ids, dtype=id_dtype(width)).ravel()
    n_prot = int(protected.size)
    header = HEADER.pack(
        MAGIC, VERSION, width, PROTECTED_CODES[protected_dtype], 0, ids.size, levels, n_prot
    )
    body = np.ascontiguousarray(protected, dtype=protected_word(protected_dtype)).ravel()
    return header + ids.tobytes() + body.tobytes()


def unpack(data: bytes | bytearray | memoryview | np.ndarray) -> Payload:
    """Parse and validate a payload; every inconsistency raises :class:`FormatError`."""
    raw = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else memoryview(
        np.ascontiguousarray(data).view("u1").ravel().data
    )
    if len(raw) < HEADER_SIZE:
        raise FormatError(
            f"Expected a quantized payload of at least {HEADER_SIZE} header bytes. "
            f"Got {len(raw)} bytes instead (truncated?)."
        )
    magic, version, width, pcode, _reserved, n, levels, n_prot = HEADER.unpack_from(raw, 0)
    if magic != MAGIC:
        raise FormatError(f"Expected payload magic {MAGIC!r}. Got {bytes(magic)!r} instead.")
    if version != VERSION:
        raise FormatError(
            f"Expected payload format version {VERSION}. Got {version} instead; "
            "upgrade inshrink-store to read it."
        )
    if pcode not in PROTECTED_DTYPES:
        raise FormatError(f"Expected protected dtype code 0 or 1. Got {pcode} instead.")
    if width != id_width_for(levels):
        raise FormatError(
            f"Expected id width {id_width_for(levels)} for {levels} levels. Got {width} instead."
        )
    pname = PROTECTED_DTYPES[pcode]
    expected = HEADER_SIZE + n * width + n_prot * PROTECTED_ITEMSIZE[pname]
    if len(raw) != expected:
        raise FormatError(
            f"Expected {expected} payload bytes for {n} ids and {n_prot} protected values. "
            f"Got {len(raw)} instead (truncated or trailing bytes)."
        )
    ids = np.frombuffer(raw, dtype=id_dtype(width), count=n, offset=HEADER_SIZE)
    if n and int(ids.max()) >= levels:
        raise FormatError(
            f"Expected level ids below B={levels}. Got id {int(ids.max())} instead."
        )
    actual_prot = int(np.count_nonzero(ids == levels - 1))
    if actual_prot != n_prot:
        raise FormatError(
            f"Expected {n_prot} protected ids (id {levels - 1}) as the header says. "
            f"Got {actual_prot} instead."
        )
    prot = np.frombuffer(raw, dtype=protected_word(pname), count=n_prot, offset=HEADER_SIZE + n * width)
    return Payload(levels=levels, ids=ids, protected_dtype=pname, protected=prot)

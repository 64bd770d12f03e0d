"""The quantized chunk payload: the byte layout `inshrink.nuq` writes and `inshrink.vdelta` reads.
Layer: codecs, storage and structure (siblings, none importing another), above the helpers.

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

A payload is assembled and parsed in the library of its ids (numpy, or CuPy on a GPU:
:mod:`inshrink_store.codecs._xp`): the n ids stay where they are, only the 28 header bytes
and the P protected words (few, and converted on the host) cross to the host.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from inshrink_store import dtypes
from inshrink_store.codecs import _quant_loops
from inshrink_store.codecs._xp import array_namespace, like, to_host
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
    """A parsed payload: ids (uint8/uint16 view, in the library of the parsed data), protected
    values as raw little-endian words (always a numpy array: they are decoded on the host)."""

    levels: int
    ids: Any  # np.ndarray, or a CuPy array for a payload parsed on the device
    protected_dtype: str
    protected: np.ndarray  # uint16 bit patterns (bfloat16) or float32

    @property
    def count(self) -> int:
        return int(self.ids.size)

    def to_bytes(self) -> bytes:
        return pack(self.levels, self.ids, self.protected_dtype, self.protected)


def assemble(levels: int, ids: Any, protected_dtype: str, protected: Any) -> Any:
    """The payload as one uint8 array in the library of ``ids`` (numpy, or CuPy on a GPU,
    where the n ids are copied device to device and only header and protected words come
    from the host). :func:`pack` is its bytes."""
    width = id_width_for(levels)
    if protected_dtype not in PROTECTED_CODES:
        raise FormatError(
            f"Expected protected dtype 'bfloat16' or 'float32'. Got {protected_dtype!r} instead."
        )
    xp = array_namespace(ids)
    ids = xp.asarray(ids).reshape(-1)
    words = np.ascontiguousarray(to_host(protected), dtype=protected_word(protected_dtype)).ravel()
    n, body = int(ids.size), HEADER_SIZE + int(ids.size) * width
    header = HEADER.pack(
        MAGIC, VERSION, width, PROTECTED_CODES[protected_dtype], 0, n, levels, words.size
    )
    out = xp.empty(body + words.nbytes, dtype=np.uint8)
    out[:HEADER_SIZE] = like(np.frombuffer(header, np.uint8), xp)
    out[HEADER_SIZE:body].view(id_dtype(width))[...] = ids  # cast as astype does (unsafe)
    out[body:] = like(words.view(np.uint8), xp)
    return out


def pack(levels: int, ids: Any, protected_dtype: str, protected: Any) -> bytes:
    """Serialise ids and protected values; the inverse of :func:`unpack`."""
    return to_host(assemble(levels, ids, protected_dtype, protected)).tobytes()


def _byte_array(data: Any) -> Any:
    """``data`` as a flat uint8 array without copying: numpy for bytes-likes and numpy
    arrays, CuPy for CuPy arrays."""
    xp = array_namespace(data)
    if xp is not np:
        return xp.ascontiguousarray(data).reshape(-1).view(xp.uint8)
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).view("u1").reshape(-1)
    return np.frombuffer(memoryview(data).cast("B"), np.uint8)


def _aligned(raw: Any, width: int) -> Any:
    """A device byte array whose ids start on a ``width``-byte boundary (a misaligned
    uint16 load faults on a GPU; numpy reads unaligned views as they are)."""
    if width == 1 or isinstance(raw, np.ndarray) or raw.data.ptr % width == 0:
        return raw
    return raw.copy()


def unpack(data: Any) -> Payload:
    """Parse and validate a payload (bytes-like, numpy or CuPy array); every inconsistency
    raises :class:`FormatError`."""
    raw = _byte_array(data)
    if raw.size < HEADER_SIZE:
        raise FormatError(
            f"Expected a quantized payload of at least {HEADER_SIZE} header bytes. "
            f"Got {raw.size} bytes instead (truncated?)."
        )
    magic, version, width, pcode, _reserved, n, levels, n_prot = HEADER.unpack(
        to_host(raw[:HEADER_SIZE]).tobytes()
    )
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
    body = HEADER_SIZE + n * width
    expected = body + n_prot * PROTECTED_ITEMSIZE[pname]
    if raw.size != expected:
        raise FormatError(
            f"Expected {expected} payload bytes for {n} ids and {n_prot} protected values. "
            f"Got {raw.size} instead (truncated or trailing bytes)."
        )
    ids = _aligned(raw, width)[HEADER_SIZE:body].view(id_dtype(width))
    _check_ids(ids, levels, n_prot)
    prot = to_host(raw[body:]).view(protected_word(pname))
    return Payload(levels=levels, ids=ids, protected_dtype=pname, protected=prot)


def _check_ids(ids: Any, levels: int, n_prot: int) -> None:
    """Every id below B, and as many protected ids (B - 1) as the header counts."""
    loops = _quant_loops.for_bytes(int(ids.nbytes)) if isinstance(ids, np.ndarray) else None
    if loops is not None:  # both checks in one pass
        top, actual = loops.id_stats(np.ascontiguousarray(ids), levels - 1)
        if top >= levels:
            raise FormatError(f"Expected level ids below B={levels}. Got id {int(top)} instead.")
        if actual != n_prot:
            raise FormatError(
                f"Expected {n_prot} protected ids (id {levels - 1}) as the header says. "
                f"Got {int(actual)} instead."
            )
        return
    if ids.size and int(ids.max()) >= levels:
        raise FormatError(
            f"Expected level ids below B={levels}. Got id {int(ids.max())} instead."
        )
    xp = array_namespace(ids)
    actual_prot = int(xp.count_nonzero(ids == levels - 1))
    if actual_prot != n_prot:
        raise FormatError(
            f"Expected {n_prot} protected ids (id {levels - 1}) as the header says. "
            f"Got {actual_prot} instead."
        )

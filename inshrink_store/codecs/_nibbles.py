"""Two level ids per byte: how the object store codes a quantized payload of at most 16 levels.
Layer: codecs, storage and structure (siblings, none importing another), above the helpers.

Why: the payload keeps one id per byte (deltas and regrouping need whole symbols), and zstd's
entropy stage codes bytes. With few levels each id carries 1-3 bits, and a byte-wise Huffman
code cannot spend less than one bit per symbol, so zstd stays well above the ids' entropy.
Packing two ids into one byte lets the same coder see pairs. Measured on pretrained weights
at 0.5 % protected (``python benchmarks/bench_rate_distortion.py``, zstd level 1): CREPE at 4 /
8 / 16 levels 1.36 / 1.83 / 2.29 bits per id unpacked, 1.06 / 1.55 / 2.12 packed (under the
ids' order-0 entropy of 1.12 / 1.79 / 2.45); Resemblyzer 2.05 / 2.78 / 3.43 unpacked, 1.60 /
2.29 / 3.31 packed.

Up to 16 levels (B, counting the protected id) every id fits a nibble. From 17 to 31 (16
levels plus the protected id is 17, the default configuration) a nibble of 15 is an escape:
the id is ``15 + e`` with ``e`` taken from an extra byte; the top few ids are rare, so the
escapes cost little. CREPE at 16 levels: 2.29 bits per id as bytes, 2.13 packed; at 24
levels 2.86 and 2.78.

Layout of a packed payload: the payload's 28-byte header unchanged; then ``ceil(n / 2)``
bytes holding ``min(id, 15)`` of id ``2i`` in the low nibble and of id ``2i + 1`` in the high
nibble of byte ``i`` (the high nibble of a last, unpaired byte is 0); then, when B > 16, one
byte ``id - 15`` for every nibble equal to 15, in element order; then the protected values
unchanged. Packing is a pure function of the payload and is undone exactly; the store keeps
whichever of the packed and the plain form compresses smaller (``cas``, coder 2).

With escapes the packed form can be *longer* than the payload: when most ids are 15 or above
(a skewed chunk whose weights sit at the top levels), each pays a nibble and an escape byte.
:func:`max_packed_length` is the bound for that case, and the one definition both the reader
(its decompression limit) and the writer (checked before it stores) use; releases e41198a to
a828d53 bounded the packed stream by the payload's length instead, and their reader refused
such chunks although the bytes on disk were intact.
"""

from __future__ import annotations

import numpy as np

from inshrink_store.codecs import _payload
from inshrink_store.errors import FormatError

#: the most levels (B, counting the protected id) whose ids all fit a nibble
NIBBLE_LEVELS = 16
#: the most levels packed at all (ids from 15 on escape to an extra byte above NIBBLE_LEVELS)
MAX_LEVELS = 31
ESCAPE = 15


def max_packed_length(payload_length: int) -> int:
    """The longest packed form of a payload of ``payload_length`` bytes: every id escaped, so
    half a byte of nibbles plus an escape byte for each one-byte id (header and protected
    values unchanged). At most one and a half times the payload's length."""
    ids = max(payload_length - _payload.HEADER_SIZE, 0)
    return payload_length + (ids + 1) // 2


def _header(data: bytes | memoryview) -> tuple[int, int, int, int]:
    """(id width, element count, levels B, protected byte count) of a payload header."""
    if len(data) < _payload.HEADER_SIZE or bytes(data[:4]) != _payload.MAGIC:
        raise FormatError(
            f"Expected a quantized payload header ({_payload.HEADER_SIZE} bytes starting "
            f"{_payload.MAGIC!r}). Got {bytes(data[:4])!r} ({len(data)} bytes) instead."
        )
    _, version, width, pcode, _, n, levels, n_prot = _payload.HEADER.unpack_from(data, 0)
    if version != _payload.VERSION or pcode not in _payload.PROTECTED_DTYPES:
        raise FormatError(f"Expected payload format {_payload.VERSION} with a known protected dtype. "
                          f"Got format {version}, protected code {pcode} instead.")
    return width, n, levels, n_prot * _payload.PROTECTED_ITEMSIZE[_payload.PROTECTED_DTYPES[pcode]]


def packable(payload: bytes | memoryview) -> bool:
    """Whether ``payload`` is a quantized payload with byte ids and at most 31 levels."""
    if not _payload.is_quantized_payload(payload):
        return False
    try:
        width, n, levels, rest = _header(payload)
    except FormatError:
        return False
    return width == 1 and levels <= MAX_LEVELS and len(payload) == _payload.HEADER_SIZE + n + rest


def pack(payload: bytes | memoryview) -> bytes:
    """The payload with its ids two to a byte (see the module docstring)."""
    if not packable(payload):
        raise FormatError(f"Expected a quantized payload of byte ids and at most {MAX_LEVELS} levels to "
                          "pack. Got another payload instead.")
    _, n, levels, _ = _header(payload)
    start = _payload.HEADER_SIZE
    ids = np.frombuffer(payload, np.uint8, count=n, offset=start)
    nibbles = np.minimum(ids, ESCAPE) if levels > NIBBLE_LEVELS else ids
    low = nibbles[0::2]
    high = np.zeros(low.size, np.uint8)
    high[: n // 2] = nibbles[1::2]
    packed = (low | (high << 4)).tobytes()
    escapes = (ids[ids >= ESCAPE] - ESCAPE).astype(np.uint8).tobytes() if levels > NIBBLE_LEVELS else b""
    return bytes(payload[:start]) + packed + escapes + bytes(payload[start + n:])


def unpack(data: bytes | memoryview) -> bytes:
    """The payload :func:`pack` was given; a malformed packed form raises a FormatError."""
    width, n, levels, rest = _header(data)
    if width != 1 or levels > MAX_LEVELS:
        raise FormatError(f"Expected a packed payload of byte ids and at most {MAX_LEVELS} levels. "
                          f"Got id width {width}, {levels} levels instead.")
    start, half = _payload.HEADER_SIZE, (n + 1) // 2
    if len(data) < start + half + rest:
        raise FormatError(f"Expected at least {start + half + rest} bytes of packed payload for {n} ids. "
                          f"Got {len(data)} instead (truncated).")
    packed = np.frombuffer(data, np.uint8, count=half, offset=start)
    ids = np.empty(n, np.uint8)
    ids[0::2] = packed & 0x0F
    ids[1::2] = (packed >> 4)[: n // 2]
    if n % 2 and half and packed[-1] >> 4:
        raise FormatError("Expected the unused high nibble of a packed payload's last byte to be 0. "
                          f"Got {int(packed[-1] >> 4)} instead.")
    escaped = np.flatnonzero(ids == ESCAPE) if levels > NIBBLE_LEVELS else np.zeros(0, np.int64)
    if len(data) != start + half + escaped.size + rest:
        raise FormatError(f"Expected {start + half + escaped.size + rest} bytes of packed payload for "
                          f"{n} ids ({escaped.size} escaped). Got {len(data)} instead (truncated or trailing bytes).")
    extra = np.frombuffer(data, np.uint8, count=escaped.size, offset=start + half)
    if extra.size and int(extra.max()) >= levels - ESCAPE:
        raise FormatError(f"Expected escaped ids below B={levels}. Got id {ESCAPE + int(extra.max())} instead.")
    ids[escaped] += extra
    return bytes(data[:start]) + ids.tobytes() + bytes(data[start + half + escaped.size:])

"""``inshrink.bytegroup``: lossless float codec that entropy-codes each byte plane on its own.

Why: in trained float weights the byte holding the sign and the high exponent bits takes
few values (it compresses several times over), while the low mantissa bytes are close to
uniformly random (they barely compress at all). Mixing them in one stream, as plain zstd
does, hides the structure; Blosc's shuffle separates the planes but codes them in small
blocks with one setting. Here each element's bytes are split by significance into
``itemsize`` planes (plane 0 is the most significant byte), and each plane is stored the
cheapest of three ways, chosen per chunk and recorded in the header: raw, one zstd frame,
or one zstd frame of the plane XOR the same plane of a *base* (the parent version's chunk
of the same tensor, passed as ``base=`` like ``inshrink.vdelta``). Raw costs nothing to
decode, which is what the near-random planes want.

Deterministic: each plane is its own single-threaded zstd frame at the configured level,
so the bytes depend on the input (and base) only, never on threads or timing.
The header carries the xxh3-64 of the decoded data (checked on every decode) and, when a
plane uses the base, the base's xxh3-64 (a wrong base is an :class:`IntegrityError`).
Byte layout and change log: ``codecs/inshrink.bytegroup/README.md``.
"""

from __future__ import annotations

import struct
from typing import Any, cast

import numpy as np
import xxhash
import zstandard
from numcodecs.abc import Codec
from numcodecs.compat import ensure_contiguous_ndarray
from numcodecs.registry import register_codec

from inshrink_store.codecs import _zstd
from inshrink_store.errors import FormatError, IntegrityError

CODEC_ID = "inshrink.bytegroup"
MAGIC = b"IBG\x01"
VERSION = 1
#: element dtype name -> (code in the header, little-endian carrier dtype)
DTYPES: dict[str, tuple[int, np.dtype[Any]]] = {
    "float32": (0, np.dtype("<f4")),
    "float16": (1, np.dtype("<f2")),
    "bfloat16": (2, np.dtype("<u2")),  # bit patterns: numpy has no bfloat16
}
DTYPE_NAMES = {code: name for name, (code, _) in DTYPES.items()}
CODERS = {"zstd": 1}
# magic, version, dtype code, flags, plane count, n, xxh3-64(decoded), xxh3-64(base)
HEADER = struct.Struct("<4sBBBBQQQ")
HEADER_SIZE = HEADER.size  # 32
# per plane: method, stored length
PLANE = struct.Struct("<BQ")
PLANE_SIZE = PLANE.size  # 9
FLAG_BASE = 1  # some plane is XORed with the base
KNOWN_FLAGS = FLAG_BASE
#: plane methods: bit 0 = zstd frame (else raw), bit 1 = XOR with the base's plane
RAW, ZSTD, XOR_RAW, XOR_ZSTD = 0, 1, 2, 3
METHODS = (RAW, ZSTD, XOR_RAW, XOR_ZSTD)
METHOD_ZSTD, METHOD_XOR = 1, 2
CONFIG_KEYS = ("coder", "dtype", "level")


def _buffer(array: np.ndarray) -> bytes:
    """``array`` where a bytes-like object is expected (numpy arrays implement the buffer
    protocol, which numpy's type stubs do not declare)."""
    return cast(bytes, array)


def _bytes_view(buf: Any) -> np.ndarray:
    return ensure_contiguous_ndarray(buf).reshape(-1).view(np.uint8)


def split_planes(data: np.ndarray, itemsize: int) -> list[np.ndarray]:
    """Bytes of little-endian elements -> ``itemsize`` contiguous planes, most significant first."""
    rows = data.reshape(-1, itemsize)
    return [np.ascontiguousarray(rows[:, itemsize - 1 - i]) for i in range(itemsize)]


def join_planes(planes: list[np.ndarray], itemsize: int, out: np.ndarray) -> np.ndarray:
    """Inverse of :func:`split_planes` into the flat uint8 array ``out``."""
    rows = out.reshape(-1, itemsize)
    for i, plane in enumerate(planes):
        rows[:, itemsize - 1 - i] = plane
    return out


def _check_level(level: Any) -> int:
    if isinstance(level, bool) or not isinstance(level, int | np.integer) or not 1 <= level <= 22:
        raise FormatError(f"Expected a zstd level (an integer) in 1..22. Got {level!r:.80} instead.")
    return int(level)


class ByteGroup(Codec):
    """numcodecs codec; ``encode``/``decode`` take the parent version's chunk as optional ``base=``.

    Arrays of ``dtype`` bfloat16 are passed as uint16 bit patterns. ``decode`` returns a flat
    array of the element's carrier dtype (float32, float16, uint16).
    """

    codec_id = CODEC_ID

    def __init__(self, dtype: str = "float32", level: int = 1, coder: str = "zstd") -> None:
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise FormatError(
                f"Expected dtype one of {sorted(DTYPES)}. Got {dtype!r:.80} instead; bfloat16 "
                "arrays are passed as uint16 bit patterns with dtype 'bfloat16'."
            )
        if not isinstance(coder, str) or coder not in CODERS:
            raise FormatError(f"Expected coder one of {sorted(CODERS)}. Got {coder!r:.80} instead.")
        self.dtype = dtype
        self.level = _check_level(level)
        self.coder = coder

    @property
    def carrier(self) -> np.dtype[Any]:
        return DTYPES[self.dtype][1]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ByteGroup:
        """Build from ``get_config()`` output; an unknown key is a FormatError naming it."""
        if not isinstance(config, dict):
            raise FormatError(f"Expected the {CODEC_ID} configuration to be a dict. Got {config!r:.80} instead.")
        unknown = [k for k in config if k != "id" and k not in CONFIG_KEYS]
        if unknown:
            raise FormatError(
                f"Expected only the keys {['id', *CONFIG_KEYS]} in the {CODEC_ID} configuration. "
                f"Got the unknown key {unknown[0]!r:.80} instead; remove it (or upgrade "
                "inshrink-store if a newer version wrote it)."
            )
        return cls(**{k: v for k, v in config.items() if k != "id"})

    def get_config(self) -> dict[str, Any]:
        return {"id": CODEC_ID, "coder": self.coder, "dtype": self.dtype, "level": self.level}

    def __repr__(self) -> str:
        return f"ByteGroup(dtype={self.dtype!r}, level={self.level}, coder={self.coder!r})"

    # -- encoding ---------------------------------------------------------------------------
    def _elements(self, buf: Any, what: str) -> np.ndarray:
        data = _bytes_view(buf)
        if data.size % self.carrier.itemsize:
            raise FormatError(
                f"Expected {what} to hold whole {self.dtype} elements ({self.carrier.itemsize} "
                f"bytes each). Got {data.size} bytes instead."
            )
        return data

    def encode(self, buf: Any, base: Any = None) -> bytes:
        """Encode the chunk ``buf``; with ``base`` (same dtype and size), a plane may be XORed
        with the base's plane where that codes smaller."""
        data = self._elements(buf, "the chunk")
        itemsize = self.carrier.itemsize
        n = data.size // itemsize
        planes = split_planes(data, itemsize)
        base_planes: list[np.ndarray] | None = None
        base_hash = 0
        if base is not None:
            base_data = self._elements(base, "the base chunk")
            if base_data.size != data.size:
                raise FormatError(
                    f"Expected a base chunk of {data.size} bytes (same shape as the chunk). Got "
                    f"{base_data.size} instead (shape changed: encode without base=)."
                )
            base_planes = split_planes(base_data, itemsize)
            base_hash = xxhash.xxh3_64_intdigest(_buffer(base_data))
        compressor = zstandard.ZstdCompressor(level=self.level)
        table: list[bytes] = []
        bodies: list[bytes] = []
        used_base = False
        for i, plane in enumerate(planes):
            method, body = RAW, plane.tobytes()
            if n:
                candidates = [(ZSTD, compressor.compress(_buffer(plane)))]
                if base_planes is not None:
                    xored = np.bitwise_xor(plane, base_planes[i])
                    candidates.append((XOR_ZSTD, compressor.compress(_buffer(xored))))
                for cand_method, cand_body in candidates:  # strictly smaller wins: ties keep the first
                    if len(cand_body) < len(body):
                        method, body = cand_method, cand_body
            used_base |= bool(method & METHOD_XOR)
            table.append(PLANE.pack(method, len(body)))
            bodies.append(body)
        code = DTYPES[self.dtype][0]
        header = HEADER.pack(
            MAGIC, VERSION, code, FLAG_BASE if used_base else 0, itemsize, n,
            xxhash.xxh3_64_intdigest(_buffer(data)), base_hash if used_base else 0,
        )
        return b"".join((header, *table, *bodies))

    # -- decoding ---------------------------------------------------------------------------
    def decode(self, buf: Any, out: Any = None, base: Any = None) -> Any:
        """The exact chunk: a flat array of the carrier dtype, or ``out`` filled with it."""
        decoded = decode_bytes(_bytes_view(buf), self.dtype, base)
        if out is None:
            return decoded.view(self.carrier)
        dest = _bytes_view(out)
        if dest.size != decoded.size:
            raise FormatError(f"Expected an out buffer of {decoded.size} bytes. Got {dest.size} instead.")
        dest[:] = decoded
        return out


def parse(data: np.ndarray) -> tuple[int, int, int, int, int, list[tuple[int, int]]]:
    """Validate the header and plane table of ``data`` against its real size.

    Returns (dtype code, flags, n, checksum, base hash, [(method, length)] per plane).
    """
    if data.size < HEADER_SIZE or bytes(data[:4]) != MAGIC:
        raise FormatError(
            f"Expected a bytegroup chunk starting with {MAGIC!r}. Got {bytes(data[:4])!r} "
            f"({data.size} bytes) instead (not a bytegroup chunk, or truncated)."
        )
    _, version, code, flags, count, n, checksum, base_hash = HEADER.unpack_from(_buffer(data))
    if version != VERSION:
        raise FormatError(
            f"Expected bytegroup format version {VERSION}. Got {version} instead; upgrade inshrink-store."
        )
    if code not in DTYPE_NAMES:
        raise FormatError(f"Expected a dtype code in {sorted(DTYPE_NAMES)}. Got {code} instead (corrupt header).")
    if flags & ~KNOWN_FLAGS:
        raise FormatError(f"Expected header flags within {KNOWN_FLAGS}. Got {flags} instead (corrupt header).")
    itemsize = DTYPES[DTYPE_NAMES[code]][1].itemsize
    if count != itemsize:
        raise FormatError(
            f"Expected {itemsize} planes for {DTYPE_NAMES[code]}. Got a plane count of {count} instead."
        )
    table_end = HEADER_SIZE + count * PLANE_SIZE
    if data.size < table_end:
        raise FormatError(f"Expected at least {table_end} bytes (header and plane table). Got {data.size} instead.")
    planes = [PLANE.unpack_from(_buffer(data), HEADER_SIZE + i * PLANE_SIZE) for i in range(count)]
    total = table_end
    for i, (method, length) in enumerate(planes):
        if method not in METHODS:
            raise FormatError(f"Expected plane {i}'s method in {list(METHODS)}. Got {method} instead.")
        if not method & METHOD_ZSTD and length != n:
            raise FormatError(f"Expected raw plane {i} to hold n={n} bytes. Got a length of {length} instead.")
        if method & METHOD_ZSTD and n > length * _zstd.MAX_EXPANSION:
            raise FormatError(
                f"Expected n={n} to fit in plane {i}'s zstd frame of {length} bytes. Got a count "
                "no frame that small can hold instead (corrupt header)."
            )
        total += length
    if data.size != total:
        raise FormatError(
            f"Expected {total} bytegroup bytes (header, plane table and planes). Got {data.size} "
            "instead (truncated, trailing bytes, or a corrupt plane length)."
        )
    uses_base = any(method & METHOD_XOR for method, _ in planes)
    if uses_base != bool(flags & FLAG_BASE) or (not uses_base and base_hash):
        raise FormatError(
            f"Expected the base flag ({flags & FLAG_BASE}) to say whether a plane uses the base "
            f"({int(uses_base)}) and a zero base hash without one. Got base hash {base_hash:016x} instead."
        )
    return code, flags, n, checksum, base_hash, planes


def decode_bytes(data: np.ndarray, dtype: str, base: Any = None) -> np.ndarray:
    """The decoded chunk as flat uint8, checked against the header's checksum."""
    code, flags, n, checksum, base_hash, table = parse(data)
    if DTYPE_NAMES[code] != dtype:
        raise FormatError(
            f"Expected a {dtype} chunk (the codec's dtype). Got a {DTYPE_NAMES[code]} chunk instead."
        )
    itemsize = len(table)
    base_planes: list[np.ndarray] | None = None
    if flags & FLAG_BASE:
        if base is None:
            raise FormatError(
                "Expected the base chunk (base=...) this chunk was XORed with. Got None instead; pass "
                "the chunk stored at the same key in the parent version."
            )
        base_data = _bytes_view(base)
        if xxhash.xxh3_64_intdigest(_buffer(base_data)) != base_hash:
            raise IntegrityError(
                f"Expected the base chunk this chunk was encoded against (xxh3-64 {base_hash:016x}). "
                f"Got a different base ({xxhash.xxh3_64_intdigest(_buffer(base_data)):016x}) instead."
            )
        if base_data.size != n * itemsize:
            raise FormatError(f"Expected a base of {n * itemsize} bytes. Got {base_data.size} instead.")
        base_planes = split_planes(base_data, itemsize)
    offset = HEADER_SIZE + itemsize * PLANE_SIZE
    planes: list[np.ndarray] = []
    for i, (method, length) in enumerate(table):
        body = data[offset:offset + length]
        offset += length
        if method & METHOD_ZSTD:
            raw = _zstd.decompress(memoryview(_buffer(body)), n, f"plane {i}'s zstd frame")
            if len(raw) != n:
                raise FormatError(f"Expected plane {i} to decompress to {n} bytes. Got {len(raw)} instead.")
            plane = np.frombuffer(raw, np.uint8)
        else:
            plane = body
        if method & METHOD_XOR:
            assert base_planes is not None  # FLAG_BASE matches the methods (parse)
            plane = np.bitwise_xor(plane, base_planes[i])
        planes.append(plane)
    out = join_planes(planes, itemsize, np.empty(n * itemsize, np.uint8))
    if xxhash.xxh3_64_intdigest(_buffer(out)) != checksum:
        raise FormatError(
            f"Expected decoded data with xxh3-64 {checksum:016x}. Got "
            f"{xxhash.xxh3_64_intdigest(_buffer(out)):016x} instead (corrupt plane bytes)."
        )
    return out


register_codec(ByteGroup)

"""``inshrink.bytegroup``: lossless float codec that entropy-codes each byte plane on its own.
Layer: codecs, storage and structure (siblings, none importing another), above the helpers.

Why: in trained float weights the byte holding the high exponent bits takes few values
(it compresses several times over), while the low mantissa bytes are close to uniformly
random (they barely compress at all). Mixing them in one stream, as plain zstd does, hides
the structure; Blosc's shuffle separates the planes but codes them in small blocks with
one setting. Here each element's bytes are split by significance into ``itemsize`` planes
(plane 0 is the most significant byte), and each plane is stored the cheapest way,
chosen per chunk and recorded in the chunk's plane table.

Two formats, picked by the ``coder`` setting:

- ``"zstd+huffman"`` (format 2, what the store writes): for float32 and bfloat16 the sign
  bit is first moved below the mantissa, so plane 0 is exactly the 8-bit exponent; each
  plane is raw, zstd, a Huffman code, or *packed* (ranks of its commonest values, see
  :mod:`inshrink_store.codecs._planes`), whichever is smallest.
- ``"zstd"`` (format 1, the first version): sign in place, each plane raw or zstd.

Either can also code a plane as the XOR with the same plane of a *base* (the parent
version's chunk of the same tensor, passed as ``base=`` like ``inshrink.vdelta``).
Decoding reads both formats, whatever the configured coder.

Deterministic: every coder is single-threaded with fixed settings, so the bytes depend on
the input (and base, level and library versions) only, never on threads or timing.
The header carries the xxh3-64 of the decoded data (checked on every decode) and, when a
plane uses the base, the base's xxh3-64 (a wrong base is an :class:`IntegrityError`).
The zarr v3 front end, :class:`ByteGroupZarrCodec`, is a bytes-to-bytes codec after
zarr's ``bytes`` codec; it codes chunks on worker threads, so the chunks of one array
are encoded in parallel. Byte layout and change log: ``codecs/inshrink.bytegroup/README.md``.
"""

from __future__ import annotations

import asyncio
import math
import struct
import threading
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import xxhash
from numcodecs.abc import Codec
from numcodecs.compat import ensure_contiguous_ndarray
from numcodecs.registry import register_codec
from zarr.abc.codec import BytesBytesCodec
from zarr.core.array_spec import ArraySpec
from zarr.core.buffer import Buffer
from zarr.registry import register_codec as register_zarr_codec

from inshrink_store import dtypes
from inshrink_store.codecs import _kernels, _planes, _zstd
from inshrink_store.codecs._config import check_config, named_configuration
from inshrink_store.errors import FormatError, IntegrityError

CODEC_ID = "inshrink.bytegroup"
MAGIC = b"IBG\x01"
#: format written per coder; decoding reads every version in VERSIONS
VERSION_OF_CODER = {"zstd": 1, "zstd+huffman": 2}
VERSIONS = (1, 2)
VERSION = max(VERSIONS)
CODERS = tuple(VERSION_OF_CODER)
#: element dtype name -> code in the chunk header (the carrier comes from the dtype registry)
DTYPE_CODES: dict[str, int] = {"float32": 0, "float16": 1, "bfloat16": 2}
DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
ELEMENT_DTYPES = tuple(DTYPE_CODES)
#: format 2 moves the sign bit below the mantissa where that makes plane 0 the exponent
SIGN_LAST_DTYPES = ("float32", "bfloat16")
# magic, version, dtype code, flags, plane count, n, xxh3-64(decoded), xxh3-64(base)
HEADER = struct.Struct("<4sBBBBQQQ")
HEADER_SIZE = HEADER.size  # 32
# per plane: method, stored length
PLANE = struct.Struct("<BQ")
PLANE_SIZE = PLANE.size  # 9
FLAG_BASE = 1  # some plane is XORed with the base
FLAG_SIGN_LAST = 2  # format 2: the sign bit was rotated to bit 0 before splitting
KNOWN_FLAGS = {1: FLAG_BASE, 2: FLAG_BASE | FLAG_SIGN_LAST}
#: plane methods: 0 raw, 1 zstd, 2/3 raw/zstd of the XOR with the base's plane;
#: format 2 adds 4 Huffman (raw deflate) and 5 packed (codecs/inshrink.bytegroup/README.md)
RAW, ZSTD, XOR_RAW, XOR_ZSTD = 0, 1, 2, 3
HUFFMAN, PACKED = _planes.HUFFMAN, _planes.PACKED
METHODS_OF_VERSION = {1: (RAW, ZSTD, XOR_RAW, XOR_ZSTD), 2: (RAW, ZSTD, XOR_RAW, XOR_ZSTD, HUFFMAN, PACKED)}
METHODS = METHODS_OF_VERSION[VERSION]
#: the stream coder of each method; methods 2 and 3 XOR with the base
CODER_OF_METHOD = {RAW: _planes.RAW, ZSTD: _planes.ZSTD, XOR_RAW: _planes.RAW, XOR_ZSTD: _planes.ZSTD,
                   HUFFMAN: _planes.HUFFMAN, PACKED: _planes.PACKED}
METHOD_XOR = 2
CONFIG_KEYS = ("coder", "dtype", "level")


def carrier(dtype: str) -> np.dtype[Any]:
    """The little-endian numpy dtype an element of ``dtype`` travels as (registry carrier)."""
    return dtypes.by_codec_name(dtype).carrier.newbyteorder("<")


def _buffer(array: np.ndarray) -> bytes:
    """``array`` where a bytes-like object is expected (numpy arrays implement the buffer
    protocol, which numpy's type stubs do not declare)."""
    return cast(bytes, array)


def _bytes_view(buf: Any) -> np.ndarray:
    array: np.ndarray = ensure_contiguous_ndarray(buf)  # numcodecs ships no types
    return array.reshape(-1).view(np.uint8)


def sign_last(data: np.ndarray, itemsize: int) -> np.ndarray:
    """Bytes of little-endian words with each word rotated left by one bit (sign to bit 0)."""
    word = np.dtype(f"<u{itemsize}")
    u = data.view(word)
    out: np.ndarray = np.left_shift(u, word.type(1))
    out |= u >> word.type(8 * itemsize - 1)
    return out.view(np.uint8)


def sign_first(data: np.ndarray, itemsize: int) -> np.ndarray:
    """Inverse of :func:`sign_last`."""
    word = np.dtype(f"<u{itemsize}")
    u = data.view(word)
    out: np.ndarray = np.right_shift(u, word.type(1))
    out |= u << word.type(8 * itemsize - 1)
    return out.view(np.uint8)


def split_planes(data: np.ndarray, itemsize: int) -> list[np.ndarray]:
    """Bytes of little-endian elements -> ``itemsize`` contiguous planes, most significant first."""
    rows = data.reshape(-1, itemsize)
    return [np.ascontiguousarray(rows[:, itemsize - 1 - i]) for i in range(itemsize)]


#: elements a plane split shifts at a time: its scratch words stay in cache and are reused
PLANE_BLOCK = 1 << 17


def byte_planes(data: np.ndarray, itemsize: int, rotate: bool) -> list[np.ndarray]:
    """``split_planes(sign_last(data) if rotate else data)``, the same planes in fewer passes.

    Why: on a 4 MiB bfloat16 chunk the strided byte copies of :func:`split_planes` and the
    chunk-sized temporaries of :func:`sign_last` took 1.4 of the chunk's 6.3 ms of encoding
    (and fresh memory is dear: every new page faults); this takes 0.5. The words are shifted a block
    of :data:`PLANE_BLOCK` at a time into one small reused buffer, and each plane's byte is
    stored by a narrowing cast (which keeps the low byte), both vectorized. Byte ``s`` (bits
    ``8s..8s+7``) of a word rotated left by one bit is byte ``s`` of the word shifted right
    by ``8s - 1``, except the lowest, which takes the sign. With numba installed one compiled
    pass does it (:mod:`._kernels`)."""
    word = np.dtype(f"<u{itemsize}")
    u = np.ascontiguousarray(data).reshape(-1).view(word)  # flat: the same planes for any shape
    planes = np.empty((itemsize, u.size), np.uint8)
    kernels = _kernels.for_bytes(u.nbytes)
    if kernels is not None and itemsize in (2, 4):  # one compiled pass (same planes)
        (kernels.planes2 if itemsize == 2 else kernels.planes4)(u, rotate, planes)
        return list(planes)
    top = word.type(8 * itemsize - 1)
    shifted = np.empty(min(u.size, PLANE_BLOCK), word)
    sign = np.empty_like(shifted) if rotate else shifted
    for start in range(0, u.size, PLANE_BLOCK):
        block = u[start:start + PLANE_BLOCK]
        out, signs = shifted[:block.size], sign[:block.size]
        for i in range(itemsize):
            shift = 8 * (itemsize - 1 - i)  # plane i is byte itemsize-1-i of the (rotated) word
            if not rotate:
                moved = np.right_shift(block, word.type(shift), out=out) if shift else block
            elif shift:
                moved = np.right_shift(block, word.type(shift - 1), out=out)
            else:
                moved = np.left_shift(block, word.type(1), out=out)
                moved |= np.right_shift(block, top, out=signs)
            planes[i, start:start + block.size] = moved  # the cast keeps the low byte
    return list(planes)


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


def _check_dtype(dtype: Any) -> str:
    if not isinstance(dtype, str) or dtype not in DTYPE_CODES:
        raise FormatError(
            f"Expected dtype one of {sorted(DTYPE_CODES)}. Got {dtype!r:.80} instead; bfloat16 "
            "arrays are passed as uint16 bit patterns with dtype 'bfloat16'."
        )
    return dtype


def _check_coder(coder: Any) -> str:
    if not isinstance(coder, str) or coder not in CODERS:
        raise FormatError(f"Expected coder one of {list(CODERS)}. Got {coder!r:.80} instead.")
    return coder


def encode_chunk(data: np.ndarray, dtype: str, level: int, coder: str, base: np.ndarray | None = None) -> bytes:
    """The encoded chunk for the flat uint8 bytes ``data`` of ``dtype`` elements (checked sizes)."""
    keyframe, delta = _encode_both(data, dtype, level, coder, base)
    return keyframe if delta is None else delta


def encode_keyframe_and_delta(data: np.ndarray, dtype: str, level: int, coder: str,
                              base: np.ndarray | None = None) -> tuple[bytes, bytes | None]:
    """(the chunk coded on its own, the chunk with a plane XORed with ``base``'s wherever
    that is strictly smaller, or None when no plane is): both from one split of the planes
    and one coding of each plane on its own, so choosing between a keyframe and a delta
    costs the XOR trials only."""
    return _encode_both(data, dtype, level, coder, base)


def _encode_both(data: np.ndarray, dtype: str, level: int, coder: str,
                 base: np.ndarray | None) -> tuple[bytes, bytes | None]:
    version = VERSION_OF_CODER[coder]
    itemsize = carrier(dtype).itemsize
    n = data.size // itemsize
    flags = FLAG_SIGN_LAST if version >= 2 and dtype in SIGN_LAST_DTYPES else 0
    planes = byte_planes(data, itemsize, rotate=bool(flags))
    base_planes: list[np.ndarray] | None = None
    if base is not None:
        base_planes = split_planes(sign_last(base, itemsize) if flags else base, itemsize)
    plain: list[tuple[int, _planes.Body]] = []  # a raw plane is joined as it is: no copy of its own
    mixed: list[tuple[int, _planes.Body]] = []
    for i, plane in enumerate(planes):
        body: _planes.Body
        if version >= 2:
            method, body = _planes.stream_body(plane, level, packable=True)
        else:
            method, body = RAW, plane
            if n:
                zstd_body = _zstd.compress(_buffer(plane), level)
                if len(zstd_body) < plane.nbytes:
                    method, body = ZSTD, zstd_body
        plain.append((method, body))
        if base_planes is not None and n:
            xored = _zstd.compress(_buffer(np.bitwise_xor(plane, base_planes[i])), level)
            if len(xored) < _planes.body_length(body):  # strictly smaller wins: ties keep the plain method
                method, body = XOR_ZSTD, xored
        mixed.append((method, body))
    checksum = xxhash.xxh3_64_intdigest(_buffer(data))

    def assemble(chosen: list[tuple[int, _planes.Body]], chunk_flags: int, base_hash: int) -> bytes:
        header = HEADER.pack(MAGIC, version, DTYPE_CODES[dtype], chunk_flags, itemsize, n, checksum, base_hash)
        table = [PLANE.pack(method, _planes.body_length(body)) for method, body in chosen]
        return _planes.join((header, *table, *(body for _, body in chosen)))

    keyframe = assemble(plain, flags, 0)
    if not any(method in (XOR_RAW, XOR_ZSTD) for method, _ in mixed):
        return keyframe, None
    assert base is not None
    return keyframe, assemble(mixed, flags | FLAG_BASE, xxhash.xxh3_64_intdigest(_buffer(base)))


class ByteGroup(Codec):  # type: ignore[misc]  # numcodecs ships no types: its Codec is Any
    """numcodecs codec; ``encode``/``decode`` take the parent version's chunk as optional ``base=``.

    Arrays of ``dtype`` bfloat16 are passed as uint16 bit patterns. ``decode`` returns a flat
    array of the element's carrier dtype (float32, float16, uint16). ``coder="zstd"`` writes
    format 1 (kept for its vectors), ``"zstd+huffman"`` format 2; both decode either.
    """

    codec_id = CODEC_ID

    def __init__(self, dtype: str = "float32", level: int = 1, coder: str = "zstd") -> None:
        self.dtype = _check_dtype(dtype)
        self.level = _check_level(level)
        self.coder = _check_coder(coder)

    @property
    def carrier(self) -> np.dtype[Any]:
        return carrier(self.dtype)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ByteGroup:
        """Build from ``get_config()`` output; an unknown key is a FormatError naming it."""
        kwargs = check_config(config, ("id", *CONFIG_KEYS), CODEC_ID)
        kwargs.pop("id", None)
        return cls(**kwargs)

    def get_config(self) -> dict[str, Any]:
        return {"id": CODEC_ID, "coder": self.coder, "dtype": self.dtype, "level": self.level}

    def __repr__(self) -> str:
        return f"ByteGroup(dtype={self.dtype!r}, level={self.level}, coder={self.coder!r})"

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
        base_data = None
        if base is not None:
            base_data = self._elements(base, "the base chunk")
            if base_data.size != data.size:
                raise FormatError(
                    f"Expected a base chunk of {data.size} bytes (same shape as the chunk). Got "
                    f"{base_data.size} instead (shape changed: encode without base=)."
                )
        return encode_chunk(data, self.dtype, self.level, self.coder, base_data)

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
    return _parse(data)[1:]


def _parse(data: np.ndarray) -> tuple[int, int, int, int, int, int, list[tuple[int, int]]]:
    """:func:`parse` with the format version first."""
    if data.size < HEADER_SIZE or bytes(data[:4]) != MAGIC:
        raise FormatError(
            f"Expected a bytegroup chunk starting with {MAGIC!r}. Got {bytes(data[:4])!r} "
            f"({data.size} bytes) instead (not a bytegroup chunk, or truncated)."
        )
    _, version, code, flags, count, n, checksum, base_hash = HEADER.unpack_from(_buffer(data))
    if version not in VERSIONS:
        raise FormatError(
            f"Expected bytegroup format version in {list(VERSIONS)}. Got {version} instead; "
            "upgrade inshrink-store."
        )
    if code not in DTYPE_NAMES:
        raise FormatError(f"Expected a dtype code in {sorted(DTYPE_NAMES)}. Got {code} instead (corrupt header).")
    if flags & ~KNOWN_FLAGS[version]:
        raise FormatError(
            f"Expected header flags within {KNOWN_FLAGS[version]} (format {version}). Got {flags} "
            "instead (corrupt header)."
        )
    itemsize = carrier(DTYPE_NAMES[code]).itemsize
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
        if method not in METHODS_OF_VERSION[version]:
            raise FormatError(
                f"Expected plane {i}'s method in {list(METHODS_OF_VERSION[version])} (format "
                f"{version}). Got {method} instead."
            )
        coder = CODER_OF_METHOD[method]
        if coder == _planes.RAW and length != n:
            raise FormatError(f"Expected raw plane {i} to hold n={n} bytes. Got a length of {length} instead.")
        if n > length * _planes.max_expansion(coder):
            raise FormatError(
                f"Expected n={n} to fit in plane {i}'s {length} stored bytes. Got a count "
                "no stream that small can hold instead (corrupt header)."
            )
        total += length
    if data.size != total:
        raise FormatError(
            f"Expected {total} bytegroup bytes (header, plane table and planes). Got {data.size} "
            "instead (truncated, trailing bytes, or a corrupt plane length)."
        )
    uses_base = any(method in (XOR_RAW, XOR_ZSTD) for method, _ in planes)
    if uses_base != bool(flags & FLAG_BASE) or (not uses_base and base_hash):
        raise FormatError(
            f"Expected the base flag ({flags & FLAG_BASE}) to say whether a plane uses the base "
            f"({int(uses_base)}) and a zero base hash without one. Got base hash {base_hash:016x} instead."
        )
    return version, code, flags, n, checksum, base_hash, planes


def _base_planes(base: Any, base_hash: int, n: int, itemsize: int, flags: int) -> list[np.ndarray]:
    base_data = _checked_base(base, base_hash, n, itemsize)
    return byte_planes(base_data, itemsize, bool(flags & FLAG_SIGN_LAST))  # split_planes(sign_last(...)), one pass


def _checked_base(base: Any, base_hash: int, n: int, itemsize: int) -> np.ndarray:
    """``base`` as flat uint8, when it is the chunk a delta was encoded against (its hash)."""
    if base is None:
        raise FormatError(
            "Expected the base chunk (base=...) this chunk was XORed with. Got None instead; pass "
            "the chunk stored at the same key in the parent version."
        )
    base_data = _bytes_view(base)
    got = xxhash.xxh3_64_intdigest(_buffer(base_data))
    if got != base_hash:
        raise IntegrityError(
            f"Expected the base chunk this chunk was encoded against (xxh3-64 {base_hash:016x}). "
            f"Got a different base ({got:016x}) instead."
        )
    if base_data.size != n * itemsize:
        raise FormatError(f"Expected a base of {n * itemsize} bytes. Got {base_data.size} instead.")
    return base_data


def _chunk_of(data: np.ndarray, dtype: str, size: int | None) -> _Chunk:
    """``data`` parsed, its dtype and (when known) its decoded ``size`` checked."""
    _, code, flags, n, checksum, base_hash, table = _parse(data)
    if DTYPE_NAMES[code] != dtype:
        raise FormatError(
            f"Expected a {dtype} chunk (the codec's dtype). Got a {DTYPE_NAMES[code]} chunk instead."
        )
    itemsize = len(table)
    if size is not None and n * itemsize != size:
        raise FormatError(
            f"Expected a chunk of {size} bytes ({size // itemsize} {dtype} elements). Got a header "
            f"saying n={n} instead."
        )
    return _Chunk(data, flags, n, checksum, base_hash, table)


@dataclass(frozen=True)
class _Chunk:
    """A parsed chunk: its header's fields and plane table, over its bytes ``data``."""

    data: np.ndarray
    flags: int
    n: int
    checksum: int
    base_hash: int
    table: list[tuple[int, int]]

    @property
    def rotated(self) -> bool:
        return bool(self.flags & FLAG_SIGN_LAST)

    def xors(self, i: int) -> bool:
        """Whether plane ``i`` is stored as the XOR with the base's plane."""
        return self.table[i][0] in (XOR_RAW, XOR_ZSTD)

    def plane(self, i: int) -> np.ndarray:
        """Plane ``i`` as stored (before any XOR with the base): flat uint8, maybe read-only."""
        offset = HEADER_SIZE + len(self.table) * PLANE_SIZE + sum(length for _, length in self.table[:i])
        method, length = self.table[i]
        body = memoryview(_buffer(self.data[offset:offset + length]))
        return _planes.decode_stream(CODER_OF_METHOD[method], body, self.n, f"plane {i}")


#: the largest chunk the ``*_to_bytes`` decoders join in a thread's scratch words (above: an array of its own)
SCRATCH_MAX = 16 << 20
_scratch = threading.local()


def _scratch_words(n: int, itemsize: int) -> np.ndarray:
    """``n`` words of ``itemsize`` bytes in this thread's scratch buffer (kept for its next
    chunk, grown as needed). Why: a fresh array for each joined chunk was fresh memory each
    time (numpy maps a 4 MiB array anew: a page fault per 4 KiB), more than the join itself;
    the caller copies the words out before this thread joins another chunk."""
    if n * itemsize > SCRATCH_MAX:
        return np.empty(n, f"<u{itemsize}")
    buffer: np.ndarray | None = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.size < n * itemsize:
        buffer = _scratch.buffer = np.empty(n * itemsize, np.uint8)
    return buffer[:n * itemsize].view(f"<u{itemsize}")


def _joined(planes: list[np.ndarray], itemsize: int, rotated: bool, scratch: bool = False) -> np.ndarray:
    """The chunk's bytes from its planes (the sign rotated back when ``rotated``): one
    compiled pass when numba is installed, else :func:`join_planes` and :func:`sign_first`;
    ``scratch``: in this thread's scratch words (:func:`_scratch_words`), copied out at once."""
    n = planes[0].size
    kernels = _kernels.for_bytes(n * itemsize)
    if kernels is not None and itemsize in (2, 4):  # one compiled pass: join and rotate back
        words = _scratch_words(n, itemsize) if scratch else np.empty(n, f"<u{itemsize}")
        (kernels.join2 if itemsize == 2 else kernels.join4)(
            *(_kernels.read_only(p) for p in planes), rotated, words)
        return words.view(np.uint8)
    out = join_planes(planes, itemsize, np.empty(n * itemsize, np.uint8))
    return sign_first(out, itemsize) if rotated else out


def _checked(out: np.ndarray, checksum: int) -> np.ndarray:
    got = xxhash.xxh3_64_intdigest(_buffer(out))
    if got != checksum:
        raise FormatError(
            f"Expected decoded data with xxh3-64 {checksum:016x}. Got {got:016x} instead (corrupt plane bytes)."
        )
    return out


def decode_bytes(data: np.ndarray, dtype: str, base: Any = None, size: int | None = None) -> np.ndarray:
    """The decoded chunk as flat uint8, checked against the header's checksum.

    ``size`` (bytes), when known, is checked against the header before anything is allocated."""
    return _decode(data, dtype, base, size, scratch=False)


def decode_to_bytes(data: np.ndarray, dtype: str, base: Any = None, size: int | None = None) -> bytes:
    """:func:`decode_bytes` as bytes (what the object store keeps), the same checks and
    errors: joined in this thread's scratch words and copied out once (issue 43, item 10)."""
    return _decode(data, dtype, base, size, scratch=True).tobytes()


def _decode(data: np.ndarray, dtype: str, base: Any, size: int | None, scratch: bool) -> np.ndarray:
    chunk = _chunk_of(data, dtype, size)
    itemsize = len(chunk.table)
    base_planes = None
    if chunk.flags & FLAG_BASE:
        base_planes = _base_planes(base, chunk.base_hash, chunk.n, itemsize, chunk.flags)
    planes: list[np.ndarray] = []
    for i in range(itemsize):
        plane = chunk.plane(i)
        if chunk.xors(i):
            assert base_planes is not None  # FLAG_BASE matches the methods (parse)
            plane = np.bitwise_xor(plane, base_planes[i])
        planes.append(plane)
    return _checked(_joined(planes, itemsize, chunk.rotated, scratch), chunk.checksum)


def decode_chain(chain: list[np.ndarray], dtype: str, base: Any = None, size: int | None = None, *,
                 checked: bool = True) -> np.ndarray:
    """The decoded last chunk of a delta chain, as flat uint8: ``chain[0]`` is a keyframe,
    or a delta over ``base`` (decoded bytes); each later chunk a delta over the one before.
    The same bytes as :func:`decode_bytes` applied link by link, each link's output the
    next one's base. A chain whose result that refuses is refused here too (a FormatError or
    an IntegrityError, not always with the same words: a caller that must name the bad link
    decodes link by link after a failure, as :meth:`ObjectStore.get` does). One difference:
    an intermediate link whose planes decode to other bytes than its checksum says is
    refused here only where the result depends on them (a plane a later link stores whole
    is never decoded), since its own bytes are never formed; the result is right either way.

    Why: a lossless chunk's delta chain is several links (up to the keyframe interval's
    eight), and link by link each one's planes were decoded, joined into words, the next
    link split them into planes again, and each link's bytes were hashed twice and copied;
    on the CLI's whole-store reads (``benchmarks/bench_cli_reads.py``) that was most of an
    export's time. Here the chain stays in byte planes: each plane is the XOR of its stored
    planes down to the nearest link that stored it whole, and only the last link's planes
    are joined. A plane is decoded only in the links the result depends on.

    What is checked: every chunk's header and plane table (:func:`parse`), its dtype and
    size; that each delta's base is the chunk below it (the base hash it records equals the
    checksum that chunk records, and ``base``'s own hash for the first); and the result
    against the last chunk's checksum. An intermediate link's decoded bytes are not hashed
    (they are never joined): the result's checksum is what says the chain decoded right.
    ``checked=False`` leaves that last hash to a caller that checks the result itself by a
    stronger one (:meth:`ObjectStore.get` compares its xxh3-128 with the object's id and
    decodes link by link on a mismatch): hashing the same bytes twice was 2 % of an
    ``export --all`` (issue 43, item 10)."""
    return _decode_chain(chain, dtype, base, size, checked, scratch=False)


def decode_chain_to_bytes(chain: list[np.ndarray], dtype: str, base: Any = None, size: int | None = None, *, checked: bool = True) -> bytes:
    """:func:`decode_chain` as bytes (what the object store keeps), the same checks and
    errors: joined in this thread's scratch words and copied out once (issue 43, item 10)."""
    return _decode_chain(chain, dtype, base, size, checked, scratch=True).tobytes()


def _decode_chain(chain: list[np.ndarray], dtype: str, base: Any, size: int | None, checked: bool, scratch: bool) -> np.ndarray:
    if not chain:
        raise FormatError("Expected at least one chunk in a delta chain. Got none instead.")
    chunks = [_chunk_of(data, dtype, size) for data in chain]
    itemsize, n = len(chunks[0].table), chunks[0].n
    for below, above in zip(chunks, chunks[1:], strict=False):
        if above.n != n or not above.flags & FLAG_BASE or above.base_hash != below.checksum:
            raise IntegrityError(
                f"Expected each chunk of a delta chain to be a delta of {n} elements over the chunk "
                f"below it (base xxh3-64 {below.checksum:016x}). Got a chunk of {above.n} elements "
                f"{'over base ' + format(above.base_hash, '016x') if above.flags & FLAG_BASE else 'stored whole'} instead."
            )
    # which planes each link decodes: all of the last link's, and below a link those it XORs
    # (a link storing a plane whole ends that plane's dependence on the links below it)
    needed: list[set[int]] = []
    wanted = set(range(itemsize))
    for k in range(len(chunks) - 1, -1, -1):
        needed.append(wanted)
        wanted = {i for i in wanted if chunks[k].xors(i)}
        if k and wanted and chunks[k - 1].rotated != chunks[k].rotated:
            wanted = set(range(itemsize))  # the planes below are joined and split again
    needed.reverse()
    first = chunks[0]
    planes: list[np.ndarray | None] = [None] * itemsize
    owned = [False] * itemsize  # whether planes[i] is this call's own writable array
    if first.flags & FLAG_BASE:
        base_data = _checked_base(base, first.base_hash, n, itemsize)
        if wanted:  # the planes the first link XORs: the base split once (fresh arrays)
            planes, owned = list(byte_planes(base_data, itemsize, first.rotated)), [True] * itemsize
    for k, chunk in enumerate(chunks):
        if k and chunk.rotated != chunks[k - 1].rotated and needed[k - 1]:
            # a chunk with the sign where the one below had it not (or the reverse): the
            # planes below are joined and split again (a store writes one layout per dtype)
            joined = _joined([p for p in planes if p is not None], itemsize, chunks[k - 1].rotated)
            planes, owned = list(byte_planes(joined, itemsize, chunk.rotated)), [True] * itemsize
        for i in sorted(needed[k]):
            plane = chunk.plane(i)
            current = planes[i]
            if not chunk.xors(i):
                planes[i], owned[i] = plane, False
            elif current is None:  # pragma: no cover - the needed sets put every base plane here
                raise FormatError(f"Expected plane {i}'s base in the delta chain. Got none instead.")
            elif owned[i]:
                np.bitwise_xor(current, plane, out=current)
            else:
                planes[i], owned[i] = np.bitwise_xor(current, plane), True
    last = chunks[-1]
    out = _joined([p for p in planes if p is not None], itemsize, last.rotated, scratch)
    return _checked(out, last.checksum) if checked else out


register_codec(ByteGroup)


# -- zarr v3 front end -------------------------------------------------------------------


@dataclass(frozen=True)
class ByteGroupZarrCodec(BytesBytesCodec):
    """zarr v3 ``BytesBytesCodec`` named ``inshrink.bytegroup``, placed after zarr's ``bytes``
    codec (little-endian). ``dtype`` names the element type (``"bfloat16"`` for uint16 arrays
    of bfloat16 bits) and must match the array's dtype. Chunks are coded on worker threads
    (``asyncio.to_thread``, as zarr's own Blosc codec does), so zarr's ``async.concurrency``
    chunks of one array are encoded at once; each chunk's bytes do not depend on that."""

    is_fixed_size = False

    dtype: str
    level: int = 1
    coder: str = "zstd+huffman"

    def __init__(self, *, dtype: Any, level: Any = 1, coder: Any = "zstd+huffman") -> None:
        object.__setattr__(self, "dtype", _check_dtype(dtype))
        object.__setattr__(self, "level", _check_level(level))
        object.__setattr__(self, "coder", _check_coder(coder))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ByteGroupZarrCodec:
        """Build from zarr.json; a missing dtype or an unknown key is a FormatError naming it."""
        config = named_configuration(data, CODEC_ID)
        kwargs = check_config(config, CONFIG_KEYS, CODEC_ID)
        if "dtype" not in kwargs:
            raise FormatError(
                f"Expected a dtype ({list(ELEMENT_DTYPES)}) in the {CODEC_ID} configuration. Got none instead."
            )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {"name": CODEC_ID, "configuration": {"coder": self.coder, "dtype": self.dtype, "level": self.level}}

    def validate(self, *, shape: Any, dtype: Any, chunk_grid: Any) -> None:
        native = np.dtype(dtype.to_native_dtype())
        if native.newbyteorder("<") != carrier(self.dtype):
            raise FormatError(
                f"Expected a {carrier(self.dtype).name} array for {CODEC_ID} with dtype "
                f"{self.dtype!r}. Got a {native} array instead; set the codec's dtype to the "
                "array's element type (bfloat16 bits are a uint16 array with dtype 'bfloat16')."
            )

    def encode_bytes(self, data: np.ndarray) -> bytes:
        """The stored form of one chunk from its bytes (flat uint8, little-endian elements in
        C order): what zarr's pipeline stores through :meth:`_encode_sync`, and what the
        writer's direct path (:mod:`inshrink_store.writer`) stores without zarr's pipeline."""
        if data.size % carrier(self.dtype).itemsize:
            raise FormatError(
                f"Expected whole {self.dtype} elements in a chunk. Got {data.size} bytes instead."
            )
        return encode_chunk(data, self.dtype, self.level, self.coder)

    def _encode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        data = chunk_bytes.as_numpy_array().reshape(-1).view(np.uint8)
        return chunk_spec.prototype.buffer.from_bytes(self.encode_bytes(data))

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        size = math.prod(chunk_spec.shape) * carrier(self.dtype).itemsize
        data = chunk_bytes.as_numpy_array().reshape(-1).view(np.uint8)
        return chunk_spec.prototype.buffer.from_array_like(decode_bytes(data, self.dtype, size=size))

    async def _encode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer | None:
        return await asyncio.to_thread(self._encode_sync, chunk_bytes, chunk_spec)

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)

    def compute_encoded_size(self, input_byte_length: int, chunk_spec: ArraySpec) -> int:
        raise NotImplementedError("inshrink.bytegroup chunks are variable-size")


register_zarr_codec(CODEC_ID, ByteGroupZarrCodec)

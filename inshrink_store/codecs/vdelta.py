"""``inshrink.vdelta``: reorder-aware delta of level ids against the previous version's payload.
Layer: codecs, storage and structure (siblings, none importing another), above the helpers.

Why: between two checkpoints most quantized weights keep their level id, so
``D = (prev - curr) mod B`` is mostly 0 and entropy-codes to almost nothing. B is the
larger level count of the two payloads; ids are compared as plain integers in
``0..B-1`` whatever they mean (the protected id is ``B - 1`` of *each* payload), which
is exact and invertible: ``curr = (prev - D) mod B``.

The deltas are regrouped by each element's *previous* id (a stable sort the decoder
repeats from the base it already holds, so the permutation costs nothing to store):
stable bins become long zero runs that migrations in busy bins no longer break. The
regrouped stream is one zstd frame (group lengths are implied by the base; measured
against per-group frames and the paper's RLE + Huffman in
``benchmarks/bench_entropy_coders.py``); the current protected values follow whole.
The header carries the base's level count and xxh3-64, so decoding against the wrong
base is an :class:`IntegrityError`, never silently wrong ids.
Byte layout and change log: ``codecs/inshrink.vdelta/README.md``.

The id arithmetic (:func:`delta_stream`, :func:`apply_stream`) takes numpy or CuPy ids
(:mod:`inshrink_store.codecs._xp`): modular uint8/uint16 arithmetic and a stable argsort
(CuPy's is a stable radix sort) give the same symbols on a device; the codec itself, which
the store runs on payload bytes, works on the host.
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

from inshrink_store.codecs import _payload, _zstd
from inshrink_store.codecs._xp import array_namespace
from inshrink_store.errors import FormatError, IntegrityError


def _buffer(array: np.ndarray) -> bytes:
    """``array`` where a bytes-like object is expected: numpy arrays implement the buffer
    protocol (no copy), which numpy's type stubs do not declare."""
    return cast(bytes, array)


CODEC_ID = "inshrink.vdelta"
MAGIC = b"IVD\x01"
VERSION = 1
# magic, version, flags, coder, protected dtype, n, B_cur, B_base, xxh3(base), P, Z
HEADER = struct.Struct("<4sBBBBQIIQQQ")
HEADER_SIZE = HEADER.size  # 48
FLAG_REGROUP = 1
KNOWN_FLAGS = FLAG_REGROUP
CODERS = {"zstd": 1}
KEEP_DELTA_BELOW = 0.8  # a delta must be under 80 % of the zstd'd whole payload


def worth_delta(delta_len: int, whole_len: int) -> bool:
    """The store's "clearly smaller" rule: keep a delta only below 80 % of the keyframe."""
    return delta_len < KEEP_DELTA_BELOW * whole_len


def delta_dtype(levels: int) -> np.dtype:
    """Deltas lie in ``0..B-1``: one byte while B <= 256, two above."""
    return np.dtype("<u1") if levels <= 256 else np.dtype("<u2")


def mod_sub(a: Any, b: Any, levels: int) -> Any:
    """``(a - b) mod levels`` for values already in ``0..levels-1``, without widening.

    The subtraction wraps modulo 2**bits; adding ``levels`` (mod 2**bits) where
    ``a < b`` turns that into the residue modulo ``levels``.
    """
    dt = delta_dtype(levels)
    xp = array_namespace(a, b)
    a, b = a.astype(dt, copy=False), b.astype(dt, copy=False)
    out = xp.subtract(a, b)
    # levels (mod 2**bits) where a < b, as a product rather than ``add(..., where=)``: CuPy
    # ufuncs take no ``where``, and numpy's masked loop is ~15x slower than the product
    out += xp.multiply(a < b, dt.type(levels % (1 << (8 * dt.itemsize))), dtype=dt)
    return out


def group_order(prev_ids: Any) -> Any:
    """Stable permutation grouping elements by previous id (a radix sort for small ints in
    numpy; CuPy's argsort is a stable radix sort too, so the permutation is the same)."""
    return array_namespace(prev_ids).argsort(prev_ids, kind="stable")


def regroup(deltas: Any, prev_ids: Any) -> Any:
    """Permute deltas into previous-id order; an all-zero stream needs no permutation."""
    return deltas[group_order(prev_ids)] if deltas.any() else deltas


def ungroup(stream: Any, prev_ids: Any) -> Any:
    """Inverse of :func:`regroup`, computed from the same base ids."""
    if not stream.any():
        return stream
    out = array_namespace(stream).empty_like(stream)
    out[group_order(prev_ids)] = stream
    return out


def delta_stream(prev_ids: Any, cur_ids: Any, levels: int, grouped: bool) -> Any:
    """The symbols the entropy coder sees (everything of encode except the coder)."""
    d = mod_sub(prev_ids, cur_ids, levels)
    return regroup(d, prev_ids) if grouped else d


def apply_stream(prev_ids: Any, stream: Any, levels: int, grouped: bool) -> Any:
    """Inverse of :func:`delta_stream`: the current ids, in the delta dtype of ``levels``."""
    d = ungroup(stream, prev_ids) if grouped else stream
    return mod_sub(prev_ids, d, levels)


def _bytes_view(buf: Any) -> np.ndarray:
    array: np.ndarray = ensure_contiguous_ndarray(buf)  # numcodecs ships no types
    return array.reshape(-1).view(np.uint8)


def _require_base(base: Any, action: str) -> np.ndarray:
    if base is None:
        raise FormatError(
            f"Expected the base payload (base=...) to {action}. Got None instead; pass the "
            "payload stored at the same chunk key in the parent version."
        )
    return _bytes_view(base)


class VDelta(Codec):  # type: ignore[misc]  # numcodecs ships no types: its Codec is Any
    """numcodecs codec whose ``encode``/``decode`` take the base payload as ``base=``."""

    codec_id = CODEC_ID

    def __init__(self, level: int = 3, regroup: bool = True, coder: str = "zstd") -> None:
        if not isinstance(coder, str) or coder not in CODERS:
            raise FormatError(f"Expected coder one of {sorted(CODERS)}. Got {coder!r:.80} instead.")
        if isinstance(level, bool) or not isinstance(level, int | np.integer) or not 1 <= level <= 22:
            raise FormatError(f"Expected a zstd level (an integer) in 1..22. Got {level!r:.80} instead.")
        if not isinstance(regroup, bool | np.bool_):
            raise FormatError(f"Expected regroup to be true or false. Got {regroup!r:.80} instead.")
        self.level = int(level)
        self.regroup = bool(regroup)
        self.coder = coder

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VDelta:
        """Build from ``get_config()`` output; an unknown key is a FormatError naming it."""
        if not isinstance(config, dict):
            raise FormatError(f"Expected the {CODEC_ID} configuration to be a dict. Got {config!r:.80} instead.")
        unknown = [k for k in config if k not in ("id", "coder", "level", "regroup")]
        if unknown:
            raise FormatError(
                f"Expected only the keys ['id', 'coder', 'level', 'regroup'] in the {CODEC_ID} "
                f"configuration. Got the unknown key {unknown[0]!r:.80} instead; remove it (or "
                "upgrade inshrink-store if a newer version wrote it)."
            )
        return cls(**{k: v for k, v in config.items() if k != "id"})

    def get_config(self) -> dict[str, Any]:
        return {"id": CODEC_ID, "coder": self.coder, "level": self.level, "regroup": self.regroup}

    def __repr__(self) -> str:
        return f"VDelta(level={self.level}, regroup={self.regroup}, coder={self.coder!r})"

    def encode(self, buf: Any, base: Any = None) -> bytes:
        """Delta-encode payload ``buf`` against payload ``base`` (equal element counts)."""
        base_view = _require_base(base, "delta-encode against")
        cur, prev = _payload.unpack(_bytes_view(buf)), _payload.unpack(base_view)
        if cur.count != prev.count:
            raise FormatError(
                f"Expected the current and base payloads to have equal element counts. "
                f"Got {cur.count} and {prev.count} instead (shape changed: store a keyframe)."
            )
        levels = max(cur.levels, prev.levels)
        stream = delta_stream(prev.ids, cur.ids, levels, self.regroup)
        body = zstandard.ZstdCompressor(level=self.level).compress(_buffer(stream))
        header = HEADER.pack(
            MAGIC, VERSION, FLAG_REGROUP if self.regroup else 0, CODERS[self.coder],
            _payload.PROTECTED_CODES[cur.protected_dtype], cur.count, cur.levels, prev.levels,
            xxhash.xxh3_64_intdigest(_buffer(base_view)), int(cur.protected.size), len(body),
        )
        return b"".join((header, body, cur.protected.tobytes()))

    def decode(self, buf: Any, base: Any = None, out: Any = None) -> Any:
        """Rebuild the exact current payload from the delta ``buf`` and payload ``base``."""
        payload = _decode(_bytes_view(buf), _require_base(base, "decode the delta against"))
        if out is None:
            return payload
        dest = _bytes_view(out)
        if dest.size != len(payload):
            raise FormatError(
                f"Expected an out buffer of {len(payload)} bytes. Got {dest.size} instead."
            )
        dest[:] = np.frombuffer(payload, np.uint8)
        return out


def _parse_header(data: np.ndarray) -> tuple[int, ...]:
    if data.size < HEADER_SIZE or bytes(data[:4]) != MAGIC:
        raise FormatError(
            f"Expected a vdelta stream starting with {MAGIC!r}. Got {bytes(data[:4])!r} "
            f"({data.size} bytes) instead (not a delta, or truncated)."
        )
    (_, version, flags, coder, pcode, n, b_cur, b_base, base_hash, n_prot, zlen) = HEADER.unpack_from(_buffer(data))
    if version != VERSION:
        raise FormatError(
            f"Expected vdelta format version {VERSION}. Got {version} instead; upgrade inshrink-store."
        )
    if flags & ~KNOWN_FLAGS or coder not in CODERS.values() or pcode not in _payload.PROTECTED_DTYPES:
        raise FormatError(
            f"Expected flags within {KNOWN_FLAGS}, coder in {sorted(CODERS.values())} and protected "
            f"dtype code 0 or 1. Got flags {flags}, coder {coder}, dtype code {pcode} instead "
            "(corrupt header, or written by a newer inshrink-store)."
        )
    _payload.id_width_for(b_cur)  # 1..65535, else FormatError
    return flags, pcode, n, b_cur, b_base, base_hash, n_prot, zlen


def _decompress(body: np.ndarray, n: int, dtype: np.dtype) -> np.ndarray:
    """The n deltas; ``n`` was already checked against the base, a real payload, and the
    frame is decompressed in bounded steps (a declared content size is never trusted)."""
    size = n * dtype.itemsize
    raw = _zstd.decompress(memoryview(_buffer(body)), size, "the vdelta stream's zstd frame of deltas")
    if len(raw) != size:
        raise FormatError(f"Expected {size} bytes of deltas. Got {len(raw)} instead.")
    return np.frombuffer(raw, dtype=dtype)


def _decode(data: np.ndarray, base: np.ndarray) -> bytes:
    flags, pcode, n, b_cur, b_base, base_hash, n_prot, zlen = _parse_header(data)
    if xxhash.xxh3_64_intdigest(_buffer(base)) != base_hash:
        raise IntegrityError(
            "Expected the base payload this delta was made against (xxh3-64 "
            f"{base_hash:016x}). Got a different base ({xxhash.xxh3_64_intdigest(_buffer(base)):016x}) "
            "instead; resolve the delta chain from the object the header names."
        )
    prev = _payload.unpack(base)
    if prev.count != n or prev.levels != b_base:
        raise FormatError(
            f"Expected a base of {n} ids and {b_base} levels. Got {prev.count} and {prev.levels} instead."
        )
    pname = _payload.PROTECTED_DTYPES[pcode]
    psize = n_prot * _payload.PROTECTED_ITEMSIZE[pname]
    if data.size != HEADER_SIZE + zlen + psize:
        raise FormatError(
            f"Expected {HEADER_SIZE + zlen + psize} vdelta bytes. Got {data.size} instead "
            "(truncated or trailing bytes)."
        )
    levels = max(b_cur, b_base)
    stream = _decompress(data[HEADER_SIZE:HEADER_SIZE + zlen], n, delta_dtype(levels))
    if n and int(stream.max()) >= levels:
        raise FormatError(f"Expected deltas below B={levels}. Got {int(stream.max())} instead.")
    ids = apply_stream(prev.ids, stream, levels, bool(flags & FLAG_REGROUP))
    if n and int(ids.max()) >= b_cur:
        raise FormatError(f"Expected ids below B={b_cur} after the delta. Got {int(ids.max())} instead.")
    if n_prot != int(np.count_nonzero(ids == b_cur - 1)):
        raise FormatError(
            f"Expected {n_prot} protected ids (id {b_cur - 1}) as the header says. "
            f"Got {int(np.count_nonzero(ids == b_cur - 1))} instead."
        )
    prot = data[HEADER_SIZE + zlen:].view(_payload.protected_word(pname))
    return _payload.pack(b_cur, ids, pname, prot)


register_codec(VDelta)

"""``inshrink.vdelta``: reorder-aware delta of level ids against the previous version's payload.

``D = (prev - curr) mod B`` with B the larger level count of the two payloads (the
protected id counts as a level), so unchanged elements give 0. The deltas are then
regrouped by each element's *previous* level id (a stable counting sort the decoder
repeats from the base it already has, so the permutation costs nothing to store):
stable bins become long zero runs that migrations in busy bins no longer break.
The regrouped stream is entropy-coded with zstd; the current protected values follow
whole. The header carries a hash of the base, so decoding against the wrong base is
an error, never silently wrong ids. Spec: ``codecs/inshrink.vdelta/README.md``.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import xxhash
import zstandard
from numcodecs.abc import Codec
from numcodecs.compat import ensure_bytes
from numcodecs.registry import register_codec

from inshrink_store.codecs import _payload
from inshrink_store.errors import FormatError, IntegrityError

CODEC_ID = "inshrink.vdelta"
MAGIC = b"IVD\x01"
VERSION = 1
HEADER = struct.Struct("<4sBBBBQIIQQQ")  # magic ver flags coder pcode n Bcur Bbase basehash nprot zlen
HEADER_SIZE = HEADER.size
FLAG_REGROUP = 1
CODER_NONE, CODER_ZSTD = 0, 1
KEEP_DELTA_BELOW = 0.8  # a delta must be at most 80 % of the whole compressed payload


def worth_delta(delta_len: int, whole_len: int) -> bool:
    """The store's "clearly smaller" rule for writing a delta instead of a keyframe."""
    return delta_len < KEEP_DELTA_BELOW * whole_len


def _delta_dtype(levels: int) -> np.dtype:
    return np.dtype("<u1") if levels <= 256 else np.dtype("<u2")


def group_order(prev_ids: np.ndarray) -> np.ndarray:
    """Stable permutation grouping elements by previous id (numpy's radix sort for ints)."""
    return np.argsort(prev_ids, kind="stable")


class VDelta(Codec):
    """numcodecs codec whose ``encode``/``decode`` take the base payload as ``base=``."""

    codec_id = CODEC_ID

    def __init__(self, level: int = 3, regroup: bool = True) -> None:
        self.level = int(level)
        self.regroup = bool(regroup)

    def get_config(self) -> dict[str, Any]:
        return {"id": CODEC_ID, "level": self.level, "regroup": self.regroup}

    def __repr__(self) -> str:
        return f"VDelta(level={self.level}, regroup={self.regroup})"

    def encode(self, buf: Any, base: Any = None) -> bytes:
        if base is None:
            raise FormatError("Expected the base payload (base=...) to delta-encode against. Got None.")
        cur, prev = _payload.unpack(buf), _payload.unpack(base)
        if cur.count != prev.count:
            raise FormatError(
                f"Expected the current and base payloads to have equal element counts. "
                f"Got {cur.count} and {prev.count} instead (shape changed: store a keyframe)."
            )
        levels = max(cur.levels, prev.levels)
        d = (prev.ids.astype(np.int32) - cur.ids.astype(np.int32)) % levels
        d = d.astype(_delta_dtype(levels))
        if self.regroup and d.size:
            d = d[group_order(prev.ids)]
        body = zstandard.ZstdCompressor(level=self.level).compress(d.tobytes())
        base_bytes = ensure_bytes(base) if not isinstance(base, bytes) else base
        header = HEADER.pack(
            MAGIC, VERSION, FLAG_REGROUP if self.regroup else 0, CODER_ZSTD,
            _payload.PROTECTED_CODES[cur.protected_dtype], cur.count, cur.levels, prev.levels,
            xxhash.xxh3_64_intdigest(base_bytes), int(cur.protected.size), len(body),
        )
        return header + body + cur.protected.tobytes()

    def decode(self, buf: Any, base: Any = None, out: Any = None) -> bytes:
        if base is None:
            raise FormatError("Expected the base payload (base=...) to decode the delta against. Got None.")
        data = ensure_bytes(buf)
        base_bytes = ensure_bytes(base)
        if len(data) < HEADER_SIZE or data[:4] != MAGIC:
            raise FormatError(f"Expected a vdelta stream starting with {MAGIC!r}. Got {data[:4]!r} "
                              f"({len(data)} bytes) instead.")
        (_, version, flags, coder, pcode, n, b_cur, b_base, base_hash, n_prot, zlen) = HEADER.unpack_from(data)
        if version != VERSION or coder != CODER_ZSTD or pcode not in _payload.PROTECTED_DTYPES:
            raise FormatError(f"Expected vdelta version {VERSION} with zstd. Got version {version}, coder {coder}.")
        if xxhash.xxh3_64_intdigest(base_bytes) != base_hash:
            raise IntegrityError("Expected the base payload this delta was made against. Got a different base.")
        prev = _payload.unpack(base_bytes)
        if prev.count != n or prev.levels != b_base:
            raise FormatError(f"Expected a base of {n} ids and {b_base} levels. Got {prev.count} and {prev.levels}.")
        pname = _payload.PROTECTED_DTYPES[pcode]
        psize = n_prot * _payload.PROTECTED_ITEMSIZE[pname]
        if len(data) != HEADER_SIZE + zlen + psize:
            raise FormatError(f"Expected {HEADER_SIZE + zlen + psize} vdelta bytes. Got {len(data)} (truncated?).")
        levels = max(b_cur, b_base)
        ddt = _delta_dtype(levels)
        try:
            raw = zstandard.ZstdDecompressor().decompress(data[HEADER_SIZE:HEADER_SIZE + zlen],
                                                          max_output_size=n * ddt.itemsize)
        except zstandard.ZstdError as exc:
            raise FormatError(f"Expected a valid zstd delta stream. Got: {exc}") from exc
        if len(raw) != n * ddt.itemsize:
            raise FormatError(f"Expected {n} deltas. Got {len(raw) // ddt.itemsize} instead.")
        d = np.frombuffer(raw, dtype=ddt)
        if flags & FLAG_REGROUP and n:
            ungrouped = np.empty_like(d)
            ungrouped[group_order(prev.ids)] = d
            d = ungrouped
        ids = (prev.ids.astype(np.int32) - d.astype(np.int32)) % levels
        if n and int(ids.max()) >= b_cur:
            raise FormatError(f"Expected ids below {b_cur} after applying the delta. Got {int(ids.max())}.")
        pdt = "<u2" if pname == "bfloat16" else "<f4"
        prot = np.frombuffer(data, dtype=pdt, count=n_prot, offset=HEADER_SIZE + zlen)
        return _payload.pack(b_cur, ids, pname, prot)


register_codec(VDelta)

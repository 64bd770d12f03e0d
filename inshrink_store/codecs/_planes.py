"""How one byte plane of ``inshrink.bytegroup`` is stored: the stream coders and their choice.
Layer: codecs, storage and structure (siblings, none importing another), above the helpers.

Why more than zstd: the plane holding a float's exponent takes a few dozen byte values
with a skewed, non-repeating distribution. zstd's fast levels spend bits on short
spurious matches there (about 5 % above a Huffman code), while its good levels are 100x
slower. A Huffman-only deflate stream (``zlib``, strategy ``Z_HUFFMAN_ONLY``) codes it at
Huffman cost and about 150 MB/s. Better still, *packing* replaces each byte by its rank
in a small table (1, 2 or 4 bits) and packs 8, 4 or 2 ranks per byte: a Huffman code of
the packed bytes then codes pairs of exponents, which captures some of the correlation
between neighbouring weights and wastes less on integer code lengths (about 6 % below
plain Huffman on a pretrained CNN). Bytes outside the table are *escapes*, stored apart.
Packing with 1 bit is also how a plane holding two values (a sign bit alone, or a
weight stored with fewer mantissa bits) costs one bit per element.

Every coder is single-threaded with fixed settings, so the output depends on the input
(and the zstd level) only. Decoding bounds every size by the stored bytes before it
allocates. Layout: ``codecs/inshrink.bytegroup/README.md``.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from typing import Any, cast

import numpy as np

from inshrink_store.codecs import _kernels, _zstd
from inshrink_store.errors import FormatError

#: stream coders (also the plane methods of the same value)
RAW, ZSTD, HUFFMAN, PACKED = 0, 1, 4, 5
STREAM_CODERS = (RAW, ZSTD, HUFFMAN)
#: deflate's largest expansion (zlib's documented 1032:1)
DEFLATE_MAX_EXPANSION = 1032
#: largest expansion of a packed plane: 8 ranks per byte, that byte stream zstd'd
PACKED_MAX_EXPANSION = 8 * _zstd.MAX_EXPANSION
#: try Huffman only when the order-0 entropy promises at least this fraction of the input
HUFFMAN_WORTH = 0.97
#: on a skewed plane, Huffman is tried only when zstd's trial misses the order-0 bound by
#: more than this fraction (Huffman cannot beat the bound; zstd level 1 is ~8x faster)
HUFFMAN_GAIN = 0.02
#: pack when the 15 commonest values cover at least this fraction of the plane
PACK_COVERAGE = 0.99
# packed body: rank bits, table size K, packed-stream coder, its stored length,
# escape coder, escape count, escapes' stored length; then the K table bytes and the streams
PACKED_HEADER = struct.Struct("<BBBQBQQ")
#: bytes of a plane that decide its coders (a sample for the histogram, the head for zstd's
#: trial), and the slack zstd's trial may lose to an order-0 code
SAMPLE = 1 << 16
ZSTD_SLACK = 64
RANK_BITS = (1, 2, 4)
#: planes smaller than this try every coder that can win (Huffman costs ~0.1 ms there); from
#: here to a trial's size, zstd on the whole plane is the trial that decides Huffman (on a
#: 128 KiB plane Huffman costs 0.9 ms, 3x zstd)
TRY_ALL_BELOW = 1 << 14
#: zstd is not tried on a packable plane whose first bytes pack this much smaller than
#: zstd codes them (:func:`_packing_wins`)
PACK_MARGIN = 0.03
#: inputs from this many bytes up are looked up by byte pairs (the pair table costs ~10 us)
PAIR_LOOKUP_MIN = 1 << 14
_DEFLATE = (1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)  # level, raw deflate, memLevel 9


def _buffer(array: np.ndarray) -> bytes:
    return cast(bytes, array)  # numpy arrays implement the buffer protocol


def huffman(data: np.ndarray) -> bytes:
    """A raw deflate stream of ``data`` coded with Huffman codes only (no matches)."""
    deflate = zlib.compressobj(*_DEFLATE)
    return deflate.compress(_buffer(data)) + deflate.flush()


def inflate(body: bytes | memoryview, size: int, what: str) -> bytes:
    """The content of the raw deflate stream ``body``, which must be exactly ``size`` bytes."""
    inflater = zlib.decompressobj(-15)
    try:
        out = inflater.decompress(body, size + 1)
    except zlib.error as exc:
        raise FormatError(f"Expected {what} to be a raw deflate stream. Got {exc} instead.") from None
    if len(out) != size or not inflater.eof or inflater.unused_data or inflater.unconsumed_tail:
        raise FormatError(
            f"Expected {what} to be one deflate stream of exactly {size} bytes. Got "
            f"{len(out)}{'+' if len(out) > size else ''} bytes (stream {'ended' if inflater.eof else 'unfinished'}, "
            f"{len(inflater.unused_data) + len(inflater.unconsumed_tail)} bytes left over) instead."
        )
    return out


def entropy_bytes(hist: np.ndarray) -> float:
    """Order-0 entropy of a byte histogram, in bytes: what no Huffman code of it beats."""
    total = int(hist.sum())
    if not total:
        return 0.0
    p = hist[hist > 0] / total
    return float(-(p * np.log2(p)).sum() * total / 8)


def sample(data: np.ndarray) -> np.ndarray:
    """Every k-th byte, about :data:`SAMPLE` of them: what the coder choices are made on."""
    return data[:: max(1, data.size // SAMPLE)]


def byte_histogram(data: np.ndarray) -> np.ndarray:
    """How often each byte value occurs in the uint8 array ``data`` (256 int64 counts):
    ``np.bincount``, or one compiled pass when numba is installed (:mod:`._kernels`)."""
    kernels = _kernels.for_bytes(data.size)
    if kernels is not None:
        return cast(np.ndarray, kernels.histogram(data))
    return np.bincount(data, minlength=256)


def _zstd_trial(data: np.ndarray, level: int) -> tuple[int, float] | None:
    """zstd's size on the first :data:`SAMPLE` bytes of ``data`` and their order-0 bound
    (what a Huffman code of them cannot beat); None for a small ``data``, where every coder
    is simply tried."""
    if data.size <= 2 * SAMPLE:
        return None
    head = data[:SAMPLE]
    coded = len(_zstd.compress(_buffer(head), level))
    return coded, entropy_bytes(byte_histogram(head))


def _packing_wins(data: np.ndarray, hist: np.ndarray, level: int, zstd_head: int) -> bool:
    """Whether packing the first :data:`SAMPLE` bytes of ``data`` gives at most
    ``1 - PACK_MARGIN`` of ``zstd_head`` (zstd's size on them, the trial's): then zstd is
    not tried on the whole plane.

    Why: on an exponent plane whose zstd trial comes near the order-0 bound, zstd was tried
    on the whole plane (a 4 MiB bfloat16 chunk: 5 ms, 1.5x the rest of its encoding) and lost
    to packing (pairs of ranks beat an order-0 code) by 7-8 %. The head decides it for 0.1 ms."""
    return len(pack(data[:SAMPLE], hist, level)) <= (1 - PACK_MARGIN) * zstd_head


#: a stream's stored bytes as :func:`stream_body` gives them: a raw stream is the plane itself
Body = bytes | np.ndarray


def body_length(body: Body) -> int:
    """Bytes in a :data:`Body` (a raw body is a flat uint8 array)."""
    return body.nbytes if isinstance(body, np.ndarray) else len(body)


def join(parts: Iterable[Body]) -> bytes:
    """The parts one after the other (arrays implement the buffer protocol ``bytes.join``
    takes, which numpy's type stubs do not declare)."""
    return b"".join(cast(Iterable[bytes], parts))


def encode_stream(data: np.ndarray, level: int, packable: bool = False) -> tuple[int, bytes]:
    """(coder, stored bytes) of :func:`stream_body`, the body always as ``bytes``."""
    coder, body = stream_body(data, level, packable)
    return coder, body if isinstance(body, bytes) else body.tobytes()


def stream_body(data: np.ndarray, level: int, packable: bool = False) -> tuple[int, Body]:
    """(coder, stored bytes): the smallest of raw, zstd, Huffman and (when ``packable``) packed,
    ties keeping the earlier. A histogram of a sample and zstd's trial on the first bytes
    decide which coders can win, so a plane costs a sample, a 64 KiB trial and the coders
    that can win:

    - zstd where its trial beats an order-0 code (runs, zeros, repeated rows), or comes
      within :data:`HUFFMAN_GAIN` of the order-0 bound on a skewed plane (Huffman could win
      at most that much there, at an eighth of zstd's speed), unless the plane packs and its
      head packs clearly smaller than zstd codes it (:func:`_packing_wins`);
    - packing or Huffman on skewed planes (Huffman only where zstd's trial is further off);
    - raw always (near-random planes: the low mantissa bytes).

    A plane too small for a trial tries every coder that can win below
    :data:`TRY_ALL_BELOW` bytes; from there, zstd on the whole plane is its trial.

    A raw body is ``data`` itself (a flat uint8 array), not a copy: the callers join the
    bodies into their output, and copying a plane no coder shrank (the low mantissa bytes)
    or one a coder then beat cost a pass over it and fresh memory for nothing."""
    data = np.ascontiguousarray(data).reshape(-1)
    best: tuple[int, Body] = (RAW, data)
    if not data.size:
        return best
    seen = sample(data)
    hist = byte_histogram(seen)
    top = np.sort(hist)[::-1]
    skewed = bool(top[1]) and entropy_bytes(hist) < HUFFMAN_WORTH * seen.size  # and not constant
    packs = skewed and packable and top[:15].sum() >= PACK_COVERAGE * seen.size
    trial = _zstd_trial(data, level)
    candidates: list[tuple[int, Any]] = []
    if trial is None and skewed and not packs and data.size >= TRY_ALL_BELOW:
        # a mid-sized skewed plane: zstd on all of it is its own trial, and decides Huffman
        # as the trial decides it on a large plane (the sample's entropy scaled to the plane)
        whole = _zstd.compress(_buffer(data), level)
        candidates.append((ZSTD, lambda: whole))
        trial = (len(whole), entropy_bytes(hist) * data.size / seen.size)
    near_bound = trial is not None and skewed and trial[0] <= (1 + HUFFMAN_GAIN) * trial[1] + ZSTD_SLACK
    zstd_can_win = trial is None or trial[0] < trial[1] + ZSTD_SLACK or near_bound
    packing_wins = packs and trial is not None and zstd_can_win and _packing_wins(data, hist, level, trial[0])
    if not candidates and zstd_can_win and not packing_wins:
        candidates.append((ZSTD, lambda: _zstd.compress(_buffer(data), level)))
    if skewed:
        if packs:
            candidates.append((PACKED, lambda: pack(data, hist, level)))
        elif not near_bound:
            candidates.append((HUFFMAN, lambda: huffman(data)))
    for coder, make in candidates:
        body = make()
        if len(body) < body_length(best[1]):
            best = (coder, body)
    return best


def decode_stream(coder: int, body: bytes | memoryview, size: int, level_what: str) -> np.ndarray:
    """The ``size`` bytes that ``encode_stream`` stored as ``body`` with ``coder`` (flat uint8)."""
    if coder == RAW:
        if len(body) != size:
            raise FormatError(f"Expected raw {level_what} of {size} bytes. Got {len(body)} instead.")
        return np.frombuffer(body, np.uint8)
    if coder == ZSTD:
        raw = _zstd.decompress(body, size, f"{level_what}'s zstd frame")
    elif coder == HUFFMAN:
        raw = inflate(body, size, f"{level_what}'s deflate stream")
    elif coder == PACKED:
        return unpack(body, size, level_what)
    else:
        raise FormatError(f"Expected a coder in {[*STREAM_CODERS, PACKED]} for {level_what}. Got {coder} instead.")
    if len(raw) != size:
        raise FormatError(f"Expected {level_what} to decode to {size} bytes. Got {len(raw)} instead.")
    return np.frombuffer(raw, np.uint8)


def max_expansion(coder: int) -> int:
    """How many bytes one stored byte of a stream of ``coder`` can decode to at most."""
    return {RAW: 1, ZSTD: _zstd.MAX_EXPANSION, HUFFMAN: DEFLATE_MAX_EXPANSION,
            PACKED: PACKED_MAX_EXPANSION}[coder]


# -- packing ---------------------------------------------------------------------------


def _word(bits: int) -> np.dtype[Any]:
    """The little-endian word holding the ``8 // bits`` ranks that share one packed byte."""
    return np.dtype(f"<u{8 // bits}")


def pack_ranks(ranks: np.ndarray, bits: int) -> np.ndarray:
    """Ranks (< 2**bits) -> bytes holding ``8 // bits`` of them, the first in the lowest bits."""
    if bits == 1:
        return np.packbits(ranks, bitorder="little")
    per = 8 // bits
    if ranks.size % per:
        padded = np.zeros(-(-ranks.size // per) * per, np.uint8)
        padded[: ranks.size] = ranks
        ranks = padded
    word = _word(bits)
    words = ranks.view(word)  # rank j of a group sits at bit 8j of its word
    mask = (1 << bits) - 1
    packed: np.ndarray = words & word.type(mask)
    moved = np.empty_like(words)  # one buffer for every rank moved down (no temporaries)
    for j in range(1, per):
        np.right_shift(words, word.type(j * (8 - bits)), out=moved)
        moved &= word.type(mask << (j * bits))
        packed |= moved
    return packed.astype(np.uint8)


def unpack_ranks(packed: np.ndarray, bits: int, size: int) -> np.ndarray:
    """Inverse of :func:`pack_ranks`: the first ``size`` ranks."""
    per = 8 // bits
    wide = packed.astype(_word(bits))
    words = np.zeros(packed.size, _word(bits))
    mask = (1 << bits) - 1
    for j in range(per):
        words |= (wide << (j * (8 - bits))) & (mask << (8 * j))
    return words.view(np.uint8)[:size]


def _sample_table(hist: np.ndarray) -> tuple[int, np.ndarray, int]:
    """(bits, table, distinct values) the sample histogram ``hist`` gives: its commonest
    values, commonest first (ties by value), as many as the fewest bits that hold them allow."""
    distinct = int(np.count_nonzero(hist))
    bits = next(b for b in RANK_BITS if distinct <= 1 << b or b == RANK_BITS[-1])
    table = np.argsort(-hist, kind="stable")[: min(distinct, 1 << bits)].astype(np.uint8)
    return bits, table, distinct


def _rank_of(table: np.ndarray) -> np.ndarray:
    """256 bytes: each table value's rank, every other value the escape's (``table.size``)."""
    rank_of = np.full(256, table.size, np.uint8)
    rank_of[table] = np.arange(table.size, dtype=np.uint8)
    return rank_of


def _ranks(data: np.ndarray, hist: np.ndarray) -> tuple[int, np.ndarray, np.ndarray, np.ndarray | None]:
    """(bits, table, ranks, escaped mask or None): the commonest values of ``hist`` (a
    sample's) get ranks in table order (commonest first, ties by value); values outside the
    table take rank len(table), the escape. Bits are the fewest that hold the ranks (and the
    escape when there are escapes)."""
    bits, table, _ = _sample_table(hist)
    ranks = lookup(_rank_of(table), data)
    while True:
        # no rank exceeds the escape's (table.size), so the largest says whether any value
        # escaped: a reduction, where the mask is a fresh array the size of the plane
        if int(ranks.max(initial=0)) < table.size:
            return bits, table, ranks, None
        if table.size < 1 << bits:
            return bits, table, ranks, ranks == table.size
        if bits < RANK_BITS[-1]:  # no rank left for the escape: widen (the ranks stay valid)
            bits = RANK_BITS[RANK_BITS.index(bits) + 1]
        else:  # or drop the rarest value: it becomes an escape, whose rank is its own
            table = table[:-1]
            np.minimum(ranks, table.size, out=ranks)


def lookup(table: np.ndarray, data: np.ndarray) -> np.ndarray:
    """``table[data]`` for a 256-entry uint8 ``table``: on large inputs through a 65,536-entry
    table of byte pairs, about 2.5x faster than a lookup per byte (same result). The pair
    table is an outer OR of the table with itself shifted (one vectorized pass), and the
    pairs are looked up straight into the output (``mode="wrap"``: every uint16 is an index
    of the table, so no mode changes a value, and wrap skips the bounds checks)."""
    data = np.ascontiguousarray(data).reshape(-1)
    if data.size < PAIR_LOOKUP_MIN:
        return np.take(table, data)
    bytes16 = table.astype("<u2")
    wide = ((bytes16 << 8)[:, None] | bytes16).reshape(-1)  # wide[hi*256 + lo] = table[lo] | table[hi] << 8
    even = data.size & ~1
    out = np.empty(data.size, np.uint8)
    np.take(wide, data[:even].view("<u2"), out=out[:even].view("<u2"), mode="wrap")
    out[even:] = np.take(table, data[even:])
    return out


def _pair_table(rank_of: np.ndarray, bits: int) -> np.ndarray:
    """65,536 bytes: entry ``hi * 256 + lo`` is ``rank_of[lo] | rank_of[hi] << bits``, the two
    ranks of a byte pair packed as :func:`pack_ranks` packs them (first in the lowest bits)."""
    wide = rank_of.astype("<u2")
    pairs: np.ndarray = (wide << bits)[:, None] | wide
    return pairs.reshape(-1).astype(np.uint8)


def _packed_by_pairs(data: np.ndarray, bits: int, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(packed ranks, escapes) for ``bits`` 2 or 4 and a ``table`` with a rank left for the
    escape: the same bytes as ranking, packing and masking element by element, in a third of
    the passes over the plane.

    Why: the exponent plane of every float chunk is packed, and ranking it byte by byte, then
    packing, then masking the escapes took a quarter of a bfloat16 chunk's encoding. Here one
    lookup of each byte *pair* (a 65,536-entry table) gives the two ranks already packed; the
    escapes (rare: values outside the table) are found from the packed pairs, and only the
    pairs holding one are read again."""
    k = table.size
    rank_of = _rank_of(table)
    kernels = _kernels.for_bytes(data.size)
    if kernels is not None:
        return _packed_compiled(kernels, data, bits, rank_of, k)
    n = data.size
    even = n & ~1
    pairs = np.empty(-(-n // 2), np.uint8)
    np.take(_pair_table(rank_of, bits), data[:even].view("<u2"), out=pairs[: even // 2], mode="wrap")
    if n & 1:
        pairs[-1] = rank_of[data[-1]]  # the last element alone, its partner's rank 0 (padding)
    mask = np.uint8((1 << bits) - 1)
    holds_escape = (pairs & mask) == k
    holds_escape |= (pairs >> np.uint8(bits)) == k  # the padding's rank 0 is never the escape's (k >= 1)
    at = np.flatnonzero(holds_escape)
    escapes = np.zeros(0, np.uint8)
    if at.size:
        positions = np.empty((at.size, 2), np.intp)
        positions[:, 0] = 2 * at
        positions[:, 1] = 2 * at + 1
        flat = positions.reshape(-1)
        flat = flat[flat < n]  # the padding of an odd plane holds no element
        values = data[flat]
        escapes = values[rank_of[values] == k]  # in element order, as the mask gives them
    if bits == 4:
        return pairs, escapes
    if pairs.size & 1:  # bits 2: two pairs of ranks to a byte
        pairs = np.append(pairs, np.uint8(0))
    return pairs[0::2] | (pairs[1::2] << np.uint8(4)), escapes


def _packed_compiled(kernels: Any, data: np.ndarray, bits: int, rank_of: np.ndarray,
                     k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_packed_by_pairs` in one compiled pass (the same bytes): the pair table's
    entries carry 256 where a pair holds an escape, so the pass finds them as it packs."""
    pair_table = _pair_table(rank_of, bits).astype(np.uint16)
    escaped = rank_of == k
    pair_table |= ((escaped[:, None] | escaped).reshape(-1).astype(np.uint16) << 8)
    pairs = -(-data.size // 2)
    packed = np.empty(pairs if bits == 4 else -(-pairs // 2), np.uint8)
    escapes = np.empty(data.size, np.uint8)
    found = kernels.pack_pairs(data, pair_table, rank_of, k, bits, packed, escapes)
    return packed, escapes[:found].copy()


def _packed(data: np.ndarray, hist: np.ndarray) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(bits, table, packed ranks, escapes): :func:`_ranks` and :func:`pack_ranks`, through
    :func:`_packed_by_pairs` wherever the table the sample gives is final (same bytes).

    The same bytes when ``hist`` is a sample of ``data`` (as for every stored plane): a
    sample with more than 16 values then proves that values outside the top 16 occur. For
    the head of a plane judged with the whole plane's histogram (:func:`_packing_wins`)
    the two may pick different tables; that only moves the estimate, never stored bytes."""
    bits, table, distinct = _sample_table(hist)
    if distinct > table.size:
        # more values in the sample than 16 ranks: values outside the table are certain, so
        # (as _ranks decides after a pass) the rarest of the 16 leaves the table for the escape
        table = table[:-1]
    if bits in (2, 4) and table.size < 1 << bits and data.size >= PAIR_LOOKUP_MIN:
        packed, escapes = _packed_by_pairs(data, bits, table)
        return bits, table, packed, escapes
    # small planes, one bit, or a full table (whether it must widen is known after a pass)
    kernels = _kernels.for_bytes(data.size)
    if kernels is not None and table.size == 1 << bits:
        # a full table packs as it is unless a value outside it occurs (then _ranks widens)
        packed = np.empty(-(-data.size // (8 // bits)), np.uint8)
        if kernels.pack_whole(data, _rank_of(table), table.size, bits, packed):
            return bits, table, packed, np.zeros(0, np.uint8)
    bits, table, ranks, escaped = _ranks(data, hist)
    escapes = data[escaped] if escaped is not None else np.zeros(0, np.uint8)
    return bits, table, pack_ranks(ranks, bits), escapes


def pack(data: np.ndarray, hist: np.ndarray, level: int) -> bytes:
    """The packed form of ``data``: ranks of its commonest values (per the sample histogram
    ``hist``), ``8 // bits`` to a byte (first element in the lowest bits), the other values
    as escapes in order. The packed ranks and the escapes are each coded raw, zstd or
    Huffman, so the bytes depend on the data only."""
    bits, table, packed, escapes = _packed(data, hist)
    p_coder, p_body = stream_body(packed, level)
    e_coder, e_body = stream_body(escapes, level)
    head = PACKED_HEADER.pack(bits, table.size, p_coder, body_length(p_body), e_coder, escapes.size,
                              body_length(e_body))
    return join((head, table.tobytes(), p_body, e_body))


def _byte_values(table: np.ndarray, k: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(values, flagged) for the 256 packed bytes: the ``8 // bits`` values a byte's ranks
    stand for (table[rank], first in the lowest byte of a word), and whether a rank in it
    is ``k`` or more (an escape: that byte is decoded rank by rank)."""
    per = 8 // bits
    word = np.dtype(f"<u{per}")
    byte = np.arange(256)
    ranks = [(byte >> (t * bits)) & ((1 << bits) - 1) for t in range(per)]
    values = np.zeros(256, word)
    flagged = np.zeros(256, np.bool_)
    for t, rank in enumerate(ranks):
        values |= table[rank].astype(word) << word.type(8 * t)  # rank < 16 = table.size
        flagged |= rank >= k
    return _kernels.read_only(values), _kernels.read_only(flagged)


def unpack(body: bytes | memoryview, size: int, what: str) -> np.ndarray:
    """Inverse of :func:`pack` for a plane of ``size`` bytes, every length checked first."""
    view = memoryview(body)
    if len(view) < PACKED_HEADER.size:
        raise FormatError(f"Expected {what}'s packed header ({PACKED_HEADER.size} bytes). Got {len(view)} bytes instead.")
    bits, k, p_coder, p_len, e_coder, n_esc, e_len = PACKED_HEADER.unpack_from(view)
    if bits not in RANK_BITS or not 1 <= k <= 1 << bits:
        raise FormatError(f"Expected {what} packed with 1, 2 or 4 bits and 1..2**bits table values. "
                          f"Got {bits} bits and {k} values instead.")
    if p_coder not in STREAM_CODERS or e_coder not in STREAM_CODERS or n_esc > size:
        raise FormatError(f"Expected {what}'s packed and escape coders in {list(STREAM_CODERS)} and "
                          f"at most {size} escapes. Got coders {p_coder}, {e_coder} and {n_esc} escapes instead.")
    start = PACKED_HEADER.size + k
    if len(view) != start + p_len + e_len:
        raise FormatError(f"Expected {what}'s packed body to be {start + p_len + e_len} bytes (header, "
                          f"table, streams). Got {len(view)} instead.")
    packed_size = -(-size // (8 // bits))
    if p_len * max_expansion(p_coder) < packed_size or e_len * max_expansion(e_coder) < n_esc:
        raise FormatError(f"Expected {what}'s streams ({p_len} and {e_len} bytes) to be able to hold "
                          f"{packed_size} packed bytes and {n_esc} escapes. Got too few bytes instead.")
    table = np.zeros(16, np.uint8)
    table[:k] = np.frombuffer(view[PACKED_HEADER.size:start], np.uint8)
    packed = decode_stream(p_coder, view[start:start + p_len], packed_size, f"{what}'s packed stream")
    escapes = decode_stream(e_coder, view[start + p_len:], n_esc, f"{what}'s escapes")
    kernels = _kernels.for_bytes(size)
    if kernels is not None:  # one compiled pass: a byte's ranks to its values, escapes in place
        wide, flagged = _byte_values(table, k, bits)
        out = np.empty(-(-size // (8 // bits)) * (8 // bits), np.uint8)  # whole words: a view per byte
        found = kernels.unpack_values(_kernels.read_only(packed), wide, flagged, bits, _kernels.read_only(table),
                                      k, _kernels.read_only(escapes), out.view(wide.dtype), out[:size])
        out = out[:size]
        if found != n_esc:
            raise FormatError(f"Expected {n_esc} escaped elements in {what}. Got {found} instead.")
        return out
    ranks = unpack_ranks(packed, bits, size)
    escaped = ranks >= k
    if int(np.count_nonzero(escaped)) != n_esc:
        raise FormatError(f"Expected {n_esc} escaped elements in {what}. Got {int(np.count_nonzero(escaped))} instead.")
    full = np.zeros(256, np.uint8)
    full[:16] = table
    out = lookup(full, ranks)
    out[escaped] = escapes
    return out

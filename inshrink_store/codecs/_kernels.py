"""Compiled loops for the lossless float codec's hot passes, when numba is installed.
Layer: codecs, storage and structure (siblings, none importing another), above the helpers.

Why: a lossless float chunk is split into byte planes, each plane's bytes are counted
(a sample, then a trial's head), and the exponent plane is packed into ranks. In numpy
each is several passes over the chunk with fresh temporaries, and ``np.bincount`` runs
at about a byte per nanosecond (it widens every byte to a 64-bit index first); on a
bfloat16 chunk those passes were over half of the encoding. Each loop here is one pass.
Decoding is the same story backwards: ranks back to values (a packed byte at a time) and
the planes joined into words with the sign rotated back, 2.4x faster on float32 chunks.

They compute exactly what the numpy code beside their callers computes (same planes,
same counts, same packed bytes and escapes), so the stored bytes never depend on whether
numba is installed; ``tests/test_codecs/test_kernels.py`` checks each loop against
that code on random inputs, and whole chunks encoded both ways. numba stays optional
(``pip install inshrink-store[fast]``): without it, with ``INSHRINK_KERNELS=numpy`` in the
environment, with numba's ``NUMBA_DISABLE_JIT`` set (the loops would then run as plain
Python, slowly and with numpy's uint8 arithmetic), or where a loop fails to compile, the
numpy code runs. Every loop is compiled (or loaded from numba's cache, beside this file or
in its user cache) when the loops are first asked for: the first process after an install
pays ~1 s, later ones ~0.3 s, once.

The loops release the GIL (``nogil``): the writer's encoder threads run them side by side.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

_log = logging.getLogger(__name__)
#: ``INSHRINK_KERNELS=numpy`` turns the compiled loops off (A/B timings, a numba problem)
ENV = "INSHRINK_KERNELS"
#: inputs below this many bytes take the numpy code: a process that only ever codes small
#: tensors (tests, the CLI on a toy model) never imports numba, whose import and loading
#: cost ~0.3 s once per process (what a 4 MiB chunk's numpy passes cost 20 times over)
KERNEL_MIN = 1 << 16


class CompiledLoops:
    """One set of loops, compiled on first use by ``build`` (or None for good: numba
    missing, refusing this numpy, failing to compile), turned off by ``INSHRINK_KERNELS=numpy``.
    The lossless codec's loops here and the quantized path's (``_quant_loops``) share it."""

    def __init__(self, build: Callable[[], SimpleNamespace], fallback: str) -> None:
        self._compile, self._fallback = build, fallback
        self._loaded: SimpleNamespace | None = None
        self._tried = False
        self._lock = threading.Lock()

    def active(self) -> SimpleNamespace | None:
        """The compiled loops, or None when numba is missing, fails to import or to compile
        them, or is turned off (here or by ``NUMBA_DISABLE_JIT``)."""
        if os.environ.get(ENV, "").strip().lower() == "numpy":
            return None
        if not self._tried:
            with self._lock:
                if not self._tried:
                    try:
                        self._loaded = self._compile()
                    except Exception as exc:  # numba refuses some numpy versions at import
                        _log.info("numba unavailable (%s: %s); %s", type(exc).__name__,
                                  str(exc).splitlines()[0] if str(exc) else "", self._fallback)
                        self._loaded = None
                    self._tried = True
        return self._loaded

    def for_bytes(self, size: int) -> SimpleNamespace | None:
        """:meth:`active` for an input of ``size`` bytes, None below :data:`KERNEL_MIN`."""
        return self.active() if size >= KERNEL_MIN else None


def active() -> SimpleNamespace | None:
    """The lossless codec's compiled loops (see :class:`CompiledLoops`)."""
    return _LOOPS.active()


def for_bytes(size: int) -> SimpleNamespace | None:
    """:func:`active` for an input of ``size`` bytes, None below :data:`KERNEL_MIN`."""
    return active() if size >= KERNEL_MIN else None


def _jit(function: Any) -> Any:
    """``function`` compiled on its first call, its machine code cached on disk where numba
    finds a writable place for it (beside this file, else its user cache), else not cached."""
    from numba import njit

    try:
        return njit(nogil=True, cache=True, boundscheck=False)(function)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return njit(nogil=True, boundscheck=False)(function)


def _compile() -> SimpleNamespace:
    """The loops, each compiled (or loaded from numba's cache) here by :func:`_warm`."""
    import numba  # the ImportError (numba missing or refusing this numpy) is here

    if getattr(numba.config, "DISABLE_JIT", False):
        raise ImportError("NUMBA_DISABLE_JIT is set: the loops would run as plain Python")
    jit = _jit

    @jit
    def histogram(data: Any) -> Any:  # pragma: no cover - compiled
        # four counters per value: a run of one value (an exponent plane is mostly a few)
        # would otherwise wait on the same counter's previous increment at every byte
        lanes = np.zeros((4, 256), np.int64)
        n = data.size
        quads = n - n % 4
        for i in range(0, quads, 4):
            lanes[0, data[i]] += 1
            lanes[1, data[i + 1]] += 1
            lanes[2, data[i + 2]] += 1
            lanes[3, data[i + 3]] += 1
        for i in range(quads, n):
            lanes[0, data[i]] += 1
        out = np.empty(256, np.int64)
        for b in range(256):
            out[b] = lanes[0, b] + lanes[1, b] + lanes[2, b] + lanes[3, b]
        return out

    @jit
    def planes2(words: Any, rotate: bool, out: Any) -> None:  # pragma: no cover - compiled
        if rotate:
            for i in range(words.size):
                w = words[i]
                out[0, i] = (w >> 7) & 0xFF
                out[1, i] = ((w << 1) | (w >> 15)) & 0xFF
        else:
            for i in range(words.size):
                w = words[i]
                out[0, i] = w >> 8
                out[1, i] = w & 0xFF

    @jit
    def planes4(words: Any, rotate: bool, out: Any) -> None:  # pragma: no cover - compiled
        if rotate:
            for i in range(words.size):
                w = words[i]
                out[0, i] = (w >> 23) & 0xFF
                out[1, i] = (w >> 15) & 0xFF
                out[2, i] = (w >> 7) & 0xFF
                out[3, i] = ((w << 1) | (w >> 31)) & 0xFF
        else:
            for i in range(words.size):
                w = words[i]
                out[0, i] = w >> 24
                out[1, i] = (w >> 16) & 0xFF
                out[2, i] = (w >> 8) & 0xFF
                out[3, i] = w & 0xFF

    @jit
    def pack_pairs(data: Any, pair_table: Any, rank_of: Any, k: int, bits: int, packed: Any,
                   escapes: Any) -> int:  # pragma: no cover - compiled
        # pair_table[hi * 256 + lo]: the two ranks packed (first in the lowest bits), plus 256
        # when either is the escape's (k); two pairs to a byte for 2 bits. The escaped values
        # are kept in element order; returns how many.
        found = 0
        n = data.size
        full = n // 2
        for p in range(full):
            a = data[2 * p]
            b = data[2 * p + 1]
            entry = pair_table[np.intp(a) | (np.intp(b) << 8)]
            if entry > 0xFF:  # rare: a value outside the table
                if rank_of[a] == k:
                    escapes[found] = a
                    found += 1
                if rank_of[b] == k:
                    escapes[found] = b
                    found += 1
            if bits == 4:
                packed[p] = entry & 0xFF
            elif p & 1:
                packed[p >> 1] |= (entry & 0xFF) << 4
            else:
                packed[p >> 1] = entry & 0xFF
        if n & 1:  # the last of an odd plane, its partner's rank 0 (padding)
            a = data[n - 1]
            pair = rank_of[a]
            if pair == k:
                escapes[found] = a
                found += 1
            if bits == 4:
                packed[full] = pair
            elif full & 1:
                packed[full >> 1] |= pair << 4
            else:
                packed[full >> 1] = pair
        return found

    @jit
    def pack_whole(data: Any, rank_of: Any, k: int, bits: int, packed: Any) -> bool:  # pragma: no cover
        # every value's rank, 8 // bits to a byte (first in the lowest bits, zero padding);
        # False where a value ranks k (outside the table): the caller then takes the numpy
        # path, which widens the ranks or drops the rarest value. A full table has k ==
        # 2**bits, so a rank is k exactly where it has a bit at or above ``bits``: the ranks
        # are OR-ed together and checked once at the end (no branch in the loop). Each width
        # is written out with constant shifts: a loop over the ranks of a byte was 3x slower.
        per = 8 // bits
        n = data.size
        whole = n // per
        seen = 0
        if per == 8:
            for j in range(whole):
                at = 8 * j
                r0 = rank_of[data[at]]
                r1 = rank_of[data[at + 1]]
                r2 = rank_of[data[at + 2]]
                r3 = rank_of[data[at + 3]]
                r4 = rank_of[data[at + 4]]
                r5 = rank_of[data[at + 5]]
                r6 = rank_of[data[at + 6]]
                r7 = rank_of[data[at + 7]]
                seen |= r0 | r1 | r2 | r3 | r4 | r5 | r6 | r7
                packed[j] = r0 | (r1 << 1) | (r2 << 2) | (r3 << 3) | (r4 << 4) | (r5 << 5) | (r6 << 6) | (r7 << 7)
        elif per == 4:
            for j in range(whole):
                at = 4 * j
                r0 = rank_of[data[at]]
                r1 = rank_of[data[at + 1]]
                r2 = rank_of[data[at + 2]]
                r3 = rank_of[data[at + 3]]
                seen |= r0 | r1 | r2 | r3
                packed[j] = r0 | (r1 << 2) | (r2 << 4) | (r3 << 6)
        else:
            for j in range(whole):
                at = 2 * j
                r0 = rank_of[data[at]]
                r1 = rank_of[data[at + 1]]
                seen |= r0 | r1
                packed[j] = r0 | (r1 << 4)
        if whole * per < n:
            last = 0
            for i in range(n - whole * per):
                r = rank_of[data[whole * per + i]]
                seen |= r
                last |= r << (i * bits)
            packed[whole] = last
        return (seen >> bits) == 0

    @jit
    def join2(p0: Any, p1: Any, rotate: bool, out: Any) -> None:  # pragma: no cover - compiled
        # the inverse of planes2: words from their high and low planes, rotated back
        if rotate:
            for i in range(out.size):
                r = (np.uint32(p0[i]) << 8) | np.uint32(p1[i])
                out[i] = (r >> 1) | ((r & 1) << 15)
        else:
            for i in range(out.size):
                out[i] = (np.uint32(p0[i]) << 8) | np.uint32(p1[i])

    @jit
    def join4(p0: Any, p1: Any, p2: Any, p3: Any, rotate: bool, out: Any) -> None:  # pragma: no cover
        # the inverse of planes4
        if rotate:
            for i in range(out.size):
                r = ((np.uint64(p0[i]) << 24) | (np.uint64(p1[i]) << 16) | (np.uint64(p2[i]) << 8)
                     | np.uint64(p3[i]))
                out[i] = (r >> 1) | ((r & 1) << 31)
        else:
            for i in range(out.size):
                out[i] = ((np.uint64(p0[i]) << 24) | (np.uint64(p1[i]) << 16) | (np.uint64(p2[i]) << 8)
                          | np.uint64(p3[i]))

    @jit
    def unpack_values(packed: Any, wide: Any, flagged: Any, bits: int, table: Any, k: int, escapes: Any,
                      words: Any, out: Any) -> int:  # pragma: no cover - compiled
        # the inverse of packing. Byte j of ``packed`` holds the ranks of elements j * per ..
        # (first in the lowest bits); ``wide[b]`` is the word of their values for a byte b
        # with no escape rank (``words`` views ``out`` a word per packed byte), and a
        # ``flagged`` byte is decoded rank by rank: table[rank], or the next escape where the
        # rank is k or more. Returns how many ranks were escapes; escapes are read only while
        # there are some left (more escape ranks than escapes is the caller's error).
        per = 8 // bits
        mask = (1 << bits) - 1
        found = 0
        left = escapes.size
        n = out.size
        whole = n // per
        for j in range(whole + (1 if n % per else 0)):
            byte = packed[j]
            if j < whole and not flagged[byte]:
                words[j] = wide[byte]
                continue
            for t in range(min(per, n - j * per)):
                rank = (np.intp(byte) >> (t * bits)) & mask
                if rank < k:
                    out[j * per + t] = table[rank]
                else:
                    if found < left:
                        out[j * per + t] = escapes[found]
                    found += 1
        return found

    loops = SimpleNamespace(histogram=histogram, planes2=planes2, planes4=planes4, pack_pairs=pack_pairs,
                            pack_whole=pack_whole, join2=join2, join4=join4, unpack_values=unpack_values)
    _warm(loops)
    return loops


def _warm(loops: SimpleNamespace) -> None:
    """Call every loop once on a few bytes of each array layout the codec passes, so each
    compiles here, where a failure means "no loops", not a failed save."""
    data = np.arange(64, dtype=np.uint8)
    loops.histogram(data)
    loops.histogram(data[::3])  # a plane's strided sample
    frozen = data.copy()
    frozen.flags.writeable = False  # a chunk read from a bytes payload (np.frombuffer) is read-only
    for words in (data, frozen):
        loops.planes2(words.view(np.uint16), True, np.empty((2, 32), np.uint8))
        loops.planes4(words.view(np.uint32), True, np.empty((4, 16), np.uint8))
        loops.histogram(words)
    rank_of = np.full(256, 3, np.uint8)
    rank_of[:3] = np.arange(3, dtype=np.uint8)
    pair_table = np.zeros(1 << 16, np.uint16)
    loops.pack_pairs(data, pair_table, rank_of, 3, 2, np.empty(16, np.uint8), np.empty(64, np.uint8))
    loops.pack_whole(data, rank_of, 4, 2, np.empty(16, np.uint8))
    # decoding: every input is passed read-only (see read_only), the outputs are fresh
    loops.join2(frozen, frozen, True, np.empty(64, np.uint16))
    loops.join4(frozen, frozen, frozen, frozen, True, np.empty(64, np.uint32))
    for bits, word in ((1, np.uint64), (2, np.uint32), (4, np.uint16)):
        out = np.empty(64, np.uint8)
        loops.unpack_values(frozen, read_only(np.zeros(256, word)), read_only(np.zeros(256, np.bool_)), bits,
                            frozen[:16], 3, frozen, out.view(word), out)


def read_only(array: np.ndarray) -> np.ndarray:
    """A read-only, contiguous view of ``array``: what the decoding loops are compiled for
    (numba compiles a version per writable/read-only mix of its arguments; decoded planes
    come both ways, from zstd's output and from a frame's raw bytes)."""
    view = np.ascontiguousarray(array).view()
    view.flags.writeable = False
    return view


#: the lossless codec's loops (module functions, so ``_compile`` is defined above)
_LOOPS = CompiledLoops(lambda: _compile(), "the lossless codec runs its numpy passes")

"""Compiled loops for the quantized path's hot passes (decoding, sketch counts), when numba
is installed.
Layer: codecs, storage and structure (siblings, none importing another), above the helpers.

Why: a quantized save sketches every tensor (a code per element from table lookups, then a
bincount, which numpy runs at about a byte per nanosecond), a search sketches each tensor's
rest under every protect / prune it looks at, and a restore turns every id back into a
value (numpy: two passes of checks, a ``take``, a comparison and a boolean scatter). Each
loop here is one pass, with no temporaries: sketches 2.4x and decoding 3.9x faster on a
32.5 M-parameter save (``python benchmarks/bench_stages.py``). Finding each element's
nearest centre stays numpy's: its compare-and-add passes over cache-sized blocks run at
SIMD speed, twice as fast as a compiled loop per element.

Every loop computes exactly what the numpy code beside its caller computes (integer counts,
table lookups and copies: nothing is summed in floating point), so the stored bytes never
depend on whether numba is installed; ``tests/test_codecs/test_quant_loops.py`` checks each
loop against that code. As with :mod:`inshrink_store.codecs._kernels` (whose switches these
loops share: ``INSHRINK_KERNELS=numpy``, ``NUMBA_DISABLE_JIT``, inputs under
:data:`~inshrink_store.codecs._kernels.KERNEL_MIN` bytes), without numba the numpy code runs.
The loops release the GIL: the writer's threads run them side by side.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from inshrink_store.codecs._kernels import CompiledLoops, _jit


def active() -> SimpleNamespace | None:
    """The compiled loops, or None (numba missing, failing, or turned off)."""
    return _LOOPS.active()


def for_bytes(size: int) -> SimpleNamespace | None:
    """:func:`active` for an input of ``size`` bytes, None below ``KERNEL_MIN``."""
    return _LOOPS.for_bytes(size)


def _compile() -> SimpleNamespace:
    import numba  # the ImportError (numba missing or refusing this numpy) is here

    if getattr(numba.config, "DISABLE_JIT", False):
        raise ImportError("NUMBA_DISABLE_JIT is set: the loops would run as plain Python")
    jit = _jit
    global _CODE_OF
    # a module global, not a closure cell: numba keys its on-disk cache by the closure's
    # contents, and a captured dispatcher pickles differently in every process, so the two
    # sketch loops were compiled afresh (1 CPU-s) and a new cache file added at every start
    _CODE_OF = jit(_code_of)

    @jit
    def id_stats(ids: Any, protected_id: int) -> Any:  # pragma: no cover - compiled
        # (largest id, how many ids equal protected_id): a payload's two checks in one pass
        top = np.intp(0)
        count = 0
        for i in range(ids.size):
            v = np.intp(ids[i])
            if v > top:
                top = v
            if v == protected_id:
                count += 1
        return top, count

    @jit
    def decode_ids(ids: Any, table: Any, protected_id: int, protected: Any, out: Any) -> int:  # pragma: no cover
        # out[i] = table[ids[i]], the protected id taking the next protected value in order;
        # returns how many protected ids were met (the caller checked them against the header)
        k = 0
        for i in range(ids.size):
            v = np.intp(ids[i])
            if v == protected_id:
                if k < protected.size:
                    out[i] = protected[k]
                k += 1
            else:
                out[i] = table[v]
        return k

    @jit
    def sketch_codes(bits: Any, code: Any, last: Any, span: int, shift: int, out: Any) -> None:  # pragma: no cover
        for i in range(bits.size):
            out[i] = _CODE_OF(bits[i], code, last, span, shift)

    @jit
    def sketch_counts(bits: Any, code: Any, last: Any, span: int, shift: int, mask: Any, masked: bool,
                      total: Any) -> None:  # pragma: no cover - compiled
        # total += bincount of the codes of bits (masked out: code 0), without the codes
        for i in range(bits.size):
            if masked and not mask[i]:
                total[0] += 1
                continue
            total[_CODE_OF(bits[i], code, last, span, shift)] += 1

    @jit
    def code_counts(codes: Any, mask: Any, masked: bool, total: Any) -> None:  # pragma: no cover - compiled
        # total += bincount(codes * mask): masked out counts as code 0
        for i in range(codes.size):
            if masked and not mask[i]:
                total[0] += 1
            else:
                total[codes[i]] += 1

    loops = SimpleNamespace(id_stats=id_stats, decode_ids=decode_ids,
                            sketch_codes=sketch_codes, sketch_counts=sketch_counts, code_counts=code_counts)
    _warm(loops)
    return loops


def _code_of(b: Any, code: Any, last: Any, span: int, shift: int) -> Any:  # pragma: no cover - compiled
    """One float32's sketch code (policy/sketch.py ``_f32_codes``) from its bit pattern;
    compiled by :func:`_compile` into ``_CODE_OF``, which the sketch loops call."""
    mag = b & 0x7FFFFFFF
    row = mag >> shift
    c = code[row]
    if mag > last[row]:
        c += 1
    if b < 0:
        c += span
    return c


#: :func:`_code_of` compiled (set by :func:`_compile`; the sketch loops read it as a global)
_CODE_OF: Any = None


def _warm(loops: SimpleNamespace) -> None:
    """Call each loop once with the array types the callers pass, so each compiles here,
    where a failure means "no loops", not a failed save."""
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    for id_type in (np.uint8, np.uint16):
        ids = read_only(np.arange(64, dtype=id_type) % 16)
        loops.id_stats(ids, 15)
        for carrier in (np.uint32, np.uint16):  # values travel as their bit patterns
            table = read_only(np.zeros(16, carrier))
            loops.decode_ids(ids, table, 15, read_only(np.zeros(4, carrier)), np.empty(64, carrier))
    code, last = read_only(np.zeros(1 << 15, np.int32)), read_only(np.zeros(1 << 15, np.int32))
    bits = x.view(np.int32)
    mask = np.ones(64, bool)
    loops.sketch_counts(bits, code, last, 8, 16, mask, True, np.zeros(16, np.int64))
    for small in (np.int16, np.int32):
        codes = np.zeros(64, small)
        loops.sketch_codes(bits, code, last, 8, 16, codes)
        loops.code_counts(codes, mask, True, np.zeros(16, np.int64))


def read_only(array: np.ndarray) -> np.ndarray:
    """A read-only contiguous view: the loops are compiled for read-only inputs (numba
    compiles one version per writable/read-only mix of its arguments)."""
    view = np.ascontiguousarray(array).view()
    view.flags.writeable = False
    return view


_LOOPS = CompiledLoops(lambda: _compile(), "the quantized path runs its numpy passes")

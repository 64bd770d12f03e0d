"""Log-space quantile sketch (DDSketch style) over weights: thresholds and k-means input.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

Keys are ``ceil(log_gamma |x|)`` with ``gamma = (1 + alpha) / (1 - alpha)``; every value in
bucket ``i`` lies in ``(gamma^(i-1), gamma^i]`` and is within relative error ``alpha`` of
the bucket's representative ``2 gamma^i / (gamma + 1)``. Positive and negative values
have separate stores and zeros are counted apart; NaN and infinities are counted but
never bucketed. There is no bucket collapsing, so sketches merge by adding counts and
the sketches of the shards of a tensor (or of all tensors of one layer type) merged
equal the sketch of the whole. A histogram has a few thousand buckets however many
millions of weights went in, which is what makes the k-means cheap.

Building is vectorised and blockwise (one ``log2`` + ``bincount`` per block of
``BLOCK`` elements), so temporary memory stays a few MB whatever the tensor size. Values
may be numpy or CuPy arrays (:mod:`inshrink_store.codecs._xp`): on a GPU one fused kernel
computes the keys and CuPy's ``bincount`` the histogram of each block
(:func:`inshrink_store.codecs._gpu.sketch_histogram`); only the small per-block histograms
come back to the host, and both paths turn them into stores with the same code. The keys
agree bit for bit for every float32, float16 and bfloat16 value whatever the last-ulp
rounding of either library's ``log2`` (checked exhaustively in
``tests/test_codecs/test_xp_path.py``).

float32 values on the host take a faster road to the same keys (:func:`_f32_tables`): no
float32 lies near a bucket edge, so a key is a non-decreasing function of the value's bit
pattern, and a table over the top 15 bits of ``|x|`` (128 rows per power of two, each
narrower than a bucket, so holding at most one edge) gives every element its key with two
lookups and one comparison against the row's edge. The table is made once per ``alpha``
from the very ``log2`` keys it replaces, edges found by bisection on bit patterns; zeros,
denormals and non-finite values have rows of their own (denormals, rare, are keyed the
old way). Same stores, bit for bit (property-tested against the float64 road), at about a
third of its time.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from inshrink_store.codecs import _gpu, _quant_loops
from inshrink_store.codecs._xp import array_namespace, to_host
from inshrink_store.errors import FormatError

ALPHA = 0.01
BLOCK = 1 << 20  # elements per vectorised pass: keeps temporaries small and cache-friendly

_Store = tuple[np.ndarray, np.ndarray]


def _empty() -> np.ndarray:
    return np.zeros(0, np.int64)


_STEP = 64  # gamma^k = gamma^(k mod 64) (gamma^64)^(k div 64): two short ladders, not 13 squarings
_LADDER_MAX = 1 << 12  # rungs of (gamma^64)^q kept: |k| up to 262,144 (float64's range at alpha 0.3 %)


def _products(base: float, n: int) -> list[float]:
    """``base ** 0 .. base ** (n - 1)`` as successive products of Python floats: IEEE-754
    doubles, one rounding a step, the same on every machine."""
    steps = [1.0]
    for _ in range(n - 1):
        steps.append(steps[-1] * base)
    return steps


@functools.lru_cache(maxsize=64)
def _ladders(gamma: float, rungs: int) -> tuple[np.ndarray, np.ndarray]:
    """``(low, high)``, read-only, row 0 for ``gamma`` and row 1 for ``1/gamma``: ``low[s, r] =
    base^r`` for ``r <= 64``, ``high[s, q] = (base^64)^q`` for ``q < rungs``. A longer ladder
    starts with a shorter one's rungs."""
    low = [_products(base, _STEP + 1) for base in (gamma, 1.0 / gamma)]
    high = [_products(row[_STEP], rungs) for row in low]
    tables = np.array(low, np.float64), np.array(high, np.float64)
    for table in tables:
        table.flags.writeable = False
    return tables


def _squarings(base: float, e: np.ndarray) -> np.ndarray:
    """``base ** e`` by binary exponentiation (exponents past the ladders: a tiny alpha)."""
    out = np.ones(e.shape, np.float64)
    e = e.copy()
    with np.errstate(over="ignore", under="ignore"):  # squares past an exponent's last bit are unused
        while e.any():
            np.multiply(out, base, out=out, where=(e & 1).astype(bool))
            e >>= 1
            base *= base
    return out


def gamma_powers(gamma: float, keys: Any) -> np.ndarray:
    """``gamma ** k`` for each integer key ``k``, as float64, from IEEE-754 products alone, so
    the same bits on every machine; each key's value depends on the key alone.

    Not ``np.power``: numpy computes float64 powers with Intel's SVML on a CPU with AVX-512 and
    with the C library's ``pow`` elsewhere, and the two differ in the last bit for some keys.
    Bucket representatives are hashed into the k-means seed, and a seed one bit away draws
    other starts and can land in another local optimum (another codebook, so other bytes; on a
    256 x 256 tensor, centres a whole level apart), and they set the prune thresholds.

    ``gamma^k`` is ``gamma^(k mod 64) (gamma^64)^(k div 64)`` read off two cached ladders of
    products, and ``gamma^-k`` is ``(1/gamma)^k`` (no overflow on the way to a tiny value).
    Every product adds at most one rounding and the ladders' steps compound, so the relative
    error stays below about ``3 |k|`` units of 2^-53 (1.7e-12 at float32's smallest, key
    -5165), far inside a bucket's 2 %."""
    k = np.asarray(keys, np.int64)
    e = np.abs(k)
    q, r = np.divmod(e, _STEP)
    sign = (k < 0).astype(np.intp)
    top = int(q.max(initial=0))
    if top < _LADDER_MAX:
        low, high = _ladders(float(gamma), 1 << top.bit_length())  # rungs in powers of two
        with np.errstate(over="ignore", under="ignore"):
            powers: np.ndarray = low[sign, r] * high[sign, q]
            return powers
    out = np.empty(k.shape, np.float64)
    near = q < _LADDER_MAX
    low, high = _ladders(float(gamma), _LADDER_MAX)
    with np.errstate(over="ignore", under="ignore"):
        out[near] = low[sign[near], r[near]] * high[sign[near], q[near]]
    for s, base in ((0, float(gamma)), (1, 1.0 / float(gamma))):
        far = ~near & (sign == s)
        out[far] = _squarings(base, e[far])
    return out


def _merge_stores(stores: list[_Store]) -> _Store:
    """Sum counts of equal keys over several (keys, counts) stores."""
    stores = [s for s in stores if s[0].size]
    if not stores:
        return _empty(), _empty()
    if len(stores) == 1:
        return stores[0]
    keys = np.concatenate([k for k, _ in stores])
    counts = np.concatenate([c for _, c in stores])
    uniq, inverse = np.unique(keys, return_inverse=True)
    return uniq, np.bincount(inverse, weights=counts, minlength=uniq.size).astype(np.int64)


def _split_counts(counts: np.ndarray, lo: int) -> tuple[_Store, _Store]:
    """The positive and negative stores of a histogram over keys ``lo..lo+span-1`` of
    positive values followed by the same keys of negative values (empty buckets dropped)."""
    span = counts.size // 2
    stores = []
    for part in (counts[:span], counts[span:]):
        nz = np.flatnonzero(part)
        stores.append((nz.astype(np.int64) + lo, part[nz]))
    return stores[0], stores[1]


def _block_stores(x: Any, scale: float, xp: Any) -> tuple[_Store, _Store, int]:
    """Positive store, negative store and zero count of one block of finite values
    (array-library generic; a GPU runs the fused :func:`_gpu.sketch_histogram` instead)."""
    # The same float64 arithmetic as abs -> log2 -> *scale -> ceil, done in one buffer
    # (this is the hottest loop of planning: every element of every tensor passes here).
    keys = x.astype(xp.float64)
    xp.abs(keys, out=keys)
    nonzero = keys > 0
    n_nonzero = int(xp.count_nonzero(nonzero))
    zeros = int(x.size) - n_nonzero
    if n_nonzero == 0:
        return (_empty(), _empty()), (_empty(), _empty()), zeros
    if zeros:
        x, keys = x[nonzero], keys[nonzero]
    xp.log2(keys, out=keys)
    keys *= scale
    xp.ceil(keys, out=keys)
    ikeys = keys.astype(xp.int64)
    lo, hi = int(ikeys.min()), int(ikeys.max())
    span = hi - lo + 1
    ikeys -= lo
    # negatives in a second key range, one bincount; a product, not ``add(..., where=)``:
    # CuPy ufuncs take no ``where``, and numpy's masked loop is ~4x slower than the product
    ikeys += xp.multiply(x < 0, span, dtype=xp.int64)
    counts = to_host(xp.bincount(ikeys, minlength=2 * span)).astype(np.int64)
    pos, neg = _split_counts(counts, lo)
    return pos, neg, zeros


def _host_block(block: Any, scale: float) -> tuple[_Store, _Store, int, int]:
    """Stores, zero count and non-finite count of one numpy block."""
    finite = np.isfinite(block)
    bad = int(block.size) - int(np.count_nonzero(finite))
    if bad:
        block = block[finite]
    pos, neg, zeros = _block_stores(block, scale, np)
    return pos, neg, zeros, bad


def _device_block(block: Any, scale: float) -> tuple[_Store, _Store, int, int]:
    """The same for one CuPy block: keys and histogram on the device, stores on the host."""
    counts, lo, zeros, bad = _gpu.sketch_histogram(block, scale)
    pos, neg = _split_counts(counts, lo)
    return pos, neg, zeros, bad


_F32_SHIFT = 16  # table rows: |x|'s bit pattern >> 16 (8 exponent bits, 7 of mantissa)
_F32_BLOCK = 1 << 15  # elements per pass of the float32 road: its temporaries stay in L2
_NORMAL_LO, _NORMAL_HI = 0x00800000, 0x7F800000  # |x| bit patterns of the normal float32 range
#: the float32 road's codes: masked out, zero, denormal (keyed the float64 way), non-finite;
#: a key ``k`` is code ``_FIRST_KEY + k - kmin``, and a negative value's code adds ``span``
_DROPPED, _ZERO, _DENORMAL, _NONFINITE, _FIRST_KEY = 0, 1, 2, 3, 4
_NEVER = 0x7FFFFFFF  # no |x| pattern is above it


@dataclass(frozen=True)
class _F32Tables:
    """Per row of :data:`_F32_SHIFT`: its first code, and the largest pattern keeping that
    code (the next pattern starts the next key; :data:`_NEVER` when the row holds no edge)."""

    code: np.ndarray  # int32
    last: np.ndarray  # int32
    span: int  # codes of one sign
    kmin: int  # the key of code _FIRST_KEY


def _f32_keys(patterns: np.ndarray, scale: float) -> np.ndarray:
    """The float64 road's keys (:func:`_block_stores`) of positive normal float32 bit patterns."""
    keys = np.asarray(patterns, np.int64).astype(np.uint32).view(np.float32).astype(np.float64)
    np.log2(keys, out=keys)
    keys *= scale
    np.ceil(keys, out=keys)
    return keys.astype(np.int64)


@functools.lru_cache(maxsize=16)
def _f32_tables(scale: float) -> _F32Tables | None:
    """The float32 road's tables for ``scale`` (None: a row would hold two edges, an alpha
    far below the default; such sketches take the float64 road)."""
    rows = np.arange(1 << (31 - _F32_SHIFT), dtype=np.int64)
    normal = rows[(rows >= _NORMAL_LO >> _F32_SHIFT) & (rows < _NORMAL_HI >> _F32_SHIFT)]
    first = normal << _F32_SHIFT
    last = first + (1 << _F32_SHIFT) - 1
    k_first, k_last = _f32_keys(first, scale), _f32_keys(last, scale)
    if np.any(k_last < k_first) or np.any(k_last - k_first > 1):
        return None
    kmin = int(k_first.min())
    code = np.full(rows.size, _DENORMAL, np.int32)
    code[_NORMAL_HI >> _F32_SHIFT:] = _NONFINITE
    code[normal] = k_first - kmin + _FIRST_KEY
    edge = np.full(rows.size, _NEVER, np.int32)
    edge[0] = 0  # row 0: the pattern 0 (zero), then denormals
    code[0] = _ZERO
    split = np.flatnonzero(k_last > k_first)
    lo, hi = first[split], last[split]  # keys k and k + 1: bisect for the first pattern of k + 1
    target = k_last[split]
    while np.any(hi - lo > 1):
        mid = (lo + hi) // 2
        up = _f32_keys(mid, scale) >= target
        lo, hi = np.where(up, lo, mid), np.where(up, mid, hi)
    edge[normal[split]] = hi - 1
    for table in (code, edge):
        table.flags.writeable = False
    return _F32Tables(code, edge, int(k_last.max()) - kmin + 1 + _FIRST_KEY, kmin)


def _f32_stores(x: np.ndarray, mask: np.ndarray | None, scale: float,
                tables: _F32Tables) -> tuple[_Store, _Store, int, int]:
    """Stores, zero count and non-finite count of float32 ``x`` (1-D, native order) where
    ``mask`` (bool, or None: all), as :func:`_host_block` gives them, by table lookups."""
    span = tables.span
    total = np.zeros(2 * span, np.int64)
    loops = _quant_loops.for_bytes(x.nbytes) if x.flags.c_contiguous else None
    if loops is not None:  # one pass: each code counted where it is found, the same counts
        flat_mask = None if mask is None else np.ascontiguousarray(mask).reshape(-1)
        loops.sketch_counts(x.view(np.int32), tables.code, tables.last, span, _F32_SHIFT,
                            flat_mask if flat_mask is not None else _NO_MASK, flat_mask is not None, total)
        return _counted_stores(total, x, mask, scale, tables)
    for s in range(0, x.size, _F32_BLOCK):
        codes = _f32_codes(x[s:s + _F32_BLOCK], tables)
        if mask is not None:
            codes *= mask[s:s + _F32_BLOCK]  # masked out: code 0, never read
        total += np.bincount(codes, minlength=2 * span)
    return _counted_stores(total, x, mask, scale, tables)


def _f32_codes(x: np.ndarray, tables: _F32Tables) -> np.ndarray:
    """Each float32 value's code (int32): its key's, in the negative half for a negative value."""
    b = x.view(np.int32)
    mag = b & 0x7FFFFFFF
    row = mag >> _F32_SHIFT
    codes = tables.code.take(row)
    codes += mag > tables.last.take(row)
    codes += (b >> 31) & tables.span  # the sign bit: the negative half
    return codes


def _counted_stores(total: np.ndarray, x: np.ndarray, mask: np.ndarray | None, scale: float,
                    tables: _F32Tables) -> tuple[_Store, _Store, int, int]:
    """Stores, zero count and non-finite count from the counts of every code of ``x`` where
    ``mask``; the denormals among them, if any, keyed the float64 way."""
    span = tables.span
    bits = x.view(np.int32)
    pos, neg = (_table_store(total[half:half + span], tables.kmin) for half in (0, span))
    if total[_DENORMAL] or total[span + _DENORMAL]:
        mag = bits & 0x7FFFFFFF
        denormal = (mag > 0) & (mag < _NORMAL_LO)
        if mask is not None:
            denormal &= mask
        dpos, dneg, _ = _block_stores(x[denormal], scale, np)
        pos, neg = _merge_stores([dpos, pos]), _merge_stores([dneg, neg])
    return pos, neg, int(total[_ZERO] + total[span + _ZERO]), int(total[_NONFINITE] + total[span + _NONFINITE])


class KeyedValues:
    """float32 values with every element's sketch code found once (a small int each), so the
    sketch of any subset of them (:meth:`sketch`) is a bincount: a search sketches the rest
    of each tensor under every protect / prune / metric it looks at. The sketches equal
    ``LogSketch.from_values(values, alpha, mask=mask)``, bit for bit; the codes cost 2 bytes
    per element (4 for an alpha under about 0.6 %). Values that are not float32, or an alpha
    too fine for the table, keep no codes and are sketched by :meth:`LogSketch.from_values`."""

    def __init__(self, values: np.ndarray, alpha: float = ALPHA) -> None:
        self.values = np.asarray(values)
        self.alpha = alpha
        self._scale = 1.0 / math.log2((1 + alpha) / (1 - alpha))
        x = self.values.reshape(-1)
        tables = _f32_tables(self._scale) if x.dtype == np.float32 and x.dtype.isnative else None
        self._tables = tables
        self._codes: np.ndarray | None = None
        if tables is not None:
            self._flat = x
            small = np.int16 if 2 * tables.span <= np.iinfo(np.int16).max else np.int32
            self._codes = np.empty(x.size, small)
            loops = _quant_loops.for_bytes(x.nbytes) if x.flags.c_contiguous else None
            if loops is not None:
                loops.sketch_codes(x.view(np.int32), tables.code, tables.last, tables.span, _F32_SHIFT, self._codes)
            else:
                for s in range(0, x.size, _F32_BLOCK):
                    self._codes[s:s + _F32_BLOCK] = _f32_codes(x[s:s + _F32_BLOCK], tables)

    def sketch(self, mask: np.ndarray | None = None) -> LogSketch:
        """``LogSketch.from_values(values, alpha, mask=mask)``, from the codes."""
        if self._codes is None or self._tables is None or (mask is not None and np.asarray(mask).dtype != bool):
            return LogSketch.from_values(self.values, self.alpha, mask=mask)
        m = None if mask is None else np.asarray(mask).reshape(-1)
        if m is not None and m.shape != self._codes.shape:
            raise FormatError(
                f"Expected a mask of {self._codes.size} elements. Got {m.size} instead; "
                "pass a boolean mask shaped like the values."
            )
        width = 2 * self._tables.span
        total = np.zeros(width, np.int64)
        loops = _quant_loops.for_bytes(self._codes.nbytes)
        if loops is not None:  # one pass, the same counts
            flat = None if m is None else np.ascontiguousarray(m)
            loops.code_counts(self._codes, flat if flat is not None else _NO_MASK, flat is not None, total)
        for s in range(0, self._codes.size if loops is None else 0, _CODES_BLOCK):
            codes = self._codes[s:s + _CODES_BLOCK]
            if m is not None:
                codes = codes * m[s:s + _CODES_BLOCK]  # masked out: code 0, never read
            total += np.bincount(codes, minlength=width)
        (pk, pc), (nk, nc), zeros, nonfinite = _counted_stores(total, self._flat, m, self._scale, self._tables)
        return LogSketch(self.alpha, pk, pc, nk, nc, zeros, nonfinite)


_CODES_BLOCK = 1 << 16  # codes per bincount of KeyedValues.sketch
#: the mask argument of a compiled loop told there is none (its flag says so; never read)
_NO_MASK = np.ones(1, bool)


def _table_store(counts: np.ndarray, kmin: int) -> _Store:
    """The (keys, counts) store of one sign's codes (keys from code _FIRST_KEY on)."""
    keyed = counts[_FIRST_KEY:]
    nz = np.flatnonzero(keyed)
    return nz.astype(np.int64) + kmin, keyed[nz]


@dataclass(frozen=True)
class LogSketch:
    """An immutable sketch; build with :meth:`from_values`, combine with :meth:`merge`.

    ``pos_keys``/``neg_keys`` are sorted ascending bucket keys of ``|x|`` with their
    ``*_counts``; ``zero_count`` counts exact zeros; ``nonfinite_count`` NaN and +-inf.
    """

    alpha: float = ALPHA
    pos_keys: np.ndarray = field(default_factory=_empty)
    pos_counts: np.ndarray = field(default_factory=_empty)
    neg_keys: np.ndarray = field(default_factory=_empty)
    neg_counts: np.ndarray = field(default_factory=_empty)
    zero_count: int = 0
    nonfinite_count: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise FormatError(
                f"Expected 0 < alpha < 1. Got {self.alpha!r} instead; use the default {ALPHA}."
            )

    @property
    def gamma(self) -> float:
        return (1 + self.alpha) / (1 - self.alpha)

    @classmethod
    def from_values(cls, values: Any, alpha: float = ALPHA, *, mask: npt.ArrayLike | None = None,
                    xp: ModuleType | None = None) -> LogSketch:
        """Sketch of ``values`` (any shape); with ``mask``, only where it is true.

        ``xp`` is the array module of ``values`` (numpy or CuPy), found from them when None;
        CuPy values are sketched on their device and equal the host's sketch of them."""
        xp = array_namespace(values, mask) if xp is None else xp
        x = xp.asarray(values).ravel()
        if mask is not None:
            m = xp.asarray(mask).ravel()
            if m.shape != x.shape:
                raise FormatError(
                    f"Expected a mask of {x.size} elements. Got {m.size} instead; "
                    "pass a boolean mask shaped like the values."
                )
        if x.size and not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
            raise FormatError(f"Expected real numbers to sketch. Got dtype {x.dtype} instead.")
        scale = 1.0 / math.log2((1 + alpha) / (1 - alpha))
        if xp is np and x.dtype == np.float32 and x.dtype.isnative and (mask is None or m.dtype == bool):
            tables = _f32_tables(scale)
            if tables is not None:
                (pk, pc), (nk, nc), zeros, nonfinite = _f32_stores(x, None if mask is None else m, scale, tables)
                return cls(alpha, pk, pc, nk, nc, zeros, nonfinite)
        pos: list[_Store] = []
        neg: list[_Store] = []
        zeros = nonfinite = 0
        step, sketch_block = (BLOCK, _host_block) if xp is np else (_gpu.BLOCK, _device_block)
        for start in range(0, int(x.size), step):
            block = x[start:start + step]
            if mask is not None:
                block = block[m[start:start + step]]
            p, q, z, bad = sketch_block(block, scale)
            pos.append(p)
            neg.append(q)
            zeros += z
            nonfinite += bad
        (pk, pc), (nk, nc) = _merge_stores(pos), _merge_stores(neg)
        return cls(alpha, pk, pc, nk, nc, zeros, nonfinite)

    def merge(self, other: LogSketch) -> LogSketch:
        """Sketch of the union of both inputs (counts add)."""
        if other.alpha != self.alpha:
            raise FormatError(
                f"Expected sketches with equal alpha. Got {self.alpha} and {other.alpha} instead; "
                "build both with the same alpha."
            )
        pk, pc = _merge_stores([(self.pos_keys, self.pos_counts), (other.pos_keys, other.pos_counts)])
        nk, nc = _merge_stores([(self.neg_keys, self.neg_counts), (other.neg_keys, other.neg_counts)])
        return LogSketch(self.alpha, pk, pc, nk, nc, self.zero_count + other.zero_count,
                         self.nonfinite_count + other.nonfinite_count)

    def magnitudes(self) -> LogSketch:
        """The sketch of ``|x|``: both stores folded into the positive one."""
        pk, pc = _merge_stores([(self.pos_keys, self.pos_counts), (self.neg_keys, self.neg_counts)])
        return LogSketch(self.alpha, pk, pc, _empty(), _empty(), self.zero_count, self.nonfinite_count)

    @property
    def count(self) -> int:
        """Finite values sketched (zeros included, NaN and infinities not)."""
        return int(self.pos_counts.sum() + self.neg_counts.sum() + self.zero_count)

    def representatives(self, keys: np.ndarray) -> np.ndarray:
        """``2 gamma^i / (gamma + 1)`` for bucket keys ``i`` (the same bits on every machine:
        :func:`gamma_powers`)."""
        g = self.gamma
        return 2.0 * gamma_powers(g, keys) / (g + 1.0)

    def histogram(self) -> tuple[np.ndarray, np.ndarray]:
        """Signed bucket representatives strictly ascending, and their counts (zeros: one bucket at 0.0)."""
        neg = -self.representatives(self.neg_keys[::-1])
        pos = self.representatives(self.pos_keys)
        has_zero = self.zero_count > 0
        reps = np.concatenate([neg, np.zeros(1 if has_zero else 0), pos])
        zero = np.array([self.zero_count] if has_zero else [], np.int64)
        counts = np.concatenate([self.neg_counts[::-1], zero, self.pos_counts]).astype(np.int64)
        return reps, counts

    def quantile(self, q: float) -> float:
        """An estimate of the sample of rank ``floor(q * (count - 1))`` in ascending order
        (numpy's ``method="lower"``), within relative error ``alpha`` of it (0 exactly for 0)."""
        if not 0 <= q <= 1:
            raise FormatError(f"Expected a quantile in [0, 1]. Got {q!r} instead.")
        if self.count == 0:
            raise FormatError(
                "Expected a sketch with at least one finite value. Got an empty one instead; "
                "sketch some values before asking for a quantile."
            )
        reps, counts = self.histogram()
        rank = math.floor(q * (self.count - 1))
        idx = int(np.searchsorted(np.cumsum(counts), rank, side="right"))
        return float(reps[min(idx, reps.size - 1)])

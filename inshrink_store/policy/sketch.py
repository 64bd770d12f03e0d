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
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inshrink_store.codecs import _gpu
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
    def from_values(cls, values: Any, alpha: float = ALPHA, *, mask: Any = None,
                    xp: Any = None) -> LogSketch:
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

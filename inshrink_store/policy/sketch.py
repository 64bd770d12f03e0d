"""Log-space quantile sketch (DDSketch style) over weights: thresholds and k-means input.

Keys are ``ceil(log_gamma |x|)`` with ``gamma = (1 + alpha) / (1 - alpha)``; every value in
a bucket is within relative error ``alpha`` of the bucket's representative
``2 gamma^i / (gamma + 1)``. Positive and negative values have separate stores and
zeros are counted apart; NaN and infinities are counted but never bucketed. Sketches
merge by adding counts, so shards on several ranks give one global sketch. A
histogram has a few thousand buckets however many millions of weights went in, which
is what makes the k-means cheap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from inshrink_store.errors import FormatError

ALPHA = 0.01


def _store(magnitudes: np.ndarray, log_gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique keys and counts, via one vectorised bincount (no per-element Python)."""
    if magnitudes.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    keys = np.ceil(np.log(magnitudes.astype(np.float64)) / log_gamma).astype(np.int64)
    lo = int(keys.min())
    counts = np.bincount(keys - lo)
    nz = np.flatnonzero(counts)
    return nz.astype(np.int64) + lo, counts[nz].astype(np.int64)


def _merge_store(ka: np.ndarray, ca: np.ndarray, kb: np.ndarray, cb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keys = np.concatenate([ka, kb])
    counts = np.concatenate([ca, cb])
    uniq, inverse = np.unique(keys, return_inverse=True)
    return uniq, np.bincount(inverse, weights=counts, minlength=uniq.size).astype(np.int64)


@dataclass(frozen=True)
class LogSketch:
    """An immutable sketch; build with :meth:`from_values`, combine with :meth:`merge`."""

    alpha: float = ALPHA
    pos_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pos_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    neg_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    neg_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    zero_count: int = 0
    nonfinite_count: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise FormatError(f"Expected 0 < alpha < 1. Got {self.alpha!r} instead.")

    @property
    def gamma(self) -> float:
        return (1 + self.alpha) / (1 - self.alpha)

    @classmethod
    def from_values(cls, values: np.ndarray, alpha: float = ALPHA) -> LogSketch:
        x = np.asarray(values).ravel()
        finite = np.isfinite(x)
        nonfinite = int(x.size - np.count_nonzero(finite))
        if nonfinite:
            x = x[finite]
        log_gamma = math.log((1 + alpha) / (1 - alpha))
        pk, pc = _store(x[x > 0], log_gamma)
        nk, nc = _store(-x[x < 0], log_gamma)
        return cls(alpha, pk, pc, nk, nc, int(np.count_nonzero(x == 0)), nonfinite)

    def merge(self, other: LogSketch) -> LogSketch:
        if other.alpha != self.alpha:
            raise FormatError(f"Expected sketches with equal alpha. Got {self.alpha} and {other.alpha}.")
        pk, pc = _merge_store(self.pos_keys, self.pos_counts, other.pos_keys, other.pos_counts)
        nk, nc = _merge_store(self.neg_keys, self.neg_counts, other.neg_keys, other.neg_counts)
        return LogSketch(self.alpha, pk, pc, nk, nc, self.zero_count + other.zero_count,
                         self.nonfinite_count + other.nonfinite_count)

    @property
    def count(self) -> int:
        """Finite values sketched."""
        return int(self.pos_counts.sum() + self.neg_counts.sum() + self.zero_count)

    def _representative(self, keys: np.ndarray) -> np.ndarray:
        g = self.gamma
        return 2.0 * np.power(g, keys.astype(np.float64)) / (g + 1.0)

    def histogram(self) -> tuple[np.ndarray, np.ndarray]:
        """Signed bucket representatives ascending, and their counts (zeros as one bucket)."""
        neg = -self._representative(self.neg_keys[::-1])
        pos = self._representative(self.pos_keys)
        zero = np.zeros(1 if self.zero_count else 0)
        reps = np.concatenate([neg, zero, pos])
        counts = np.concatenate([self.neg_counts[::-1], [self.zero_count] if self.zero_count else [], self.pos_counts])
        return reps, counts.astype(np.int64)

    def quantile(self, q: float) -> float:
        """The value of rank ``q * (count - 1)`` (lower), within relative error ``alpha``."""
        if not 0 <= q <= 1:
            raise FormatError(f"Expected a quantile in [0, 1]. Got {q!r} instead.")
        if self.count == 0:
            raise FormatError("Expected a sketch with at least one finite value. Got an empty one.")
        reps, counts = self.histogram()
        rank = math.floor(q * (self.count - 1))
        idx = int(np.searchsorted(np.cumsum(counts), rank, side="right"))
        return float(reps[min(idx, reps.size - 1)])

"""How one Adam moment tensor is quantized: m pruned by importance and clustered, v clustered
in log space, codebooks seeded from the data (what :mod:`inshrink_store.policy.moments`'
policy and guard call for each attempt).
Layer: policy, beside refs and history, below the facade.

Why a module of its own: these are the numeric kernels (log-space buckets, weighted
histograms, nearest-centre snapping) with no notion of a policy, a guard or a record, so
they can be read, tested and tuned apart from the decisions that use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from inshrink_store.codecs.nuq import nearest_index
from inshrink_store.policy.kmeans import fit_codebook, loss, through_dtype, weighted_kmeans
from inshrink_store.policy.sketch import BLOCK

#: log2(v) is histogrammed at 1/LOG_RESOLUTION octave before clustering (a few thousand points)
LOG_RESOLUTION = 64
MAX_BINS = 255  # one uint8 level id per element (+ the protected id)


def _snap(values: np.ndarray, codebook: np.ndarray) -> np.ndarray:
    """Each finite value replaced by its nearest centre; NaN/Inf kept (the codec protects them)."""
    c32 = codebook.astype(np.float32)
    flat = values.ravel()
    out = np.empty(flat.size, np.float32)
    for s in range(0, flat.size, BLOCK):
        part = flat[s:s + BLOCK]
        ids = nearest_index(part, c32)
        out[s:s + BLOCK] = np.where(np.isfinite(part), c32[np.minimum(ids, c32.size - 1)], part)
    return out.reshape(values.shape)


def smallest_mask(scores: np.ndarray, fraction: float) -> np.ndarray:
    """True for the ``fraction`` of finite entries with the smallest score (ties at the
    threshold included; deterministic: a partition, no sort order of equal keys)."""
    flat = np.abs(scores.ravel())
    finite = np.isfinite(flat)
    count = int(fraction * int(finite.sum()))
    if count <= 0:
        return np.zeros(scores.shape, bool)
    pool = flat[finite]
    threshold = np.partition(pool, count - 1)[count - 1]
    mask: np.ndarray = (flat <= threshold) & finite
    return mask.reshape(scores.shape)


#: key spans up to which :func:`unique_inverse` counts instead of sorting (a few MB of table)
DENSE_SPAN = 1 << 23


def unique_inverse(keys: np.ndarray, consume: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_inverse=True)`` for int64 keys, in O(n) when their span is
    at most :data:`DENSE_SPAN` (a table of which keys occur, its running count as each
    key's rank) instead of a sort of every element: moment planning buckets every entry of
    both moments by its log2 magnitude, and the sort was a third of it. Same arrays.
    ``consume``: ``keys`` (int64) is the caller's scratch and may be overwritten, which saves
    a tensor-sized copy."""
    flat = np.asarray(keys, np.int64).ravel()
    if flat.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.intp)
    low, high = int(flat.min()), int(flat.max())
    if high - low >= DENSE_SPAN:
        uniq, inverse = np.unique(flat, return_inverse=True)
        return uniq, inverse.ravel()
    if consume and keys.dtype == np.int64 and keys.flags.writeable and keys.flags.c_contiguous:
        shifted = np.subtract(flat, low, out=flat)  # flat is a view of keys: no copy
    else:
        shifted = flat - low
    present = np.zeros(high - low + 1, bool)
    present[shifted] = True
    rank = np.cumsum(present, dtype=np.intp) - 1
    return np.flatnonzero(present).astype(np.int64) + low, rank[shifted]


def log_steps(values: np.ndarray) -> np.ndarray:
    """``round(log2 |x| * LOG_RESOLUTION)`` per entry (int64; 0 where x is 0 or not finite,
    which callers leave out): the log2 bucket of each entry."""
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log2(np.abs(values).astype(np.float64))
    logs[~np.isfinite(logs)] = 0.0
    steps: np.ndarray = np.round(logs * LOG_RESOLUTION)
    return steps.astype(np.int64)


def _bucket_keys(values: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Dense bucket numbers in the order the signed key ``sign * (steps + 2^20)`` sorts
    (negatives from the largest magnitude down, then positives up): a table of thousands."""
    low, high = (int(steps.min()), int(steps.max())) if steps.size else (0, 0)
    return np.where(values > 0, (high - low + 1) + (steps - low), high - steps)


def _weighted_buckets(inverse: np.ndarray, buckets: int, values: np.ndarray,
                      weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each non-empty bucket's weighted mean value and summed weight, in bucket order.

    Sums in float64 whatever the inputs' float dtype: ``bincount`` widens its weights itself,
    and the products are taken in float64, so float32 inputs give the figures their float64
    copies gave, without a tensor-sized float64 copy of each."""
    total = np.bincount(inverse, weights=weights, minlength=buckets)
    centre = np.bincount(inverse, weights=np.multiply(weights, values, dtype=np.float64), minlength=buckets)
    keep = total > 0
    return centre[keep] / total[keep], total[keep]


@dataclass(frozen=True)
class _PreparedM:
    """What every attempt of the guard shares for one ``exp_avg``: the entries that may be
    kept at all (finite, non-zero, with a finite positive importance), their values and
    importance, and their log2 bucket numbers (the float64 log2 was most of a histogram). An
    attempt only drops some of them; empty buckets fall out as before.

    Values and importance stay in their own dtype (float32 for a float32 moment) and are
    widened to float64 only for the entries an attempt keeps, and the bucket numbers (a few
    thousand) are int32: the same histogram, at 12 bytes per entry instead of 24 for as long
    as the guard runs (a 16.8 M-element moment held 400 MB of these)."""

    usable: np.ndarray
    values: np.ndarray
    weights: np.ndarray
    keys: np.ndarray
    buckets: int

    @classmethod
    def of(cls, m: np.ndarray, importance: np.ndarray) -> _PreparedM:
        usable = np.isfinite(m) & (m != 0) & np.isfinite(importance) & (importance > 0)
        values = m[usable]
        keys = _bucket_keys(values, log_steps(values))
        buckets = int(keys.max()) + 1 if keys.size else 0
        narrow = keys.astype(np.int32) if buckets <= np.iinfo(np.int32).max else keys
        return cls(usable, values, importance[usable], narrow, buckets)

    def histogram(self, drop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:func:`_importance_histogram` of the usable entries not in ``drop``."""
        kept = ~drop[self.usable]
        return _weighted_buckets(self.keys[kept], self.buckets, self.values[kept], self.weights[kept])


def _importance_histogram(values: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-zero finite ``values`` bucketed by sign and log2 magnitude (1/LOG_RESOLUTION octave):
    (each bucket's weighted mean value, its summed weight) - a few thousand points to cluster.
    The guard's path (:class:`_PreparedM`) with nothing dropped."""
    return _PreparedM.of(values, weights).histogram(np.zeros(np.shape(values), bool))


def quantize_exp_avg(m: np.ndarray, drop: np.ndarray, levels: int, dtype: str,
                     importance: np.ndarray | None = None,
                     prepared: _PreparedM | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(stored m, codebook): ``drop`` entries 0, the rest on ``levels`` centres with 0 pinned.

    ``importance`` (per entry; ``1 / (sqrt(v_hat) + eps)^2``, how much an error in m moves the
    update) weighs the k-means, so the codebook minimises the *update's* squared error, not
    m's: a small m under a tiny v drives a large step and gets the resolution it needs. With
    no importance the weights' own codebook fitter is used. ``prepared``: ``_PreparedM.of(m,
    importance)``, when the caller quantizes the same m several times (the same result)."""
    if importance is not None and prepared is None:
        prepared = _PreparedM.of(m, importance)
    if prepared is not None:
        points, weights = prepared.histogram(drop)
        kept_any = points.size > 0
    else:
        kept = m[~drop & np.isfinite(m) & (m != 0)]
        kept_any = kept.size > 0
    if not kept_any:
        codebook = np.zeros(1)
    elif prepared is None:
        codebook = fit_codebook(kept, levels, include_zero=True, dtype=dtype)
    else:
        centres = weighted_kmeans(points, weights, levels - 1, sigma=1.0)
        codebook = np.unique(through_dtype(centres, dtype).astype(np.float64))
    if not (codebook == 0.0).any():
        codebook = np.union1d(codebook, [0.0])
    out = _snap(m, codebook)
    out[drop & np.isfinite(m)] = 0.0
    return out, codebook


def quantize_exp_avg_sq(v: np.ndarray, levels: int, dtype: str, importance: np.ndarray | None = None,
                        previous: Any = None, reuse_tolerance: float = 1.10,
                        importance_root: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(stored v, codebook): positive entries on ``levels`` centres fitted to log2 v (so every
    positive entry stays positive), zeros exact; negative or non-finite entries are left as
    they are (the codec stores them exactly as protected values).

    ``importance`` (per entry, e.g. the update squared) weighs the clustering, so entries
    that drive large steps get the finer levels. ``previous`` (the parent version's
    codebook of this tensor) is reused while its weighted log-domain error is within
    ``reuse_tolerance`` x a fresh fit's: v moves slowly (beta2 ~ 0.999), so with the same
    centres most level ids repeat and the store's delta against the parent is small.
    ``importance_root``: instead of ``importance``, an array whose square (in float64) is the
    importance, squared here for the positive entries only, so no tensor-sized float64
    importance is held (the guard passes the exact update). The float64 work arrays cover the
    positive entries only and are built in place (the same values as before, less memory)."""
    positive = np.isfinite(v) & (v > 0)
    logs = v[positive].astype(np.float64)
    np.log2(logs, out=logs)
    out = np.array(v, dtype=np.float32, copy=True)
    out[out == 0] = 0.0  # -0.0 too: the codec stores it as the 0.0 centre, so plan what it reads back
    codebook = [0.0] if (v == 0).any() else []
    if logs.size:
        scaled = logs * LOG_RESOLUTION
        np.round(scaled, out=scaled)
        bucket = scaled.astype(np.int64)
        del scaled
        keys, inverse = unique_inverse(bucket, consume=True)
        del bucket
        if importance_root is not None:
            weights = importance_root[positive].astype(np.float64)
            np.square(weights, out=weights)
        elif importance is not None:
            weights = importance[positive].astype(np.float64)
        else:
            weights = np.ones(logs.size)
        weights[~np.isfinite(weights)] = 0.0
        weights += 1e-30  # every bucket counts a little
        mass = np.bincount(inverse, weights=weights, minlength=keys.size)
        del inverse, weights
        points = keys / LOG_RESOLUTION
        fresh = weighted_kmeans(points, mass, levels, sigma=1.0)
        chosen = fresh
        reused = _positive_codebook(previous, levels)
        if reused is not None:
            w = mass / mass.sum()
            if loss(points, w, np.log2(reused)) <= reuse_tolerance * loss(points, w, fresh):
                chosen = np.log2(reused)
        values = through_dtype(np.exp2(chosen), dtype).astype(np.float64)
        values = np.unique(values[np.isfinite(values) & (values > 0)])
        if values.size == 0:  # every centre under- or overflowed the dtype: keep v exact
            return np.array(v, dtype=np.float32, copy=True), np.zeros(0)
        ids = nearest_index(logs, np.log2(values))
        out[positive] = values[np.minimum(ids, values.size - 1)].astype(np.float32)
        codebook.extend(values.tolist())
    return out, np.asarray(sorted(codebook), np.float64)


def _positive_codebook(previous: Any, levels: int) -> np.ndarray | None:
    """The parent's positive centres, if it had a usable codebook of at most ``levels``."""
    if previous is None:
        return None
    try:
        prev = np.asarray(previous, np.float64).reshape(-1)
    except (TypeError, ValueError):
        return None
    prev = prev[np.isfinite(prev) & (prev > 0)]
    return prev if 1 <= prev.size <= levels else None

"""Approximate weighted 1-D k-means over sketch buckets: a codebook in milliseconds.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

Clustering a few thousand bucket representatives instead of millions of weights is
what ALGORITHM.md §2 calls approximate k-means. Each bucket weighs
``W = sigma * frequency + (1 - sigma) * |centre|`` (each normalised to sum 1), so large
weights keep accurate centres even when they are rare. Initialisation is weighted
k-means++ (distance^2 x W) seeded from a hash of the input when no seed is given, so
the same weights always give the same codebook (the store's dedup and small deltas
rely on it); weighted Lloyd iterations follow, vectorised for 1-D data (points sorted
once, assignment by ``searchsorted`` on the midpoints between centres). Centres come
back sorted, so level ids are ordered and stable across checkpoints.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from inshrink_store import dtypes as dtype_registry
from inshrink_store.errors import FormatError
from inshrink_store.policy.sketch import LogSketch

SIGMA = 0.2
ITERS = 30  # Lloyd on a few thousand sorted 1-D points converges well before this
RESTARTS = 3  # k-means++ draws per cold fit (plus one weighted-quantile start); lowest loss wins


def bucket_weights(points: np.ndarray, counts: np.ndarray, sigma: float = SIGMA) -> np.ndarray:
    """``W = sigma * counts/sum(counts) + (1 - sigma) * |points|/sum(|points|)``."""
    freq = counts / counts.sum()
    mag = np.abs(points)
    total = mag.sum()
    mag = mag / total if total > 0 else np.full_like(mag, 1.0 / mag.size)
    weights: np.ndarray = sigma * freq + (1.0 - sigma) * mag
    return weights


def assign(points: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """Index of the nearest sorted centre for each point (ties to the lower)."""
    mids = (centres[:-1] + centres[1:]) / 2
    return np.searchsorted(mids, points, side="left")


def loss(points: np.ndarray, weights: np.ndarray, centres: np.ndarray) -> float:
    """Weighted sum of squared distances to the nearest centre."""
    c = np.sort(np.asarray(centres, dtype=np.float64))
    return float(np.sum(weights * (points - c[assign(points, c)]) ** 2))


def _seed(points: np.ndarray, weights: np.ndarray, k: int) -> int:
    h = xxhash.xxh3_64(np.ascontiguousarray(points, np.float64).tobytes())
    h.update(np.ascontiguousarray(weights, np.float64).tobytes())
    h.update(int(k).to_bytes(4, "little"))
    return h.intdigest()


def draw(rng: np.random.Generator, p: np.ndarray) -> int:
    """``rng.choice(p.size, p=p)`` for probabilities ``p`` that sum to 1: the same index from
    the same draw of ``rng`` (numpy's own steps: cumulative sum, divided by its last, one
    ``rng.random()``, searched on the right), without ``choice``'s checks of ``p``, which cost
    as much as the draw and run for every centre of every fit. Property-tested against
    ``choice`` in ``tests/test_policy/test_kmeans.py``."""
    cdf = p.cumsum()
    cdf /= cdf[-1]
    return int(cdf.searchsorted(rng.random(), side="right"))


def kmeans_pp(points: np.ndarray, weights: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Weighted k-means++: each next centre drawn with probability ~ distance^2 x weight."""
    centres = [points[draw(rng, weights / weights.sum())]]
    d2 = (points - centres[0]) ** 2
    for _ in range(1, k):
        score = d2 * weights
        total = score.sum()
        if total <= 0:
            break
        nxt = points[draw(rng, score / total)]
        centres.append(nxt)
        np.minimum(d2, (points - nxt) ** 2, out=d2)
    return np.unique(np.asarray(centres, dtype=np.float64))


def lloyd(points: np.ndarray, weights: np.ndarray, centres: np.ndarray, iters: int = ITERS,
          pinned: float | None = None) -> np.ndarray:
    """Weighted Lloyd iterations on sorted 1-D data; an empty cluster keeps its centre,
    and a centre equal to ``pinned`` (e.g. 0.0 when pruning) never moves.

    The points are sorted, so each cluster is a run of them, cut where the midpoints between
    centres fall (a point on a midpoint goes to the lower centre, as :func:`assign`): its
    mass and moment are differences of prefix sums, and an iteration costs O(k log n)
    instead of a pass over every point (the search fits a codebook per candidate)."""
    c = np.unique(np.asarray(centres, dtype=np.float64))
    mass_upto = np.concatenate(([0.0], np.cumsum(weights)))
    moment_upto = np.concatenate(([0.0], np.cumsum(weights * points)))
    for _ in range(iters):
        cuts = np.concatenate(([0], np.searchsorted(points, (c[:-1] + c[1:]) / 2, side="right"), [points.size]))
        mass = mass_upto[cuts[1:]] - mass_upto[cuts[:-1]]
        moment = moment_upto[cuts[1:]] - moment_upto[cuts[:-1]]
        full = (cuts[1:] > cuts[:-1]) & (mass > 0)
        mean = moment / np.where(full, mass, 1)
        # a difference of prefix sums can round a mean just past its run of points (past a
        # float16's largest value, say): a mean lies within them, so it is clipped there
        first, last = points[np.minimum(cuts[:-1], points.size - 1)], points[np.maximum(cuts[1:] - 1, 0)]
        new = np.where(full, np.clip(mean, first, last), c)
        if pinned is not None:
            new[c == pinned] = pinned
        new = np.sort(new)
        if np.array_equal(new, c):
            break
        c = new
    return np.unique(c)


def lloyd_many(points: np.ndarray, weights: np.ndarray, starts: list[np.ndarray],
               iters: int = ITERS) -> list[np.ndarray]:
    """:func:`lloyd` from each start, all in lockstep: exactly ``[lloyd(points, weights, s,
    iters) for s in starts]``, at the numpy overhead of one run.

    Why: a cold fit runs Lloyd from four starts, each a few dozen iterations of small array
    operations whose cost is numpy's per-call overhead, and the search fits a codebook per
    tensor and candidate. Each start is a row, padded with +inf to the longest: a centre at
    +inf sits past every (finite) point, so its cluster is empty and it never moves, and the
    midpoint before it is +inf, so the last real cluster runs to the end as it does alone.
    A row that has converged is a fixed point of the update, so running it on while others
    converge changes nothing: every row ends where its own run would."""
    rows = [np.unique(np.asarray(s, dtype=np.float64)) for s in starts]
    if not rows:
        return []
    width = max(r.size for r in rows)
    c = np.full((len(rows), width), np.inf)
    for i, r in enumerate(rows):
        c[i, :r.size] = r
    n = points.size
    mass_upto = np.concatenate(([0.0], np.cumsum(weights)))
    moment_upto = np.concatenate(([0.0], np.cumsum(weights * points)))
    edge = np.zeros((len(rows), 1), np.intp)
    end = np.full((len(rows), 1), n, np.intp)
    with np.errstate(invalid="ignore"):  # inf - inf in the padding's midpoints is never read
        for _ in range(iters):
            mids = (c[:, :-1] + c[:, 1:]) / 2
            cuts = np.concatenate((edge, np.searchsorted(points, mids, side="right"), end), axis=1)
            lo, hi = cuts[:, :-1], cuts[:, 1:]
            mass = mass_upto[hi] - mass_upto[lo]
            moment = moment_upto[hi] - moment_upto[lo]
            full = (hi > lo) & (mass > 0)
            mean = moment / np.where(full, mass, 1)
            first, last = points[np.minimum(lo, n - 1)], points[np.maximum(hi - 1, 0)]
            new = np.sort(np.where(full, np.clip(mean, first, last), c), axis=1)
            if np.array_equal(new, c):
                break
            c = new
    return [np.unique(row[np.isfinite(row)]) for row in c]


def _prepare(points: Any, counts: Any) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct finite points with summed positive counts."""
    p = np.asarray(points, dtype=np.float64).ravel()
    c = np.asarray(counts, dtype=np.float64).ravel()
    if p.shape != c.shape:
        raise FormatError(
            f"Expected one count per point. Got {p.size} points and {c.size} counts instead."
        )
    keep = np.isfinite(p) & (c > 0)
    p, c = p[keep], c[keep]
    if p.size == 0:
        raise FormatError(
            "Expected at least one finite point with a positive count to cluster. Got none "
            "instead; quantize only tensors with finite values."
        )
    uniq, inverse = np.unique(p, return_inverse=True)
    return uniq, np.bincount(inverse.ravel(), weights=c, minlength=uniq.size)


def weighted_kmeans(points: npt.ArrayLike, counts: npt.ArrayLike, k: int, *, sigma: float = SIGMA,
                    init: npt.ArrayLike | None = None, iters: int = ITERS, seed: int | None = None) -> np.ndarray:
    """Sorted distinct centres (at most ``k``) of ``points`` with ``counts``; deterministic.

    ``init`` (e.g. the previous checkpoint's centres) warm-starts Lloyd instead of
    k-means++, so centres move only as far as the data asks and level ids survive.
    ``seed`` defaults to a hash of the input. With ``k`` >= the number of distinct
    points, the distinct points themselves are returned (zero loss).
    """
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
        raise FormatError(f"Expected k to be an int >= 1. Got {k!r} instead.")
    if not 0 <= sigma <= 1:
        raise FormatError(f"Expected sigma in [0, 1]. Got {sigma!r} instead; the paper uses 0.2.")
    pts, cnt = _prepare(points, counts)
    if pts.size <= k:
        return pts
    weights = bucket_weights(pts, cnt, sigma)
    if init is not None:
        start = np.unique(np.asarray(init, np.float64)[np.isfinite(np.asarray(init, np.float64))])
        if 1 <= start.size <= k:
            return lloyd(pts, weights, start, iters)
    rng = np.random.default_rng(_seed(pts, weights, int(k)) if seed is None else seed)
    cdf = np.cumsum(weights) / weights.sum()
    starts = [kmeans_pp(pts, weights, int(k), rng) for _ in range(RESTARTS)]
    quantiles = np.searchsorted(cdf, (np.arange(k) + 0.5) / k)
    starts.append(np.unique(pts[np.minimum(quantiles, pts.size - 1)]))
    fits = lloyd_many(pts, weights, starts, iters)
    return min(fits, key=lambda c: (loss(pts, weights, c), c.size))


def through_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded through a tensor dtype (``F32``/``F16``/``BF16``/``F64``),
    so a value equal to a centre stays equal after the tensor is cast to its dtype."""
    return dtype_registry.get(dtype).round_float32(np.asarray(values, np.float32))


def fit_codebook(values: npt.ArrayLike | None, k: int, *, include_zero: bool, sketch: LogSketch | None = None,
                 previous: npt.ArrayLike | None = None, dtype: str = "F32", sigma: float = SIGMA) -> np.ndarray:
    """A sorted float64 codebook of at most ``k`` centres, each exact in ``dtype``.

    Fitted by weighted k-means over the log-space sketch of ``values`` (pass ``sketch``
    when it is already built; then ``values`` is not read). With ``include_zero``
    (pruning on) 0.0 is one of the centres and the other ``k - 1`` are fitted.
    ``previous`` centres warm-start the fit. No values at all gives ``[0.0]``.
    """
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < (2 if include_zero else 1):
        raise FormatError(
            f"Expected k >= {2 if include_zero else 1} levels. Got {k!r} instead."
        )
    if sketch is None:
        sketch = LogSketch.from_values(values)
    reps, counts = sketch.histogram()
    fit_k = int(k) - 1 if include_zero else int(k)
    init = None
    if previous is not None:
        prev = np.asarray(previous, np.float64)
        init = prev[prev != 0.0] if include_zero else prev
        init = init if 1 <= init.size <= fit_k else None
    nonzero = reps != 0.0
    if not nonzero.any():
        return np.zeros(1)
    if not include_zero:
        centres = weighted_kmeans(reps, counts, fit_k, sigma=sigma, init=init)
    else:  # fit k - 1 centres on the non-zero buckets, then refine them with 0.0 pinned
        centres = weighted_kmeans(reps[nonzero], counts[nonzero], fit_k, sigma=sigma, init=init)
        weights = bucket_weights(reps, counts.astype(np.float64), sigma)
        centres = lloyd(reps, weights, np.union1d(centres, [0.0]), pinned=0.0)
    # A bucket's representative may lie just past the dtype's largest value (values near a
    # float16's 65504): such a centre would round to infinity. The largest value is the
    # closest centre the dtype has there.
    big = largest_finite(dtype)
    return np.unique(through_dtype(np.clip(centres, -big, big), dtype)).astype(np.float64)


def largest_finite(dtype: str) -> float:
    """The largest finite value of a float dtype (``F32``, ``F16``, ``BF16``...)."""
    entry = dtype_registry.get(dtype)
    if entry.carried_as_bits:  # the bit pattern just below +inf's
        inf_bits = np.asarray(entry.from_float32(np.float32(np.inf))).astype(np.int64)
        return float(entry.to_float32(np.asarray(inf_bits - 1, entry.carrier)))
    return float(np.finfo(entry.carrier).max)

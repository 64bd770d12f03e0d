"""Approximate weighted 1-D k-means over sketch buckets: a codebook in milliseconds.

Clustering a few thousand bucket representatives instead of millions of weights is
what ALGORITHM.md §2 calls approximate k-means. Each bucket weighs
``W = sigma * frequency + (1 - sigma) * |centre|`` (each normalised to sum 1), so large
weights keep accurate centres even when they are rare. Initialisation is weighted
k-means++ (distance^2 x W) seeded from the data itself, so the same weights always
give the same codebook (the store's dedup relies on it); Lloyd iterations follow.
Centres come back sorted, so level ids are ordered and stable across checkpoints.
"""

from __future__ import annotations

import numpy as np
import xxhash

from inshrink_store.errors import FormatError

SIGMA = 0.2
RESTARTS = 3  # k-means++ draws per fit; each costs one Lloyd run over a few thousand buckets


def bucket_weights(points: np.ndarray, counts: np.ndarray, sigma: float = SIGMA) -> np.ndarray:
    freq = counts / counts.sum()
    mag = np.abs(points)
    mag = mag / mag.sum() if mag.sum() > 0 else np.full_like(mag, 1.0 / mag.size)
    return sigma * freq + (1.0 - sigma) * mag


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


def kmeans_pp(points: np.ndarray, weights: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Weighted k-means++: each next centre drawn with probability ~ distance^2 x weight."""
    centres = [points[rng.choice(points.size, p=weights / weights.sum())]]
    d2 = (points - centres[0]) ** 2
    for _ in range(1, k):
        score = d2 * weights
        total = score.sum()
        if total <= 0:
            break
        nxt = points[rng.choice(points.size, p=score / total)]
        centres.append(nxt)
        d2 = np.minimum(d2, (points - nxt) ** 2)
    return np.unique(np.asarray(centres, dtype=np.float64))


def lloyd(points: np.ndarray, weights: np.ndarray, centres: np.ndarray, iters: int) -> np.ndarray:
    """Weighted Lloyd iterations on sorted 1-D data; an empty cluster keeps its centre."""
    c = np.sort(np.asarray(centres, dtype=np.float64))
    for _ in range(iters):
        labels = assign(points, c)
        mass = np.bincount(labels, weights=weights, minlength=c.size)
        moment = np.bincount(labels, weights=weights * points, minlength=c.size)
        new = np.where(mass > 0, moment / np.where(mass > 0, mass, 1), c)
        new = np.sort(new)
        if np.array_equal(new, c):
            break
        c = new
    return np.unique(c)


def weighted_kmeans(points: np.ndarray, counts: np.ndarray, k: int, *, sigma: float = SIGMA,
                    init: np.ndarray | None = None, iters: int = 30) -> np.ndarray:
    """Sorted centres (at most ``k``) of bucket ``points`` with ``counts``; deterministic."""
    points = np.asarray(points, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    if points.size == 0 or counts.sum() <= 0:
        raise FormatError("Expected at least one value to cluster. Got none.")
    if k < 1:
        raise FormatError(f"Expected k >= 1. Got {k} instead.")
    order = np.argsort(points, kind="stable")
    points, counts = points[order], counts[order]
    if points.size <= k:
        return np.unique(points)
    weights = bucket_weights(points, counts, sigma)
    if init is not None and len(init) == k:
        return lloyd(points, weights, np.asarray(init, dtype=np.float64), iters)
    # a few deterministic starts (k-means++ draws and weighted quantiles); keep the lowest loss.
    rng = np.random.default_rng(_seed(points, weights, k))
    cdf = np.cumsum(weights) / weights.sum()
    starts = [kmeans_pp(points, weights, k, rng) for _ in range(RESTARTS)]
    starts.append(np.unique(points[np.minimum(np.searchsorted(cdf, (np.arange(k) + 0.5) / k), points.size - 1)]))
    fits = [lloyd(points, weights, s, iters) for s in starts]
    return min(fits, key=lambda c: (loss(points, weights, c), c.size))

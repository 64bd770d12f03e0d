"""Which codebook a tensor gets: a fresh fit, or its previous one kept or warm-started, judged
by the sketch of the values it quantizes.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

Codebook stability is the biggest lever on delta size (ALGORITHM.md §2): a tensor's previous
codebook is kept unchanged while its squared error on the quantized values is within
``codebook_reuse_tolerance`` x a fresh fit's; otherwise it is refitted warm-started from the
previous one (a fresh fit when that is worse). The errors come from the sketch alone
(:func:`sketch_sq_errors`): the test runs for every tensor of every planned candidate with a
previous codebook, and a pass over the tensor per codebook cost a fifth of a search.
Split out of :mod:`~inshrink_store.policy.partition`, which calls :func:`choose_codebook`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from inshrink_store.policy.kmeans import fit_codebook, through_dtype
from inshrink_store.policy.sketch import LogSketch, gamma_powers

__all__ = ["choose_codebook", "previous_codebook", "sketch_sq_errors"]


def _bucket_edges(sketch: LogSketch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each non-empty bucket as (low edge, high edge, count), ascending; exact zeros are one
    bucket of width 0."""
    g = sketch.gamma
    pos_hi = gamma_powers(g, sketch.pos_keys)  # not np.power: its last bit depends on the CPU
    neg_hi = gamma_powers(g, sketch.neg_keys[::-1])
    zero = sketch.zero_count > 0
    lo = np.concatenate([-neg_hi, np.zeros(int(zero)), pos_hi / g])
    hi = np.concatenate([-neg_hi / g, np.zeros(int(zero)), pos_hi])
    counts = np.concatenate([sketch.neg_counts[::-1], [sketch.zero_count] if zero else [], sketch.pos_counts])
    return lo, hi, counts.astype(np.float64)


def _segment_sq(lo: np.ndarray, hi: np.ndarray, centre: np.ndarray) -> np.ndarray:
    """The integral of ``(x - centre)^2`` over ``[lo, hi]``, as ``width * (a^2 + ab + b^2) / 3``:
    the difference of the two cubes would cancel to nothing on a bucket far narrower than its
    distance to the centre (values of 1e-15 against a centre of 0.3)."""
    a, b = lo - centre, hi - centre
    integral: np.ndarray = (hi - lo) * (a * a + a * b + b * b) / 3.0
    return integral


def sketch_sq_errors(sketch: LogSketch, codebooks: list[np.ndarray]) -> list[float]:
    """Sum of squared errors of nearest-centre quantization of the sketched values, for each
    codebook, from the sketch alone: every bucket's count spread evenly over its range, each
    piece of the range (cut where the nearest centre changes) on its nearest centre.

    Why not the values: the codebook-reuse test runs for every tensor of every planned
    candidate with a previous codebook, and a pass over the tensor per codebook was a fifth
    of a search. A bucket spans 2 % of its values' magnitude (``alpha`` 1 %); integrating
    over it, not taking one representative, keeps the sums within about 0.5 % of the values'
    on 20 k values, and within 10 % on 2 k heavy-tailed ones with 32 levels, whose few tail
    values sit anywhere in their buckets (7.2 % the worst of 1500 random draws; property-tested);
    the test compares two sums against a tolerance of 10 %. Each sum runs on this thread."""
    lo, hi, counts = _bucket_edges(sketch)
    width = hi - lo
    totals = []
    for codebook in codebooks:
        centres = np.unique(np.asarray(codebook, np.float64).astype(np.float32)).astype(np.float64)
        mids = (centres[:-1] + centres[1:]) / 2
        first = np.searchsorted(mids, lo, side="right")  # the centre nearest each bucket's low edge
        last = np.searchsorted(mids, hi, side="left")  # ... and its high edge
        total = 0.0
        whole = first == last  # one centre for the whole bucket (most buckets)
        point = width == 0
        d = lo - centres[first]
        total += float(np.einsum("i,i->", counts[point], d[point] * d[point]))
        spread = whole & ~point
        total += float(np.einsum("i,i->", counts[spread] / width[spread],
                                 _segment_sq(lo[spread], hi[spread], centres[first[spread]])))
        for b in np.flatnonzero(~whole & ~point):  # buckets cut by a midpoint: a few per centre
            cuts = np.concatenate([[lo[b]], mids[first[b]:last[b]], [hi[b]]])
            pieces = _segment_sq(cuts[:-1], cuts[1:], centres[first[b]:last[b] + 1])
            total += float(counts[b] / width[b] * pieces.sum())
        totals.append(total)
    return totals


def previous_codebook(prev: Any, dtype: str, include_zero: bool, levels: int) -> np.ndarray | None:
    """The previous codebook, rounded through ``dtype``, if it is usable as this one: a
    centre past the dtype's range (a float32 codebook of values near 3.4e38, the tensor now
    float16) would round to infinity, so such a codebook is not."""
    if prev is None:
        return None
    p = np.asarray(prev, np.float64).ravel()
    if p.size == 0 or not np.all(np.isfinite(p)):
        return None
    with np.errstate(over="ignore"):
        p = np.unique(through_dtype(p, dtype)).astype(np.float64)
    if p.size != levels or not np.all(np.isfinite(p)) or (include_zero and 0.0 not in p):
        return None
    return p


def choose_codebook(w: np.ndarray, rest: np.ndarray | None, levels: int, include_zero: bool, dtype: str,
                     previous: Any, tolerance: float, sketch: LogSketch | None = None,
                     fresh: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
    """Fresh fit, or the previous codebook when it is within ``tolerance`` of the fresh one's
    error, or a refit warm-started from the previous codebook (fresh when that is worse).
    ``rest``: the mask of the values quantized (read only when ``sketch``, theirs, is None);
    ``fresh``: the fresh fit when it is already made (:func:`fresh_codebook`)."""
    if sketch is None:
        sketch = LogSketch.from_values(w, mask=rest)
    if fresh is None:
        fresh = fit_codebook(None, levels, include_zero=include_zero, sketch=sketch, dtype=dtype)
    prev = previous_codebook(previous, dtype, include_zero, min(levels, max(fresh.size, 1)))
    if prev is None:
        prev = previous_codebook(previous, dtype, include_zero, levels)
    if prev is None:
        return fresh, False
    err_fresh, err_prev = sketch_sq_errors(sketch, [fresh, prev])
    if err_prev <= tolerance * err_fresh:
        return prev, True
    warm = fit_codebook(None, levels, include_zero=include_zero, sketch=sketch, dtype=dtype,
                        previous=prev)
    return (warm if sketch_sq_errors(sketch, [warm])[0] <= tolerance * err_fresh else fresh), False

"""Approximate weighted k-means against the exact optimum of 1-D weighted k-means (a DP).

Bound asserted: loss(weighted_kmeans) <= BOUND x the exact optimal loss, on the
sketch histograms (coarsened to <= 150 points so the O(k n^2) DP stays fast) of
gaussian, laplace, bimodal and trained-MLP weights, k in {4, 8, 16}. The measured
worst ratio is written in docs/understanding/quantization.md.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store.errors import FormatError
from inshrink_store.policy.kmeans import bucket_weights, fit_codebook, loss, weighted_kmeans
from inshrink_store.policy.sketch import LogSketch

BOUND = 1.25


def optimal_loss(points: np.ndarray, weights: np.ndarray, k: int) -> float:
    """Exact weighted 1-D k-means: DP over sorted points, clusters are contiguous runs."""
    order = np.argsort(points)
    p, w = points[order], weights[order]
    n = p.size
    cw, cwp, cwp2 = (np.concatenate([[0.0], np.cumsum(a)]) for a in (w, w * p, w * p * p))
    i, j = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    sw = cw[j] - cw[i]
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = (cwp2[j] - cwp2[i]) - np.where(sw > 0, (cwp[j] - cwp[i]) ** 2 / sw, 0.0)
    cost = np.where(i < j, np.maximum(cost, 0.0), np.inf)  # cost[i, j]: one cluster of p[i:j]
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    results = []
    for _ in range(k):
        best = np.min(best[:, None] + cost, axis=0)
        results.append(best[n])
    return float(min(results))


@functools.cache
def _trained_mlp_weights() -> np.ndarray:
    """First-layer weights of a 64-64-10 MLP after 30 full-batch Adam steps on sklearn digits."""
    torch = pytest.importorskip("torch")
    datasets = pytest.importorskip("sklearn.datasets")
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the test machine's cores are shared; threads only contend
    try:
        x, y = datasets.load_digits(return_X_y=True)
        x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(30):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model[0].weight.detach().numpy().ravel().astype(np.float64)


DISTRIBUTIONS = {
    "gaussian": lambda rng: rng.standard_normal(20_000) * 0.02,
    "laplace": lambda rng: rng.laplace(0, 0.02, 20_000),
    "bimodal": lambda rng: np.concatenate([rng.normal(-0.05, 0.01, 10_000), rng.normal(0.08, 0.02, 10_000)]),
    "trained-mlp": lambda rng: _trained_mlp_weights(),
}


def coarse_histogram(x: np.ndarray, size: int = 150) -> tuple[np.ndarray, np.ndarray]:
    """The sketch histogram merged into ``size`` runs of buckets (count-weighted means)."""
    reps, counts = LogSketch.from_values(x).histogram()
    edges = np.unique(np.linspace(0, reps.size, size + 1).astype(int))
    cnt = np.add.reduceat(counts.astype(float), edges[:-1])
    pts = np.add.reduceat(reps * counts, edges[:-1]) / cnt
    return pts, cnt


def loss_ratio(x: np.ndarray, k: int) -> float:
    pts, cnt = coarse_histogram(x)
    w = bucket_weights(pts, cnt)
    return loss(pts, w, weighted_kmeans(pts, cnt, k)) / optimal_loss(pts, w, k)


def test_dp_is_exact_on_a_tiny_case():
    # three points, two clusters: best is {0, 1} | {10}: loss = 0.5 (equal weights 1)
    assert optimal_loss(np.array([0.0, 1.0, 10.0]), np.ones(3), 2) == pytest.approx(0.5)
    assert optimal_loss(np.array([0.0, 1.0, 10.0]), np.ones(3), 3) == pytest.approx(0.0)


@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
@pytest.mark.parametrize("k", [4, 8, 16])
def test_loss_within_bound_of_the_exact_optimum(name, k):
    x = DISTRIBUTIONS[name](np.random.default_rng(1))
    ratio = loss_ratio(x, k)
    assert 1 - 1e-9 <= ratio <= BOUND, f"{name} k={k}: ratio {ratio:.3f}"


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 60), k=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_sorted_deterministic_at_most_k(n, k, seed):
    rng = np.random.default_rng(seed)
    pts, cnt = rng.standard_normal(n), rng.integers(1, 100, n).astype(float)
    a, b = weighted_kmeans(pts, cnt, k), weighted_kmeans(pts.copy(), cnt.copy(), k)
    assert np.array_equal(a, b) and np.all(np.diff(a) > 0) and 1 <= a.size <= min(k, n)
    eps = 1e-12 * np.abs(pts).max()  # centres are weighted means: inside the data's range
    assert a.min() >= pts.min() - eps and a.max() <= pts.max() + eps
    # input order does not matter
    perm = rng.permutation(n)
    assert np.array_equal(a, weighted_kmeans(pts[perm], cnt[perm], k))


def test_k_at_least_distinct_points_returns_them():
    pts = np.array([0.3, -0.1, 0.3, 0.7])  # 3 distinct
    assert weighted_kmeans(pts, np.ones(4), 3).tolist() == [-0.1, 0.3, 0.7]
    assert weighted_kmeans(pts, np.ones(4), 10).tolist() == [-0.1, 0.3, 0.7]


def test_k1_is_the_weighted_mean_and_all_equal_input():
    pts, cnt = np.array([1.0, 2.0, 4.0]), np.array([1.0, 1.0, 2.0])
    w = bucket_weights(pts, cnt)
    assert weighted_kmeans(pts, cnt, 1)[0] == pytest.approx(np.sum(w * pts) / w.sum())
    assert weighted_kmeans(np.full(5, 0.25), np.ones(5), 3).tolist() == [0.25]


def test_seed_and_warm_start():
    x = np.random.default_rng(3).laplace(0, 0.02, 5000)
    reps, counts = LogSketch.from_values(x).histogram()
    cold = weighted_kmeans(reps, counts, 8)
    assert np.array_equal(weighted_kmeans(reps, counts, 8, seed=7), weighted_kmeans(reps, counts, 8, seed=7))
    warm = weighted_kmeans(reps, counts, 8, init=cold)
    assert np.allclose(warm, cold, rtol=1e-6)  # a converged fit is a fixed point of Lloyd


def test_clear_errors():
    with pytest.raises(FormatError, match="at least one finite"):
        weighted_kmeans(np.array([]), np.array([]), 2)
    with pytest.raises(FormatError, match="k to be an int"):
        weighted_kmeans(np.ones(3), np.ones(3), 0)
    with pytest.raises(FormatError, match="one count per point"):
        weighted_kmeans(np.ones(3), np.ones(2), 2)
    with pytest.raises(FormatError, match="levels"):
        fit_codebook(np.ones(10), 1, include_zero=True)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.sampled_from([2, 4, 8, 16, 32]), zero=st.booleans(),
       dtype=st.sampled_from(["F32", "F16", "BF16"]))
def test_fit_codebook_sorted_exact_in_dtype_with_zero_when_pruning(seed, k, zero, dtype):
    x = np.random.default_rng(seed).standard_normal(3000).astype(np.float32) * 0.05
    book = fit_codebook(x, k, include_zero=zero, dtype=dtype)
    assert book.dtype == np.float64 and np.all(np.diff(book) > 0) and 1 <= book.size <= k
    assert (0.0 in book) or not zero
    cast = {"F32": np.float32, "F16": np.float16}
    if dtype in cast:
        assert np.array_equal(book.astype(cast[dtype]).astype(np.float64), book)
    else:  # bfloat16: the low 16 bits of the float32 pattern are zero
        assert np.all(book.astype(np.float32).view(np.uint32) & 0xFFFF == 0)
    assert np.array_equal(book, fit_codebook(x.copy(), k, include_zero=zero, dtype=dtype))


def test_fit_codebook_with_a_given_sketch_ignores_values_and_empty_gives_zero():
    x = np.random.default_rng(0).standard_normal(4000)
    assert np.array_equal(fit_codebook(None, 8, include_zero=False, sketch=LogSketch.from_values(x)),
                          fit_codebook(x, 8, include_zero=False))
    assert fit_codebook(np.zeros(0), 8, include_zero=True).tolist() == [0.0]


def _lloyd_by_passes(points: np.ndarray, weights: np.ndarray, centres: np.ndarray,
                     pinned: float | None = None) -> np.ndarray:
    """The textbook Lloyd iteration (assign every point, sum per cluster), as a reference."""
    from inshrink_store.policy.kmeans import ITERS, assign

    c = np.unique(centres)
    for _ in range(ITERS):
        labels = assign(points, c)
        mass = np.bincount(labels, weights=weights, minlength=c.size)
        moment = np.bincount(labels, weights=weights * points, minlength=c.size)
        new = np.where(mass > 0, moment / np.where(mass > 0, mass, 1), c)
        if pinned is not None:
            new[c == pinned] = pinned
        new = np.sort(new)
        if np.allclose(new, c, rtol=1e-12, atol=0):
            break
        c = new
    return np.unique(c)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 12), st.integers(2, 400), st.booleans())
def test_lloyd_on_runs_of_sorted_points_matches_assigning_every_point(seed, k, n, pin):
    """lloyd() sums clusters as prefix-sum differences of the sorted points; the centres are
    those of the pass-over-every-point iteration (empty clusters and a pinned zero included)."""
    from inshrink_store.policy.kmeans import lloyd

    rng = np.random.default_rng(seed)
    points = np.unique(np.round(rng.standard_t(3, n), 3))
    weights = rng.uniform(0.0, 2.0, points.size) * (rng.random(points.size) < 0.8)
    start = np.unique(np.concatenate([rng.choice(points, min(k, points.size)), [0.0] if pin else []]))
    pinned = 0.0 if pin else None
    got = lloyd(points, weights, start, pinned=pinned)
    want = _lloyd_by_passes(points, weights, start, pinned=pinned)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32"])
def test_values_at_the_dtypes_largest_give_finite_centres(dtype: str) -> None:
    """A log bucket's representative can lie past the dtype's largest value (float16 values
    near 65504): the centre is clipped there instead of rounding to infinity (found by
    hypothesis through the restore-residual test)."""
    from inshrink_store import dtypes
    from inshrink_store.policy.kmeans import largest_finite

    big = largest_finite(dtype)
    entry = dtypes.get(dtype)
    assert np.isfinite(big) and entry.round_float32(np.float32(big)) == np.float32(big)
    rng = np.random.default_rng(0)
    values = np.concatenate([np.float32(big) * rng.uniform(0.9, 1.0, 64).astype(np.float32),
                             -np.float32(big) * rng.uniform(0.9, 1.0, 64).astype(np.float32),
                             rng.standard_normal(64).astype(np.float32)])
    values = entry.round_float32(values)
    for include_zero in (False, True):
        centres = fit_codebook(values, 4, include_zero=include_zero, dtype=dtype)
        assert np.all(np.isfinite(centres)) and np.all(np.abs(centres) <= big)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 300), st.integers(1, 20), st.integers(1, 4), st.integers(1, 40),
       st.floats(-3, 2))
def test_lloyd_in_lockstep_ends_where_each_start_ends_alone(seed: int, n: int, k: int, restarts: int, iters: int,
                                                           scale: float) -> None:
    """The cold fit's starts run together (padded with +inf): every row must give exactly
    the centres its own run gives, whatever the sizes, duplicates and iteration cap."""
    from inshrink_store.policy.kmeans import lloyd, lloyd_many

    rng = np.random.default_rng(seed)
    points = np.unique(rng.standard_t(3, n) * 10.0 ** scale)
    weights = bucket_weights(points, rng.random(points.size) + (rng.random(points.size) < 0.3) * 5)
    starts = [np.sort(rng.choice(points, size=min(k, points.size), replace=bool(rng.integers(0, 2))))
              for _ in range(restarts)]
    together = lloyd_many(points, weights, starts, iters)
    alone = [lloyd(points, weights, s, iters) for s in starts]
    assert len(together) == len(alone)
    for a, b in zip(alone, together, strict=True):
        assert a.shape == b.shape and np.array_equal(a, b)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 3000), power=st.integers(0, 40),
       spikes=st.integers(0, 3))
def test_a_draw_is_numpys_choice_from_the_same_generator(seed, n, power, spikes):
    """``draw`` picks the index ``Generator.choice(n, p=p)`` picks and leaves the generator
    where ``choice`` leaves it, so k-means++ starts (and codebooks) are unchanged by it."""
    from inshrink_store.policy.kmeans import draw

    local = np.random.default_rng(seed)
    p = local.random(n) ** power
    p[local.integers(0, n, spikes)] *= 1e6  # a few points that take nearly all the mass
    p[local.random(n) < 0.3] = 0.0
    if p.sum() <= 0:
        p[0] = 1.0
    p = p / p.sum()
    ours, numpys = np.random.default_rng(seed + 1), np.random.default_rng(seed + 1)
    for _ in range(4):
        assert draw(ours, p) == int(numpys.choice(n, p=p))
    assert ours.random() == numpys.random()

"""Approximate weighted k-means against the exact optimum of 1-D weighted k-means (a DP)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store.errors import FormatError
from inshrink_store.policy.kmeans import bucket_weights, loss, weighted_kmeans
from inshrink_store.policy.sketch import LogSketch

BOUND = 1.5  # measured worst case over the distributions below is recorded in docs/understanding/quantization.md


def optimal_loss(points: np.ndarray, weights: np.ndarray, k: int) -> float:
    """Exact weighted 1-D k-means by dynamic programming over sorted points (O(k n^2))."""
    order = np.argsort(points)
    p, w = points[order], weights[order]
    n = p.size
    cw, cwp, cwp2 = (np.concatenate([[0], np.cumsum(a)]) for a in (w, w * p, w * p * p))

    def cost(i: int, j: int) -> float:  # cluster of p[i:j]
        sw = cw[j] - cw[i]
        return 0.0 if sw <= 0 else (cwp2[j] - cwp2[i]) - (cwp[j] - cwp[i]) ** 2 / sw

    best = np.full((k + 1, n + 1), np.inf)
    best[0, 0] = 0.0
    for c in range(1, k + 1):
        for j in range(c, n + 1):
            best[c, j] = min(best[c - 1, i] + cost(i, j) for i in range(c - 1, j))
    return float(min(best[c, n] for c in range(1, k + 1)))


def _real_weights() -> np.ndarray:
    torch = pytest.importorskip("torch")
    from sklearn.datasets import load_digits

    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model[0].weight.detach().numpy().ravel().astype(np.float64)


DISTRIBUTIONS = {
    "gaussian": lambda rng: rng.standard_normal(20_000) * 0.02,
    "laplace": lambda rng: rng.laplace(0, 0.02, 20_000),
    "bimodal": lambda rng: np.concatenate([rng.normal(-0.05, 0.01, 10_000), rng.normal(0.08, 0.02, 10_000)]),
}


@pytest.mark.parametrize("name", [*DISTRIBUTIONS, "trained-mlp"])
@pytest.mark.parametrize("k", [4, 8, 16])
def test_loss_within_bound_of_the_exact_optimum(name, k):
    rng = np.random.default_rng(1)
    x = _real_weights() if name == "trained-mlp" else DISTRIBUTIONS[name](rng)
    reps, counts = LogSketch.from_values(x).histogram()
    # the DP is O(k n^2): cluster a 150-bucket coarsening of the same histogram
    idx = np.linspace(0, reps.size, 151).astype(int)
    pts = np.array([np.average(reps[a:b], weights=counts[a:b]) for a, b in zip(idx[:-1], idx[1:]) if b > a])
    cnt = np.array([counts[a:b].sum() for a, b in zip(idx[:-1], idx[1:]) if b > a], dtype=float)
    w = bucket_weights(pts, cnt)
    centres = weighted_kmeans(pts, cnt, k)
    assert loss(pts, w, centres) <= BOUND * optimal_loss(pts, w, k) + 1e-18


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 60), k=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_sorted_deterministic_at_most_k(n, k, seed):
    rng = np.random.default_rng(seed)
    pts, cnt = rng.standard_normal(n), rng.integers(1, 100, n).astype(float)
    a, b = weighted_kmeans(pts, cnt, k), weighted_kmeans(pts.copy(), cnt.copy(), k)
    assert np.array_equal(a, b) and np.all(np.diff(a) > 0) and 1 <= a.size <= k


def test_edge_cases():
    assert weighted_kmeans(np.array([0.5]), np.array([3.0]), 4).tolist() == [0.5]
    assert weighted_kmeans(np.array([1.0, 1.0, 1.0]), np.ones(3), 2).tolist() == [1.0]
    warm = weighted_kmeans(np.linspace(-1, 1, 50), np.ones(50), 3, init=np.array([-0.6, 0.0, 0.6]))
    assert warm.size == 3
    with pytest.raises(FormatError):
        weighted_kmeans(np.array([]), np.array([]), 2)

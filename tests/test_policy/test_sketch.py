"""LogSketch: quantiles within relative error alpha, merge == whole, determinism.

The guarantee tested: for any finite sample and q in [0, 1], ``quantile(q)`` is within
relative error alpha of ``numpy.quantile(x, q, method="lower")`` (the sample of rank
floor(q (n - 1))), exactly 0 when that sample is 0; the slack 1e-12 covers float64
rounding of the logarithm at a bucket edge.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from inshrink_store.errors import FormatError
from inshrink_store.policy import sketch as sketch_mod
from inshrink_store.policy.sketch import ALPHA, LogSketch

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_subnormal=False, width=32)
values = hnp.arrays(np.float32, st.integers(1, 300), elements=finite | st.sampled_from([0.0, 1.0, -1.0]))
FIELDS = ("pos_keys", "pos_counts", "neg_keys", "neg_counts", "zero_count", "nonfinite_count")


def _same(a: LogSketch, b: LogSketch) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in FIELDS)


@settings(max_examples=50, deadline=None)
@given(x=values, q=st.floats(0, 1))
def test_quantile_within_relative_error_of_the_lower_sample_quantile(x, q):
    exact = float(np.quantile(x.astype(np.float64), q, method="lower"))
    got = LogSketch.from_values(x).quantile(q)
    assert abs(got - exact) <= ALPHA * abs(exact) * (1 + 1e-12)
    assert (got == 0) == (exact == 0) and np.sign(got) == np.sign(exact)


@settings(max_examples=30, deadline=None)
@given(a=values, b=values, c=values)
def test_sketches_of_shards_merged_equal_the_sketch_of_the_whole(a, b, c):
    merged = LogSketch.from_values(a).merge(LogSketch.from_values(b)).merge(LogSketch.from_values(c))
    whole = LogSketch.from_values(np.concatenate([a, b, c]))
    assert _same(merged, whole) and merged.count == a.size + b.size + c.size


@settings(max_examples=30, deadline=None)
@given(x=values, data=st.data())
def test_mask_and_magnitudes_match_direct_sketches(x, data):
    mask = data.draw(hnp.arrays(bool, x.shape))
    assert _same(LogSketch.from_values(x, mask=mask), LogSketch.from_values(x[mask]))
    assert _same(LogSketch.from_values(x).magnitudes(), LogSketch.from_values(np.abs(x)))


def test_blockwise_build_equals_one_block(monkeypatch):
    x = np.random.default_rng(5).laplace(0, 0.02, 10_000).astype(np.float32)
    x[::97] = 0.0
    one = LogSketch.from_values(x)
    monkeypatch.setattr(sketch_mod, "BLOCK", 333)
    assert _same(one, LogSketch.from_values(x))


def test_histogram_is_sorted_and_counts_everything_finite():
    x = np.array([-3.0, -3.0, 0.0, 1e-3, 2.0, np.nan, np.inf, -np.inf])
    sketch = LogSketch.from_values(x)
    reps, counts = sketch.histogram()
    assert np.all(np.diff(reps) > 0) and counts.tolist() == [2, 1, 1, 1]
    assert sketch.count == 5 and sketch.nonfinite_count == 3 and sketch.zero_count == 1
    for v in (-3.0, 1e-3, 2.0):  # every value is within alpha of its bucket representative
        assert np.min(np.abs(reps - v) / abs(v)) <= ALPHA


def test_deterministic_and_clear_errors():
    x = np.random.default_rng(0).standard_normal(10_000)
    a, b = LogSketch.from_values(x), LogSketch.from_values(x.copy())
    assert _same(a, b) and np.array_equal(a.histogram()[0], b.histogram()[0])
    with pytest.raises(FormatError, match="at least one finite"):
        LogSketch.from_values(np.array([np.nan])).quantile(0.5)
    with pytest.raises(FormatError, match="quantile in"):
        a.quantile(1.5)
    with pytest.raises(FormatError, match="equal alpha"):
        a.merge(LogSketch(alpha=0.05))
    with pytest.raises(FormatError, match="mask"):
        LogSketch.from_values(x, mask=np.ones(3, bool))


def _power_by_python_floats(gamma: float, k: int) -> float:
    """The same products on Python floats: IEEE-754 doubles, rounded the same way on every
    machine and by no vector-math library. ``gamma^(64 q + r)`` is ``gamma^r (gamma^64)^q``, each
    power a run of products; past 4096 runs of 64, binary exponentiation."""
    base = 1.0 / gamma if k < 0 else gamma
    q, r = divmod(abs(k), 64)
    if q >= 4096:
        out, e = 1.0, abs(k)
        while e:
            if e & 1:
                out *= base
            e >>= 1
            base *= base
        return out
    low = [1.0]
    for _ in range(64):
        low.append(low[-1] * base)
    high = 1.0
    for _ in range(q):
        high *= low[64]
    return low[r] * high


@pytest.mark.parametrize("alpha", [ALPHA, 0.05, 0.001])
def test_bucket_values_are_products_the_same_on_every_machine(alpha: float, monkeypatch) -> None:
    """Bucket values (representatives, and the edges of the reuse test's sums) are IEEE-754
    products: bit for bit the Python-float products', whatever other keys share the call,
    and within 3 |k| units of 2^-53 of the exact power. Not np.power, whose last bit depends
    on the CPU (SVML on AVX-512) and which seeded k-means, through a hash of the
    representatives, differently per machine."""
    from fractions import Fraction

    gamma = LogSketch(alpha=alpha).gamma
    keys = np.concatenate([np.arange(-6000, 6000, 7), [-1, 0, 1, 63, 64, -64, 2**13, -(2**13)]])
    if alpha == 0.001:  # keys past the ladders (|k| >= 64 x 4096) take binary exponentiation
        keys = np.concatenate([keys, [262_143, 262_144, -262_144, 300_001, -350_000]])
    got = sketch_mod.gamma_powers(gamma, keys)
    want = np.array([_power_by_python_floats(gamma, int(k)) for k in keys], np.float64)
    assert got.tobytes() == want.tobytes()
    assert sketch_mod.gamma_powers(gamma, keys[::-5]).tobytes() == want[::-5].tobytes()
    for k in (-5165, -1, 0, 1, 7, 63, 64, 300, 4436, -(2**13)):
        if abs(k * math.log(gamma)) > 700:  # past float64's normal range
            continue
        exact = Fraction(gamma) ** k
        value = float(sketch_mod.gamma_powers(gamma, np.array([k]))[0])
        assert abs(Fraction(value) - exact) <= (3 * abs(k) + 2) * Fraction(2) ** -53 * exact
    for k in keys[np.abs(keys) >= 64 * 4096].tolist():  # against the C library's pow, within an ulp
        value = float(sketch_mod.gamma_powers(gamma, np.array([k]))[0])
        assert abs(value / math.pow(gamma, k) - 1) <= (3 * abs(k) + 4) * 2.0**-53
    monkeypatch.setattr(np, "power", None)  # the sketch, its histogram and its quantiles never call it
    x = np.random.default_rng(0).laplace(0, 0.02, 5_000).astype(np.float32)
    sketch = LogSketch.from_values(x, alpha=alpha)
    reps, _ = sketch.histogram()
    expected = 2.0 * sketch_mod.gamma_powers(gamma, sketch.pos_keys) / (gamma + 1.0)
    assert np.array_equal(reps[reps > 0], expected)
    assert sketch.quantile(0.5) in reps


# -- the float32 road: table lookups give the float64 road's keys -------------------------

_patterns = st.integers(0, 2**32 - 1)
_f32_by_bits = hnp.arrays(np.uint32, st.integers(0, 500), elements=_patterns).map(lambda b: b.view(np.float32))
_f32_values = st.one_of(_f32_by_bits, values,
                        hnp.arrays(np.float32, st.integers(0, 300), elements=st.floats(width=32)))


def _float64_road(x: np.ndarray, mask: np.ndarray | None = None, alpha: float = ALPHA) -> LogSketch:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sketch_mod, "_f32_tables", lambda scale: None)
        return LogSketch.from_values(x, alpha, mask=mask)


def _same_typed(a: LogSketch, b: LogSketch) -> bool:
    return _same(a, b) and all(getattr(a, f).dtype == getattr(b, f).dtype == np.int64 for f in FIELDS[:4])


@settings(max_examples=150, deadline=None)
@given(x=_f32_values, data=st.data(), block=st.sampled_from([3, 64, 1 << 15]))
def test_the_float32_road_gives_the_float64_roads_sketch(x, data, block):
    """Any float32 bit pattern (zeros of both signs, denormals, NaN, infinities), any mask,
    one block or many: the same stores and counts as the float64 road, bit for bit."""
    mask = data.draw(hnp.arrays(bool, x.shape))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sketch_mod, "_F32_BLOCK", block)
        fast, fast_masked = LogSketch.from_values(x), LogSketch.from_values(x, mask=mask)
    assert _same_typed(fast, _float64_road(x))
    assert _same_typed(fast_masked, _float64_road(x, mask))


@pytest.mark.parametrize("alpha", [ALPHA, 0.005, 0.05])
def test_the_float32_tables_key_every_pattern_of_many_binades_as_log2_does(alpha):
    """Every positive float32 in [2^-1, 2^1) and [2^-40, 2^-39), and the patterns on either
    side of every bucket edge the tables hold, keyed by table as by ``log2`` (the whole
    normal range was checked once for alpha 1 %: no pattern differs)."""
    scale = 1.0 / math.log2((1 + alpha) / (1 - alpha))
    tables = sketch_mod._f32_tables(scale)
    assert tables is not None
    edges = tables.last[tables.last != sketch_mod._NEVER].astype(np.int64)
    edges = edges[edges >= sketch_mod._NORMAL_LO]
    bits = [np.arange(0x3F000000, 0x40000000, dtype=np.int64), np.arange(0x2B800000, 0x2C000000, dtype=np.int64),
            (edges[:, None] + np.arange(-2, 3)).ravel()]
    for p in bits:
        p = p[(p >= sketch_mod._NORMAL_LO) & (p < sketch_mod._NORMAL_HI)]
        row = p >> sketch_mod._F32_SHIFT
        keys = tables.code[row].astype(np.int64) + (p > tables.last[row]) - sketch_mod._FIRST_KEY + tables.kmin
        assert np.array_equal(keys, sketch_mod._f32_keys(p, scale))


def test_an_alpha_too_fine_for_the_table_takes_the_float64_road():
    x = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
    alpha = 0.001  # buckets of 0.2 %: a table row (up to 0.8 %) would hold several edges
    assert sketch_mod._f32_tables(1.0 / math.log2((1 + alpha) / (1 - alpha))) is None
    assert _same(LogSketch.from_values(x, alpha), _float64_road(x, alpha=alpha))


@settings(max_examples=100, deadline=None)
@given(x=_f32_values, data=st.data(), block=st.sampled_from([5, 1 << 16]))
def test_keyed_values_sketch_any_subset_as_from_values_does(x, data, block):
    """Codes found once, then a bincount per subset: the same sketch as ``from_values`` for
    the whole and for any mask (denormals, zeros, NaN and infinities included)."""
    masks = [None, *data.draw(st.lists(hnp.arrays(bool, x.shape), min_size=1, max_size=3))]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sketch_mod, "_CODES_BLOCK", block)
        mp.setattr(sketch_mod, "_F32_BLOCK", block)
        keyed = sketch_mod.KeyedValues(x.reshape(-1, 1) if x.size % 2 else x)
        got = [keyed.sketch(m) for m in masks]
    for mask, sketch in zip(masks, got, strict=True):
        assert _same_typed(sketch, _float64_road(x, mask))


def test_keyed_values_of_other_dtypes_fall_back_to_from_values():
    x = np.random.default_rng(4).standard_normal(1000)
    keyed = sketch_mod.KeyedValues(x)  # float64: no codes
    mask = x > 0
    assert _same(keyed.sketch(mask), LogSketch.from_values(x, mask=mask))
    with pytest.raises(FormatError, match="mask of 1000 elements"):
        sketch_mod.KeyedValues(x.astype(np.float32)).sketch(np.ones(10, bool))

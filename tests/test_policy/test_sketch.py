"""LogSketch: quantiles within relative error alpha, merge == whole, determinism."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from inshrink_store.errors import FormatError
from inshrink_store.policy.sketch import ALPHA, LogSketch

values = hnp.arrays(np.float64, st.integers(1, 400),
                    elements=st.floats(-1e6, 1e6, allow_nan=False, allow_subnormal=False))


@settings(max_examples=60, deadline=None)
@given(x=values, q=st.floats(0, 1))
def test_quantile_within_relative_error_of_the_lower_sample_quantile(x, q):
    """The sketch returns a value within alpha (relative) of the sample of rank floor(q (n-1))."""
    exact = np.quantile(x, q, method="lower")
    got = LogSketch.from_values(x).quantile(q)
    assert abs(got - exact) <= ALPHA * abs(exact) + 1e-300


@settings(max_examples=40, deadline=None)
@given(a=values, b=values)
def test_merge_equals_sketch_of_the_union(a, b):
    merged = LogSketch.from_values(a).merge(LogSketch.from_values(b))
    whole = LogSketch.from_values(np.concatenate([a, b]))
    for field in ("pos_keys", "pos_counts", "neg_keys", "neg_counts"):
        assert np.array_equal(getattr(merged, field), getattr(whole, field))
    assert merged.zero_count == whole.zero_count and merged.count == a.size + b.size


def test_histogram_is_sorted_and_counts_everything_finite():
    x = np.array([-3.0, -3.0, 0.0, 1e-3, 2.0, np.nan, np.inf])
    sketch = LogSketch.from_values(x)
    reps, counts = sketch.histogram()
    assert np.all(np.diff(reps) > 0) and counts.sum() == 5 and sketch.nonfinite_count == 2
    for v in (-3.0, 1e-3, 2.0):  # every value is within alpha of its bucket representative
        assert np.min(np.abs(reps - v) / abs(v)) <= ALPHA


def test_deterministic_and_clear_errors():
    x = np.random.default_rng(0).standard_normal(10_000)
    a, b = LogSketch.from_values(x), LogSketch.from_values(x.copy())
    assert np.array_equal(a.histogram()[0], b.histogram()[0])
    with pytest.raises(FormatError):
        LogSketch.from_values(np.array([])).quantile(0.5)
    with pytest.raises(FormatError):
        a.quantile(1.5)
    with pytest.raises(FormatError):
        a.merge(LogSketch(alpha=0.05))

"""Finite values near a float dtype's largest read back finite from quantized versions.

Why: a quantized version once read float32 values above bfloat16's largest (~3.39e38) back
as ``inf`` (46 of 65,536 uniform values over ±3.4e38, at every ``bins``): the policy layer
rounded the protected values to bfloat16 to nearest, which overflows there, and the codec
stored the infinity it was given. float16 tensors did the same at 65504 (bfloat16 rounds it
to 65536, past float16's range). A finite input must never decode to a non-finite value,
whatever the codebook size, protected fraction or protected dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import inshrink_store
from inshrink_store import dtypes
from inshrink_store.codecs.nuq import NUQ
from inshrink_store.policy import QuantConfig
from inshrink_store.policy.codebook_choice import previous_codebook
from inshrink_store.policy.kmeans import largest_finite
from inshrink_store.policy.partition import TensorInput, quantize_tensor
from inshrink_store.policy.planner import array_plan

DTYPES = ("F32", "F16", "BF16")
BINS = (2, 16, 256)


def _carrier(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as the dtype's carrier, finite ones kept finite (one step toward zero
    where rounding to nearest would overflow, as the test strategies do)."""
    entry = dtypes.get(dtype)
    with np.errstate(over="ignore"):
        carrier = np.asarray(entry.from_float32(np.asarray(values, np.float32)))
    if entry.carried_as_bits:
        over = ~np.isfinite(entry.to_float32(carrier))
        carrier = np.where(over, carrier - entry.carrier.type(1), carrier).astype(entry.carrier)
    else:
        big = np.finfo(entry.carrier).max
        carrier = np.clip(np.asarray(values, np.float32), -big, big).astype(entry.carrier)
    assert np.all(np.isfinite(entry.to_float32(carrier)))
    return carrier


def _extremes(dtype: str, n: int, seed: int) -> np.ndarray:
    """``n`` finite float32 values spread over the dtype's whole range, its largest (both
    signs) among them, in the dtype's carrier."""
    big = largest_finite(dtype)
    rng = np.random.default_rng(seed)
    values = rng.uniform(-big, big, n).astype(np.float32)
    values[:4] = [big, -big, np.nextafter(np.float32(big), np.float32(0)), -np.float32(big) * 0.999]
    return _carrier(values, dtype).reshape(256, n // 256)


@pytest.mark.parametrize("protected_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("protect", [0.0, 0.005])
@pytest.mark.parametrize("bins", BINS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_quantized_version_of_values_near_the_largest_reads_back_finite(dtype, bins, protect, protected_dtype):
    carrier = _extremes(dtype, 65_536, seed=bins)
    repo = inshrink_store.open(f"memory://extremes-{dtype}-{bins}-{protect}-{protected_dtype}", create=True)
    config = QuantConfig(bins=bins, protect=protect, protected_dtype=protected_dtype)
    repo.save({"w": carrier}, dtypes={"w": dtype}, quantize=config)
    entry = dtypes.get(dtype)
    got = entry.to_float32(np.asarray(repo.load("main")["w"]))
    bad = np.flatnonzero(~np.isfinite(got))
    assert bad.size == 0, (
        f"{bad.size} of {got.size} finite values read back non-finite, e.g. "
        f"{entry.to_float32(carrier).ravel()[bad[:3]].tolist()} -> {got.ravel()[bad[:3]].tolist()}")
    x = entry.to_float32(carrier).astype(np.float64)
    assert np.all(np.abs(got - x) <= 2 * largest_finite(dtype))  # no value crossed the range


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_previous_codebook_past_the_dtypes_range_is_not_reused():
    """A tensor saved as float32 near ±3.4e38, then as float16: the parent's codebook rounds
    to ±inf in float16, so it is refitted, not reused (it was reused, infinite centres and
    all, and its error came out NaN)."""
    big = np.float32(largest_finite("F32"))
    values = _carrier(np.linspace(-60000, 60000, 4096, dtype=np.float32), "F16").reshape(64, 64)
    t = TensorInput(values.astype(np.float32), dtype="F16", previous_codebook=(-float(big), 0.0, float(big)))
    assert previous_codebook(t.previous_codebook, "F16", include_zero=False, levels=3) is None
    q = quantize_tensor(t, QuantConfig(bins=3, protect=0.0))
    assert not q.stats["codebook_reused"]
    assert np.all(np.isfinite(q.codebook)) and np.all(np.abs(q.codebook) <= largest_finite("F16"))
    assert np.all(np.isfinite(q.values))


def _finite_elements(dtype: str) -> st.SearchStrategy[float]:
    """Any finite value of the dtype (hypothesis favours the boundaries), and its largest."""
    big = largest_finite(dtype)
    width = 16 if dtype == "F16" else 32
    return st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=width),
                     st.sampled_from([big, -big, float(np.nextafter(np.float32(big), np.float32(0)))]))


@st.composite
def _finite_tensors(draw: st.DrawFn) -> tuple[str, np.ndarray]:
    """(dtype, a 2-D carrier array of finite values) for F32, F16 and BF16."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=24))
    values = draw(hnp.arrays(np.float32, shape, elements=_finite_elements(dtype)))
    return dtype, _carrier(values, dtype)


def _bound(x: np.ndarray, codebook: np.ndarray, dtype: str, protected_dtype: str) -> np.ndarray:
    """The largest error each element may have: the distance to its nearest centre
    (quantized), or its rounding to the protected dtype and back to the element dtype
    (protected; 2^-8 of it covers bfloat16's last step toward zero at the top of the range)."""
    nearest = np.min(np.abs(x[:, None] - codebook[None, :]), axis=1)
    rounding = np.abs(x) * 2.0**-8 if protected_dtype == "bfloat16" else np.zeros_like(x)
    if dtype == "F16":
        rounding = np.maximum(rounding, np.abs(x) * 2.0**-10) + 6e-8
    return np.maximum(nearest, rounding) * (1 + 1e-6)


@settings(max_examples=80, deadline=None)
@given(tensor=_finite_tensors(), bins=st.sampled_from(BINS), protect=st.sampled_from([0.0, 0.005, 0.1]),
       protected_dtype=st.sampled_from(["bfloat16", "float32"]))
def test_any_finite_tensor_decodes_finite_and_within_the_codec_bound(tensor, bins, protect, protected_dtype):
    """What the planner plans and the codec stores, for any finite tensor: every element
    decodes finite, within its bound, and encoding again gives the same bytes."""
    dtype, carrier = tensor
    entry = dtypes.get(dtype)
    config = QuantConfig(bins=bins, protect=protect, protected_dtype=protected_dtype, min_numel=1)
    q = quantize_tensor(TensorInput(entry.to_float32(carrier), dtype=dtype), config)
    plan = array_plan(q, dtype, protected_dtype)
    codec = NUQ(list(q.codebook), tolerance=0.0, protected_dtype=protected_dtype, dtype=str(entry.codec_name))
    encoded = codec.encode(plan.values)
    got = entry.to_float32(codec.decode(encoded)).astype(np.float64)
    x = entry.to_float32(carrier).astype(np.float64).ravel()
    assert np.all(np.isfinite(got)), f"non-finite from {x[~np.isfinite(got)].tolist()}"
    bound = _bound(x, np.asarray(q.codebook, np.float64), dtype, protected_dtype)
    err = np.abs(got - x)
    assert np.all(err <= bound), f"errors {err[err > bound].tolist()} over {bound[err > bound].tolist()}"
    assert codec.encode(codec.decode(encoded)) == encoded
    again = quantize_tensor(TensorInput(entry.to_float32(carrier), dtype=dtype), config)
    assert codec.encode(array_plan(again, dtype, protected_dtype).values) == encoded

"""The dtype registry: every entry rounds float32 through itself faithfully, bfloat16 keeps
NaN payloads and -0.0, errors name the tensor, and one new entry is all a dtype needs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from inshrink_store import dtypes
from inshrink_store.errors import FormatError

FLOATS32 = hnp.arrays(np.float32, hnp.array_shapes(min_dims=0, max_dims=2, max_side=9),
                      elements=st.floats(width=32))
SETTINGS = settings(max_examples=60, deadline=None)


def _bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal values, NaN where NaN, and the same sign of zero."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return bool(np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(
        np.nan_to_num(a), np.nan_to_num(b)) and np.array_equal(np.signbit(a), np.signbit(b)))


def _bf16_nearest(x: np.ndarray) -> np.ndarray:
    """Reference: the nearer of the two bfloat16 neighbours of finite x, ties to even bits."""
    u = _bits(x).astype(np.int64)
    low = (u >> 16) << 16
    high = low + (1 << 16)
    lo_v = low.astype(np.uint32).view(np.float32).astype(np.float64)
    with np.errstate(over="ignore"):
        hi_v = high.astype(np.uint32).view(np.float32).astype(np.float64)
    xv = x.astype(np.float64)
    d_lo, d_hi = np.abs(xv - lo_v), np.abs(hi_v - xv)
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (((low >> 16) & 1) == 1))
    return np.where(pick_hi, hi_v, lo_v)


def _nearest_of(entry: dtypes.DType, x: np.ndarray, rounded: np.ndarray) -> bool:
    """Reference for a narrow float carried as bits: no finite value of the dtype is nearer."""
    every = entry.to_float32(np.arange(1 << (8 * entry.carrier.itemsize), dtype=np.uint64).astype(entry.carrier))
    finite = every[np.isfinite(every)].astype(np.float64)
    xs, rs = x.astype(np.float64).reshape(-1, 1), rounded.astype(np.float64).reshape(-1, 1)
    return bool((np.abs(xs - rs)[:, 0] <= np.abs(xs - finite).min(axis=1)).all())


REAL = sorted(n for n, d in dtypes.REGISTRY.items() if d.kind != "complex")


@pytest.mark.parametrize("name", REAL)
@SETTINGS
@given(data=st.data())
def test_every_entry_rounds_float32_through_itself(name: str, data: st.DataObject) -> None:
    entry = dtypes.get(name)
    if entry.is_float:
        x = data.draw(FLOATS32, label="x")
    else:  # an integer carrier holds only integers within its range
        info = np.iinfo(entry.carrier) if entry.kind != "bool" else None
        lo, hi = (0, 1) if info is None else (max(info.min, -(2**24)), min(info.max, 2**24))
        x = data.draw(hnp.arrays(np.float32, hnp.array_shapes(min_dims=0, max_dims=2, max_side=9),
                                 elements=st.integers(lo, hi).map(float)), label="x")
    with np.errstate(over="ignore", invalid="ignore"):
        carried = entry.from_float32(x)
        rounded = entry.to_float32(carried)
        assert carried.dtype == entry.carrier and carried.shape == np.shape(x)
        assert rounded.dtype == np.float32
        # rounding through the dtype is a projection: a second trip changes nothing
        assert _same(entry.round_float32(rounded), rounded)
        again = entry.from_float32(rounded)
        assert again.tobytes() == carried.tobytes() or np.isnan(rounded).any()
        if not entry.is_float:
            assert _same(rounded, x)  # integers in range are exact
        elif entry.name == "BF16":
            finite = np.isfinite(x) & np.isfinite(rounded)
            assert np.array_equal(rounded[finite].astype(np.float64), _bf16_nearest(x[finite]))
        elif entry.carried_as_bits:  # float8: the nearest value within its range
            every = entry.to_float32(np.arange(256, dtype=np.uint8))
            top = float(np.abs(every[np.isfinite(every)]).max())
            inside = np.isfinite(x) & (np.abs(x) <= top)
            assert _nearest_of(entry, x[inside], rounded[inside])
        else:  # numpy's own rounding to nearest is the reference
            assert _same(rounded, x.astype(entry.carrier).astype(np.float32))


@SETTINGS
@given(bits=hnp.arrays(np.uint16, hnp.array_shapes(min_dims=0, max_dims=2, max_side=9)))
def test_every_bf16_pattern_survives_float32_bit_for_bit(bits: np.ndarray) -> None:
    assert np.array_equal(dtypes.float32_to_bf16(dtypes.bf16_to_float32(bits)), bits)  # NaN payloads too


def test_bf16_keeps_nan_payloads_signs_and_negative_zero() -> None:
    assert dtypes.float32_to_bf16(np.float32(-0.0)) == 0x8000
    assert np.signbit(dtypes.bf16_to_float32(np.uint16(0x8000)))
    payloads = np.array([0x7FC0, 0xFFC1, 0x7F81, 0xFF80 | 0x7F], np.uint16)
    assert np.array_equal(dtypes.float32_to_bf16(dtypes.bf16_to_float32(payloads)), payloads)
    # a float32 NaN whose payload lies only in the dropped bits stays a NaN, sign kept
    low_payload = np.array([0x7F800001, 0xFF800001], np.uint32).view(np.float32)
    words = dtypes.float32_to_bf16(low_payload)
    assert np.isnan(dtypes.bf16_to_float32(words)).all() and list(words >> 15) == [0, 1]
    # finite values past the largest bfloat16 round to infinity, as IEEE says
    assert dtypes.float32_to_bf16(np.float32(3.4e38)) == 0x7F80
    assert dtypes.round_bf16(np.float32(1.0)) == np.float32(1.0)
    assert np.array_equal(dtypes.float32_to_bf16(np.ones(2, np.float32)), [0x3F80, 0x3F80])


def test_of_array_errors_name_the_tensor() -> None:
    with pytest.raises(FormatError, match="'opt/z'.*<U1"):
        dtypes.of_array(np.array(["a", "b"]), path="opt/z")
    with pytest.raises(FormatError, match="'w' declared BF16 to be carried as uint16"):
        dtypes.of_array(np.ones(2, np.float32), "BF16", "w")
    with pytest.raises(FormatError, match="for tensor 'w'.*'F9'"):
        dtypes.of_array(np.ones(2, np.float32), "F9", "w")
    assert dtypes.of_array(np.ones(2, np.uint16)).name == "U16"  # BF16 is never inferred
    assert dtypes.of_array(np.ones(2, np.uint16), "BF16", "w").name == "BF16"


def test_adding_an_entry_is_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    c64 = dtypes.DType("C64", np.dtype("complex64"), "complex")
    fp8 = dtypes.DType("F8E4", np.dtype("uint8"), "float", "float8_e4m3",
                       widen=lambda bits: np.asarray(bits, np.float32),
                       narrow=lambda values: np.asarray(values).astype(np.uint8))
    monkeypatch.setitem(dtypes.REGISTRY, "C64", c64)
    monkeypatch.setitem(dtypes.REGISTRY, "F8E4", fp8)
    assert dtypes.get("C64") is c64
    assert dtypes.of_array(np.ones(2, np.complex64), path="z") is c64  # inferred from its carrier
    assert dtypes.of_array(np.ones(2, np.uint8)).name == "U8"  # carried as bits: never inferred
    assert dtypes.of_array(np.ones(2, np.uint8), "F8E4", "w") is fp8
    assert dtypes.by_codec_name("float8_e4m3") is fp8 and fp8.carried_as_bits


def test_registry_shape() -> None:
    assert dtypes.CODEC_NAMES == ("float32", "float16", "bfloat16")
    assert dtypes.QUANTIZABLE_NAMES == ("F32", "F16", "BF16")
    assert {n for n, d in dtypes.REGISTRY.items() if d.carried_as_bits} == {"BF16", "F8_E4M3", "F8_E5M2"}
    with pytest.raises(FormatError, match="quantizable element dtype"):
        dtypes.by_codec_name("int8")


@pytest.mark.parametrize("name", ["C64", "C128"])
def test_complex_is_carried_as_itself_and_has_no_float32_value(name: str) -> None:
    entry = dtypes.get(name)
    z = np.array([1 + 2j, np.nan - 0j], entry.carrier)
    assert dtypes.of_array(z) is entry and not entry.is_float and not entry.quantizable
    with pytest.raises(FormatError, match=f"{name}.*complex"):
        entry.to_float32(z)

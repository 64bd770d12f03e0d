"""Property tests of the inshrink.nuq codec (numcodecs and zarr v3 front ends)."""

from __future__ import annotations

import math

import numcodecs
import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store.codecs import _payload, bf16
from inshrink_store.codecs.nuq import NUQ, NUQZarrCodec
from inshrink_store.errors import FormatError
from inshrink_store.testing import check_codec_roundtrip
from inshrink_store.testing.strategies import codebooks, float_arrays

SETTINGS = settings(max_examples=40, deadline=None)


def _bound(codebook: list[float], tolerance: float, protected: str, sample) -> float:
    """Largest possible error: the tolerance for quantized values, bf16 rounding for protected."""
    finite = sample.values[np.isfinite(sample.values)]
    biggest = float(np.abs(finite).max()) if finite.size else 0.0
    rounding = biggest * 2.0**-8 if protected == "bfloat16" else 0.0
    if sample.dtype == "float16":
        rounding = max(rounding, biggest * 2.0**-10) + 6e-8
    return (tolerance if math.isfinite(tolerance) else 0.0) + rounding + 1e-12


@SETTINGS
@given(sample=float_arrays(), codebook=codebooks(), tol=st.sampled_from([0.0, 0.05, 1.0]),
       protected=st.sampled_from(["bfloat16", "float32"]))
def test_roundtrip_error_bound_projection_and_config(sample, codebook, tol, protected):
    codec = NUQ(codebook, tolerance=tol, protected_dtype=protected, dtype=sample.dtype)
    check_codec_roundtrip(codec, sample.array, max_abs_error=_bound(codebook, tol, protected, sample),
                          element_dtype=sample.dtype)


@SETTINGS
@given(sample=float_arrays(allow_special=False, dtypes=("float32",)), codebook=codebooks(min_size=2))
def test_infinite_tolerance_gives_the_nearest_centre(sample, codebook):
    codec = NUQ(codebook, tolerance="inf", dtype="float32")
    decoded = codec.decode(codec.encode(sample.array)).reshape(sample.array.shape)
    centres = np.asarray(codec._q.centres, dtype=np.float64)
    x = sample.array.astype(np.float64)
    if not x.size:
        return
    best = np.min(np.abs(x[..., None] - centres), axis=-1)
    assert np.all(np.abs(np.abs(decoded - x) - best) <= 1e-6 * (1 + np.abs(x)))


@SETTINGS
@given(sample=float_arrays(dtypes=("float32", "bfloat16", "float16")))
def test_special_values_are_protected_and_exact(sample):
    codec = NUQ([-1.0, 0.0, 1.0], tolerance="inf", protected_dtype="float32", dtype=sample.dtype)
    decoded = codec.decode(codec.encode(sample.array)).reshape(sample.array.shape)
    v, d = sample.values, (bf16.to_float32(decoded) if sample.dtype == "bfloat16" else decoded.astype(np.float32))
    assert np.array_equal(np.isnan(v), np.isnan(d))
    inf = np.isinf(v)
    assert np.array_equal(v[inf], d[inf])


def test_values_equal_to_a_centre_take_its_id_and_others_are_protected():
    codec = NUQ([-0.5, 0.0, 0.25], tolerance=0.0)
    x = np.array([0.25, -0.5, 0.0, 0.1, np.nan], np.float32)
    payload = _payload.unpack(codec.encode(x))
    assert payload.levels == 4
    assert payload.ids.tolist() == [2, 0, 1, 3, 3]
    assert payload.protected.size == 2


def test_uint16_ids_when_more_than_254_centres():
    codebook = list(np.linspace(-1, 1, 300))
    codec = NUQ(codebook, tolerance="inf")
    x = np.linspace(-1, 1, 1000).astype(np.float32)
    payload = _payload.unpack(codec.encode(x))
    assert payload.ids.dtype == np.uint16 and payload.levels == 301
    assert np.max(np.abs(codec.decode(codec.encode(x)) - x)) <= (2 / 299) / 2 + 1e-6


def test_deterministic_bytes():
    x = np.random.default_rng(3).standard_normal(10_000).astype(np.float32)
    assert NUQ([-1, 0, 1], tolerance=0.3).encode(x) == NUQ([-1, 0, 1], tolerance=0.3).encode(x.copy())


@pytest.mark.parametrize("config", [
    {"codebook": [1.0, 0.0]}, {"codebook": []}, {"codebook": [0.0, float("nan")]},
    {"codebook": [0.0], "tolerance": -1}, {"codebook": [0.0], "dtype": "int8"},
    {"codebook": [0.0], "protected_dtype": "float16"},
    {"codebook": [1.0, 1.0001], "dtype": "float16"},  # equal after rounding to float16
])
def test_invalid_configurations_raise(config):
    with pytest.raises(FormatError):
        NUQ(**config)


def test_malformed_payloads_raise_format_error():
    codec = NUQ([-1.0, 0.0, 1.0], tolerance="inf")
    good = codec.encode(np.array([0.0, 1.0, 5.0, np.nan], np.float32))
    bad = [good[:10], good[:-1], good + b"\0", b"XXXX" + good[4:],
           good[:4] + bytes([9]) + good[5:],                      # version
           _payload.pack(5, np.zeros(4, np.uint8), "bfloat16", np.zeros(0, np.uint16)),  # wrong B
           good[:28] + bytes([7]) + good[29:]]                    # id >= B
    for data in bad:
        with pytest.raises(FormatError):
            codec.decode(data)
    with pytest.raises(FormatError):
        codec.decode(good, out=np.empty(3, np.float32))


def test_registered_with_numcodecs_and_zarr():
    assert numcodecs.get_codec({"id": "inshrink.nuq", "codebook": [0.0]}) == NUQ([0.0])
    from zarr.registry import get_codec_class

    assert get_codec_class("inshrink.nuq") is NUQZarrCodec


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_zarr_array_roundtrip_and_payload_sniffing(dtype):
    store = zarr.storage.MemoryStore()
    codec = NUQZarrCodec(codebook=[-0.5, 0.0, 0.5], dtype="bfloat16" if dtype == "bfloat16" else None)
    carrier = "uint16" if dtype == "bfloat16" else dtype
    arr = zarr.create_array(store=store, shape=(6, 4), chunks=(3, 4), dtype=carrier, serializer=codec,
                            compressors=None)
    values = np.array([[0.5, 0.0, -0.5, 0.75]] * 6, np.float32)
    data = bf16.from_float32(values) if dtype == "bfloat16" else values.astype(dtype)
    arr[...] = data
    assert np.array_equal(arr[...], data)
    raw = store._store_dict["c/0/0"].to_bytes()
    assert _payload.is_quantized_payload(raw) and _payload.unpack(raw).protected.size == 3
    reopened = zarr.open_array(store=store, mode="r")
    assert reopened.metadata.codecs[0] == codec


def test_zarr_codec_rejects_uint16_without_bfloat16_dtype():
    with pytest.raises(FormatError):
        zarr.create_array(store=zarr.storage.MemoryStore(), shape=(4,), chunks=(4,), dtype="uint16",
                          serializer=NUQZarrCodec(codebook=[0.0]), compressors=None)

"""Property tests of the inshrink.nuq codec (numcodecs and zarr v3 front ends)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numcodecs
import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store import dtypes
from inshrink_store.codecs import _payload
from inshrink_store.codecs.nuq import _BLOCK, NUQ, NUQZarrCodec, nearest_index
from inshrink_store.errors import FormatError
from inshrink_store.testing import check_codec_roundtrip
from inshrink_store.testing.strategies import codebooks, float_arrays, nuq_configs

SETTINGS = settings(max_examples=40, deadline=None)


def _bound(tolerance: float, protected: str, sample) -> float:
    """Largest possible error: the tolerance for quantized values, rounding for protected ones."""
    finite = sample.values[np.isfinite(sample.values)]
    biggest = float(np.abs(finite).max()) if finite.size else 0.0
    rounding = biggest * 2.0**-8 if protected == "bfloat16" else 0.0
    if sample.dtype == "float16":
        rounding = max(rounding, biggest * 2.0**-10) + 6e-8
    # the spec compares |x - c| <= tolerance in float32: float32(0.05) is above 0.05, and the
    # float32 subtraction rounds too (half an ulp of the difference)
    tol32 = float(np.float32(tolerance)) * (1 + 2.0**-23) if math.isfinite(tolerance) else 0.0
    return max(tolerance if math.isfinite(tolerance) else 0.0, tol32) + rounding + 1e-12


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@SETTINGS
@given(sample=float_arrays(), codebook=codebooks(), tol=st.sampled_from([0.0, 0.05, 1.0]),
       protected=st.sampled_from(["bfloat16", "float32"]))
def test_roundtrip_error_bound_projection_and_config(sample, codebook, tol, protected):
    codec = NUQ(codebook, tolerance=tol, protected_dtype=protected, dtype=sample.dtype)
    check_codec_roundtrip(codec, sample.array, max_abs_error=_bound(tol, protected, sample))


@SETTINGS
@given(config=nuq_configs(), data=st.data())
def test_every_valid_configuration_is_a_projection(config, data):
    codec = numcodecs.get_codec(dict(config))
    sample = data.draw(float_arrays(dtypes=(config["dtype"],)))
    encoded = codec.encode(sample.array)
    assert codec.encode(codec.decode(encoded)) == encoded
    assert _payload.unpack(encoded).count == sample.array.size


@SETTINGS
@given(sample=float_arrays(allow_special=False, dtypes=("float32",)),
       codebook=codebooks(min_size=2))
def test_infinite_tolerance_gives_the_nearest_centre(sample, codebook):
    codec = NUQ(codebook, tolerance="inf", dtype="float32")
    decoded = codec.decode(codec.encode(sample.array)).astype(np.float64)
    x = sample.array.astype(np.float64).reshape(-1)
    best = np.min(np.abs(x[:, None] - np.asarray(codebook)), axis=-1) if x.size else x
    assert np.all(np.abs(np.abs(decoded - x) - best) <= 1e-6 * (1 + np.abs(x)))


@pytest.mark.parametrize("k", [16, 100, 300])  # compare loop, searchsorted, uint16 ids
def test_blocked_encode_finds_the_nearest_centre_across_blocks(k):
    rng = np.random.default_rng(k)
    centres = np.unique(rng.standard_normal(k).astype(np.float32))
    x = rng.standard_normal(2 * _BLOCK + 123).astype(np.float32) * 1.5
    ids = _payload.unpack(NUQ(centres.tolist(), tolerance="inf").encode(x)).ids
    c, x64 = centres.astype(np.float64), x.astype(np.float64)
    above = np.clip(np.searchsorted(c, x64), 1, len(c) - 1)  # exact nearest: a neighbour pair
    best = np.minimum(np.abs(x64 - c[above - 1]), np.abs(x64 - c[above]))
    assert np.all(np.abs(x64 - c[ids]) <= best + 1e-6)
    assert np.array_equal(nearest_index(x, centres), ids)


@SETTINGS
@given(sample=float_arrays(dtypes=("float32", "bfloat16", "float16")))
def test_special_values_are_protected_and_exact(sample):
    codec = NUQ([-1.0, 0.0, 1.0], tolerance="inf", protected_dtype="float32", dtype=sample.dtype)
    encoded = codec.encode(sample.array)
    decoded = codec.decode(encoded)
    v = sample.values.reshape(-1)
    d = dtypes.bf16_to_float32(decoded) if sample.dtype == "bfloat16" else decoded.astype(np.float32)
    special = ~np.isfinite(v)
    assert np.array_equal(_payload.unpack(encoded).ids == 3, special)
    assert np.array_equal(_bits(decoded)[special], _bits(sample.array.reshape(-1))[special])
    assert np.array_equal(np.isnan(v), np.isnan(d))


@pytest.mark.parametrize(("dtype", "protected", "patterns"), [
    ("bfloat16", "bfloat16", [0x7FC1, 0xFF81, 0x7F81, 0x7FFF, 0x7F80, 0xFF80]),
    ("bfloat16", "float32", [0x7FC1, 0xFF81, 0x7F81, 0x7FFF, 0x7F80, 0xFF80]),
    ("float32", "float32", [0x7FC00001, 0xFFA12345, 0x7F800001, 0x7F800000]),
    ("float16", "float32", [0x7C01, 0xFE3F, 0x7E00, 0xFC00]),
    ("float32", "bfloat16", [0x7FC00000, 0xFFC10000, 0x7F800000, 0xFF800000]),
])
def test_nan_and_inf_bit_patterns_survive_where_the_protected_dtype_holds_them(dtype, protected, patterns):
    carrier = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}[dtype]
    bits = np.array(patterns, carrier)
    array = bits.view(np.float16) if dtype == "float16" else bits.view(np.float32) if dtype == "float32" else bits
    codec = NUQ([0.0, 1.0], tolerance="inf", protected_dtype=protected, dtype=dtype)
    assert _bits(codec.decode(codec.encode(array))).tolist() == bits.tolist()


@pytest.mark.parametrize(("dtype", "values", "expected"), [
    ("float32", [3.4e38, -np.finfo(np.float32).max], [dtypes.bf16_to_float32(0x7F7F), -dtypes.bf16_to_float32(0x7F7F)]),
    ("float16", [65504.0, -65504.0, 65472.0], [65280.0, -65280.0, 65280.0]),
])
def test_finite_values_stay_finite_when_bfloat16_rounding_would_overflow(dtype, values, expected):
    codec = NUQ([0.0], tolerance=0.0, protected_dtype="bfloat16", dtype=dtype)
    x = np.array(values, dtype)
    decoded = codec.decode(codec.encode(x))
    assert np.all(np.isfinite(decoded))
    assert decoded.astype(np.float64).tolist() == np.asarray(expected, np.float64).ravel().tolist()


def test_values_equal_to_a_centre_take_its_id_and_others_are_protected():
    codec = NUQ([-0.5, 0.0, 0.25], tolerance=0.0)
    x = np.array([0.25, -0.5, 0.0, 0.1, np.nan, -0.0], np.float32)
    payload = _payload.unpack(codec.encode(x))
    assert payload.levels == 4
    assert payload.ids.tolist() == [2, 0, 1, 3, 3, 1]
    assert payload.protected.size == 2


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_centres_match_after_rounding_to_the_element_dtype(dtype):
    codec = NUQ([0.1, 0.3], tolerance=0.0, dtype=dtype)  # neither is representable exactly
    x = np.array([0.1, 0.3], np.float32)
    array = dtypes.float32_to_bf16(x) if dtype == "bfloat16" else x.astype(np.float16)
    payload = _payload.unpack(codec.encode(array))
    assert payload.ids.tolist() == [0, 1] and payload.protected.size == 0


def test_tolerance_decides_between_centre_and_protection():
    codec = NUQ([0.0, 1.0], tolerance=0.1, protected_dtype="float32")
    x = np.array([0.05, 0.95, 0.2, 0.5, -0.1], np.float32)
    payload = _payload.unpack(codec.encode(x))
    assert payload.ids.tolist() == [0, 1, 2, 2, 0]
    assert payload.protected.tolist() == [np.float32(0.2), np.float32(0.5)]


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


def test_tolerance_is_json_safe():
    codec = NUQ([0.0], tolerance=math.inf)
    config = json.loads(json.dumps(codec.get_config(), allow_nan=False))
    assert config["tolerance"] == "inf"
    assert numcodecs.get_codec(config) == codec
    assert NUQZarrCodec.from_dict(NUQZarrCodec(codebook=[0.0], tolerance="inf").to_dict()).tolerance == math.inf


@pytest.mark.parametrize("config", [
    {"codebook": [1.0, 0.0]}, {"codebook": []}, {"codebook": [0.0, float("nan")]},
    {"codebook": [0.0, float("inf")]}, {"codebook": ["a"]}, {"codebook": [0.0, 1e39]},
    {"codebook": [0.0], "tolerance": -1}, {"codebook": [0.0], "tolerance": None},
    {"codebook": [0.0], "tolerance": "lots"}, {"codebook": [0.0], "tolerance": float("nan")},
    {"codebook": [0.0], "dtype": "int8"}, {"codebook": [0.0], "protected_dtype": "float16"},
    {"codebook": [1.0, 1.0001], "dtype": "float16"},  # equal after rounding to float16
    {"codebook": [1.0, 1.001], "dtype": "bfloat16"},  # equal after rounding to bfloat16
    {"codebook": list(range(65535))},
])
def test_invalid_configurations_raise(config):
    with pytest.raises(FormatError):
        NUQ(**config)
    with pytest.raises(FormatError):
        NUQZarrCodec(**config)


def test_float_input_of_another_dtype_is_rejected_not_reinterpreted():
    with pytest.raises(FormatError, match="float64"):
        NUQ([0.0]).encode(np.zeros(4, np.float64))
    with pytest.raises(FormatError, match="float32"):
        NUQ([0.0], dtype="bfloat16").encode(np.zeros(4, np.float32))
    with pytest.raises(FormatError):
        NUQ([0.0]).encode(b"\0" * 6)  # not a whole number of float32


def test_malformed_payloads_raise_format_error():
    codec = NUQ([-1.0, 0.0, 1.0], tolerance="inf")
    good = codec.encode(np.array([0.0, 1.0, 5.0, np.nan], np.float32))
    bad = [b"", good[:10], good[:-1], good + b"\0", b"XXXX" + good[4:],
           good[:4] + bytes([9]) + good[5:],                       # format version
           good[:5] + bytes([2]) + good[6:],                       # id width vs B
           good[:6] + bytes([7]) + good[7:],                       # protected dtype code
           good[:20] + (2).to_bytes(8, "little") + good[28:],      # protected count
           _payload.pack(5, np.zeros(4, np.uint8), "bfloat16", np.zeros(0, np.uint16)),  # B vs codebook
           good[:28] + bytes([7]) + good[29:]]                     # id >= B
    for data in bad:
        with pytest.raises(FormatError):
            codec.decode(data)
    with pytest.raises(FormatError):
        codec.decode(good, out=np.empty(3, np.float32))


@settings(max_examples=50, deadline=None)
@given(cut=st.integers(0, 60), flip=st.integers(0, 59), value=st.integers(0, 255))
def test_corrupted_payloads_raise_format_error_or_decode_to_the_right_size(cut, flip, value):
    codec = NUQ([-1.0, 0.0, 1.0], tolerance=0.0)
    good = codec.encode(np.array([0.0, 1.0, 5.0, np.nan, -1.0, 0.3], np.float32))
    data = bytearray(good[:cut] if cut < len(good) else good)
    if flip < len(data):
        data[flip] = value
    try:
        decoded = codec.decode(bytes(data))
    except FormatError:
        return
    assert decoded.dtype == np.float32 and decoded.size == _payload.unpack(bytes(data)).count


def test_registered_with_numcodecs_and_zarr():
    assert numcodecs.get_codec({"id": "inshrink.nuq", "codebook": [0.0]}) == NUQ([0.0])
    assert numcodecs.registry.entries["inshrink.nuq"].load() is NUQ
    from zarr.registry import get_codec_class

    assert get_codec_class("inshrink.nuq") is NUQZarrCodec


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_zarr_array_roundtrip_and_payload_sniffing(dtype):
    store = zarr.storage.MemoryStore()
    codebook = [-0.5, 0.0, 0.5]
    codec = NUQZarrCodec(codebook=codebook, dtype="bfloat16" if dtype == "bfloat16" else None)
    carrier = "uint16" if dtype == "bfloat16" else dtype
    arr = zarr.create_array(store=store, shape=(6, 4), chunks=(3, 4), dtype=carrier,
                            serializer=codec, compressors=None, fill_value=0)
    values = np.array([[0.5, 0.0, -0.5, 0.75]] * 6, np.float32)
    data = dtypes.float32_to_bf16(values) if dtype == "bfloat16" else values.astype(dtype)
    arr[...] = data
    assert np.array_equal(arr[...], data)
    raw = store._store_dict["c/0/0"].to_bytes()
    assert _payload.is_quantized_payload(raw)
    assert raw == NUQ(codebook, dtype=dtype).encode(data[:3])  # exactly the numcodecs payload
    assert _payload.unpack(raw).protected.size == 3
    reopened = zarr.open_array(store=store, mode="r")
    assert reopened.metadata.codecs[0] == codec
    assert np.array_equal(reopened[...], data)


def test_zarr_chunk_with_the_wrong_element_count_raises():
    store = zarr.storage.MemoryStore()
    arr = zarr.create_array(store=store, shape=(4,), chunks=(4,), dtype="float32",
                            serializer=NUQZarrCodec(codebook=[0.0]), compressors=None)
    arr[...] = np.full(4, 0.5, np.float32)  # not the fill value: the chunk is written
    wrong = NUQ([0.0]).encode(np.zeros(5, np.float32))
    store._store_dict["c/0"] = store._store_dict["c/0"].from_bytes(wrong)
    with pytest.raises(FormatError, match="Expected 4 elements"):
        zarr.open_array(store=store, mode="r")[...]


@pytest.mark.parametrize(("dtype", "config_dtype"), [("uint16", None), ("float32", "bfloat16"),
                                                     ("float64", None), ("float16", "float32")])
def test_zarr_codec_rejects_arrays_it_cannot_encode(dtype, config_dtype):
    with pytest.raises(FormatError):
        zarr.create_array(store=zarr.storage.MemoryStore(), shape=(4,), chunks=(4,), dtype=dtype,
                          serializer=NUQZarrCodec(codebook=[0.0], dtype=config_dtype), compressors=None)


SCHEMA = Path(__file__).resolve().parents[2] / "codecs" / "inshrink.nuq" / "schema.json"


@SETTINGS
@given(config=nuq_configs())
def test_schema_accepts_what_the_codec_writes(config):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text())
    jsonschema.validate(numcodecs.get_codec(dict(config)).get_config(), schema)
    for folder in sorted(SCHEMA.parent.glob("vectors/*/")):
        jsonschema.validate(json.loads((folder / "config.json").read_text()), schema)
    for bad in ({"tolerance": None}, {"tolerance": -1}, {"dtype": "int8"}, {"codebook": []}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**config, **bad}, schema)

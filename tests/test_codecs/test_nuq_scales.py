"""Property tests of the ``scales`` key of inshrink.nuq (per-channel scales, float32 only).

Column j of an array decodes to float32(centre * scales[j]); the payload is the unscaled
codec's. Spec: codecs/inshrink.nuq/README.md, "Channel scales".
"""

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
from hypothesis.extra import numpy as hnp

from inshrink_store.codecs import _payload
from inshrink_store.codecs.nuq import MAX_SCALES, NUQ, NUQZarrCodec, protected_values
from inshrink_store.errors import FormatError
from inshrink_store.testing.strategies import codebooks

SETTINGS = settings(max_examples=40, deadline=None)
EPS = 2.0**-24  # unit roundoff of float32
SCHEMA = Path(__file__).resolve().parents[2] / "codecs" / "inshrink.nuq" / "schema.json"


@st.composite
def scale_lists(draw: st.DrawFn, max_size: int = 6) -> list[float]:
    """1..max_size float32 scales spanning 2^-20..2^21 (so centres times scales stay normal
    floats for the bfloat16-exact codebooks of :func:`codebooks`), not only powers of two:
    the division and the product round."""
    mantissa = st.floats(1.0, 2.0, exclude_max=True, width=32)
    scale = st.builds(lambda m, e: float(np.float32(m) * np.float32(2.0**e)),
                      mantissa, st.integers(-20, 20))
    return draw(st.lists(scale, min_size=1, max_size=max_size))


@st.composite
def scaled_inputs(draw: st.DrawFn, scales: list[float], rows: int | None = None,
                  special: bool = True) -> np.ndarray:
    """float32 (rows, len(scales)) arrays (1..5 rows unless given): values u * scales[j] with
    u around the codebook's range, mixed (``special``) with any float32 (NaN, ±Inf, huge,
    subnormal, -0.0)."""
    rows = draw(st.integers(1, 5)) if rows is None else rows
    around = st.floats(-150, 150, width=32)
    u = draw(hnp.arrays(np.float32, (rows, len(scales)),
                        elements=st.one_of(around, st.floats(width=32)) if special else around))
    with np.errstate(over="ignore", invalid="ignore"):
        return (u * np.asarray(scales, np.float32)).astype(np.float32)


def scaled_centres(codebook: list[float], scales: list[float]) -> np.ndarray:
    """(K, columns) float32: what id k decodes to in column j (one float32 multiply)."""
    c = np.asarray(codebook, np.float32)[:, None]
    return np.multiply(c, np.asarray(scales, np.float32)[None, :], dtype=np.float32)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal values, NaN equal to NaN (bfloat16 storage keeps a NaN, not all of its bits)."""
    a, b = np.asarray(a, np.float32).reshape(-1), np.asarray(b, np.float32).reshape(-1)
    return bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


# -- numerics ---------------------------------------------------------------------------


@SETTINGS
@given(codebook=codebooks(min_size=2, max_size=24), scales=scale_lists(),
       protected=st.sampled_from(["bfloat16", "float32"]), data=st.data())
def test_infinite_tolerance_gives_the_nearest_scaled_centre_of_each_column(
        codebook, scales, protected, data):
    """Every finite value decodes to a scaled centre of its column no farther than the nearest
    one plus the float32 rounding of u = x / s, of the midpoints and of the products (<=
    2 eps |x| + 4 eps max|y| in all; checked with 2^-21 (|x| + max|y|)): in particular within
    half the largest gap between neighbouring scaled centres when it lies between them.
    NaN and ±Inf are protected and read back as themselves."""
    x = data.draw(scaled_inputs(scales))
    codec = NUQ(codebook, tolerance="inf", protected_dtype=protected, scales=scales)
    encoded = codec.encode(x)
    payload = _payload.unpack(encoded)
    decoded = codec.decode(encoded).reshape(x.shape)
    assert decoded.dtype == np.float32 and payload.levels == len(codebook) + 1
    ids = payload.ids.reshape(x.shape)
    finite = np.isfinite(x)
    assert np.all((ids == len(codebook)) == ~finite)  # no scaled centre overflows here
    assert _same(decoded[~finite], x[~finite])
    y = scaled_centres(codebook, scales).astype(np.float64)  # (K, columns)
    top = np.abs(y).max(axis=0)
    gaps = np.diff(y, axis=0).max(axis=0)
    for (r, j) in zip(*np.nonzero(finite), strict=True):
        xv, d = float(x[r, j]), float(decoded[r, j])
        assert d == y[ids[r, j], j], "a quantized value decodes to its column's scaled centre"
        slack = 2.0**-21 * (abs(xv) + top[j]) + 1e-37
        assert abs(xv - d) <= np.abs(xv - y[:, j]).min() + slack, (r, j, xv, d)
        if y[0, j] <= xv <= y[-1, j]:
            assert abs(xv - d) <= gaps[j] / 2 + slack


@SETTINGS
@given(codebook=codebooks(max_size=24), scales=scale_lists(),
       tolerance=st.sampled_from([0.0, "inf", 1e-6, 0.01, 1.0]),
       protected=st.sampled_from(["bfloat16", "float32"]), data=st.data())
def test_decode_then_encode_gives_the_same_bytes(codebook, scales, tolerance, protected, data):
    x = data.draw(scaled_inputs(scales))
    codec = NUQ(codebook, tolerance=tolerance, protected_dtype=protected, scales=scales)
    encoded = codec.encode(x)
    decoded = codec.decode(encoded)
    assert codec.encode(decoded) == encoded
    assert codec.encode(decoded.reshape(x.shape)) == encoded
    assert codec.encode(x.copy()) == encoded  # deterministic


@SETTINGS
@given(codebook=codebooks(max_size=24), scales=scale_lists(),
       protected=st.sampled_from(["bfloat16", "float32"]), data=st.data())
def test_tolerance_zero_keeps_scaled_centres_exactly_and_protects_the_rest(
        codebook, scales, protected, data):
    """An input of scaled centres reads back bit for bit with the ids it was built from; any
    other value reads back as it is stored protected (or as the scaled centre that stored
    value equals, the same number)."""
    rows = data.draw(st.integers(1, 5))
    ids = data.draw(hnp.arrays(np.int64, (rows, len(scales)),
                               elements=st.integers(0, len(codebook) - 1)))
    y = scaled_centres(codebook, scales)
    x = np.take_along_axis(y, ids, axis=0)
    codec = NUQ(codebook, tolerance=0.0, protected_dtype=protected, scales=scales)
    encoded = codec.encode(x)
    payload = _payload.unpack(encoded)
    assert payload.protected.size == 0
    assert np.array_equal(payload.ids.reshape(x.shape), ids)
    assert np.array_equal(_bits(codec.decode(encoded)), _bits(x).reshape(-1))

    off = data.draw(scaled_inputs(scales, rows=rows))
    mask = data.draw(hnp.arrays(bool, x.shape))
    mixed = np.where(mask, off, x).astype(np.float32)
    decoded = codec.decode(codec.encode(mixed)).reshape(x.shape)
    on_centre = np.any(mixed[None, :, :] == y[:, None, :], axis=0)
    expected = np.where(on_centre, mixed, protected_values(mixed, "float32", protected))
    assert _same(decoded, expected)


@SETTINGS
@given(codebook=codebooks(max_size=24), scales=scale_lists(),
       tolerance=st.sampled_from([0.0, "inf", 0.01]), data=st.data())
def test_an_element_depends_only_on_its_value_and_column(codebook, scales, tolerance, data):
    """Rows encode independently: splitting the chunk between rows gives the same ids, and
    all scales 1.0 give the unscaled codec's bytes (the payload layout is the same)."""
    x = data.draw(scaled_inputs(scales))
    codec = NUQ(codebook, tolerance=tolerance, scales=scales)
    whole = _payload.unpack(codec.encode(x)).ids
    cut = data.draw(st.integers(0, x.shape[0]))
    parts = [_payload.unpack(codec.encode(x[:cut])).ids if cut else np.zeros(0, whole.dtype),
             _payload.unpack(codec.encode(x[cut:])).ids if cut < x.shape[0] else np.zeros(0, whole.dtype)]
    assert np.array_equal(whole, np.concatenate(parts))
    ones = NUQ(codebook, tolerance=tolerance, scales=[1.0] * len(scales))
    if tolerance in (0.0, "inf"):  # a finite tolerance may keep a neighbour the unscaled one protects
        assert ones.encode(x) == NUQ(codebook, tolerance=tolerance).encode(x)


def test_columns_of_very_different_scale_share_one_codebook():
    """The point of the scales: one normalised codebook serves columns 10^6 apart, where the
    unscaled codec would round the narrow column to its nearest centre (0)."""
    rng = np.random.default_rng(5)
    scales = [float(v) for v in np.asarray([1e-3, 1.0, 1e3], np.float32)]
    codebook = [float(v) for v in np.linspace(-2, 2, 33)]
    u = np.clip(rng.standard_normal((200, 3)), -2, 2)  # within the codebook's range
    x = (u * np.asarray(scales)).astype(np.float32)
    scaled = NUQ(codebook, tolerance="inf", scales=scales)
    err = np.abs(scaled.decode(scaled.encode(x)).reshape(x.shape) - x).max(axis=0)
    bound = 0.0625 * np.asarray(scales) * (1 + 2.0**-20)  # half a gap of 0.125, scaled
    assert np.all(err <= bound), (err, bound)
    unscaled = NUQ(codebook, tolerance="inf")
    column = np.ascontiguousarray(x[:, 0])
    narrow = np.abs(unscaled.decode(unscaled.encode(column)) - column).max()
    assert narrow > 20 * err[0]  # every value of the narrow column read back as 0


# -- configuration ----------------------------------------------------------------------


@SETTINGS
@given(codebook=codebooks(), scales=scale_lists(max_size=40),
       tolerance=st.sampled_from([0.0, 0.25, "inf"]),
       protected=st.sampled_from(["bfloat16", "float32"]))
def test_config_survives_json_in_both_front_ends(codebook, scales, tolerance, protected):
    jsonschema = pytest.importorskip("jsonschema")
    codec = NUQ(codebook, tolerance=tolerance, protected_dtype=protected, scales=scales)
    config = codec.get_config()
    assert config["scales"] == scales
    text = json.dumps(config, allow_nan=False)
    back = NUQ.from_config(json.loads(text))
    assert back == codec and back.get_config() == config
    assert numcodecs.get_codec(json.loads(text)) == codec
    jsonschema.validate(json.loads(text), json.loads(SCHEMA.read_text()))
    x = np.asarray([scales], np.float32) * np.float32(0.3)
    assert back.encode(x) == codec.encode(x)

    zcodec = NUQZarrCodec(codebook=codebook, tolerance=tolerance, protected_dtype=protected,
                          scales=scales)
    entry = json.loads(json.dumps(zcodec.to_dict(), allow_nan=False))
    assert entry["configuration"]["scales"] == scales
    assert NUQZarrCodec.from_dict(entry) == zcodec
    assert NUQZarrCodec.from_dict(entry).scales == tuple(scales)


def test_an_unscaled_codec_writes_no_scales_key():
    for codec in (NUQ([0.0, 1.0]), NUQ([0.0, 1.0], scales=None)):
        assert "scales" not in codec.get_config() and codec.scales is None
    for zcodec in (NUQZarrCodec(codebook=[0.0, 1.0]), NUQZarrCodec(codebook=[0.0, 1.0], scales=None)):
        assert "scales" not in zcodec.to_dict()["configuration"]
    config = {"id": "inshrink.nuq", "codebook": [0.0, 1.0], "scales": None}
    assert "scales" not in NUQ.from_config(config).get_config()
    x = np.asarray([0.0, 0.4, 2.0], np.float32)
    assert NUQ([0.0, 1.0], scales=None).encode(x) == NUQ([0.0, 1.0]).encode(x)


BAD_SCALES = [
    ([0.0], r"scales\[0\] = 0\.0"),
    ([1.0, -2.0], r"scales\[1\] = -2\.0"),
    ([1.0, math.nan], r"scales\[1\] = nan"),
    ([math.inf], r"scales\[0\] = inf"),
    ([1.0, 2.0, 0.1], r"scales\[2\] = 0\.1"),     # not exactly a float32
    ([1e39], r"scales\[0\] = 1e\+39"),             # beyond float32
    ([1e-46], r"scales\[0\] = 1e-46"),             # rounds to 0 in float32
    ([], r"1\.\.65536 scales in the inshrink\.nuq configuration\. Got 0 "),
    ([1.0] * (MAX_SCALES + 1), r"1\.\.65536 scales in the inshrink\.nuq configuration\. Got 65537 "),
    (1.0, "list of numbers or null"),
    ("1.0", "list of numbers or null"),
    ({"0": 1.0}, "list of numbers or null"),
    ([[1.0, 2.0]], "list of numbers or null"),
    (["1.0"], "list of numbers or null"),
    ([True], "list of numbers or null"),
    ([1.0, None], "list of numbers or null"),
]


@pytest.mark.parametrize(("scales", "message"), BAD_SCALES, ids=lambda v: repr(v)[:24])
def test_malformed_scales_are_a_format_error_naming_them(scales, message):
    with pytest.raises(FormatError, match=message):
        NUQ([0.0, 1.0], scales=scales)
    with pytest.raises(FormatError, match=message):
        NUQ.from_config({"id": "inshrink.nuq", "codebook": [0.0, 1.0], "scales": scales})
    with pytest.raises(FormatError, match=message):
        NUQZarrCodec(codebook=[0.0, 1.0], scales=scales)
    entry = {"name": "inshrink.nuq", "configuration": {"codebook": [0.0, 1.0], "scales": scales}}
    with pytest.raises(FormatError, match=message):
        NUQZarrCodec.from_dict(entry)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_scales_are_for_float32_elements_only(dtype):
    with pytest.raises(FormatError, match=f"scales only with dtype 'float32'.*{dtype}"):
        NUQ([0.0, 1.0], dtype=dtype, scales=[1.0])
    with pytest.raises(FormatError, match=f"scales only with dtype 'float32'.*{dtype}"):
        NUQZarrCodec(codebook=[0.0, 1.0], dtype=dtype, scales=[1.0])
    with pytest.raises(FormatError, match="scales only with dtype 'float32'"):  # from the array
        zarr.create_array(store={}, shape=(2, 2), chunks=(1, 2), dtype="float16", compressors=None,
                          serializer=NUQZarrCodec(codebook=[0.0, 1.0], scales=[1.0, 2.0]))


def test_a_chunk_of_partial_rows_is_a_format_error():
    codec = NUQ([-1.0, 0.0, 1.0], tolerance="inf", scales=[1.0, 2.0, 4.0])
    for size in (1, 4, 7):
        with pytest.raises(FormatError, match=f"whole rows of 3 elements.*Got {size} elements"):
            codec.encode(np.zeros(size, np.float32))
        unscaled = NUQ([-1.0, 0.0, 1.0], tolerance="inf").encode(np.zeros(size, np.float32))
        with pytest.raises(FormatError, match=f"whole rows of 3 elements.*Got {size} elements"):
            codec.decode(unscaled)
    whole = np.asarray([[1.0, 2.0, 4.0], [-1.0, -2.0, 3.0]], np.float32)
    assert codec.decode(codec.encode(whole)).tolist() == [1, 2, 4, -1, -2, 4]


# -- zarr v3 ----------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(codebook=codebooks(max_size=16), scales=scale_lists(max_size=5),
       tolerance=st.sampled_from([0.0, "inf"]), lead=st.integers(1, 3), data=st.data())
def test_zarr_array_roundtrip_with_whole_row_chunks(codebook, scales, tolerance, lead, data):
    rows = data.draw(st.integers(1, 6))
    chunk_rows = data.draw(st.integers(1, rows))
    shape = (lead, rows, len(scales))
    x = data.draw(scaled_inputs(scales, rows=lead * rows)).reshape(shape)
    store: dict = {}
    serializer = NUQZarrCodec(codebook=codebook, tolerance=tolerance, scales=scales)
    # every chunk written: a chunk of fill values is otherwise skipped, and reads as the fill
    # value, not as what the codec makes of it (0.0 with no 0 centre)
    arr = zarr.create_array(store=store, shape=shape, chunks=(1, chunk_rows, len(scales)),
                            dtype="float32", serializer=serializer, compressors=None, fill_value=0,
                            config={"write_empty_chunks": True})
    arr[...] = x
    codec = NUQ(codebook, tolerance=tolerance, scales=scales)
    expected = codec.decode(codec.encode(x)).reshape(shape)  # rows encode independently
    reopened = zarr.open_array(store=store, mode="r")
    assert reopened.metadata.codecs[0] == serializer
    assert json.loads(store["zarr.json"].to_bytes())["codecs"][0]["configuration"]["scales"] == scales
    assert _same(reopened[...], expected)
    raw = store.get("c/0/0/0")
    if raw is not None:  # not written when the chunk equals the fill value
        assert raw.to_bytes() == codec.encode(np.ascontiguousarray(x[:1, :chunk_rows]))


@pytest.mark.parametrize(("shape", "chunks"), [
    ((4, 3), (2, 3)),     # last axis 3 != 2 scales
    ((4, 2), (4, 1)),     # chunks split the last axis
    ((2, 4, 2), (1, 4, 1)),
    ((2,), (1,)),         # 1-D: the chunk splits the only axis
    ((), ()),             # 0-d: no last axis
])
def test_zarr_refuses_an_array_that_does_not_fit_the_scales(shape, chunks):
    with pytest.raises(FormatError, match=r"one element per scale \(2\).*keep that axis whole"):
        zarr.create_array(store={}, shape=shape, chunks=chunks, dtype="float32", compressors=None,
                          serializer=NUQZarrCodec(codebook=[0.0, 1.0], scales=[1.0, 2.0]),
                          fill_value=0)


def test_zarr_chunk_holding_partial_rows_is_a_format_error():
    store: dict = {}
    arr = zarr.create_array(store=store, shape=(2, 3), chunks=(2, 3), dtype="float32",
                            serializer=NUQZarrCodec(codebook=[0.0, 1.0], scales=[1.0, 2.0, 4.0]),
                            compressors=None, fill_value=0)
    arr[...] = np.ones((2, 3), np.float32)
    store["c/0/0"] = store["c/0/0"].from_bytes(NUQ([0.0, 1.0]).encode(np.ones(4, np.float32)))
    with pytest.raises(FormatError, match="whole rows of 3 elements"):
        zarr.open_array(store=store, mode="r")[...]


# -- edges a first version got wrong: an empty chunk, an overflowing scale, centres a scale rounds
# together, a Fortran-ordered input --


def test_an_empty_array_encodes_with_scales():
    codec = NUQ([0.0, 1.0], scales=[1.0, 2.0])
    assert codec.decode(codec.encode(np.zeros((0, 2), np.float32))).size == 0


def test_a_scale_beyond_float64_is_a_format_error():
    with pytest.raises(FormatError):
        NUQ.from_config(json.loads('{"id": "inshrink.nuq", "codebook": [0.0], "scales": [1' + "0" * 400 + "]}"))


def test_centres_that_collide_when_scaled_are_refused_or_still_a_projection():
    codebook = [6.696564197540283, 6.696564674377441]  # neighbouring float32 values
    try:
        codec = NUQ(codebook, tolerance="inf", scales=[20.960268020629883])
    except FormatError:
        return
    encoded = codec.encode(np.asarray([140.36170959472656], np.float32))
    assert codec.encode(codec.decode(encoded)) == encoded


def test_a_fortran_ordered_array_is_scaled_by_its_own_columns_or_refused():
    codec = NUQ([-1.0, 0.0, 1.0], tolerance="inf", scales=[1.0, 100.0])
    x = np.asarray([[1.0, 100.0], [-1.0, -100.0], [0.0, 100.0]], np.float32)
    try:
        encoded = codec.encode(np.asfortranarray(x))
    except FormatError:
        return
    assert encoded == codec.encode(x)

"""A codebook's JSON text: each centre in the fewest digits that keep its centre in every
element dtype (``short_codebook``), so zarr.json shrinks and nothing decoded changes."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store import dtypes
from inshrink_store.codecs._nuq_config import short_codebook
from inshrink_store.codecs.nuq import NUQ, NUQZarrCodec, _element_centres, quantizer

SETTINGS = settings(max_examples=200, deadline=None)

#: any finite float64, float32 values among them (the policy's centres), and values past
#: float32's range or below its subnormals (kept as they are where they round differently)
centre = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.floats(min_value=-1.0, max_value=1.0, allow_nan=False),
    st.sampled_from([1.00048828125, -1.00048828125, 0.0, -0.0, 1e-45, 3e-8, 6.1e-5, 65504.0, 65520.0, 3.4028235e38, 1e39, -1e300]),
)
codebook = st.lists(centre, min_size=1, max_size=64).map(tuple)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


@SETTINGS
@given(codebook)
def test_every_element_dtype_decodes_the_same_centres(values: tuple[float, ...]) -> None:
    short = short_codebook(values)
    assert len(short) == len(values)
    for name in dtypes.CODEC_NAMES:
        with np.errstate(over="ignore"):
            assert _same(_element_centres(short, name), _element_centres(values, name)), name


@SETTINGS
@given(codebook)
def test_idempotent_and_never_longer_as_json(values: tuple[float, ...]) -> None:
    short = short_codebook(values)
    assert short_codebook(short) == short
    assert json.loads(json.dumps(list(short))) == list(short)  # the text parses back to the codec's values
    for s, v in zip(short, values, strict=True):
        assert len(json.dumps(s)) <= len(json.dumps(v))


def test_a_float16_midpoint_keeps_its_digits() -> None:
    """1.00048828125 lies halfway between two float16 values and rounds to the even one;
    its shortest float32 digits, 1.0004883, lie above it and would round up."""
    m = 1.00048828125
    assert np.float16(m) == 1.0 and np.float16(float(str(np.float32(m)))) != 1.0
    assert short_codebook((m, 0.5)) == (m, 0.5)


def test_a_float32_centre_takes_its_shortest_digits() -> None:
    c = float(np.float32(-0.0015899459831416607))
    assert json.dumps(c) == "-0.0015899459831416607"
    assert json.dumps(short_codebook((c,))[0]) == "-0.001589946"
    assert NUQZarrCodec(codebook=[c]).to_dict()["configuration"]["codebook"] == [-0.001589946]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, min_value=-4, max_value=4, allow_nan=False), min_size=2, max_size=32,
                unique=True).map(lambda v: tuple(sorted(v))),
       st.integers(0, 2**32 - 1))
def test_the_codecs_write_the_payload_of_the_centres_given(values: tuple[float, ...], seed: int) -> None:
    """Front ends shorten their codebook at construction; the payload is the one the
    quantizer built from the centres as given writes, and zarr.json's codebook rebuilds it."""
    data = np.random.default_rng(seed).normal(0, 2, 500).astype(np.float32)
    expected = quantizer(values, 0.0, "bfloat16", "float32", None).encode(data)
    codec = NUQ(list(values), 0.0, "bfloat16", "float32")
    assert codec.encode(data) == expected
    again = NUQ.from_config(json.loads(json.dumps(codec.get_config())))
    assert again.codebook == codec.codebook and again.encode(data) == expected
    v3 = NUQZarrCodec.from_dict(json.loads(json.dumps(NUQZarrCodec(codebook=list(values)).to_dict())))
    assert v3.codebook == tuple(codec.codebook)

"""``check_codec_roundtrip``: the one check every codec, ours or a user's, should pass."""

from __future__ import annotations

import json
from typing import Any

import numcodecs
import numpy as np


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-equal, so NaN payloads and -0.0 count."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _as_float(a: np.ndarray, dtype_name: str | None) -> np.ndarray:
    if dtype_name == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def check_codec_roundtrip(codec: Any, array: np.ndarray, max_abs_error: float | None = None,
                          element_dtype: str | None = None) -> bytes:
    """Check a numcodecs codec on ``array``; raise AssertionError saying what broke.

    - configuration survives ``json.dumps``/``json.loads`` and ``numcodecs.get_codec``;
    - encode accepts bytes, bytearray, memoryview and ndarray and gives identical bytes twice;
    - decode works with and without ``out=``; lossless codecs give the input back bit-exact;
    - with ``max_abs_error``: |decoded - input| <= bound and NaN stays NaN;
    - lossy codecs are projections: encoding the decoded array gives the same bytes.
    Returns the encoded bytes.
    """
    array = np.ascontiguousarray(array)
    config = json.loads(json.dumps(codec.get_config()))
    clone = numcodecs.get_codec(dict(config))
    assert clone == codec, f"config round trip changed the codec: {codec!r} -> {clone!r}"
    encoded = bytes(codec.encode(array))
    for kind, buf in (("bytes", array.tobytes()), ("bytearray", bytearray(array.tobytes())),
                      ("memoryview", memoryview(array.tobytes())), ("ndarray", array)):
        assert bytes(codec.encode(buf)) == encoded, f"encode({kind}) differs from encode(ndarray)"
    assert bytes(clone.encode(array)) == encoded, "a codec rebuilt from its config encodes differently"
    flat = np.asarray(codec.decode(encoded)).reshape(-1).view(array.dtype).reshape(array.shape)
    out = np.empty_like(array)
    codec.decode(encoded, out=out)
    assert _same(out, flat), "decode(out=...) differs from decode()"
    for kind, buf in (("bytearray", bytearray(encoded)), ("memoryview", memoryview(encoded))):
        got = np.asarray(codec.decode(buf)).reshape(-1).view(array.dtype).reshape(array.shape)
        assert _same(got, flat), f"decode({kind}) differs"
    if max_abs_error is None:
        assert _same(flat, array), "a lossless codec did not give its input back bit-exact"
    else:
        a, b = _as_float(array, element_dtype), _as_float(flat, element_dtype)
        nan = np.isnan(a)
        assert np.array_equal(nan, np.isnan(b)), "NaN positions changed"
        finite = ~nan
        same_inf = np.isinf(a[finite]) == np.isinf(b[finite])
        assert same_inf.all(), "infinities changed"
        fin = finite & np.isfinite(a)
        if fin.any():
            err = float(np.max(np.abs(a[fin] - b[fin])))
            assert err <= max_abs_error, f"max abs error {err} above the bound {max_abs_error}"
        assert bytes(codec.encode(flat)) == encoded, "lossy codec is not a projection (re-encode differs)"
    return encoded

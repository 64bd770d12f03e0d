"""``check_codec_roundtrip``: the one check every codec, ours or a user's, should pass.
Layer: none: test helpers outside the layers, importing only ``dtypes`` and ``codecs``.

It follows numcodecs' own shared codec test (config through JSON and the registry,
every buffer type, ``out=``) and adds what a lossy codec owes its readers: identical
bytes for identical input, an error bound that keeps NaN and infinities, and being a
projection (decoding then re-encoding changes nothing, so a store that re-saves an
unchanged tensor writes identical chunks and deduplicates them).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, TypeVar

import numcodecs
import numpy as np
from numcodecs.abc import Codec
from numcodecs.compat import ensure_contiguous_ndarray

from inshrink_store import dtypes

T = TypeVar("T")


def _call(what: str, fn: Callable[[], T]) -> T:
    """Run one codec call; an exception becomes an AssertionError saying which call failed."""
    try:
        return fn()
    except AssertionError:
        raise
    except Exception as exc:
        raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}") from exc


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def _as_input(decoded: Any, like: np.ndarray, what: str) -> np.ndarray:
    """A decoded buffer reinterpreted with the input's dtype and shape (numcodecs returns flat)."""
    arr: np.ndarray = ensure_contiguous_ndarray(decoded)  # bytes-like decodes (b"" included) as uint8
    assert arr.nbytes == like.nbytes, (
        f"{what} returned {arr.nbytes} bytes ({arr.dtype}, shape {arr.shape}); "
        f"expected {like.nbytes} bytes for a {like.dtype} array of shape {like.shape}"
    )
    return arr.reshape(-1).view(np.uint8).view(like.dtype).reshape(like.shape)


def _bits_dtype(name: Any) -> dtypes.DType | None:
    """The registry entry for an element dtype carried as bit patterns (``"bfloat16"``), else
    None: other names (a user codec's own) are read as the array's numpy values."""
    entry = next((d for d in dtypes.REGISTRY.values() if d.codec_name == name), None)
    return entry if entry is not None and entry.carried_as_bits else None


def _as_float(a: np.ndarray, element_dtype: str | None) -> np.ndarray:
    entry = _bits_dtype(element_dtype)
    return (entry.to_float32(a) if entry is not None else a).astype(np.float64)


def _check_error(array: np.ndarray, decoded: np.ndarray, bound: float, element_dtype: str | None) -> None:
    a, b = _as_float(array, element_dtype), _as_float(decoded, element_dtype)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    assert np.array_equal(nan_a, nan_b), (
        f"NaN positions changed: input NaN at {np.flatnonzero(nan_a)[:8].tolist()}, "
        f"decoded NaN at {np.flatnonzero(nan_b)[:8].tolist()}"
    )
    inf_a, inf_b = np.isinf(a), np.isinf(b)
    assert np.array_equal(inf_a, inf_b) and np.array_equal(a[inf_a], b[inf_a]), (
        f"infinities changed: input {a[inf_a | inf_b][:8].tolist()} -> "
        f"decoded {b[inf_a | inf_b][:8].tolist()}"
    )
    finite = np.isfinite(a)
    if finite.any():
        err = np.abs(a[finite] - b[finite])
        worst = int(np.argmax(err))
        assert err[worst] <= bound, (
            f"max abs error {err[worst]!r} above the bound {bound!r} "
            f"(input {a[finite][worst]!r} decoded as {b[finite][worst]!r})"
        )


def check_codec_roundtrip(codec: Codec, array: np.ndarray, max_abs_error: float | None = None,
                          element_dtype: str | None = None) -> bytes:
    """Check a numcodecs codec on ``array``; raise AssertionError saying what broke.

    - the configuration survives ``json.dumps``/``json.loads`` and ``numcodecs.get_codec``
      (the codec must be registered) and the rebuilt codec encodes identically;
    - encode accepts bytes, bytearray, memoryview and ndarray, and gives identical bytes
      every time (deterministic);
    - decode accepts bytes, bytearray and memoryview, with and without ``out=``;
    - ``max_abs_error=None``: the codec is lossless, decoding gives the input back bit-exact;
    - ``max_abs_error=e``: |decoded - input| <= e on finite values, NaN stays NaN and
      ±Inf stays the same infinity; and the codec is a projection:
      ``encode(decode(encode(x))) == encode(x)``.

    ``element_dtype="bfloat16"`` reads uint16 arrays as bfloat16 bit patterns for the
    error check; it defaults to the codec's ``dtype`` config entry when that says bfloat16.
    Returns the encoded bytes.
    """
    array = np.ascontiguousarray(array)
    config = _call("get_config()", codec.get_config)
    if element_dtype is None and _bits_dtype(config.get("dtype")) is not None:
        element_dtype = config["dtype"]
    text = _call("json.dumps(get_config())", lambda: json.dumps(config, allow_nan=False))
    clone = _call("numcodecs.get_codec(config)", lambda: numcodecs.get_codec(json.loads(text)))
    assert clone == codec, f"the config round trip changed the codec: {codec!r} -> {clone!r}"

    encoded = bytes(_call("encode(ndarray)", lambda: codec.encode(array)))
    for kind, make in (("bytes", bytes), ("bytearray", bytearray), ("memoryview", memoryview)):
        buf = make(array.tobytes())
        again = bytes(_call(f"encode({kind})", functools.partial(codec.encode, buf)))
        assert again == encoded, f"encode({kind}) gave different bytes from encode(ndarray)"
    assert bytes(codec.encode(array.copy())) == encoded, "encode is not deterministic"
    assert bytes(_call("rebuilt codec encode", lambda: clone.encode(array))) == encoded, (
        "a codec rebuilt from its config encodes differently"
    )

    decoded = _as_input(_call("decode(bytes)", lambda: codec.decode(encoded)), array, "decode(bytes)")
    for kind, make in (("bytearray", bytearray), ("memoryview", memoryview)):
        buf = make(encoded)
        got = _as_input(_call(f"decode({kind})", functools.partial(codec.decode, buf)), array,
                        f"decode({kind})")
        assert _bits(got) == _bits(decoded), f"decode({kind}) differs from decode(bytes)"
    out = np.zeros_like(array)
    _call("decode(out=...)", lambda: codec.decode(encoded, out=out))
    assert _bits(out) == _bits(decoded), "decode(out=...) did not fill out with the decoded array"

    if max_abs_error is None:
        assert _bits(decoded) == _bits(array), (
            "a lossless codec (max_abs_error=None) did not give its input back bit-exact; "
            "pass max_abs_error for a lossy codec"
        )
        return encoded
    _check_error(array, decoded, max_abs_error, element_dtype)
    again = bytes(_call("encode(decoded)", lambda: codec.encode(decoded)))
    assert again == encoded, "the lossy codec is not a projection: encode(decode(encode(x))) != encode(x)"
    return encoded

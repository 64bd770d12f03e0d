"""The shipped test helpers catch broken codecs, and their strategies draw what they promise."""

from __future__ import annotations

import re
from pathlib import Path

import numcodecs
import numpy as np
import pytest
from hypothesis import find, given, settings
from numcodecs.abc import Codec
from numcodecs.compat import ensure_contiguous_ndarray, ndarray_copy
from numcodecs.registry import register_codec

from inshrink_store import dtypes
from inshrink_store.codecs.nuq import NUQ
from inshrink_store.testing import check_codec_roundtrip, codebooks, float_arrays, nuq_configs

SETTINGS = settings(max_examples=30, deadline=None)
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "testing-your-codec.md"
GRID = np.array([[0.0, 0.5], [-1.25, 3.0]], np.float32)  # exact in every codec below


class Fixed(Codec):
    """A correct lossy codec: float32 -> int32 multiples of 2**-bits."""

    codec_id = "tests.fixed"

    def __init__(self, bits: int = 8) -> None:
        self.bits = bits

    def _values(self, buf):  # noqa: ANN001, ANN202
        return ensure_contiguous_ndarray(buf).view("<f4")

    def encode(self, buf):  # noqa: ANN001, ANN201
        return np.rint(self._values(buf) * np.float32(2.0**self.bits)).astype("<i4").tobytes()

    def decode(self, buf, out=None):  # noqa: ANN001, ANN201
        q = ensure_contiguous_ndarray(buf).view("<i4")
        return ndarray_copy((q / 2.0**self.bits).astype("<f4"), out)


class Unregistered(Fixed):
    codec_id = "tests.unregistered"


class ForgetsConfig(Fixed):
    codec_id = "tests.forgets_config"

    def get_config(self):  # noqa: ANN201
        return {"id": self.codec_id}


class Nondeterministic(Fixed):
    codec_id = "tests.nondeterministic"
    calls = 0

    def encode(self, buf):  # noqa: ANN001, ANN201
        type(self).calls += 1
        return super().encode(buf) + bytes([type(self).calls % 256] * 4)

    def decode(self, buf, out=None):  # noqa: ANN001, ANN201
        return super().decode(bytes(buf)[:-4], out)


class RejectsMemoryview(Fixed):
    codec_id = "tests.rejects_memoryview"

    def encode(self, buf):  # noqa: ANN001, ANN201
        if isinstance(buf, memoryview):
            raise TypeError("no memoryviews here")
        return super().encode(buf)


class IgnoresOut(Fixed):
    codec_id = "tests.ignores_out"

    def decode(self, buf, out=None):  # noqa: ANN001, ANN201
        return super().decode(buf)


class Float64Decode(Fixed):
    codec_id = "tests.float64_decode"

    def decode(self, buf, out=None):  # noqa: ANN001, ANN201
        return super().decode(buf).astype(np.float64)


class Float16(Fixed):
    """float16 storage; ``nan_to_num`` variant loses NaN, ``abs`` variant flips -inf."""

    codec_id = "tests.float16"

    def __init__(self, bits: int = 0, mode: str = "plain") -> None:
        super().__init__(bits)
        self.mode = mode

    def encode(self, buf):  # noqa: ANN001, ANN201
        x = self._values(buf).astype("<f2")
        if self.mode == "nan_to_num":
            x = np.nan_to_num(x, nan=0.0, posinf=np.inf, neginf=-np.inf)
        elif self.mode == "abs":
            x = np.where(np.isinf(x), np.abs(x), x)
        return x.tobytes()

    def decode(self, buf, out=None):  # noqa: ANN001, ANN201
        return ndarray_copy(ensure_contiguous_ndarray(buf).view("<f2").astype("<f4"), out)


class Drifts(Fixed):
    """Within its error bound but not a projection: every decode moves the value up."""

    codec_id = "tests.drifts"

    def encode(self, buf):  # noqa: ANN001, ANN201
        return (self._values(buf) + np.float32(2.0**-10)).tobytes()

    def decode(self, buf, out=None):  # noqa: ANN001, ANN201
        return ndarray_copy(ensure_contiguous_ndarray(buf).view("<f4").copy(), out)


for _cls in (Fixed, ForgetsConfig, Nondeterministic, RejectsMemoryview, IgnoresOut, Float64Decode,
             Float16, Drifts):
    register_codec(_cls)


def test_a_correct_lossy_codec_passes_and_returns_the_encoded_bytes():
    assert check_codec_roundtrip(Fixed(8), GRID, max_abs_error=2.0**-9) == Fixed(8).encode(GRID)


@SETTINGS
@given(sample=float_arrays())
def test_a_lossless_codec_passes_on_every_dtype_and_special_value(sample):
    # (numcodecs 0.16 Zstd fails to decode its own encoding of an empty buffer: the check finds it)
    check_codec_roundtrip(numcodecs.Zlib(level=1), sample.array)


SPECIALS = np.array([np.nan, np.inf, -np.inf, 1.5], np.float32)


@pytest.mark.parametrize(("codec", "array", "bound", "message"), [
    (Unregistered(), GRID, 1e-3, "get_codec.*UnknownCodecError"),
    (ForgetsConfig(4), GRID, 1e-3, "rebuilt from its config encodes differently"),
    (Nondeterministic(), GRID, 1e-3, "different bytes|not deterministic"),
    (RejectsMemoryview(), GRID, 1e-3, r"encode\(memoryview\) raised TypeError"),
    (IgnoresOut(), GRID, 1e-3, "did not fill out"),
    (Float64Decode(), GRID, 1e-3, r"decode\(bytes\) returned 32 bytes"),
    (Fixed(8), GRID + np.float32(0.001), None, "lossless codec"),
    (Fixed(2), GRID + np.float32(0.1), 2.0**-9, "max abs error"),
    (Float16(mode="nan_to_num"), SPECIALS, 0.0, "NaN positions changed"),
    (Float16(mode="abs"), SPECIALS, 0.0, "infinities changed"),
    (Drifts(), GRID, 1e-3, "not a projection"),
])
def test_broken_codecs_fail_with_a_message_naming_the_problem(codec, array, bound, message):
    with pytest.raises(AssertionError, match=message):
        check_codec_roundtrip(codec, array, max_abs_error=bound)
    assert check_codec_roundtrip(Float16(), SPECIALS, max_abs_error=0.0)  # the sound variant passes


def test_bfloat16_arrays_are_read_as_bfloat16_for_the_error_bound():
    codec = NUQ([0.0], tolerance="inf", dtype="bfloat16")
    ones = dtypes.float32_to_bf16(np.ones(3, np.float32))  # 0x3F80: 16256 as an integer, 1.0 as bf16
    check_codec_roundtrip(codec, ones, max_abs_error=1.0)  # element dtype taken from the config
    with pytest.raises(AssertionError, match="max abs error"):
        check_codec_roundtrip(codec, ones, max_abs_error=0.5)


@SETTINGS
@given(sample=float_arrays(allow_special=False, max_magnitude=50.0))
def test_float_arrays_without_specials_are_finite_and_bounded(sample):
    carrier = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[sample.dtype]
    assert sample.array.dtype == carrier
    assert sample.values.dtype == np.float32 and sample.values.shape == sample.array.shape
    assert np.all(np.isfinite(sample.values)) and np.all(np.abs(sample.values) <= 50.0)


@pytest.mark.parametrize(("what", "condition"), [
    ("a 0-d array", lambda s: s.array.ndim == 0),
    ("an empty array", lambda s: s.array.size == 0 and s.array.ndim > 0),
    ("a bfloat16 NaN", lambda s: s.dtype == "bfloat16" and bool(np.isnan(s.values).any())),
    ("a float16 -inf", lambda s: s.dtype == "float16" and bool((s.values == -np.inf).any())),
    ("a float32 -0.0", lambda s: s.dtype == "float32" and bool(np.signbit(s.values[s.values == 0]).any())),
])
def test_float_arrays_reach_the_edge_cases(what, condition):
    sample = find(float_arrays(), condition, settings=settings(max_examples=2000, database=None))
    assert condition(sample), what


@SETTINGS
@given(codebook=codebooks(min_size=2, max_size=30))
def test_codebooks_are_ascending_and_valid_for_every_element_dtype(codebook):
    assert len(codebook) >= 2 and all(a < b for a, b in zip(codebook, codebook[1:], strict=False))
    for dtype in ("float32", "float16", "bfloat16"):
        assert NUQ(codebook, dtype=dtype).codebook == codebook


@SETTINGS
@given(config=nuq_configs())
def test_nuq_configs_build_a_codec_that_reports_the_same_config(config):
    assert numcodecs.get_codec(dict(config)).get_config() == config


def _guide_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)


@pytest.mark.parametrize("index", range(len(_guide_snippets())))
def test_the_testing_guide_examples_run_and_their_tests_pass(index):
    namespace: dict = {"__name__": f"guide_example_{index}"}
    exec(compile(_guide_snippets()[index], f"{GUIDE.name}[{index}]", "exec"), namespace)
    tests = [fn for name, fn in namespace.items() if name.startswith("test_") and callable(fn)]
    assert tests, "the example defines no test"
    for fn in tests:
        fn()

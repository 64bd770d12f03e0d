"""The quantized path's compiled loops give the numpy code's results, bit for bit.

Decoded values, a payload's checks and sketch counts must not depend on whether numba is
installed: values are what a restore hands back, and a sketch decides a codebook. Each
case runs the public function twice on the same input, once with the loops and once with
``INSHRINK_KERNELS=numpy``, on arrays above the loops' size gate, with the special values
(NaN, infinities, signed zeros, denormals) mixed in. Without numba the loops' tests skip.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store import dtypes
from inshrink_store.codecs import _kernels, _payload, _quant_loops
from inshrink_store.codecs.nuq import quantizer
from inshrink_store.errors import FormatError
from inshrink_store.policy.sketch import KeyedValues, LogSketch
from tests.test_codecs.kernel_switch import kernels_env

#: elements enough for every loop's gate (float32 values, one-byte ids)
N = _kernels.KERNEL_MIN + 4099


def _numpy(on: bool) -> AbstractContextManager[None]:
    return kernels_env("numpy" if on else None)


@pytest.fixture(scope="module", autouse=True)
def loops() -> object:
    pytest.importorskip("numba")
    with _numpy(False):
        loaded = _quant_loops.active()
    assert loaded is not None, "numba is installed, so the compiled loops must load"
    return loaded


def _values(seed: int, kind: str, specials: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = {"normal": rng.standard_normal(N), "heavy": rng.standard_t(2, N) * 1e-3,
         "skewed": rng.lognormal(-6, 3, N) * rng.choice([-1, 1], N)}[kind].astype(np.float32)
    if specials:
        at = rng.choice(N, 64, replace=False)
        x[at] = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-42, -1e-42, 3.4e38] * 8, np.float32)
    return x


def _both(fn):  # noqa: ANN001, ANN202 - a test helper: fn's result with the loops and without
    with _numpy(False):
        fast = fn()
    with _numpy(True):
        slow = fn()
    return fast, slow


cases = st.tuples(st.integers(0, 2**20), st.sampled_from(["normal", "heavy", "skewed"]), st.booleans())


@settings(max_examples=20, deadline=None)
@given(case=cases, levels=st.sampled_from([4, 16, 255]), dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
       tolerance=st.sampled_from([0.0, 1e-3, float("inf")]))
def test_encoded_and_decoded_bytes_are_the_same_with_and_without_the_loops(
        case: tuple[int, str, bool], levels: int, dtype: str, tolerance: float) -> None:
    x = _values(*case)
    element = dtypes.by_codec_name(dtype)
    finite = x[np.isfinite(x)]
    spread = np.quantile(finite, np.linspace(0.001, 0.999, levels - 1)).astype(np.float32)
    codebook = tuple(float(v) for v in np.unique(element.to_float32(element.from_float32(spread))))
    q = quantizer(codebook, tolerance, "bfloat16" if dtype == "bfloat16" else "float32", dtype)
    with np.errstate(over="ignore"):  # 3.4e38 is inf in 16 bits
        carrier = q.element.from_float32(x) if dtype != "float32" else x
    carrier = np.asarray(carrier).astype(q.table.dtype, copy=False)
    fast, slow = _both(lambda: q.encode(carrier))
    assert fast == slow
    back_fast, back_slow = _both(lambda: q.decode(fast))
    assert back_fast.dtype == back_slow.dtype
    assert np.array_equal(back_fast.view(np.uint8), back_slow.view(np.uint8))  # bits, NaN payloads included


@pytest.mark.parametrize("bad", ["id", "count"])
def test_a_damaged_payload_is_refused_alike_with_and_without_the_loops(bad: str) -> None:
    x = _values(3, "normal", False)
    q = quantizer((-1.0, 0.0, 1.0), 0.25, "float32", "float32")
    payload = bytearray(q.encode(x))
    header = _payload.HEADER_SIZE
    if bad == "id":
        payload[header + 5] = 9  # above B - 1
    else:
        ids = np.frombuffer(bytes(payload[header:header + N]), np.uint8)
        kept = int(np.flatnonzero(ids != q.levels - 1)[0])
        payload[header + kept] = q.levels - 1  # one protected id more than the header counts
    errors = []
    for numpy_only in (False, True):
        with _numpy(numpy_only), pytest.raises(FormatError) as caught:
            q.decode(bytes(payload))
        errors.append(str(caught.value))
    assert errors[0] == errors[1]


@settings(max_examples=25, deadline=None)
@given(case=cases, masked=st.booleans())
def test_sketches_are_the_same_with_and_without_the_loops(case: tuple[int, str, bool], masked: bool) -> None:
    x = _values(*case)
    mask = np.random.default_rng(case[0] + 3).random(N) < 0.7 if masked else None
    assert _quant_loops.for_bytes(x.nbytes) is not None  # the loops do run here
    fast, slow = _both(lambda: LogSketch.from_values(x, mask=mask))
    keyed_fast, keyed_slow = _both(lambda: KeyedValues(x).sketch(mask))
    for other in (fast, keyed_fast, keyed_slow):
        assert _fields(other) == _fields(slow)


def _fields(sketch: LogSketch) -> tuple[object, ...]:
    return (sketch.alpha, sketch.pos_keys.tolist(), sketch.pos_counts.tolist(), sketch.neg_keys.tolist(),
            sketch.neg_counts.tolist(), sketch.zero_count, sketch.nonfinite_count)


def test_a_second_process_loads_every_loop_from_numbas_cache() -> None:
    """Regression: the sketch loops called a compiled helper held in a closure cell, which numba
    keys its cache by and which pickles differently in every process, so both were compiled
    afresh at every start (~0.3 CPU-s of each save's process) and a new file joined the cache
    beside the package each time. With a writable cache, a second start saves nothing."""
    import subprocess
    import sys

    code = ("from inshrink_store.codecs import _kernels, _quant_loops\n"
            "assert _quant_loops.active() is not None and _kernels.active() is not None")
    env = {**os.environ, "NUMBA_DEBUG_CACHE": "1"}
    env.pop(_kernels.ENV, None)
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                           timeout=300) for _ in range(2)]
    if "[cache] index loaded" not in runs[1].stdout + runs[1].stderr:
        pytest.skip("numba found no writable place for its cache here: nothing to load")
    saved = [line for line in (runs[1].stdout + runs[1].stderr).splitlines()
             if ("_quant_loops" in line or "_kernels" in line) and "saved" in line]
    assert not saved, f"a second process compiled loops again: {saved}"

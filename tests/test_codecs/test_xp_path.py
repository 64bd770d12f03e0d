"""The array-namespace path on the host: the code a GPU runs, covered without one.

The codecs and the sketch take numpy or CuPy arrays and run one code path
(``inshrink_store.codecs._xp``); on a device, two steps are fused kernels
(``inshrink_store.codecs._gpu``). Here, with numpy only:

- ``array_namespace`` recognises arrays without importing CuPy, and nothing in the package
  imports CuPy when imported;
- everything the device path does around its kernels (rejected elements found in element
  order, settled on the host, scattered back, the payload assembled and parsed in the ids'
  library, the sketch's histogram turned into stores) gives the host path's bytes when the
  kernels are replaced by numpy emulations of what their docstring says they compute;
- the facts the kernels' byte identity rests on hold: the midpoints are strictly ascending
  (so the kernel's binary search counts what numpy's compare loop counts), widening is
  exact, and every float32 sketch key is robust to the last-ulp rounding of ``log2``.

The kernels themselves are compared with the host in ``tests/test_gpu`` (needs a GPU).
"""

from __future__ import annotations

import ast
import math
import struct
import subprocess
import sys
import types
from decimal import Decimal, localcontext
from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from inshrink_store import dtypes
from inshrink_store.codecs import _gpu, _payload, vdelta
from inshrink_store.codecs._xp import array_namespace, like, to_host
from inshrink_store.codecs.nuq import NUQZarrCodec, _nearest_into, midpoints, quantizer
from inshrink_store.errors import FormatError, InvalidInputError, MissingDependencyError
from inshrink_store.policy import sketch as sketch_mod
from inshrink_store.policy.sketch import ALPHA, LogSketch
from inshrink_store.testing.strategies import codebooks, float_arrays, nuq_configs

SETTINGS = settings(max_examples=40, deadline=None)
PACKAGE = Path(__file__).resolve().parents[2] / "inshrink_store"


# -- the namespace ------------------------------------------------------------------------


def test_host_inputs_are_numpy():
    for value in (np.zeros(3, np.float32), np.float32(1), b"abc", bytearray(2),
                  memoryview(b"ab"), [1.0, 2.0], None):
        assert array_namespace(value) is np
    a = np.arange(4)
    assert to_host(a) is a and like(a, np) is a  # no copy on the host


def test_a_cupy_array_is_recognised_from_sys_modules_and_never_mixed(monkeypatch):
    fake = types.ModuleType("cupy")

    class ndarray:  # noqa: N801 - CuPy's spelling
        nbytes = 24  # small: copied by get(), not through pinned memory

        def get(self) -> np.ndarray:
            return np.arange(3)

    fake.ndarray = ndarray  # type: ignore[attr-defined]
    fake.asarray = lambda host: ("on device", host)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", fake)
    device = ndarray()
    assert array_namespace(device) is fake
    assert array_namespace(b"header", device) is fake
    assert np.array_equal(to_host(device), np.arange(3))
    assert like(np.ones(1), fake)[0] == "on device"
    with pytest.raises(InvalidInputError, match="one library"):
        array_namespace(device, np.zeros(2))


def test_no_module_of_the_package_imports_cupy_itself():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "cupy"]
    assert offenders == []  # _gpu.py loads it through errors.require, inside functions


def test_importing_the_codecs_and_the_policy_never_imports_cupy():
    # zarr tries CuPy for its own GPU buffers when imported, so it is imported first; any
    # later attempt comes from our modules
    script = """
import sys, zarr
attempts = []
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'cupy':
            attempts.append(name)
            raise ImportError('blocked')
sys.meta_path.insert(0, Block())
import inshrink_store, inshrink_store.repository, inshrink_store.policy.sketch
import inshrink_store.codecs.nuq, inshrink_store.codecs.vdelta, inshrink_store.codecs._gpu
assert attempts == [], attempts
print('ok')
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.skipif(_gpu.available(), reason="CuPy and a device are present")
def test_without_cupy_the_gpu_module_says_why_and_names_the_extra():
    assert not _gpu.available()
    assert _gpu.why_unavailable()
    if "not installed" in (_gpu.why_unavailable() or ""):
        with pytest.raises(MissingDependencyError, match=r"inshrink-store\[gpu\]"):
            _gpu.nearest_index(np.zeros(3, np.float32), np.zeros(0, np.float32), np.dtype("u1"))


# -- level assignment ---------------------------------------------------------------------


def _adjacent_heavy_codebooks() -> st.SearchStrategy[np.ndarray]:
    """float32 codebooks with runs of neighbouring floats, where midpoints round onto centres."""
    start = st.floats(-1e3, 1e3, width=32, allow_subnormal=True)
    return st.lists(st.tuples(start, st.integers(1, 4)), min_size=1, max_size=90).map(
        lambda runs: np.unique(np.concatenate([
            np.float32(s) + np.arange(k, dtype=np.float32) * np.spacing(np.float32(s))
            for s, k in runs]).astype(np.float32)))


@SETTINGS
@given(centres=_adjacent_heavy_codebooks())
def test_midpoints_are_strictly_ascending_so_a_binary_search_counts_like_the_compare_loop(centres):
    mids = midpoints(centres)
    assert np.all(np.diff(mids) > 0)
    assert np.all(mids >= centres[:-1]) and np.all(mids < centres[1:])


@SETTINGS
@given(centres=_adjacent_heavy_codebooks() | codebooks(max_size=200).map(np.float32),
       x=hnp.arrays(np.float32, st.integers(0, 300),
                    elements=st.floats(width=32, allow_nan=False)))
def test_the_compare_loop_counts_the_midpoints_below_each_value(centres, x):
    """What the kernel's binary search computes (lower bound) is what numpy's loop counts,
    on both sides of the 64-midpoint switch to searchsorted."""
    mids = midpoints(np.asarray(centres, np.float32))
    out = np.empty(x.size, np.uint8 if mids.size < 255 else np.uint16)
    _nearest_into(x, mids, out, np.empty(x.size, bool))
    expected = np.array([np.count_nonzero(mids < v) for v in x], dtype=np.int64)
    assert np.array_equal(out.astype(np.int64), expected)


def _widen_f32_bits(b: np.ndarray) -> np.ndarray:
    """``inshrink_f32_bits_to_f64`` in numpy, step for step: integer fields moved into
    float64's, a denormal's mantissa times 2^-149, never a float32 operation."""
    b = b.astype(np.uint64)
    e, m = (b >> np.uint64(23)) & np.uint64(0xFF), b & np.uint64(0x7FFFFF)
    normal = ((e + np.uint64(896)) << np.uint64(52)) | (m << np.uint64(29))
    special = np.where(m != 0, np.uint64(0x7FF8000000000000), np.uint64(0x7FF0000000000000))
    mag = np.where(e == 0xFF, special, normal).view(np.float64)
    mag = np.where(e == 0, m.astype(np.float64) * np.uint64(0x36A0000000000000).view(np.float64), mag)
    return np.where(b >> np.uint64(31) != 0, -mag, mag)


def _widen_f16_bits(h: np.ndarray) -> np.ndarray:
    """``inshrink_f16_bits_to_f64`` in numpy (a denormal's mantissa times 2^-24)."""
    h = h.astype(np.uint64)
    e, m = (h >> np.uint64(10)) & np.uint64(0x1F), h & np.uint64(0x3FF)
    normal = ((e + np.uint64(1008)) << np.uint64(52)) | (m << np.uint64(42))
    special = np.where(m != 0, np.uint64(0x7FF8000000000000), np.uint64(0x7FF0000000000000))
    mag = np.where(e == 0x1F, special, normal).view(np.float64)
    mag = np.where(e == 0, m.astype(np.float64) * np.uint64(0x3E70000000000000).view(np.float64), mag)
    return np.where(h >> np.uint64(15) != 0, -mag, mag)


def _f64(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # signalling NaNs quieten
        return x.astype(np.float64)


def _same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bits, NaN payloads aside (the kernels only ask whether a value is NaN)."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint64), b[~nan].view(np.uint64)))


def test_the_kernels_widening_is_exact_for_every_16_bit_pattern():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    shifted = (bits.astype(np.uint32) << 16).view(np.float32)  # the bfloat16 kernel expression
    registry = dtypes.by_codec_name("bfloat16").to_float32(bits)
    assert np.array_equal(shifted.view(np.uint32), registry.view(np.uint32))
    assert _same_values(_widen_f32_bits(shifted.view(np.uint32)), _f64(registry))
    halves = bits.view(np.float16)
    assert _same_values(_widen_f16_bits(bits), _f64(halves))
    finite = np.isfinite(halves)
    with np.errstate(invalid="ignore"):
        widened = halves.astype(np.float32)
    assert np.array_equal(widened[finite].astype(np.float16).view(np.uint16), bits[finite])


def test_the_kernels_widening_is_exact_for_float32_denormals_and_specials():
    """Every float32 denormal and power of two, both signs, and a random sample of patterns:
    the integer widening equals numpy's exact float32 -> float64 conversion (which the
    device's flush-to-zero conversion does not: it turns every denormal into 0)."""
    denormals = np.arange(0, 1 << 23, 97, dtype=np.uint32)
    powers = (np.arange(256, dtype=np.uint32) << 23)
    sample = np.random.default_rng(3).integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    for bits in (denormals, powers, sample, np.uint32([0x7F7FFFFF, 0x00800000, 0x007FFFFF, 1])):
        both = np.concatenate([bits, bits | np.uint32(0x80000000)])
        assert _same_values(_widen_f32_bits(both), _f64(both.view(np.float32)))


def _accepts_within(v: np.ndarray, c: np.ndarray, tol32: np.float32) -> np.ndarray:
    """The kernel's finite-tolerance acceptance: float64 difference against within_bound."""
    bound, tie_ok = _gpu.within_bound(tol32)
    d = np.abs(v.astype(np.float64) - c.astype(np.float64))
    return (d < bound) | (tie_ok & (d == bound))


def _float32_accepts(v: np.ndarray, c: np.ndarray, tol32: np.float32) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return np.abs(v - c) <= tol32  # numpy's float32 arithmetic, denormals kept


tolerances32 = st.floats(0, 1e3, width=32, allow_subnormal=True, exclude_min=True) | st.sampled_from(
    [np.finfo(np.float32).max, np.finfo(np.float32).smallest_subnormal, np.float32(1e-3), np.float32(0.5)])


@settings(max_examples=200, deadline=None)
@given(tol=tolerances32, c=st.floats(width=32, allow_nan=False, allow_infinity=False),
       offsets=st.lists(st.integers(-4, 4), min_size=1, max_size=9))
def test_the_float64_bound_accepts_exactly_what_float32_arithmetic_accepts(tol, c, offsets):
    """At the edge: values whose float32 difference from the centre lands on the tolerance
    and a few float32 steps either side, where rounding to nearest (ties to even) decides."""
    t, c32 = np.float32(tol), np.float32(c)
    with np.errstate(over="ignore", invalid="ignore"):
        edges = np.array([c32 + t, c32 - t], np.float32)
    edges = edges[np.isfinite(edges)]
    v = [edges]
    for k in offsets:
        step = np.float32(np.inf) if k > 0 else np.float32(-np.inf)
        moved = edges
        with np.errstate(over="ignore"):
            for _ in range(abs(k)):
                moved = np.nextafter(moved, step)
        v.append(moved)
    values = np.concatenate(v + [np.float32([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-45])]).astype(np.float32)
    centre = np.full(values.size, c32, np.float32)
    assert np.array_equal(_accepts_within(values, centre, t), _float32_accepts(values, centre, t))


@settings(max_examples=200, deadline=None)
@given(v=hnp.arrays(np.float32, 64, elements=st.floats(width=32, allow_subnormal=True) | st.floats(-2.0**-120, 2.0**-120, width=32)),
       c=hnp.arrays(np.float32, 64, elements=st.floats(-2.0**-120, 2.0**-120, width=32, allow_subnormal=True)),
       tol=tolerances32)
def test_the_float64_bound_agrees_on_denormal_neighbourhoods(v, c, tol):
    t = np.float32(tol)
    assert np.array_equal(_accepts_within(v, c, t), _float32_accepts(v, c, t))


def test_within_bound_rejects_what_is_not_a_finite_tolerance():
    for bad in (np.float32(np.inf), np.float32(np.nan), np.float32(-1.0)):
        with pytest.raises(FormatError, match="tolerance"):
            _gpu.within_bound(bad)


def _kernel_emulation(q, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``_gpu.assign_levels`` in numpy, one pass over the whole array as on the device:
    elements widened from their bits to float64, the lower bound of each among the
    widened midpoints, then the kernel's float64 accept expression."""
    if q.dtype == "float16":
        v = _widen_f16_bits(flat.view(np.uint16))
    else:
        bits = flat.view(np.uint32) if q.dtype == "float32" else flat.astype(np.uint32) << np.uint32(16)
        v = _widen_f32_bits(bits)
    level = np.searchsorted(q.mids.astype(np.float64), v, side="left").astype(q.id_dtype)
    centre = q.centres.astype(np.float64)[np.minimum(level, q.centres.size - 1)]
    with np.errstate(invalid="ignore", over="ignore"):
        if q.tol32 is None:
            ok = np.isfinite(v)
        elif q.tol32 == 0:
            ok = v == centre
        else:
            bound, tie_ok = _gpu.within_bound(q.tol32)
            d = np.abs(v - centre)
            ok = (d < bound) | (tie_ok & (d == bound))
    return level, ok


@SETTINGS
@given(config=nuq_configs(), data=st.data())
def test_the_device_shaped_encode_gives_the_host_bytes(config, data):
    """Fused assignment + the generic finish (what a GPU runs) == the blocked host encode."""
    sample = data.draw(float_arrays(dtypes=(config["dtype"],)))
    q = quantizer(tuple(config["codebook"]), float(config["tolerance"]),
                  config["protected_dtype"], config["dtype"])
    flat = sample.array.reshape(-1)
    level, ok = _kernel_emulation(q, flat)
    host_level, host_ok = q._assign(flat)
    assert np.array_equal(ok, host_ok)
    assert np.array_equal(level[ok], host_level[ok])  # rejected ids are overwritten anyway
    device_shaped = q._finish(flat, level, ok)
    assert isinstance(device_shaped, np.ndarray) and device_shaped.dtype == np.uint8
    assert device_shaped.tobytes() == q.encode(sample.array)


@pytest.mark.parametrize("centres", [15, 70])  # both sides of the switch to searchsorted
def test_a_blocked_encode_across_many_blocks_equals_the_one_pass_emulation(centres):
    rng = np.random.default_rng(3)
    x = (rng.standard_t(4, 200_003) * 0.02).astype(np.float32)
    x[rng.integers(0, x.size, 50)] = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-42], np.float32)[
        rng.integers(0, 5, 50)]
    finite = x[np.isfinite(x)]
    codebook = tuple(float(c) for c in np.unique(
        np.quantile(finite, np.linspace(0, 1, centres)).astype(np.float32)))
    for tol in (0.0, 1e-3, math.inf):
        q = quantizer(codebook, tol, "bfloat16", "float32")
        assert q._finish(x, *_kernel_emulation(q, x)).tobytes() == q.encode(x)


# -- payload ------------------------------------------------------------------------------


def _reference_payload(levels: int, ids: np.ndarray, pname: str, words: np.ndarray) -> bytes:
    width = 1 if levels <= 255 else 2
    header = struct.pack("<4sBBBBQIQ", b"INQ\x01", 1, width, {"bfloat16": 0, "float32": 1}[pname],
                         0, ids.size, levels, words.size)
    return header + ids.astype(f"<u{width}").tobytes() + words.tobytes()


@SETTINGS
@given(levels=st.integers(1, 700), n=st.integers(0, 200), pname=st.sampled_from(["bfloat16", "float32"]),
       seed=st.integers(0, 2**32 - 1), offset=st.integers(0, 3))
def test_assemble_writes_the_documented_layout_and_unpack_reads_it_from_any_buffer(
        levels, n, pname, seed, offset):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, levels, n).astype(np.uint16 if levels > 255 else np.uint8)
    word = _payload.protected_word(pname)
    words = rng.integers(0, 1 << (8 * word.itemsize), int(np.count_nonzero(ids == levels - 1)),
                         dtype=np.uint64).astype(word.str.replace("f", "u")).view(word)
    expected = _reference_payload(levels, ids, pname, words)
    assembled = _payload.assemble(levels, ids, pname, words)
    assert assembled.tobytes() == expected == _payload.pack(levels, ids, pname, words)
    shifted = np.frombuffer(b"\0" * offset + expected, np.uint8)[offset:]  # misaligned ids/words
    for buf in (expected, bytearray(expected), memoryview(expected), shifted):
        parsed = _payload.unpack(buf)
        assert parsed.levels == levels and parsed.protected_dtype == pname
        assert np.array_equal(parsed.ids, ids)
        assert parsed.protected.tobytes() == words.tobytes()


@SETTINGS
@given(config=nuq_configs(), data=st.data())
def test_decode_of_an_array_equals_decode_of_bytes(config, data):
    sample = data.draw(float_arrays(dtypes=(config["dtype"],)))
    q = quantizer(tuple(config["codebook"]), float(config["tolerance"]),
                  config["protected_dtype"], config["dtype"])
    payload = q.encode(sample.array)
    from_bytes = q.decode(payload)
    from_array = q.decode(np.frombuffer(payload, np.uint8))
    assert from_array.dtype == from_bytes.dtype
    assert from_array.tobytes() == from_bytes.tobytes()
    assert q.encode(from_array) == q.encode(from_bytes)  # still a projection


def test_the_zarr_codec_on_host_buffers_stores_the_quantizer_bytes():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 33)) * 0.1).astype(np.float32)
    codebook = [-0.2, -0.05, 0.0, 0.05, 0.2]
    store = zarr.storage.MemoryStore()
    arr = zarr.create_array(store, shape=x.shape, chunks=(32, 33), dtype="float32",
                            serializer=NUQZarrCodec(codebook=codebook, tolerance=0.06),
                            compressors=None)
    arr[...] = x
    q = quantizer(tuple(codebook), 0.06, "bfloat16", "float32")
    for i in range(2):
        stored = store._store_dict[f"c/{i}/0"].to_bytes()
        assert stored == q.encode(np.ascontiguousarray(x[32 * i:32 * (i + 1)]))
    back = arr[...]
    assert isinstance(back, np.ndarray)
    assert back.tobytes() == b"".join(q.decode(q.encode(x[r:r + 32])).tobytes() for r in (0, 32))


# -- vdelta -------------------------------------------------------------------------------


@SETTINGS
@given(levels=st.integers(2, 700), n=st.integers(0, 300), churn=st.floats(0, 1),
       seed=st.integers(0, 2**32 - 1), grouped=st.booleans())
def test_the_delta_stream_is_the_modular_difference_grouped_stably_by_the_previous_id(
        levels, n, churn, seed, grouped):
    rng = np.random.default_rng(seed)
    dt = np.uint16 if levels > 255 else np.uint8
    prev = rng.integers(0, levels, n).astype(dt)
    cur = np.where(rng.random(n) < churn, rng.integers(0, levels, n), prev).astype(dt)
    stream = vdelta.delta_stream(prev, cur, levels, grouped)
    diff = (prev.astype(np.int64) - cur.astype(np.int64)) % levels
    order = sorted(range(n), key=lambda i: int(prev[i])) if grouped else list(range(n))
    assert stream.dtype == vdelta.delta_dtype(levels)
    assert stream.astype(np.int64).tolist() == [int(diff[i]) for i in order]
    assert np.array_equal(vdelta.apply_stream(prev, stream, levels, grouped), cur)


# -- sketch -------------------------------------------------------------------------------


def _histogram_emulation(x: np.ndarray, scale: float) -> tuple[np.ndarray, int, int, int]:
    """``_gpu.sketch_histogram`` in numpy: class and key per element, bins, bincount."""
    x = np.asarray(x).reshape(-1)
    if x.dtype == np.float32:  # read as bits and widened as the kernel does
        a = _widen_f32_bits(x.view(np.uint32))
    elif x.dtype == np.float16:
        a = _widen_f16_bits(x.view(np.uint16))
    else:
        a = x.astype(np.float64)
    finite = np.isfinite(a)
    cls = np.where(~finite, 3, np.where(a == 0, 0, np.where(a < 0, 2, 1)))
    with np.errstate(divide="ignore", invalid="ignore"):
        key = np.where((cls == 1) | (cls == 2), np.ceil(np.log2(np.abs(a)) * scale), 0).astype(np.int64)
    tally = np.bincount(cls, minlength=4)
    if tally[1] + tally[2] == 0:
        return np.zeros(0, np.int64), 0, int(tally[0]), int(tally[3])
    bucketed = (cls == 1) | (cls == 2)
    lo, hi = int(key[bucketed].min()), int(key[bucketed].max())
    span = hi - lo + 1
    bins = np.where(cls == 1, key - lo, np.where(cls == 2, key - lo + span, 2 * span))
    return np.bincount(bins, minlength=2 * span + 1)[:2 * span].astype(np.int64), lo, int(tally[0]), int(tally[3])


sketch_values = st.one_of(
    hnp.arrays(np.float32, st.integers(0, 400), elements=st.floats(width=32)),
    hnp.arrays(np.float16, st.integers(0, 400), elements=st.floats(width=16)),
    hnp.arrays(np.float64, st.integers(0, 400), elements=st.floats(-1e300, 1e300) | st.just(np.nan)),
    hnp.arrays(np.int32, st.integers(0, 100)),
)


@SETTINGS
@given(x=sketch_values, block=st.sampled_from([7, 1 << 20]))
def test_the_generic_sketch_equals_the_keys_counted_one_by_one(x, block):
    """The array-library generic block histogram (no ``where=``: CuPy has none) against the
    definition, ``ceil(log2|x| * scale)`` counted per sign, over one block or many."""
    scale = 1.0 / math.log2((1 + ALPHA) / (1 - ALPHA))
    a = x.astype(np.float64)
    a = a[np.isfinite(a) & (a != 0)]
    with np.errstate(divide="ignore"):
        keys = np.ceil(np.log2(np.abs(a)) * scale).astype(np.int64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sketch_mod, "BLOCK", block)
        got = LogSketch.from_values(x)
    for sign, (k, c) in ((a > 0, (got.pos_keys, got.pos_counts)), (a < 0, (got.neg_keys, got.neg_counts))):
        expected_keys, expected_counts = np.unique(keys[sign], return_counts=True)
        assert np.array_equal(k, expected_keys) and np.array_equal(c, expected_counts)
    assert got.zero_count == int(np.count_nonzero(x == 0))
    assert got.nonfinite_count == int(np.count_nonzero(~np.isfinite(x.astype(np.float64))))


@SETTINGS
@given(x=sketch_values)
def test_the_device_shaped_sketch_block_gives_the_host_stores(x):
    scale = 1.0 / math.log2((1 + ALPHA) / (1 - ALPHA))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sketch_mod._gpu, "sketch_histogram", _histogram_emulation)
        device = sketch_mod._device_block(x, scale)
    host = sketch_mod._host_block(x, scale)
    for d, h in zip(device[:2], host[:2], strict=True):
        assert np.array_equal(d[0], h[0]) and np.array_equal(d[1], h[1])
        assert d[0].dtype == h[0].dtype == np.int64 and d[1].dtype == h[1].dtype == np.int64
    assert device[2:] == host[2:]
    whole = LogSketch.from_values(x)
    assert whole.zero_count == host[2] and whole.nonfinite_count == host[3]


def _keys_that_would_move(alpha: float, ulps: int) -> tuple[list[float], float]:
    """float32 values whose key ``ceil(log2|x| * scale)`` could change under a ``log2`` off
    by ``ulps`` units in the last place (1.0 aside: log2(1) = 0 exactly), and the smallest
    ratio of a value's distance to its bucket edge over that error."""
    scale = 1.0 / math.log2((1 + alpha) / (1 - alpha))
    exact_scale, movable, worst = Decimal(scale), [], math.inf
    with localcontext() as ctx:
        ctx.prec = 34
        ln2 = Decimal(2).ln()
        for k in range(math.floor(-149 * scale) - 1, math.ceil(128 * scale) + 2):
            edge = float(min(Decimal(k) / exact_scale * ln2, Decimal(700)).exp())
            with np.errstate(over="ignore"):
                f = np.float32(edge)
            for v in (np.nextafter(f, np.float32(0)), f, np.nextafter(f, np.float32(np.inf))):
                if not np.isfinite(v) or v == 0 or v == 1:
                    continue
                t = Decimal(float(v)).ln() / ln2 * exact_scale
                distance = float(abs(t - t.to_integral_value()))
                budget = ulps * math.ulp(float(t) / scale) * scale + math.ulp(float(t))
                worst = min(worst, distance / budget)
                if distance <= budget:
                    movable.append(float(v))
    return movable, worst


def test_every_float32_sketch_key_survives_a_log2_off_by_four_ulps():
    """Why the GPU's sketch equals the host's for float32, float16 and bfloat16 weights:
    no float32 value lies within four ulps of ``log2`` of a bucket edge, so numpy's, glibc's
    and CUDA's ``log2`` all give the same keys (the nearest is ~200 times further)."""
    movable, worst = _keys_that_would_move(ALPHA, ulps=4)
    assert movable == [] and worst > 100
    edge_values = np.array([1.0, -1.0, np.float32(2.0) ** -149, np.finfo(np.float32).max], np.float32)
    sketch = LogSketch.from_values(edge_values)
    assert 0 in sketch.pos_keys and 0 in sketch.neg_keys  # |x| = 1 is key 0 exactly

"""The GPU path gives the host's bytes: payloads, ids, decoded values, sketches, deltas.

Every test runs the same routine on numpy and on CuPy arrays and compares the results bit
for bit (payload bytes, id arrays, histogram keys and counts), on random and trained-looking
weights (Student-t tails, pruned zeros, outliers), every element dtype (float32, float16,
bfloat16 carried as uint16 bits; float64 for the sketch, and rejected by the quantizer as on
the host), odd sizes, and the values where rounding could tell two implementations apart:
NaN with payloads, infinities, -0.0, denormals, centres, midpoints and their neighbours,
float32 values on both sides of every sketch bucket edge. Skipped without CuPy or a device.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from inshrink_store import dtypes
from inshrink_store.codecs import _payload, vdelta
from inshrink_store.codecs.nuq import midpoints, nearest_index, quantizer
from inshrink_store.errors import FormatError
from inshrink_store.policy import sketch as sketch_mod
from inshrink_store.policy.sketch import ALPHA, LogSketch
from tests.test_gpu._device import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

ELEMENTS = ("float32", "float16", "bfloat16")
SIZES = (7, 65_537, 1_000_003)  # odd, and across the host's 64 Ki-element encode blocks
CENTRES = (1, 2, 15, 64, 65, 255, 256, 1000)  # both sides of 64 midpoints and of uint8 ids
TOLERANCES = (0.0, 1e-3, math.inf)
NAN_BITS = np.array([0x7FC00000, 0x7FC00001, 0xFFA00000, 0x7F800001], np.uint32)


def _trained_like(n: int, rng: np.random.Generator) -> np.ndarray:
    """Student-t (df 4) weights at a layer's scale, 30 % pruned to 0, 0.5 % outliers."""
    w = (rng.standard_t(4, n) * 0.02).astype(np.float32)
    w[rng.random(n) < 0.3] = 0.0
    outliers = rng.random(n) < 0.005
    w[outliers] *= 50
    return w


def _codebook(values: np.ndarray, k: int, element: str) -> tuple[float, ...]:
    finite = values[np.isfinite(values)]
    c = np.unique(np.quantile(finite, np.linspace(0.001, 0.999, k)).astype(np.float32))
    rounded = dtypes.by_codec_name(element).round_float32(c)
    return tuple(float(v) for v in np.unique(rounded[np.isfinite(rounded)]))


def _tricky(values: np.ndarray, centres: tuple[float, ...], rng: np.random.Generator) -> np.ndarray:
    """Overwrite a few elements with the values where implementations could disagree."""
    c = np.asarray(centres, np.float32)
    m = midpoints(c)
    special = np.concatenate([
        NAN_BITS.view(np.float32), np.array([np.inf, -np.inf, 0.0, -0.0, 1e-42, -1e-45,
                                             np.finfo(np.float32).max, np.finfo(np.float32).tiny],
                                            np.float32),
        c, m, np.nextafter(m, np.float32(np.inf)), np.nextafter(m, np.float32(-np.inf)),
        np.nextafter(c, np.float32(np.inf)), np.nextafter(c, np.float32(-np.inf)),
    ]).astype(np.float32)
    out = values.copy()
    if out.size:
        at = rng.integers(0, out.size, min(out.size, special.size))
        out[at] = special[: at.size]
    return out


def _carrier(values: np.ndarray, element: str) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(dtypes.by_codec_name(element).from_float32(values))


def _case(element: str, n: int, k: int, seed: int) -> tuple[np.ndarray, tuple[float, ...]]:
    rng = np.random.default_rng(seed)
    w = _trained_like(n, rng)
    centres = _codebook(w, k, element)
    return _carrier(_tricky(w, centres, rng), element), centres


# -- level assignment ---------------------------------------------------------------------


@pytest.mark.parametrize("element", ELEMENTS)
@pytest.mark.parametrize("k", CENTRES)
@pytest.mark.parametrize("tolerance", TOLERANCES)
def test_the_assign_kernel_gives_the_host_ids_and_flags(element, k, tolerance):
    carrier, centres = _case(element, 65_537, k, seed=k)
    q = quantizer(centres, tolerance, "bfloat16", element)
    host_ids, host_ok = q._assign(carrier)
    dev_ids, dev_ok = q._assign(cp.asarray(carrier))
    assert dev_ids.dtype == host_ids.dtype == q.id_dtype
    assert np.array_equal(dev_ok.get(), host_ok)
    known = ~np.isnan(q.values_of(carrier))  # a NaN's id is arbitrary on both (and rejected)
    assert np.array_equal(dev_ids.get()[known], host_ids[known])


@pytest.mark.parametrize("k", CENTRES)
def test_nearest_index_on_the_device_equals_the_host(k):
    x = _tricky(_trained_like(100_003, np.random.default_rng(k)), (0.0,), np.random.default_rng(1))
    centres = np.asarray(_codebook(x, k, "float32"), np.float32)
    host = nearest_index(x, centres)
    dev = nearest_index(cp.asarray(x), centres)
    assert isinstance(dev, cp.ndarray) and dev.dtype == host.dtype
    known = ~np.isnan(x)
    assert np.array_equal(dev.get()[known], host[known])


def test_the_assign_kernel_rejects_a_carrier_of_the_wrong_dtype():
    q = quantizer((0.0, 1.0), 0.0, "bfloat16", "float32")
    with pytest.raises(FormatError, match="carrier"):
        q.encode(cp.zeros(4, cp.float64))


# -- whole payloads -----------------------------------------------------------------------


@pytest.mark.parametrize("element", ELEMENTS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("k", (2, 15, 256))
@pytest.mark.parametrize("tolerance", TOLERANCES)
@pytest.mark.parametrize("protected", ("bfloat16", "float32"))
def test_encode_on_the_device_gives_the_host_payload_bytes(element, n, k, tolerance, protected):
    carrier, centres = _case(element, n, k, seed=n + k)
    q = quantizer(centres, tolerance, protected, element)
    host = q.encode(carrier)
    device = q.encode_array(cp.asarray(carrier))
    assert isinstance(device, cp.ndarray) and device.dtype == cp.uint8
    assert device.get().tobytes() == host
    assert q.encode(cp.asarray(carrier)) == host


@pytest.mark.parametrize("element", ELEMENTS)
@pytest.mark.parametrize("k", (2, 15, 256, 1000))
@pytest.mark.parametrize("protected", ("bfloat16", "float32"))
def test_decode_on_the_device_gives_the_host_values(element, k, protected):
    carrier, centres = _case(element, 100_001, k, seed=7 * k)
    q = quantizer(centres, 0.0, protected, element)
    payload = q.encode(carrier)
    host = q.decode(payload)
    device = q.decode(cp.asarray(np.frombuffer(payload, np.uint8)))
    assert isinstance(device, cp.ndarray) and device.dtype == host.dtype
    assert device.get().tobytes() == host.tobytes()
    shifted = cp.zeros(len(payload) + 1, cp.uint8)  # uint16 ids at an odd device address
    shifted[1:] = cp.asarray(np.frombuffer(payload, np.uint8))
    assert q.decode(shifted[1:]).get().tobytes() == host.tobytes()


@pytest.mark.parametrize("n", (0, 1))
@pytest.mark.parametrize("element", ELEMENTS)
def test_empty_and_single_element_chunks(n, element):
    carrier = _carrier(np.full(n, 0.5, np.float32), element)
    for centres in ((0.5,), (0.0, 1.0)):
        q = quantizer(centres, 0.0, "bfloat16", element)
        host = q.encode(carrier)
        assert q.encode(cp.asarray(carrier)) == host
        assert q.decode(cp.asarray(np.frombuffer(host, np.uint8))).get().tobytes() == q.decode(host).tobytes()


def test_policy_planned_weights_encode_to_the_same_bytes():
    """The production path: the policy plans the codebook and snaps the weights (host), the
    device encodes them (tolerance 0, as the writer configures the codec)."""
    from inshrink_store.policy.config import QuantConfig
    from inshrink_store.policy.partition import TensorInput, quantize_tensor

    w = (np.random.default_rng(5).standard_t(4, (1024, 999)) * 0.02).astype(np.float32)
    for config in (QuantConfig(bins=16, prune=0.0, protect=0.005),
                   QuantConfig(bins=4, prune=0.5, protect=0.0005)):
        planned = quantize_tensor(TensorInput(w), config)
        q = quantizer(planned.codebook, 0.0, "bfloat16", "float32")
        host = q.encode(planned.values)
        assert q.encode(cp.asarray(planned.values)) == host


@pytest.mark.parametrize("levels", (1, 16, 255, 256, 3000))
@pytest.mark.parametrize("protected", ("bfloat16", "float32"))
def test_payload_assembly_and_parsing_on_the_device(levels, protected):
    rng = np.random.default_rng(levels)
    ids = rng.integers(0, levels, 100_003).astype(_payload.id_dtype(_payload.id_width_for(levels)))
    word = _payload.protected_word(protected)
    words = rng.standard_normal(int(np.count_nonzero(ids == levels - 1))).astype(np.float32)
    words = words if word.itemsize == 4 else dtypes.float32_to_bf16(words)
    host = _payload.pack(levels, ids, protected, words)
    device = _payload.assemble(levels, cp.asarray(ids), protected, words)
    assert isinstance(device, cp.ndarray) and device.get().tobytes() == host
    parsed = _payload.unpack(device)
    assert isinstance(parsed.ids, cp.ndarray) and isinstance(parsed.protected, np.ndarray)
    assert np.array_equal(parsed.ids.get(), ids)
    assert parsed.protected.tobytes() == words.tobytes()


def test_a_malformed_device_payload_raises_as_on_the_host():
    q = quantizer((0.0, 1.0), 0.0, "bfloat16", "float32")
    payload = np.frombuffer(q.encode(np.array([0.0, 2.0, 1.0], np.float32)), np.uint8)
    for bad in (payload[:-1], payload[:10], np.concatenate([payload, payload[:1]])):
        with pytest.raises(FormatError) as on_host:
            q.decode(bad)
        with pytest.raises(FormatError) as on_device:
            q.decode(cp.asarray(bad))
        assert str(on_device.value) == str(on_host.value)


# -- vdelta -------------------------------------------------------------------------------


@pytest.mark.parametrize("levels", (2, 16, 256, 257, 3000))
@pytest.mark.parametrize("grouped", (True, False))
def test_the_delta_rearrangement_on_the_device_equals_the_host(levels, grouped):
    rng = np.random.default_rng(levels)
    dt = np.uint16 if levels > 255 else np.uint8
    prev = rng.integers(0, levels, 1_000_003).astype(dt)
    cur = np.where(rng.random(prev.size) < 0.05, rng.integers(0, levels, prev.size), prev).astype(dt)
    host = vdelta.delta_stream(prev, cur, levels, grouped)
    device = vdelta.delta_stream(cp.asarray(prev), cp.asarray(cur), levels, grouped)
    assert device.dtype == host.dtype and device.get().tobytes() == host.tobytes()
    back = vdelta.apply_stream(cp.asarray(prev), device, levels, grouped)
    assert np.array_equal(back.get(), cur)


# -- sketch -------------------------------------------------------------------------------

FIELDS = ("pos_keys", "pos_counts", "neg_keys", "neg_counts", "zero_count", "nonfinite_count")


def _assert_same(a: LogSketch, b: LogSketch) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert np.array_equal(x, y), name
        assert np.asarray(x).dtype == np.asarray(y).dtype, name


def _bucket_edges_float32(alpha: float) -> np.ndarray:
    """float32 values on both sides of every bucket edge (and +-1.0, whose key is 0)."""
    scale = 1.0 / math.log2((1 + alpha) / (1 - alpha))
    k = np.arange(math.floor(-149 * scale), math.ceil(128 * scale) + 1)
    with np.errstate(over="ignore", under="ignore"):
        edges = np.exp2(k / scale).astype(np.float32)
    edges = edges[np.isfinite(edges) & (edges > 0)]
    near = np.concatenate([edges, np.nextafter(edges, np.float32(0)),
                           np.nextafter(edges, np.float32(np.inf)), np.float32([1.0])])
    return np.concatenate([near, -near]).astype(np.float32)


@pytest.mark.parametrize("dtype", ("float32", "float16", "bfloat16", "float64"))
def test_the_sketch_on_the_device_equals_the_host(dtype):
    rng = np.random.default_rng(11)
    w = _tricky(_trained_like(3_000_001, rng), (0.0, 1.0), rng)
    if dtype == "bfloat16":  # the policy sketches bfloat16 weights widened to float32
        x = dtypes.round_bf16(w)
    elif dtype == "float64":
        with np.errstate(invalid="ignore"):  # signalling NaNs quieten
            x = w.astype(np.float64) * (1 + 1e-9)  # values float32 cannot hold
    else:
        with np.errstate(over="ignore"):
            x = w.astype(dtype)
    _assert_same(LogSketch.from_values(cp.asarray(x)), LogSketch.from_values(x))
    mask = rng.random(x.size) < 0.7
    _assert_same(LogSketch.from_values(cp.asarray(x), mask=cp.asarray(mask)),
                 LogSketch.from_values(x, mask=mask))


def test_every_bucket_edge_gets_the_host_key_on_the_device():
    x = _bucket_edges_float32(ALPHA)
    _assert_same(LogSketch.from_values(cp.asarray(x)), LogSketch.from_values(x))


def test_a_sketch_over_several_device_blocks_equals_the_host():
    from inshrink_store.codecs import _gpu

    x = _trained_like(_gpu.BLOCK + 12_345, np.random.default_rng(2))
    _assert_same(LogSketch.from_values(cp.asarray(x)), LogSketch.from_values(x))


def test_the_generic_block_histogram_on_cupy_equals_the_fused_kernel_and_the_host():
    x = _trained_like(1_000_003, np.random.default_rng(4))
    scale = 1.0 / math.log2((1 + ALPHA) / (1 - ALPHA))
    host = sketch_mod._block_stores(x, scale, np)
    generic = sketch_mod._block_stores(cp.asarray(x), scale, cp)
    fused = sketch_mod._device_block(cp.asarray(x), scale)
    for got in (generic, fused[:3]):
        for store, expected in zip(got[:2], host[:2], strict=True):
            assert np.array_equal(store[0], expected[0]) and np.array_equal(store[1], expected[1])
        assert got[2] == host[2]

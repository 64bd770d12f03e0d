"""The compiled loops (numba, optional) give the numpy code's results byte for byte.

The stored bytes must never depend on whether numba is installed (the store addresses
chunks by content, so a second machine without it would otherwise dedup nothing), so
each loop is checked against the numpy code it replaces on the same inputs, and whole
chunks are encoded both ways. Without numba the tests of the loops skip; the fallback
and the size gate are tested either way.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store import dtypes
from inshrink_store.codecs import _kernels, _planes
from inshrink_store.codecs import bytegroup as bg
from inshrink_store.errors import FormatError
from inshrink_store.testing import float_arrays
from tests.test_codecs.kernel_switch import kernels_env

MIN = _kernels.KERNEL_MIN


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("numba")
    with _env(None):
        loaded = _kernels.active()
    assert loaded is not None, "numba is installed, so the compiled loops must load"
    return loaded


def _numpy() -> AbstractContextManager[None]:
    return _env("numpy")


_env = kernels_env


def _skewed(rng: np.random.Generator, n: int, palette: int) -> np.ndarray:
    """Bytes like an exponent plane: a few values, most of them one or two."""
    return (120 + rng.zipf(1.4, n) % palette).astype(np.uint8)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 5000), seed=st.integers(0, 2**32 - 1), stride=st.integers(1, 5),
       offset=st.integers(0, 3), palette=st.sampled_from([1, 3, 40, 256]))
def test_the_compiled_histogram_is_bincount_on_any_layout(kernels, n, seed, stride, offset, palette):
    rng = np.random.default_rng(seed)
    data = _skewed(rng, n + offset, palette) if palette < 256 else rng.integers(0, 256, n + offset).astype(np.uint8)
    view = data[offset::stride]  # unaligned and strided, as a plane's sample is
    counts = kernels.histogram(view)
    assert counts.dtype == np.int64
    assert counts.tolist() == np.bincount(view, minlength=256).tolist()


@settings(max_examples=60, deadline=None)
@given(itemsize=st.sampled_from([2, 4]), n=st.integers(0, 3000), seed=st.integers(0, 2**32 - 1),
       offset=st.integers(0, 3))
def test_the_compiled_plane_split_is_the_numpy_split(kernels, itemsize, n, seed, offset):
    """Any bit pattern, rotated (sign last) or not, from an unaligned buffer."""
    raw = np.random.default_rng(seed).integers(0, 256, n * itemsize + offset).astype(np.uint8)
    words = np.ascontiguousarray(raw[offset:]).view(f"<u{itemsize}")
    for rotate in (False, True):
        expected = bg.split_planes(bg.sign_last(raw[offset:], itemsize) if rotate else raw[offset:], itemsize)
        out = np.empty((itemsize, words.size), np.uint8)
        (kernels.planes2 if itemsize == 2 else kernels.planes4)(words, rotate, out)
        assert [row.tobytes() for row in out] == [p.tobytes() for p in expected]


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 3 * _planes.PAIR_LOOKUP_MIN + 5), palette=st.integers(1, 40),
       hidden=st.integers(0, 6), seed=st.integers(0, 2**32 - 1), offset=st.integers(0, 1))
def test_compiled_packing_gives_the_pair_lookup_bytes(kernels, n, palette, hidden, seed, offset):
    """2- and 4-bit ranks, odd and even lengths, unaligned planes, escapes anywhere (the
    last element included): the packed ranks and the escapes, in order, of the numpy pairs."""
    rng = np.random.default_rng(seed)
    data = (rng.zipf(1.5, n + offset) % palette * 3).astype(np.uint8)[offset:]
    data[rng.integers(0, n, hidden)] = 250
    if hidden and seed % 2:
        data[-1] = 251
    hist = np.bincount(data[::3], minlength=256)
    bits, table, distinct = _planes._sample_table(hist)
    if distinct > table.size:
        table = table[:-1]
    if bits not in (2, 4) or table.size >= 1 << bits:
        return  # the pair path's precondition: 2 or 4 bits with a rank left for the escape
    rank_of = _planes._rank_of(table)
    packed, escapes = _planes._packed_compiled(kernels, data, bits, rank_of, table.size)
    saved = _kernels._LOOPS._loaded
    try:
        _kernels._LOOPS._loaded = None  # the numpy pairs, whatever the size
        want_packed, want_escapes = _planes._packed_by_pairs(data, bits, table)
    finally:
        _kernels._LOOPS._loaded = saved
    assert packed.tobytes() == want_packed.tobytes()
    assert escapes.tobytes() == want_escapes.tobytes()


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 5000), bits=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**32 - 1),
       outside=st.booleans(), offset=st.integers(0, 1))
def test_compiled_packing_of_a_full_table_is_ranking_then_packing(kernels, n, bits, seed, outside, offset):
    """A table holding 2**bits values: the ranks packed as pack_ranks packs them (every
    length, zero padding), or False where a value outside the table occurs (anywhere, the
    last element included), which sends the plane to the numpy path that widens."""
    rng = np.random.default_rng(seed)
    values = rng.choice(256, 1 << bits, replace=False).astype(np.uint8)
    data = values[rng.integers(0, values.size, n + offset)][offset:].copy()
    table = np.sort(values)
    rank_of = _planes._rank_of(table)
    if outside:
        stray = np.setdiff1d(np.arange(256, dtype=np.uint8), values)[0]
        data[rng.integers(0, n) if seed % 3 else n - 1] = stray
    packed = np.empty(-(-n // (8 // bits)), np.uint8)
    done = kernels.pack_whole(data, rank_of, table.size, bits, packed)
    assert done is not outside
    if done:
        assert packed.tobytes() == _planes.pack_ranks(np.take(rank_of, data), bits).tobytes()


@settings(max_examples=60, deadline=None)
@given(itemsize=st.sampled_from([2, 4]), n=st.integers(0, 3000), seed=st.integers(0, 2**32 - 1),
       rotate=st.booleans())
def test_the_compiled_join_is_joining_the_planes_then_rotating_back(kernels, itemsize, n, seed, rotate):
    rng = np.random.default_rng(seed)
    planes = [rng.integers(0, 256, n).astype(np.uint8) for _ in range(itemsize)]
    expected = bg.join_planes(planes, itemsize, np.empty(n * itemsize, np.uint8))
    if rotate:
        expected = bg.sign_first(expected, itemsize)
    words = np.empty(n, f"<u{itemsize}")
    (kernels.join2 if itemsize == 2 else kernels.join4)(*map(_kernels.read_only, planes), rotate, words)
    assert words.view(np.uint8).tobytes() == expected.tobytes()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(MIN, MIN + 5000), bits=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**32 - 1),
       strays=st.integers(0, 30), last=st.booleans())
def test_compiled_unpacking_gives_the_numpy_plane_and_checks_the_escapes(kernels, n, bits, seed, strays, last):
    """Packed planes of every width and length with escapes anywhere (the last element
    too), decoded both ways; a header claiming one escape fewer fails both ways alike."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, (1 << bits) - (1 if strays or last else 0), n).astype(np.uint8)
    data[rng.integers(0, n, strays)] = 200
    if last:
        data[-1] = 201
    body = _planes.pack(data, np.bincount(data[::7], minlength=256), 1)
    with _env(None):
        compiled = _planes.unpack(body, n, "plane 0")
    with _numpy():
        plain = _planes.unpack(body, n, "plane 0")
    assert compiled.tobytes() == plain.tobytes() == data.tobytes()
    fields = list(_planes.PACKED_HEADER.unpack_from(body))
    if fields[5]:  # escapes: claim one fewer
        fields[5] -= 1
        forged = _planes.PACKED_HEADER.pack(*fields) + body[_planes.PACKED_HEADER.size:]
        errors = []
        for env in (None, "numpy"):
            with _env(env), pytest.raises(FormatError) as caught:
                _planes.unpack(forged, n, "plane 0")
            errors.append(str(caught.value))
        assert errors[0] == errors[1]


def _large_weights(dtype: str, n: int, seed: int, kind: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        w = (rng.standard_normal(n) * 0.02).astype(np.float32)
    elif kind == "palette":  # few exponents and mantissas: packing with escapes, Huffman
        w = rng.choice(np.float32([0, 0.5, -0.25, 1e-3, 3.0, np.inf, -0.0]), n, p=[.5, .2, .1, .1, .05, .03, .02])
    else:  # specials and subnormals everywhere
        w = rng.standard_normal(n).astype(np.float32)
        w[rng.integers(0, n, n // 50)] = np.float32(1e-42)
        w[rng.integers(0, n, n // 50)] = np.nan
    return dtypes.by_codec_name(dtype).from_float32(w)


@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
       extra=st.integers(0, 3 * MIN), seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["normal", "palette", "specials"]), level=st.sampled_from([1, 3]))
def test_chunks_large_enough_for_the_loops_encode_to_the_numpy_bytes(kernels, dtype, extra, seed, kind, level):
    array = _large_weights(dtype, MIN // 2 + extra, seed, kind)  # planes on both sides of the gate
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    base = np.ascontiguousarray(_large_weights(dtype, array.size, seed + 1, kind)).reshape(-1).view(np.uint8)
    with _env(None):
        compiled = bg.encode_keyframe_and_delta(data, dtype, level, "zstd+huffman", base)
    with _numpy():
        assert bg.encode_keyframe_and_delta(data, dtype, level, "zstd+huffman", base) == compiled
    codec = bg.ByteGroup(dtype, coder="zstd+huffman")
    for encoded in (e for e in compiled if e is not None):
        with _env(None):
            decoded = codec.decode(encoded, base=base) if encoded is compiled[1] else codec.decode(encoded)
        with _numpy():
            plain = codec.decode(encoded, base=base) if encoded is compiled[1] else codec.decode(encoded)
        assert decoded.tobytes() == plain.tobytes() == data.tobytes()


@settings(max_examples=30, deadline=None)
@given(sample=float_arrays(), extra=st.integers(0, 5000))
def test_special_values_tiled_past_the_gate_encode_the_same_with_the_loops_on_or_off(kernels, sample, extra):
    """The property strategy's arrays (NaN payloads, signed zeros, subnormals, infinities)
    are small, so they are repeated into a chunk large enough for the loops."""
    flat = np.ascontiguousarray(sample.array).reshape(-1)
    if not flat.size:
        return
    tiled = np.resize(flat, MIN // flat.itemsize + extra)
    assert tiled.nbytes >= MIN
    codec = bg.ByteGroup(sample.dtype, coder="zstd+huffman")
    with _env(None):
        on = codec.encode(tiled)
    with _numpy():
        assert codec.encode(tiled) == on
    assert codec.decode(on).tobytes() == tiled.tobytes()


def test_a_full_table_broken_by_a_value_the_sample_missed_takes_the_numpy_ranks(kernels):
    """A large plane of exactly 2**bits sampled values plus one the strided sample never
    sees: the compiled full-table pass gives up and the numpy path widens, the bytes of the
    element-by-element definition."""
    rng = np.random.default_rng(21)
    n = 4 * MIN
    for bits in (1, 2, 4):
        data = np.sort(rng.choice(200, 1 << bits, replace=False)).astype(np.uint8)[rng.integers(0, 1 << bits, n)]
        stride = n // _planes.SAMPLE
        data[stride * 7 + 1] = 250  # between two sampled bytes
        hist = np.bincount(_planes.sample(data), minlength=256)
        assert hist[250] == 0 and np.count_nonzero(hist) == 1 << bits
        width, table, packed, escapes = _planes._packed(data, hist)
        with _numpy():
            want = _planes._packed(data, hist)
        assert (width, table.tobytes(), packed.tobytes(), escapes.tobytes()) == (
            want[0], want[1].tobytes(), want[2].tobytes(), want[3].tobytes())
        assert 250 in escapes.tolist() or width > bits


def test_threads_running_the_loops_side_by_side_give_the_numpy_bytes(kernels):
    chunks = [np.ascontiguousarray(_large_weights(dtype, 1 << 19, seed, kind)).reshape(-1).view(np.uint8)
              for seed, (dtype, kind) in enumerate([("bfloat16", "normal"), ("float32", "palette"),
                                                     ("float16", "specials"), ("bfloat16", "palette"),
                                                     ("float32", "normal"), ("float16", "normal")])]
    dtypes_of = ["bfloat16", "float32", "float16", "bfloat16", "float32", "float16"]
    with _numpy():
        expected = [bg.encode_chunk(c, d, 1, "zstd+huffman") for c, d in zip(chunks, dtypes_of, strict=True)]
    with _env(None), ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(lambda cd: bg.encode_chunk(cd[0], cd[1], 1, "zstd+huffman"),
                                 zip(chunks, dtypes_of, strict=True)))
    assert parallel == expected


def test_a_read_only_chunk_compiles_nothing_new_in_the_middle_of_a_save(kernels):
    """The object store hands the codec np.frombuffer views of bytes (read-only), for which
    numba would compile another version of a loop: every layout is compiled at load."""
    counts = {name: len(getattr(kernels, name).signatures) for name in vars(kernels)}
    for dtype in ("float32", "bfloat16", "float16"):
        for kind in ("palette", "normal", "specials"):
            chunk = np.ascontiguousarray(_large_weights(dtype, MIN, 9, kind)).reshape(-1)
            encoded = bg.encode_chunk(np.frombuffer(chunk.tobytes(), np.uint8), dtype, 1, "zstd+huffman")
            decoded = bg.ByteGroup(dtype, coder="zstd+huffman").decode(encoded)  # decoding too
            assert decoded.tobytes() == chunk.tobytes()
    assert {name: len(getattr(kernels, name).signatures) for name in vars(kernels)} == counts


def test_the_environment_switch_turns_the_loops_off():
    with _numpy():
        assert _kernels.active() is None
        assert _kernels.for_bytes(1 << 30) is None


def test_numbas_switch_to_plain_python_turns_the_loops_off(kernels, monkeypatch):
    """With NUMBA_DISABLE_JIT numba hands back the Python functions, whose uint8 arithmetic
    (numpy 2: a uint8 shifted left stays uint8) would pack wrong bytes: not used then."""
    numba = pytest.importorskip("numba")
    monkeypatch.setattr(numba.config, "DISABLE_JIT", 1)
    monkeypatch.setattr(_kernels._LOOPS, "_tried", False)
    monkeypatch.setattr(_kernels._LOOPS, "_loaded", None)
    with _env(None):
        assert _kernels.active() is None


def test_a_loop_that_fails_to_compile_means_no_loops_not_a_failed_save(kernels, monkeypatch):
    """Every loop compiles when the loops are first asked for (a numba that imports but
    cannot compile them falls back there, not in the middle of a save)."""
    monkeypatch.setattr(_kernels._LOOPS, "_tried", False)
    monkeypatch.setattr(_kernels._LOOPS, "_loaded", None)

    def broken(loops):
        raise TypeError("cannot determine Numba type of <class 'object'>")

    monkeypatch.setattr(_kernels, "_warm", broken)
    with _env(None):
        assert _kernels.active() is None
    data = np.ascontiguousarray(_large_weights("bfloat16", MIN, 5, "normal")).view(np.uint8)
    encoded = bg.encode_chunk(data, "bfloat16", 1, "zstd+huffman")
    assert bg.ByteGroup("bfloat16", coder="zstd+huffman").decode(encoded).tobytes() == data.tobytes()


def test_inputs_below_the_gate_never_ask_for_the_loops(monkeypatch):
    asked: list[int] = []
    monkeypatch.setattr(_kernels, "active", lambda: asked.append(1))
    assert _kernels.for_bytes(MIN - 1) is None
    assert not asked
    _kernels.for_bytes(MIN)
    assert asked == [1]


def test_without_numba_the_codec_runs_its_numpy_passes_and_says_so_once(monkeypatch, caplog):
    monkeypatch.delenv(_kernels.ENV, raising=False)
    compiled = None
    if _kernels.active() is not None:
        chunk = np.ascontiguousarray(_large_weights("float32", MIN, 3, "normal")).view(np.uint8)
        compiled = bg.encode_chunk(chunk, "float32", 1, "zstd+huffman")
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba -> ImportError
    monkeypatch.setattr(_kernels._LOOPS, "_tried", False)
    monkeypatch.setattr(_kernels._LOOPS, "_loaded", None)
    with caplog.at_level(logging.INFO, logger=_kernels.__name__):
        assert _kernels.active() is None
        assert _kernels.active() is None
    said = [r for r in caplog.records if "numba unavailable" in r.getMessage()]
    assert len(said) == 1
    data = np.ascontiguousarray(_large_weights("float32", MIN, 3, "normal")).view(np.uint8)
    encoded = bg.encode_chunk(data, "float32", 1, "zstd+huffman")
    assert bg.ByteGroup("float32", coder="zstd+huffman").decode(encoded).tobytes() == data.tobytes()
    if compiled is not None:
        assert encoded == compiled  # what a machine with numba stores for the same chunk


def test_a_process_coding_only_small_tensors_never_imports_numba(tmp_path):
    """The CLI on a toy model must not pay numba's import and first call (~0.6 s)."""
    script = (
        "import sys, numpy as np, inshrink_store as ins\n"
        f"repo = ins.open({str(tmp_path / 's')!r}, create=True)\n"
        "repo.save({'w': np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)})\n"
        "assert (repo.load()['w'] != 0).any()\n"
        "print('numba' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_without_a_writable_cache_the_loops_compile_uncached(kernels, monkeypatch):
    """numba refuses ``cache=True`` where it finds no writable place (a read-only install
    and no user cache): the loops are then compiled in memory, not given up."""
    numba = pytest.importorskip("numba")
    real = numba.njit
    asked: list[bool] = []

    def njit(**options):
        asked.append(options.get("cache", False))
        if options.get("cache"):
            raise RuntimeError("cannot cache function 'f': no locator available for file 'x'")
        return real(**options)

    monkeypatch.setattr(numba, "njit", njit)

    def double(x):
        return 2 * x

    compiled = _kernels._jit(double)
    assert asked == [True, False]
    assert compiled(21) == 42

"""inshrink.bytegroup format 2 (coder "zstd+huffman") and its zarr v3 front end.

Bit-exact for every float dtype and special value, deterministic whatever zarr's
concurrency, each plane coder (raw, zstd, Huffman, packed with and without escapes)
exercised on the data that picks it, and clear errors for bad configurations and chunks.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from zarr.codecs import BytesCodec

from inshrink_store import dtypes
from inshrink_store.codecs import _planes
from inshrink_store.codecs import bytegroup as bg
from inshrink_store.codecs.bytegroup import ByteGroup, ByteGroupZarrCodec
from inshrink_store.errors import FormatError
from inshrink_store.testing import check_codec_roundtrip, float_arrays
from inshrink_store.writer import create_array, lossless_codecs

CODER = "zstd+huffman"
LOGICAL = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def weights(n: int, seed: int = 0, dtype: str = "float32") -> np.ndarray:
    w = (np.random.default_rng(seed).standard_normal(n) * 0.02).astype(np.float32)
    return dtypes.by_codec_name(dtype).from_float32(w)


def methods(encoded: bytes) -> list[int]:
    return [m for m, _ in bg.parse(np.frombuffer(encoded, np.uint8))[5]]


# -- the numcodecs front end, format 2 -------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(sample=float_arrays(), level=st.sampled_from([1, 3]))
def test_format_2_round_trips_every_float_dtype_bit_exact_with_special_values(sample, level):
    encoded = check_codec_roundtrip(ByteGroup(sample.dtype, level=level, coder=CODER), sample.array)
    assert encoded[4] == 2  # format version


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(sorted(LOGICAL)), seed=st.integers(0, 2**32 - 1),
       n=st.integers(1, 5000), palette=st.integers(1, 40), specials=st.booleans())
def test_few_distinct_values_take_the_packed_and_huffman_paths_bit_exact(dtype, seed, n, palette, specials):
    """Weights drawn from a small palette (quantized-like, or stored with few mantissa bits):
    planes with 1..40 distinct bytes, so packing with 1, 2 and 4 bits and escapes all occur."""
    rng = np.random.default_rng(seed)
    values = weights(palette, seed, dtype)
    array = values[rng.integers(0, palette, n)]
    if specials:
        special = {"float32": np.array([np.nan, -np.inf, -0.0, 1e-45], np.float32),
                   "float16": np.array([np.nan, np.inf, -0.0, 6e-8], np.float16),
                   "bfloat16": np.array([0x7FC1, 0xFF80, 0x8000, 0x0001], np.uint16)}[dtype]
        array[rng.integers(0, n, 4)] = special
    check_codec_roundtrip(ByteGroup(dtype, coder=CODER), array)


def test_plane_zero_is_the_exponent_and_is_packed_for_float32_and_bfloat16():
    for dtype in ("float32", "bfloat16"):
        w = weights(200_000, 1, dtype)
        enc = ByteGroup(dtype, coder=CODER).encode(w)
        _, flags, n, _, _, table = bg.parse(np.frombuffer(enc, np.uint8))
        assert flags == bg.FLAG_SIGN_LAST and n == w.size
        assert table[0][0] == bg.PACKED and table[-1][0] == bg.RAW  # exponents packed, low byte raw
        assert len(enc) < len(ByteGroup(dtype, coder="zstd").encode(w))
        assert bits(ByteGroup(dtype).decode(enc)) == bits(w)  # any configured coder decodes format 2
    f16 = ByteGroup("float16", coder=CODER).encode(weights(50_000, 2, "float16"))
    assert bg.parse(np.frombuffer(f16, np.uint8))[1] == 0  # float16 keeps its sign in place


def test_each_plane_coder_is_chosen_where_it_wins():
    rng = np.random.default_rng(3)
    n = 300_000
    zeros = np.zeros(n, np.float32)  # every plane constant: zstd
    assert set(methods(ByteGroup(coder=CODER).encode(zeros))) == {bg.ZSTD}
    noise = rng.integers(0, 2**32, n, dtype=np.uint32).view(np.float32)  # nothing compresses: raw
    assert set(methods(ByteGroup(coder=CODER).encode(noise))) == {bg.RAW}
    low = (noise.view(np.uint32) & np.uint32(0xFFFFFF80)).view(np.float32)  # 1 random bit in plane 3
    enc = ByteGroup(coder=CODER).encode(low)
    assert methods(enc)[3] == bg.PACKED and bg.parse(np.frombuffer(enc, np.uint8))[5][3][1] < n // 8 + 64
    # too many exponents to pack; independent draws: zstd codes them within 2 % of the
    # order-0 bound, so Huffman (8x slower) is not even tried
    wide = (rng.standard_normal(n) * np.exp(rng.uniform(-30, 30, n))).astype(np.float32)
    enc = ByteGroup(coder=CODER).encode(wide)
    exponents = bg.split_planes(bg.sign_last(wide.view(np.uint8), 4), 4)[0]
    assert methods(enc)[0] == bg.ZSTD
    assert bg.parse(np.frombuffer(enc, np.uint8))[5][0][1] <= 1.02 * len(_planes.huffman(exponents))
    # exponents of rows sharing one pattern of column scales: zstd's short spurious matches
    # cost more than 2 % over the bound, so Huffman is tried, and wins
    cols = (rng.standard_normal((600, 500)) * np.linspace(0.001, 1, 500)).astype(np.float32)
    plane = bg.split_planes(bg.sign_last(cols.view(np.uint8).ravel(), 4), 4)[0]
    coder, body = _planes.encode_stream(plane, 1)
    assert coder == bg.HUFFMAN and body == _planes.huffman(plane)


@pytest.mark.parametrize("bits_needed,palette", [(1, 2), (2, 4), (4, 16)])
def test_values_the_sample_missed_become_escapes(bits_needed, palette):
    """The table comes from a sample of the plane; a value outside it is an escape, and a
    table that filled every rank gives up one rank (or widens) to make room."""
    n = 5 * _planes.SAMPLE
    data = (np.arange(n) % palette).astype(np.uint8)
    data[1::485] = 200  # never at a sampled position (every 5th byte)
    data[2::485] = 201
    hist = np.bincount(_planes.sample(data), minlength=256)
    assert hist[200] == hist[201] == 0
    body = _planes.pack(data, hist, 1)
    width, k, *_, escapes, _ = _planes.PACKED_HEADER.unpack_from(body)
    table = set(body[_planes.PACKED_HEADER.size:_planes.PACKED_HEADER.size + k])
    assert escapes == int(np.count_nonzero(~np.isin(data, list(table))))
    missed = int(np.count_nonzero(data >= 200))
    assert escapes > missed if bits_needed == 4 else escapes == missed  # 4 bits: a value dropped too
    assert (width, k) == ({1: 2, 2: 4, 4: 4}[bits_needed], palette - (bits_needed == 4))
    assert bits(_planes.unpack(body, n, "plane")) == data.tobytes()


def test_rank_packing_is_its_own_inverse_for_every_width_and_length():
    rng = np.random.default_rng(4)
    for width in _planes.RANK_BITS:
        for n in (0, 1, 7, 8, 9, 1001):
            ranks = rng.integers(0, 1 << width, n).astype(np.uint8)
            packed = _planes.pack_ranks(ranks, width)
            assert packed.size == -(-n // (8 // width))
            assert bits(_planes.unpack_ranks(packed, width, n)) == ranks.tobytes()
    assert _planes.pack_ranks(np.array([1, 2, 3], np.uint8), 4).tolist() == [0x21, 0x03]  # first low


@settings(max_examples=60, deadline=None)
@given(itemsize=st.sampled_from([2, 4]), n=st.integers(0, 3000), seed=st.integers(0, 2**32 - 1),
       offset=st.integers(0, 3))
def test_the_fused_plane_split_gives_the_planes_of_sign_last_then_split(itemsize, n, seed, offset):
    """byte_planes (one shift and one narrowing cast per plane) is the two-step definition
    byte for byte, rotated or not, on any bit pattern and on an unaligned buffer."""
    raw = np.random.default_rng(seed).integers(0, 256, n * itemsize + offset).astype(np.uint8)
    data = raw[offset:]
    for rotate in (False, True):
        expected = bg.split_planes(bg.sign_last(data, itemsize) if rotate else data, itemsize)
        got = bg.byte_planes(data, itemsize, rotate)
        assert [bits(p) for p in got] == [bits(p) for p in expected]
        assert all(p.dtype == np.uint8 and p.flags.c_contiguous for p in got)


def test_the_pair_lookup_is_a_lookup_per_byte_on_either_side_of_its_threshold():
    rng = np.random.default_rng(6)
    table = rng.permutation(256).astype(np.uint8)
    edge = _planes.PAIR_LOOKUP_MIN
    for n in (0, 1, 2, 3, edge - 1, edge, edge + 1, 3 * edge + 7):
        data = rng.integers(0, 256, n + 1).astype(np.uint8)[1:]  # odd start: unaligned byte pairs
        assert bits(_planes.lookup(table, data)) == bits(np.take(table, data))


def test_a_raw_stream_body_is_the_plane_itself_and_encode_stream_still_gives_bytes():
    data = np.random.default_rng(7).integers(0, 256, 200_000).astype(np.uint8)  # nothing shrinks it
    coder, body = _planes.stream_body(data, 1, packable=True)
    assert coder == _planes.RAW and isinstance(body, np.ndarray) and np.shares_memory(body, data)
    assert _planes.encode_stream(data, 1, packable=True) == (_planes.RAW, data.tobytes())


@pytest.mark.parametrize("field,offset,value", [
    ("packed width", 0, b"\x03"), ("table size", 1, b"\x00"), ("packed coder", 2, b"\x09"),
    ("packed length", 3, (10**9).to_bytes(8, "little")), ("escape count", 12, (10**9).to_bytes(8, "little")),
])
def test_corrupt_packed_bodies_raise_format_errors(field, offset, value):
    data = np.tile(np.array([0, 1, 2, 0, 0, 9], np.uint8), 500)
    body = bytearray(_planes.pack(data, np.bincount(data, minlength=256), 1))
    body[offset:offset + len(value)] = value
    with pytest.raises(FormatError, match="Expected") as info:
        _planes.unpack(bytes(body), data.size, "plane 0")
    assert "Got" in str(info.value), field


def test_a_truncated_or_padded_huffman_stream_is_a_format_error():
    data = np.random.default_rng(5).integers(0, 6, 10_000).astype(np.uint8)
    stream = _planes.huffman(data)
    assert _planes.inflate(stream, data.size, "s") == data.tobytes()
    for bad, size in ((stream[:-3], data.size), (stream + b"\x00", data.size), (stream, data.size - 1)):
        with pytest.raises(FormatError, match="deflate"):
            _planes.inflate(bad, size, "plane 1's deflate stream")


@settings(max_examples=60, deadline=None)
@given(position=st.integers(0, 10**6), bit=st.integers(0, 7))
def test_any_bit_flip_in_a_format_2_chunk_fails_or_decodes_to_the_original(position, bit):
    w = weights(3000, 6)
    w[::50] = 0.0  # a second common exponent, so planes pack
    enc = bytearray(ByteGroup(coder=CODER).encode(w))
    enc[position % len(enc)] ^= 1 << bit
    try:
        decoded = ByteGroup().decode(bytes(enc))
    except FormatError:
        return
    assert bits(decoded) == bits(w)


def test_format_2_is_refused_by_name_where_format_1_methods_are_expected():
    enc = bytearray(ByteGroup(coder=CODER).encode(weights(5000, 7)))
    enc[4] = 1  # claim format 1: the sign-last flag and methods 4/5 do not exist there
    with pytest.raises(FormatError, match="format 1"):
        ByteGroup().decode(bytes(enc))


# -- the zarr v3 front end -------------------------------------------------------------


def _bytegroup_codecs(array: np.ndarray, logical: str | None = None) -> dict[str, object]:
    """bytes + ``inshrink.bytegroup``: the zarr chain for float chunks (the store itself now
    writes raw bits and codes them as objects; zarr users and older stores use this one)."""
    from inshrink_store import dtypes

    element = dtypes.of_array(array, logical).codec_name
    return {"serializer": BytesCodec(endian="little"),
            "compressors": [ByteGroupZarrCodec(dtype=element, level=1)]}


def _zarr_round_trip(array: np.ndarray, logical: str, chunks: tuple[int, ...] | None = None,
                     concurrency: int = 10) -> tuple[np.ndarray, dict[str, bytes]]:
    written: dict[str, object] = {}
    chunking = (lambda shape, itemsize: chunks) if chunks else None
    with zarr.config.set({"async.concurrency": concurrency}):
        create_array(zarr.storage.MemoryStore(written), None, array, _bytegroup_codecs(array, logical), chunking)
        back = zarr.open_array(zarr.storage.MemoryStore(written), mode="r")[...]
    return np.asarray(back), {k: v.to_bytes() for k, v in written.items()}  # type: ignore[attr-defined]


@settings(max_examples=60, deadline=None)
@given(sample=float_arrays(max_dims=2, max_side=40), side=st.integers(1, 9))
def test_zarr_arrays_of_every_float_dtype_read_back_bit_exact(sample, side):
    array = sample.array
    chunks = tuple(min(side, max(s, 1)) for s in array.shape)  # several chunks and short edges
    back, written = _zarr_round_trip(array, LOGICAL[sample.dtype], chunks)
    assert back.dtype == array.dtype and bits(back) == bits(array)
    codecs = json.loads(written["zarr.json"])["codecs"]
    assert codecs[1] == {"name": "inshrink.bytegroup",
                         "configuration": {"coder": CODER, "dtype": sample.dtype, "level": 1}}


def test_chunks_are_encoded_in_parallel_into_the_same_bytes_whatever_the_concurrency():
    array = weights(6 << 20).reshape(-1, 1024)  # 24 MB: six 4 MiB chunks
    one = _zarr_round_trip(array, "F32", concurrency=1)[1]
    many = _zarr_round_trip(array, "F32", concurrency=16)[1]
    assert len(one) == 7 and one == many


def test_the_zarr_codec_configuration_round_trips_through_json_and_the_registry():
    from zarr.registry import get_codec_class

    codec = ByteGroupZarrCodec(dtype="bfloat16", level=3)
    entry = json.loads(json.dumps(codec.to_dict()))
    assert entry == {"name": "inshrink.bytegroup", "configuration": {"coder": CODER, "dtype": "bfloat16", "level": 3}}
    assert ByteGroupZarrCodec.from_dict(entry) == codec
    assert get_codec_class("inshrink.bytegroup") is ByteGroupZarrCodec
    assert ByteGroupZarrCodec.from_dict({"name": "inshrink.bytegroup",
                                         "configuration": {"dtype": "float16"}}).coder == CODER


@pytest.mark.parametrize("entry,named", [
    ({"name": "inshrink.bytegroup", "configuration": {}}, "dtype"),
    ({"name": "inshrink.bytegroup", "configuration": {"dtype": "float64"}}, "float64"),
    ({"name": "inshrink.bytegroup", "configuration": {"dtype": "float32", "shuffle": 1}}, "'shuffle'"),
    ({"name": "inshrink.bytegroup", "configuration": {"dtype": "float32", "level": 0}}, "level"),
    ({"name": "inshrink.bytegroup", "configuration": {"dtype": "float32", "coder": "lz4"}}, "coder"),
    ({"name": "inshrink.bytegroup", "configuration": ["float32"]}, "dict"),
    ({"name": "blosc", "configuration": {"dtype": "float32"}}, "inshrink.bytegroup"),
    ("inshrink.bytegroup", "inshrink.bytegroup"),
])
def test_malformed_zarr_configurations_raise_format_errors_naming_what_is_wrong(entry, named):
    with pytest.raises(FormatError, match=named) as info:
        ByteGroupZarrCodec.from_dict(entry)
    assert "Expected" in str(info.value) and "Got" in str(info.value)


@pytest.mark.parametrize("array_dtype,codec_dtype", [("float16", "float32"), ("uint16", "float16"),
                                                     ("float32", "bfloat16"), ("float64", "float32")])
def test_the_codec_refuses_an_array_of_another_dtype(array_dtype, codec_dtype):
    with pytest.raises(FormatError, match=codec_dtype):
        zarr.create_array(store=zarr.storage.MemoryStore(), shape=(4,), dtype=array_dtype,
                          compressors=[ByteGroupZarrCodec(dtype=codec_dtype)])


def test_a_chunk_of_the_wrong_size_is_a_format_error_before_anything_is_allocated():
    written: dict[str, object] = {}
    store = zarr.storage.MemoryStore(written)
    create_array(store, None, weights(8), _bytegroup_codecs(weights(8)), lambda shape, itemsize: (4,))
    written["c/1"] = written["c/0"].__class__.from_bytes(ByteGroup(coder=CODER).encode(weights(5)))  # type: ignore[attr-defined]
    with pytest.raises(FormatError, match="chunk of 16 bytes"):
        zarr.open_array(store, mode="r")[...]


def test_other_dtypes_keep_blosc_and_floats_are_raw_bits_for_the_object_store():
    for array in (np.arange(10, dtype=np.int64), np.ones(3, bool), np.linspace(0, 1, 5)):
        (codec,) = lossless_codecs(array)["compressors"]
        assert codec.to_dict()["name"] == "blosc"
    assert lossless_codecs(np.zeros(3, np.uint16))["compressors"][0].to_dict()["name"] == "blosc"
    for array, logical in ((np.zeros(3, np.uint16), "BF16"), (np.zeros(3, np.float32), None),
                           (np.zeros(3, np.float16), None)):
        codecs = lossless_codecs(array, logical)
        assert codecs["compressors"] is None and codecs["serializer"].to_dict()["name"] == "bytes"


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["float32", "float16", "bfloat16"]), st.integers(0, 300), st.integers(0, 2**31 - 1),
       st.integers(0, 40))
def test_keyframe_and_delta_in_one_go_are_the_two_separate_encodings(dtype: str, n: int, seed: int, flips: int) -> None:
    from inshrink_store.codecs.bytegroup import encode_chunk, encode_keyframe_and_delta

    itemsize = 4 if dtype == "float32" else 2
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n * itemsize, dtype=np.uint8)
    data = base.copy()
    if data.size:
        data[rng.integers(0, data.size, flips)] ^= rng.integers(1, 256, flips, dtype=np.uint8)
    keyframe, delta = encode_keyframe_and_delta(data, dtype, 1, "zstd+huffman", base=base)
    assert keyframe == encode_chunk(data, dtype, 1, "zstd+huffman")
    with_base = encode_chunk(data, dtype, 1, "zstd+huffman", base=base)
    assert (delta if delta is not None else keyframe) == with_base


def _reference_packed(data: np.ndarray, hist: np.ndarray) -> tuple[int, bytes, bytes, bytes]:
    """Ranking element by element, packing, then masking the escapes: the definition."""
    width, table, ranks, escaped = _planes._ranks(data, hist)
    escapes = data[escaped] if escaped is not None else np.zeros(0, np.uint8)
    return width, table.tobytes(), _planes.pack_ranks(ranks, width).tobytes(), escapes.tobytes()


@settings(max_examples=80, deadline=None)
@given(n=st.one_of(st.integers(0, 3 * _planes.PAIR_LOOKUP_MIN + 5),  # around the pair threshold
                   st.integers(2 * _planes.SAMPLE, 3 * _planes.SAMPLE + 5)),  # a strided sample
       palette=st.integers(1, 40),
       hidden=st.integers(0, 6), seed=st.integers(0, 2**32 - 1), offset=st.integers(0, 1))
def test_packing_by_byte_pairs_gives_the_bytes_of_ranking_each_byte(n, palette, hidden, seed, offset):
    """_packed (one lookup per byte pair, escapes found from the packed pairs) is the
    element-by-element definition byte for byte: every width, odd lengths, unaligned
    planes, escapes the sample sees and escapes it misses (values planted between the
    sampled bytes), tables with and without a rank left for the escape."""
    rng = np.random.default_rng(seed)
    raw = (rng.zipf(1.5, n + offset) % palette * 3).astype(np.uint8)
    data = raw[offset:]
    stride = max(1, n // _planes.SAMPLE)
    if stride > 1:
        at = rng.integers(0, n, hidden)
        data[at[at % stride != 0]] = 250  # off the sample's stride: escapes it cannot see
    hist = np.bincount(_planes.sample(data), minlength=256)
    if not hist.any():
        return
    width, table, packed, escapes = _planes._packed(data, hist)
    assert (width, table.tobytes(), packed.tobytes(), escapes.tobytes()) == _reference_packed(data, hist)


@pytest.mark.parametrize("n", [3 * _planes.SAMPLE + 3, 3 * _planes.SAMPLE + 2])
def test_an_escape_in_the_last_element_of_an_odd_or_even_plane_is_kept(n):
    rng = np.random.default_rng(14)
    data = rng.integers(0, 3, n).astype(np.uint8)
    assert (n - 1) % (n // _planes.SAMPLE)  # the sample (every third byte) misses the last
    data[-1] = 99  # so it is not in the table: an escape
    hist = np.bincount(_planes.sample(data), minlength=256)
    width, table, packed, escapes = _planes._packed(data, hist)
    assert escapes.tolist() == [99]
    assert (width, table.tobytes(), packed.tobytes(), escapes.tobytes()) == _reference_packed(data, hist)


def test_the_pair_path_runs_where_the_sample_gives_the_final_table():
    """Large planes with 4 or 2 bit ranks and an escape rank to spare take the pair path
    (checked by making the element path fail); full tables and one bit do not."""
    rng = np.random.default_rng(11)
    n = 4 * _planes.PAIR_LOOKUP_MIN
    exponents = (120 + rng.zipf(1.3, n) % 30).astype(np.uint8)  # > 16 values: 15 ranks + escape
    three = rng.integers(0, 3, n).astype(np.uint8)  # 2 bits, rank 3 left for the escape
    for data in (exponents, three):
        hist = np.bincount(_planes.sample(data), minlength=256)
        original = _planes._ranks
        try:
            _planes._ranks = None  # type: ignore[assignment]  # the pair path must not need it
            width, table, packed, escapes = _planes._packed(data, hist)
        finally:
            _planes._ranks = original
        assert (width, table.tobytes(), packed.tobytes(), escapes.tobytes()) == _reference_packed(data, hist)


def _coders_tried(monkeypatch, data: np.ndarray) -> list[str]:
    tried: list[str] = []
    for name in ("huffman", "pack"):
        real = getattr(_planes, name)
        monkeypatch.setattr(_planes, name, lambda *a, _real=real, _name=name: tried.append(_name) or _real(*a))
    _planes.stream_body(data, 1, packable=True)
    return tried


def test_huffman_is_skipped_on_a_mid_sized_plane_where_zstd_comes_near_the_bound(monkeypatch):
    """From TRY_ALL_BELOW bytes, zstd on the whole plane decides Huffman as a trial does:
    a skewed plane of 40 values (not packable) that zstd codes near its entropy skips
    Huffman; below TRY_ALL_BELOW, Huffman is still tried."""
    rng = np.random.default_rng(12)
    values = np.minimum(rng.geometric(0.12, 100_000), 60).astype(np.uint8)  # skewed, > 15 values
    big, small = values, values[: _planes.TRY_ALL_BELOW - 1]
    assert _coders_tried(monkeypatch, small) == ["huffman"]
    assert _coders_tried(monkeypatch, big) == []
    coder, body = _planes.stream_body(big, 1, packable=True)
    assert coder == _planes.ZSTD and len(body) <= 1.02 * _planes.entropy_bytes(np.bincount(big, minlength=256)) + 64


def test_zstd_is_skipped_on_a_large_plane_whose_head_packs_clearly_smaller(monkeypatch):
    """An exponent-like plane (a few values, each repeated a while) whose zstd trial comes
    within 2 % of the order-0 bound, so zstd would be tried, but whose head packs more than
    3 % smaller: zstd is never run on the whole plane, and the packed body is stored (it
    is 13 % below zstd's on the whole plane)."""
    rng = np.random.default_rng(13)
    n = 4 * _planes.SAMPLE
    draws = (124 + np.clip(np.round(rng.standard_normal(n) * 1.5), -6, 3)).astype(np.uint8)
    changes = np.where(rng.random(n) > 0.5, np.arange(n), 0)
    plane = draws[np.maximum.accumulate(changes)]  # each value kept until the next change
    trial = _planes._zstd_trial(plane, 1)
    assert trial is not None and trial[0] <= (1 + _planes.HUFFMAN_GAIN) * trial[1] + _planes.ZSTD_SLACK
    calls: list[int] = []
    real = _planes._zstd.compress

    def counting(data, level):
        calls.append(len(memoryview(data).cast("B")))
        return real(data, level)

    monkeypatch.setattr(_planes._zstd, "compress", counting)
    coder, _ = _planes.stream_body(plane, 1, packable=True)
    assert coder == _planes.PACKED
    assert n not in calls and max(calls) < n  # trials and the packed stream only


def test_the_thread_local_compressor_writes_the_bytes_of_a_fresh_one_on_every_thread():
    """zstd frames from the per-thread compressors (reused across calls and levels) are
    those of a new compressor each time, on any thread."""
    import threading

    import zstandard

    rng = np.random.default_rng(15)
    inputs = [rng.integers(0, k, n).astype(np.uint8).tobytes() for k in (2, 30, 256) for n in (0, 100, 70_000)]
    expected = [zstandard.ZstdCompressor(level=lv).compress(d) for lv in (1, 3) for d in inputs]
    got: dict[int, list[bytes]] = {}

    def run(i: int) -> None:
        got[i] = [_planes._zstd.compress(d, lv) for lv in (1, 3) for d in inputs]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(got[i] == expected for i in range(3))

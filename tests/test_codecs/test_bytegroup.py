"""Property tests of the inshrink.bytegroup codec: bit-exact, deterministic, clear errors."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import numcodecs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store.codecs import bytegroup as bg
from inshrink_store.codecs.bytegroup import ByteGroup
from inshrink_store.errors import FormatError, IntegrityError
from inshrink_store.testing import check_codec_roundtrip, float_arrays

REPO = Path(__file__).resolve().parents[2]
VECTORS = REPO / "codecs" / "inshrink.bytegroup" / "vectors"
CARRIER = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@settings(max_examples=60, deadline=None)
@given(sample=float_arrays(), level=st.sampled_from([1, 3]))
def test_every_float_dtype_round_trips_bit_exact_with_special_values(sample, level):
    check_codec_roundtrip(ByteGroup(sample.dtype, level=level), sample.array)


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(sorted(CARRIER)), seed=st.integers(0, 2**32 - 1),
       n=st.integers(0, 3000), changed=st.sampled_from([0.0, 0.01, 0.3, 1.0]))
def test_xor_with_a_base_round_trips_and_is_deterministic(dtype, seed, n, changed):
    rng = np.random.default_rng(seed)
    word = np.dtype(CARRIER[dtype]).itemsize
    base = rng.integers(0, 256, n * word, dtype=np.uint8)
    cur = base.copy()
    mask = rng.random(cur.size) < changed
    cur[mask] = rng.integers(0, 256, int(mask.sum()), dtype=np.uint8)
    codec = ByteGroup(dtype)
    enc = codec.encode(cur, base=base)
    assert codec.encode(cur.tobytes(), base=memoryview(base.tobytes())) == enc
    assert bits(codec.decode(enc, base=base)) == cur.tobytes()
    assert len(enc) <= len(codec.encode(cur)) + 8  # XOR only where it is smaller (+ base hash)


def test_bit_patterns_that_floats_lose_survive():
    f32 = np.array([0x7F800001, 0xFFC12345, 0x80000000, 0x00000001, 0x807FFFFF, 0xFF800000],
                   np.uint32).view(np.float32)
    f16 = np.array([0x7C01, 0xFE01, 0x8000, 0x0001, 0x83FF, 0xFC00], np.uint16).view(np.float16)
    bf16 = np.array([0x7F81, 0xFFC1, 0x8000, 0x0001, 0x807F, 0xFF80], np.uint16)
    for dtype, array in (("float32", f32), ("float16", f16), ("bfloat16", bf16)):
        check_codec_roundtrip(ByteGroup(dtype), array)
        decoded = ByteGroup(dtype).decode(ByteGroup(dtype).encode(array))
        assert decoded.dtype == array.dtype and bits(decoded) == bits(array)


def test_planes_are_chosen_per_chunk_and_recorded():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(50_000) * 0.02).astype(np.float32)
    code, flags, n, _, _, table = bg.parse(np.frombuffer(ByteGroup().encode(w), np.uint8))
    assert (code, flags, n) == (0, 0, w.size)
    assert table[0][0] == bg.ZSTD and table[0][1] < w.size // 2  # sign + exponent byte compresses
    assert table[3][0] == bg.RAW  # the lowest mantissa byte is noise: stored raw
    assert bg.split_planes(w.view(np.uint8), 4)[0].tobytes() == (w.view(np.uint32) >> 24).astype(np.uint8).tobytes()


def test_an_unchanged_tensor_against_its_base_is_almost_nothing():
    w = (np.random.default_rng(1).standard_normal(100_000) * 0.02).astype(np.float32)
    enc = ByteGroup().encode(w, base=w)
    assert len(enc) < 200
    assert bits(ByteGroup().decode(enc, base=w)) == bits(w)


def test_config_round_trips_through_json_and_the_registry():
    codec = ByteGroup("bfloat16", level=7)
    config = json.loads(json.dumps(codec.get_config()))
    assert config == {"id": "inshrink.bytegroup", "coder": "zstd", "dtype": "bfloat16", "level": 7}
    assert numcodecs.get_codec(config) == codec
    assert numcodecs.registry.codec_registry["inshrink.bytegroup"] is ByteGroup


@pytest.mark.parametrize("config", [
    {"dtype": "float64"}, {"dtype": "int8"}, {"level": 0}, {"level": 23}, {"level": True},
    {"level": 2.5}, {"coder": "lz4"},
])
def test_bad_configurations_raise_format_errors(config):
    with pytest.raises(FormatError, match="Expected"):
        ByteGroup(**config)


def test_unknown_config_keys_are_refused_by_name():
    with pytest.raises(FormatError, match="'shuffle'"):
        ByteGroup.from_config({"id": "inshrink.bytegroup", "dtype": "float32", "shuffle": 1})
    with pytest.raises(FormatError, match="dict"):
        ByteGroup.from_config(["float32"])  # type: ignore[arg-type]


def _chunk() -> tuple[np.ndarray, bytes]:
    w = (np.random.default_rng(2).standard_normal(500) * 0.02).astype(np.float32)
    return w, ByteGroup().encode(w)


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(0, 10_000))
def test_truncated_or_extended_chunks_raise_format_errors(cut):
    _, enc = _chunk()
    bad = enc[: cut % len(enc)] if cut < 5000 else enc + bytes(cut % 7 + 1)
    with pytest.raises(FormatError, match="Expected"):
        ByteGroup().decode(bad)


# header / plane-table offsets (codecs/inshrink.bytegroup/README.md) and a corrupt value for each
CORRUPTIONS = {
    "magic": (0, b"NOPE", "IBG"), "version": (4, b"\x09", "version"), "dtype code": (5, b"\x09", "dtype code"),
    "flags": (6, b"\x04", "flags"), "plane count": (7, b"\x02", "planes"),
    "count": (8, (501).to_bytes(8, "little"), "n=501"),
    "huge count": (8, (10**18).to_bytes(8, "little"), "Expected"),
    "checksum": (16, (1).to_bytes(8, "little"), "xxh3-64"),
    "base hash": (24, (5).to_bytes(8, "little"), "base"),
    "method": (32, b"\x07", "method"), "plane length": (33, (3).to_bytes(8, "little"), "Expected"),
    "base flag": (6, b"\x01", "base flag"),
}


@pytest.mark.parametrize("field", sorted(CORRUPTIONS))
def test_corrupt_header_fields_raise_format_errors_naming_what_is_wrong(field):
    _, enc = _chunk()
    data = bytearray(enc)
    offset, value, named = CORRUPTIONS[field]
    data[offset:offset + len(value)] = value
    with pytest.raises(FormatError, match=named) as info:
        ByteGroup().decode(bytes(data))
    assert "Got" in str(info.value)


@settings(max_examples=80, deadline=None)
@given(position=st.integers(0, 10**6), bit=st.integers(0, 7))
def test_any_bit_flip_is_a_format_error_never_a_wrong_chunk(position, bit):
    """The checksum of the decoded data catches every flip that changes it; a flip zstd ignores
    (say, an unused frame-header bit) may still decode, but only to the original chunk."""
    w, enc = _chunk()
    data = bytearray(enc)
    data[position % len(data)] ^= 1 << bit
    try:
        decoded = ByteGroup().decode(bytes(data))
    except FormatError:
        return
    assert bits(decoded) == bits(w)


def test_dtype_mismatch_odd_sizes_and_out_buffers():
    w, enc = _chunk()
    with pytest.raises(FormatError, match="float16 chunk"):
        ByteGroup("float16").decode(enc)
    with pytest.raises(FormatError, match="whole float32 elements"):
        ByteGroup().encode(b"\x00" * 6)
    with pytest.raises(FormatError, match="out buffer"):
        ByteGroup().decode(enc, out=bytearray(w.nbytes - 4))


def test_wrong_or_missing_base_is_detected():
    rng = np.random.default_rng(3)
    base = (rng.standard_normal(400) * 0.02).astype(np.float32)
    cur = base.copy()
    cur[::5] *= np.float32(1.01)
    enc = ByteGroup().encode(cur, base=base)
    assert bg.parse(np.frombuffer(enc, np.uint8))[1] == bg.FLAG_BASE
    with pytest.raises(FormatError, match="base="):
        ByteGroup().decode(enc)
    with pytest.raises(IntegrityError, match="base"):
        ByteGroup().decode(enc, base=base[::-1].copy())
    with pytest.raises(FormatError, match="base chunk of"):
        ByteGroup().encode(cur, base=base[:-1])


def test_a_chunk_without_xor_decodes_with_or_without_a_base():
    w, enc = _chunk()
    assert bits(ByteGroup().decode(enc, base=w[::-1].copy())) == bits(w)


def test_vectors_script_reproduces_the_committed_vectors(tmp_path):
    main = runpy.run_path(str(REPO / "codecs" / "inshrink.bytegroup" / "make_vectors.py"), run_name="not_main")["main"]
    main(tmp_path)
    made = tmp_path / "inshrink.bytegroup" / "vectors"
    names = sorted(p.relative_to(made) for p in made.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(VECTORS) for p in VECTORS.rglob("*") if p.is_file())
    for name in names:
        assert (made / name).read_bytes() == (VECTORS / name).read_bytes(), name


@pytest.mark.parametrize("folder", sorted(VECTORS.iterdir()), ids=lambda p: p.name)
def test_golden_vectors_decode_bit_exact(folder):
    codec = numcodecs.get_codec(json.loads((folder / "config.json").read_text()))
    given_ = np.load(folder / "input.npy", allow_pickle=False)
    encoded = (folder / "encoded.bin").read_bytes()
    base = (folder / "base.bin").read_bytes() if (folder / "base.bin").exists() else None
    decoded = codec.decode(encoded, base=base)
    assert bits(decoded) == given_.tobytes()
    if base is None:
        assert decoded.dtype == given_.dtype
    assert codec.encode(given_, base=base) == encoded

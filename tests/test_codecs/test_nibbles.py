"""Level ids two per byte: the object store's coder 2 for quantized keyframes of <= 16 levels."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import inshrink_store as ins
from inshrink_store import cas, object_format
from inshrink_store.codecs import _nibbles, _payload
from inshrink_store.errors import FormatError, IntegrityError
from inshrink_store.policy import QuantConfig


@st.composite
def payloads(draw: st.DrawFn, max_levels: int = 31) -> bytes:
    levels = draw(st.integers(1, max_levels))
    n = draw(st.integers(0, 300))
    ids = np.array(draw(st.lists(st.integers(0, levels - 1), min_size=n, max_size=n)), np.uint8)
    dtype = draw(st.sampled_from(["bfloat16", "float32"]))
    n_prot = int(np.count_nonzero(ids == levels - 1))
    protected = np.arange(n_prot, dtype=np.uint16 if dtype == "bfloat16" else np.float32)
    return _payload.pack(levels, ids, dtype, protected)


@settings(max_examples=300, deadline=None)
@given(payload=payloads())
def test_pack_then_unpack_is_the_identity_and_halves_the_ids(payload: bytes) -> None:
    assert _nibbles.packable(payload)
    packed = _nibbles.pack(payload)
    parsed = _payload.unpack(payload)
    n = parsed.count
    escapes = int(np.count_nonzero(parsed.ids >= 15)) if parsed.levels > 16 else 0
    assert len(packed) == len(payload) - n + (n + 1) // 2 + escapes
    assert _nibbles.unpack(packed) == payload
    assert _nibbles.pack(payload) == packed  # deterministic


@settings(max_examples=100, deadline=None)
@given(payload=payloads(), cut=st.integers(1, 40))
def test_a_truncated_or_extended_packed_payload_is_a_format_error(payload: bytes, cut: int) -> None:
    packed = _nibbles.pack(payload)
    with pytest.raises(FormatError):
        _nibbles.unpack(packed[:-cut] if cut <= len(packed) else b"")
    with pytest.raises(FormatError, match="bytes of packed payload"):
        _nibbles.unpack(packed + b"\0")


def test_what_cannot_be_packed_is_refused() -> None:
    wide = _payload.pack(300, np.arange(10) % 299, "bfloat16", np.zeros(0, np.uint16))
    many = _payload.pack(32, np.arange(32) % 31, "bfloat16", np.zeros(0, np.uint16))
    for payload in (wide, many, b"not a payload at all, just bytes"):
        assert not _nibbles.packable(payload)
        with pytest.raises(FormatError):
            _nibbles.pack(payload)
    odd = bytearray(_nibbles.pack(_payload.pack(4, np.array([1, 2, 0]), "bfloat16", np.zeros(0, np.uint16))))
    odd[_payload.HEADER_SIZE + 1] |= 0x30  # the unpaired last id's unused high nibble
    with pytest.raises(FormatError, match="high nibble"):
        _nibbles.unpack(bytes(odd))
    escaped = bytearray(_nibbles.pack(_payload.pack(20, np.array([19, 3, 16]), "bfloat16", np.ones(1, np.uint16))))
    escaped[_payload.HEADER_SIZE + 2] = 9  # the first escape's extra byte: id 15 + 9 >= B = 20
    with pytest.raises(FormatError, match="escaped ids below"):
        _nibbles.unpack(bytes(escaped))


def _object_coder(repo: ins.Repository, tensor: str) -> int:
    (oid,) = repo.checkout("main").arrays()[tensor].chunk_ids.values()
    return cas.ObjectStore(repo._storage).header(oid).coder


@pytest.mark.parametrize(("bins", "coder"), [(4, object_format.CODER_PACKED_ZSTD), (8, object_format.CODER_PACKED_ZSTD),
                                             (16, object_format.CODER_PACKED_ZSTD), (64, object_format.CODER_ZSTD)])
def test_the_store_packs_few_level_keyframes_and_reads_them_back_exactly(memory_url: str, bins: int,
                                                                         coder: int) -> None:
    rng = np.random.default_rng(bins)
    w = (rng.standard_t(4, (256, 128)) * 0.02).astype(np.float32)
    config = QuantConfig(bins=bins, protect=0.005)
    planned = config.plan({"w": w}, {"w": "F32"}, {})["w"].values  # what the codec is handed
    repo = ins.init(memory_url)
    repo.save({"w": w}, quantize=config)
    assert _object_coder(repo, "w") == coder
    np.testing.assert_array_equal(ins.open(memory_url).load()["w"], planned)


def test_a_packed_object_whose_body_lies_is_an_integrity_error(memory_url: str) -> None:
    """A packed body that decompresses to the wrong length is caught, naming the object."""
    repo = ins.init(memory_url)
    w = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
    repo.save({"w": w}, quantize=QuantConfig(bins=4))
    (oid,) = repo.checkout("main").arrays()["w"].chunk_ids.values()
    store = cas.ObjectStore(repo._storage)
    payload = store.get(oid)
    body = zstandard.ZstdCompressor().compress(_nibbles.pack(payload) + b"\0\0")
    repo._storage.write(cas.object_path(oid), object_format.frame(object_format.KIND_WHOLE, object_format.CODER_PACKED_ZSTD, 0, payload, None, body))
    with pytest.raises(IntegrityError, match=oid):
        cas.ObjectStore(repo._storage).get(oid)

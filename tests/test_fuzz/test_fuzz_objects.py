"""Object headers and bodies: bit flips of real objects, random bytes, crafted lengths."""

from __future__ import annotations

import struct
import uuid

import numpy as np
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from inshrink_store import cas, object_format
from inshrink_store.codecs import _payload
from inshrink_store.storage import open_storage
from tests.test_fuzz._hostile import FAST, INTERESTING_INTS, SLOW, bounded, mutate_bytes

_STORAGE = open_storage(f"memory://fuzz-objects-{uuid.uuid4().hex}")


def _quantized(seed: int, changed: int = 0) -> bytes:
    ids = np.random.default_rng(seed).integers(0, 15, size=2048).astype(np.uint8)
    ids[:changed] = (ids[:changed] + 1) % 15
    return _payload.pack(16, ids, "bfloat16", np.zeros(0, np.uint16))


def _real_objects() -> dict[str, tuple[bytes, bytes]]:
    """Name -> (object id, ...) of a raw keyframe, a zstd keyframe and a delta, with payloads."""
    objects = cas.ObjectStore(_STORAGE)
    raw = objects.put(b"lossless chunk bytes" * 20).oid
    base = objects.put(_quantized(1)).oid
    delta = objects.put(_quantized(1, changed=30), base=base)
    assert delta.kind == object_format.KIND_DELTA
    return {
        oid: (_STORAGE.read(cas.object_path(oid)), cas.ObjectStore(_STORAGE).get(oid))
        for oid in (raw, base, delta.oid)
    }


REAL = _real_objects()
OIDS = sorted(REAL)


def _read_back(oid: str, stored: bytes) -> None:
    """Store ``stored`` as ``oid``; reading it either fails with an InshrinkError or is right."""
    _STORAGE.write(cas.object_path(oid), stored)
    try:
        with bounded() as outcome:
            payload = cas.ObjectStore(_STORAGE).get(oid)
        if outcome.error is None:
            assert payload == REAL[oid][1]
        with bounded():
            cas.ObjectStore(_STORAGE).header(oid)
        with bounded():
            cas.ObjectStore(_STORAGE).chain(oid)
    finally:
        _STORAGE.write(cas.object_path(oid), REAL[oid][0])


def _mutated(data: st.DataObject) -> None:
    oid = data.draw(st.sampled_from(OIDS), label="object")
    _read_back(oid, mutate_bytes(REAL[oid][0], data))


def _crafted(data: st.DataObject) -> None:
    """Any header fields, with a *valid* checksum: only the bounds stand in the way."""
    oid = data.draw(st.sampled_from(OIDS), label="object")
    stored = REAL[oid][0]
    _, kind, coder, depth, length, base, _ = object_format.HEADER.unpack_from(stored)
    kind = data.draw(st.sampled_from([kind, 0, 1, 2, 255]), label="kind")
    coder = data.draw(st.sampled_from([coder, 0, 1, 7]), label="coder")
    depth = data.draw(st.one_of(st.just(depth), st.integers(0, 65535)), label="depth")
    length = data.draw(st.one_of(st.just(length), INTERESTING_INTS.filter(lambda v: 0 <= v < 2**64),
                                 st.integers(0, 2**64 - 1)), label="length")
    base = data.draw(st.one_of(st.just(base), st.sampled_from([bytes.fromhex(o) for o in OIDS]),
                               st.binary(min_size=16, max_size=16)), label="base")
    body = stored[object_format.HEADER_SIZE:]
    if data.draw(st.booleans(), label="zstd body"):
        size = data.draw(st.sampled_from([0, 1, 1000, 1 << 20, 8 << 20]), label="zstd size")
        body = zstandard.ZstdCompressor().compress(b"\0" * size)
    version = data.draw(st.sampled_from([1, 2]), label="version")
    magic = object_format.MAGIC_V2 if version == 2 else object_format.MAGIC_V1
    head = object_format.HEADER.pack(magic, kind, coder, depth, length, base, 0)[: object_format.CHECKED_HEADER]
    checksum = object_format.object_checksum(head if version == 2 else b"", body)
    _read_back(oid, head + struct.pack("<Q", checksum) + body)


@FAST
@given(data=st.data())
def test_mutated_objects(data: st.DataObject) -> None:
    _mutated(data)


@FAST
@given(data=st.data())
def test_crafted_headers(data: st.DataObject) -> None:
    _crafted(data)


@FAST
@given(raw=st.binary(max_size=512))
def test_random_bytes_as_an_object(raw: bytes) -> None:
    _read_back(OIDS[0], raw)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_mutated_objects_long(data: st.DataObject) -> None:
    _mutated(data)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_crafted_headers_long(data: st.DataObject) -> None:
    _crafted(data)


def test_every_single_bit_flip_of_each_real_object() -> None:
    for oid, (stored, _payload_bytes) in REAL.items():
        for pos in range(len(stored)):
            for bit in (0, 7):
                flipped = bytearray(stored)
                flipped[pos] ^= 1 << bit
                _read_back(oid, bytes(flipped))

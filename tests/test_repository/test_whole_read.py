"""Whole-array reads without zarr's event loop (``inshrink_store.whole_read``) give exactly
what zarr itself reads, for every codec chain the fast path takes, and fall back to zarr
for chains it does not know."""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zarr.codecs import BloscCodec, BytesCodec, TransposeCodec, ZstdCodec

import inshrink_store as ins
from inshrink_store import whole_read
from inshrink_store.codecs.bytegroup import ByteGroupZarrCodec
from inshrink_store.codecs.nuq import NUQZarrCodec
from inshrink_store.errors import IntegrityError

CODEBOOK = (-1.0, -0.25, 0.0, 0.5, 2.0)


def _chains(dtype: str) -> list[tuple[str, dict[str, Any]]]:
    chains: list[tuple[str, dict[str, Any]]] = [
        ("bytes+zstd", {"serializer": BytesCodec(), "compressors": [ZstdCodec(level=1)]}),
        ("bytes+blosc", {"serializer": BytesCodec(), "compressors": [BloscCodec(cname="zstd", clevel=1)]}),
        ("bytes", {"serializer": BytesCodec(), "compressors": None}),
    ]
    if dtype in ("float32", "float16"):
        chains.append(("bytegroup", {"serializer": BytesCodec(endian="little"),
                                     "compressors": [ByteGroupZarrCodec(dtype=dtype, level=1)]}))
        chains.append(("nuq", {"serializer": NUQZarrCodec(codebook=CODEBOOK, tolerance=0.0),
                               "compressors": None}))
    return chains


shapes = st.lists(st.integers(1, 9), min_size=1, max_size=3).flatmap(
    lambda shape: st.tuples(st.just(tuple(shape)),
                            st.tuples(*(st.integers(1, s + 2) for s in shape))))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape_chunks=shapes, dtype=st.sampled_from(["float32", "float16", "int64", "uint8", "bool"]),
       seed=st.integers(0, 2**31 - 1), chain=st.integers(0, 4))
def test_whole_read_matches_zarr(shape_chunks: tuple[tuple[int, ...], tuple[int, ...]], dtype: str,
                                 seed: int, chain: int) -> None:
    shape, chunks = shape_chunks
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(shape) * 3).astype(dtype)
    if dtype == "float32" and values.size > 2:
        values.flat[:3] = [np.nan, -0.0, np.inf]
    options = _chains(dtype)
    name, codecs = options[chain % len(options)]
    repo = ins.open(f"memory://whole-read-{uuid.uuid4().hex}", create=True)
    tx = repo.transaction()
    z = zarr.create_array(store=tx.store, name="t", shape=shape, chunks=chunks, dtype=dtype,
                          fill_value=0, **codecs)
    z[...] = values
    tx.commit()
    reader = ins.open(repo.url).checkout()
    assert reader._whole_plan("t") is not None, name  # the fast path was taken
    fast = reader.read("t")
    through_zarr = np.asarray(reader["t"][...])
    assert fast.dtype == through_zarr.dtype and fast.shape == shape
    assert fast.tobytes() == through_zarr.tobytes(), name
    assert fast.flags.writeable and fast.flags.c_contiguous
    if name != "nuq":
        assert fast.tobytes() == values.tobytes()
    uncached = ins.open(repo.url).checkout().read("t", cache=False)  # ObjectStore.take's chunks
    assert uncached.tobytes() == through_zarr.tobytes() and uncached.dtype == fast.dtype, name
    assert uncached.flags.writeable and uncached.flags.c_contiguous


def test_store_written_tensors_take_the_fast_path_and_are_writable() -> None:
    repo = ins.open(f"memory://whole-read-{uuid.uuid4().hex}", create=True)
    rng = np.random.default_rng(0)
    tensors = {"big": rng.standard_normal((1100, 1024)).astype(np.float32),  # two 4 MiB chunks
               "small": rng.standard_normal(7).astype(np.float32),
               "ints": np.arange(10, dtype=np.int64)}
    repo.save(tensors)
    reader = ins.open(repo.url).checkout()
    for name, expected in tensors.items():
        assert reader._whole_plan(name) is not None
        got = reader.read(name)
        np.testing.assert_array_equal(got, expected)
        got[...] = 0  # a restore hands arrays to torch.from_numpy: they must be writable
    np.testing.assert_array_equal(reader.read("big"), tensors["big"])  # nothing cached was changed


def test_an_uncached_read_is_the_same_tensor_in_memory_of_its_own_and_caches_nothing() -> None:
    """``read(cache=False)`` (an export's reads, issue 43 item 10): the same values, writable;
    a one-chunk tensor is the decoded chunk itself and the object store keeps none of them,
    so a later cached read, and a later uncached one, are unaffected by writes to it."""
    repo = ins.open(f"memory://whole-read-{uuid.uuid4().hex}", create=True)
    rng = np.random.default_rng(1)
    tensors = {"big": rng.standard_normal((1100, 1024)).astype(np.float32),  # two 4 MiB chunks
               "small": rng.standard_normal(7).astype(np.float32),
               "ints": np.arange(10, dtype=np.int64)}
    for step in range(3):  # deltas: the newest chunks are chains of bytegroup links
        repo.save({k: v + step if v.dtype == np.float32 else v for k, v in tensors.items()})
    expected = {k: v + 2 if v.dtype == np.float32 else v for k, v in tensors.items()}
    reader = ins.open(repo.url).checkout()
    objects = reader.view.objects
    for name, want in expected.items():
        got = reader.read_many([name], cache=False)[name]
        np.testing.assert_array_equal(got, want)
        assert got.flags.writeable and got.flags.c_contiguous
        got[...] = 0
    assert objects._cache._size == 0  # nothing kept: no chunk, and no link of a chain
    for name, want in expected.items():
        np.testing.assert_array_equal(reader.read(name, cache=False), want)
        np.testing.assert_array_equal(reader.read(name), want)  # cached now
        fresh = reader.read(name, cache=False)  # a copy out of the cache, not the cache's bytes
        fresh[...] = 0
        np.testing.assert_array_equal(reader.read(name), want)


def test_an_unknown_chain_reads_through_zarr() -> None:
    repo = ins.open(f"memory://whole-read-{uuid.uuid4().hex}", create=True)
    tx = repo.transaction()
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    z = zarr.create_array(store=tx.store, name="t", shape=(3, 4), chunks=(2, 3), dtype="float32",
                          filters=[TransposeCodec(order=(1, 0))], serializer=BytesCodec(), compressors=None)
    z[...] = values
    tx.commit()
    reader = ins.open(repo.url).checkout()
    assert reader._whole_plan("t") is None
    np.testing.assert_array_equal(reader.read("t"), values)


def test_missing_chunks_read_as_the_fill_value() -> None:
    repo = ins.open(f"memory://whole-read-{uuid.uuid4().hex}", create=True)
    tx = repo.transaction()
    z = zarr.create_array(store=tx.store, name="t", shape=(30,), chunks=(10,), dtype="float32",
                          fill_value=7.0, serializer=BytesCodec(), compressors=[ZstdCodec(level=1)])
    z[:10] = 1.0  # chunks equal to the fill value are not written
    tx.commit()
    reader = ins.open(repo.url).checkout()
    assert len(reader.arrays()["t"].chunk_ids) == 1
    np.testing.assert_array_equal(reader.read("t"), np.r_[np.ones(10), np.full(20, 7.0)].astype(np.float32))


def test_a_corrupt_chunk_is_an_error_naming_the_tensor() -> None:
    repo = ins.open(f"memory://whole-read-{uuid.uuid4().hex}", create=True)
    repo.save({"w": np.arange(64, dtype=np.float32)})
    reader = ins.open(repo.url).checkout()
    oid = next(iter(reader.arrays()["w"].chunk_ids.values()))
    storage = reader.view.objects.storage
    from inshrink_store.layout import object_path
    stored = bytearray(storage.read(object_path(oid)))
    stored[-1] ^= 0xFF
    storage.write(object_path(oid), bytes(stored))
    with pytest.raises(IntegrityError, match="Chunk 'w/c/0'.*checksum"):
        ins.open(repo.url).checkout().read("w")


def test_plan_refuses_metadata_zarr_refuses() -> None:
    doc = {"zarr_format": 3, "node_type": "array", "shape": [4], "data_type": "float32",
           "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2]}},
           "chunk_key_encoding": {"name": "default"}, "fill_value": 0,
           "codecs": [{"name": "no-such-codec"}]}
    with pytest.raises(Exception, match="no-such-codec"):
        whole_read.plan(json.dumps(doc).encode())


def _doc(**change: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"zarr_format": 3, "node_type": "array", "shape": [4, 6], "data_type": "float32",
                           "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2, 6]}},
                           "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
                           "fill_value": 0.0, "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
                           "attributes": {"inshrink": {"content": "a"}}}
    doc.update(change)
    return doc


def test_plans_are_shared_by_documents_differing_in_attributes_only() -> None:
    """A version's tensors share a handful of plans (issue 43, item 10): zarr parses each
    distinct shape, dtype and codec chain once; any other difference is another plan."""
    first = whole_read.plan(json.dumps(_doc()).encode())
    assert first is not None and first.metadata.attributes == {}
    same = [_doc(attributes={"inshrink": {"content": "b"}}), _doc(attributes=None), _doc(attributes="not a dict")]
    assert all(whole_read.plan(json.dumps(d).encode()) is first for d in same)
    other = [_doc(shape=[4, 7]), _doc(data_type="float64"), _doc(fill_value=1.0),
             _doc(chunk_grid={"name": "regular", "configuration": {"chunk_shape": [1, 6]}})]
    plans = [whole_read.plan(json.dumps(d).encode()) for d in other]
    assert all(p is not None and p is not first for p in plans)
    assert [p.shape for p in plans if p is not None][0] == (4, 7)


def test_a_refused_document_is_refused_every_time_even_beside_a_shared_plan() -> None:
    whole_read.plan(json.dumps(_doc()).encode())
    for _ in range(2):  # errors are not remembered as plans
        with pytest.raises(Exception, match="no-such-codec"):
            whole_read.plan(json.dumps(_doc(codecs=[{"name": "no-such-codec"}])).encode())
    with pytest.raises(Exception):  # noqa: B017, PT011 - zarr's own error for a document that is no object
        whole_read.plan(b"[1, 2]")

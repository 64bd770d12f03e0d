"""zarr's own Store conformance suite, run against ``InshrinkStore``.

``zarr.testing.store.StoreTests`` is the contract every zarr v3 store promises;
passing it is what lets any zarr code use a transaction or snapshot as a plain
store. The suite is written with ``async def`` tests; this project does not
depend on an asyncio pytest plugin, so each async test and fixture is wrapped
into a synchronous one that runs on zarr's own event loop (``zarr.core.sync``).
"""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zarr
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import given, settings
from hypothesis import strategies as st
from zarr.core.buffer import Buffer, cpu, default_buffer_prototype
from zarr.core.sync import sync
from zarr.testing.store import StoreTests

import inshrink_store as ins
from inshrink_store.zarr_store import InshrinkStore, PendingChunks


def _synchronous(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return sync(fn(*args, **kwargs))

    return run


def _sync_suite(cls: type) -> type:
    """Give ``cls`` a synchronous copy of every inherited ``async def test_*``."""
    for name in dir(cls):
        fn = getattr(cls, name)
        if name.startswith("test_") and inspect.iscoroutinefunction(fn):
            setattr(cls, name, _synchronous(fn))
    return cls


@pytest.fixture
def repo() -> Iterator[ins.Repository]:
    name = f"conformance-{uuid.uuid4().hex}"
    yield ins.open(f"memory://{name}", create=True)
    for key in [k for k in MemoryFileSystem.store if k.startswith(f"/{name}/")]:
        MemoryFileSystem.store.pop(key, None)


@_sync_suite
class TestInshrinkStoreConformance(StoreTests[InshrinkStore, cpu.Buffer]):
    """The writable side: a transaction's store over a fresh memory repository."""

    store_cls = InshrinkStore
    buffer_cls = cpu.Buffer

    async def set(self, store: InshrinkStore, key: str, value: Buffer) -> None:
        view = store._view
        assert isinstance(view, PendingChunks)
        view.put(key, value.to_bytes())

    async def get(self, store: InshrinkStore, key: str) -> Buffer:
        data = store._view.get(key)
        assert data is not None, key
        return self.buffer_cls.from_bytes(data)

    @pytest.fixture
    def store_kwargs(self, repo: ins.Repository) -> dict[str, Any]:
        return {"view": PendingChunks(repo._objects)}

    @pytest.fixture
    def store(self, open_kwargs: dict[str, Any]) -> InshrinkStore:
        return sync(self.store_cls.open(**open_kwargs))

    @pytest.fixture
    def store_not_open(self, store_kwargs: dict[str, Any]) -> InshrinkStore:
        return self.store_cls(**store_kwargs)

    def test_store_repr(self, store: InshrinkStore) -> None:
        assert repr(store).startswith("InshrinkStore(transaction of 'memory://conformance-")

    def test_store_supports_writes(self, store: InshrinkStore) -> None:
        assert store.supports_writes

    def test_store_supports_listing(self, store: InshrinkStore) -> None:
        assert store.supports_listing


_DTYPES = st.sampled_from(["float32", "float64", "float16", "int64", "int8", "uint16", "bool"])
_NAMES = st.lists(
    st.sampled_from(["a", "b", "layer.0", "w_1"]), min_size=1, max_size=3
).map("/".join)


@st.composite
def _tensors(draw: st.DrawFn) -> dict[str, np.ndarray]:
    names = draw(st.lists(_NAMES, min_size=1, max_size=4, unique=True))
    names = [n for n in names if not any(o.startswith(n + "/") for o in names if o != n)]
    out = {}
    for name in names:
        shape = tuple(draw(st.lists(st.integers(0, 7), max_size=3)))
        dtype = np.dtype(draw(_DTYPES))
        raw = draw(st.binary(min_size=0, max_size=8)) or b"\x01"
        seed = int.from_bytes(raw, "little")
        rng = np.random.default_rng(seed)
        values = rng.standard_normal(shape) * 100
        out[name] = values.astype(dtype) if dtype != np.bool_ else values > 0
    return out


@settings(max_examples=25, deadline=None)
@given(tensors=_tensors())
def test_plain_zarr_reads_every_array_bit_exact(tensors: dict[str, np.ndarray]) -> None:
    name = f"plainread-{uuid.uuid4().hex}"
    try:
        repo = ins.open(f"memory://{name}", create=True)
        repo.save(tensors, message="v1")
        group = zarr.open_group(store=repo.snapshot_store("main"), mode="r")
        found = {p: a for p, a in group.members(max_depth=None) if isinstance(a, zarr.Array)}
        assert sorted(found) == sorted(tensors)
        for path, expected in tensors.items():
            got = found[path][...]
            assert got.dtype == expected.dtype and got.shape == expected.shape
            assert got.tobytes() == expected.tobytes(), path
    finally:
        for key in [k for k in MemoryFileSystem.store if k.startswith(f"/{name}/")]:
            MemoryFileSystem.store.pop(key, None)


def test_snapshot_store_rejects_writes_with_zarrs_error(repo: ins.Repository) -> None:
    repo.save({"w": np.arange(6, dtype=np.float32)})
    store = repo.snapshot_store("main")
    assert store.read_only
    buf = default_buffer_prototype().buffer.from_bytes(b"x")
    message = "store was opened in read-only mode and does not support writing"
    with pytest.raises(ValueError, match=message):
        sync(store.set("w/c/0", buf))
    with pytest.raises(ValueError, match=message):
        sync(store.delete("w/zarr.json"))
    with pytest.raises(ValueError, match=message):
        sync(store.clear())
    # asking for a writable copy of a snapshot still gives a read-only store
    assert store.with_read_only(False).read_only
    group = zarr.open_group(store=store, mode="r")
    with pytest.raises(ValueError, match=message):
        group["w"][0] = 5.0
    np.testing.assert_array_equal(repo.checkout("main").read("w"), np.arange(6, dtype=np.float32))


def test_transaction_store_takes_plain_zarr_writes(repo: ins.Repository) -> None:
    repo.save({"keep": np.ones(3, np.int32)}, message="v1")
    tx = repo.transaction("main")
    group = zarr.open_group(store=tx.store, mode="a")
    written = np.arange(40, dtype=np.float64).reshape(5, 8)
    z = group.create_array("sub/x", shape=(5, 8), chunks=(2, 3), dtype="float64")
    z[...] = written
    info = tx.commit(message="plain zarr")
    snap = repo.checkout("main")
    assert snap.id == info.id and sorted(snap.names()) == ["keep", "sub/x"]
    np.testing.assert_array_equal(snap.read("sub/x"), written)
    np.testing.assert_array_equal(snap.read("keep"), np.ones(3, np.int32))
    assert len(snap.arrays()["sub/x"].chunk_ids) == 3 * 3

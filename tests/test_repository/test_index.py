"""The snapshot index: every tree of a snapshot is read once per process, whoever asks.

Reads are counted per path by wrapping ``FsspecStorage.read`` (every tree and snapshot read)
and the filesystem's ``cat_file`` (everything, ranged object headers included).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store import cas, index, layout, object_format
from inshrink_store.errors import IntegrityError, NotFoundError
from inshrink_store.index import IndexCache, SnapshotIndex
from inshrink_store.storage import FsspecStorage, Storage, open_storage
from inshrink_store.writer import previous_codecs
from inshrink_store.zarr_store import SnapshotChunks

N_ARRAYS = 20


def _state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    state = {f"model/layer{i}.weight": rng.standard_normal((16, 16)).astype(np.float32)
             for i in range(N_ARRAYS - 1)}
    state["x"] = rng.standard_normal(32).astype(np.float32)
    return state


class Reads:
    """Storage reads by path while installed (thread-safe; ``delay`` widens races)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, url: str, delay: float = 0.0) -> None:
        self.by_path: collections.Counter[str] = collections.Counter()
        self.ranged: list[tuple[str, int | None, int | None]] = []
        self._lock = threading.Lock()
        original_read = FsspecStorage.read
        fs = open_storage(url).fs  # fsspec shares instances: this is the one every handle uses
        fs_class = type(fs)
        original_cat = fs_class.cat_file

        def read(storage: Storage, path: str) -> bytes:
            with self._lock:
                self.by_path[path] += 1
            if delay:
                time.sleep(delay)
            return original_read(storage, path)

        def cat_file(fs, path, start=None, end=None, **kw):  # type: ignore[no-untyped-def]
            with self._lock:
                self.ranged.append((path, start, end))
            return original_cat(fs, path, start=start, end=end, **kw)

        monkeypatch.setattr(FsspecStorage, "read", read)
        monkeypatch.setattr(fs_class, "cat_file", cat_file)
        # an earlier monkeypatch of this shared instance may have left its own cat_file on it
        monkeypatch.setattr(fs, "cat_file", cat_file.__get__(fs))

    def of(self, prefix: str) -> dict[str, int]:
        return {p: n for p, n in self.by_path.items() if p.startswith(prefix)}

    def clear(self) -> None:
        self.by_path.clear()
        self.ranged.clear()


@pytest.fixture
def cold_cache() -> Iterator[None]:
    """An empty process-wide cache: what a new process sees."""
    index.CACHE.clear()
    yield
    index.CACHE.clear()


@pytest.fixture
def url(memory_url: str) -> str:
    ins.open(memory_url, create=True).save(_state(), message="one")
    return memory_url


def _root(url: str) -> str:
    repo = ins.open(url)
    return repo.snapshot(repo.resolve("main")).root


# -- read counts ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["read", "getitem"])
def test_reading_one_tensor_reads_each_tree_and_the_snapshot_once(
    tree_files: None, url: str, cold_cache: None, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    repo = ins.open(url)
    reads = Reads(monkeypatch, url)
    reader = repo.checkout("main")
    got = reader.read("x") if how == "read" else reader["x"][...]
    np.testing.assert_array_equal(got, _state()["x"])
    trees, snapshots = reads.of(layout.TREES), reads.of(layout.SNAPSHOTS)
    assert trees and max(trees.values()) == 1, trees
    assert snapshots and max(snapshots.values()) == 1, snapshots
    # the root tree, the tensor's tree and at most the groups above it: never one per tensor
    assert len(trees) <= 4 < N_ARRAYS, trees
    first = dict(trees)

    reads.clear()
    again = ins.open(url).checkout("main")  # a new handle: the process already knows the trees
    np.testing.assert_array_equal(again.read("x"), _state()["x"])
    assert reads.of(layout.TREES) == {}
    assert again.names() == reader.names()  # listing reads the other trees, each once
    listed = reads.of(layout.TREES)
    assert listed and max(listed.values()) == 1 and not set(listed) & set(first), listed


def test_every_query_of_a_reader_reads_no_tree_twice(
    url: str, cold_cache: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = Reads(monkeypatch, url)
    reader = ins.open(url).checkout("main")
    reader.load()
    reader.attributes  # noqa: B018 - the root group through zarr
    assert sorted(reader.dtypes()) == sorted(_state())
    reader.index.quantization_codecs()
    previous_codecs(reader.view)
    trees = reads.of(layout.TREES)
    assert max(trees.values()) == 1, trees


def test_quantized_save_with_a_parent_reads_the_parent_trees_once(
    url: str, cold_cache: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inshrink_store.policy import QuantConfig

    repo = ins.open(url)
    plan = QuantConfig(min_numel=64)
    repo.save(_state(1), quantize=plan, message="quantized")
    parent_root = _root(url)
    parent_trees = {layout.tree_path(parent_root)} | {
        layout.tree_path(tid) for tid in SnapshotIndex.of(
            cas.ObjectStore(open_storage(url)), parent_root).root.nodes.values()}
    index.CACHE.clear()
    reads = Reads(monkeypatch, url)
    repo.save(_state(2), quantize=plan, message="quantized again")  # codebooks from the parent
    counted = {p: n for p, n in reads.of(layout.TREES).items() if p in parent_trees}
    assert counted and max(counted.values()) == 1, counted


# -- one build, many threads -----------------------------------------------------------------


def test_many_threads_build_one_index_once(
    url: str, cold_cache: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _root(url)
    reads = Reads(monkeypatch, url, delay=0.002)
    threads_n = 16
    start = threading.Barrier(threads_n)
    found: list[SnapshotIndex] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            start.wait()
            reader = ins.open(url).checkout("main")
            np.testing.assert_array_equal(reader.read("x"), _state()["x"])
            assert len(reader.index.arrays()) == N_ARRAYS
            found.append(reader.index)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len({id(i) for i in found}) == 1 and found[0].root_id == root
    trees = reads.of(layout.TREES)
    assert max(trees.values()) == 1, trees


def test_the_cache_is_bounded_and_an_evicted_snapshot_is_read_again(url: str) -> None:
    repo = ins.open(url)
    roots = [_root(url)]
    for seed in (5, 6):
        repo.save(_state(seed))
        roots.append(_root(url))
    storage = open_storage(url)
    cache = IndexCache(max_entries=2)
    first = cache.get(storage, roots[0])
    assert cache.get(storage, roots[0]) is first
    cache.get(storage, roots[1])
    cache.get(storage, roots[2])  # evicts roots[0], the least recently used
    assert len(cache) == 2
    assert cache.get(storage, roots[0]) is not first
    assert cache.get(storage, roots[2]) is cache.get(storage, roots[2])
    cache.resize(1)
    assert len(cache) == 1
    cache.resize(0)  # off: every get builds a private index
    assert cache.get(storage, roots[0]) is not cache.get(storage, roots[0]) and len(cache) == 0
    with pytest.raises(ins.FormatError, match="cache size"):
        cache.resize(-1)


def test_the_cache_tells_stores_apart(url: str, memory_url: str) -> None:
    del memory_url
    storage = open_storage(url)
    cache = IndexCache()
    root = _root(url)
    assert cache.get(storage, root) is cache.get(open_storage(url), root)
    assert cache.get(open_storage(url, {"skip_instance_cache": True}), root) is not cache.get(storage, root)


# -- what the index answers ------------------------------------------------------------------


def test_queries(url: str) -> None:
    reader = ins.open(url).checkout("main")
    idx = reader.index
    assert isinstance(idx, SnapshotIndex) and reader.view.index is idx
    infos = idx.arrays()
    assert sorted(infos) == sorted(_state()) and infos["x"].shape == (32,)
    assert infos["x"].dtype == "F32" and infos["x"].storage == "lossless"
    assert idx.chunk_ids("x") == dict(infos["x"].chunk_ids)
    assert idx.array_doc("x")["shape"] == [32]
    assert [p for p, _ in idx.array_docs()] == sorted(_state())
    assert idx.quantization_codecs() == {}
    entries = idx.entries()
    assert "x/zarr.json" in entries and entries["x/zarr.json"].inline is not None
    assert {k for k in entries if k.startswith("x/")} == {"x/zarr.json"} | {
        f"x/{k}" for k in idx.chunk_ids("x")}
    with pytest.raises(NotFoundError, match="'nope'"):
        idx.array_doc("nope")
    with pytest.raises(NotFoundError, match="'nope'"):
        idx.chunk_ids("nope")
    # copies: changing what a query returned never changes the index
    idx.array_doc("x")["shape"] = [1]
    idx.arrays().clear()
    assert idx.array_doc("x")["shape"] == [32] and len(idx.arrays()) == N_ARRAYS
    with pytest.raises(TypeError):
        entries["new"] = entries["x/zarr.json"]  # type: ignore[index]


def test_quantization_codecs_are_the_previous_codebooks(memory_url: str) -> None:
    from inshrink_store.policy import QuantConfig

    repo = ins.open(memory_url, create=True)
    repo.save(_state(3), quantize=QuantConfig(min_numel=64))
    reader = repo.checkout("main")
    codecs = reader.index.quantization_codecs()
    quantized = {p for p, a in reader.arrays().items() if a.storage == "quantized"}
    assert quantized and set(codecs) == quantized
    for path in quantized:
        assert codecs[path]["codec"]["codebook"]
        assert codecs[path]["attributes"]["storage"] == "quantized"
    assert previous_codecs(reader.view) == codecs == previous_codecs(reader.index)
    assert previous_codecs(None) == {}


def test_uncached_views_read_storage_afresh(tree_files: None, url: str, cold_cache: None) -> None:
    """What verify needs: a tree damaged after it was cached is still found."""
    objects = cas.ObjectStore(open_storage(url))
    root = _root(url)
    cached = SnapshotChunks(objects, root, "s")
    tid = cached.root.nodes["x"]
    assert cached.index.arrays()  # every tree now cached
    storage = open_storage(url)
    raw = storage.read(layout.tree_path(tid))
    storage.write(layout.tree_path(tid), raw[:-1] + bytes([raw[-1] ^ 0x5A]))  # one byte flipped
    assert SnapshotChunks(objects, root, "s").index.arrays()["x"].shape == (32,)
    with pytest.raises(IntegrityError, match=tid):
        SnapshotChunks(objects, root, "s", cached=False).node_trees()


def test_a_missing_root_fails_at_once_and_is_not_kept(url: str, cold_cache: None) -> None:
    objects = cas.ObjectStore(open_storage(url))
    missing = "0" * 32
    for _ in range(2):
        with pytest.raises(NotFoundError, match=missing):
            SnapshotChunks(objects, missing)


# -- object headers come from ranged reads ------------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_headers_are_ranged_reads(
    kind: str, memory_url: str, tmp_path, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    url = memory_url if kind == "memory" else str(tmp_path / "store")
    objects = cas.ObjectStore(open_storage(url))
    payload = np.random.default_rng(0).bytes(1 << 20)
    oid = objects.put(payload).oid
    reads = Reads(monkeypatch, url)
    assert objects.header(oid).logical_length == len(payload)
    assert [(start, end) for _, start, end in reads.ranged] == [(0, object_format.HEADER_SIZE)]
    assert reads.by_path == {}  # no Storage.read (whole object) at all

    fs = open_storage(url).fs
    original = type(fs).cat_file

    def no_ranges(fs, path, start=None, end=None, **kw):  # type: ignore[no-untyped-def]
        if start is not None:
            raise NotImplementedError
        return original(fs, path, **kw)

    monkeypatch.setattr(type(fs), "cat_file", no_ranges)
    monkeypatch.setattr(fs, "cat_file", no_ranges.__get__(fs))
    monkeypatch.setattr(cas.ObjectStore, "read_stored", lambda self, oid: pytest.fail("whole read"))
    assert objects.header(oid).logical_length == len(payload)

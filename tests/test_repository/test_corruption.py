"""Corrupt, truncated or missing stored bytes are loud: never silently wrong numbers.

Reading raises :class:`IntegrityError` (or :class:`NotFoundError` for a missing
object) naming the chunk key and the object; ``verify`` names the bad object and
every (snapshot, tensor) that uses it.
"""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import inshrink_store as ins
from inshrink_store import cas, index, manifest, object_format
from inshrink_store.codecs import _payload
from inshrink_store.zarr_store import tree_path


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((8, 8)).astype(np.float32), "b": np.arange(5, dtype=np.int64)}


@pytest.fixture
def repo(store_url: str) -> ins.Repository:
    repo = ins.open(store_url, create=True)
    repo.save(_state(1), message="v1")
    repo.save(_state(2), message="v2")  # "b" is unchanged: its object is shared by both
    return repo


def _chunk(repo: ins.Repository, tensor: str, ref: str = "main") -> str:
    (oid,) = repo.checkout(ref).arrays()[tensor].chunk_ids.values()
    return oid


def _rewrite(repo: ins.Repository, path: str, change) -> None:  # type: ignore[no-untyped-def]
    repo._storage.write(path, change(bytearray(repo._storage.read(path))))


def _fresh(repo: ins.Repository) -> ins.Repository:
    """A new handle with an empty index cache (what a new process sees), so no in-process
    cache hides what is on storage (the writer seeds the cache with the trees it wrote)."""
    index.CACHE.clear()
    return ins.open(repo.url)


def _flip(offset: int):  # type: ignore[no-untyped-def]
    def change(data: bytearray) -> bytes:
        data[offset % len(data)] ^= 0x5A
        return bytes(data)

    return change


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.integers(0, 10_000))
def test_flipped_byte_anywhere_in_an_object(memory_url: str, offset: int) -> None:
    repo = ins.open(f"{memory_url}/{offset}", create=True)
    repo.save(_state(1))
    oid = _chunk(repo, "w")
    _rewrite(repo, cas.object_path(oid), _flip(offset))
    with pytest.raises(ins.IntegrityError) as info:
        _fresh(repo).checkout("main").read("w")
    assert oid in str(info.value) and "'w/c/0/0'" in str(info.value)
    np.testing.assert_array_equal(_fresh(repo).checkout("main").read("b"), _state(1)["b"])


def test_every_single_byte_flip_of_an_object_is_caught(memory_url: str) -> None:
    """Exhaustive over one small object: header bytes outside the checksum included."""
    repo = ins.open(memory_url, create=True)
    repo.save({"b": np.arange(5, dtype=np.int64)})
    oid = _chunk(repo, "b")
    path = cas.object_path(oid)
    good = repo._storage.read(path)
    for offset in range(len(good)):
        _rewrite(repo, path, _flip(offset))
        with pytest.raises(ins.IntegrityError, match=oid):
            cas.ObjectStore(repo._storage).get(oid)
        repo._storage.write(path, good)
    np.testing.assert_array_equal(_fresh(repo).checkout("main").read("b"), np.arange(5))


def test_flipped_byte_is_reported_with_its_users(repo: ins.Repository) -> None:
    oid = _chunk(repo, "b")
    assert oid == _chunk(repo, "b", "main~1")
    _rewrite(repo, cas.object_path(oid), _flip(object_format.HEADER_SIZE + 3))
    fresh = _fresh(repo)
    with pytest.raises(ins.IntegrityError, match="checksum") as info:
        fresh.checkout("main~1").read("b")
    message = str(info.value)
    assert oid in message and "'b/c/0'" in message and repo.resolve("main~1") in message
    report = fresh.verify()
    assert not report.ok
    assert [(p.kind, p.id) for p in report.problems] == [("object", oid)]
    users = sorted(repo.resolve(r) for r in ("main", "main~1"))
    assert report.problems[0].used_by == [(sid, "b") for sid in users]
    np.testing.assert_array_equal(fresh.checkout("main").read("w"), _state(2)["w"])


def test_truncated_object(repo: ins.Repository) -> None:
    oid = _chunk(repo, "w")
    for keep in (0, 10, object_format.HEADER_SIZE, object_format.HEADER_SIZE + 5):
        _rewrite(repo, cas.object_path(oid), lambda data, keep=keep: bytes(data[:keep]))
        with pytest.raises(ins.IntegrityError, match=oid):
            _fresh(repo).checkout("main").read("w")
        assert [p.id for p in _fresh(repo).verify().problems] == [oid]


def test_missing_object(repo: ins.Repository) -> None:
    oid = _chunk(repo, "w")
    repo._storage.delete(cas.object_path(oid))
    with pytest.raises(ins.NotFoundError) as info:
        _fresh(repo).checkout("main").read("w")
    assert oid in str(info.value) and "'w/c/0/0'" in str(info.value)
    assert "inshrink verify" in str(info.value)
    report = _fresh(repo).verify()
    assert [(p.kind, p.id, p.used_by) for p in report.problems] == [
        ("object", oid, [(repo.resolve("main"), "w")])]


def test_corrupted_tree(tree_files: None, repo: ins.Repository) -> None:
    tid = repo.checkout("main").view.root.nodes["w"]
    _rewrite(repo, tree_path(tid), _flip(7))  # a tree is a zstd frame now: any byte will do
    with pytest.raises(ins.IntegrityError, match=tid):
        _fresh(repo).checkout("main").read("w")
    report = _fresh(repo).verify()
    assert [(p.kind, p.id) for p in report.problems] == [("tree", repo.resolve("main"))]
    assert tid in report.problems[0].error
    np.testing.assert_array_equal(_fresh(repo).checkout("main~1").read("w"), _state(1)["w"])


def _edited_snapshot(data: bytes, stored_plain: bool) -> bytes:
    """A snapshot's stored bytes (a zstd frame) with its message changed, stored again as a
    frame or as the plain JSON a snapshot written before frames was."""
    text = zstandard.ZstdDecompressor().decompress(bytes(data)).replace(b'"v1"', b'"v9"')
    return text if stored_plain else manifest.pack_tree(text, manifest.SNAPSHOT_ZSTD_LEVEL)


@pytest.mark.parametrize("stored_plain", [False, True], ids=["frame", "plain-json"])
def test_corrupted_snapshot_document(repo: ins.Repository, stored_plain: bool) -> None:
    sid = repo.resolve("main~1")
    _rewrite(repo, f"snapshots/{sid}", lambda data: _edited_snapshot(data, stored_plain))
    fresh = _fresh(repo)
    with pytest.raises(ins.IntegrityError, match=sid):
        fresh.checkout(sid)
    with pytest.raises(ins.IntegrityError, match=sid):
        fresh.log("main")
    report = fresh.verify()
    assert [(p.kind, p.id) for p in report.problems] == [("snapshot", sid)]
    np.testing.assert_array_equal(fresh.checkout("main").read("w"), _state(2)["w"])
    with pytest.raises(ins.IntegrityError):  # gc never deletes on top of a corrupt history
        fresh.gc()


def _quantized(seed: int, changed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 15, size=4096).astype(np.uint8)
    ids[:changed] = (ids[:changed] + 1) % 15
    return _payload.pack(16, ids, "bfloat16", np.zeros(0, np.uint16))


def test_corrupt_delta_base_and_chain_loop(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    objects = repo._objects
    base = objects.put(_quantized(7)).oid
    child = objects.put(_quantized(7, changed=20), base=base)
    assert child.kind == object_format.KIND_DELTA
    assert cas.ObjectStore(repo._storage).get(child.oid) == _quantized(7, changed=20)

    _rewrite(repo, cas.object_path(base), _flip(object_format.HEADER_SIZE + 1))
    with pytest.raises(ins.IntegrityError, match=base):
        cas.ObjectStore(repo._storage).get(child.oid)

    # two deltas naming each other as base: a loop is an error, never a hang
    a, b = "a" * 32, "b" * 32
    body = b"\x00" * 8
    for oid, other in ((a, b), (b, a)):
        repo._storage.write(cas.object_path(oid), object_format.frame(object_format.KIND_DELTA, 0, 1, body, other, body))
    with pytest.raises(ins.IntegrityError, match="one deeper than its base"):
        cas.ObjectStore(repo._storage).get(a)
    with pytest.raises(ins.IntegrityError, match="loop"):
        cas.ObjectStore(repo._storage).chain(a)

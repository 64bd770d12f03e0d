"""The write session's staging API (issue 34): ``stage_array`` puts an array whose chunk
objects are already stored (written by another process, as the ranks of a DCP save write
their shards) into the version, ``stage_group`` a group with attributes. What is staged reads
back through the repository and through plain zarr; a bad path, chunk key, object id or
zarr.json is refused with an error naming the array, before anything is staged."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zarr
from zarr.storage import MemoryStore

import inshrink_store as ins
from inshrink_store.cas import ObjectStore
from inshrink_store.errors import ConflictError, InvalidInputError, NotFoundError
from inshrink_store.index import METADATA_KEY
from inshrink_store.storage import open_storage
from inshrink_store.writer import write_arrays
from inshrink_store.zarr_store import InshrinkStore, PendingChunks

W = np.arange(24 * 16, dtype=np.float32).reshape(24, 16) / 7
IDS = np.arange(10, dtype=np.int64)


def _eight(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    return tuple(min(8, n) for n in shape)  # several chunks per array


def _written_elsewhere(repo: ins.Repository, arrays: dict[str, np.ndarray]) -> dict[str, tuple[bytes, dict[str, str]]]:
    """Arrays written as another process writes them (a DCP rank): chunk objects stored
    straight into the store, nothing committed; path -> (zarr.json, chunk ids)."""
    objects = ObjectStore(open_storage(repo.url), keyframe_interval=repo.keyframe_interval)
    view = PendingChunks(objects)
    write_arrays(InshrinkStore(view), arrays, chunking=_eight)
    nodes = {}
    for path in arrays:
        metadata, chunks = view.node(path)
        assert metadata is not None and chunks
        nodes[path] = (metadata, chunks)
    return nodes


def _zarr_group_doc(attributes: dict[str, Any]) -> bytes:
    written: dict[str, Any] = {}
    zarr.create_group(store=MemoryStore(store_dict=written), attributes=attributes)
    return bytes(written[METADATA_KEY].to_bytes())


@pytest.fixture(params=["memory_url", "local_url"])
def repo(request: pytest.FixtureRequest) -> Iterator[ins.Repository]:
    yield ins.open(request.getfixturevalue(request.param), create=True)


def test_staged_arrays_and_groups_read_back_through_the_repository_and_zarr(repo: ins.Repository) -> None:
    with repo.transaction("main") as tx:
        nodes = _written_elsewhere(repo, {"model/w": W, "step/ids": IDS})
        for path, (metadata, chunks) in nodes.items():
            tx.stage_array(path, metadata, chunks)
        tx.stage_group("model", {"note": "staged", "layers": [1, 2]})
        tx.stage_group("", {"run": {"id": 7}})
        info = tx.commit(message="staged")

    reader = repo.checkout("main")
    assert reader.id == info.id
    np.testing.assert_array_equal(reader.read("model/w"), W)
    np.testing.assert_array_equal(reader.read("step/ids"), IDS)
    assert reader.attributes == {"run": {"id": 7}}
    assert reader.index.chunk_ids("model/w") == nodes["model/w"][1]  # 3 x 2 chunks, as staged

    group = zarr.open_group(store=repo.snapshot_store("main"), mode="r")
    np.testing.assert_array_equal(group["model/w"][...], W)
    np.testing.assert_array_equal(group["step"]["ids"][2:5], IDS[2:5])
    assert dict(group["model"].attrs) == {"note": "staged", "layers": [1, 2]}
    assert dict(group["step"].attrs) == {}  # the group above an array gets an empty document
    assert sorted(group.group_keys()) == ["model", "step"]
    # a group's document is zarr's own, byte for byte (what DCP versions have always stored)
    assert repo.checkout().index.node("model")[1].metadata.encode() == _zarr_group_doc(
        {"note": "staged", "layers": [1, 2]})
    assert repo.verify().ok


def test_a_staged_array_replaces_the_inherited_one_with_none_of_its_chunks_left(repo: ins.Repository) -> None:
    with repo.transaction("main") as tx:
        tx.write({"model/b": IDS})
        tx.stage_array("model/w", *_written_elsewhere(repo, {"model/w": np.ones((40, 16), np.float32)})["model/w"])
        tx.commit(message="first")
    assert len(repo.checkout().index.chunk_ids("model/w")) == 10
    with repo.transaction("main") as tx:
        (metadata, chunks), = _written_elsewhere(repo, {"model/w": W}).values()
        tx.stage_array("model/w", metadata, chunks)
        tx.commit(message="second")
    reader = repo.checkout()
    np.testing.assert_array_equal(reader.read("model/w"), W)
    np.testing.assert_array_equal(reader.read("model/b"), IDS)  # inherited, untouched
    assert set(reader.index.chunk_ids("model/w")) == set(chunks)  # 6: none of the 10 before left


def _stage(tx: ins.WriteSession, repo: ins.Repository, change: dict[str, Any]) -> None:
    (metadata, chunks), = _written_elsewhere(repo, {"model/w": W}).values()
    args: dict[str, Any] = {"path": "model/w", "metadata": metadata, "chunk_ids": chunks}
    for key, value in change.items():
        args[key] = value(args[key]) if callable(value) else value
    tx.stage_array(args["path"], args["metadata"], args["chunk_ids"])


def _first(chunks: dict[str, str], key: str | None = None, oid: Any = None) -> dict[str, Any]:
    """``chunks`` with its first chunk's key or id replaced."""
    first = sorted(chunks)[0]
    out: dict[str, Any] = {k: v for k, v in chunks.items() if k != first}
    out[key if key is not None else first] = oid if oid is not None else chunks[first]
    return out


_ARRAY_DOC = {"zarr_format": 3, "node_type": "array", "shape": [2]}

BAD = {
    # a path the writer would refuse as a tensor name
    "dotdot path": ({"path": "model/../w"}, InvalidInputError, r"array path .*'model/\.\./w'"),
    "empty part": ({"path": "model//w"}, InvalidInputError, r"'model//w'"),
    "reserved part": ({"path": "model/__w"}, InvalidInputError, r"'model/__w'"),
    "empty path": ({"path": ""}, InvalidInputError, r"array path"),
    # chunk keys must be inside the array; ids are 32 lowercase hex digits, of stored objects
    "key outside": ({"chunk_ids": lambda c: _first(c, key="../c/0/0")}, InvalidInputError,
                    r"chunk keys of array 'model/w'.*'\.\./c/0/0'"),
    "key is zarr.json": ({"chunk_ids": lambda c: _first(c, key=METADATA_KEY)}, InvalidInputError,
                         r"chunk keys of array 'model/w'"),
    "malformed id": ({"chunk_ids": lambda c: _first(c, oid="ABCDEF")}, InvalidInputError,
                     r"chunk 'c/0/0' of array 'model/w' to name a stored object by its id.*'ABCDEF'"),
    "id not a string": ({"chunk_ids": lambda c: _first(c, oid=12)}, InvalidInputError, r"array 'model/w'"),
    "unknown id": ({"chunk_ids": lambda c: _first(c, oid="0" * 32)}, NotFoundError,
                   r"chunk 'c/0/0' of array 'model/w' to name a stored object. Got 0{32}"),
    "chunk ids not a mapping": ({"chunk_ids": [("c/0/0", "0" * 32)]}, InvalidInputError, r"as a mapping"),
    # the zarr.json must be a zarr v3 array document, as bytes
    "metadata not json": ({"metadata": b"{not json"}, InvalidInputError,
                          r"zarr.json of array 'model/w' to be a JSON document"),
    "metadata a list": ({"metadata": b"[1, 2]"}, InvalidInputError, r"zarr v3 document"),
    "metadata zarr v2": ({"metadata": json.dumps({**_ARRAY_DOC, "zarr_format": 2}).encode()}, InvalidInputError,
                         r"zarr_format 2"),
    "metadata of a group": ({"metadata": b'{"zarr_format": 3, "node_type": "group"}'}, InvalidInputError,
                            r"node_type 'group'"),
    "metadata as str": ({"metadata": lambda m: m.decode()}, InvalidInputError, r"as bytes. Got str"),
}


@pytest.mark.parametrize("change,error,match", list(BAD.values()), ids=list(BAD))
def test_bad_input_is_refused_naming_the_array_and_nothing_is_staged_or_committed(
        repo: ins.Repository, change: dict[str, Any], error: type[Exception], match: str) -> None:
    parent = repo.save({"model/b": IDS}, message="first").id
    with pytest.raises(error, match=match), repo.transaction("main") as tx:
        before = dict(tx.view.entries)
        try:
            _stage(tx, repo, change)
        finally:
            assert dict(tx.view.entries) == before  # checked before anything was staged
    assert repo.resolve("main") == parent  # the session aborted: nothing committed
    assert not any(info.message != "first" for info in repo.log("main"))


def test_a_session_that_refused_a_stage_still_commits_what_was_staged_before(repo: ins.Repository) -> None:
    with repo.transaction("main", inherit=False) as tx:
        nodes = _written_elsewhere(repo, {"model/w": W})
        tx.stage_array("model/w", *nodes["model/w"])
        with pytest.raises(NotFoundError, match="'model/x'"):
            tx.stage_array("model/x", nodes["model/w"][0], _first(nodes["model/w"][1], oid="f" * 32))
        tx.commit()
    assert repo.checkout().names() == ["model/w"]


def test_nodes_cannot_be_staged_inside_an_array_nor_a_group_over_one(repo: ins.Repository) -> None:
    with repo.transaction("main") as tx:
        nodes = _written_elsewhere(repo, {"model/w": W})
        tx.stage_array("model/w", *nodes["model/w"])
        with pytest.raises(InvalidInputError, match="array 'model/w' above it"):
            tx.stage_array("model/w/inner", *nodes["model/w"])
        with pytest.raises(InvalidInputError, match="array 'model/w' above it"):
            tx.stage_group("model/w/g", {})
        with pytest.raises(InvalidInputError, match="group 'model/w' where this version holds no array"):
            tx.stage_group("model/w", {})
        with pytest.raises(InvalidInputError, match="zarr stores as JSON for group 'model'"):
            tx.stage_group("model", {"x": object()})
        with pytest.raises(InvalidInputError, match="group path"):
            tx.stage_group("model/..", {})
        tx.commit()
        with pytest.raises(ConflictError, match="already committed"):
            tx.stage_group("model", {})


def test_a_pending_view_gives_each_node_without_the_nodes_below_it(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    view = PendingChunks(ObjectStore(open_storage(repo.url)))
    write_arrays(InshrinkStore(view), {"a/w": W, "a/b/v": IDS}, attributes={"k": 1}, chunking=_eight)
    metadata, chunks = view.node("a/w")
    assert json.loads(metadata)["shape"] == [24, 16] and sorted(chunks) == [f"c/{i}/{j}" for i in range(3)
                                                                             for j in range(2)]
    assert view.node("a") == (view.get(f"a/{METADATA_KEY}"), {})  # its members are nodes of their own
    root, none = view.node("")
    assert json.loads(root)["attributes"] == {"k": 1} and none == {}
    assert view.node("missing") == (None, {})

"""A whole hostile store on memory://: real documents written by a real save, then mutated
and re-addressed (so they pass their content hash and reach the schema and array checks),
read through ``inshrink_store.open(url).checkout(...).load()`` and ``.verify()``."""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np
import pytest
import zstandard
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import given
from hypothesis import strategies as st

import inshrink_store as ins
from inshrink_store import cas, manifest
from inshrink_store.manifest import ZSTD_MAGIC, canonical_json, content_id, pack_tree
from inshrink_store.policy import QuantConfig
from inshrink_store.storage import open_storage
from inshrink_store.zarr_store import tree_path
from tests.test_fuzz._hostile import FAST, SLOW, bounded, mutate, mutate_bytes


def _build() -> tuple[dict[str, bytes], str, str]:
    """Files of a small real store (lossless, quantized keyframe and delta, NaN metric); the
    head snapshot (its root holds every node inline) and its parent (every node a tree file)."""
    url = f"memory://fuzz-base-{uuid.uuid4().hex}"
    repo = ins.open(url, create=True)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    state = {"model/w": w, "model/b": np.arange(8, dtype=np.int64),
             "opt/m": np.zeros((4, 100), np.float32), "bits": np.arange(6, dtype=np.uint16)}
    plan = QuantConfig(min_numel=64)
    with pytest.MonkeyPatch.context() as patch:  # the parent as stores wrote it before inline nodes
        patch.setattr(manifest, "INLINE_MAX_CHUNKS", -1)
        repo.save(state, quantize=plan, dtypes={"bits": "BF16"}, metadata={"lr": 0.1})
    w2 = w.copy()
    w2[:3] += 0.5
    repo.save({**state, "model/w": w2}, quantize=plan, dtypes={"bits": "BF16"},
              metrics={"loss": float("nan")})
    head, base = repo.resolve("main"), repo.resolve("main~1")
    files = {path: repo._storage.read(path) for path in repo._storage.list("")}
    _clear(url)
    return files, head, base


def _clear(url: str) -> None:
    root = "/" + url.split("://", 1)[1]
    for key in [k for k in MemoryFileSystem.store if k == root or k.startswith(root + "/")]:
        MemoryFileSystem.store.pop(key, None)


FILES, HEAD, BASE = _build()


def _doc(path: str) -> Any:
    raw = FILES[path]  # trees are stored as a zstd frame of their JSON
    return json.loads(zstandard.decompress(raw) if raw[:4] == ZSTD_MAGIC else raw)


def _write_doc(files: dict[str, bytes], folder: str, raw: bytes) -> str:
    new_id = content_id(raw)
    files[f"snapshots/{new_id}" if folder == "snapshots" else tree_path(new_id)] = raw
    return new_id


def _hostile_files(data: st.DataObject) -> tuple[dict[str, bytes], str]:
    """A copy of the store with one document or object made hostile; the snapshot to read."""
    files = dict(FILES)
    target = data.draw(st.sampled_from(["snapshot", "root", "node", "zarr.json", "inline", "object", "ref"]),
                       label="target")
    # a tree file to mutate is the parent's (every node a file), anything else the head's (inline)
    start = BASE if target in ("node", "zarr.json") else HEAD
    snap = _doc(f"snapshots/{start}")
    root = _doc(tree_path(snap["root"]))
    as_bytes = data.draw(st.booleans(), label="byte-level")

    packed = data.draw(st.booleans(), label="tree documents packed as stored now")

    def tree(doc_bytes: bytes) -> bytes:
        """A tree document as the store writes it now (zstd) or did before (plain JSON)."""
        return pack_tree(doc_bytes) if packed and doc_bytes[:4] != ZSTD_MAGIC else doc_bytes

    def changed(doc: Any, raw: bytes) -> bytes:
        if as_bytes:
            return mutate_bytes(raw, data)
        try:
            return canonical_json(mutate(doc, data))
        except ValueError:
            return raw

    if target == "object":
        oids = sorted({oid for tid in root["nodes"].values()
                       for oid in _doc(tree_path(tid))["chunks"].values()}
                      | {oid for node in root.get("inline", {}).values() for oid in node["chunks"].values()})
        oid = data.draw(st.sampled_from(oids), label="object")
        files[cas.object_path(oid)] = mutate_bytes(FILES[cas.object_path(oid)], data)
        return files, HEAD
    if target == "ref":
        ref = data.draw(st.sampled_from(sorted(p for p in files if p.startswith("refs/"))))
        files[ref] = data.draw(st.one_of(
            st.sampled_from([b"../../x", b"../" * 8 + b"etc/passwd", b"\xff\xfe", b"", b"0" * 32,
                             HEAD.encode() + b"\n", HEAD.upper().encode(), b"x" * 10_000]),
            st.binary(max_size=64)), label="ref content")
        return files, "main"
    if target == "snapshot":
        return files, _write_doc(files, "snapshots", changed(snap, FILES[f"snapshots/{HEAD}"]))
    if target == "inline":  # one node the root holds inline, its document mutated in place
        path = data.draw(st.sampled_from(sorted(root["inline"])), label="inline node")
        node = root["inline"][path]
        if data.draw(st.booleans(), label="its zarr.json") and node["metadata"] is not None:
            meta_raw = node["metadata"].encode()
            node["metadata"] = changed(json.loads(meta_raw), meta_raw).decode("utf-8", "replace")
        else:
            root["inline"][path] = mutate(node, data)
        snap["root"] = _write_doc(files, "trees", tree(canonical_json(root)))
    elif target == "root":
        snap["root"] = _write_doc(files, "trees", tree(changed(root, FILES[tree_path(snap["root"])])))
    else:
        path = data.draw(st.sampled_from(sorted(root["nodes"])), label="node")
        node = _doc(tree_path(root["nodes"][path]))
        if target == "zarr.json" and node["metadata"] is not None:
            meta_raw = node["metadata"].encode()
            node["metadata"] = changed(json.loads(meta_raw), meta_raw).decode("utf-8", "replace")
            raw = canonical_json(node)
        else:
            raw = changed(node, FILES[tree_path(root["nodes"][path])])
        root["nodes"][path] = _write_doc(files, "trees", tree(raw))
        snap["root"] = _write_doc(files, "trees", tree(canonical_json(root)))
    return files, _write_doc(files, "snapshots", canonical_json(snap))


def _read_hostile(data: st.DataObject) -> None:
    files, ref = _hostile_files(data)
    url = f"memory://fuzz-store-{uuid.uuid4().hex}"
    storage = open_storage(url)
    for path, raw in files.items():
        storage.write(path, raw)
    if ref != "main":
        storage.write("refs/tags/fuzz", ref.encode())  # verify walks it too
    try:
        with bounded():
            ins.open(url).checkout(ref).load()
        with bounded():
            reader = ins.open(url).checkout(ref)
            for name in reader.names():
                reader.read_float(name)
            reader.attributes  # noqa: B018 - reading the root group is the point
        with bounded():
            ins.open(url).log(ref)
        with bounded():
            ins.open(url).verify()
    finally:
        _clear(url)


@FAST
@given(data=st.data())
def test_hostile_store(data: st.DataObject) -> None:
    _read_hostile(data)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_hostile_store_long(data: st.DataObject) -> None:
    _read_hostile(data)


def test_the_unmutated_store_reads() -> None:
    url = f"memory://fuzz-store-{uuid.uuid4().hex}"
    storage = open_storage(url)
    for path, raw in FILES.items():
        storage.write(path, raw)
    try:
        repo = ins.open(url)
        assert sorted(repo.checkout("main").load()) == ["bits", "model/b", "model/w", "opt/m"]
        assert repo.verify().ok
    finally:
        _clear(url)

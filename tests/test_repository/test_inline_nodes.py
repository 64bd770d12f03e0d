"""Small nodes kept inline in the root tree (root tree format 2).

A node with at most INLINE_MAX_CHUNKS chunks and a zarr.json of at most
INLINE_MAX_METADATA bytes is written into its version's root tree instead of a tree file of
its own: a checkpoint of many small tensors wrote two fsynced files per tensor (its chunk and
its tree). Larger nodes keep tree files; a root without inline nodes is still format 1, byte
for byte, so old roots keep their ids; every inline document is checked like a tree's."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import inshrink_store as ins
from inshrink_store import manifest
from inshrink_store.errors import FormatError, IntegrityError
from inshrink_store.manifest import NodeTree, RootTree, canonical_json, pack_tree, parse_document
from inshrink_store.storage import open_storage

OID = "ab" * 16
NODE_PATHS = st.lists(st.sampled_from(["", "a", "a/b", "model/w", "x.y", "ü"]), unique=True, max_size=5)


def _node(chunks: int, metadata: str | None = '{"zarr_format":3}') -> NodeTree:
    return NodeTree(metadata=metadata, chunks={f"c/{i}": OID for i in range(chunks)})


@settings(max_examples=60, deadline=None)
@given(inline=NODE_PATHS, chunks=st.integers(0, 4), meta=st.one_of(st.none(), st.text(max_size=40)))
def test_a_root_with_inline_nodes_round_trips(inline: list[str], chunks: int, meta: str | None) -> None:
    root = RootTree(nodes={"big": "cd" * 16}, inline={p: _node(chunks, meta) for p in inline if p != "big"})
    back = RootTree.from_bytes(root.to_bytes(), root.id)
    assert back == root and back.id == root.id
    assert all(back.has_node(p) for p in ("big", *root.inline)) and not back.has_node("nope")


def test_a_root_without_inline_nodes_is_format_1_byte_for_byte() -> None:
    nodes = {"": "cd" * 16, "w": "ef" * 16}
    root = RootTree(nodes=nodes)
    assert root.to_bytes() == pack_tree(canonical_json({"format": 1, "nodes": nodes}))
    assert parse_document(root.to_bytes(), "root tree", root.id, compressed=True)["format"] == 1


def test_an_inline_node_has_an_id_of_its_content_that_is_no_tree_id() -> None:
    a, b = _node(1), _node(2)
    assert a.inline_id != b.inline_id and a.inline_id == _node(1).inline_id
    assert a.inline_id != a.id  # never a storage address


@pytest.mark.parametrize("chunks, metadata, inlinable", [
    (manifest.INLINE_MAX_CHUNKS, "{}", True),
    (manifest.INLINE_MAX_CHUNKS + 1, "{}", False),
    (0, "x" * manifest.INLINE_MAX_METADATA, True),
    (0, "x" * (manifest.INLINE_MAX_METADATA + 1), False),
])
def test_which_nodes_are_kept_inline(chunks: int, metadata: str, inlinable: bool) -> None:
    assert _node(chunks, metadata).inlinable is inlinable


def _hostile_root(doc: dict[str, object]) -> tuple[bytes, str]:
    raw = pack_tree(canonical_json(doc))
    return raw, manifest.content_id(raw)


@pytest.mark.parametrize("doc, match", [
    ({"format": 2, "nodes": {"w": OID}, "inline": {"w": {"metadata": None, "chunks": {}}}}, "not both"),
    ({"format": 2, "nodes": {}, "inline": {"w": {"metadata": None}}}, "fields"),
    ({"format": 2, "nodes": {}, "inline": {"w": {"metadata": None, "chunks": {}, "extra": 1}}}, "fields"),
    ({"format": 2, "nodes": {}, "inline": {"w": {"metadata": 5, "chunks": {}}}}, "metadata"),
    ({"format": 2, "nodes": {}, "inline": {"w": {"metadata": None, "chunks": {"c/0": "nope"}}}}, "c/0"),
    ({"format": 2, "nodes": {}, "inline": {"../w": {"metadata": None, "chunks": {}}}}, "safe"),
    ({"format": 2, "nodes": {}, "inline": {"w": []}}, "JSON object"),
    ({"format": 2, "nodes": {}, "inline": []}, "inline node"),
    ({"format": 2, "nodes": {}, "inline": {}}, "non-empty"),
    ({"format": 2, "nodes": {}}, "fields"),
    ({"format": 1, "nodes": {}, "inline": {}}, "fields"),
])
def test_a_hostile_root_is_an_integrity_error_naming_it(doc: dict[str, object], match: str) -> None:
    raw, rid = _hostile_root(doc)
    with pytest.raises(IntegrityError, match=match) as info:
        RootTree.from_bytes(raw, rid)
    assert rid in str(info.value)


def test_a_root_format_this_release_does_not_know_says_to_upgrade() -> None:
    raw, rid = _hostile_root({"format": 3, "nodes": {}})
    with pytest.raises(FormatError, match="upgrade"):
        RootTree.from_bytes(raw, rid)
    # and a release that reads format 1 only (what came before) says the same of format 2
    inline = RootTree(nodes={}, inline={"w": _node(1)})
    with pytest.raises(FormatError, match="format version 1. Got 2"):
        parse_document(inline.to_bytes(), "root tree", inline.id, compressed=True)


def _tree_files(url: str) -> list[str]:
    return sorted(open_storage(url).list("trees"))


def test_a_save_writes_a_tree_file_only_for_large_nodes() -> None:
    """Small tensors and groups: the root tree only. A node with a zarr.json over the limit
    (here the root group's attributes) keeps a tree file; the version reads back either way."""
    url = f"memory://inline-{uuid.uuid4().hex}"
    repo = ins.open(url, create=True)
    state = {f"layer{i}/b": np.full(i + 1, i, np.float32) for i in range(6)}
    first = repo.save(state)
    assert _tree_files(url) == [f"trees/{first.root[:2]}/{first.root[2:]}"]
    big = repo.save(state, attributes={"note": "x" * (manifest.INLINE_MAX_METADATA + 100)})
    root = ins.open(url).checkout(big.id).index.root
    assert set(root.nodes) == {""} and set(root.inline) >= set(state)
    assert len(_tree_files(url)) == 3  # two roots and the root group's own tree
    loaded = ins.open(url).load()
    assert all(np.array_equal(loaded[k], v) for k, v in state.items())
    assert ins.open(url).checkout().attributes["note"].startswith("xxx")


def test_gc_keeps_the_chunks_an_inline_node_names_and_verify_checks_them() -> None:
    url = f"memory://inline-gc-{uuid.uuid4().hex}"
    repo = ins.open(url, create=True)
    for v in range(3):
        repo.save({"w": np.full(8, v, np.float32), "step": np.array(v)})
    report = repo.gc(keep_last=1)
    assert len(report.deleted["snapshots"]) == 2 and report.deleted["objects"]
    fresh = ins.open(url)
    np.testing.assert_array_equal(fresh.load()["w"], np.full(8, 2, np.float32))
    assert fresh.verify().ok
    (oid,) = fresh.checkout().arrays()["w"].chunk_ids.values()
    open_storage(url).delete(f"objects/{oid[:2]}/{oid[2:]}")
    ins.index.CACHE.clear()
    problems = ins.open(url).verify().problems
    assert [(p.kind, p.id) for p in problems] == [("object", oid)]


def test_an_unchanged_inline_tensor_keeps_its_residual_across_versions() -> None:
    """What inherits a parent's restore residual compares node ids: inline nodes are named by
    their content, so an unchanged quantized tensor still comes back exact a version later."""
    from inshrink_store.policy import QuantConfig

    quantize = QuantConfig(bins=4, min_numel=16)
    rng = np.random.default_rng(0)
    a, b, a2 = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3))
    url = f"memory://inline-residual-{uuid.uuid4().hex}"
    repo = ins.open(url, create=True)
    repo.save({"a": a, "b": b}, quantize=quantize, exact_resume=1)
    with repo.transaction() as tx:  # inherits "b" unchanged
        tx.write({"a": a2}, quantize=quantize, residual=True)
        info = tx.commit(keep_residual=1)
    reader = ins.open(url).checkout(info.id)
    assert {"a", "b"} <= set(reader.index.root.inline) and reader.arrays()["b"].storage == "quantized"
    residual = repo.residual(info.id)
    assert residual is not None and "b" in residual
    assert residual.exact("b", reader.read("b")).tobytes() == b.tobytes()


def test_a_parent_written_with_tree_files_passes_its_residual_on(tree_files: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first commit after an upgrade: the parent keeps every node as a tree file, the
    child holds the same unchanged node inline. The residual entry is inherited all the same
    (nodes are compared by what they hold, not by how they are stored)."""
    from inshrink_store.policy import QuantConfig

    quantize = QuantConfig(bins=4, min_numel=16)
    rng = np.random.default_rng(1)
    a, b, a2 = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3))
    url = f"memory://inline-upgrade-{uuid.uuid4().hex}"
    repo = ins.open(url, create=True)
    parent = repo.save({"a": a, "b": b}, quantize=quantize, exact_resume=1)
    assert not ins.open(url).checkout(parent.id).index.root.inline
    monkeypatch.setattr(manifest, "INLINE_MAX_CHUNKS", 4)  # now as a current release writes
    with repo.transaction() as tx:
        tx.write({"a": a2}, quantize=quantize, residual=True)
        info = tx.commit(keep_residual=1)
    reader = ins.open(url).checkout(info.id)
    assert "b" in reader.index.root.inline
    residual = repo.residual(info.id)
    assert residual is not None and "b" in residual
    assert residual.exact("b", reader.read("b")).tobytes() == b.tobytes()


def test_a_root_stops_inlining_at_its_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest, "INLINE_MAX_ROOT_BYTES", 3000)
    url = f"memory://inline-budget-{uuid.uuid4().hex}"
    state = {f"t{i:02d}": np.full(4, i, np.float32) for i in range(12)}
    info = ins.open(url, create=True).save(state)
    root = ins.open(url).checkout(info.id).index.root
    assert root.inline and root.nodes  # the first nodes in path order inline, the rest files
    assert max(root.inline) < min(p for p in root.nodes if p)
    loaded = ins.open(url).load()
    assert all(np.array_equal(loaded[k], v) for k, v in state.items())


def test_a_tree_keeps_its_own_copy_of_what_it_was_built_from() -> None:
    chunks = {"c/0": OID}
    tree = NodeTree(metadata="{}", chunks=chunks)
    root = RootTree(nodes={}, inline={"w": tree})
    before = (tree.id, tree.inline_id, root.id)
    chunks["c/1"] = OID
    assert dict(tree.chunks) == {"c/0": OID} and (tree.id, tree.inline_id, root.id) == before
    with pytest.raises(TypeError):
        tree.chunks["c/2"] = OID  # type: ignore[index]
    import pickle  # process pools pickle what they are handed

    assert pickle.loads(pickle.dumps(root)) == root and pickle.loads(pickle.dumps(root)).id == root.id


def test_verify_names_a_damaged_root_that_holds_nodes_inline() -> None:
    url = f"memory://inline-damage-{uuid.uuid4().hex}"
    repo = ins.open(url, create=True)
    info = repo.save({"w": np.arange(6, dtype=np.float32)})
    path = f"trees/{info.root[:2]}/{info.root[2:]}"
    raw = bytearray(open_storage(url).read(path))
    raw[-1] ^= 0x5A
    open_storage(url).write(path, bytes(raw))
    ins.index.CACHE.clear()
    report = ins.open(url).verify()
    assert not report.ok and [p.kind for p in report.problems] == ["tree"]
    assert info.root in report.problems[0].error
    with pytest.raises(IntegrityError, match=info.root):
        ins.open(url).load()


def test_verify_reports_a_bad_array_document_held_inline() -> None:
    from inshrink_store.manifest import Snapshot

    url = f"memory://inline-bad-doc-{uuid.uuid4().hex}"
    repo = ins.open(url, create=True)
    info = repo.save({"w": np.ones(3, np.float32)})
    root = ins.open(url).checkout(info.id).index.root
    bad = NodeTree(metadata='{"zarr_format": 3, "node_type": "array", "shape": "huge"}', chunks=root.inline["w"].chunks)
    new_root = RootTree(nodes=root.nodes, inline={**root.inline, "w": bad})
    storage = open_storage(url)
    storage.write(f"trees/{new_root.id[:2]}/{new_root.id[2:]}", new_root.to_bytes())
    snap = Snapshot(root=new_root.id, parent=info.id, time=info.time)
    storage.write(f"snapshots/{snap.id}", snap.to_bytes())
    storage.create_exclusive("refs/branches/main/000000000001", snap.id.encode())
    ins.index.CACHE.clear()
    report = ins.open(url).verify()
    assert not report.ok and any("w" in p.error for p in report.problems)

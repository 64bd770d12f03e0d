"""zarr.json documents are stored without indentation: same document, fewer bytes per version."""

from __future__ import annotations

import json

import numpy as np

import inshrink_store as ins
from inshrink_store.cas import ObjectStore
from inshrink_store.index import load_node, load_root
from inshrink_store.zarr_store import compact_json


def test_node_trees_hold_compact_zarr_json_that_reads_back(memory_url: str) -> None:
    repo = ins.init(memory_url)
    state = {"model/w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": np.array(3)}
    info = repo.save(state, attributes={"note": "ünïcode and \"quotes\""})
    objects = ObjectStore(repo._storage)
    root = load_root(objects, info.root)
    texts = [load_node(objects, tid).metadata for tid in root.nodes.values()]
    texts += [tree.metadata for tree in root.inline.values()]  # small nodes live in the root
    assert texts and all(t is not None and "\n" not in t and ": " not in t for t in texts)
    for t in texts:
        assert json.loads(t)["zarr_format"] == 3
    loaded = ins.open(memory_url).load()
    np.testing.assert_array_equal(loaded["model/w"], state["model/w"])
    assert ins.open(memory_url).checkout().attributes["note"] == "ünïcode and \"quotes\""


def test_compacting_keeps_the_document_and_leaves_non_json_alone() -> None:
    doc = {"b": [1, 2.5, "NaN"], "a": {"x": None, "y": 1e-300}}
    text = json.dumps(doc, indent=2).encode()
    small = compact_json(text)
    assert json.loads(small) == doc and len(small) < len(text)
    assert list(json.loads(small)) == ["b", "a"]  # key order kept
    assert compact_json(small) == small  # idempotent: an unchanged array keeps its tree id
    assert compact_json(b"not json {") == b"not json {"

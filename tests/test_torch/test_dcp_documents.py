"""Committed DCP documents are trusted only once checked: a forged document that names
chunks outside a tensor, leaves a tensor without chunks, puts a wrong type in a field, or
nests JSON deep enough to exhaust the stack is an IntegrityError naming what is wrong, both
for a DCP load and for ``verify`` (which reports the version as bad)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import inshrink_store as ins  # noqa: E402
from inshrink_store.errors import IntegrityError  # noqa: E402
from inshrink_store.manifest import NodeTree, RootTree, Snapshot, utc_now  # noqa: E402
from inshrink_store.torch import InshrinkStorageReader, InshrinkStorageWriter  # noqa: E402
from inshrink_store.torch.dcp_format import DOC_ATTR  # noqa: E402
from inshrink_store.zarr_store import tree_path  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning", "ignore::FutureWarning")


DEEP = "[" * 900 + "0" + "]" * 900  # a JSON value nested 900 deep
PLACEHOLDER = "@deep@"
FORGED = "forged"  # the branch holding the forged version


def forged(tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> str:
    """A store whose head is a one-rank save of ``w`` ([3, 4]) with its document changed by
    ``change``, committed as test_hostile_store's ``_replace_node`` commits a forged node:
    the root group's zarr.json rewritten as text (so :data:`PLACEHOLDER` becomes
    :data:`DEEP`, which no writer would serialise), the other nodes kept."""
    url = str(tmp_path / "store")
    dcp.save({"w": torch.arange(12.0).reshape(3, 4)}, storage_writer=InshrinkStorageWriter(url), no_dist=True)
    repo = ins.open(url)
    reader = repo.checkout()
    group = json.loads(reader.view.node_trees()[""][1].metadata)
    change(group["attributes"][DOC_ATTR])
    node = NodeTree(json.dumps(group).replace(json.dumps(PLACEHOLDER), DEEP), {})
    repo._storage.write(tree_path(node.id), node.to_bytes())
    old = reader.view.root
    root = RootTree({**old.nodes, "": node.id}, inline={p: t for p, t in old.inline.items() if p != ""})
    repo._storage.write(tree_path(root.id), root.to_bytes())
    snap = Snapshot(root.id, reader.id, utc_now(), "forged")
    repo._storage.write(f"snapshots/{snap.id}", snap.to_bytes())
    repo.create_branch(FORGED, snap.id)
    return url


def load_refused(url: str, match: str) -> None:
    """A 1-rank load of the forged version fails naming ``match`` and leaves the target as it
    was; the reader's own error is an IntegrityError. (DCP wraps it: torch 2.13 turns a failed
    ``read_metadata`` into an AssertionError quoting its message, inside a CheckpointException.)"""
    with pytest.raises(IntegrityError, match=re.escape(match)):
        InshrinkStorageReader(url, FORGED).read_metadata()
    target = {"w": torch.full((3, 4), -1.0)}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(target, storage_reader=InshrinkStorageReader(url, FORGED), no_dist=True)
    assert any(match in str(f) for f in caught.value.failures.values()), caught.value.failures
    assert torch.equal(target["w"], torch.full((3, 4), -1.0))


def verify_problem(url: str, match: str) -> None:
    report = ins.open(url).verify()
    assert not report.ok
    assert any(p.kind == "tree" and match in p.error for p in report.problems), report.problems


def _chunk_outside(doc: dict[str, Any]) -> None:
    doc["tensors"]["w"]["chunks"][0]["offsets"] = [5, 0]


def _no_chunks(doc: dict[str, Any]) -> None:
    doc["tensors"]["w"]["chunks"] = []


@pytest.mark.parametrize(("change", "match"), [
    (_chunk_outside, "chunk 0 of tensor 'w' (offsets [5, 0], sizes [3, 4]) inside its size [3, 4]"),
    (_no_chunks, "tensor 'w' covered by its chunks"),
], ids=["chunk-outside", "no-chunks"])
def test_chunks_that_do_not_tile_the_tensor_are_refused(tmp_path: Path, change: Any, match: str) -> None:
    url = forged(tmp_path, change)
    load_refused(url, match)
    verify_problem(url, match)


@pytest.mark.parametrize(("rows", "got"), [
    ([(0, 3), (1, 2)], "chunks holding 20 elements"),
    ([(0, 2), (1, 1)], "chunks 0 and 1 overlapping"),  # as many elements as the tensor, row 2 in none
], ids=["too-many-elements", "overlap-hiding-a-gap"])
def test_overlapping_chunks_are_refused(tmp_path: Path, rows: list[tuple[int, int]], got: str) -> None:
    def overlap(doc: dict[str, Any]) -> None:
        array = doc["tensors"]["w"]["chunks"][0]["array"]
        doc["tensors"]["w"]["chunks"] = [{"offsets": [r, 0], "sizes": [n, 4], "array": array} for r, n in rows]

    url = forged(tmp_path, overlap)
    load_refused(url, f"tensor 'w' covered by its chunks exactly once (12 elements) in the DCP document of "
                      f"snapshot {ins.open(url).checkout(FORGED).id[:12]}. Got {got} instead")
    verify_problem(url, got)


@pytest.mark.parametrize(("meta", "field"), [
    ({"modules": 5}, "storage_meta.modules"),
    ({"modules": [1]}, "storage_meta.modules"),
    ({"save_id": 3}, "storage_meta.save_id"),
    ({"checkpoint_id": []}, "storage_meta.checkpoint_id"),
    ({"nonsense": 1}, "storage_meta"),
])
def test_wrong_types_in_storage_meta_are_integrity_errors(tmp_path: Path, meta: dict[str, Any], field: str) -> None:
    url = forged(tmp_path, lambda doc: doc.update(storage_meta=meta))
    load_refused(url, field)
    verify_problem(url, field)


@pytest.mark.parametrize("where", ["storage_meta", "planner_data", "value"])
def test_deeply_nested_json_is_an_integrity_error(tmp_path: Path, where: str) -> None:
    def nest(doc: dict[str, Any]) -> None:
        if where == "value":
            doc["values"]["step"] = {"encoding": "json", "value": PLACEHOLDER}
        elif where == "planner_data":
            doc["planner_data"] = {"skeleton": PLACEHOLDER}
        else:
            doc["storage_meta"] = {"save_id": PLACEHOLDER}

    url = forged(tmp_path, nest)
    load_refused(url, "JSON nested at most 128 deep")
    verify_problem(url, "JSON nested at most 128 deep")


def test_a_value_too_deep_for_the_document_is_stored_as_bytes(tmp_path: Path) -> None:
    deep: Any = 1
    for _ in range(100):
        deep = [deep]
    url = str(tmp_path / "store")
    dcp.save({"w": torch.ones(2), "deep": deep}, storage_writer=InshrinkStorageWriter(url), no_dist=True)
    assert ins.open(url).checkout().attributes[DOC_ATTR]["values"]["deep"]["encoding"] == "torch"
    state = {"w": torch.zeros(2), "deep": None}
    dcp.load(state, storage_reader=InshrinkStorageReader(url), no_dist=True)
    assert state["deep"] == deep
    assert ins.open(url).verify().ok


def test_honest_saves_pass_every_check(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    state = {"w": torch.ones(3, 4), "scalar": torch.tensor(2.0), "empty": torch.zeros(0, 5), "step": 3,
             "extra": {"betas": (0.9, 0.99), "nested": [[[1.5]]]}}
    dcp.save(state, storage_writer=InshrinkStorageWriter(url), no_dist=True)
    assert ins.open(url).verify().ok
    InshrinkStorageReader(url).read_metadata()


def test_the_document_dtypes_are_torch_s() -> None:
    from inshrink_store.dcp_document import DTYPES
    from inshrink_store.torch import TORCH_DTYPES

    assert sorted(DTYPES) == sorted(TORCH_DTYPES.values())

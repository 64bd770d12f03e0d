"""Bad input fails early with an error from the one tree, naming the culprit and the fix;
and content addressing stores unchanged data once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import inshrink_store as ins
from inshrink_store import writer
from inshrink_store.manifest import Snapshot


@pytest.fixture
def repo(memory_url: str) -> ins.Repository:
    repo = ins.open(memory_url, create=True)
    repo.save({"w": np.arange(4, dtype=np.float32)}, message="one")
    repo.save({"w": np.arange(4, dtype=np.float32) + 1}, message="two")
    return repo


# -- opening -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["memory", "local"])
def test_missing_store_suggests_init(kind: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(f"{kind}_url") + "/never-created"
    with pytest.raises(ins.NotFoundError, match="inshrink init") as info:
        ins.open(url)
    assert url in str(info.value) and "Expected an inshrink store" in str(info.value)


def test_init_twice_is_an_error(memory_url: str) -> None:
    ins.init(memory_url)
    with pytest.raises(ins.AlreadyExistsError, match="existing inshrink store"):
        ins.init(memory_url)
    assert ins.open(memory_url).branches() == {}


# -- refs ------------------------------------------------------------------------------------
def test_unknown_ref_is_named(repo: ins.Repository) -> None:
    for ref in ["nope", "nope~1", "deadbeef"]:
        with pytest.raises(ins.NotFoundError) as info:
            repo.checkout(ref)
        assert repr(ref.split("~")[0]) in str(info.value)
        assert "branches: main" in str(info.value)


@pytest.mark.parametrize("ref", ["main~2", "main~99", "main^^^", "main~1~1"])
def test_history_too_short(repo: ins.Repository, ref: str) -> None:
    with pytest.raises(ins.NotFoundError, match="versions deep"):
        repo.resolve(ref)


def test_ambiguous_and_unique_prefixes(repo: ins.Repository) -> None:
    """Two stored snapshots sharing their first 4 hex digits: the prefix is ambiguous."""
    head = repo.snapshot(repo.resolve("main"))
    by_prefix: dict[str, Snapshot] = {}
    for i in itertools.count():
        doc = Snapshot(root=head.root, parent=None, time=head.time, message=f"twin {i}")
        if doc.id[:4] in by_prefix and doc.id[:5] != by_prefix[doc.id[:4]].id[:5]:
            twins = [by_prefix[doc.id[:4]], doc]
            break
        by_prefix[doc.id[:4]] = doc
    for doc in twins:
        repo._storage.write(f"snapshots/{doc.id}", doc.to_bytes())
    with pytest.raises(ins.FormatError, match="matches 2 snapshots") as info:
        repo.resolve(twins[0].id[:4])
    assert "give more digits" in str(info.value)
    for doc in twins:
        assert repo.resolve(doc.id[:5]) == doc.id
        assert repo.checkout(doc.id[:5]).info.message == doc.message


def test_ref_past_gc_cut_is_not_found(repo: ins.Repository) -> None:
    """After gc(keep_last=1), main~1 names a deleted snapshot; it must not resolve
    (create_branch/tag would point at nothing)."""
    repo.gc(keep_last=1)
    with pytest.raises(ins.NotFoundError):
        repo.resolve("main~1")


# -- names and dtypes ----------------------------------------------------------------------------
def test_an_unsupported_dtype_names_the_tensor(repo: ins.Repository) -> None:
    """complex64 is stored since issue 33; extended precision still is not."""
    before = repo.resolve("main")
    with pytest.raises(ins.FormatError, match="'opt/z'") as info:
        repo.save({"ok": np.ones(2, np.float32), "opt/z": np.ones(3, np.clongdouble)})
    assert "complex" in str(info.value)
    assert repo.resolve("main") == before


@pytest.mark.parametrize(
    "name", ["..", "a/../b", "a//b", "/a", "a/", "__x", "m/__meta", ".", "zarr.json", "", "a\\b"]
)
def test_bad_tensor_names(repo: ins.Repository, name: str) -> None:
    before = repo.resolve("main")
    with pytest.raises(ins.FormatError, match="tensor name"):
        repo.save({name: np.ones(2, np.float32)})
    assert repo.resolve("main") == before


def test_tensor_nested_under_a_tensor(repo: ins.Repository) -> None:
    with pytest.raises(ins.FormatError, match="'a/b'"):
        repo.save({"a": np.ones(2, np.float32), "a/b": np.ones(2, np.float32)})


@pytest.mark.parametrize("name", ["a/b", "../x", "", "-x", "a..b", "x y"])
def test_bad_branch_and_tag_names(repo: ins.Repository, name: str) -> None:
    calls: list[Callable[[], object]] = [
        lambda: repo.tag(name, "main"),
        lambda: repo.create_branch(name, "main"),
        lambda: repo.save({"w": np.ones(1, np.float32)}, branch=name),
        lambda: repo.transaction(name),
    ]
    for call in calls:
        with pytest.raises(ins.FormatError, match="name of letters"):
            call()
    assert repo.tags() == {} and list(repo.branches()) == ["main"]


def test_tag_twice_conflicts(repo: ins.Repository) -> None:
    first = repo.tag("best", "main~1")
    with pytest.raises(ins.ConflictError, match="write-once") as info:
        repo.tag("best", "main")
    assert first in str(info.value)
    assert repo.tags() == {"best": first}
    with pytest.raises(ins.ConflictError, match="existing branch"):
        repo.create_branch("main", "main~1")


# -- dedup ------------------------------------------------------------------------------------
ROWS_PER_CHUNK = 16


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 KiB chunks instead of 4 MiB, so a test tensor spans several chunks cheaply."""
    original = writer.default_chunks
    monkeypatch.setattr(writer, "default_chunks", lambda shape, itemsize: original(shape, itemsize, 4096))


def _objects(repo: ins.Repository) -> set[str]:
    return set(repo._storage.list("objects"))


def test_unchanged_state_adds_no_objects_or_trees(repo: ins.Repository) -> None:
    state = repo.load("main")
    listing = repo._storage.list("")
    info = repo.save(state, message="same again")
    added = sorted(set(repo._storage.list("")) - set(listing))
    assert added == [f"refs/branches/main/{2:012d}", f"snapshots/{info.id}"]
    assert repo.snapshot(info.parent).root == info.root  # identical root tree: diff is free


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(row=st.integers(0, 63), col=st.integers(0, 63), seed=st.integers(0, 2**16))
def test_one_changed_chunk_adds_one_object(
    memory_url: str, small_chunks: None, row: int, col: int, seed: int
) -> None:
    repo = ins.open(f"{memory_url}/{seed}-{row}-{col}", create=True)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    state = {"w": w, "b": rng.standard_normal(64).astype(np.float32), "copy": w.copy()}
    first = repo.save(state)
    snap = repo.checkout("main")
    assert snap.arrays()["w"].chunks == (ROWS_PER_CHUNK, 64)
    assert snap.arrays()["copy"].chunk_ids == snap.arrays()["w"].chunk_ids  # stored once
    before = _objects(repo)
    assert len(before) == 64 // ROWS_PER_CHUNK + 1

    changed = w.copy()
    changed[row, col] += 1.0
    repo.save({**state, "w": changed})
    new = _objects(repo) - before
    ids = repo.checkout("main").arrays()["w"].chunk_ids
    key = f"c/{row // ROWS_PER_CHUNK}/0"
    assert new == {f"objects/{ids[key][:2]}/{ids[key][2:]}"}
    report = repo.diff(first.id, "main")
    assert {t.path: (t.status, t.chunks_changed) for t in report.tensors} == {
        "b": ("unchanged", 0), "copy": ("unchanged", 0), "w": ("changed", 1)}
    np.testing.assert_array_equal(repo.checkout("main").read("w"), changed)


def test_rebasing_a_partial_update_keeps_the_other_writers_change(memory_url: str) -> None:
    """Regression: history said b=2 followed a=1, but head had the old a."""
    repo = ins.open(memory_url, create=True)
    repo.save({"a": np.zeros(3, np.float32), "b": np.zeros(3, np.float32)})
    slow = repo.transaction("main")  # inherits a and b, changes only b
    fast = repo.transaction("main")
    fast.write({"a": np.ones(3, np.float32)})
    fast.commit(message="a=1")
    slow.write({"b": np.full(3, 2, np.float32)})
    with pytest.raises(ins.ConflictError):
        slow.commit(message="b=2")
    info = slow.commit(message="b=2", rebase=True)
    head = repo.load("main")
    assert info.id == repo.resolve("main") and [i.message for i in repo.log()][:2] == ["b=2", "a=1"]
    np.testing.assert_array_equal(head["a"], np.ones(3, np.float32))  # not reverted
    np.testing.assert_array_equal(head["b"], np.full(3, 2, np.float32))
    assert repo.verify().ok


def test_rebasing_onto_a_change_of_the_same_tensor_takes_the_later_write(memory_url: str) -> None:
    """Same tensor on both sides: the rebased commit is the later one in history, so its
    write stands — whole, never a mix of the two writers' chunks."""
    repo = ins.open(memory_url, create=True)
    repo.save({"a": np.zeros(3, np.float32), "c": np.zeros(2, np.float32)})
    slow, fast = repo.transaction("main"), repo.transaction("main")
    fast.write({"a": np.ones((4, 4), np.float32), "c": np.ones(2, np.float32)})
    fast.commit()
    slow.write({"a": np.full(5, 2, np.float32)})
    slow.commit(rebase=True)
    head = repo.load("main")
    np.testing.assert_array_equal(head["a"], np.full(5, 2, np.float32))
    np.testing.assert_array_equal(head["c"], np.ones(2, np.float32))
    assert repo.verify().ok


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_metrics_and_metadata_keep_the_checkpoint(memory_url: str, value: float) -> None:
    """Regression: a diverged run's checkpoint was lost (objects written, commit failed on JSON)."""
    repo = ins.open(memory_url, create=True)
    info = repo.save({"w": np.ones(3, np.float32)}, metrics={"loss": value},
                     metadata={"grad_norm": [1.0, value], "note": {"x": value}}, step=5)
    back = ins.open(memory_url).snapshot(info.id)
    for got in (back.metrics["loss"], back.metadata["grad_norm"][1], back.metadata["note"]["x"]):
        assert (np.isnan(got) and np.isnan(value)) or got == value
    assert repo.verify().ok


@pytest.mark.parametrize("kwargs", [
    {"step": "abc"}, {"step": 1.7}, {"step": True}, {"metrics": {"loss": "low"}},
    {"metadata": {"s": {1, 2}}}, {"metadata": {"o": object()}}, {"message": 3},
])
def test_bad_commit_fields_are_refused_before_anything_is_written(memory_url: str, kwargs: dict) -> None:
    repo = ins.open(memory_url, create=True)
    before = repo._storage.list("")
    with pytest.raises(ins.FormatError):
        repo.save({"w": np.ones(3, np.float32)}, **kwargs)
    assert repo._storage.list("") == before


def test_quantize_must_be_a_planner(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    with pytest.raises(ins.FormatError, match="quantize"):
        repo.save({"w": np.ones(3, np.float32)}, quantize="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("content", [b"[1, 2]", b"{not json", b"\xff\xfe", b'{"format": 1, "keyframe_interval": "x"}', b"[" * 5000])
def test_a_corrupt_settings_file_is_a_clear_error(memory_url: str, content: bytes) -> None:
    ins.open(memory_url, create=True)
    from inshrink_store.storage import open_storage

    open_storage(memory_url).write("inshrink.json", content)
    with pytest.raises(ins.IntegrityError, match="inshrink.json"):
        ins.open(memory_url)


def test_init_under_a_file_names_the_file(tmp_path) -> None:
    path = tmp_path / "file"
    path.write_text("user data")
    with pytest.raises(ins.FormatError, match="Got a file there"):
        ins.init(str(path))
    assert path.read_text() == "user data"


def test_verify_reports_a_bad_array_document(tree_files: None, memory_url: str) -> None:
    from inshrink_store.manifest import NodeTree, RootTree, Snapshot
    from inshrink_store.zarr_store import load_node, load_root, tree_path

    repo = ins.open(memory_url, create=True)
    info = repo.save({"w": np.ones(3, np.float32)})
    root = load_root(repo._objects, info.root)
    node = load_node(repo._objects, root.nodes["w"])
    bad = NodeTree(metadata='{"zarr_format": 3, "node_type": "array", "shape": "huge"}', chunks=node.chunks)
    repo._storage.write(tree_path(bad.id), bad.to_bytes())
    new_root = RootTree(nodes={**root.nodes, "w": bad.id})
    repo._storage.write(tree_path(new_root.id), new_root.to_bytes())
    snap = Snapshot(root=new_root.id, parent=info.id, time=info.time)
    repo._storage.write(f"snapshots/{snap.id}", snap.to_bytes())
    repo._storage.create_exclusive("refs/branches/main/000000000001", snap.id.encode())
    report = repo.verify()
    assert not report.ok and any("w" in p.error for p in report.problems)

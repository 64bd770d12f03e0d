"""gc fails closed, and verify names what it finds (issue 41, items 1, 2, 4 and 6).

A transient storage error while gc marks (a throttled GET of a snapshot document, of an
object's header, of a residual document) used to read as "nothing more to keep": a kept
delta lost its base (item 1), a kept version was swept (item 2). Each case here injects
the issue's exact fault into one storage object's reads and checks that gc raises, deletes
nothing, and collects as asked once the storage answers again. Also: verify wraps a decode
error of a crafted coder-4 object as an IntegrityError naming it (item 4), and does not
report the rightly collected residual of an old version that became a branch head (item 6).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store import object_format
from inshrink_store.errors import StorageError
from inshrink_store.layout import object_path, residual_path, snapshot_path
from inshrink_store.policy import QuantConfig
from inshrink_store.storage import Storage

QC = QuantConfig(bins=4, min_numel=16)


class Faults:
    """Makes the reads of chosen paths of one storage object (``read``, ``read_range``,
    ``size``) raise ``StorageError``, each path a chosen number of times, as a throttled or
    dropped request would; every other call goes through. ``left`` says what is still armed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, storage: Storage) -> None:
        self.left: dict[str, int] = {}
        self.hits: list[str] = []
        for name in ("read", "read_range", "size"):
            monkeypatch.setattr(storage, name, self._wrap(name, getattr(storage, name)))

    def fail(self, path: str, times: int) -> None:
        self.left[path] = times

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(path: str, *args: Any, **kwargs: Any) -> Any:
            if self.left.get(path, 0) > 0:
                self.left[path] -= 1
                self.hits.append(f"{name} {path}")
                raise StorageError(f"Expected to {name} {path}. Got SlowDown (injected) instead.")
            return original(path, *args, **kwargs)
        return call


def _files(repo: ins.Repository) -> dict[str, int]:
    return repo._storage.list("")


@pytest.fixture(autouse=True)
def _quiet_quantizer() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


# -- item 1: a transient error on a delta base's header -------------------------------------


def _closed_loop_run(url: str, saves: int = 4) -> ins.Repository:
    """``saves`` closed-loop Checkpointer saves of a torch ``Linear(128, 64)`` (each version's
    weight a coder-4 residual on the previous version's object)."""
    torch = pytest.importorskip("torch")
    from inshrink_store.torch import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Linear(128, 64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    y = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))

    def evaluate(m: Any) -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(m(x), y))

    repo = ins.open(url, create=True)
    ck = Checkpointer(repo, model, opt, eval_fn=evaluate, tolerance=0.05, higher_is_better=False,
                      background=False)
    for step in range(1, saves + 1):
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            ck.observe_gradients()
            opt.step()
        ck.save(step)
    ck.close()
    return repo


def test_a_transient_error_on_a_kept_deltas_base_stops_gc_and_deletes_nothing(
        memory_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _closed_loop_run(memory_url)
    objects = repo._parts.objects
    head = repo.checkout("main")
    deltas = [oid for key, oid in sorted(head.index.chunk_ids("model/weight").items())
              if key != "zarr.json" and objects.header(oid).is_delta]
    assert deltas, "the head's weight should be a closed-loop residual on the previous version"
    base = objects.header(deltas[0]).base
    assert base is not None and base not in head.index.chunk_ids("model/weight").values()
    expected = {name: np.asarray(head.read(name)).tobytes() for name in head.arrays()}
    before = _files(repo)

    faults = Faults(monkeypatch, repo._storage)
    faults.fail(object_path(base), 2)  # two reads of the base's header
    with pytest.raises(StorageError, match=base):
        repo.gc(keep_last=1)
    assert faults.hits and _files(repo) == before  # nothing deleted

    fresh = ins.open(memory_url)
    reader = fresh.checkout("main")
    assert {name: np.asarray(reader.read(name)).tobytes() for name in reader.arrays()} == expected
    report = fresh.gc(keep_last=1)  # the storage answers again: gc collects as asked
    assert len(report.deleted["snapshots"]) == 3 and object_path(base) not in report.deleted["objects"]
    reader = ins.open(memory_url).checkout("main")
    assert {name: np.asarray(reader.read(name)).tobytes() for name in reader.arrays()} == expected
    assert ins.open(memory_url).verify().ok


# -- item 2: a transient error on a kept version's snapshot document ------------------------


def _five(repo: ins.Repository) -> list[str]:
    rng = np.random.default_rng(5)
    return [repo.save({"w": rng.standard_normal((32, 32)).astype(np.float32)}, step=i).id for i in range(5)]


def test_a_transient_error_on_a_snapshot_document_stops_gc_and_keeps_every_kept_version(
        memory_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = ins.open(memory_url, create=True)
    ids = _five(repo)
    main_1, main_2 = repo.resolve("main~1"), repo.resolve("main~2")
    before = _files(repo)
    faults = Faults(monkeypatch, repo._storage)
    faults.fail(snapshot_path(main_1), 1)  # one read of main~1's snapshot document
    with pytest.raises(StorageError, match=main_1):
        repo.gc(keep_last=3)
    assert faults.hits and _files(repo) == before
    fresh = ins.open(memory_url)
    assert fresh.checkout(main_2).read("w").shape == (32, 32)
    report = fresh.gc(keep_last=3)
    assert sorted(report.deleted["snapshots"]) == sorted(snapshot_path(sid) for sid in ids[:2])
    assert [info.id for info in fresh.log()] == ids[:1:-1] and fresh.verify().ok


def test_an_exists_that_says_no_on_a_failure_never_ends_the_history_walk(
        memory_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsspec's ``exists`` answers False on any error (a local disk's too, on a permission
    error): an absence is only what a read says it is (FileNotFoundError)."""
    repo = ins.open(memory_url, create=True)
    ids = _five(repo)
    storage = repo._storage
    original = storage.exists
    monkeypatch.setattr(storage, "exists", lambda path: False if path.startswith("snapshots/") else original(path))
    report = repo.gc(keep_last=3)
    assert sorted(report.deleted["snapshots"]) == sorted(snapshot_path(sid) for sid in ids[:2])
    monkeypatch.setattr(storage, "exists", original)
    assert [info.id for info in ins.open(memory_url).log()] == ids[:1:-1]


def test_a_missing_parent_after_an_earlier_keep_last_still_ends_the_walk(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    ids = _five(repo)
    repo.gc(keep_last=2)
    assert not any(repo.gc().deleted.values())  # main~1's parent is gone: that is history gc cut
    assert repo.gc(keep_last=1).deleted["snapshots"] == [snapshot_path(ids[3])]
    assert repo.verify().ok


# -- the same rule in the residual-only sweep and in the Checkpointer's retention ----------


def test_a_transient_error_on_a_kept_residual_stops_the_residual_sweep(
        memory_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two versions whose documents share the piece of an unchanged tensor ``p``: dropping
    the older document must keep that piece, which only the newer document says."""
    repo = ins.open(memory_url, create=True)
    rng = np.random.default_rng(8)
    p = rng.standard_normal((16, 16)).astype(np.float32)
    for seed in (1, 2):
        q = np.random.default_rng(seed).standard_normal((16, 16)).astype(np.float32)
        head = repo.save({"p": p, "q": q}, quantize=QC, exact_resume=1)
    kept = str(head.metadata["residual"]["id"])
    before = _files(repo)
    faults = Faults(monkeypatch, repo._storage)
    faults.fail(residual_path(kept), 2)
    with pytest.raises(StorageError, match=kept):
        repo.gc_residuals()
    assert faults.hits and _files(repo) == before
    fresh = ins.open(memory_url)
    assert len(fresh.gc_residuals().deleted["residuals"]) == 1
    found = fresh.residual(head.id)
    assert found is not None
    assert found.exact("p", fresh.checkout(head.id).read("p")).tobytes() == p.tobytes()
    assert fresh.verify().ok


def test_retention_stops_its_gc_on_a_transient_error_in_another_branchs_history(
        memory_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    torch = pytest.importorskip("torch")
    from inshrink_store.torch import Checkpointer

    repo = ins.open(memory_url, create=True)
    rng = np.random.default_rng(3)
    side = [repo.save({"w": rng.standard_normal(8).astype(np.float32)}, branch="side").id for _ in range(3)]
    model = torch.nn.Linear(4, 2)
    ck = Checkpointer(repo, model, lossless=True, max_to_keep=1, background=False, exact_resume=0)
    ck.save(1)
    faults = Faults(monkeypatch, repo._storage)
    faults.fail(snapshot_path(side[1]), 1)  # one read of side~1's snapshot document
    with caplog.at_level(logging.WARNING, logger="inshrink_store.torch.checkpointer"):
        ck.save(2)  # the commit stands; its gc logs the error and deletes nothing
    assert faults.hits and "gc(keep_last=1) failed" in caplog.text
    assert [info.id for info in ins.open(memory_url).log("side")] == side[::-1]
    ck.save(3)
    ck.close()
    fresh = ins.open(memory_url)
    assert [info.id for info in fresh.log("side")] == side[::-1] and len(fresh.log("main")) == 1
    assert fresh.verify().ok


# -- item 4: verify wraps every decode error ------------------------------------------------


def test_verify_reports_a_coder_4_delta_on_a_base_of_odd_length_as_an_integrity_error(memory_url: str) -> None:
    """A crafted coder-4 delta whose base payload (6 bytes) is not whole float32 elements: a
    read refused it with an IntegrityError, verify raised numpy's raw ValueError."""
    from inshrink_store.codecs import closed_loop
    from inshrink_store.codecs.nuq import quantizer

    repo = ins.open(memory_url, create=True)
    values = np.linspace(-1, 1, 64, dtype=np.float32)
    info = repo.save({"w": values})
    (oid,) = [o for key, o in repo.checkout(info.id).index.chunk_ids("w").items() if key != "zarr.json"]
    objects = repo._parts.objects
    base = objects.put(b"\x01\x02\x03\x04\x05\x06").oid  # a raw keyframe of 6 bytes
    q = quantizer((-1.0, 0.0, 1.0), 0.0, "float32", "float32")
    body = closed_loop.encode(q.encode(np.round(values)), np.asarray(q.centres, np.float32))
    crafted = object_format.frame(object_format.KIND_DELTA, object_format.CODER_CLOSED_LOOP, 1, values.tobytes(), base, body)
    repo._storage.write(object_path(oid), crafted)

    report = ins.open(memory_url).verify()
    assert [(p.kind, p.id) for p in report.problems] == [("object", oid)]
    assert oid in report.problems[0].error and report.problems[0].used_by == [(info.id, "w")]
    with pytest.raises(ins.IntegrityError, match=oid):  # a read names it too (one definition)
        ins.open(memory_url).checkout(info.id).read("w")


# -- item 6: verify knows which versions should still have a residual ----------------------


@pytest.mark.parametrize("keep", [1, 2])
def test_verify_does_not_report_a_rightly_collected_residual_of_a_new_branch_head(
        memory_url: str, keep: int) -> None:
    repo = ins.open(memory_url, create=True)
    rng = np.random.default_rng(6)
    for i in range(4):
        repo.save({"p": rng.standard_normal((16, 16)).astype(np.float32)}, quantize=QC, exact_resume=keep, step=i)
    old = repo.snapshot("main~2")
    repo.gc_residuals()
    assert repo.residual(old.id) is None  # collected: main~2 is past its keep_newest on main
    repo.create_branch("from-old", "main~2")
    assert repo.verify().ok, repo.verify().problems
    assert not any(repo.gc().deleted.values())  # a full gc keeps what is there and stops at nothing
    assert ins.open(memory_url).verify().ok
    np.testing.assert_array_equal(repo.checkout("from-old").read("p"), repo.checkout(old.id).read("p"))


def test_verify_still_reports_the_missing_residual_of_a_version_that_needs_it(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    rng = np.random.default_rng(7)
    for i in range(3):
        repo.save({"p": rng.standard_normal((16, 16)).astype(np.float32)}, quantize=QC, exact_resume=2, step=i)
    repo.create_branch("from-old", "main~2")  # before the sweep: its residual is kept
    repo.gc_residuals()
    needed = repo.snapshot("main~1")
    repo._storage.delete(residual_path(str(needed.metadata["residual"]["id"])))
    (problem,) = repo.verify().problems
    assert problem.kind == "residual" and problem.used_by == [(needed.id, "restore residual")]

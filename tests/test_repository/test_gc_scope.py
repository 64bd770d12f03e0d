"""``Repository.gc(keep_last, branch=, keep=, trim=)``: a gc that trims one branch (issue 45).

Retention and the Lightning plugin trim their own branch through it (their tests cover
them); these tests pin the facade's contract itself: the other branches keep their
history, ``keep`` keeps a version of the trimmed branch, ``trim`` trims another branch with
it, tags keep theirs, and the keywords need the branch they scope.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store.errors import InvalidInputError
from inshrink_store.repository import Repository


def _versions(repo: Repository, branch: str, n: int, step0: int = 0) -> list[str]:
    return [repo.save({"w": np.full(64, i + step0, np.float32)}, branch=branch, step=i + step0).id
            for i in range(n)]


def test_only_the_named_branch_is_trimmed(memory_url: str) -> None:
    repo = ins.init(memory_url)
    main = _versions(repo, "main", 3)
    other = _versions(repo, "other", 3, step0=10)
    repo.gc(1, branch="main")
    kept = set(repo.snapshot_ids())
    assert kept == {main[-1], *other}
    assert repo.head("main") == main[-1] and repo.head("nobranch") is None


def test_keep_keeps_a_version_and_trim_trims_another_branch(memory_url: str) -> None:
    repo = ins.init(memory_url)
    main = _versions(repo, "main", 4)
    side = _versions(repo, "side", 2, step0=10)
    asked: list[str] = []

    def keep(info: ins.SnapshotInfo) -> bool:
        asked.append(info.id)
        return info.step == 1

    repo.gc(1, branch="main", keep=keep, trim=lambda name: name == "side")
    assert set(repo.snapshot_ids()) == {main[1], main[-1], side[-1]}
    before = len(asked)
    repo.gc(1, branch="main", keep=keep, trim=lambda name: name == "side")
    assert len(asked) == before  # asked once per version: remembered across runs


def test_tags_keep_their_versions(memory_url: str) -> None:
    repo = ins.init(memory_url)
    main = _versions(repo, "main", 3)
    repo.tag("first", main[0])
    repo.gc(1, branch="main")
    assert set(repo.snapshot_ids()) == {main[0], main[-1]}


def test_keep_and_trim_need_a_branch(memory_url: str) -> None:
    repo = ins.init(memory_url)
    _versions(repo, "main", 1)
    with pytest.raises(InvalidInputError, match="branch="):
        repo.gc(1, keep=lambda info: True)


def test_codebooks_name_a_versions_quantized_arrays(memory_url: str) -> None:
    repo = ins.init(memory_url)
    w = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
    repo.save({"model/w": w, "b": np.zeros(4, np.float32)}, quantize=ins.QuantConfig(bins=16))
    codebooks = repo.codebooks("main")
    assert list(codebooks) == ["model/w"] and "codec" in codebooks["model/w"]


def test_a_repository_pickles_after_a_gc_with_a_lambda(local_url: str) -> None:
    repo = ins.init(local_url)
    _versions(repo, "main", 2)
    repo.gc(1, branch="main", keep=lambda info: False)
    copy = pickle.loads(pickle.dumps(repo))
    assert copy.url == repo.url and copy.snapshot_ids() == repo.snapshot_ids()


def test_a_failed_read_on_the_trimmed_branch_stops_the_gc_and_keeps_what_keep_keeps(memory_url: str) -> None:
    """Regression: the scope's walk over the trimmed branch skipped a version it could not
    read (any store error, a transient one included), so ``keep`` was never asked about it
    and the gc swept it: Lightning's plugin kept the user's own versions this way. Only a
    confirmed absence may end the walk; anything else stops the gc before it deletes."""
    from inshrink_store import index
    from inshrink_store.errors import StorageError
    from inshrink_store.testing import FlakyStorage

    repo = ins.init(memory_url)
    main = _versions(repo, "main", 4)
    index.CACHE.clear()  # the scope reads the snapshot documents from the store, not from memory
    flaky = FlakyStorage.for_url(memory_url)
    fresh = Repository(flaky)
    flaky.fail("read", f"snapshots/{main[0]}", times=1)
    with pytest.raises(StorageError):
        fresh.gc(1, branch="main", keep=lambda info: info.step == 0)
    assert flaky.injected and set(fresh.snapshot_ids()) == set(main)  # nothing deleted
    fresh.gc(1, branch="main", keep=lambda info: info.step == 0)  # the fault is spent: the gc runs
    assert set(fresh.snapshot_ids()) == {main[0], main[-1]}

"""du accounts for every byte under the store: the versions along a ref, the delta bases their
deltas need (a deleted version's keyframe that gc kept), other refs' versions, the store's
documents and what gc would still collect add up to the bytes on disk.

Issue 33: after ``gc --keep-last 2`` du reported 156.9 MB while objects/ held 173.2 MB,
because the delta bases of deleted versions were not counted anywhere.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

import inshrink_store as ins
from inshrink_store import object_format
from tests._cli_helpers import run


def _bytes_on_disk(folder: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def _drifting_versions(repo: ins.Repository, versions: int, seed: int = 0) -> None:
    """A weight that drifts a little each version: every version after the first is a delta."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((120, 100)) * 0.05).astype(np.float32)
    for step in range(versions):
        w = w + (rng.standard_normal(w.shape) * 1e-4).astype(np.float32)
        repo.save({"model/w": w.copy()}, step=step)


def _kept_delta_with_a_deleted_base(tmp_path: Path) -> tuple[str, ins.Repository]:
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    _drifting_versions(repo, 4)
    repo.gc(keep_last=2)
    reader = repo.checkout("main")
    oid = next(iter(reader.arrays()["model/w"].chunk_ids.values()))
    chain = reader.view.objects.chain(oid)
    assert reader.view.objects.header(oid).kind == object_format.KIND_DELTA and len(chain) > 1
    kept = {repo.snapshot(sid).step for sid in repo.snapshot_ids()}
    assert kept == {2, 3}  # the keyframe at the end of the chain belonged to step 0, now deleted
    return url, repo


def test_du_accounts_for_the_delta_bases_of_deleted_versions(tmp_path: Path) -> None:
    url, repo = _kept_delta_with_a_deleted_base(tmp_path)
    rows = repo.du()
    summary = repo.du_summary()
    assert summary.versions == sum(r.new_stored_bytes for r in rows)
    assert summary.delta_bases > 0
    assert summary.total == _bytes_on_disk(tmp_path / "store")
    assert summary.total == (summary.versions + summary.delta_bases + summary.other_refs + summary.metadata
                             + summary.unreferenced)


def test_du_accounts_for_other_refs_and_garbage_not_yet_collected(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    _drifting_versions(repo, 2)
    side = repo.save({"model/w": np.ones((120, 100), np.float32)}, branch="side", parent=None)
    repo.tag("side-version", side.id)
    repo.delete_branch("side")  # its version stays (tagged)
    repo.save({"model/v": np.arange(5000, dtype=np.float32)}, branch="gone", parent=None)
    repo.delete_branch("gone")  # its version is garbage until the next gc
    summary = repo.du_summary()
    assert summary.other_refs > 0 and summary.unreferenced > 0
    assert summary.total == _bytes_on_disk(tmp_path / "store")
    freed = repo.gc().freed_bytes
    assert freed <= summary.unreferenced
    assert repo.du_summary().total == _bytes_on_disk(tmp_path / "store")


def test_cli_du_prints_where_every_byte_is(tmp_path: Path) -> None:
    url, repo = _kept_delta_with_a_deleted_base(tmp_path)
    result = run("du", url)
    assert result.exit_code == 0, result.output
    for label in ("delta bases", "other refs", "documents and refs", "unreferenced", "total"):
        assert label in result.output, label

"""du's ratio says what it counts and its total is the bytes on disk (issue 43, item 2).

A user's Lightning store showed "overall 5.24x" where the bytes on disk gave 2.82x (273.5 MiB
under "other refs", 177.9 MiB under "delta bases" that the rows' ratio left out), and a
quantized store showed a per-version "ratio 12924.18x" (a version that added almost nothing).
The store-wide ratio is now the raw bytes of every version the store keeps over every byte
under the store, and the table names what each ratio counts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

import inshrink_store as ins
from tests._cli_helpers import run


def _bytes_on_disk(folder: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def _store_with_other_refs_and_delta_bases(tmp_path: Path) -> tuple[str, ins.Repository]:
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((120, 100)) * 0.05).astype(np.float32)
    for step in range(4):  # every version after the first is a delta
        w = w + (rng.standard_normal(w.shape) * 1e-4).astype(np.float32)
        repo.save({"model/w": w.copy()}, step=step)
    repo.gc(keep_last=2)  # step 0's keyframe stays as a delta base no row counts
    side = repo.save({"model/v": rng.standard_normal((80, 50)).astype(np.float32)}, branch="side", parent=None)
    repo.tag("side-version", side.id)
    repo.save({"model/v": np.ones((80, 50), np.float32)}, step=9)  # the same as no other: dedup-free
    repo.save({"model/v": np.ones((80, 50), np.float32)}, step=10)  # adds almost nothing
    return url, repo


def _kept_logical(repo: ins.Repository) -> int:
    total = 0
    kept = {*repo.tags().values(), *(s.id for s in repo.log("main")), *(s.id for s in repo.log("side"))}
    for sid in kept:
        total += sum(a.logical_bytes for a in repo.checkout(sid).arrays().values())
    return total


def test_du_total_is_the_bytes_on_disk_and_its_ratio_counts_every_kept_version(tmp_path: Path) -> None:
    url, repo = _store_with_other_refs_and_delta_bases(tmp_path)
    summary = repo.du_summary()
    assert summary.delta_bases > 0 and summary.other_refs > 0
    on_disk = _bytes_on_disk(tmp_path / "store")
    assert summary.total == on_disk
    assert summary.kept_versions == len(set(repo.snapshot_ids()))
    assert summary.kept_logical_bytes == _kept_logical(repo)
    assert summary.ratio == summary.kept_logical_bytes / on_disk


def test_cli_du_prints_the_store_ratio_over_the_bytes_on_disk(tmp_path: Path) -> None:
    url, repo = _store_with_other_refs_and_delta_bases(tmp_path)
    result = run("du", url)
    assert result.exit_code == 0, result.output
    on_disk = _bytes_on_disk(tmp_path / "store")
    expected = f"{_kept_logical(repo) / on_disk:.2f}x"
    line = next(line for line in result.output.splitlines() if "under the store" in line and "=" in line)
    assert line.rstrip().endswith(expected), line
    assert f"{len(set(repo.snapshot_ids()))} versions" in line
    # no per-version ratio of logical bytes to the bytes a version added: it reads as thousands
    header = next(line for line in result.output.splitlines() if "snapshot" in line)
    assert not re.search(r"(?<![a-z ])ratio(?! so far)", header), header
    assert "ratio so far" in header

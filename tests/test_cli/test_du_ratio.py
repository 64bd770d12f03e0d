"""du's ratio says what it counts and its total is the bytes on disk (issue 43, item 2).

A user's Lightning store showed "overall 5.24x" where the bytes on disk gave 2.82x (273.5 MiB
under "other refs", 177.9 MiB under "delta bases" that the rows' ratio left out), and a
quantized store showed a per-version "ratio 12924.18x" (a version that added almost nothing).
The store-wide ratio is now the raw bytes of every version the store keeps over every byte
under the store, and the table names what each ratio counts.
"""

from __future__ import annotations

import json
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


def test_du_json_gives_the_tables_ratios_each_with_what_it_counts(tmp_path: Path) -> None:
    """du --json listed the rows alone, each with its version's own ratio (the figure the
    table dropped: thousands on a version that deduplicated) and none of the store-wide
    figures. It now holds what the table prints: the ratio so far per row, where every byte
    under the store is, and the ref's and the store's ratios, each with the bytes it divides
    and what they count."""
    url, repo = _store_with_other_refs_and_delta_bases(tmp_path)
    result = run("du", url, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    on_disk = _bytes_on_disk(tmp_path / "store")
    rows = doc["rows"]
    assert doc["ref"] == "main" and doc["prefix"] == ""
    assert [r["snapshot"] for r in rows] == [s.id for s in reversed(repo.log("main"))]
    assert all("ratio" not in r for r in rows)  # the version's own ratio is gone
    for r in rows:
        assert r["cumulative_ratio"] == r["cumulative_logical_bytes"] / r["cumulative_stored_bytes"]
    assert doc["where"]["total"] == on_disk == sum(v for k, v in doc["where"].items() if k != "total")
    store, ref, so_far = doc["ratios"]["store"], doc["ratios"]["ref"], doc["ratios"]["so_far"]
    assert store["stored_bytes"] == on_disk and store["logical_bytes"] == _kept_logical(repo)
    assert store["ratio"] == _kept_logical(repo) / on_disk and store["versions"] == len(set(repo.snapshot_ids()))
    summary = repo.du_summary()
    assert ref["stored_bytes"] == summary.versions + summary.delta_bases == doc["where"]["versions"] + doc["where"]["delta_bases"]
    assert ref["logical_bytes"] == sum(r["logical_bytes"] for r in rows) and ref["versions"] == len(rows)
    assert so_far["ratio"] == rows[-1]["cumulative_ratio"] and so_far["stored_bytes"] == rows[-1]["cumulative_stored_bytes"]
    assert all(entry["counts"] for entry in (store, ref, so_far))
    # the table prints the same figures
    table = run("du", url).output
    assert f"= {store['ratio']:.2f}x" in table and f"= {ref['ratio']:.2f}x" in table
    assert f"{rows[-1]['cumulative_ratio']:.2f}x" in table


def test_du_json_with_a_prefix_has_no_store_wide_figures(tmp_path: Path) -> None:
    """With --prefix the rows count only the tensors under it (no trees), so the store's and
    the ref's byte accounts do not apply: null, as the table leaves them out."""
    url, _ = _store_with_other_refs_and_delta_bases(tmp_path)
    doc = json.loads(run("du", url, "--prefix", "model/", "--json").stdout)
    assert doc["prefix"] == "model/" and doc["where"] is None
    assert doc["ratios"]["ref"] is None and doc["ratios"]["store"] is None
    assert doc["ratios"]["so_far"]["ratio"] == doc["rows"][-1]["cumulative_ratio"]
    assert "under the store" not in run("du", url, "--prefix", "model/").output

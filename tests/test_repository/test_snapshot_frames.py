"""Snapshots are stored as zstd frames of their canonical JSON; one stored as the plain JSON
(every snapshot written before frames) is read, verified, tagged and kept by gc as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import zstandard

import inshrink_store as ins
from inshrink_store import manifest


def test_a_snapshot_is_a_zstd_frame_of_its_canonical_json(tmp_path: Path) -> None:
    repo = ins.open(str(tmp_path / "s"), create=True)
    metadata = {"trials": [{"bins": b, "quality": 1.0 / b} for b in range(4, 64)]}
    info = repo.save({"w": np.arange(8, dtype=np.float32)}, message="m", metadata=metadata)
    stored = repo._storage.read(f"snapshots/{info.id}")
    assert stored[:4] == manifest.ZSTD_MAGIC and manifest.content_id(stored) == info.id
    plain = zstandard.decompress(stored)
    assert len(stored) < len(plain) / 3  # the repeated keys of metadata are what a frame saves
    assert ins.open(repo.url).snapshot(info.id).metadata == metadata


def test_a_snapshot_stored_as_plain_json_is_still_read(tmp_path: Path) -> None:
    repo = ins.open(str(tmp_path / "s"), create=True)
    first = repo.save({"w": np.arange(8, dtype=np.float32)}, message="first", metrics={"loss": 0.5})
    plain = zstandard.decompress(repo._storage.read(f"snapshots/{first.id}"))  # as written before frames
    old = manifest.content_id(plain)
    repo._storage.write(f"snapshots/{old}", plain)
    fresh = ins.open(repo.url)
    fresh.tag("old", old)
    [info] = fresh.log("old")
    assert (info.id, info.message, info.metrics) == (old, "first", {"loss": 0.5})
    np.testing.assert_array_equal(fresh.checkout("old").read("w"), np.arange(8, dtype=np.float32))
    assert fresh.verify().problems == []
    fresh.gc()
    assert fresh.snapshot(old).message == "first"

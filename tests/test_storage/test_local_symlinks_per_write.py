"""A local store's folder swapped for an outward symlink after a handle has written into it.

The handle once trusted a folder for its whole life after checking it on first use; a
shard folder (``objects/ab/``) or a top folder (``objects/``) replaced by a link to
somewhere else then let the same handle write outside the store. Every write checks the
folders between the store's root and the file again.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store.errors import IntegrityError
from inshrink_store.storage import open_storage

OID = "ab" + "0" * 30
OTHER = "ab" + "1" * 30


def _swap_for_link(folder: Path, target: Path) -> set[Path]:
    """Move ``folder`` to ``target`` (outside the store) and leave a symlink to it in its
    place; the files now outside are returned (a write through the link would add one)."""
    shutil.move(folder, target)
    os.symlink(target, folder)
    return _files(target)


def _files(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("swapped", ["objects/ab", "objects"])
def test_a_folder_swapped_for_an_outward_link_after_a_write_is_refused(tmp_path: Path, swapped: str) -> None:
    storage = open_storage(str(tmp_path / "store"))
    storage.write(f"objects/{OID[:2]}/{OID[2:]}", b"first")  # the handle has now seen objects/ab
    outside = tmp_path / "outside"
    before = _swap_for_link(tmp_path / "store" / swapped, outside)
    with pytest.raises(IntegrityError, match="symlink"):
        storage.write(f"objects/{OTHER[:2]}/{OTHER[2:]}", b"second")
    with pytest.raises(IntegrityError, match="symlink"):
        storage.create_exclusive(f"objects/{OTHER[:2]}/{OTHER[2:]}", b"second")
    assert _files(outside) == before  # nothing landed outside


def test_a_save_after_the_snapshots_folder_is_swapped_for_a_link_writes_nothing_outside(tmp_path: Path) -> None:
    repo = ins.open(str(tmp_path / "store"), create=True)
    repo.save({"w": np.arange(64, dtype=np.float32)})  # the handle has written into snapshots/
    outside = tmp_path / "outside"
    before = _swap_for_link(tmp_path / "store" / "snapshots", outside)
    with pytest.raises(IntegrityError, match="symlink"):
        repo.save({"w": np.random.default_rng(0).standard_normal(64).astype(np.float32)})
    assert _files(outside) == before


def test_a_link_that_stays_inside_the_store_is_still_written_through(tmp_path: Path) -> None:
    root = tmp_path / "store"
    storage = open_storage(str(root))
    storage.write(f"objects/{OID[:2]}/{OID[2:]}", b"first")
    (root / "elsewhere").mkdir()
    os.symlink(root / "elsewhere", root / "objects" / "cd")
    storage.write("objects/cd/" + "2" * 30, b"inside")
    storage.write("objects/cd/" + "3" * 30, b"inside again")
    assert sorted(p.name for p in (root / "elsewhere").iterdir()) == ["2" * 30, "3" * 30]

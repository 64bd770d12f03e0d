"""The error tree: each kind of failure has one class, grouped by what the caller should do."""

from __future__ import annotations

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store import errors


def test_the_tree() -> None:
    assert issubclass(ins.NotFoundError, KeyError)
    assert issubclass(ins.FormatError, ValueError)
    assert issubclass(ins.InvalidInputError, ins.FormatError)  # old `except FormatError` still works
    assert issubclass(ins.StorageError, OSError)
    assert issubclass(ins.MissingDependencyError, ImportError)
    for conflict in (ins.AlreadyExistsError, ins.GcRunningError, ins.LeaseBrokenError):
        assert issubclass(conflict, ins.ConflictError)
    assert not issubclass(ins.IntegrityError, ins.FormatError)
    assert not issubclass(ins.StorageError, (ins.FormatError, ins.IntegrityError))
    public = [getattr(errors, name) for name in dir(errors) if name.endswith("Error")]
    assert all(issubclass(cls, ins.InshrinkError) for cls in public)
    assert errors.BackgroundSaveError.__module__ == "inshrink_store.errors"


def test_a_bad_argument_is_invalid_input_and_damaged_data_is_not(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    info = repo.save({"w": np.ones(2, np.float32)})
    for call in (lambda: repo.save({"w": np.ones(2, np.float32)}, step="x"),
                 lambda: repo.tag("bad/name"),
                 lambda: repo.resolve("~~ ~"),
                 lambda: repo.save({"w": np.ones(2, np.float32)}, quantize="yes")):
        with pytest.raises(ins.InvalidInputError):
            call()
    repo._storage.write(f"snapshots/{info.id}", b'{"format": 99}')
    with pytest.raises(ins.IntegrityError):  # the bytes no longer hash to the id
        repo.snapshot(info.id)


def test_names_taken_are_already_exists(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    repo.save({"w": np.ones(2, np.float32)})
    repo.tag("t")
    with pytest.raises(ins.AlreadyExistsError):
        repo.tag("t")
    with pytest.raises(ins.AlreadyExistsError):
        repo.create_branch("main")
    with pytest.raises(ins.AlreadyExistsError):
        ins.init(memory_url)

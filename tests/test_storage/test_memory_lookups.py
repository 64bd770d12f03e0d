"""The memory backend answers exists/size from fsspec's dict, never through ``fs.info``,
which tests every key in the process to tell folders from files (a save's dedup checks made
a save of N tensors quadratic)."""

from __future__ import annotations

import uuid

import pytest

from inshrink_store.cas import ObjectStore
from inshrink_store.errors import NotFoundError
from inshrink_store.storage import open_storage


def _never(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("fs.info was called: it scans every key of the memory filesystem")


def test_exists_and_size_are_dict_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    storage = open_storage(f"memory://lookups-{uuid.uuid4().hex}")
    storage.write("objects/ab/cdef", b"12345")
    monkeypatch.setattr(storage.fs, "info", _never)
    assert storage.exists("objects/ab/cdef")
    assert not storage.exists("objects/ab/missing")
    assert storage.size("objects/ab/cdef") == 5
    with pytest.raises(FileNotFoundError):
        storage.size("objects/ab/missing")
    storage.create_exclusive("refs/x", b"1")
    with pytest.raises(FileExistsError):
        storage.create_exclusive("refs/x", b"2")
    assert storage.read("refs/x") == b"1"


def test_an_object_missing_from_memory_is_named() -> None:
    objects = ObjectStore(open_storage(f"memory://lookups-{uuid.uuid4().hex}"))
    put = objects.put(b"payload")
    assert objects.stored_size(put.oid) > 0
    with pytest.raises(NotFoundError, match="0" * 32):
        objects.stored_size("0" * 32)


def test_two_stores_in_memory_do_not_see_each_others_files() -> None:
    a, b = open_storage(f"memory://a-{uuid.uuid4().hex}"), open_storage(f"memory://b-{uuid.uuid4().hex}")
    a.write("inshrink.json", b"{}")
    assert a.exists("inshrink.json") and not b.exists("inshrink.json")


@pytest.mark.parametrize("root", ["memory://nested-{}/deeper/store", "memory://trailing-{}/", "memory:///slash-{}"])
def test_lookups_agree_with_reads_whatever_the_root(root: str) -> None:
    storage = open_storage(root.format(uuid.uuid4().hex))
    storage.write("trees/ab/cd", b"xyz")
    assert storage.exists("trees/ab/cd") and storage.read("trees/ab/cd") == b"xyz"
    assert storage.size("trees/ab/cd") == 3
    assert not storage.exists("trees/ab") and not storage.exists("trees/ab/c")  # files only

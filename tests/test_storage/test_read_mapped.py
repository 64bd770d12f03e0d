"""``LocalStorage.read_mapped`` (an export's object reads, issue 43 item 10): a file's bytes
as a view of the file mapped into memory, with what ``read`` checks and raises."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from inshrink_store.errors import IntegrityError
from inshrink_store.storage import LocalStorage, open_storage


def _local(tmp_path: Path) -> LocalStorage:
    storage = open_storage(str(tmp_path / "store"))
    assert isinstance(storage, LocalStorage)
    return storage


def test_a_mapped_read_gives_what_a_read_gives(tmp_path: Path) -> None:
    storage = _local(tmp_path)
    data = os.urandom(3 << 20) + b"end"
    storage.write("objects/ab/cdef", data)
    storage.write("objects/ab/empty", b"")
    mapped = storage.read_mapped("objects/ab/cdef")
    assert isinstance(mapped, memoryview) and mapped.readonly
    assert bytes(mapped) == storage.read("objects/ab/cdef") == data
    assert storage.read_mapped("objects/ab/empty") == b""  # nothing to map


def test_a_mapped_read_of_a_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    storage = _local(tmp_path)
    with pytest.raises(FileNotFoundError):
        storage.read_mapped("objects/ab/missing")


def test_a_mapped_read_through_an_outward_link_is_refused_as_a_read_is(tmp_path: Path) -> None:
    storage = _local(tmp_path)
    storage.write("objects/ab/cdef", b"inside")
    outside = tmp_path / "outside"
    (outside / "ab").mkdir(parents=True)
    (outside / "ab" / "cdef").write_bytes(b"outside")
    objects = tmp_path / "store" / "objects"
    (objects / "ab" / "cdef").unlink()
    (objects / "ab").rmdir()
    objects.rmdir()
    objects.symlink_to(outside)
    fresh = _local(tmp_path)
    with pytest.raises(IntegrityError, match="symlink") as read:
        fresh.read("objects/ab/cdef")
    with pytest.raises(IntegrityError, match="symlink") as mapped:
        _local(tmp_path).read_mapped("objects/ab/cdef")
    assert str(mapped.value) == str(read.value)


def test_where_files_cannot_be_mapped_a_mapped_read_reads_them(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    storage = _local(tmp_path)
    storage.write("objects/ab/cdef", b"payload")

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(19, "No such device")  # ENODEV: what mmap raises on a file system without it

    monkeypatch.setattr(mmap, "mmap", refuse)
    assert bytes(storage.read_mapped("objects/ab/cdef")) == b"payload"

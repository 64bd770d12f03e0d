"""``Storage.read_start``: the first bytes of a file where a ranged read is not served (issue
45, item 3: the object store read an object's header through ``Storage.fs`` and
``Storage._full`` there, past every check and fault the protocol's methods make)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import inshrink_store as ins
from inshrink_store.cas import ObjectStore
from inshrink_store.layout import object_path
from inshrink_store.object_format import HEADER_SIZE
from inshrink_store.storage import Storage, open_storage
from inshrink_store.testing import FlakyStorage, InjectedStorageError


def test_read_start_gives_the_first_bytes_on_every_backend(store_url: str) -> None:
    storage = open_storage(store_url)
    storage.write("objects/ab/cdef", bytes(range(100)))
    storage.write("objects/ab/short", b"abc")
    assert storage.read_start("objects/ab/cdef", 40) == bytes(range(40))
    assert storage.read_start("objects/ab/short", 40) == b"abc"  # fewer when the file is shorter
    with pytest.raises(FileNotFoundError):
        storage.read_start("objects/ab/missing", 40)


def test_read_start_is_part_of_the_protocol_and_fs_is_not() -> None:
    """The object store needs no filesystem handle: the protocol has no ``fs`` nor ``_full``."""
    assert callable(getattr(Storage, "read_start", None))
    assert "fs" not in Storage.__annotations__ and not hasattr(Storage, "_full")


def test_read_start_refuses_a_symlink_out_of_a_local_store(tmp_path: Path) -> None:
    """A read through a folder linked out of the store is refused, as ``read`` and
    ``read_range`` refuse it (the file handle the object store opened did not check)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "cdef").write_bytes(b"secret" * 10)
    real = tmp_path / "real"
    (real / "objects").mkdir(parents=True)
    os.symlink(outside, real / "objects" / "ab")
    storage = open_storage(str(real))
    with pytest.raises(ins.IntegrityError, match="symlink"):
        storage.read_range("objects/ab/cdef", 0, 40)
    with pytest.raises(ins.IntegrityError, match="symlink"):
        storage.read_start("objects/ab/cdef", 40)


def test_the_header_fallback_goes_through_the_storage(memory_url: str) -> None:
    """Where ranged reads fail, an object's header is read by ``read_start``: a wrapper sees the
    call (and can fail it), and the header read is the same."""
    ins.init(memory_url)
    flaky = FlakyStorage.for_url(memory_url)
    objects = ObjectStore(flaky)
    oid = objects.put(b"some payload, longer than a header " * 4).oid
    header = ObjectStore(open_storage(memory_url)).header(oid)
    flaky.fail("read_range", times=None)
    assert objects.header(oid) == header
    assert flaky.stats.calls["read"] >= 3  # the ranged read, the size, the start of the object
    flaky.fail("read_start", times=1)
    with pytest.raises(InjectedStorageError):
        objects.header(oid)
    assert objects.header(oid) == header
    assert flaky.size(object_path(oid)) > HEADER_SIZE

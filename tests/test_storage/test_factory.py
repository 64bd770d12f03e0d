"""open_storage picks the backend; Storage is a protocol whose capability flags say what each
backend guarantees; and the storage package (the whole package, in fact) has no import cycle.

Before open_storage, ``Storage.__new__`` in storage/base.py picked the backend, so base
imported local, memory and remote, which import base: the package's one import cycle.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from inshrink_store.errors import InvalidInputError
from inshrink_store.storage import (
    FsspecStorage,
    LocalStorage,
    MemoryStorage,
    ObjectStorage,
    Storage,
    open_storage,
)

FLAGS = ("supports_rename", "atomic_create", "listing_consistent")


def _cycles(package: str) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing
    itself) in ``package``'s import graph, as grimp (import-linter's graph) builds it."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph(package, cache_dir=None)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & graph.modules) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:  # Tarjan's algorithm, iterative (no recursion limit)
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(edges[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in edges[node]:
                        found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_the_package_has_no_import_cycle() -> None:
    assert _cycles("inshrink_store") == []


def test_the_cycle_finder_finds_the_cycle_base_had(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: the shape the storage package had (base importing its
    backends inside ``__new__``, the backends importing base) is found."""
    package = tmp_path / f"cyclic_{uuid.uuid4().hex[:8]}"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "base.py").write_text("class Base:\n    def __new__(cls):\n        from . import local\n"
                                     "        return object.__new__(local.Local)\n")
    (package / "local.py").write_text("from .base import Base\n\nclass Local(Base):\n    pass\n")
    (package / "atomic.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cycles(package.name) == [[f"{package.name}.base", f"{package.name}.local"]]


def test_base_imports_no_backend() -> None:
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("inshrink_store", cache_dir=None)
    imported = graph.find_modules_directly_imported_by("inshrink_store.storage.base")
    assert not {m for m in imported if m.startswith("inshrink_store.storage")}


def test_open_storage_picks_the_backend_by_url(tmp_path: Path) -> None:
    assert type(open_storage(str(tmp_path))) is LocalStorage
    assert type(open_storage(str(tmp_path / "not" / "there"))) is LocalStorage  # nothing is created
    assert not (tmp_path / "not").exists()
    assert type(open_storage(f"file://{tmp_path}")) is LocalStorage
    assert type(open_storage(f"memory://factory-{uuid.uuid4().hex}")) is MemoryStorage


def test_open_storage_picks_the_object_store_for_s3_without_connecting() -> None:
    """Building an S3 storage makes no request: an endpoint nothing listens on is fine."""
    pytest.importorskip("s3fs")
    options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "key": "k", "secret": "s"}
    storage = open_storage("s3://bucket/store", options)
    assert type(storage) is ObjectStorage
    assert storage.protocol in ("s3", "s3a") and storage.root == "bucket/store"
    assert storage.storage_options == options  # the caller's, as given (the listings cache is fsspec's)
    assert type(open_storage("s3a://bucket/store", options)) is ObjectStorage


def test_open_storage_refuses_what_no_backend_serves() -> None:
    with pytest.raises(InvalidInputError, match="store URL"):
        open_storage("")
    with pytest.raises(InvalidInputError, match="ftp:// is not supported"):
        open_storage("ftp://host/store")


def test_storage_is_a_protocol_not_a_factory(tmp_path: Path) -> None:
    """``Storage(url)`` picked a backend once; now :func:`open_storage` does, and ``Storage``
    is the type every backend satisfies (checked at run time too)."""
    with pytest.raises(TypeError):
        Storage(str(tmp_path))  # type: ignore[misc]
    for storage in (open_storage(str(tmp_path)), open_storage(f"memory://factory-{uuid.uuid4().hex}")):
        assert isinstance(storage, Storage) and isinstance(storage, FsspecStorage)
    assert not isinstance(object(), Storage)


@pytest.mark.parametrize(("backend", "expected"), [
    (LocalStorage, {"supports_rename": True, "atomic_create": True, "listing_consistent": True, "is_local": True}),
    (MemoryStorage, {"supports_rename": False, "atomic_create": True, "listing_consistent": True, "is_local": False}),
    (ObjectStorage, {"supports_rename": False, "atomic_create": True, "listing_consistent": True, "is_local": False}),
])
def test_capability_flags_per_backend(backend: type[FsspecStorage], expected: dict[str, bool]) -> None:
    assert {name: getattr(backend, name) for name in expected} == expected


def test_the_shared_base_promises_nothing() -> None:
    """A backend that forgets a flag gets the cautious answer, not a guarantee it lacks."""
    assert not any(getattr(FsspecStorage, name) for name in (*FLAGS, "is_local"))


def test_local_writes_go_through_a_rename_and_crashed_ones_are_temp_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``supports_rename`` on a local disk: each write is a temp file renamed into place, so
    a crash can leave a temp file, which ``list`` hides and ``temp_files`` (gc) finds."""
    from inshrink_store.storage import atomic

    renamed: list[str] = []
    real_replace = os.replace

    def replace(src: str, dst: str) -> None:
        renamed.append(os.path.basename(dst))
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    storage = open_storage(str(tmp_path / "s"))
    storage.write("objects/ab/cd", b"x")
    assert renamed == ["cd"]
    (tmp_path / "s" / "objects" / "ab" / "ef.tmp-deadbeef").write_bytes(b"half")
    assert storage.list("") == {"objects/ab/cd": 1}
    assert list(storage.temp_files()) == ["objects/ab/ef.tmp-deadbeef"]


def test_without_rename_there_are_no_temp_files_to_sweep() -> None:
    """A backend whose writes are atomic puts (memory, object stores) makes no temp files:
    ``temp_files`` does not even list (on an object store, a request saved for gc)."""
    storage = open_storage(f"memory://factory-{uuid.uuid4().hex}")
    storage.write("objects/ab/cd", b"x")
    assert storage.temp_files() == {}
    assert storage.list("") == {"objects/ab/cd": 1}


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_listing_consistent_and_atomic_create_hold(kind: str, tmp_path: Path) -> None:
    """What the flags promise, on the backends that run here (S3 and GCS: test_storage.py's
    store_url tests): another handle lists a write the moment it returns, and a second
    exclusive create of one name loses."""
    url = str(tmp_path / "s") if kind == "local" else f"memory://factory-{uuid.uuid4().hex}"
    one, two = open_storage(url), open_storage(url)
    assert one.listing_consistent and one.atomic_create
    assert two.list("refs") == {}
    one.create_exclusive("refs/branches/main/000000000000", b"a")
    assert two.list("refs") == {"refs/branches/main/000000000000": 1}
    with pytest.raises(FileExistsError):
        two.create_exclusive("refs/branches/main/000000000000", b"b")
    assert one.read("refs/branches/main/000000000000") == b"a"

"""One table of URL schemes, in ``storage/`` (issue 45, item 3: "the URL-scheme table only in
storage/"). Before it the schemes were spelled in five places: ``storage/base`` (the supported
ones and the extras), ``storage/__init__`` (the backend per scheme), the CLI (the remote ones,
what a local path is, which cloud settings apply), ``torch/dcp_reader`` (what a local checkpoint
id is), and the readers, writer, ``verify`` and ``diff``, which asked ``protocol == "memory"``
to choose their threads. Now every one of them asks the table, or the ``is_remote`` flag."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from inshrink_store.storage import (
    BACKENDS,
    SCHEMES,
    SUPPORTED_PROTOCOLS,
    LocalStorage,
    MemoryStorage,
    ObjectStorage,
    backend_for,
    local_path,
    open_storage,
    remote_service,
)
from inshrink_store.testing import FlakyStorage

PACKAGE = Path(__file__).resolve().parents[2] / "inshrink_store"


def test_the_table_picks_the_backend_of_every_supported_scheme() -> None:
    assert tuple(SCHEMES) == SUPPORTED_PROTOCOLS == ("file", "local", "memory", "s3", "s3a", "gs", "gcs")
    assert {p: backend_for(f"{p}://bucket/x") for p in SCHEMES} == {
        "file": LocalStorage, "local": LocalStorage, "memory": MemoryStorage,
        "s3": ObjectStorage, "s3a": ObjectStorage, "gs": ObjectStorage, "gcs": ObjectStorage}
    assert backend_for("relative/path") is LocalStorage
    assert backend_for("ftp://host/x") is ObjectStorage  # which refuses it when built
    assert set(BACKENDS) == {s.backend for s in SCHEMES.values()}
    assert {p: s.extra for p, s in SCHEMES.items() if s.extra} == {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


@pytest.mark.parametrize(("url", "path", "service"), [
    ("store", "store", None),
    ("/abs/store", "/abs/store", None),
    ("file:///abs/store", "/abs/store", None),
    ("memory://run", None, None),
    ("s3://bucket/run", None, "s3"),
    ("s3a://bucket/run", None, "s3"),
    ("gs://bucket/run", None, "gcs"),
    ("gcs://bucket/run", None, "gcs"),
    ("ftp://host/run", None, None),
])
def test_what_a_url_names_comes_from_the_table(url: str, path: str | None, service: str | None) -> None:
    assert local_path(url) == path
    assert remote_service(url) == service


def test_only_an_object_store_is_remote(memory_url: str, tmp_path: Path) -> None:
    """Callers choose their threads by ``is_remote`` (not by asking for ``memory``); a wrapper
    keeps its backend's answer."""
    memory, local = open_storage(memory_url), open_storage(str(tmp_path / "s"))
    assert (memory.is_remote, memory.is_local) == (False, False)
    assert (local.is_remote, local.is_local) == (False, True)
    assert ObjectStorage.is_remote and not LocalStorage.is_remote and not MemoryStorage.is_remote
    assert FlakyStorage(memory).is_remote is False


def _scheme_tests(tree: ast.AST) -> list[int]:
    """Lines comparing a URL's scheme (``x.protocol``, ``protocol_of(...)``, a name ``protocol``)
    with a string, or testing it against a literal tuple, list or set of them."""
    def is_scheme(node: ast.expr) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "protocol") or (
            isinstance(node, ast.Name) and node.id == "protocol") or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and "protocol" in node.func.id)

    def is_literal(node: ast.expr) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and any(is_scheme(a) and is_literal(b) for a, b in
                    [(node.left, c) for c in node.comparators] + [(c, node.left) for c in node.comparators])]


def test_no_module_outside_storage_dispatches_on_a_scheme() -> None:
    found = {str(p.relative_to(PACKAGE)): lines for p in sorted(PACKAGE.rglob("*.py"))
             if p.relative_to(PACKAGE).parts[0] != "storage"
             and (lines := _scheme_tests(ast.parse(p.read_text())))}
    assert found == {}, f"scheme tests outside storage/ (ask storage's SCHEMES, local_path, remote_service): {found}"


def test_the_scheme_walk_finds_what_it_looks_for() -> None:
    source = ('a = storage.protocol == "memory"\n'
              'b = protocol in ("s3", "s3a")\n'
              'c = _protocol(url) not in REMOTE\n'  # a named tuple: not a literal, not seen
              'd = "gcs" != protocol_of(url)\n')
    assert _scheme_tests(ast.parse(source)) == [1, 2, 4]

"""Requests against an object store: what reading and saving cost on S3 (moto on 127.0.0.1).

Every request s3fs sends goes through aiobotocore's ``AioEndpoint._send``; the
``count_requests`` fixture wraps it (monkeypatch restores it) and records each request's
method and URL. On an object store a request costs tens of milliseconds, so these pin the
bounds the design promises: one tensor of a large snapshot reads its own tree, not every
tree, and a save with a parent reads the parent's trees once and rewrites none of them.
The whole table is ``benchmarks/bench_requests.py``.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store.index import CACHE
from inshrink_store.layout import tree_path

pytestmark = pytest.mark.s3

READ = "layer7.weight"
#: open + read one tensor from a cold cache: settings, ref listing + ref, snapshot, root
#: tree, the root group's and the tensor's node trees, the chunk object (9 today)
MAX_READ_REQUESTS = 15


class Requests:
    """The requests sent while counting, as (method, URL path, query)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    def add(self, method: str, url: str) -> None:
        parts = urlsplit(url)
        with self._lock:
            self.sent.append((method.upper(), unquote(parts.path), parts.query))

    def by_method(self) -> collections.Counter[str]:
        """GET, PUT, HEAD, DELETE; a GET of a ``list-type=2`` listing counts as LIST."""
        return collections.Counter(
            "LIST" if m == "GET" and "list-type=2" in q.split("&") else m for m, _p, q in self.sent
        )

    def paths(self, method: str, under: str) -> collections.Counter[str]:
        """Requests of ``method`` (not listings) per object path containing ``/under/``."""
        return collections.Counter(
            p for m, p, q in self.sent if m == method and "list-type=2" not in q and f"/{under}/" in p
        )


@pytest.fixture
def count_requests(monkeypatch: pytest.MonkeyPatch) -> Callable[[], contextlib.AbstractContextManager[Requests]]:
    """``with count_requests() as seen:`` records every S3 request sent inside the block."""
    endpoint = pytest.importorskip("aiobotocore.endpoint")

    @contextlib.contextmanager
    def counting() -> Iterator[Requests]:
        seen = Requests()
        original = endpoint.AioEndpoint._send

        async def send(self: Any, request: Any) -> Any:
            seen.add(str(request.method), str(request.url))
            return await original(self, request)

        with monkeypatch.context() as patch:
            patch.setattr(endpoint.AioEndpoint, "_send", send)
            yield seen

    return counting


def _state(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layer{i}.weight": rng.standard_normal((64, 64)).astype(np.float32) for i in range(n)}


def _store_key(path: str, store_url: str) -> str:
    """``/bucket/prefix/trees/ab/cd...`` -> ``trees/ab/cd...``."""
    root = "/" + store_url.split("://", 1)[1].strip("/") + "/"
    assert path.startswith(root), (path, root)
    return path[len(root):]


def test_reading_one_tensor_costs_the_same_few_requests_for_10_or_60_tensors(
    s3_url: str, count_requests: Callable[[], contextlib.AbstractContextManager[Requests]]
) -> None:
    counts = {}
    for n in (10, 60):
        url = f"{s3_url}-{n}"
        state = _state(n, seed=n)
        ins.init(url).save(state, message="v0")
        CACHE.clear()  # as a fresh process sees the store
        with count_requests() as seen:
            got = ins.open(url).checkout("main")[READ][...]
        np.testing.assert_array_equal(got, state[READ])
        counts[n] = seen.by_method()
        assert sum(counts[n].values()) <= MAX_READ_REQUESTS, (n, counts[n], seen.sent)
        assert counts[n]["PUT"] == counts[n]["DELETE"] == 0, counts[n]  # a read writes nothing
    assert counts[10] == counts[60], counts


def test_a_save_with_a_parent_reads_each_parent_tree_once_and_rewrites_none(
    tree_files: None, s3_url: str, count_requests: Callable[[], contextlib.AbstractContextManager[Requests]]
) -> None:
    state = _state(30)
    repo = ins.init(s3_url)
    repo.save(state, message="v0")
    parent_trees = set(repo._storage.list("trees"))
    assert len(parent_trees) == 32  # root, root group, 30 tensors
    changed = {**state, READ: state[READ] + np.float32(1)}

    CACHE.clear()  # the parent's trees are read from storage, not from this process's cache
    with count_requests() as seen:
        info = repo.save(changed, message="v1")

    tree_reads = {_store_key(p, s3_url): n for p, n in seen.paths("GET", "trees").items()}
    assert max(tree_reads.values()) == 1, {p: n for p, n in tree_reads.items() if n > 1}
    tree_writes = {_store_key(p, s3_url): n for p, n in seen.paths("PUT", "trees").items()}
    assert not set(tree_writes) & parent_trees, sorted(set(tree_writes) & parent_trees)
    # what is written is exactly what is new: the changed tensor's node tree and the root
    new_root = ins.open(s3_url).checkout(info.id).index.root
    assert set(tree_writes) == {tree_path(info.root), tree_path(new_root.nodes[READ])}, tree_writes
    assert max(tree_writes.values()) == 1, tree_writes
    np.testing.assert_array_equal(ins.open(s3_url).checkout("main")[READ][...], changed[READ])


def test_saving_an_unchanged_state_writes_no_tree(
    s3_url: str, count_requests: Callable[[], contextlib.AbstractContextManager[Requests]]
) -> None:
    state = _state(5)
    repo = ins.init(s3_url)
    first = repo.save(state, message="v0")
    with count_requests() as seen:
        again = repo.save(state, message="v1")
    assert again.root == first.root
    assert not seen.paths("PUT", "trees"), sorted(seen.paths("PUT", "trees"))


def test_a_save_right_after_a_save_reads_no_tree_back(
    tree_files: None, s3_url: str, count_requests: Callable[[], contextlib.AbstractContextManager[Requests]]
) -> None:
    """The trees a commit wrote seed the process's index: the next save (whose parent they
    are) reads none of them from the object store."""
    state = _state(20)
    repo = ins.init(s3_url)
    repo.save(state, message="v0")
    state["layer7.weight"] = state["layer7.weight"] + 1
    with count_requests() as seen:
        repo.save(state, message="v1")
    got, put = seen.paths("GET", "trees"), seen.paths("PUT", "trees")
    # the only tree asked about is the changed tensor's new one (is it there? no: write it)
    assert len(put) == 2 and len(got) == 1 and set(got) <= set(put), (got, put)


def test_small_tensors_keep_their_nodes_in_the_root_tree(
    s3_url: str, count_requests: Callable[[], contextlib.AbstractContextManager[Requests]]
) -> None:
    """A tensor of a few chunks has no tree object of its own: its node lives in the root
    tree, so a save of N such tensors PUTs N chunk objects and one tree (the root), a save
    with a parent GETs one tree (the parent's root), and reading a tensor GETs one tree."""
    state = _state(30)
    repo = ins.init(s3_url)
    with count_requests() as seen:
        info = repo.save(state, message="v0")
    assert len(seen.paths("PUT", "trees")) == 1, seen.paths("PUT", "trees")
    assert list(repo._storage.list("trees")) == [tree_path(info.root)]
    changed = {**state, READ: state[READ] + np.float32(1)}
    CACHE.clear()
    with count_requests() as seen:
        second = repo.save(changed, message="v1")
    assert len(seen.paths("GET", "trees")) == 1 and len(seen.paths("PUT", "trees")) == 1
    CACHE.clear()
    with count_requests() as seen:
        got = ins.open(s3_url).checkout(second.id)[READ][...]
    np.testing.assert_array_equal(got, changed[READ])
    assert len(seen.paths("GET", "trees")) == 1, seen.paths("GET", "trees")
    with count_requests() as seen:  # right after a save, its root is known: no tree read back
        ins.open(s3_url).save({**changed, READ: changed[READ] + np.float32(1)}, message="v2")
    assert not seen.paths("GET", "trees") and len(seen.paths("PUT", "trees")) == 1

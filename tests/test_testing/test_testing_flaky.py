"""FlakyStorage (inshrink_store.testing.flaky): its faults are the ones asked for, no more,
the same ones for the same seed, and a store reached through it works when no rule fires."""

from __future__ import annotations

import contextlib
import pickle
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store.errors import InvalidInputError, StorageError
from inshrink_store.storage import Storage
from inshrink_store.testing import (
    FlakyStorage,
    InjectedFault,
    InjectedOSError,
    InjectedStorageError,
)


@pytest.fixture
def flaky(memory_url: str) -> FlakyStorage:
    ins.init(memory_url)
    return FlakyStorage.for_url(memory_url)


def test_is_a_storage_with_the_inner_capabilities(flaky: FlakyStorage) -> None:
    assert isinstance(flaky, Storage)
    for name in ("url", "root", "protocol", "is_local", "supports_rename", "atomic_create", "listing_consistent"):
        assert getattr(flaky, name) == getattr(flaky.inner, name)
    with pytest.raises(InvalidInputError, match="FlakyStorage"):
        FlakyStorage(flaky)  # type: ignore[arg-type]


def test_transient_fault_fails_the_next_n_matching_calls_only(flaky: FlakyStorage) -> None:
    flaky.write("a/x", b"1")
    flaky.write("b/x", b"2")
    rule = flaky.fail("read", "a/*", times=2)
    assert flaky.read("b/x") == b"2"  # another path: untouched
    for _ in range(2):
        with pytest.raises(InjectedStorageError) as caught:
            flaky.read("a/x")
        assert isinstance(caught.value, StorageError) and isinstance(caught.value, InjectedFault)
        assert (caught.value.op, caught.value.path) == ("read", "a/x")
    assert flaky.read("a/x") == b"1"  # spent
    assert rule.injected == 2 and rule.times == 0
    assert flaky.stats.faults == {"read": 2, "write": 0, "list": 0, "delete": 0}
    assert flaky.stats.calls["read"] == 4 and flaky.stats.calls["write"] == 2
    assert [(i.op, i.path) for i in flaky.injected] == [("read", "a/x"), ("read", "a/x")]


def test_a_kind_covers_its_methods_and_a_method_only_itself(flaky: FlakyStorage) -> None:
    flaky.write("f", b"abc")
    flaky.fail("read", times=None)
    for call in (lambda: flaky.read("f"), lambda: flaky.read_range("f", 0, 1), lambda: flaky.size("f"),
                 lambda: flaky.exists("f"), lambda: flaky.exists_durably("f")):
        with pytest.raises(InjectedStorageError):
            call()
    flaky.clear()
    flaky.fail("read_range", times=None)
    assert flaky.read("f") == b"abc"
    with pytest.raises(InjectedStorageError):
        flaky.read_range("f", 0, 2)


def test_permanent_fault_lasts_until_cleared(flaky: FlakyStorage) -> None:
    flaky.write("refs/x", b"1")
    flaky.fail("list", "refs*", times=None, error="os")
    for _ in range(5):
        with pytest.raises(InjectedOSError) as caught:
            flaky.list("refs")
        assert not isinstance(caught.value, StorageError) and isinstance(caught.value, OSError)
    assert flaky.list("objects") == {}  # another prefix
    flaky.clear()
    assert flaky.list("refs") == {"refs/x": 1}
    assert flaky.stats.faults["list"] == 5


def test_after_faults_take_effect_then_raise(flaky: FlakyStorage) -> None:
    flaky.fail("create_exclusive", "c", when="after")
    with pytest.raises(InjectedStorageError):
        flaky.create_exclusive("c", b"x")
    assert flaky.inner.read("c") == b"x"  # it happened: an ambiguous outcome
    flaky.fail("delete", "c", when="after")
    with pytest.raises(InjectedStorageError):
        flaky.delete("c")
    assert not flaky.inner.exists("c")
    with pytest.raises(InvalidInputError, match="when='after'"):
        flaky.fail("read", when="after")


def test_never_fakes_an_answer(flaky: FlakyStorage) -> None:
    """Missing files and lost exclusive creates are the inner storage's own answers."""
    with pytest.raises(FileNotFoundError):
        flaky.read("nothing")
    flaky.create_exclusive("once", b"1")
    with pytest.raises(FileExistsError):
        flaky.create_exclusive("once", b"2")


def test_bad_rules_are_refused(flaky: FlakyStorage) -> None:
    with pytest.raises(InvalidInputError, match="op"):
        flaky.fail("rename")
    with pytest.raises(InvalidInputError, match="times"):
        flaky.fail("read", times=0)
    with pytest.raises(InvalidInputError, match="error"):
        flaky.fail("read", error="timeout")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="probability"):
        flaky.fail_randomly(1.5)


def _random_run(url: str, seed: int, threads: int) -> list[tuple[str, str, str]]:
    flaky = FlakyStorage.for_url(url)
    flaky.fail_randomly(0.3, seed=seed, ops=("read", "write"))
    paths = [f"p/{i}" for i in range(40)]

    def work(path: str) -> None:
        for _ in range(3):
            with contextlib.suppress(StorageError):
                flaky.write(path, b"x")
            with contextlib.suppress(StorageError, FileNotFoundError):
                flaky.read(path)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, paths))
    return sorted((i.op, i.path, i.when) for i in flaky.injected)


def test_seeded_random_faults_are_the_same_whatever_the_thread_order(memory_url: str) -> None:
    ins.init(memory_url)
    first = _random_run(memory_url, seed=7, threads=1)
    assert 20 < len(first) < 160  # about 0.3 of 240 calls
    assert _random_run(memory_url, seed=7, threads=8) == first
    assert _random_run(memory_url, seed=8, threads=1) != first


def test_probability_zero_and_one(flaky: FlakyStorage) -> None:
    flaky.write("z", b"1")
    flaky.fail_randomly(0.0)
    assert all(flaky.read("z") == b"1" for _ in range(50))
    flaky.clear()
    flaky.fail_randomly(1.0, ops=("delete",))
    with pytest.raises(InjectedStorageError):
        flaky.delete("z")


def test_paused_counts_nothing_and_fails_nothing(flaky: FlakyStorage) -> None:
    flaky.fail("read", times=None)
    with flaky.paused():
        assert not flaky.enabled
        assert flaky.read("inshrink.json")
    assert flaky.enabled
    assert flaky.stats.calls["read"] == 0
    with pytest.raises(InjectedStorageError):
        flaky.read("inshrink.json")


def test_a_repository_through_it_works_with_faults_off(store_url: str) -> None:
    ins.init(store_url)
    flaky = FlakyStorage.for_url(store_url)
    repo = ins.Repository(flaky)
    w = np.arange(600, dtype=np.float32).reshape(20, 30) / 7
    first = repo.save({"w": w}, message="one")
    repo.save({"w": w + 1}, message="two")
    repo.tag("t", first.id)
    repo.create_branch("dev", "main~1")
    np.testing.assert_array_equal(repo.load("t")["w"], w)
    np.testing.assert_array_equal(repo.load("main")["w"], w + 1)
    repo.gc(keep_last=1)
    assert repo.verify().ok
    assert flaky.stats.total_faults == 0
    assert {"read", "write", "list", "delete"} <= {k for k, n in flaky.stats.calls.items() if n}
    # the same store, opened afresh without the wrapper, reads the same
    np.testing.assert_array_equal(ins.open(store_url).load("t")["w"], w)


def test_a_failed_read_is_an_error_not_a_wrong_answer(memory_url: str) -> None:
    ins.init(memory_url)
    flaky = FlakyStorage.for_url(memory_url)
    repo = ins.Repository(flaky)
    w = np.linspace(-1, 1, 256, dtype=np.float32)
    repo.save({"w": w})
    flaky.fail("read", "objects/*", times=None)
    fresh = ins.Repository(flaky)
    with pytest.raises(StorageError):
        fresh.load("main")
    flaky.clear()
    np.testing.assert_array_equal(fresh.load("main")["w"], w)


def test_pickles_with_its_rules(flaky: FlakyStorage) -> None:
    flaky.fail("read", "x", times=3)
    copy = pickle.loads(pickle.dumps(flaky))
    assert copy.rules[0].times == 3 and copy.url == flaky.url

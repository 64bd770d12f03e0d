"""A memory store lists while other threads write. fsspec's own walk of the live dict can fail
with "dictionary changed size during iteration" (rarely: it failed one clean-clone CI run, in
tests/test_repository/test_gc_leases.py, where a gc beside a writer then stopped)."""

from __future__ import annotations

import threading
import uuid

from inshrink_store.storage import open_storage


def _race(list_files) -> list[BaseException]:  # type: ignore[no-untyped-def]
    storage = open_storage(f"memory://listing-{uuid.uuid4().hex}")
    errors: list[BaseException] = []
    done = threading.Event()

    def writer() -> None:
        for i in range(20_000):
            storage.write(f"objects/{i:05d}", b"x")
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    while not done.is_set():
        try:
            listed = list_files(storage)
            assert all(size == 1 for size in listed.values())
        except RuntimeError as exc:  # what fsspec's walk raises
            errors.append(exc)
        except Exception as exc:  # noqa: BLE001 - the StorageError that wraps it
            errors.append(exc)
    thread.join()
    return errors


def test_listing_beside_a_writer_never_fails() -> None:
    assert _race(lambda storage: storage.list("objects")) == []


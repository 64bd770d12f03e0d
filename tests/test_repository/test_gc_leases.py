"""gc beside writers: leases keep a gc from deleting what an in-flight commit writes.

Without leases, gc sees an in-flight commit's objects as unreachable (its ref does not
exist yet) and deletes them; the commit then lands a version whose chunks are gone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store import leases


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"model/w": rng.standard_normal((64, 64)).astype(np.float32), "step": np.array(seed)}


def test_gc_refuses_while_a_commit_is_in_progress(store_url: str) -> None:
    repo = ins.open(store_url, create=True)
    repo.save(_state(0), message="v0")
    tx = repo.transaction("main")
    tx.write(_state(1))  # objects written, not reachable yet
    before = repo.storage.list("")
    with pytest.raises(ins.ConflictError, match="writer lease"):
        repo.gc()
    assert repo.storage.list("") == before  # nothing deleted, no gc lease left behind
    info = tx.commit(message="v1")
    assert repo.gc().deleted["objects"] == []
    assert repo.verify().ok
    np.testing.assert_array_equal(repo.load(info.id)["model/w"], _state(1)["model/w"])
    assert leases.writers(repo.storage) == []


def test_a_commit_refuses_while_gc_holds_its_lease(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    head = repo.save(_state(0)).id
    leases.acquire_gc(repo.storage)
    before = repo.storage.list("")
    with pytest.raises(ins.ConflictError, match="gc lease"):
        repo.save(_state(1))
    assert repo.storage.list("") == before  # refused before writing anything
    assert repo.resolve("main") == head
    leases.release(repo.storage, leases.GC_LEASE)
    assert repo.save(_state(1)).parent == head


def test_only_one_gc_at_a_time(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    repo.save(_state(0))
    leases.acquire_gc(repo.storage)
    with pytest.raises(ins.ConflictError, match="other gc"):
        repo.gc()
    assert repo.storage.exists(leases.GC_LEASE)  # the first gc's lease is untouched


def _old_lease(repo: ins.Repository, path: str, age: float) -> None:
    doc = {"created": time.time() - age, "host": "dead-host", "pid": 1}
    repo.storage.write(path, json.dumps(doc).encode())


def test_dead_processes_leases_expire(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    repo.save(_state(0))
    _old_lease(repo, f"{leases.WRITERS}/00000000000000000001-dead", age=7200)
    report = repo.gc()
    assert report.deleted["leases"] == [f"{leases.WRITERS}/00000000000000000001-dead"]
    assert leases.writers(repo.storage) == []
    _old_lease(repo, leases.GC_LEASE, age=7200)  # a gc that died
    repo.save(_state(1))  # writers ignore it
    repo.gc()  # and a new gc replaces it
    assert not repo.storage.exists(leases.GC_LEASE)


def test_a_failed_save_releases_its_lease(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    with pytest.raises(ins.FormatError):
        repo.save({"bad/../name": np.zeros(2, np.float32)})
    assert leases.writers(repo.storage) == []
    repo.gc()


def test_cli_gc_exit_1_names_the_writer_and_stale_after_zero_overrides(local_url: str) -> None:
    repo = ins.open(local_url, create=True)
    repo.save(_state(0))
    tx = repo.transaction("main")  # a writer that will never finish
    cli = [sys.executable, "-m", "inshrink_store._cli", "gc", local_url]
    refused = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1
    assert tx.lease is not None and tx.lease.split("/")[-1] in refused.stderr.replace("\n", "")
    forced = subprocess.run([*cli, "--stale-after", "0"], capture_output=True, text=True, timeout=120)
    assert forced.returncode == 0, forced.stderr
    assert leases.writers(repo.storage) == []


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_gc_looping_beside_a_writer_never_breaks_a_version(backend: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(f"{backend}_url")
    repo = ins.open(url, create=True)
    repo.save(_state(0), message="v0")
    done = threading.Event()
    errors: list[BaseException] = []
    runs = {"gc": 0, "refused": 0}

    def collector() -> None:
        handle = ins.open(url)
        while not done.is_set():
            try:
                handle.gc(keep_last=2)
                runs["gc"] += 1
            except ins.ConflictError:
                runs["refused"] += 1
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return
            time.sleep(0.002)  # a periodic gc, not a busy loop that starves the writer

    thread = threading.Thread(target=collector)
    thread.start()
    committed = []
    try:
        for step in range(1, 13):
            for _ in range(500):  # a commit refused because gc runs is retried, as a user would
                try:
                    committed.append(repo.save(_state(step), message=f"v{step}").id)
                    break
                except ins.ConflictError:
                    time.sleep(0.002)
    finally:
        done.set()
        thread.join()
    assert not errors, errors
    assert len(committed) == 12 and runs["gc"] + runs["refused"] > 0
    final = ins.open(url)
    assert final.verify().ok
    for sid in final.log()[:2]:
        loaded = final.load(sid.id)
        np.testing.assert_array_equal(loaded["model/w"], _state(int(loaded["step"]))["model/w"])

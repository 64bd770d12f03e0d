"""gc beside writers, tags and other gc runs: leases, fences and renewals.

Without leases, gc sees an in-flight commit's objects as unreachable (its ref does not
exist yet) and deletes them; the commit then lands a version whose chunks are gone.
These tests pin the protocol of leases.py: every lease file is its holder's alone,
liveness comes from the holder's process (same machine) or from renewals watched on
the watcher's own clock, and a gc that judges a writer dead can only fence it off.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store import leases
from tests.test_repository._clock import FakeClock


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"model/w": rng.standard_normal((64, 64)).astype(np.float32), "step": np.array(seed)}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(leases, "CLOCK", fake)
    monkeypatch.setattr(leases.HeldLease, "keep_alive", lambda self, every=0: self)  # no threads
    return fake


def _foreign_lease(repo: ins.Repository, prefix: str, token: str, *, count: int = 0,
                   renewed_ago: float = 0.0, kind: str = "gc") -> str:
    """A lease held by a process on another machine (its pid means nothing here)."""
    path = f"{prefix}/{token}"
    doc = {"token": token, "kind": kind, "host": "elsewhere", "node": "elsewhere:boot:ns", "pid": 4242,
           "started": None, "created": leases.CLOCK.wall() - renewed_ago,
           "renewed": leases.CLOCK.wall() - renewed_ago, "count": count}
    repo._storage.write(path, json.dumps(doc).encode())
    return path


def test_gc_refuses_while_a_commit_is_in_progress(store_url: str) -> None:
    repo = ins.open(store_url, create=True)
    repo.save(_state(0), message="v0")
    tx = repo.transaction("main")
    tx.write(_state(1))  # objects written, not reachable yet
    before = repo._storage.list("")
    with pytest.raises(ins.ConflictError, match="writer lease"):
        repo.gc()
    assert repo._storage.list("") == before  # nothing deleted, no gc lease left behind
    info = tx.commit(message="v1")
    assert repo.gc().deleted["objects"] == []
    assert repo.verify().ok
    np.testing.assert_array_equal(repo.load(info.id)["model/w"], _state(1)["model/w"])
    assert leases.writers(repo._storage) == []


def test_a_commit_waits_then_refuses_while_gc_runs(memory_url: str, clock: FakeClock) -> None:
    repo = ins.open(memory_url, create=True)
    head = repo.save(_state(0)).id
    gc = repo.garbage_collector(keep_alive=False)
    gc.start()
    before = repo._storage.list("")
    with pytest.raises(ins.GcRunningError, match="gc running"):
        repo.save(_state(1), gc_wait=0)
    assert repo._storage.list("") == before  # refused before writing anything
    assert repo.resolve("main") == head
    gc.finish()
    assert repo.save(_state(1), gc_wait=0).parent == head


def test_second_gc_refuses_and_never_touches_the_first_gcs_lease(memory_url: str, clock: FakeClock) -> None:
    """Regression: a second gc deleted the first's lease (on a failed read, and on release),
    so the first ran unprotected and deleted a commit made meanwhile."""
    repo = ins.open(memory_url, create=True)
    repo.save(_state(0))
    first = repo.garbage_collector(keep_alive=False)
    first.start()
    with pytest.raises(ins.ConflictError, match="other gc"):
        repo.gc()
    assert repo._storage.exists(first.lease.path)  # untouched by the refused gc
    with pytest.raises(ins.GcRunningError):
        repo.save(_state(1), gc_wait=0)  # still protects writers
    first.mark()
    first.sweep()
    first.finish()
    assert leases.gc_runs(repo._storage) == []


def test_an_unreadable_gc_lease_is_never_deleted_for_being_unreadable(memory_url: str, clock: FakeClock) -> None:
    repo = ins.open(memory_url, create=True)
    repo.save(_state(0))
    torn = f"{leases.GC}/00000000000000001-torn"
    repo._storage.write(torn, b"\x00not json")
    with pytest.raises(ins.ConflictError, match="other gc"):
        repo.gc()
    with pytest.raises(ins.GcRunningError):
        repo.save(_state(1), gc_wait=0)
    assert repo._storage.read(torn) == b"\x00not json"


def test_a_long_gc_keeps_protecting_writers_whatever_its_wall_age(memory_url: str, clock: FakeClock) -> None:
    """Regression: a gc older than the stale bound (long run, or clock skew) stopped
    protecting writers. Renewals, not ages, say a gc is alive."""
    repo = ins.open(memory_url, create=True)
    repo.save(_state(0))
    gc = repo.garbage_collector(keep_alive=False)
    gc.start()
    for _ in range(50):  # 50 x 5 s of renewals: far past any wall-clock bound
        clock.sleep(5)
        gc.lease.renew()
    assert gc.lease.valid()
    with pytest.raises(ins.GcRunningError):
        repo.save(_state(1), gc_wait=10)  # waits 10 s of renewals: still alive
    gc.finish()


def test_a_dead_remote_gc_is_recognised_after_expiry_without_renewal(memory_url: str, clock: FakeClock) -> None:
    repo = ins.open(memory_url, create=True)
    head = repo.save(_state(0)).id
    path = _foreign_lease(repo, leases.GC, "00000000000000002-dead-remote", count=7)
    with pytest.raises(ins.GcRunningError):
        repo.save(_state(1), gc_wait=leases.EXPIRY / 2)  # not long enough to judge it
    messages: list[str] = []
    info = repo.save(_state(1), gc_wait=2 * leases.EXPIRY, on_wait=messages.append)
    assert info.parent == head and messages and "waiting for gc" in messages[0]
    token = path.rsplit("/", 1)[-1]
    assert repo._storage.exists(f"{leases.BROKEN}/{token}")  # marked, so nobody waits again
    repo.save(_state(2), gc_wait=0)
    report = repo.gc()
    assert path in report.deleted["leases"] and not repo._storage.exists(path)


def test_a_paused_gc_stops_once_its_lease_lapsed(memory_url: str, clock: FakeClock) -> None:
    """The gc a writer judged dead may only have been paused: it must not delete anything
    when it wakes up, since the writer went ahead meanwhile."""
    repo = ins.open(memory_url, create=True)
    repo.save(_state(0))
    tx = repo.transaction("main")
    tx.write(_state(1))
    tx.abort()  # garbage for the gc to find
    gc = repo.garbage_collector(keep_alive=False)
    gc.start()
    report = gc.mark()
    assert report.deleted["objects"]
    # the gc process stalls; a writer watches its lease go unrenewed, breaks it and commits
    info = repo.save(_state(2), gc_wait=3 * leases.EXPIRY)
    before = repo._storage.list("")
    with pytest.raises(ins.ConflictError, match="lapsed"):
        gc.sweep()
    assert repo._storage.list("") == before  # deleted nothing
    gc.finish()  # which removes only its own lease file
    assert set(before) - set(repo._storage.list("")) == {gc.lease.path}
    np.testing.assert_array_equal(repo.load(info.id)["model/w"], _state(2)["model/w"])
    assert repo.verify().ok


def test_a_writer_judged_dead_cannot_publish(memory_url: str, clock: FakeClock) -> None:
    """A live writer whose lease looks stale (clock skew between hosts, a long pause) is
    fenced off by gc: its commit fails cleanly, and every committed version survives."""
    repo = ins.open(memory_url, create=True)
    head = repo.save(_state(0)).id
    tx = repo.transaction("main")
    tx.write(_state(1))
    clock.now += leases.STALE_AFTER + 1  # its renewal looks old by gc's wall clock
    report = repo.gc()
    assert tx.lease is not None and tx.lease.path in report.deleted["leases"]
    fence = f"{leases.FENCES}/{tx.lease.token}"
    assert fence not in report.deleted["leases"] and repo._storage.exists(fence)  # what stops it
    with pytest.raises(ins.LeaseBrokenError, match="nothing was published"):
        tx.commit(message="too late")
    tx.abort()
    assert repo.resolve("main") == head and repo.verify().ok
    assert repo.save(_state(1)).parent == head  # a retry works


def test_a_publishing_writer_is_never_broken(memory_url: str, clock: FakeClock) -> None:
    repo = ins.open(memory_url, create=True)
    repo.save(_state(0))
    tx = repo.transaction("main")
    tx.write(_state(1))
    leases.fence_for_commit(repo._storage, tx.lease)  # the writer is between fence and ref
    with pytest.MonkeyPatch.context() as skewed:  # gc's clock says the writer is ancient
        skewed.setattr(leases.Lease, "wall_age", lambda self: leases.STALE_AFTER + 1)
        with pytest.raises(ins.ConflictError, match="writer lease"):
            repo.gc()
    info = tx.commit(message="v1")
    assert repo.gc().deleted["objects"] == []
    np.testing.assert_array_equal(repo.load(info.id)["model/w"], _state(1)["model/w"])


def test_a_stalled_writer_does_not_publish_and_a_watching_gc_goes_on(memory_url: str, clock: FakeClock) -> None:
    """A writer that fenced ``commit`` and then stalled past its lease: a gc that watched it
    go unrenewed for the expiry takes it for dead, and the writer, waking up, must not
    publish (its own clock says its lease lapsed)."""
    repo = ins.open(memory_url, create=True)
    head = repo.save(_state(0)).id
    tx = repo.transaction("main")
    tx.write(_state(1))
    leases.fence_for_commit(repo._storage, tx.lease)
    report = repo.gc(wait=2 * leases.EXPIRY)  # watches it; the fake clock advances as gc waits
    assert tx.lease is not None and tx.lease.path in report.deleted["leases"]
    assert report.deleted["objects"]  # the stalled writer's objects were garbage
    with pytest.raises(ins.LeaseBrokenError, match="lapsed"):
        tx.commit(message="woke up too late")
    tx.abort()
    assert repo.resolve("main") == head and repo.verify().ok


def test_a_killed_gc_on_this_machine_blocks_no_commit(memory_url: str, local_url: str, clock: FakeClock) -> None:
    """Regression: a kill -9'd gc blocked every commit for an hour. Its process is gone,
    which this machine can tell at once: the commit neither waits for it nor watches it
    expire (no time passes on the protocol's clock), whatever the machine's load; it once
    asserted under 10 s of wall clock instead, which a loaded machine could miss."""
    repo = ins.open(local_url, create=True)
    head = repo.save(_state(0)).id
    code = (
        "import sys, time; from inshrink_store import leases; from inshrink_store.storage import open_storage\n"
        "held, _ = leases.acquire_gc(open_storage(sys.argv[1])); print(held.path, flush=True); time.sleep(600)\n"
    )
    # the child sleeps far longer than the test can take (it is killed): alive while refused
    # (as a context manager: its stdout pipe is closed when done, not left to the collector)
    with subprocess.Popen([sys.executable, "-c", code, local_url], stdout=subprocess.PIPE, text=True) as child:
        try:
            path = child.stdout.readline().strip()
            assert path.startswith(leases.GC)
            with pytest.raises(ins.GcRunningError):
                repo.save(_state(1), gc_wait=0)  # alive: refused
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
        finally:
            child.kill()
            child.wait()
    waits: list[str] = []
    before = clock.now
    assert repo.save(_state(1), gc_wait=0, on_wait=waits.append).parent == head  # dead: at once
    assert waits == [] and clock.now == before  # judged by its process, not by a watched expiry
    assert path in repo.gc().deleted["leases"]


def test_tags_and_branches_are_published_like_commits(memory_url: str, clock: FakeClock) -> None:
    """Regression: a tag created during gc could name a snapshot gc was deleting."""
    repo = ins.open(memory_url, create=True)
    first = repo.save(_state(0)).id
    repo.save(_state(1))
    repo.save(_state(2))
    gc = repo.garbage_collector(keep_last=1, keep_alive=False)
    gc.start()
    with pytest.raises(ins.GcRunningError):
        repo.tag("old", first, gc_wait=0)
    with pytest.raises(ins.GcRunningError):
        repo.create_branch("old", first, gc_wait=0)
    gc.mark()
    gc.sweep()
    gc.finish()
    with pytest.raises(ins.NotFoundError):
        repo.tag("old", first)  # gone now: refused, not a dangling tag
    assert "old" not in repo.tags() and repo.verify().ok


def test_dangling_refs_are_reported_and_tags_can_be_deleted(memory_url: str) -> None:
    """Regression: one ref naming a deleted snapshot made every later gc fail, and there was
    no way to delete a tag."""
    repo = ins.open(memory_url, create=True)
    sid = repo.save(_state(0)).id
    repo.save(_state(1))
    repo.tag("best", sid)
    repo._storage.delete(f"snapshots/{sid}")  # what a hand-edited or half-restored store looks like
    report = repo.gc()
    assert f"tag best -> {sid} (snapshot missing)" in report.dangling  # (and main's first ref file)
    assert repo.delete_tag("best") == sid
    assert repo.gc().dangling == [] and "best" not in repo.tags()
    with pytest.raises(ins.NotFoundError, match="no such tag"):
        repo.delete_tag("best")


def test_delete_branch(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    repo.save(_state(0))
    dev = repo.create_branch("dev")
    repo.save(_state(1), branch="dev")
    assert repo.delete_branch("dev") != dev and "dev" not in repo.branches()
    assert not repo._storage.list("refs/branches/dev")
    report = repo.gc()
    assert len(report.deleted["snapshots"]) == 1  # dev's own version; main's stays
    with pytest.raises(ins.NotFoundError, match="no such branch"):
        repo.delete_branch("dev")


def test_a_failed_save_releases_its_lease(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    with pytest.raises(ins.FormatError):
        repo.save({"bad/../name": np.zeros(2, np.float32)})
    assert leases.writers(repo._storage) == []
    repo.gc()


def test_cli_gc_exit_1_names_the_writer(local_url: str) -> None:
    repo = ins.open(local_url, create=True)
    repo.save(_state(0))
    tx = repo.transaction("main")  # a writer in this (live) process
    cli = [sys.executable, "-m", "inshrink_store._cli", "gc", local_url]
    # timeouts: a generous limit that only stops a hang (the CLI's gc takes seconds)
    refused = subprocess.run(cli, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 1
    assert tx.lease is not None and tx.lease.token in refused.stderr.replace("\n", "")
    assert "Traceback" not in refused.stderr
    tx.abort()
    done = subprocess.run(cli, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert leases.writers(repo._storage) == []


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
            committed.append(repo.save(_state(step), message=f"v{step}").id)  # waits out each gc
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

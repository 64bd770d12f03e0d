"""Leases and fences: how gc and any number of writers share a store without losing a version.
Layer: objects and leases (``cas`` | ``leases``), under everything that stores or deletes.

A commit writes objects, trees and a snapshot first and makes them reachable last (the
ref). To gc, everything before that moment looks unreachable, and a chunk a writer
skipped because an old version already stored it may be exactly what gc is deleting.
So writers and gc runs announce themselves with leases, and the one place where a
wrong guess about another process could lose data is guarded by a *fence* that two
parties race to create with exclusive create, the one atomic step every backend has.

Files (every one has a random token in its name, so no process ever deletes or
overwrites another's file by accident — the flaw that let two gc runs destroy data):

- ``leases/writers/<token>``: a commit (or tag/branch creation) in progress.
- ``leases/fences/<token>``: created exclusively, either by that writer just before it
  publishes its ref (``commit``) or by a gc that judged the writer dead (``broken``).
  Whoever creates it first wins: a broken writer never publishes, and a gc that loses
  the race knows the writer is alive.
- ``leases/gc/<token>``: a gc run. Renewed (a counter rewritten) every few seconds while
  it runs; gc stops deleting as soon as its own last renewal is older than a third of
  the expiry *by its own monotonic clock*, and a lapsed lease is never renewed again.
- ``leases/broken/<token>``: a writer judged that gc dead; the gc, if it was only
  paused, sees the marker (or its own expired renewal) and stops.

Liveness judgements never compare two hosts' clocks for safety:

- same machine (hostname, boot id and pid namespace all equal): the process is gone
  (``kill(pid, 0)`` fails, or the pid now belongs to a process started at another time);
- anywhere: the lease's renewal counter did not change while *this* process watched it
  for ``EXPIRY`` seconds of its own monotonic clock;
- for writer leases only, also a hint: the lease says it was last renewed more than
  ``stale_after`` seconds ago by this host's wall clock. A wrong hint cannot lose data,
  because breaking a writer goes through its fence; it only makes that writer's commit
  fail with :class:`LeaseBrokenError` (nothing published, safe to retry).

The full argument is in docs/reference/format.md ("Why gc never loses a version").
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from inshrink_store.errors import ConflictError, GcRunningError, LeaseBrokenError
from inshrink_store.layout import BROKEN_MARKERS, FENCES, GC_LEASES, WRITER_LEASES, lease_token

WRITERS, FENCES, GC, BROKEN = WRITER_LEASES, FENCES, GC_LEASES, BROKEN_MARKERS

RENEW_EVERY = 5.0  # seconds between renewals of a held lease
EXPIRY = 30.0  # a lease seen unrenewed this long (watcher's own clock) is dead
STALE_AFTER = 300.0  # writer leases: wall-clock hint that the writer died (fenced, so safe)
FENCE_COMMIT = b"commit"
FENCE_BROKEN = b"broken"


class Clock:
    """Time and sleep, in one place so tests can run the protocol on a fake clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


CLOCK: Clock = Clock()
_SERIAL = itertools.count()  # orders tokens made in one microsecond by one process


# -- who is running where --------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _node() -> str:
    """This machine and pid namespace: a pid is only meaningful inside both.

    Containers can share a hostname (``--network host``) but not a pid namespace, and two
    boots of one host share a hostname but not a boot id; an empty string means "unknown"
    and turns the pid check off for leases of this process.
    """
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id",):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            return ""
    try:
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        return ""
    return f"{socket.gethostname()}:{':'.join(parts)}"


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), to tell pid reuse apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def _process_gone(node: str, pid: int, started: str | None) -> bool:
    """True only when certain: same machine and pid namespace, and that process is gone."""
    if not node or node != _node() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    now_started = _start_time(pid)
    return started is not None and now_started is not None and now_started != started


# -- leases as others see them ---------------------------------------------------------
@dataclass(frozen=True)
class Lease:
    """A lease file as read by anyone: who holds it and how often it has been renewed."""

    path: str
    token: str
    kind: str
    host: str
    node: str
    pid: int
    started: str | None
    created: float
    renewed: float
    count: int

    def wall_age(self) -> float:
        return CLOCK.wall() - self.renewed

    def process_gone(self) -> bool:
        return _process_gone(self.node, self.pid, self.started)

    def describe(self) -> str:
        return (f"{self.path} (host {self.host}, pid {self.pid}, renewed {self.count} times, "
                f"last {self.wall_age():.0f} s ago by this host's clock)")


def _doc(token: str, kind: str, created: float, count: int) -> bytes:
    pid = os.getpid()
    return json.dumps({
        "token": token, "kind": kind, "host": socket.gethostname(), "node": _node(), "pid": pid,
        "started": _start_time(pid), "created": created, "renewed": CLOCK.wall(), "count": count,
    }, sort_keys=True).encode()


def read(storage: Any, path: str) -> Lease | None:
    """The lease at ``path``; None if it is gone.

    An unreadable lease (a torn or foreign file) is *never* deleted on that account: it
    reads as a lease of an unknown process, which only the watch (no change for
    ``EXPIRY``) can judge dead."""
    try:
        raw = storage.read(path)
    except FileNotFoundError:
        return None
    token = lease_token(path)
    try:
        doc = json.loads(raw)
        return Lease(path, token, str(doc["kind"]), str(doc["host"]), str(doc.get("node", "")),
                     int(doc["pid"]), doc.get("started"), float(doc["created"]),
                     float(doc["renewed"]), int(doc["count"]))
    except (ValueError, KeyError, TypeError):
        return Lease(path, token, "?", "?", "", -1, None, 0.0, CLOCK.wall(), -hash(raw) % 1000003)


def listing(storage: Any, prefix: str) -> list[Lease]:
    """Every lease under ``prefix`` (WRITERS or GC), oldest file name first."""
    found = [read(storage, path) for path in storage.list(prefix)]
    return sorted((lease for lease in found if lease is not None), key=lambda lease: lease.path)


def writers(storage: Any) -> list[Lease]:
    return listing(storage, WRITERS)


def gc_runs(storage: Any) -> list[Lease]:
    return listing(storage, GC)


class Watch:
    """What this process has seen of other leases: (count, first seen at, own clock).

    A lease whose counter stays the same for ``expiry`` seconds of our own monotonic
    clock is dead; no other host's clock is consulted."""

    def __init__(self, expiry: float = EXPIRY) -> None:
        self.expiry = expiry
        self._seen: dict[str, tuple[int, float]] = {}

    def unrenewed_for(self, lease: Lease) -> float:
        now = CLOCK.monotonic()
        count, since = self._seen.get(lease.path, (lease.count, now))
        if count != lease.count:
            since = now
        self._seen[lease.path] = (lease.count, since)
        return now - since

    def expired(self, lease: Lease) -> bool:
        return self.unrenewed_for(lease) >= self.expiry


# -- leases as their holder sees them -------------------------------------------------------
@dataclass
class HeldLease:
    """A lease this process holds: renew it, check it, release it (only ever its own file)."""

    storage: Any
    path: str
    token: str
    kind: str
    expiry: float = EXPIRY
    count: int = 0
    created: float = field(default_factory=lambda: CLOCK.wall())
    renewed_at: float = field(default_factory=lambda: CLOCK.monotonic())
    released: bool = False
    lost: bool = False  # a gc lease a writer marked broken: stop acting at once
    _keeper: threading.Thread | None = field(default=None, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def renew(self) -> None:
        """Rewrite the lease with the next counter; a gc also learns here if it was broken."""
        with self._lock:
            if self.released:
                return
            issued = CLOCK.monotonic()
            if issued - self.renewed_at >= self.expiry / 3 or self.broken():
                # Lapsed or broken: another process may already have judged us dead and gone
                # ahead, so renewing now would claim a lease that is no longer ours. Stop for good.
                self.lost = True
                return
            self.storage.write(self.path, _doc(self.token, self.kind, self.created, self.count + 1))
            self.count += 1
            self.renewed_at = issued  # from when the write was *issued*: conservative

    def broken(self) -> bool:
        """A gc lease only: did a writer judge this gc dead?"""
        return self.kind == "gc" and self.storage.exists(f"{BROKEN}/{self.token}")

    def valid(self) -> bool:
        """May the holder still act on this lease? (gc checks this before every delete)."""
        return not (self.released or self.lost) and CLOCK.monotonic() - self.renewed_at < self.expiry / 3

    def keep_alive(self, every: float = RENEW_EVERY) -> HeldLease:
        """Renew from a daemon thread until released (errors are retried; validity lapses)."""
        def loop() -> None:
            while not self._stop.wait(every):
                with contextlib.suppress(Exception):
                    self.renew()
        self._keeper = threading.Thread(target=loop, name=f"inshrink-lease-{self.token[:8]}", daemon=True)
        self._keeper.start()
        return self

    def keep_alive_running(self) -> bool:
        return self._keeper is not None and self._keeper.is_alive()

    def release(self) -> None:
        """Delete this lease's own files; never anyone else's."""
        self._stop.set()
        with self._lock:
            if self.released:
                return
            self.released = True
        self.storage.delete(self.path)
        if self.kind == "writer":
            self.storage.delete(f"{FENCES}/{self.token}")


def _create(storage: Any, prefix: str, kind: str) -> HeldLease:
    token = f"{int(CLOCK.wall() * 1e6):017d}-{next(_SERIAL):08d}-{uuid.uuid4().hex}"
    held = HeldLease(storage, f"{prefix}/{token}", token, kind)
    storage.create_exclusive(held.path, _doc(token, kind, held.created, 0))
    return held


class _Waiting:
    """The waiting half of acquire_writer/acquire_gc: a deadline on our own clock, and
    ``on_wait`` told once about each lease we wait for."""

    def __init__(self, wait: float, on_wait: Any) -> None:
        self.deadline = CLOCK.monotonic() + wait
        self.on_wait = on_wait
        self._told: set[str] = set()

    def over(self) -> bool:
        return CLOCK.monotonic() >= self.deadline

    def tell(self, live: list[Lease], what: str) -> None:
        for lease in live:
            if self.on_wait is not None and lease.path not in self._told:
                self.on_wait(what.format(lease.describe()))
            self._told.add(lease.path)

    def pause(self, at_most: float) -> None:
        CLOCK.sleep(min(at_most, max(0.0, self.deadline - CLOCK.monotonic())))


# -- writers ---------------------------------------------------------------------------
def _gc_dead(storage: Any, lease: Lease, watch: Watch) -> bool:
    if storage.exists(f"{BROKEN}/{lease.token}"):
        return True
    return lease.process_gone() or watch.expired(lease)


def acquire_writer(storage: Any, wait: float = 0.0, on_wait: Any = None) -> HeldLease:
    """Announce a writer, then make sure no live gc runs; return the held lease.

    The writer lease is created *before* gc leases are read: a gc that starts later lists
    writers after creating its own lease, so it sees this one. A gc seen here is waited
    for, up to ``wait`` seconds (``on_wait(message)`` is told once per gc), *without*
    holding the writer lease meanwhile: a waiting writer must not hold up the gc it waits
    for. A gc judged dead (its process gone, or no renewal while we watched for
    ``EXPIRY`` s) is marked broken and ignored. Raises :class:`GcRunningError` after
    ``wait``, having written nothing that stays.
    """
    watch = Watch()
    waiting = _Waiting(wait, on_wait)
    while True:
        held = _create(storage, WRITERS, "writer")
        try:
            live = []
            for lease in gc_runs(storage):
                if _gc_dead(storage, lease, watch):
                    storage.write(f"{BROKEN}/{lease.token}", b"judged dead by writer " + held.token.encode())
                else:
                    live.append(lease)
        except BaseException:
            held.release()
            raise
        if not live:
            return held
        held.release()
        if waiting.over():
            names = "; ".join(lease.describe() for lease in live)
            raise GcRunningError(
                f"Expected no gc running on {storage.url!r} while committing. Got {names} "
                f"instead, still running after {wait:.0f} s of waiting; nothing was written. "
                f"Retry when it finishes (a gc that died is recognised after {EXPIRY:.0f} s "
                "without renewal, or at once on its own machine)."
            )
        waiting.tell(live, "waiting for gc {} to finish before committing")
        waiting.pause(0.5)


def check_publishable(storage: Any, held: HeldLease) -> None:
    """Right before a ref is created: the writer's lease must still be valid by its own
    clock. A writer that stalled past a third of the expiry may have been judged dead by a
    gc that watched it (even after it fenced ``commit``), so it must not publish now."""
    if not held.valid():
        held.lost = True
        raise LeaseBrokenError(
            f"Expected this writer's lease {held.path} on {storage.url!r} to be valid when "
            "publishing. Got it lapsed (not renewed for "
            f"{CLOCK.monotonic() - held.renewed_at:.0f} s: the process stalled) instead; "
            "nothing was published and no version was lost: retry the commit."
        )


def fence_for_commit(storage: Any, held: HeldLease) -> None:
    """The writer's last step before publishing a ref: win its fence, or learn it was broken."""
    check_publishable(storage, held)
    try:
        storage.create_exclusive(f"{FENCES}/{held.token}", FENCE_COMMIT)
    except FileExistsError:
        if _read_fence(storage, held.token) == FENCE_COMMIT:
            return  # ours, from an earlier attempt of this same commit (a lost race, then rebase)
        raise LeaseBrokenError(
            f"Expected to publish this commit on {storage.url!r}. Got its writer lease "
            f"{held.path} broken by a gc that judged the writer dead instead; nothing was "
            "published and no version was lost: retry the commit."
        ) from None


# -- gc ----------------------------------------------------------------------------------
def acquire_gc(storage: Any, *, wait: float = 0.0, stale_after: float = STALE_AFTER,
               on_wait: Any = None) -> tuple[HeldLease, list[Lease]]:
    """Take a gc lease and clear the way; return it and the dead leases gc may delete.

    Order matters: the gc lease is created *before* writer leases are listed (see
    ``acquire_writer``). Each writer lease then is either alive (wait up to ``wait`` s,
    then refuse), or judged dead and *broken through its fence*; a fence already holding
    ``commit`` means the writer is publishing, so it counts as alive. An older live gc run
    also makes this one refuse (one at a time is what users expect, though two would be
    safe: each deletes only what no ref reaches); the older one goes on. On refusal the
    gc lease is released and nothing was deleted.
    """
    held = _create(storage, GC, "gc")
    watch = Watch()
    waiting = _Waiting(wait, on_wait)
    try:
        while True:
            dead: list[Lease] = []
            live: list[Lease] = []
            for other in gc_runs(storage):
                if other.token == held.token:
                    continue
                if _gc_dead(storage, other, watch):
                    dead.append(other)
                elif other.token < held.token:  # the older run goes on, the younger yields
                    live.append(other)
            if live:
                names = "; ".join(lease.describe() for lease in live)
                raise ConflictError(
                    f"Expected no other gc running on {storage.url!r}. Got {names} instead; "
                    "nothing was deleted."
                )
            for lease in writers(storage):
                fence = _read_fence(storage, lease.token)
                if fence.startswith(FENCE_BROKEN):
                    dead.append(lease)  # fenced off before: dead for good
                    continue
                if fence:  # publishing: alive, unless it cannot publish any more
                    gone = lease.process_gone() or watch.expired(lease)  # lapsed: it self-fences
                    (dead if gone else live).append(lease)
                    continue
                if not (lease.process_gone() or lease.wall_age() >= stale_after or watch.expired(lease)):
                    live.append(lease)
                    continue
                who = json.dumps({"by": held.token, "node": lease.node, "pid": lease.pid,
                                  "started": lease.started}, sort_keys=True).encode()
                try:
                    storage.create_exclusive(f"{FENCES}/{lease.token}", FENCE_BROKEN + b" " + who)
                    dead.append(lease)
                except FileExistsError:
                    fence = _read_fence(storage, lease.token)
                    (dead if fence.startswith(FENCE_BROKEN) else live).append(lease)
            if not live:
                return held, dead
            if waiting.over():
                names = "; ".join(lease.describe() for lease in live)
                raise ConflictError(
                    f"Expected no commit in progress on {storage.url!r} while collecting garbage. "
                    f"Got {len(live)} writer lease(s) instead: {names}. Nothing was deleted; run gc "
                    f"when the writers are done (a dead writer is recognised at once on its own "
                    f"machine, elsewhere once unrenewed for {stale_after:.0f} s; --wait to wait)."
                )
            waiting.tell(live, "waiting for writer {}")
            held.renew()
            waiting.pause(1.0)
    except BaseException:
        held.release()
        raise


def _read_fence(storage: Any, token: str) -> bytes:
    try:
        return bytes(storage.read(f"{FENCES}/{token}"))
    except FileNotFoundError:
        return b""


def leftovers(storage: Any, dead: list[Lease]) -> list[str]:
    """Lease files gc may delete now.

    - the dead leases it judged (writer leases it fenced off, gc leases marked broken);
    - ``commit`` fences and broken-markers whose lease is gone (a release cut short);
    - ``broken`` fences only once that writer's process is certainly gone (same machine):
      a writer judged dead elsewhere may only be paused, and its fence is what stops it
      from publishing when it wakes up, so that fence (a few bytes) stays.
    """
    paths = {lease.path for lease in dead}
    dead_tokens = {lease.token for lease in dead}
    present = {lease_token(path) for prefix in (WRITERS, GC) for path in storage.list(prefix)}
    present -= dead_tokens
    for path in storage.list(BROKEN):
        if lease_token(path) not in present:
            paths.add(path)
    for path in storage.list(FENCES):
        token = lease_token(path)
        if token in present:
            continue
        fence = _read_fence(storage, token)
        if not fence.startswith(FENCE_BROKEN):
            paths.add(path)
            continue
        try:
            who = json.loads(fence[len(FENCE_BROKEN):])
            gone = _process_gone(str(who["node"]), int(who["pid"]), who.get("started"))
        except (ValueError, KeyError, TypeError):
            gone = False
        if gone:
            paths.add(path)
    return sorted(paths)

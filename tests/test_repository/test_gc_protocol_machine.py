"""A hypothesis state machine for the gc protocol: writers, gc runs, tags and branches interleaved
step by step, with pauses, deaths and clock jumps, on the memory backend.

Each actor is driven one protocol step at a time: a writer starts (lease), writes its
objects, and commits (fence, ref) in separate rules; a gc starts (lease), marks, sweeps a
few paths at a time and finishes in separate rules. Actors can stall (stop renewing) or
die (never come back), and the clock can jump past every expiry, so a gc judges live
writers dead and writers judge live-but-paused gc runs dead. Whatever happens:

- every version a branch or tag names reads back exactly what was committed, and
  ``verify`` passes (no ref points at deleted data);
- a commit that reported success is on its branch until something deletes the branch.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import inshrink_store as ins
from inshrink_store import leases, manifest
from inshrink_store.admin import GarbageCollector
from tests.test_repository._clock import FakeClock


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"w": rng.standard_normal((int(rng.integers(1, 40)), 3)).astype(np.float32)}
    if seed % 3:
        out["b"] = np.full(4, seed % 5, np.float32)  # often identical across versions: dedup
    return out


BRANCHES = st.sampled_from(["main", "dev"])
TAGS = st.sampled_from(["best", "v1"])


class GcProtocolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._saved = (leases.CLOCK, leases.HeldLease.keep_alive)
        self.clock = FakeClock(5000.0)
        leases.CLOCK = self.clock
        leases.HeldLease.keep_alive = lambda self, every=0: self  # renewals are rules here
        self.name = f"gcm-{uuid.uuid4().hex}"
        self.repo = ins.open(f"memory://{self.name}", create=True)
        first = self.repo.save(_tensors(0), message="v0")
        self.versions: dict[str, dict[str, np.ndarray]] = {first.id: _tensors(0)}
        self.acked: dict[str, list[str]] = {"main": [first.id]}  # successful commits per branch
        self.writers: dict[int, tuple[ins.Transaction, dict[str, np.ndarray], bool]] = {}
        self.gcs: dict[int, GarbageCollector] = {}
        self.stalled: set[tuple[str, int]] = set()
        self.counter = 0

    def teardown(self) -> None:
        leases.CLOCK, leases.HeldLease.keep_alive = self._saved
        for key in [k for k in MemoryFileSystem.store if k.startswith(f"/{self.name}/")]:
            MemoryFileSystem.store.pop(key, None)

    def _next(self) -> int:
        self.counter += 1
        return self.counter

    # -- writers ------------------------------------------------------------------------
    @rule(branch=BRANCHES, seed=st.integers(1, 30), wait=st.sampled_from([0.0, 2 * leases.EXPIRY]))
    def writer_starts_and_writes(self, branch: str, seed: int, wait: float) -> None:
        try:
            tx = self.repo.transaction(branch, inherit=False, gc_wait=wait)
        except ins.GcRunningError:
            return
        tensors = _tensors(seed)
        tx.write(tensors)  # its objects exist now, unreachable until the commit
        self.writers[self._next()] = (tx, tensors, True)

    @precondition(lambda self: any(wrote for _, _, wrote in self.writers.values()))
    @rule(data=st.data())
    def writer_commits(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(k for k, (_, _, w) in self.writers.items() if w)))
        tx, tensors, _ = self.writers.pop(key)
        self.stalled.discard(("w", key))
        try:
            info = tx.commit(message=f"w{key}", rebase=True)
        except ins.LeaseBrokenError:
            tx.abort()
            return
        self.versions[info.id] = tensors
        self.acked.setdefault(tx.branch, []).append(info.id)

    @precondition(lambda self: bool(self.writers))
    @rule(data=st.data(), forever=st.booleans())
    def writer_stalls_or_dies(self, data: st.DataObject, forever: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.writers)))
        if forever:
            self.writers.pop(key)  # killed: its lease stays behind, unrenewed
        else:
            self.stalled.add(("w", key))

    # -- gc -----------------------------------------------------------------------------
    @rule(keep_last=st.sampled_from([None, 1, 2]), wait=st.sampled_from([0.0, leases.EXPIRY]))
    def gc_starts(self, keep_last: int | None, wait: float) -> None:
        gc = self.repo.garbage_collector(keep_last, wait=wait, keep_alive=False)
        try:
            gc.start()
        except ins.ConflictError:
            return
        self.gcs[self._next()] = gc

    def _gc_step(self, key: int, step: str, n: int = 0) -> None:
        gc = self.gcs[key]
        try:
            if step == "mark":
                gc.mark()
            elif gc.sweep(n) == 0:
                gc.finish()
                self.gcs.pop(key)
        except ins.ConflictError:  # its lease lapsed or was broken: it stops
            gc.finish()
            self.gcs.pop(key)

    @precondition(lambda self: any(g.report is None for g in self.gcs.values()))
    @rule(data=st.data())
    def gc_marks(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(k for k, g in self.gcs.items() if g.report is None)))
        self.stalled.discard(("g", key))
        self._gc_step(key, "mark")

    @precondition(lambda self: any(g.report is not None for g in self.gcs.values()))
    @rule(data=st.data(), n=st.integers(1, 6))
    def gc_sweeps(self, data: st.DataObject, n: int) -> None:
        key = data.draw(st.sampled_from(sorted(k for k, g in self.gcs.items() if g.report is not None)))
        self.stalled.discard(("g", key))
        self._gc_step(key, "sweep", n)

    @precondition(lambda self: bool(self.gcs))
    @rule(data=st.data(), forever=st.booleans())
    def gc_stalls_or_dies(self, data: st.DataObject, forever: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.gcs)))
        if forever:
            self.gcs.pop(key)
        else:
            self.stalled.add(("g", key))

    # -- refs, time ---------------------------------------------------------------------
    @rule(tag=TAGS, back=st.integers(0, 3), branch=BRANCHES)
    def tag(self, tag: str, back: int, branch: str) -> None:
        try:
            self.repo.tag(tag, f"{branch}~{back}", gc_wait=0)
        except (ins.GcRunningError, ins.NotFoundError, ins.ConflictError):
            return

    @rule(tag=TAGS)
    def delete_tag(self, tag: str) -> None:
        try:
            self.repo.delete_tag(tag)
        except ins.NotFoundError:
            return

    @rule(back=st.integers(0, 2))
    def branch_dev(self, back: int) -> None:
        try:
            self.repo.create_branch("dev", f"main~{back}", gc_wait=0)
        except (ins.GcRunningError, ins.NotFoundError, ins.ConflictError):
            return

    @rule()
    def renewals(self) -> None:
        """What the keeper threads of every running, un-stalled actor do."""
        for key, (tx, _, _) in self.writers.items():
            if ("w", key) not in self.stalled and tx.lease is not None:
                tx.lease.renew()
        for key, gc in self.gcs.items():
            if ("g", key) not in self.stalled and gc.lease is not None:
                gc.lease.renew()

    @rule(seconds=st.sampled_from([1.0, leases.RENEW_EVERY, leases.EXPIRY, leases.STALE_AFTER + 1]))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds

    # -- what must always hold ------------------------------------------------------------
    @invariant()
    def every_ref_reads_back_what_was_committed(self) -> None:
        repo = self.repo
        named = {**repo.branches(), **{f"tag:{k}": v for k, v in repo.tags().items()}}
        for name, sid in named.items():
            loaded = repo.load(sid)
            expected = self.versions[sid]
            assert sorted(loaded) == sorted(expected), name
            for key, value in expected.items():
                assert loaded[key].tobytes() == value.tobytes(), (name, key)
        report = repo.verify()
        assert report.ok, report.problems

    @invariant()
    def acknowledged_heads_stay(self) -> None:
        heads = self.repo.branches()
        for branch, acked in self.acked.items():
            if branch in heads and acked:
                assert heads[branch] == acked[-1] or acked[-1] in [i.id for i in self.repo.log(branch)]


TestGcProtocol = GcProtocolMachine.TestCase
TestGcProtocol.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])


class TestGcProtocolTreeFiles(GcProtocolMachine.TestCase):
    """The same protocol with every array's node a tree file (only groups inline): roots that
    mix tree files and inline nodes, and node trees for gc to keep or collect."""

    settings = settings(max_examples=15, stateful_step_count=25, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow])

    def setUp(self) -> None:
        self._inline_max = manifest.INLINE_MAX_CHUNKS
        manifest.INLINE_MAX_CHUNKS = 0

    def tearDown(self) -> None:
        manifest.INLINE_MAX_CHUNKS = self._inline_max


@pytest.mark.slow
class TestGcProtocolLong(GcProtocolMachine.TestCase):
    settings = settings(max_examples=500, stateful_step_count=40, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow])

"""Crash consistency: a committer killed at any storage write leaves a usable store.

A child process commits three versions to a local store and dies at its N-th
storage write (before it, after it, or leaving a torn temp file). Afterwards the
store opens, ``log`` shows only complete versions, every one of them reads back
exactly, ``verify`` passes, ``gc`` removes every leftover, and committing goes on.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store import leases
from inshrink_store.storage import open_storage
from tests.test_repository._child import state

CHILD = Path(__file__).with_name("_child.py")
SEED = 3


def _run_child(url: str, crash_at: int, how: str) -> tuple[int, list[str]]:
    proc = subprocess.run(
        [sys.executable, str(CHILD), "crash", url, str(SEED), str(crash_at), how],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode in (0, 9), proc.stderr
    committed = [json.loads(line)["committed"] for line in proc.stdout.splitlines()]
    return proc.returncode, committed


def _files(root: str) -> set[str]:
    return {str(Path(d, f).relative_to(root)) for d, _, fs in os.walk(root) for f in fs}


def _check_after_crash(url: str, committed: list[str]) -> None:
    repo = ins.open(url)
    log = repo.log() if repo.branches() else []
    assert [i.id for i in log[::-1]][: len(committed)] == committed  # nothing acknowledged is lost
    assert [i.message for i in log] == [f"v{k}" for k in reversed(range(len(log)))]
    for info in log:
        loaded = repo.load(info.id)
        expected = state(SEED, info.step)
        assert sorted(loaded) == sorted(expected)
        for name, value in expected.items():
            assert loaded[name].tobytes() == value.tobytes(), (info.message, name)
    assert repo.verify().ok
    # a writer lease left behind is recognised as dead at once (same machine, process gone),
    # so gc fences it off instead of refusing for an hour
    assert all(lease.process_gone() for lease in leases.writers(repo._storage))
    repo.gc(stale_after=0)  # stale_after=0: also the crash's young temp files
    assert repo.verify().ok
    assert (repo.log() if log else []) == log
    live = {"inshrink.json"} | set(open_storage(url).list(""))
    assert _files(url) == live, "gc left temp files or the listing hides files"
    assert not any(repo.gc(dry_run=True).deleted.values())
    # the store keeps working: the next commit continues the history
    info = repo.save(state(SEED, 7), message="after crash", step=7)
    assert info.parent == (log[0].id if log else None)


def _total_writes(url: str) -> int:
    """How many storage writes a full, uncrashed child run makes (the range to crash in)."""
    ins.init(url)
    code, committed = _run_child(url, 10_000, "before")
    assert code == 0 and len(committed) == 3
    return sum(1 for _ in open_storage(url).list(""))  # every write creates one file (no overwrites)


def _crash_once(tmp_path: Path, name: str, crash_at: int, how: str) -> None:
    url = str(tmp_path / name)
    ins.init(url)
    code, committed = _run_child(url, crash_at, how)
    assert code == 9, f"the child was meant to die at write {crash_at}"
    _check_after_crash(url, committed)


def test_crash_at_a_few_writes(tmp_path: Path) -> None:
    total = _total_writes(str(tmp_path / "full")) - 1  # inshrink.json was written by init
    rng = random.Random(total)
    points = [(1, "before"), (total, "before"), (total, "torn"), (rng.randrange(2, total), "after")]
    for i, (crash_at, how) in enumerate(points):
        _crash_once(tmp_path, f"s{i}", crash_at, how)


@pytest.mark.slow
def test_crash_at_every_write(tmp_path: Path) -> None:
    total = _total_writes(str(tmp_path / "full")) - 1
    for crash_at in range(1, total + 1):
        for how in ("before", "after", "torn"):
            _crash_once(tmp_path, f"s{crash_at}-{how}", crash_at, how)


@pytest.mark.slow
def test_sigkill_at_random_times(tmp_path: Path) -> None:
    """Real SIGKILLs at random moments, not only at storage calls."""
    rng = random.Random(1234)
    for i in range(15):
        url = str(tmp_path / f"k{i}")
        ins.init(url)
        with subprocess.Popen(  # closes its stdout pipe when done (no ResourceWarning)
            [sys.executable, str(CHILD), "crash", url, str(SEED), "10000", "before"],
            stdout=subprocess.PIPE, text=True,
        ) as proc:
            try:
                proc.wait(timeout=rng.uniform(0.5, 2.5))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            assert proc.stdout is not None
            committed = [json.loads(line)["committed"] for line in proc.stdout.read().splitlines()]
        _check_after_crash(url, committed)
        np.testing.assert_array_equal(ins.open(url).load()["step"], np.array(7))


def test_crash_inside_exclusive_create_leaves_no_ref(tmp_path: Path) -> None:
    """A kill after the new ref's bytes are written but before they are linked into
    place: the head stays the previous version, the branch stays readable, and the
    left-over temp file is not mistaken for a ref."""
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    first = repo.save(state(SEED, 0), message="v0", step=0)
    script = (
        "import os, sys, inshrink_store as ins\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from _child import state\n"
        "def crash_link(src, dst, *a, **k):\n"
        "    os._exit(9)\n"
        "os.link = crash_link\n"
        "ins.open(sys.argv[1]).save(state(3, 1), message='v1', step=1)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, url, str(CHILD.parent)], timeout=120)
    assert proc.returncode == 9
    assert ins.open(url).resolve("main") == first.id
    reopened = ins.open(url)
    assert [entry.id for entry in reopened.log("main")] == [first.id]
    assert reopened.verify().ok
    second = reopened.save(state(3, 1), message="v1 again", step=1)
    assert ins.open(url).resolve("main") == second.id

"""A separate process for the crash and race tests (run as a script, never imported by pytest).

``crash URL SEED CRASH_AT HOW``: commit versions ``v0``, ``v1``, ``v2`` of a
deterministic state and die with ``os._exit`` at the CRASH_AT-th storage write:
``before`` it, ``after`` it, or ``torn`` (a half-written temp file is left, as a
kill inside a local atomic write would). The fault is injected by wrapping the
``Storage`` class in this process only; library code is untouched.

``race URL NAME READY_DIR``: open a transaction on ``main``, wait until every
racer has one open (files in READY_DIR), commit, and on a conflict retry with
``rebase=True``. Prints one JSON line per step.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

import numpy as np

import inshrink_store as ins
from inshrink_store.storage import LocalStorage, MemoryStorage, ObjectStorage, Storage


def state(seed: int, version: int) -> dict[str, np.ndarray]:
    """The state of version ``version``: ``b`` never changes (dedup), ``w`` always does."""
    rng = np.random.default_rng([seed, version])
    return {
        "model/w": rng.standard_normal((6, 5)).astype(np.float32),
        "model/b": np.arange(5, dtype=np.float32) + seed,
        "step": np.array(version, dtype=np.int64),
    }


def _inject(crash_at: int, how: str, uncounted: str | None = None) -> None:
    """Die at the ``crash_at``-th storage write; writes under the prefix ``uncounted`` (e.g.
    the leases, whose renewals depend on timing) are made but not counted."""
    calls = 0

    def fault(real):  # type: ignore[no-untyped-def]
        def wrapped(self: Storage, path: str, data: bytes) -> None:
            nonlocal calls
            if uncounted is not None and path.startswith(uncounted):
                return real(self, path, data)
            calls += 1
            if calls != crash_at:
                return real(self, path, data)
            if how == "after":
                real(self, path, data)
            elif how == "torn" and self.supports_rename:  # only a rename-based write leaves a temp file
                full = self._full(path)
                os.makedirs(os.path.dirname(full), exist_ok=True)
                Path(f"{full}.tmp-{uuid.uuid4().hex}").write_bytes(data[: len(data) // 2])
            os._exit(9)

        return wrapped

    for backend in (LocalStorage, MemoryStorage, ObjectStorage):
        backend.write = fault(backend.write)  # type: ignore[method-assign]
        backend.create_exclusive = fault(backend.create_exclusive)  # type: ignore[method-assign]


def crash(url: str, seed: int, crash_at: int, how: str) -> None:
    _inject(crash_at, how)
    repo = ins.open(url)
    for version in range(3):
        info = repo.save(state(seed, version), message=f"v{version}", step=version)
        print(json.dumps({"committed": info.id, "version": version}), flush=True)


def race(url: str, name: str, ready_dir: str) -> None:
    repo = ins.open(url)
    tx = repo.transaction("main")
    tx.write({"who": np.frombuffer(name.encode().ljust(8), dtype=np.uint8).copy()})
    Path(ready_dir, name).touch()
    deadline = time.monotonic() + 60
    while len(os.listdir(ready_dir)) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError("the other racer never opened its transaction")
        time.sleep(0.005)
    try:
        info = tx.commit(message=name)
        print(json.dumps({"result": "won", "id": info.id}), flush=True)
    except ins.ConflictError as exc:
        print(json.dumps({"result": "conflict", "error": str(exc)}), flush=True)
        info = tx.commit(message=name, rebase=True)
        print(json.dumps({"result": "rebased", "id": info.id, "parent": info.parent}), flush=True)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "crash":
        crash(args[0], int(args[1]), int(args[2]), args[3])
    elif mode == "race":
        race(*args)
    else:
        raise SystemExit(f"Expected mode crash or race. Got {mode!r} instead.")

"""Processes for the multi-process gc test (run as a script, never imported by pytest).

``python _actors.py ROLE URL ENDPOINT SECONDS SEED``, ROLE one of:

- ``writer``: commit versions of a deterministic state for SECONDS (every third round it
  opens a transaction, writes, and aborts: garbage for gc); prints one JSON line per
  acknowledged commit: ``{"id": ..., "version": ...}``.
- ``gc``: run gc in a loop (refusals while writers commit are expected);
  prints ``{"gc": runs, "refused": n}`` at the end.
- ``tagger``: tag a recent version, and delete an older tag, in a loop.

ENDPOINT is the S3 emulator's URL ("-" for none).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

import fsspec
import numpy as np

import inshrink_store as ins


def state(seed: int, version: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, version])
    return {"model/w": rng.standard_normal((16, 8)).astype(np.float32),
            "model/b": np.arange(8, dtype=np.float32) + seed,  # the same every version: dedup
            "step": np.array(version, dtype=np.int64)}


def writer(repo: ins.Repository, until: float, seed: int) -> None:
    version = 0
    while time.monotonic() < until:
        version += 1
        if version % 3 == 0:
            tx = repo.transaction("main", gc_wait=60)
            tx.write(state(seed + 1000, version))
            tx.abort()
            continue
        for _ in range(5):
            try:
                info = repo.save(state(seed, version), message=f"v{version}", step=version, gc_wait=60,
                                 rebase=True)
                break
            except ins.LeaseBrokenError:
                continue
        else:
            raise SystemExit("five commits in a row fenced off")
        print(json.dumps({"id": info.id, "version": version}), flush=True)
        time.sleep(0.2)  # the training steps between two checkpoints


def collector(repo: ins.Repository, until: float) -> None:
    runs = refused = 0
    why: list[str] = []
    while time.monotonic() < until:
        try:
            repo.gc(wait=1.0)
            runs += 1
        except ins.ConflictError as exc:
            refused += 1
            why = why[-2:] + [str(exc)[:400]]
        time.sleep(0.05)
    print(json.dumps({"gc": runs, "refused": refused, "why": why}), flush=True)


def tagger(repo: ins.Repository, until: float) -> None:
    n = 0
    while time.monotonic() < until:
        n += 1
        with contextlib.suppress(ins.NotFoundError, ins.ConflictError):
            repo.tag(f"t{n}", "main~1", gc_wait=60)
        if n > 3:
            with contextlib.suppress(ins.NotFoundError):
                repo.delete_tag(f"t{n - 3}")
        time.sleep(0.1)


def main() -> None:
    role, url, endpoint, seconds, seed = sys.argv[1:6]
    if endpoint != "-":
        fsspec.config.conf["s3"] = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing",
                                    "secret": "testing", "token": "testing", "skip_instance_cache": True}
    repo = ins.open(url)
    until = time.monotonic() + float(seconds)
    {"writer": lambda: writer(repo, until, int(seed)), "gc": lambda: collector(repo, until),
     "tagger": lambda: tagger(repo, until)}[role]()


if __name__ == "__main__":
    main()

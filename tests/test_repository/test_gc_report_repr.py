"""repr(GcReport) is short (issue 33 item 11): counts and bytes, a few example paths at most,
not every deleted object (``ck.last_gc`` in a notebook printed hundreds of paths)."""

from __future__ import annotations

import uuid

import numpy as np

import inshrink_store as ins


def test_a_gc_report_repr_gives_counts_and_bytes_not_every_path() -> None:
    repo = ins.open(f"memory://gc-repr-{uuid.uuid4().hex}", create=True)
    rng = np.random.default_rng(0)
    for _ in range(3):
        repo.save({f"t{i}": rng.standard_normal(64).astype(np.float32) for i in range(100)})
    report = repo.gc(keep_last=1)
    assert len(report.deleted["objects"]) >= 200
    text = repr(report)
    assert len(text) < 600, text
    assert f"{len(report.deleted['objects'])} objects" in text and "2 snapshots" in text
    assert f"freed_bytes={report.freed_bytes}" in text and "kept_snapshots=1" in text
    shown = [p for p in report.deleted["objects"] if p in text]
    assert len(shown) <= 3

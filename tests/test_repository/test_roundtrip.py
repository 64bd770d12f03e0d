"""The run-everywhere suite: one save/checkout/log/tag/diff/verify/gc round trip per backend.

Parametrised over ``store_url`` so the same guarantees are checked on memory,
a local disk and (when the fixtures provide them) S3 and GCS.
"""

from __future__ import annotations

import numpy as np
import pytest

import inshrink_store as ins


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model/w": rng.standard_normal((16, 8)).astype(np.float32),
        "model/b": rng.standard_normal(8).astype(np.float32),
        "optim/step": np.array(seed, dtype=np.int64),
    }


def test_save_checkout_log_roundtrip(store_url: str) -> None:
    repo = ins.open(store_url, create=True)
    states = [_state(i) for i in range(3)]
    infos = [repo.save(s, message=f"v{i}", step=i, metrics={"loss": 1.0 / (i + 1)})
             for i, s in enumerate(states)]
    assert [i.id for i in repo.log()] == [i.id for i in reversed(infos)]
    assert [i.parent for i in repo.log()] == [infos[1].id, infos[0].id, None]
    assert repo.log()[0].metrics == {"loss": pytest.approx(1 / 3)}
    for back, state in enumerate(reversed(states)):
        loaded = repo.load(f"main~{back}")
        assert sorted(loaded) == sorted(state)
        for name, value in state.items():
            assert loaded[name].dtype == value.dtype
            np.testing.assert_array_equal(loaded[name], value)
    reopened = ins.open(store_url)
    assert reopened.branches() == {"main": infos[-1].id}
    assert reopened.resolve(infos[0].id[:8]) == infos[0].id


def test_tag_diff_verify_gc(store_url: str) -> None:
    repo = ins.open(store_url, create=True)
    first = repo.save(_state(0), message="first")
    changed = dict(_state(0), **{"model/b": np.zeros(8, np.float32)})
    repo.save(changed, message="second")
    repo.save(changed | {"extra": np.ones(2, np.int8)}, message="third")
    assert repo.tag("best", "main~2") == first.id
    assert repo.tags() == {"best": first.id}

    report = repo.diff("best", "main~1", values=True)
    status = {t.path: t.status for t in report.tensors}
    assert status == {"model/b": "changed", "model/w": "unchanged", "optim/step": "unchanged"}
    b = next(t for t in report.tensors if t.path == "model/b")
    assert b.max_abs_change == pytest.approx(float(np.abs(_state(0)["model/b"]).max()))
    assert [t.path for t in repo.diff("main~1", "main").by_status("added")] == ["extra"]

    assert repo.verify().ok
    dry = repo.gc(keep_last=1, dry_run=True)
    assert dry.deleted["snapshots"] and repo.verify().snapshots == 3  # dry run deletes nothing
    report_gc = repo.gc(keep_last=1)
    assert report_gc.deleted == dry.deleted and report_gc.freed_bytes == dry.freed_bytes > 0
    # the tag keeps "first"; "second" was neither tagged nor in the last 1
    assert sorted(s for s in repo.snapshot_ids()) == sorted([first.id, repo.resolve("main")])
    np.testing.assert_array_equal(repo.checkout("best").read("model/b"), _state(0)["model/b"])
    np.testing.assert_array_equal(repo.checkout("main").read("extra"), np.ones(2, np.int8))
    assert repo.verify().ok
    assert not any(repo.gc().deleted.values())


def test_gc_then_saving_old_content_again(store_url: str) -> None:
    """gc deletes an object; the same handle saving that content again must rewrite it
    (regression: a process-wide "already written" cache skipped the write)."""
    repo = ins.open(store_url, create=True)
    repo.save(_state(0), message="a")
    repo.save(_state(1), message="b")
    assert repo.gc(keep_last=1).deleted["objects"]
    again = repo.save(_state(0), message="a again")
    assert repo.verify().ok
    loaded = ins.open(store_url).load(again.id)
    for name, value in _state(0).items():
        np.testing.assert_array_equal(loaded[name], value)

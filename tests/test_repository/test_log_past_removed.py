"""``log`` and ``main~N`` go on past a version gc removed from the middle of a branch (issue 43,
item 1).

A tag keeps its version, not the versions around it: when gc removes a version from the middle
of a branch while older ones are still kept by a tag (Lightning's ``save_top_k`` evicting one
of its checkpoints, a Checkpointer's ``keep-<step>`` tags), the history used to end at the
removed parent, so ``log`` hid kept versions and ``main~2`` raised "Expected snapshot …
Got nothing instead". The walk now goes on with the newest older version committed on the
branch that is still kept (the branch's ref files), but never past a commit that went back to
an older version (a restore), whose ref files are not its ancestors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import inshrink_store as ins
from tests._cli_helpers import run


def _save(repo: ins.Repository, step: int, **kwargs: object) -> str:
    tensors = {"w": np.full(8, step, dtype=np.float32)}
    return repo.save(tensors, step=step, message=f"step {step}", **kwargs).id  # type: ignore[arg-type]


def test_log_and_main_n_reach_the_kept_versions_below_a_removed_one(tmp_path: object) -> None:
    url = str(tmp_path)
    repo = ins.init(url)
    ids = [_save(repo, step) for step in range(5)]
    repo.tag("one", ids[1])
    repo.tag("three", ids[3])
    repo.gc(keep_last=1)  # keeps the head and the tags: 0 and 2 go
    fresh = ins.open(url)
    assert set(fresh.snapshot_ids()) == {ids[4], ids[3], ids[1]}

    assert [i.id for i in fresh.log("main")] == [ids[4], ids[3], ids[1]]
    assert [i.id for i in fresh.log("main", limit=2)] == [ids[4], ids[3]]
    assert [i.id for i in fresh.log("three")] == [ids[3], ids[1]]  # from a tag, through the branch's ref files
    assert fresh.resolve("main~1") == ids[3] and fresh.resolve("main~2") == ids[1]
    assert fresh.resolve("three~1") == ids[1] and fresh.resolve("main^^") == ids[1]
    with pytest.raises(ins.NotFoundError, match="history only 2 versions deep"):
        fresh.resolve("main~3")

    logged = run("log", url, "--json")
    assert logged.exit_code == 0, logged.output
    assert [e["id"] for e in json.loads(logged.stdout)] == [ids[4], ids[3], ids[1]]
    diff = run("diff", url, "main~2", "main", "--json")
    assert diff.exit_code == 0, diff.output
    rows = json.loads(run("du", url, "--json").stdout)["rows"]
    assert [r["snapshot"] for r in rows] == [ids[1], ids[3], ids[4]]
    assert run("verify", url).exit_code == 0


def test_a_commit_on_an_older_version_is_not_walked_past(tmp_path: object) -> None:
    """main: a, b, c; then d on a (a restore): c is kept on main.replaced-…, not d's ancestor.
    With that branch deleted, c tagged and a collected, d's parent is gone and the ref file
    before d's names c: the history of d ends at d, it does not go on to c."""
    url = str(tmp_path)
    repo = ins.init(url)
    a, _b, c = (_save(repo, step) for step in range(3))
    d = _save(repo, 3, parent=a)
    replaced = [name for name in repo.branches() if name.startswith("main.replaced-")]
    assert replaced and repo.branches()[replaced[0]] == c
    repo.delete_branch(replaced[0])
    repo.tag("c", c)
    repo.gc(keep_last=1)
    fresh = ins.open(url)
    assert set(fresh.snapshot_ids()) == {c, d}
    assert [i.id for i in fresh.log("main")] == [d]
    with pytest.raises(ins.NotFoundError, match="history only 0 versions deep"):
        fresh.resolve("main~1")


def test_a_history_without_gaps_is_its_parents(tmp_path: object) -> None:
    """No version removed: the walk is the parent chain, and reads no ref file."""
    url = str(tmp_path)
    repo = ins.init(url)
    ids = [_save(repo, step) for step in range(4)]
    repo.create_branch("side", ids[1])
    side = _save(repo, 10, branch="side")
    assert [i.id for i in repo.log("side")] == [side, ids[1], ids[0]]
    assert [i.id for i in repo.log("main")] == ids[::-1]
    assert repo.resolve("main~3") == ids[0]

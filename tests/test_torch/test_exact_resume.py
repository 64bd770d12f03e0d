"""Exact resume: a Checkpointer restores its newest version bit-exact, model and optimizer.

``Checkpointer(exact_resume=1)`` (the default) saves each version with its restore residual
and asks for a gc after the commit, so only the newest keeps one. ``load_state(exact=...)``
says which values you get, ``restored_exact`` says what ``restore`` got, and
``inshrink export --exact`` writes the exact weights. Damage is loud, never wrong numbers.
"""

from __future__ import annotations

import copy
import json
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

torch = pytest.importorskip("torch")

import inshrink_store as ins  # noqa: E402
from inshrink_store._cli import app  # noqa: E402
from inshrink_store.layout import object_path, residual_path  # noqa: E402
from inshrink_store.torch import Checkpointer, load_state, load_state_report  # noqa: E402
from inshrink_store.torch.tensors import state_to_arrays  # noqa: E402
from tests._cli_helpers import run_main, runner  # noqa: E402
from tests.test_torch._lossy import SaysLossy  # noqa: E402


def _problem(seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """Data and an MLP whose first layer (4096 weights) and its Adam moments get quantized."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 32, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 2))
    return x, y, model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model: Any, opt: Any, x: Any, y: Any, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _live(model: Any, opt: Any) -> dict[str, Any]:
    """A deep copy of the training state as it is now (what a save must give back)."""
    return {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(opt.state_dict())}


def _assert_identical(got: Any, expected: Any, where: str = "") -> None:
    """Same structure; every tensor torch.equal with the same dtype and shape; scalars ==."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == expected.dtype and got.shape == expected.shape, where
        assert torch.equal(got, expected), where
    elif isinstance(expected, dict):
        assert sorted(map(str, got)) == sorted(map(str, expected)), where
        for key, value in expected.items():
            _assert_identical(got[key], value, f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            _assert_identical(a, b, f"{where}/{i}")
    else:
        assert got == expected, where


def _checkpointer(repo: ins.Repository, model: Any, opt: Any, **kwargs: Any) -> Checkpointer:
    kwargs.setdefault("background", False)
    return SaysLossy(repo, model, opt, eval_fn=None, **kwargs)


def _restored(repo: ins.Repository, ref: str = "main") -> tuple[Checkpointer, Any, Any]:
    """A fresh model and optimizer restored from ``ref`` by a new Checkpointer; (it, model, optimizer)."""
    _, _, model, opt = _problem(seed=99)  # other weights: everything must come from the store
    ck = _checkpointer(repo, model, opt)
    ck.restore(ref)
    return ck, model, opt


@pytest.fixture
def url() -> str:
    return f"memory://exact-{uuid.uuid4().hex}"


def _lossy_paths(repo: ins.Repository, ref: str = "main") -> list[str]:
    return sorted(p for p, a in repo.checkout(ref).arrays().items() if a.storage == "quantized")


# -- Checkpointer ----------------------------------------------------------------------------


def test_the_default_checkpointer_restores_model_and_optimizer_bit_exact(url: str) -> None:
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    ck = _checkpointer(repo, model, opt)
    assert ck.exact_resume == 1
    _train(model, opt, x, y, 5)
    saved = _live(model, opt)
    info = ck.save(5)
    _train(model, opt, x, y, 3)  # the live state moves on; the store must not follow
    assert info.metadata["residual"]["keep_newest"] == 1
    lossy = _lossy_paths(repo)
    assert "model/0.weight" in lossy and any(p.startswith("optimizer/") for p in lossy), lossy

    ck2, model2, opt2 = _restored(repo)
    assert ck2.restored_exact is True
    _assert_identical(_live(model2, opt2), saved)
    # resumed training follows the uninterrupted run step for step, bit for bit
    _train(model2, opt2, x, y, 3)
    _assert_identical(_live(model2, opt2), _live(model, opt))
    # the stored values are lossy: without the residual the weights would differ
    stored = load_state(repo, "main", exact=False)
    assert not torch.equal(stored["model"]["0.weight"], saved["model"]["0.weight"])
    exact, is_exact = load_state_report(repo, "main")
    assert is_exact is True
    _assert_identical(exact["model"], saved["model"])
    ck.close()
    ck2.close()


def test_exact_resume_0_stores_no_residual_and_restores_the_stored_values(url: str) -> None:
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    ck = _checkpointer(repo, model, opt, exact_resume=0)
    _train(model, opt, x, y, 5)
    saved = _live(model, opt)
    info = ck.save(5)
    assert "residual" not in info.metadata and repo.residual("main") is None
    assert not repo._storage.list("residuals")

    ck2, model2, opt2 = _restored(repo)
    state = _live(model2, opt2)
    assert ck2.restored_exact is False
    assert not torch.equal(state["model"]["0.weight"], saved["model"]["0.weight"])  # quantized
    for name in ("0.bias", "2.bias"):  # lossless tensors are exact all the same
        assert torch.equal(state["model"][name], saved["model"][name])
    _assert_identical(state["model"], load_state(repo, "main", exact=False)["model"])
    with pytest.raises(ins.NotFoundError, match=info.id[:12]):
        load_state(repo, "main", exact=True)


def test_load_state_exact_true_false_none_after_gc_collected_an_older_residual(url: str) -> None:
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    ck = _checkpointer(repo, model, opt)
    _train(model, opt, x, y, 3)
    first = ck.save(3)
    _train(model, opt, x, y, 3)
    newest = _live(model, opt)
    ck.save(6)  # background=False: the gc the Checkpointer asks for runs before save returns
    assert repo.residual(first.id) is None and repo.residual("main") is not None
    assert len(repo._storage.list("residuals")) == 1

    with pytest.raises(ins.NotFoundError, match=first.id[:12]) as caught:
        load_state(repo, first.id, exact=True)
    assert "exact=None" in str(caught.value)  # it says what to do instead
    default, is_exact = load_state_report(repo, first.id)
    assert is_exact is False
    stored = load_state(repo, first.id, exact=False)
    _assert_identical(default, stored)
    # exact=False is what zarr reads, tensor for tensor
    arrays, _, _ = state_to_arrays(stored)
    group = zarr.open_group(store=repo.snapshot_store(first.id), mode="r")
    assert sorted(arrays) == sorted(repo.checkout(first.id).names())
    for path, array in arrays.items():
        assert np.asarray(group[path][...]).tobytes() == array.tobytes(), path

    _assert_identical(load_state(repo, "main", exact=True), newest)
    assert load_state_report(repo, "main")[1] is True
    assert not torch.equal(load_state(repo, "main", exact=False)["model"]["0.weight"], newest["model"]["0.weight"])
    with pytest.raises(ins.InvalidInputError, match="exact"):
        load_state(repo, "main", exact="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-1, 1.5, True, "1", None])
def test_exact_resume_must_be_an_int_of_at_least_0(url: str, value: Any) -> None:
    _, _, model, opt = _problem()
    with warnings.catch_warnings(), pytest.raises(ins.InvalidInputError, match="exact_resume"):
        warnings.simplefilter("ignore", UserWarning)  # the no-eval_fn warning, if it got that far
        Checkpointer(ins.open(url, create=True), model, opt, eval_fn=None, exact_resume=value)


FALSE_BUG = ("Checkpointer accepts exact_resume=False and 0.0 (its check is `not _positive_int(v) "
             "and v != 0`, and False == 0.0 == 0) but passes the value on to repo.save, which refuses "
             "anything but an int: every lossy save then fails with InvalidInputError 'Expected "
             "exact_resume to be an int >= 0 ... Got False instead' (a BackgroundSaveError in the "
             "background). Expected: refused at construction like True, or treated as 0")


@pytest.mark.parametrize("value", [False, 0.0])
def test_exact_resume_false_is_refused_up_front(url: str, value: Any) -> None:
    """Regression: False and 0.0 passed the constructor (False == 0.0 == 0) and then every save failed."""
    _, _, model, opt = _problem()
    repo = ins.open(url, create=True)
    with pytest.raises(ins.InvalidInputError, match="exact_resume"):
        Checkpointer(repo, model, opt, exact_resume=value)


@pytest.mark.parametrize("keep", [1, 2])
def test_background_saves_leave_only_the_newest_residuals(url: str, keep: int) -> None:
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    ck = _checkpointer(repo, model, opt, background=True, exact_resume=keep)
    for step in (2, 4, 6):
        _train(model, opt, x, y, 2)
        ck.save(step)  # returns at once; the next save waits for it, a commit for the gc
    newest = _live(model, opt)
    ck.close()  # waits for the last save and the gc it asked for
    log = repo.log()
    assert [i.step for i in log] == [6, 4, 2]
    assert all("residual" in i.metadata for i in log)  # each was saved with one...
    # ...the newest `keep` keep theirs
    assert [repo.residual(i.id) is not None for i in log] == [d < keep for d in range(3)]
    assert len(repo._storage.list("residuals")) == keep
    assert repo.verify().ok
    ck2, model2, opt2 = _restored(repo)
    assert ck2.restored_exact is True
    _assert_identical(_live(model2, opt2), newest)


def test_a_damaged_residual_fails_loudly_and_a_lost_one_is_reported(url: str) -> None:
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    ck = _checkpointer(repo, model, opt)
    _train(model, opt, x, y, 3)
    saved = _live(model, opt)
    info = ck.save(3)
    residual = repo.residual(info.id)
    assert residual is not None
    oid = residual.arrays["model/0.weight"].pieces[0]
    good = repo._storage.read(object_path(oid))
    repo._storage.delete(object_path(oid))
    for exact in (True, None):  # a residual that is there but broken is never skipped
        with pytest.raises((ins.IntegrityError, ins.NotFoundError), match=oid):
            load_state(ins.open(url), info.id, exact=exact)
    _, _, model2, opt2 = _problem(seed=99)
    with pytest.raises((ins.IntegrityError, ins.NotFoundError), match=oid):
        _checkpointer(ins.open(url), model2, opt2).restore()
    repo._storage.write(object_path(oid), good)
    _assert_identical(load_state(ins.open(url), info.id, exact=True), saved)

    repo._storage.delete(residual_path(residual.ref.id))  # the document itself gone
    fresh = ins.open(url)
    problems = fresh.verify().problems
    assert [(p.kind, p.id) for p in problems] == [("residual", residual.ref.id)]
    with pytest.raises(ins.NotFoundError, match=info.id[:12]):
        load_state(fresh, info.id, exact=True)
    stored, is_exact = load_state_report(fresh, info.id)
    assert is_exact is False  # what it got is said, never passed off as exact
    _assert_identical(stored, load_state(fresh, info.id, exact=False))


MESSAGE_BUG = ("load_state(exact=True) on the newest version whose residual document was deleted by "
               "hand (verify: Problem('residual', <id>)) raises NotFoundError 'Expected the restore "
               "residual of snapshot <sid> ... this one was saved without it or gc has collected it': "
               "neither is true (it is the branch head, saved with keep_newest=1) and the missing "
               "document residuals/<id> is not named (repo.residual swallows the NotFoundError that "
               "names it and returns None)")


def test_load_state_exact_names_a_missing_residual_document(url: str) -> None:
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    ck = _checkpointer(repo, model, opt)
    _train(model, opt, x, y, 2)
    info = ck.save(2)
    rid = info.metadata["residual"]["id"]
    repo._storage.delete(residual_path(rid))
    with pytest.raises(ins.NotFoundError) as caught:
        load_state(ins.open(url), info.id, exact=True)
    assert rid in str(caught.value)


# -- CLI ------------------------------------------------------------------------------------


def _invoke(*args: str) -> Any:
    """The CLI through typer's runner, wide enough that no table column is cut."""
    return runner.invoke(app, list(args), env={"COLUMNS": "250"})


@pytest.fixture
def two_versions(tmp_path: Path) -> tuple[str, dict[str, Any], ins.SnapshotInfo]:
    """A local store with two Checkpointer versions: (url, live model state at the newest, older info)."""
    url = str(tmp_path / "store")
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    ck = _checkpointer(repo, model, opt)
    _train(model, opt, x, y, 2)
    older = ck.save(2)
    _train(model, opt, x, y, 2)
    newest = copy.deepcopy(model.state_dict())
    ck.save(4)
    ck.close()
    return url, newest, older


def test_cli_export_exact_writes_the_live_weights(two_versions, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    url, newest, _ = two_versions
    out = tmp_path / "out.safetensors"
    result = _invoke("export", url, "main", str(out), "--exact")
    assert result.exit_code == 0, result.output
    assert "bit-exact" in result.output
    _assert_identical(load_file(str(out)), dict(newest))
    pt = tmp_path / "out.pt"
    assert _invoke("export", url, "main", str(pt), "--exact").exit_code == 0
    _assert_identical(torch.load(str(pt), weights_only=True), dict(newest))

    plain = tmp_path / "plain.safetensors"
    assert _invoke("export", url, "main", str(plain)).exit_code == 0
    assert not torch.equal(load_file(str(plain))["0.weight"], newest["0.weight"])  # the stored values


def test_cli_export_exact_without_a_residual_is_one_clear_line(  # type: ignore[no-untyped-def]
        two_versions, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    url, _, older = two_versions
    out = tmp_path / "old.safetensors"
    code, _, stderr = run_main(monkeypatch, capsys, "export", url, "main~1", str(out), "--exact")
    assert code == 1
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert "--exact" in stderr and older.id[:12] in stderr and "residual" in stderr
    assert not out.exists()


def test_cli_log_and_du_show_the_residuals(two_versions) -> None:  # type: ignore[no-untyped-def]
    url, _, older = two_versions
    result = _invoke("log", url, "--json")
    assert result.exit_code == 0, result.output
    entries = json.loads(result.output)
    assert [e["step"] for e in entries] == [4, 2]
    head = ins.open(url).residual("main")
    assert head is not None and entries[0]["metadata"]["residual"]["id"] == head.ref.id
    assert entries[1]["metadata"]["residual"]["id"] == older.metadata["residual"]["id"]  # named, collected

    table = _invoke("log", url)
    assert table.exit_code == 0 and "exact" in table.output
    assert "yes (" in table.output and "no (residual collected)" in table.output
    usage = _invoke("du", url)
    assert usage.exit_code == 0 and "exact resume" in usage.output
    rows = json.loads(_invoke("du", url, "--json").output)["rows"]
    assert [r["residual_bytes"] > 0 for r in rows] == [False, True]  # oldest first

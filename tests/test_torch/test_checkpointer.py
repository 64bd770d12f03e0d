"""Checkpointer: search picks a tolerated configuration, runs off the loop, survives restarts."""

from __future__ import annotations

import logging
import uuid
import warnings
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import inshrink_store as ins  # noqa: E402
from inshrink_store.policy import QuantConfig  # noqa: E402
from inshrink_store.policy.search import SearchPoint, SearchSpace  # noqa: E402
from inshrink_store.torch import (  # noqa: E402
    DEFAULT_CONFIG,
    BackgroundSaveError,
    Checkpointer,
    Retention,
    load_state,
)

SMALL_SPACE = SearchSpace(bins=(4, 8, 16), prune=(0.0, 0.2, 0.4), protect=(0.0005, 0.005))


def _problem(seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """A linearly separable 2-class problem and an MLP big enough to be quantized (>= 4096 weights)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 32, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 2))
    return x, y, model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _accuracy(model: Any, x: Any, y: Any) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def _train(model: Any, opt: Any, x: Any, y: Any, steps: int, ck: Checkpointer | None = None) -> None:
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if ck is not None:
            ck.observe_gradients()
        opt.step()


def _index(space: SearchSpace, config: dict[str, Any]) -> tuple[int, int, int]:
    return space.index(SearchPoint.from_dict({k: config[k] for k in ("bins", "prune", "prune_metric", "protect")}))


@pytest.fixture
def url() -> str:
    return f"memory://ck-{uuid.uuid4().hex}"


def test_chosen_configuration_is_within_tolerance_and_never_more_aggressive_later(url: str) -> None:
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    tolerance = 0.02
    # the exhaustive search (max_evals=None), whose modes and neighbourhood rule this checks
    exhaustive = ins.policy.SearchPolicy(tolerance=tolerance, space=SMALL_SPACE, max_evals=None)
    ck = Checkpointer(repo, model, opt, eval_fn=lambda m: _accuracy(m, x, y), policy=exhaustive)
    configs = []
    for step in (20, 40, 60):
        _train(model, opt, x, y, 20, ck)
        ck.save(step)
        info = ck.wait()
        q = info.metadata["quantization"]
        assert q["config"] is not None, "a separable problem tolerates some quantization"
        restored = _problem()[2]
        restored.load_state_dict(load_state(repo, info.id)["model"])
        # the stored (quantized) model really is within tolerance of the live one at save time
        assert _accuracy(restored, x, y) >= q["baseline_quality"] * (1 - tolerance) - 1e-9
        configs.append((q["config"], q["search"]["mode"]))
    assert configs[0][1] == "full"
    for (prev, _), (cur, mode) in zip(configs, configs[1:], strict=False):
        if mode == "neighbourhood":
            a, b = _index(SMALL_SPACE, prev), _index(SMALL_SPACE, cur)
            assert all(bi <= ai for ai, bi in zip(a, b, strict=True)), (prev, cur)
    ck.close()
    assert [i.step for i in repo.log()] == [60, 40, 20]
    # each version's timings split eval_fn out of the search and count its calls
    searches = [i.metadata["quantization"]["search"] for i in reversed(repo.log())]
    assert len(ck.timings) == 3
    for timing, search in zip(ck.timings, searches, strict=True):
        assert 0 < timing["eval_s"] <= timing["search_s"] <= timing["total_s"]
        assert timing["evaluations"] == search["evaluations"] + 1  # + the unquantized baseline


def test_nothing_feasible_stores_the_checkpoint_lossless(url: str) -> None:
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    _train(model, opt, x, y, 5)
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    def exact(m: Any) -> float:  # any change to the weights is "worse"
        same = all(torch.equal(m.state_dict()[k], v) for k, v in reference.items())
        return 1.0 if same else 0.0

    with Checkpointer(repo, model, opt, eval_fn=exact, tolerance=0.0, space=SMALL_SPACE, background=False) as ck:
        info = ck.save(5)
    assert info.metadata["quantization"]["config"] is None
    state = load_state(repo, "main")
    for k, v in reference.items():
        assert torch.equal(state["model"][k], v), k


def test_restore_only_checkpointer_is_quiet_and_the_first_save_warns_once(url: str) -> None:
    """Issue 43, item 8: a Checkpointer that only restores stores nothing, lossy or not."""
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    with Checkpointer(repo, model, opt, lossless=True, background=False) as ck:
        ck.save(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Checkpointer(repo, model, opt) as restorer:   # no eval_fn, restore only
            assert restorer.restore() == 1
    with Checkpointer(repo, model, opt, background=False) as ck:
        with pytest.warns(UserWarning, match="no eval_fn") as caught:
            ck.save(2)
        assert len([w for w in caught if "no eval_fn" in str(w.message)]) == 1
        assert caught[0].filename == __file__, "the warning points at the caller's save()"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ck.save(3)   # said once


def test_without_eval_fn_warns_and_uses_the_default(url: str) -> None:
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    ck = Checkpointer(repo, model, opt)   # quiet: the warning comes with the first save
    _train(model, opt, x, y, 3, ck)
    with pytest.warns(UserWarning, match="no eval_fn"):
        ck.save(3)
    info = ck.wait()
    ck.close()
    assert QuantConfig.from_dict(info.metadata["quantization"]["config"]) == DEFAULT_CONFIG
    assert info.metadata["quantization"]["search"] is None


def test_background_failure_surfaces_on_the_next_call_and_loses_nothing(url: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    ck = Checkpointer(repo, model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # no eval_fn: said by the first save
        ck.save(1)
    first = ck.wait()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(repo, "transaction", broken)  # the Checkpointer commits through a write session
        ck.save(2)
        with pytest.raises(BackgroundSaveError, match="disk full") as info:
            ck.wait()
    assert isinstance(info.value.__cause__, OSError)
    assert repo.resolve("main") == first.id  # the failed save changed nothing
    ck.save(3)
    assert ck.wait().parent == first.id
    ck.close()


def test_restore_in_a_new_process_continues_the_chain(tmp_path: Path) -> None:
    """Restart = new objects over a reopened local store: model and optimizer come back,
    and the next save is a child of the restored version."""
    url = str(tmp_path / "store")
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    exhaustive = ins.policy.SearchPolicy(space=SMALL_SPACE, max_evals=None)  # its modes are checked below
    with Checkpointer(repo, model, opt, eval_fn=lambda m: _accuracy(m, x, y), policy=exhaustive) as ck:
        _train(model, opt, x, y, 10, ck)
        ck.save(10)
        saved_opt = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
        _train(model, opt, x, y, 10, ck)
        ck.save(20)
    older = ins.open(url).resolve("main~1")

    _, _, model2, opt2 = _problem(seed=1)
    repo2 = ins.open(url)
    with Checkpointer(repo2, model2, opt2, eval_fn=lambda m: _accuracy(m, x, y), policy=exhaustive) as ck2:
        assert ck2.restore(older) == 10
        stored = load_state(repo2, older)
        for k, v in stored["model"].items():
            assert torch.equal(model2.state_dict()[k], v), k
        for k in saved_opt:  # the optimizer holds what the version stores (moments compressed)
            assert torch.equal(opt2.state_dict()["state"][0][k], stored["optimizer"]["state"][0][k]), k
        assert torch.equal(opt2.state_dict()["state"][0]["step"], saved_opt["step"])  # counters exact
        _train(model2, opt2, x, y, 5, ck2)
        info = ck2.save(15)
        info = ck2.wait() or info
    assert info.parent == older
    assert info.metadata["quantization"]["search"]["mode"] in ("neighbourhood", "fallback")
    assert repo2.resolve("main") == info.id
    assert np.isfinite(_accuracy(model2, x, y))


def test_moments_are_compressed_by_default_lossless_on_request_and_a_planner_can_quantize_them(url: str) -> None:
    from inshrink_store.policy import StatePlanner

    x, y, model, opt = _problem()
    _train(model, opt, x, y, 5)
    repo = ins.open(url, create=True)
    big = lambda p, a: p.startswith("optimizer/") and a.shape and np.prod(a.shape) >= 4096  # noqa: E731
    with Checkpointer(repo, model, opt, eval_fn=lambda m: _accuracy(m, x, y), space=SMALL_SPACE) as ck:
        info = ck.save(5)
        info = ck.wait() or info
    arrays = repo.checkout("main").arrays()
    assert [p for p, a in arrays.items() if big(p, a)]
    assert all(a.storage == "quantized" for p, a in arrays.items() if big(p, a))
    assert any(a.storage == "quantized" for p, a in arrays.items() if p.startswith("model/"))
    assert any(r["storage"] == "quantized" for r in info.metadata["moments"]["tensors"].values())

    with Checkpointer(repo, model, opt, eval_fn=lambda m: _accuracy(m, x, y), space=SMALL_SPACE,
                      optimizer_policy="lossless") as ck:
        ck.save(5)
    arrays = repo.checkout("main").arrays()
    assert all(a.storage == "lossless" for p, a in arrays.items() if p.startswith("optimizer/"))

    policy = StatePlanner(QuantConfig(bins=16, protect=0.01), scope="optimizer/")
    with Checkpointer(repo, model, opt, eval_fn=lambda m: _accuracy(m, x, y), space=SMALL_SPACE,
                      optimizer_policy=policy) as ck:
        ck.save(6)
    arrays = repo.checkout("main").arrays()
    moments = {p: a for p, a in arrays.items()
               if p.startswith("optimizer/") and len(a.shape) >= 2 and np.prod(a.shape) >= 4096}
    assert moments and all(a.storage == "quantized" for a in moments.values())
    # step counters and 1-D state stay exact whatever the policy
    state = load_state(repo, "main")
    for k, v in opt.state_dict()["state"].items():
        assert torch.equal(state["optimizer"]["state"][k]["step"], v["step"])


def test_saves_ride_out_a_running_gc_and_a_fence(url: str, caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: saves raised BackgroundSaveError into the loop while a gc ran (13 of 144)."""
    import threading

    from inshrink_store import leases

    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    # no restore residual: its gc after each commit would be a second gc beside the test's
    ck = Checkpointer(repo, model, opt, gc_wait=60, exact_resume=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # no eval_fn: said by the first save
        ck.save(1)
    first = ck.wait()
    gc = repo.garbage_collector()
    gc.start()  # a gc holds the store until the save says it waits for it (no timer: a loaded
    # machine once trained past a 1.5 s timer, and the save never met the gc)
    save_waits = threading.Event()

    class _SaysItWaits(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for gc" in record.getMessage():
                save_waits.set()

    def run_gc() -> None:
        save_waits.wait(timeout=30)  # bounded: if the save never waits, the assertion below says so
        gc.mark()
        gc.sweep()
        gc.finish()

    gc_thread = threading.Thread(target=run_gc)
    gc_thread.start()
    says_it_waits = _SaysItWaits()
    logging.getLogger("inshrink_store.torch.checkpointer").addHandler(says_it_waits)
    try:
        _train(model, opt, x, y, 2, ck)
        with caplog.at_level("WARNING", logger="inshrink_store.torch.checkpointer"):
            ck.save(2)
            second = ck.wait()
    finally:
        logging.getLogger("inshrink_store.torch.checkpointer").removeHandler(says_it_waits)
        gc_thread.join()
    assert second.parent == first.id and "waiting for gc" in caplog.text and save_waits.is_set()
    # a commit fenced off by a gc (it judged this process dead) is retried, not lost
    real_fence, calls = leases.fence_for_commit, []

    def fenced_once(storage: Any, held: Any) -> None:
        calls.append(held.token)
        if len(calls) == 1:
            raise ins.LeaseBrokenError("fenced off")
        real_fence(storage, held)

    with monkeypatch.context() as patch:
        patch.setattr(leases, "fence_for_commit", fenced_once)
        ck.save(3)
        third = ck.wait()
    ck.close()
    assert len(calls) == 2 and third.parent == second.id and third.step == 3


def test_a_search_policy_or_the_old_keywords_build_the_same_policy(url: str) -> None:
    from inshrink_store.errors import FormatError
    from inshrink_store.policy import QuantizationRecord, SearchPolicy

    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    policy = SearchPolicy(tolerance=0.02, space=SMALL_SPACE)
    old = Checkpointer(repo, model, opt, eval_fn=lambda m: _accuracy(m, x, y), tolerance=0.02, space=SMALL_SPACE)
    new = Checkpointer(repo, model, opt, eval_fn=lambda m: _accuracy(m, x, y), policy=policy)
    assert old.policy == new.policy == policy and old.tolerance == 0.02 and old.space == SMALL_SPACE
    with pytest.raises(FormatError, match="either policy="):
        Checkpointer(repo, model, opt, eval_fn=lambda m: 1.0, policy=policy, tolerance=0.1)
    with pytest.raises(FormatError, match="tolerance is keyword-only"):
        cast(Any, Checkpointer)(repo, model, opt, lambda m: 1.0, 0.05)  # the 0.1 positional call
    with pytest.raises(TypeError, match="tolerence"):
        cast(Any, Checkpointer)(repo, model, opt, eval_fn=lambda m: 1.0, tolerence=0.1)
    _train(model, opt, x, y, 5, new)
    new.save(5)
    record = QuantizationRecord.from_dict(new.wait().metadata["quantization"])
    assert record.version == 1 and record.config is not None and record.search is not None
    assert record.tolerance == 0.02 and record.model_ratio_estimate is not None and record.model_ratio_estimate > 1
    old.close()
    new.close()


# -- retention, closing, the lossless option -----------------------------------------------

def _steps(repo: Any) -> set[int | None]:
    return {repo.snapshot(sid).step for sid in repo.snapshot_ids()}


def test_retention_keeps_the_last_n_and_every_mth_step(url: str, caplog: pytest.LogCaptureFixture) -> None:
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    saved = {}
    with (caplog.at_level("INFO", logger="inshrink_store.torch.checkpointer"),
          Checkpointer(repo, model, opt, lossless=True, max_to_keep=3, keep_every_n_steps=4) as ck):
        for step in range(1, 11):
            _train(model, opt, x, y, 1, ck)
            ck.save(step, extra={"epoch": step // 5})
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    assert ck.retention == Retention(max_to_keep=3, keep_every_n_steps=4)
    assert _steps(repo) == {4, 8, 9, 10}
    assert [i.step for i in repo.log()] == [10, 9, 8, 4]  # and past the removed 5-7, keep-4 (issue 43)
    tags = repo.tags()
    assert sorted(tags) == ["keep-4", "keep-8"] and tags["keep-8"] == repo.resolve("main~2")
    assert repo.snapshot(tags["keep-4"]).step == 4
    for sid in repo.snapshot_ids():
        step = repo.snapshot(sid).step
        state = load_state(repo, sid)
        assert state["extra"] == {"epoch": step // 5}
        for k, v in saved[step].items():
            assert torch.equal(state["model"][k], v), (step, k)
    assert repo.verify().problems == []
    assert "retention: gc(keep_last=3)" in caplog.text and "tagged keep-8" in caplog.text
    assert ck.last_gc is not None and ck.last_gc.kept_snapshots == 4


def test_retention_gc_refused_by_a_commit_in_progress_is_retried_at_the_next_save(
        url: str, caplog: pytest.LogCaptureFixture) -> None:
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    ck = Checkpointer(repo, model, opt, lossless=True, retention=Retention(max_to_keep=1), background=False)
    ck.save(1)
    other = repo.transaction("other")  # another writer's commit in progress: gc must refuse
    with caplog.at_level("INFO", logger="inshrink_store.torch.checkpointer"):
        ck.save(2)  # must not raise into the loop
    assert "put off to the next save" in caplog.text
    assert _steps(repo) == {1, 2}
    other.abort()
    ck.save(3)
    ck.close()
    assert _steps(repo) == {3} and repo.verify().problems == []


def test_retention_arguments_are_checked(url: str) -> None:
    from inshrink_store.errors import InvalidInputError

    repo = ins.open(url, create=True)
    model = _problem()[2]
    with pytest.raises(InvalidInputError, match="max_to_keep to be an int >= 1"):
        Retention(max_to_keep=0)
    with pytest.raises(InvalidInputError, match="Expected max_to_keep with keep_every_n_steps"):
        Checkpointer(repo, model, lossless=True, keep_every_n_steps=5)
    with pytest.raises(InvalidInputError, match="either retention="):
        Checkpointer(repo, model, lossless=True, retention=Retention(2), max_to_keep=3)
    assert Retention(2, 5).tag_for(10) == "keep-10" and Retention(2, 5).tag_for(11) is None
    assert Retention(2, 5).tag_for(10, "exp") == "keep-exp-10"


def test_save_after_close_is_a_clear_error(url: str) -> None:
    from inshrink_store.errors import InvalidInputError

    repo = ins.open(url, create=True)
    x, y, model, opt = _problem()
    with Checkpointer(repo, model, opt, lossless=True) as ck:
        ck.save(1)
    assert ck.closed
    with pytest.raises(InvalidInputError, match=r"already closed instead; create a new Checkpointer"):
        ck.save(2)
    with pytest.raises(InvalidInputError, match="to restore"):
        ck.restore()
    ck.close()  # closing twice is fine
    assert [i.step for i in repo.log()] == [1]


def test_the_warning_says_what_is_lossy_and_lossless_true_keeps_everything_exact(url: str) -> None:
    from inshrink_store.errors import InvalidInputError

    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    with Checkpointer(repo, model, opt) as ck, pytest.warns(UserWarning) as caught:
        ck.save(1)   # said with the first save
    text = str(caught[0].message)
    for part in ("model weights are stored lossy", "16 levels", "no pruning", "0.5% protected",
                 "Adam moments compressed", "lossless=True"):
        assert part in text, part
    _train(model, opt, x, y, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # lossless=True warns about nothing
        with Checkpointer(repo, model, opt, lossless=True) as ck:
            info = ck.save(3).result()
    assert all(a.storage == "lossless" for a in repo.checkout("main").arrays().values())
    assert info.metadata["quantization"]["config"] is None
    state = load_state(repo)
    for k, v in model.state_dict().items():
        assert torch.equal(state["model"][k], v), k
    with pytest.raises(InvalidInputError, match="lossless=True alone"):
        Checkpointer(repo, model, opt, eval_fn=lambda m: 1.0, lossless=True)


def test_extra_state_is_checked_in_the_loop(url: str) -> None:
    from inshrink_store.errors import InvalidInputError

    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    with pytest.raises(InvalidInputError, match=r"extra_state\['epoch'\] to have state_dict"):
        Checkpointer(repo, model, opt, lossless=True, extra_state={"epoch": 3})
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    with Checkpointer(repo, model, opt, lossless=True, extra_state={"scheduler": sched}) as ck:
        with pytest.raises(InvalidInputError, match="no pickle"):
            ck.save(1, extra={"when": object()})
        with pytest.raises(InvalidInputError, match=r"\['scheduler'\] in both"):
            ck.save(1, extra={"scheduler": 1})
        ck.save(1, extra={"epoch": 0})
    assert repo.log()[0].step == 1
    # a version saved without an extra_state entry cannot restore it: nothing is half-loaded
    with (Checkpointer(repo, model, opt, lossless=True, extra_state={"scheduler": sched, "gen": torch.Generator()}) as ck,
          pytest.raises(ins.NotFoundError, match=r"Expected extra state \['gen'\]")):
        ck.restore()


def test_a_step_saved_again_after_a_restore_moves_its_keep_tag(url: str) -> None:
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    with Checkpointer(repo, model, opt, lossless=True, max_to_keep=2, keep_every_n_steps=2) as ck:
        for step in (1, 2, 3):
            ck.save(step)
        first = repo.tags()["keep-2"]
        assert ck.restore("keep-2") == 2
        _train(model, opt, x, y, 1)
        ck.save(2)
    again = repo.tags()["keep-2"]
    assert again != first and again == repo.resolve("main") and repo.snapshot(again).parent == first
    assert repo.verify().problems == []


def _roots_of_a_short_run(url: str) -> list[str]:
    torch.manual_seed(0)
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    ck = Checkpointer(repo, model, opt, eval_fn=lambda m: _accuracy(m, x, y), tolerance=0.02,
                      space=SMALL_SPACE)
    for step in (10, 20, 30):
        _train(model, opt, x, y, 10, ck)
        ck.save(step)
        ck.wait()
    ck.close()
    return [repo.snapshot(info.id).root for info in repo.log()]


def test_what_is_stored_does_not_depend_on_how_many_threads_write_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tensors are written side by side on a thread pool; chunks are addressed by content and
    trees are sorted, so every version's root tree (its whole content: weights, moments,
    codebooks, metadata of the arrays) is the same with one writer thread or several."""
    roots = []
    for threads in ("1", "4"):
        monkeypatch.setenv("INSHRINK_WRITE_THREADS", threads)
        roots.append(_roots_of_a_short_run(f"memory://ck-{uuid.uuid4().hex}"))
    assert len(roots[0]) == 3 and roots[0] == roots[1]


def test_a_bad_thread_count_is_a_clear_error(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INSHRINK_WRITE_THREADS", "zero")
    repo = ins.open(url, create=True)
    with pytest.raises(ins.FormatError, match="INSHRINK_WRITE_THREADS"):
        repo.save({"a": np.ones((4, 4), np.float32), "b": np.zeros(3, np.float32)})
    assert "main" not in repo.branches()  # nothing committed


def test_without_a_residual_versions_are_searched_in_the_resume_space(url: str) -> None:
    """exact_resume=0: a restart resumes from what is stored, so the search runs in the
    policy's resume_space (16-64 levels, at most 40 % pruned by default), not its aggressive space."""
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    policy = ins.policy.SearchPolicy(tolerance=0.05, space=SMALL_SPACE)
    chosen = {}
    for exact in (1, 0):
        ck = Checkpointer(repo, model, opt, eval_fn=lambda m: _accuracy(m, x, y), policy=policy,
                          exact_resume=exact, branch=f"resume-{exact}")
        _train(model, opt, x, y, 20, ck)
        ck.save(20)
        chosen[exact] = ck.wait().metadata["quantization"]["config"]
        ck.close()
    assert chosen[1] is not None and chosen[1]["bins"] in SMALL_SPACE.bins
    resume = ins.policy.SearchPolicy().resume_space
    assert chosen[0] is not None and chosen[0]["bins"] in resume.bins and chosen[0]["prune"] in resume.prune
    # a point of the resume space, not of the policy's: magnitude scores, 0.5 % protected
    assert (chosen[0]["prune_metric"], chosen[0]["protect"]) == ("magnitude", 0.005)
    custom = ins.policy.SearchPolicy(resume_space=SearchSpace(bins=(64,), prune=(0.0,), protect=(0.005,)))
    assert custom.resuming().space.bins == (64,) and custom.resuming().resume_space == custom.resume_space
    with pytest.raises(ins.FormatError, match="resume_space"):
        ins.policy.SearchPolicy(resume_space=(256,))  # type: ignore[arg-type]


def test_an_evaluation_budget_bounds_eval_fn_calls_per_checkpoint(url: str) -> None:
    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    calls = []

    def eval_fn(m: Any) -> float:
        calls.append(1)
        return _accuracy(m, x, y)

    policy = ins.policy.SearchPolicy(tolerance=0.05, space=SMALL_SPACE, max_evaluations=2)
    with Checkpointer(repo, model, opt, eval_fn=eval_fn, policy=policy) as ck:
        _train(model, opt, x, y, 20, ck)
        ck.save(20)
        search = ck.wait().metadata["quantization"]["search"]
    assert search["evaluations"] <= 2 and len(calls) <= 3  # plus the unquantized baseline
    with pytest.raises(ins.FormatError, match="max_evaluations"):
        ins.policy.SearchPolicy(max_evaluations=0)


def test_an_allocation_search_stores_the_largest_tolerated_target_with_few_evaluations(url: str) -> None:
    """One knob: the target ratio. A bisection over it evaluates about log2(len) targets, the
    stored model is within tolerance, and the record says which target and what was tried."""
    x, y, model, opt = _problem(3)
    repo = ins.init(url)
    calls: list[float] = []

    def eval_fn(m: Any) -> float:
        calls.append(_accuracy(m, x, y))
        return calls[-1]

    ratios = (2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0)
    policy = ins.policy.SearchPolicy(tolerance=0.02, allocation_ratios=ratios)
    with Checkpointer(repo, model, opt, eval_fn=eval_fn, policy=policy) as ck:
        _train(model, opt, x, y, 40, ck)
        ck.save(40)
        info = ck.wait()
    record = ins.QuantizationRecord.from_dict(info.metadata["quantization"])
    trials = record.allocation_search
    assert trials is not None and 1 <= len(trials) <= 3 and len(calls) == len(trials) + 1
    baseline = calls[0]
    for trial in trials:  # each verdict is the tolerance rule applied to what was measured
        assert trial.quality is not None and trial.feasible == (trial.quality >= baseline - 0.02 * baseline)
    feasible = [t.target_ratio for t in trials if t.feasible]
    infeasible = [t.target_ratio for t in trials if not t.feasible]
    if feasible:
        assert record.allocation is not None and record.allocation.target_ratio == max(feasible)
        assert not infeasible or min(infeasible) > max(feasible)  # bisection: monotone verdicts
        restored = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 2))
        restored.load_state_dict(load_state(repo, info.id, exact=False)["model"])
        assert _accuracy(restored, x, y) >= baseline * (1 - 0.02)
    else:
        assert record.allocation is None
    assert record.config is None
    with pytest.raises(ins.FormatError, match="allocation_ratios"):
        ins.policy.SearchPolicy(allocation_ratios=(0.5,))
    assert policy.resuming().allocation_ratios is None  # resumed-as-stored versions use the resume space


def test_after_a_restore_residuals_start_from_the_restored_point_only_when_it_was_a_residual(url: str) -> None:
    """Default policy, closed loop: the first version is a keyframe (the default space), the
    next a residual (the residual space). Restoring the keyframe must not start the next
    residual search from the keyframe's point, even where that point lies on the residual
    space's axes; restoring the residual continues its neighbourhood."""
    from inshrink_store.policy import RESIDUAL_SPACE

    x, y, model, opt = _problem()
    repo = ins.open(url, create=True)
    # every point is within tolerance; the exhaustive search, whose modes tell where it started
    anything = ins.policy.SearchPolicy(tolerance=0.5, max_evals=None)

    def checkpointer() -> Checkpointer:
        return Checkpointer(repo, model, opt, eval_fn=lambda m: 1.0, policy=anything, background=False)

    with checkpointer() as ck:
        _train(model, opt, x, y, 10, ck)
        keyframe = ck.save(10)
        _train(model, opt, x, y, 10, ck)
        residual = ck.save(20)
        _train(model, opt, x, y, 10, ck)
        second = ck.save(30)
    kf = keyframe.metadata["quantization"]
    assert kf["search"]["mode"] == "full"
    # the trap the old rule fell into: the keyframe's point is a point of the residual space
    assert RESIDUAL_SPACE.index(SearchPoint.from_dict(
        {k: kf["config"][k] for k in ("bins", "prune", "prune_metric", "protect")})) is not None
    # keyframes and residuals are searched apart: the first residual searches afresh
    assert residual.metadata["quantization"]["search"]["mode"] == "full"
    assert second.metadata["quantization"]["search"]["mode"] == "neighbourhood"

    for restored, mode in ((keyframe.id, "full"), (residual.id, "neighbourhood")):
        with checkpointer() as ck:
            ck.restore(restored)
            _train(model, opt, x, y, 5, ck)
            info = ck.save(40)
        assert info.parent == restored
        assert info.metadata["quantization"]["search"]["mode"] == mode, restored

"""The README's main job, scaled down: train, checkpoint, fail, resume, report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from typer.testing import CliRunner  # noqa: E402

import inshrink_store as ins  # noqa: E402
from inshrink_store._cli import app, main  # noqa: E402
from inshrink_store.errors import FormatError  # noqa: E402
from inshrink_store.torch.demo import DEMO_MARKER, prepare_demo_store, write_demo_marker  # noqa: E402


def test_demo_compresses_weights_resumes_and_keeps_accuracy(tmp_path: Path) -> None:
    url = str(tmp_path / "demo")
    (tmp_path / "demo").mkdir()  # an empty directory is fine
    result = CliRunner().invoke(app, ["demo", url, "--steps", "120", "--every", "30", "--fail-at", "75", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [r["step"] for r in report["rows"]] == [30, 60, 90, 120]
    assert report["resumed_from_step"] == 60
    # weights are quantized: far smaller than lossless float32 (which is ~1.1x with zstd)
    assert report["model_logical_bytes"] / report["model_stored_bytes"] > 8
    assert report["stored_bytes"] < report["logical_bytes"]
    # the model restored from the last compressed version is about as good as an uncompressed run
    assert report["restored_accuracy"] >= report["reference_accuracy"] - 0.05
    # per version: "accuracy" is the stored checkpoint's, "live_accuracy" the training model's
    assert report["rows"][-1]["accuracy"] == report["restored_accuracy"]
    assert all(0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["live_accuracy"] <= 1.0 for r in report["rows"])
    assert all("live_accuracy" in i.metrics and "accuracy" not in i.metrics for i in ins.open(url).log())
    repo = ins.open(url)
    assert repo.verify().problems == []
    history = repo.log()
    # the version after the failure is a child of the version it resumed from
    parent = history[1].parent
    assert history[1].step == 90 and parent is not None and repo.snapshot(parent).step == 60


def test_demo_prints_a_table_and_the_headline(tmp_path: Path) -> None:
    url = str(tmp_path / "d")
    earlier = ins.open(url, create=True)  # a previous demo store here is replaced
    write_demo_marker(earlier)
    earlier.save({"old": np.zeros(2, np.float32)}, message="from the earlier demo")
    result = CliRunner().invoke(app, ["demo", url, "--steps", "40", "--every", "20", "--fail-at", "30"])
    assert result.exit_code == 0, result.output
    assert "smaller end to end" in result.stdout
    assert "accuracy restored from the last compressed checkpoint" in result.stdout
    repo = ins.open(url)
    assert [e.step for e in repo.log()] == [40, 20]  # nothing left of the earlier store
    assert (tmp_path / "d" / DEMO_MARKER).is_file()


def _refused(url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    """Run `inshrink demo URL` through the real entry point; it must refuse in one line."""
    monkeypatch.setattr(sys, "argv", ["inshrink", "demo", url, "--steps", "1", "--every", "1"])
    with pytest.raises(SystemExit) as info:
        main()
    stderr = capsys.readouterr().err
    assert info.value.code == 1, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert url in stderr and stderr.startswith("error: Expected"), stderr
    return stderr


def test_demo_refuses_a_folder_of_user_files(tmp_path: Path, monkeypatch, capsys) -> None:
    folder = tmp_path / "work"
    (folder / "sub").mkdir(parents=True)
    (folder / "thesis.tex").write_text("years of work")
    (folder / "sub" / "data.csv").write_text("1,2,3")
    assert "nothing was deleted" in _refused(str(folder), monkeypatch, capsys)
    assert (folder / "thesis.tex").read_text() == "years of work"
    assert (folder / "sub" / "data.csv").read_text() == "1,2,3"
    assert CliRunner().invoke(app, ["demo", str(folder), "--steps", "1"]).exit_code != 0


def test_demo_refuses_a_store_it_did_not_make(tmp_path: Path, monkeypatch, capsys) -> None:
    url = str(tmp_path / "mine")
    repo = ins.open(url, create=True)
    sid = repo.save({"w": np.ones(3, np.float32)}, message="my real checkpoint").id
    _refused(url, monkeypatch, capsys)
    assert ins.open(url).resolve("main") == sid


def test_demo_refuses_a_file_and_a_forged_marker(tmp_path: Path, monkeypatch, capsys) -> None:
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    _refused(str(target), monkeypatch, capsys)
    assert target.read_text() == "keep me"
    # a demo.json without a store, or with the wrong content, is not a demo store
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / DEMO_MARKER).write_text("{}")
    (folder / "inshrink.json").write_text("{}")
    (folder / "mine.txt").write_text("keep me")
    with pytest.raises(FormatError, match="nothing was deleted"):
        prepare_demo_store(str(folder))
    assert (folder / "mine.txt").read_text() == "keep me"


def test_prepare_demo_store_empties_only_a_demo_store(tmp_path: Path) -> None:
    url = str(tmp_path / "demo")
    repo = ins.open(url, create=True)
    write_demo_marker(repo)
    repo.save({"w": np.ones(3, np.float32)})
    prepare_demo_store(url)
    assert (tmp_path / "demo").is_dir() and list((tmp_path / "demo").iterdir()) == []
    prepare_demo_store(str(tmp_path / "nothing-here"))  # a new path: nothing to do
    assert not (tmp_path / "nothing-here").exists()

"""The README's main job, scaled down: train, checkpoint, fail, resume, report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from typer.testing import CliRunner  # noqa: E402

import inshrink_store as ins  # noqa: E402
from inshrink_store._cli import app  # noqa: E402


def test_demo_compresses_weights_resumes_and_keeps_accuracy(tmp_path: Path) -> None:
    url = str(tmp_path / "demo")
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
    repo = ins.open(url)
    assert repo.verify().problems == []
    history = repo.log()
    # the version after the failure is a child of the version it resumed from
    assert history[1].step == 90 and repo.snapshot(history[1].parent).step == 60


def test_demo_prints_a_table_and_the_headline(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["demo", str(tmp_path / "d"), "--steps", "40", "--every", "20",
                                      "--fail-at", "30"])
    assert result.exit_code == 0, result.output
    assert "smaller end to end" in result.stdout
    assert "accuracy restored from the last compressed checkpoint" in result.stdout

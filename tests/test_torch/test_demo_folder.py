"""`inshrink demo PATH` replaces only what an earlier demo recorded as its own.

An earlier demo store that the user has since put their own files in (``my-notes/``,
``results.csv``) must be refused, naming those files, and nothing deleted. These tests
stop before training (the refusal comes first) or call the folder logic directly, so
they take seconds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

import inshrink_store as ins  # noqa: E402
from inshrink_store._cli import main  # noqa: E402
from inshrink_store.errors import FormatError  # noqa: E402
from inshrink_store.torch.demo import DEMO_MARKER, prepare_demo_store, write_demo_marker  # noqa: E402


def _earlier_demo(folder: Path) -> str:
    """A store as an earlier demo left it: its marker and one version."""
    repo = ins.open(str(folder), create=True)
    write_demo_marker(repo)
    return repo.save({"w": np.ones(3, np.float32)}, message="from the earlier demo").id


def _add_user_files(folder: Path) -> None:
    (folder / "my-notes").mkdir()
    (folder / "my-notes" / "thesis.tex").write_text("years of work")
    (folder / "results.csv").write_text("1,2,3")


def _user_files_intact(folder: Path) -> None:
    assert (folder / "my-notes" / "thesis.tex").read_text() == "years of work"
    assert (folder / "results.csv").read_text() == "1,2,3"


def test_demo_cli_refuses_an_earlier_demo_store_holding_user_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "inshrink-demo"
    sid = _earlier_demo(folder)
    _add_user_files(folder)
    monkeypatch.setattr(sys, "argv", ["inshrink", "demo", str(folder), "--steps", "1", "--every", "1"])
    with pytest.raises(SystemExit) as info:
        main()
    stderr = capsys.readouterr().err
    assert info.value.code == 1, stderr
    assert stderr.startswith("error: Expected") and "Traceback" not in stderr, stderr
    assert "my-notes" in stderr and "results.csv" in stderr and "nothing was deleted" in stderr, stderr
    _user_files_intact(folder)
    assert ins.open(str(folder)).resolve("main") == sid  # the earlier demo store is left as it was


def test_prepare_demo_store_names_the_foreign_files_and_deletes_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "demo"
    sid = _earlier_demo(folder)
    _add_user_files(folder)
    with pytest.raises(FormatError, match="nothing was deleted") as info:
        prepare_demo_store(str(folder))
    assert "'my-notes/'" in str(info.value) and "'results.csv'" in str(info.value), info.value
    assert str(folder) in str(info.value)
    _user_files_intact(folder)
    assert ins.open(str(folder)).resolve("main") == sid


def test_prepare_demo_store_removes_only_what_the_marker_records(tmp_path: Path) -> None:
    folder = tmp_path / "demo"
    _earlier_demo(folder)
    recorded = json.loads((folder / DEMO_MARKER).read_text())["owns"]
    assert "objects" in recorded and DEMO_MARKER in recorded and "inshrink.json" in recorded
    prepare_demo_store(str(folder))
    assert folder.is_dir() and list(folder.iterdir()) == []


def test_a_marker_that_records_a_name_outside_the_store_layout_is_not_a_demos(tmp_path: Path) -> None:
    folder = tmp_path / "demo"
    _earlier_demo(folder)
    (folder / "results.csv").write_text("1,2,3")
    doc = json.loads((folder / DEMO_MARKER).read_text())
    (folder / DEMO_MARKER).write_text(json.dumps({**doc, "owns": [*doc["owns"], "results.csv"]}))
    with pytest.raises(FormatError, match="nothing was deleted"):
        prepare_demo_store(str(folder))
    assert (folder / "results.csv").read_text() == "1,2,3"


def test_an_earlier_releases_marker_owns_the_store_layout_only(tmp_path: Path) -> None:
    """A marker written before markers recorded their names (no ``owns``): the store's own
    layout is the demo's, anything else is refused."""
    folder = tmp_path / "demo"
    _earlier_demo(folder)
    doc = json.loads((folder / DEMO_MARKER).read_text())
    doc.pop("owns", None)
    (folder / DEMO_MARKER).write_text(json.dumps(doc))
    (folder / "results.csv").write_text("1,2,3")
    with pytest.raises(FormatError, match="results.csv"):
        prepare_demo_store(str(folder))
    (folder / "results.csv").unlink()
    prepare_demo_store(str(folder))
    assert list(folder.iterdir()) == []

"""``python -m benchmarks evaluate --quick`` runs end to end and writes the page, the plots and
the data where ``--out`` says (never into docs/).

Marked slow: the quick mode still trains three tiny workloads under every method (about a
minute on 2 shared cores); CI runs the same command directly after the test suite.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = ("ratio-vs-quality.png", "timeline.png", "restores.png", "loss-curves.png", "evaluation.json")


@pytest.mark.slow
def test_quick_evaluation_writes_its_files(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    docs = ROOT / "docs" / "evaluation.md"
    before = docs.read_bytes() if docs.exists() else None
    done = subprocess.run([sys.executable, "-m", "benchmarks", "evaluate", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    page = (tmp_path / "evaluation.md").read_text(encoding="utf-8")
    assert "## Summary" in page
    plotted = importlib.util.find_spec("matplotlib") is not None
    assert ("img/evaluation/ratio-vs-quality.png" in page) == plotted
    for name in FILES if plotted else FILES[-1:]:
        assert (tmp_path / "img" / "evaluation" / name).stat().st_size > 0, name
    results = json.loads((tmp_path / "img" / "evaluation" / "evaluation.json").read_text())
    assert set(results["workloads"]) == {"cnn", "lm", "transfer"}
    assert (docs.read_bytes() if docs.exists() else None) == before, "quick mode wrote into docs/"


def test_unknown_command_is_a_usage_error() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks", "nonsense"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "evaluate" in done.stderr

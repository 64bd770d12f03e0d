"""The search guides' code runs with warnings as errors (issue 33 item 11): the training-loop
guide's search example called ``float(loss)`` on a tensor that requires grad, which PyTorch
warns about; readers copy that loop. Both the search section of the guide and every python
block of docs/understanding/search.md run here with ``-W error``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _python_blocks(text: str) -> list[str]:
    return [part.split("```", 1)[0] for part in text.split("```python\n")[1:]]


def _section(page: Path, heading: str) -> str:
    text = page.read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


CASES = {
    "training-loop: the search": _section(DOCS / "guides" / "training-loop.md", "## Compressed checkpoints: the search"),
    "understanding/search.md": (DOCS / "understanding" / "search.md").read_text(),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_search_guide_code_runs_with_warnings_as_errors(name: str, tmp_path: Path) -> None:
    blocks = _python_blocks(CASES[name])
    assert blocks, name
    script = tmp_path / "guide.py"
    script.write_text("\n".join(blocks))
    done = subprocess.run([sys.executable, "-W", "error", str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]

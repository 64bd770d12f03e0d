"""tests/typing/user_script.py is checked by mypy --strict in .ci/run (the public API's types as
a user's type checker sees them); here it runs, so what its assertions say is also true."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "typing" / "user_script.py"


def test_the_typed_user_script_runs() -> None:
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("inshrink_user_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()

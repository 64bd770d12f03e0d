"""Running the `inshrink` CLI from tests: through typer's runner, or the real entry point."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from inshrink_store._cli import app, main

runner = CliRunner()


def run(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args))


def run_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The real entry point in-process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["inshrink", *args])
    with pytest.raises(SystemExit) as info:
        main()
    captured = capsys.readouterr()
    code = info.value.code
    return (0 if code is None else int(code)), captured.out, captured.err

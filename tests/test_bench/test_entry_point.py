"""``python -m benchmarks COMMAND``: one entry point for every benchmark (issue 45, item 4).

The benchmarks are modules of the ``benchmarks`` package, run from the repository root; none
edits ``sys.path`` to find its neighbours (twelve did, so each ran only as a script from its
own folder and imported the others as top-level modules, twice over when ``run.py`` and a test
loaded the same file). The measuring helpers they each defined again live in
``benchmarks/machine_info.py``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import __main__ as entry
from benchmarks import machine_info

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def _edits_sys_path(path: Path) -> list[int]:
    """Lines where ``path`` reads ``sys.path`` (any use: insert, append, assignment)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys"]


def test_no_benchmark_edits_sys_path() -> None:
    found = {p.relative_to(ROOT).as_posix(): lines for p in sorted(BENCHMARKS.rglob("*.py"))
             if (lines := _edits_sys_path(p))}
    assert not found, f"benchmarks that edit sys.path (import them as benchmarks.x instead): {found}"


def test_every_benchmark_file_is_a_command() -> None:
    commands = entry.commands()
    for path in BENCHMARKS.glob("bench_*.py"):
        name = path.stem.removeprefix("bench_")
        assert commands[name][0] == f"benchmarks.{path.stem}"
        assert commands[name][1], f"{path.name} has no docstring to describe its command"
    assert commands["run"][0] == "benchmarks.run" and "evaluate" in commands


def test_a_command_runs_its_benchmark_as_main() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks", "search-budget", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "--quick" in done.stdout and "exhaustive" in done.stdout


def test_help_lists_the_commands_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert entry.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("run", "evaluate", "stages", "search", "save_cost"))


def test_best_of_is_the_fastest_call_and_returns_the_last_result() -> None:
    calls: list[int] = []

    def fn() -> int:
        calls.append(1)
        return len(calls)

    seconds, result = machine_info.best_of(fn, 3)
    assert len(calls) == 3 and result == 3 and seconds >= 0
    with pytest.raises(ValueError, match="repeats=0"):
        machine_info.best_of(fn, 0)


def test_dir_bytes_counts_files_only(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"12345")
    (tmp_path / "y").write_bytes(b"12")
    assert machine_info.dir_bytes(tmp_path) == 7

"""``python -m benchmarks COMMAND [options]``: the one entry point of every benchmark.

``run`` writes the whole page (docs/benchmarks.md); ``evaluate`` the evaluation
(docs/evaluation.md); every other command is one benchmark, ``benchmarks/bench_COMMAND.py``
(``python -m benchmarks stages`` runs ``bench_stages.py``), with its own options (``--help``).
Run from the repository root: the benchmarks are modules of the ``benchmarks`` package and
import each other as such (nothing edits the import path), so the module form
``python -m benchmarks.bench_stages`` works too, and running a file as a script does not.

The commands are found from the files, each described by its docstring's first line, so a new
``bench_*.py`` is a command without an edit here, and listing them imports nothing heavy.
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: commands that are not a ``bench_*.py``: name -> (module, what it does)
FIXED = {
    "run": ("benchmarks.run", "every section of docs/benchmarks.md, written there (--quick: small sizes)"),
    "evaluate": ("benchmarks.evaluate.cli",
                 "fault tolerance with ten restores, baselines, ablations, sweeps -> docs/evaluation.md"),
}


def _summary(path: Path) -> str:
    """The first sentence-line of a benchmark's docstring, read without importing it."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    return first if len(first) <= 90 else first[:87] + "..."


def commands() -> dict[str, tuple[str, str]]:
    """Every command: name -> (module to run as ``__main__``, what it does)."""
    found = dict(FIXED)
    for path in sorted(HERE.glob("bench_*.py")):
        name = path.stem.removeprefix("bench_")
        found[name] = (f"benchmarks.{path.stem}", _summary(path))
    return found


def usage(known: dict[str, tuple[str, str]]) -> str:
    width = max(map(len, known))
    lines = [f"  {name:{width}}  {what}" for name, (_, what) in known.items()]
    return ("usage: python -m benchmarks COMMAND [options]   (from the repository root)\n\n"
            "commands:\n" + "\n".join(lines))


def main(argv: list[str]) -> int:
    known = commands()
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(usage(known))
        return 0
    name = argv[0].replace("-", "_") if argv else ""
    if name not in known:
        print(usage(known), file=sys.stderr)
        if argv:
            print(f"\nno benchmark command {argv[0]!r}", file=sys.stderr)
        return 2
    module, _ = known[name]
    if name == "evaluate":
        from benchmarks.evaluate.cli import main as evaluate

        return evaluate(argv[1:])
    # as ``python -m benchmarks NAME ARGS`` would run it: its own __main__ block parses
    # sys.argv and may raise SystemExit with its status
    sys.argv = [f"python -m benchmarks {name}", *argv[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

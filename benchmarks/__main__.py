"""``python -m benchmarks evaluate [--quick] [--out DIR]``: the evaluation (docs/evaluation.md).

The other benchmarks keep their own command, ``python benchmarks/run.py`` (docs/benchmarks.md).
"""

from __future__ import annotations

import sys

COMMANDS = {"evaluate": "fault tolerance with ten restores, baselines, ablations, sweeps -> docs/evaluation.md"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        lines = [f"  {name:10} {what}" for name, what in COMMANDS.items()]
        print("usage: python -m benchmarks COMMAND [options]\n\ncommands:\n" + "\n".join(lines), file=sys.stderr)
        return 2
    from benchmarks.evaluate.cli import main as evaluate

    return evaluate(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

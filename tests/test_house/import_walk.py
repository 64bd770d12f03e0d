"""The package's modules and the imports each makes, resolved exactly: what the house tests on
fan-out (``test_fan_out``) and on the clients' two doors (``test_two_doors``) both count.

``from a import b`` where ``a.b`` is a module imports ``a.b``; relative imports resolve
against the module's package; only ``inshrink_store`` imports are kept."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "inshrink_store"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


#: every module of the package, by dotted name
MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolved_imports(module: str, nodes: Iterable[ast.AST]) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for every import among ``nodes``
    (the caller picks them: every node, or the run-time ones) of ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: list[tuple[str, str | None, int]] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "inshrink_store"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            if origin.split(".")[0] != "inshrink_store":
                continue
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                found.append((sub, None, node.lineno) if sub in MODULES else (origin, alias.name, node.lineno))
    return found

"""docs/reference/modules.md names every module of the package, so a new reader finds the
layer of any change there: a module added without a row fails here (the map was stale in the
commit that wrote it, missing seven modules)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_module_map_names_every_module() -> None:
    text = (ROOT / "docs" / "reference" / "modules.md").read_text()
    missing = []
    for path in sorted((ROOT / "inshrink_store").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        module = path.relative_to(ROOT / "inshrink_store").with_suffix("").as_posix()
        # a row names it by its path (`torch/dcp`) or, in a row of siblings, by its name (`settings`)
        if f"`{module}`" not in text and f"`{path.stem}`" not in text:
            missing.append(module)
    assert not missing, f"docs/reference/modules.md names no row for {missing}"


def test_every_module_the_map_names_exists() -> None:
    text = (ROOT / "docs" / "reference" / "modules.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    named = {cell.strip("`") for line in table for cell in line.split("|")[2].replace(",", " ").split()
             if cell.startswith("`") and cell.endswith("`")}
    modules = {p.relative_to(ROOT / "inshrink_store").with_suffix("").as_posix()
               for p in (ROOT / "inshrink_store").rglob("*.py")}
    stems = {m.rsplit("/", 1)[-1] for m in modules} | {m.split("/", 1)[0] for m in modules}
    stale = sorted(n for n in named if n not in modules and n not in stems and n != "module")
    assert not stale, f"docs/reference/modules.md names modules that do not exist: {stale}"

"""House rules that keep the package's names in one place.

1. Each on-disk name the store depends on has one home module that spells it; every other
   module imports the constant. A re-spelling elsewhere is how two copies drift apart (a
   renamed codec id that one check still looks for under its old name). Only code counts:
   comments and docstrings may mention the names, so the scan reads string literals through
   ``ast``, never the raw text.
2. ``docs/reference/modules.md`` has a row for every module of the package and names no module
   that no longer exists (what a new reader looks up to find where a change belongs).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from inshrink_store import layout, structure
from inshrink_store.codecs import bytegroup, nuq, vdelta

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "inshrink_store"
MODULE_MAP = ROOT / "docs" / "reference" / "modules.md"

# -- one place for each name ----------------------------------------------------------------

#: each name -> the one module (relative to inshrink_store/) that may spell it as a literal
HOMES: dict[str, str] = {
    # the zarr metadata key: index.METADATA_KEY re-exports it; its home is below index in the
    # layers because structure.py (which index may import, never the reverse) refuses it as a key
    structure.METADATA_KEY: "structure.py",
    layout.CONFIG_FILE: "layout.py",  # the store's settings file, inshrink.json
    nuq.CODEC_ID: "codecs/_nuq_config.py",
    vdelta.CODEC_ID: "codecs/vdelta.py",
    bytegroup.CODEC_ID: "codecs/bytegroup.py",
}

#: (module, name) re-spellings left in modules this change did not edit. Remove a row when
#: its module imports the constant; the test fails on a row whose module still exists and no
#: longer re-spells the name.
ALLOWED: set[tuple[str, str]] = set()


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the nodes that are docstrings (a module's, class's or function's first statement)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _spellings(source: str) -> set[str]:
    """The HOMES names that the code of ``source`` spells as a key: a string literal (f-string
    parts included) that is the name or has it as a path segment (``"zarr.json"``,
    ``f"{path}/zarr.json"``). Prose may name them: comments, docstrings, and messages (a
    literal with a space in it), which say the name to a reader and look nothing up by it."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    spelled = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
                and not re.search(r"\s", node.value)):
            spelled |= {name for name in HOMES if re.search(rf"(?:^|/){re.escape(name)}(?:/|$)", node.value)}
    return spelled


def _modules() -> dict[str, str]:
    return {p.relative_to(PACKAGE).as_posix(): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_scan_reads_code_not_prose() -> None:
    source = '''"""A docstring naming zarr.json and inshrink.nuq."""
# a comment naming "zarr.json"
def f(key):
    """Reads "inshrink.json"."""
    return key == "zarr.json" or key.endswith(f"/{key}/zarr.json")
'''
    assert _spellings(source) == {"zarr.json"}
    assert _spellings('x = f"{id}:inshrink.nuq"; y = "codecs/inshrink.nuq/README.md"') == {"inshrink.nuq"}
    assert _spellings('x = f"Expected {key} in the inshrink.nuq configuration"') == set()  # a message
    assert _spellings('x = "inshrink.nuqx"; y = "my.zarr.json"; z = "zarr.jsonl"') == set()


def test_each_on_disk_name_is_spelled_in_its_home_module_only() -> None:
    codec_ids = {module.CODEC_ID for module in (nuq, vdelta, bytegroup)}
    declared = {m.group(1) for m in re.finditer(r'CODEC_ID = "([^"]+)"',
                                                 "".join(p.read_text() for p in (PACKAGE / "codecs").glob("*.py")))}
    assert declared == codec_ids, f"a codec id missing from HOMES: {sorted(declared - codec_ids)}"
    spelled = {(module, name) for module, source in _modules().items() for name in _spellings(source)}
    elsewhere = {(module, name) for module, name in spelled if HOMES[name] != module}
    assert not elsewhere - ALLOWED, (
        f"import these names from their home modules instead: "
        f"{sorted(f'{m}: {n!r} (home {HOMES[n]})' for m, n in elsewhere - ALLOWED)}")
    stale = {(module, name) for module, name in ALLOWED - elsewhere if (PACKAGE / module).exists()}
    assert not stale, f"remove these rows from ALLOWED: {sorted(stale)}"
    assert {name for module, name in spelled if HOMES[name] == module} == set(HOMES), "a home lost its name"


# -- the module map --------------------------------------------------------------------------

#: modules without a row of their own, each named: the package __init__s, which re-export
#: what their folders' rows name (the top one is the public API, docs/reference/names.md),
#: and the CLI's ``python -m`` entry, which calls the ``_cli`` row's main. A new subpackage's
#: __init__ needs a row or a line here.
NO_ROW = {"__init__", "admin/__init__", "codecs/__init__", "policy/__init__", "storage/__init__",
          "testing/__init__", "torch/__init__", "_cli/__main__"}

#: modules whose rows the map may lack for now (none: every module has its row)
IN_FLUX: tuple[str, ...] = ()


def _in_flux(module: str) -> bool:
    return any(module == name or module.startswith(name + "/") for name in IN_FLUX)


def _package_modules() -> set[str]:
    """``torch/dcp``, ``torch/__init__``: every module below inshrink_store/."""
    return {p.relative_to(PACKAGE).with_suffix("").as_posix() for p in PACKAGE.rglob("*.py")}


def _existing(name: str, modules: set[str]) -> bool:
    """A name in the map is a module or a package (``_cli`` once it is a folder)."""
    return name in modules or f"{name}/__init__" in modules


def _map_names() -> set[str]:
    """Every module the map's table rows name in their module column, as a path below
    inshrink_store/: ``torch/dcp``, and in a row of siblings the later ones by their name,
    which this reads in the folder of the row's last path (``admin/diff``, ``verify``)."""
    names = set()
    for line in MODULE_MAP.read_text().splitlines():
        if not line.startswith("| "):
            continue
        folder = ""
        for name in re.findall(r"`([^`]+)`", line.split("|")[2]):
            if "/" in name:
                folder = name.rsplit("/", 1)[0] + "/"
            names.add(name if "/" in name else folder + name)
    return names


def test_the_module_map_has_a_row_for_every_module() -> None:
    named = _map_names()
    missing = sorted(m for m in _package_modules() - NO_ROW - named
                     if not _in_flux(m) and not (m.endswith("/__init__") and m[: -len("/__init__")] in named))
    assert not missing, f"docs/reference/modules.md has no row for {missing}"


def test_the_module_map_names_no_module_that_does_not_exist() -> None:
    modules = _package_modules()
    stale = sorted(n for n in _map_names() | NO_ROW if not _existing(n, modules) and not _in_flux(n))
    assert not stale, f"docs/reference/modules.md (or NO_ROW) names modules that do not exist: {stale}"

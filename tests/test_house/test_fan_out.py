"""No module of the package imports more than 12 of its other modules (issue 45, done-when:
"no module importing more than 12 internal modules").

A module that imports a dozen rooms of the house is doing a dozen rooms' work, or standing in
a corridor everything passes through; either way a change anywhere reaches it. The count is a
test so that it can only go down: a module over the cap that is not on :data:`OVER_CAP` fails
here by name, and one on the list fails if it imports more than it did when the test was written.

What counts: the distinct modules of ``inshrink_store`` a module imports at run time, resolved
exactly as ``tests/test_house/test_two_doors.py`` resolves them (relative imports against the
module's package; ``from pkg import name`` counts ``pkg.name`` when that is a module, else
``pkg``; imports inside functions count). Imports under ``if TYPE_CHECKING:`` do not count:
they are read by the type checker only, never run, and tie no room to another at import time.
"""

from __future__ import annotations

import ast

from tests.test_house.import_walk import MODULES, resolved_imports

CAP = 12

#: module -> the most internal modules it may import until someone narrows it (its count when
#: this test was written, main ac1b61d, or lower since); remove the row when it is at or under
#: the cap. (session 15, policy.allocation 15, policy.partition 13 and policy.candidates 13 were
#: narrowed to 12 and left the list: write_threads moved to parallel, type-only imports under
#: TYPE_CHECKING, compensated() to policy.compensation, the residual's stored values to residual.
#: policy 17 -> 12: the entry no longer re-exports what no client takes from it (candidates,
#: kmeans, partition, ratio, settings: imported from their modules); repository 13 -> 12: making
#: and opening a store, with its settings file, moved to store_settings.)
OVER_CAP: dict[str, int] = {}




def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _run_time_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but the bodies of ``if TYPE_CHECKING:`` (their ``else`` runs)."""
    found: list[ast.AST] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo += [node.test, *node.orelse]
        else:
            todo += ast.iter_child_nodes(node)
    return found


def internal_imports(module: str, source: str | None = None) -> set[str]:
    """The other modules of the package ``module`` imports at run time (``source``: its text,
    read from disk unless given)."""
    tree = ast.parse(MODULES[module].read_text() if source is None else source)
    return {imported for imported, _, _ in resolved_imports(module, _run_time_nodes(tree))} - {module}


def fan_out() -> dict[str, int]:
    return {module: len(internal_imports(module)) for module in MODULES}


def test_no_module_imports_more_than_the_cap() -> None:
    over = {m: n for m, n in fan_out().items() if n > CAP and m not in OVER_CAP}
    assert not over, (f"modules importing more than {CAP} internal modules (issue 45: narrow them): "
                      + ", ".join(f"{m} ({n})" for m, n in sorted(over.items())))


def test_modules_over_the_cap_today_do_not_grow() -> None:
    found = fan_out()
    grown = {m: (found.get(m, 0), most) for m, most in OVER_CAP.items() if found.get(m, 0) > most}
    assert not grown, "allow-listed modules import more than their ceiling: " + ", ".join(
        f"{m} ({n}, ceiling {most})" for m, (n, most) in grown.items())


def test_the_allow_list_names_modules_that_exist() -> None:
    """A row for a module that was renamed or removed would keep a ceiling nobody checks."""
    assert sorted(set(OVER_CAP) - set(MODULES)) == []


def test_the_walk_resolves_imports_exactly() -> None:
    """The walk can fail: relative imports resolve against the package, a submodule taken by
    ``from`` counts as itself, a name counts as its module, a function's import counts, and
    a TYPE_CHECKING import does not (its ``else`` does)."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import errors, layout\n"  # inshrink_store.repository -> inshrink_store.errors, .layout
        "from .policy import SaveDecider\n"  # a name: counts inshrink_store.policy
        "import inshrink_store.cas\n"
        "if TYPE_CHECKING:\n"
        "    from .storage import Storage\n"
        "else:\n"
        "    from .refs import Refs\n"
        "def f():\n"
        "    from .codecs.nuq import x\n"
    )
    assert internal_imports("inshrink_store.repository", source) == {
        "inshrink_store.errors", "inshrink_store.layout", "inshrink_store.policy", "inshrink_store.cas",
        "inshrink_store.refs", "inshrink_store.codecs.nuq"}

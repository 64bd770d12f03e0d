"""The house has two doors (issue 45): the clients — ``torch/``, ``lightning/``, ``hf*.py`` and
``_cli/`` — enter the store through its public API and the policy through its one entry, and
reach no private name of another module.

Why a test beside the import-linter contract: the contract ("Clients enter through two doors",
pyproject.toml) refuses an import of a store internal, but it cannot see an attribute reach
(``repo._parts``, ``reader._zarr``) nor a private name taken from a door
(``from inshrink_store.repository import _x``); this walk of the clients' syntax trees sees
both, counts the store modules the clients import (at most :data:`MOST_STORE_MODULES`), and
checks that the contract forbids every store module outside :data:`DOORS`, so a new internal
module cannot become a side door by being left off its list. Before issue 45 the clients
imported 38 store modules and took 20 private names of other modules: 10 attribute reaches
(``repo._parts`` three times, ``reader._zarr``, ``io._exact_resume_given``, and Lightning's
subclass of retention's ``_OtherBranchesKept`` reading its base's ``_history`` and ``_branch``)
and 10 ``from`` imports of ``_x`` between the modules of ``torch/`` and into ``lightning/``.
"""

from __future__ import annotations

import ast
import fnmatch
import tomllib

from tests.test_house.import_walk import MODULES, ROOT, resolved_imports

#: the store modules a client may import: the public store API and the policy entry
#: (docs/reference/architecture.md, "Two doors"); every other store module is an internal
DOORS = frozenset({
    # door 1, the public store API
    "inshrink_store",  # what the package exports
    "inshrink_store.repository",  # Repository, WriteSession, open, the gc and codebooks of a version
    "inshrink_store.errors",
    "inshrink_store.storage",  # open_storage and the URL schemes
    "inshrink_store.admin",  # the admin reports (du, diff, verify, gc), as the package exports them
    "inshrink_store.rank_writer",  # one rank's arrays of a distributed save, beside the write session
    # ... and the data model those speak: names of the format, state trees, dtypes, plans
    "inshrink_store.layout",
    "inshrink_store.structure",
    "inshrink_store.dtypes",
    "inshrink_store.plans",
    "inshrink_store.dcp_document",
    "inshrink_store.parallel",
    # door 2, the policy's entry: what a save's decision needs
    "inshrink_store.policy",
})

#: the done-when of issue 45
MOST_STORE_MODULES = 15

#: private attributes a client may reach on another module's object: torch's own convention
#: (``state_dict._metadata``, which ``load_state_dict`` reads; torch documents it)
TORCH_CONVENTIONS = frozenset({"_metadata"})




def is_client(module: str) -> bool:
    parts = module.split(".")
    return len(parts) > 1 and (parts[1] in ("torch", "lightning", "_cli") or parts[1].startswith("hf"))


def _shares_privates(module: str, imported: str) -> bool:
    """Whether ``module`` may take a private name from ``imported``: only inside a package that
    is private as a whole (``inshrink_store._cli``, whose modules share their output helpers);
    ``torch``, ``lightning`` and the store are public packages, where a name another module
    needs is public."""
    package = module.split(".")[:2]
    return imported.split(".")[:2] == package and package[-1].startswith("_")


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for every import in ``module``;
    imports inside functions and TYPE_CHECKING count."""
    return resolved_imports(module, ast.walk(ast.parse(MODULES[module].read_text())))


def store_modules_imported() -> set[str]:
    """The store modules (every module of the package but the clients') the clients import."""
    return {imported for module in MODULES if is_client(module)
            for imported, _, _ in _imports(module) if not is_client(imported)}


def _defined_names(tree: ast.AST) -> set[str]:
    """Names a module defines itself: functions, classes, assigned names and ``self.x = ...``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


def private_reaches() -> list[str]:
    """Every private name a client takes from another module: a ``from`` import of ``_x``
    (outside the private ``_cli`` package), and an attribute
    ``obj._x`` whose name the module does not define itself (``self``/``cls`` on its own
    attributes, ``super()`` on a base class it defines, torch's conventions excepted)."""
    found = []
    for module, path in sorted(MODULES.items()):
        if not is_client(module):
            continue
        where = path.relative_to(ROOT)
        for imported, name, line in _imports(module):
            private = name is not None and name.startswith("_") and not name.startswith("__")
            if private and not _shares_privates(module, imported):
                found.append(f"{where}:{line}: from {imported} import {name}")
        tree = ast.parse(path.read_text())
        own = _defined_names(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and node.attr not in own and node.attr not in TORCH_CONVENTIONS):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_clients_reach_no_private_name_of_another_module() -> None:
    assert private_reaches() == []


def test_clients_import_only_the_doors() -> None:
    imported = store_modules_imported()
    assert imported <= DOORS, f"side doors: {sorted(imported - DOORS)}"
    assert len(imported) <= MOST_STORE_MODULES


def test_the_contract_forbids_every_store_module_outside_the_doors() -> None:
    """The import-linter contract names the clients as sources and forbids, by name or by
    wildcard, every store module that is not a door (and no door)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    contract, = (c for c in config if c["type"] == "forbidden" and "inshrink_store.torch" in c["source_modules"])
    assert contract.get("allow_indirect_imports") in (True, "true", "True")

    def forbidden(module: str) -> bool:
        return any(module == pattern or module.startswith(pattern + ".") or fnmatch.fnmatchcase(module, pattern)
                   for pattern in contract["forbidden_modules"])

    store = {m for m in MODULES if not is_client(m)}
    assert sorted(m for m in store - DOORS if not forbidden(m)) == []
    assert sorted(m for m in DOORS if forbidden(m)) == []
    assert sorted(m for m in MODULES if is_client(m) and not any(
        m == s or m.startswith(s + ".") for s in contract["source_modules"])) == []


def test_the_walk_resolves_imports_exactly() -> None:
    """The walk above can fail: a relative import, a submodule taken by ``from`` and a private
    attribute reach are each seen."""
    assert is_client("inshrink_store.torch.dcp_writer") and not is_client("inshrink_store.reader")
    writer = {imported for imported, _, _ in _imports("inshrink_store.torch.dcp_writer")}
    assert "inshrink_store.errors" in writer
    tree = ast.parse("repo._parts.refs\nself._own = 1\nself._own\n")
    reached = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")
               and n.attr not in _defined_names(tree)]
    assert reached == ["repo._parts"]

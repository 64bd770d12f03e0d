"""The stage table of ``benchmarks/bench_stages.py`` times library functions by patching them
by name: a function renamed in the library must fail here, not halfway through
``python -m benchmarks run`` (a rename of ``partition._error_stats`` once did)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest


def _stages() -> Any:
    """The benchmark as ``python -m benchmarks stages`` imports it: a module of the package."""
    return importlib.import_module("benchmarks.bench_stages")


@pytest.mark.parametrize("table", ["SAVE_STAGES", "LOAD_STAGES"])
def test_every_timed_stage_names_a_function_the_library_has(table: str) -> None:
    stages = getattr(_stages(), table)
    assert stages
    for name, _where, places, _included in stages:
        for owner, attribute in places:
            assert callable(owner.__dict__.get(attribute)) or isinstance(
                owner.__dict__.get(attribute), (classmethod, staticmethod)), (name, owner, attribute)

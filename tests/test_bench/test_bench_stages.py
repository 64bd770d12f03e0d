"""The stage table of ``benchmarks/bench_stages.py`` times library functions by patching them
by name: a function renamed in the library must fail here, not halfway through
``python benchmarks/run.py`` (a rename of ``partition._error_stats`` once did)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_stages.py"


def _stages() -> Any:
    spec = importlib.util.spec_from_file_location("bench_stages_under_test", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("table", ["SAVE_STAGES", "LOAD_STAGES"])
def test_every_timed_stage_names_a_function_the_library_has(table: str) -> None:
    stages = getattr(_stages(), table)
    assert stages
    for name, _where, places, _included in stages:
        for owner, attribute in places:
            assert callable(owner.__dict__.get(attribute)) or isinstance(
                owner.__dict__.get(attribute), (classmethod, staticmethod)), (name, owner, attribute)

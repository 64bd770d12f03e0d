"""The GPU training comparison's small CPU form: every way of saving runs, commits and
restores the last save's state exactly (the harness CI can check; its GPU figures come
from a device run, docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu_training.py"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gpu_training_under_test", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_way_of_saving_restores_the_last_save_exactly(tmp_path):
    bench = _bench()
    lines: list[str] = []
    out = tmp_path / "rows.json"
    rows = bench.main(["--small", "--steps", "4", "--every", "2", "--json", str(out)], emit=lines.append)
    names = [r.name for r in rows]
    assert names == [v.name for v in bench.VARIANTS]
    for row in rows[1:]:
        assert row.exact is True, row.name
        assert len(row.blocked_ms) == 2 and row.disk_mb > 0, row.name
    ours = {r.name: r for r in rows}["inshrink lossless"]
    assert len(ours.details["timings"]) == 2  # the Checkpointer's own timing of each save
    assert json.loads(out.read_text())[0]["name"] == "none"
    assert "| inshrink compressed |" in lines[-1]

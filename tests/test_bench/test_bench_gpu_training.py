"""The GPU training comparison's small CPU form: every way of saving runs, commits and
restores the last save's state exactly (the harness CI can check; its GPU figures come
from a device run, docs/benchmarks.md)."""

from __future__ import annotations

import importlib
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _bench():
    """The benchmark as ``python -m benchmarks gpu_training`` imports it: a module of the package."""
    return importlib.import_module("benchmarks.bench_gpu_training")


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

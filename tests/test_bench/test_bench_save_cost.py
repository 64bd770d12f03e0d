"""The save-cost benchmark's quick form (``python -m benchmarks save_cost --quick``): every row of
issue 42's table is measured on a tiny MLP, the Checkpointer rows with their blocked time,
and the section names its targets. About 20 s on 2 cores."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("torch")


def _bench():
    """The benchmark as ``python -m benchmarks save_cost`` imports it: a module of the package."""
    return importlib.import_module("benchmarks.bench_save_cost")


def test_the_quick_form_measures_every_row(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "save_cost.md"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    text = out.read_text()
    assert text == capsys.readouterr().out.rstrip("\n") + "\n"
    result = bench.run(quick=True, rounds=2, steps=1)
    rows = bench.summary(result)
    assert list(rows) == list(bench.ROWS)
    for row in bench.ROWS:
        assert len(result["seconds"][row]) >= 1 and rows[row]["seconds"] > 0, row
    for row in bench.ROWS[2:]:  # the Checkpointer's: blocked is part of the save
        assert 0 <= rows[row]["blocked"] <= rows[row]["seconds"], row
    assert result["later_ratio"] > 1.0  # the later saves stored compressed
    for row in ("Checkpointer lossless", "compressed, first save", "compressed, later saves"):
        assert f"| {row} |" in text
    assert "<= 10x" in text and "<= 3x" in text and "<= 1.5x" in text and "blocked <=" in text


def test_stages_profile_a_first_and_a_later_save(tmp_path):
    bench = _bench()
    result = bench.run(quick=True, rounds=1, steps=1, stages=True)
    profile = result["stages"]
    names = [name for name, _where in profile["stages"]]
    for label in ("first", "later"):
        save = profile[label]
        assert save["cpu"] > 0 and save["wall"] > 0, label
        assert set(save["spent"]) <= set(names), label
        # the state's moments are compressed and its weights planned on every save
        assert save["spent"]["Adam moments: quantize, guard"] > 0, label
        assert save["spent"]["write (fsynced files)"] > 0, label
    assert profile["later"]["spent"].get("delta against the parent's ids", 0) > 0  # a later save deltas
    text = bench.to_markdown(result)
    assert "--stages" in text and "| Adam moments: quantize, guard |" in text

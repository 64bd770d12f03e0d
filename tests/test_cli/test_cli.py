"""The inshrink CLI on a store written through the Python API: exit codes, JSON, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

import inshrink_store as ins
from inshrink_store._cli import app

runner = CliRunner()


@pytest.fixture
def store(tmp_path):
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    repo.save({"model/w": w, "model/b": np.zeros(32, np.float32)}, message="one", step=1,
              metrics={"loss": 2.0})
    repo.save({"model/w": w + 1, "model/b": np.zeros(32, np.float32)}, message="two", step=2)
    return url


def run(*args: str):
    return runner.invoke(app, list(args))


def test_log_json_lists_versions_newest_first(store):
    result = run("log", store, "--json")
    assert result.exit_code == 0, result.output
    entries = json.loads(result.stdout)
    assert [e["message"] for e in entries] == ["two", "one"]
    assert entries[1]["metrics"] == {"loss": 2.0} and entries[0]["step"] == 2


def test_ls_json_reports_shapes_and_bytes(store):
    result = run("ls", store, "main~1", "--json")
    assert result.exit_code == 0, result.output
    rows = {r["tensor"]: r for r in json.loads(result.stdout)["tensors"]}
    assert rows["model/w"]["shape"] == [64, 32] and rows["model/w"]["dtype"] == "F32"
    assert rows["model/w"]["logical_bytes"] == 64 * 32 * 4 and rows["model/w"]["stored_bytes"] > 0


def test_diff_values_json(store):
    result = run("diff", store, "main~1", "main", "--values", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    by_path = {t["path"]: t for t in doc["tensors"]}
    assert by_path["model/w"]["status"] == "changed" and by_path["model/b"]["status"] == "unchanged"
    assert by_path["model/w"]["max_abs_change"] == pytest.approx(1.0)


def test_show_reads_statistics(store):
    result = run("show", store, "main", "w", "--json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    assert stats["tensor"] == "model/w" and stats["numel"] == 64 * 32 and stats["nan"] == 0


def test_tag_verify_gc_du(store):
    assert run("tag", store, "first", "main~1").exit_code == 0
    assert run("tag", store, "first", "main").exit_code == 1  # write-once
    assert run("verify", store).exit_code == 0
    du = json.loads(run("du", store, "--json").stdout)["rows"]
    assert len(du) == 2 and du[1]["new_stored_bytes"] < du[0]["new_stored_bytes"] * 2
    dry = json.loads(run("gc", store, "--keep-last", "1", "--dry-run", "--json").stdout)
    assert dry["dry_run"] is True and dry["kept_snapshots"] == 2  # the tag keeps main~1


def test_unknown_ref_and_missing_store_fail_cleanly(store, tmp_path):
    """Through the real entry point: exit 1, one clear line naming the ref, no traceback."""
    for args, needle in ((["ls", store, "no-such-ref"], "no-such-ref"),
                         (["log", str(tmp_path / "nowhere")], "inshrink init")):
        proc = subprocess.run([sys.executable, "-m", "inshrink_store._cli", *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert needle in proc.stderr.replace("\n", "") and "Traceback" not in proc.stderr


def test_usage_error_exits_2(store):
    assert run("diff", store).exit_code == 2


def test_verify_exits_1_on_a_corrupt_object(store, tmp_path):
    objects = sorted((tmp_path / "store" / "objects").rglob("*"))
    victim = next(p for p in objects if p.is_file())
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    result = run("verify", store, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert not report["ok"] and report["problems"][0]["id"] == victim.parent.name + victim.name

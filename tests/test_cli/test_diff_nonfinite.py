"""`diff --values` with inf and NaN (issue 43, item 4).

A user's unchanged tensor holding inf showed ``max |Δ| nan, rel L2 Δ inf``: inf - inf is NaN,
and the figures were taken over the finite differences only. A bit-equal tensor now shows 0
change, equal infs (and NaNs in the same place) are no change, and a value that becomes or
stops being inf or NaN is an unbounded change (inf).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

import inshrink_store as ins
from tests._cli_helpers import run

INF = np.inf


def _two_versions(tmp_path: Path) -> tuple[str, dict[str, dict[str, object]]]:
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    a = {"model/all_inf": np.array([INF, -INF], np.float32),  # e.g. a best score not yet set
         "model/inf_and_nan": np.array([INF, np.nan, 1.0, -INF], np.float32),
         "model/steady_inf": np.array([INF, 1.0, 2.0], np.float32),
         "model/becomes_inf": np.array([1.0, 2.0], np.float32),
         "model/same_nan_moved": np.array([np.nan, 4.0, 2.0], np.float32),
         "model/w": np.arange(6, dtype=np.float32)}
    repo.save(a, step=0)
    b = {**a, "model/steady_inf": np.array([INF, 1.5, 2.0], np.float32),
         "model/becomes_inf": np.array([1.0, INF], np.float32),
         "model/same_nan_moved": np.array([np.nan, 4.0, 2.0], np.float32) + np.float32(0),
         "model/w": np.arange(6, dtype=np.float32) + 1}
    repo.save(b, step=1)
    result = run("diff", url, "main~1", "main", "--values", "--json")
    assert result.exit_code == 0, result.output
    return url, {t["path"]: t for t in json.loads(result.stdout)["tensors"]}


def test_unchanged_tensors_holding_inf_or_nan_show_no_change(tmp_path: Path) -> None:
    _, by_path = _two_versions(tmp_path)
    for path in ("model/all_inf", "model/inf_and_nan", "model/same_nan_moved"):
        assert by_path[path]["status"] == "unchanged", path
        assert by_path[path]["max_abs_change"] == 0.0, (path, by_path[path])
        assert by_path[path]["rel_l2_change"] == 0.0, (path, by_path[path])


def test_equal_infs_are_no_change_and_a_new_inf_is_unbounded(tmp_path: Path) -> None:
    _, by_path = _two_versions(tmp_path)
    steady = by_path["model/steady_inf"]
    assert steady["status"] == "changed"
    assert steady["max_abs_change"] == 0.5
    assert math.isclose(steady["rel_l2_change"], 0.5 / math.hypot(1.0, 2.0))
    grown = by_path["model/becomes_inf"]
    assert grown["max_abs_change"] == math.inf and grown["rel_l2_change"] == math.inf
    assert by_path["model/w"]["max_abs_change"] == 1.0


def test_the_table_shows_zero_for_an_unchanged_inf_tensor(tmp_path: Path) -> None:
    url, _ = _two_versions(tmp_path)
    result = run("diff", url, "main~1", "main", "--values")
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "all_inf" in line)
    assert "nan" not in line and "inf" not in line.replace("all_inf", ""), line

"""diff --values on complex tensors measures the complex difference: casting to float64 dropped
the imaginary part, so a tensor whose imaginary part alone changed read as unchanged (max |Δ|
and relative L2 of 0), with a ComplexWarning."""

from __future__ import annotations

import json
import uuid
import warnings

import numpy as np
import pytest

import inshrink_store as ins
from tests._cli_helpers import run


def _two_versions() -> tuple[str, ins.Repository, np.ndarray, np.ndarray]:
    url = f"memory://diff-complex-{uuid.uuid4().hex}"
    repo = ins.open(url, create=True)
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(256) + 1j * rng.standard_normal(256)).astype(np.complex64)
    b = (a.real + 1j * (a.imag * 1.5)).astype(np.complex64)  # the real part as it was
    assert np.array_equal(a.real, b.real) and not np.array_equal(a.imag, b.imag)
    repo.save({"z": a, "same": a, "wide": a.astype(np.complex128)})
    repo.save({"z": b, "same": a, "wide": b.astype(np.complex128)})
    return url, repo, a, b


def _expected(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    delta = b.astype(np.complex128) - a.astype(np.complex128)
    return float(np.abs(delta).max()), float(np.linalg.norm(delta) / np.linalg.norm(a.astype(np.complex128)))


def test_diff_values_of_complex_tensors_counts_the_imaginary_part() -> None:
    _, repo, a, b = _two_versions()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ComplexWarning (or any other) from discarding parts
        report = repo.diff("main~1", "main", values=True)
    by_path = {t.path: t for t in report.tensors}
    max_abs, rel = _expected(a, b)
    for path in ("z", "wide"):
        t = by_path[path]
        assert t.status == "changed" and t.bytes_changed is None, path
        assert t.max_abs_change == pytest.approx(max_abs, rel=1e-6), path
        assert t.rel_l2_change is not None and t.rel_l2_change > 0.1, path
        assert t.rel_l2_change == pytest.approx(rel, rel=1e-6), path
    same = by_path["same"]
    assert same.status == "unchanged" and same.max_abs_change == 0.0 and same.rel_l2_change == 0.0


def test_cli_diff_values_of_complex_tensors() -> None:
    url, _, a, b = _two_versions()
    max_abs, rel = _expected(a, b)
    result = run("diff", url, "main~1", "main", "--values")
    assert result.exit_code == 0, result.output
    rows = {line.split()[1]: line for line in result.output.splitlines() if len(line.split()) > 2}
    assert f"{rel:.3g}" in rows["z"] and f"{max_abs:.3g}" in rows["z"], rows["z"]
    doc = json.loads(run("diff", url, "main~1", "main", "--values", "--json").output)
    z = {t["path"]: t for t in doc["tensors"]}["z"]
    assert z["status"] == "changed" and z["rel_l2_change"] == pytest.approx(rel, rel=1e-6)

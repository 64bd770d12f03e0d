"""diff --values on integer, bool and byte tensors says whether their bytes changed (issue 33
item 11): a relative L2 of an RNG state (uint8) or a step counter means nothing; only floats
get max |Δ| and relative L2."""

from __future__ import annotations

import json
import uuid

import numpy as np

import inshrink_store as ins
from tests._cli_helpers import run


def _two_versions() -> tuple[str, ins.Repository]:
    url = f"memory://diff-exact-{uuid.uuid4().hex}"
    repo = ins.open(url, create=True)
    rng = np.random.default_rng(0)
    rng_state = rng.integers(0, 256, 5056, dtype=np.uint8)
    w = rng.standard_normal(100).astype(np.float32)
    repo.save({"rng/torch": rng_state, "step": np.array([7]), "mask": np.ones(4, bool), "w": w,
               "same": np.arange(4, dtype=np.int32)})
    changed = rng_state.copy()
    changed[:8] ^= 0xFF
    repo.save({"rng/torch": changed, "step": np.array([8]), "mask": np.ones(4, bool), "w": w * 1.01,
               "same": np.arange(4, dtype=np.int32)})
    return url, repo


def test_diff_values_says_only_whether_the_bytes_of_exact_tensors_changed() -> None:
    url, repo = _two_versions()
    by_path = {t.path: t for t in repo.diff("main~1", "main", values=True).tensors}
    for path, changed in (("rng/torch", True), ("step", True), ("mask", False), ("same", False)):
        t = by_path[path]
        assert t.bytes_changed is changed, path
        assert t.max_abs_change is None and t.rel_l2_change is None, path
    w = by_path["w"]
    assert w.bytes_changed is None and w.rel_l2_change is not None and abs(w.rel_l2_change - 0.01) < 1e-3


def test_cli_diff_values_prints_bytes_changed_not_a_relative_l2() -> None:
    url, _ = _two_versions()
    result = run("diff", url, "main~1", "main", "--values")
    assert result.exit_code == 0, result.output
    rows = {line.split()[1]: line for line in result.output.splitlines() if len(line.split()) > 2}
    assert "bytes changed" in rows["rng/torch"] and "e-" not in rows["rng/torch"]
    assert "bytes changed" in rows["step"] and "same bytes" in rows["mask"]
    assert "bytes" not in rows["w"]
    doc = json.loads(run("diff", url, "main~1", "main", "--values", "--json").output)
    by_path = {t["path"]: t for t in doc["tensors"]}
    assert by_path["rng/torch"]["bytes_changed"] is True and by_path["rng/torch"]["rel_l2_change"] is None

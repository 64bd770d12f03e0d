"""`inshrink import --target-ratio / --max-error`: per-tensor levels from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import inshrink_store as ins
from tests._cli_helpers import run


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A .pt state dict: a large and a small linear weight (quantizable) and a bias."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    path = tmp_path / "ckpt.pt"
    torch.save({"big.weight": torch.randn(512, 128, generator=gen) * 0.02,
                "small.weight": torch.randn(64, 96, generator=gen) * 0.1,
                "small.bias": torch.zeros(64)}, path)
    return path


def _ratio(url: str) -> float:
    repo = ins.open(url)
    logical = sum(a.nbytes for a in repo.load().values())
    return logical / sum(repo.stored_bytes().values())


def test_target_ratio_import_lands_near_the_target_and_records_it(checkpoint: Path, tmp_path: Path) -> None:
    url = str(tmp_path / "t")
    result = run("import", str(checkpoint), url, "--target-ratio", "8")
    assert result.exit_code == 0, result.output
    assert _ratio(url) == pytest.approx(8, rel=0.15)
    meta = json.loads(run("log", url, "--json").stdout)[0]["metadata"]["quantization"]
    record = ins.QuantizationRecord.from_dict(meta)
    assert record.config is None and record.allocation == ins.policy.Allocation(target_ratio=8.0)
    table = run("log", url).stdout
    assert "per-tensor levels" in table and "target_ratio=8" in table


def test_max_error_import_bounds_the_weight_error(checkpoint: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    url = str(tmp_path / "e")
    assert run("import", str(checkpoint), url, "--max-error", "0.05", "--protect", "0.01").exit_code == 0
    original = torch.load(checkpoint, weights_only=True)
    restored = ins.open(url).load()
    errs = [np.linalg.norm(restored[f"model/{k}"] - original[k].numpy()) / np.linalg.norm(original[k].numpy())
            for k in ("big.weight", "small.weight")]
    assert float(np.sqrt(np.mean(np.square(errs)))) <= 0.05 * 1.1
    record = ins.QuantizationRecord.from_dict(json.loads(run("log", url, "--json").stdout)[0]["metadata"]["quantization"])
    assert record.allocation is not None and record.allocation.protect == 0.01


@pytest.mark.parametrize(("args", "needle"), [
    (["--target-ratio", "8", "--bins", "16"], "--bins"),
    (["--target-ratio", "8", "--max-error", "0.1"], "one of --target-ratio and --max-error"),
    (["--target-ratio", "0.5"], "at least 1"),
    (["--max-error", "-1"], "above 0"),
    (["--max-error", "0.1", "--prune", "0.1"], "never prunes"),
    (["--target-ratio", "8", "--protect", "0.9"], "fraction from 0 to 0.5"),
])
def test_bad_allocation_options_are_usage_errors(checkpoint: Path, tmp_path: Path, args: list[str],
                                                 needle: str) -> None:
    url = str(tmp_path / "bad")
    result = run("import", str(checkpoint), url, *args)
    assert result.exit_code == 2, result.output
    assert needle in " ".join(result.output.replace("│", " ").split())  # unwrap the box
    assert not Path(url).exists()  # nothing was created


def test_log_summarises_an_allocation_search(tmp_path: Path) -> None:
    """A version stored by a search over target ratios says so in `inshrink log`."""
    from inshrink_store.policy import SearchPolicy
    from inshrink_store.policy.candidates import Candidates

    url = str(tmp_path / "s")
    rng = np.random.default_rng(1)
    state = {"model/w": rng.standard_normal((256, 64)).astype(np.float32)}
    policy = SearchPolicy(tolerance=0.5, allocation_ratios=(2, 4, 8), optimizer=None)
    decision = policy.decide(Candidates(state, {"model/w": "F32"}, {}), lambda plans: 1.0)
    repo = ins.open(url, create=True)
    repo.save(state, quantize=decision.plans, metadata={"quantization": decision.record.to_dict()})
    table = " ".join(run("log", url).stdout.replace("│", " ").split())
    assert "target ratio bisection" in table and "target_ratio=8" in table

"""The CLI reports the optimizer's moments: import --optimizer, log, ls and du columns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import inshrink_store as ins
from tests._cli_helpers import run


@pytest.fixture
def adam_file(tmp_path: Path) -> Path:
    """A torch.save'd {model, optimizer} whose Adam moments are big enough to compress."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,))).backward()
        opt.step()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return path


def _storage(url: str) -> dict[str, str]:
    return {p: a.storage for p, a in ins.open(url).checkout("main").arrays().items()}


def test_import_compresses_moments_with_bins_and_keeps_them_lossless_without(adam_file: Path, tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    assert run("import", str(adam_file), url).exit_code == 0
    assert all(s == "lossless" for s in _storage(url).values())
    assert "moments" not in ins.open(url).snapshot("main").metadata

    assert run("import", str(adam_file), url, "--bins", "16").exit_code == 0
    storage = _storage(url)
    assert storage["optimizer/state/0/exp_avg"] == "quantized"
    assert storage["optimizer/state/0/exp_avg_sq"] == "quantized"
    assert storage["optimizer/state/0/step"] == "lossless"
    record = ins.open(url).snapshot("main").metadata["moments"]
    assert record["tensors"]["optimizer/state/0"]["storage"] == "quantized"

    assert run("import", str(adam_file), url, "--bins", "16", "--optimizer", "lossless").exit_code == 0
    assert all(s == "lossless" for p, s in _storage(url).items() if p.startswith("optimizer/"))

    assert run("import", str(adam_file), url, "--optimizer", "compressed").exit_code == 0
    storage = _storage(url)
    assert storage["optimizer/state/0/exp_avg"] == "quantized" and storage["model/0.weight"] == "lossless"


def test_a_wrong_optimizer_mode_is_a_usage_error(adam_file: Path, tmp_path: Path) -> None:
    result = run("import", str(adam_file), str(tmp_path / "store"), "--optimizer", "zipped")
    assert result.exit_code == 2
    assert "compressed or lossless" in result.output
    assert not (tmp_path / "store").exists()


def test_log_ls_and_du_show_the_moments(adam_file: Path, tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    run("import", str(adam_file), url, "--bins", "16")
    log = run("log", url)
    assert log.exit_code == 0 and "moments" in log.output and "compressed" in log.output

    listing = json.loads(run("ls", url, "--json").output)
    rows = {r["tensor"]: r for r in listing["tensors"]}
    guard = rows["optimizer/state/0/exp_avg"]
    assert 0.95 <= guard["update_cosine"] <= 1.0 and 0 <= guard["update_rel_error"] <= 0.3
    assert rows["model/0.weight"]["update_cosine"] is None
    table = run("ls", url)
    assert "update cos" in table.output

    usage = json.loads(run("du", url, "--json").output)["rows"]
    assert usage[-1]["model_cumulative_ratio"] > 1 and usage[-1]["optimizer_cumulative_ratio"] > 1
    assert "optimizer overall" in run("du", url).output
    only_model = json.loads(run("du", url, "--prefix", "model/", "--json").output)["rows"]
    assert "optimizer_cumulative_ratio" not in only_model[-1]

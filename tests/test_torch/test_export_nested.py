"""Exports that load back, and moments named by their parameters.

``inshrink export --all out.pt`` (and the Python ``export_torch``) write the saved structure,
``{"model": state_dict, "optimizer": optimizer_state_dict, ...}``, which
``model.load_state_dict`` and ``optimizer.load_state_dict`` take as they are; before, the file
held flat ``optimizer/state/0/exp_avg`` keys. A ``.safetensors`` export stays flat (one tensor
per stored path) and carries the structure as JSON in its metadata. ``ls`` and ``show`` say
which parameter a moment belongs to, and ``optimizer/state/<param name>/exp_avg`` names it in
Python and the CLI alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import inshrink_store as ins
from tests._cli_helpers import run

torch = pytest.importorskip("torch")
from inshrink_store.torch import Checkpointer, load_state  # noqa: E402

PARAM = "encoder.query.weight"


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Module()
        self.encoder.query = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 2)
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: Any) -> Any:
        return self.head(self.encoder.query(x))


def _trained(named: bool = False) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.named_parameters() if named else model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
    return model, opt


def _checkpointed(tmp_path: Path) -> tuple[str, Any, Any]:
    url = str(tmp_path / "store")
    model, opt = _trained()
    with Checkpointer(ins.open(url, create=True), model, opt, lossless=True, background=False) as ck:
        ck.save(3, extra={"epoch": 1})
    return url, model, opt


def _same_state(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b), (list(a), list(b))
        for k in a:
            _same_state(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same_state(x, y)
    else:
        assert a == b, (a, b)


def test_export_all_to_pt_loads_into_the_model_and_the_optimizer(tmp_path: Path) -> None:
    url, model, opt = _checkpointed(tmp_path)
    out = tmp_path / "all.pt"
    result = run("export", url, "main", str(out), "--all")
    assert result.exit_code == 0, result.output
    loaded = torch.load(out, weights_only=True)
    assert set(loaded) == {"model", "optimizer", "extra"}
    fresh_model = _Net()
    fresh_model.load_state_dict(loaded["model"])
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=1.0)
    fresh_opt.load_state_dict(loaded["optimizer"])
    _same_state(fresh_model.state_dict(), model.state_dict())
    _same_state(fresh_opt.state_dict(), opt.state_dict())
    assert loaded["extra"] == {"epoch": 1}


def test_the_python_export_writes_the_same_nested_file(tmp_path: Path) -> None:
    from inshrink_store.torch import export_torch

    url, model, opt = _checkpointed(tmp_path)
    out = tmp_path / "py.pt"
    export_torch(ins.open(url).checkout("main"), out, include_all=True)
    loaded = torch.load(out, weights_only=True)
    _same_state(loaded["optimizer"], opt.state_dict())
    plain = tmp_path / "model.pt"  # without include_all: the model's state dict, as before
    export_torch(ins.open(url).checkout("main"), plain)
    _same_state(torch.load(plain, weights_only=True), model.state_dict())


def test_export_all_to_safetensors_is_flat_and_carries_the_structure(tmp_path: Path) -> None:
    from safetensors import safe_open

    url, _, _ = _checkpointed(tmp_path)
    out = tmp_path / "all.safetensors"
    assert run("export", url, "main", str(out), "--all").exit_code == 0
    with safe_open(str(out), "pt") as f:
        keys, metadata = set(f.keys()), f.metadata()
    assert keys == set(ins.open(url).checkout("main").names())
    assert "optimizer/state/0/exp_avg" in keys
    structure = json.loads(metadata["inshrink_structure"])
    assert "__dict__" in structure
    assert json.loads(metadata["inshrink_param_names"])["0"] == PARAM


def test_ls_and_show_name_each_moment_by_its_parameter(tmp_path: Path) -> None:
    url, _, opt = _checkpointed(tmp_path)
    rows = {r["tensor"]: r for r in json.loads(run("ls", url, "main", "--json").stdout)["tensors"]}
    assert rows["optimizer/state/0/exp_avg"]["param"] == PARAM
    assert rows["optimizer/state/2/exp_avg_sq"]["param"] == "head.weight"
    assert rows["model/encoder.query.weight"]["param"] is None
    assert PARAM in run("ls", url, "main").stdout
    alias = f"optimizer/state/{PARAM}/exp_avg"
    for name in (alias, f"{PARAM}/exp_avg", "query.weight/exp_avg"):
        shown = run("show", url, "main", name, "--json")
        assert shown.exit_code == 0, shown.output
        doc = json.loads(shown.stdout)
        assert doc["tensor"] == "optimizer/state/0/exp_avg" and doc["param"] == PARAM
    snap = ins.open(url).checkout("main")
    assert snap.param_names() == {0: PARAM, 1: "encoder.query.bias", 2: "head.weight", 3: "head.bias"}
    assert snap.resolve_name(alias) == "optimizer/state/0/exp_avg"
    assert torch.equal(torch.from_numpy(snap.read(alias)), opt.state_dict()["state"][0]["exp_avg"])
    by_param = load_state(ins.open(url), prefix=f"optimizer/state/{PARAM}")
    _same_state(by_param, opt.state_dict()["state"][0])


def test_an_imported_file_names_moments_when_its_optimizer_does(tmp_path: Path) -> None:
    """torch's named optimizers (built from named_parameters()) record param_names; a file
    without them keeps the indices, which is all it says."""
    for named in (True, False):
        model, opt = _trained(named)
        path = tmp_path / f"named-{named}.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        url = str(tmp_path / f"store-{named}")
        assert run("import", str(path), url).exit_code == 0
        snap = ins.open(url).checkout("main")
        assert snap.param_names() == ({0: PARAM, 1: "encoder.query.bias", 2: "head.weight", 3: "head.bias"}
                                      if named else {})
        assert (f"optimizer/state/{PARAM}/exp_avg" in snap) is named

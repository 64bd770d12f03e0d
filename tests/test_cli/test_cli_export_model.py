"""`inshrink export STORE REF OUT` without --all writes the model's tensors (issue 43, item 3).

A user's Lightning version exported all 415 tensors (optimizer, callbacks, loops) to
x.safetensors though the help says "model tensors". Without --all an export now writes the
model's state dict: a Checkpointer version's ``model/``, a Lightning version's ``state_dict``.
The Lightning case builds its version with the plugin (skipped without lightning).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

import inshrink_store as ins  # noqa: E402
from inshrink_store.torch import Checkpointer  # noqa: E402
from tests._cli_helpers import run  # noqa: E402


def _exports(url: str, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The model-only .safetensors and .pt exports and the --all .safetensors export of main."""
    for name, extra in (("model.safetensors", []), ("model.pt", []), ("all.safetensors", ["--all"])):
        result = run("export", url, "main", str(tmp_path / name), *extra)
        assert result.exit_code == 0, result.output
    return (safetensors_torch.load_file(str(tmp_path / "model.safetensors")),
            torch.load(tmp_path / "model.pt", weights_only=True),
            safetensors_torch.load_file(str(tmp_path / "all.safetensors")))


def _assert_model_only(exported: dict[str, Any], model: Any) -> None:
    expected = model.state_dict()
    assert sorted(exported) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(exported[key], value), key


def test_export_of_a_checkpointer_version_writes_model_tensors(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    url = str(tmp_path / "store")
    Checkpointer(ins.open(url, create=True), model, optimizer, lossless=True, background=False).save(step=1)
    safetensors, pt, everything = _exports(url, tmp_path)
    _assert_model_only(safetensors, model)
    _assert_model_only(pt, model)
    assert any(k.startswith("optimizer/") for k in everything)


def test_export_of_a_lightning_version_writes_its_state_dict(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from inshrink_store.lightning import InshrinkCheckpointIO
    from tests.test_integrations.test_lightning import fit

    url = str(tmp_path / "store")
    trainer = fit(tmp_path / "run", InshrinkCheckpointIO(url), [ModelCheckpoint(dirpath=tmp_path / "ckpt")])
    stored = ins.open(url).checkout("main").names()
    assert any(p.startswith("optimizer_states/") for p in stored)  # a whole Lightning checkpoint
    safetensors, pt, everything = _exports(url, tmp_path)
    _assert_model_only(safetensors, trainer.lightning_module)
    _assert_model_only(pt, trainer.lightning_module)
    assert sorted(everything) == sorted(stored)

"""``LightningModule.load_from_checkpoint(path)`` on a path the plugin saved (issue 43, item 6).

It failed with torch's ``UnpicklingError … Unsupported operand 123`` (the JSON pointer file read
as a pickle), naming nothing of the store. The pointer is now a ``torch.save`` file whose one
object is a call of ``inshrink_store.lightning.load_from_store`` on the pointer: where the
plugin is imported, ``load_from_checkpoint`` (and ``torch.load``) reads the checkpoint from the
store; in a process that never imported it, torch's error names that function. Skipped
without Lightning.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from inshrink_store.lightning import InshrinkCheckpointIO, _read_pointer  # noqa: E402
from tests.test_integrations.test_lightning import Regression, fit  # noqa: E402


def _trained(tmp_path: Path) -> tuple[str, ModelCheckpoint, object]:
    url = str(tmp_path / "store")
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=2, monitor="val/loss", save_last=True)
    trainer = fit(tmp_path / "run", InshrinkCheckpointIO(url), [checkpoints])
    return url, checkpoints, trainer


def test_load_from_checkpoint_reads_the_version_from_the_store(tmp_path: Path) -> None:
    url, checkpoints, trainer = _trained(tmp_path)
    for path in (checkpoints.best_model_path, checkpoints.last_model_path):
        expected = InshrinkCheckpointIO(url).load_checkpoint(path)["state_dict"]
        model = Regression.load_from_checkpoint(path)
        assert isinstance(model, Regression)
        assert list(model.state_dict()) == list(expected)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    last = Regression.load_from_checkpoint(checkpoints.last_model_path)
    assert all(torch.equal(a, b) for a, b in zip(last.state_dict().values(),
                                                 trainer.lightning_module.state_dict().values(), strict=True))
    pointer = _read_pointer(checkpoints.last_model_path)  # still read without unpickling anything
    assert pointer is not None and pointer["store"] == str(Path(url).resolve())


def test_without_the_plugin_imported_torch_names_it(tmp_path: Path) -> None:
    url, checkpoints, _ = _trained(tmp_path)
    script = textwrap.dedent(f"""
        import sys, torch
        try:
            torch.load({checkpoints.best_model_path!r}, weights_only=True)
        except Exception as exc:
            print(str(exc))
            sys.exit(3)
        """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr
    assert "inshrink_store.lightning.load_from_store" in proc.stdout, proc.stdout


def test_pointers_of_earlier_releases_still_load(tmp_path: Path) -> None:
    """A JSON pointer file (what earlier releases wrote) is read as before."""
    import json

    url, checkpoints, _ = _trained(tmp_path)
    pointer = _read_pointer(checkpoints.best_model_path)
    assert pointer is not None
    old = tmp_path / "old.ckpt"
    old.write_text(json.dumps(pointer))
    io = InshrinkCheckpointIO(url)
    assert io.find(old) == pointer["snapshot"]
    assert torch.equal(io.load_checkpoint(old)["state_dict"]["linear.weight"],
                       io.load_checkpoint(checkpoints.best_model_path)["state_dict"]["linear.weight"])

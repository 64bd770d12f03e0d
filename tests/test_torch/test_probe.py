"""The probe check: each version records how close its stored model's output is to the live
model's on a batch the user gives, and `inshrink log` shows it."""

from __future__ import annotations

import uuid
from contextlib import nullcontext
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import inshrink_store as ins  # noqa: E402
from inshrink_store.errors import InvalidInputError  # noqa: E402
from inshrink_store.torch import Checkpointer  # noqa: E402

X = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))


def _model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


@pytest.mark.parametrize("lossless", [False, True])
def test_each_version_records_its_output_against_the_live_models(lossless: bool) -> None:
    url = f"memory://probe-{uuid.uuid4().hex}"
    model = _model()
    kwargs: dict[str, Any] = {"lossless": True} if lossless else {"tolerance": 0.05}
    ck = Checkpointer(ins.open(url, create=True), model, background=False, probe=X, **kwargs)
    with pytest.warns(UserWarning) if not lossless else nullcontext():
        ck.save(1)
    ck.close()
    record = ins.open(url).log()[0].metadata["probe"]
    if lossless:
        assert record == {"cosine_mean": 1.0, "cosine_min": 1.0, "rel_error": 0.0}
        return
    # what the store holds, run by hand, gives the same figures
    stored = _model()
    reader = ins.open(url).checkout("main")
    stored.load_state_dict({k: torch.from_numpy(reader.read(f"model/{k}").copy()) for k in stored.state_dict()})
    with torch.no_grad():
        a, b = model(X).double(), stored(X).double()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=1)
    assert record["cosine_mean"] == pytest.approx(float(cos.mean()), abs=1e-6)
    assert record["cosine_min"] == pytest.approx(float(cos.min()), abs=1e-6)
    assert record["rel_error"] == pytest.approx(float((b - a).norm() / a.norm()), abs=1e-6)
    assert 0 < record["rel_error"] < 1 and record["cosine_min"] < 1.0  # quantized: close, not exact


def test_inshrink_log_shows_the_probe_column() -> None:
    from typer.testing import CliRunner

    from inshrink_store._cli import app

    url = f"memory://probe-{uuid.uuid4().hex}"
    ck = Checkpointer(ins.open(url, create=True), _model(), background=False, probe=(X,))
    with pytest.warns(UserWarning):
        ck.save(1)
    ck.close()
    result = CliRunner().invoke(app, ["log", url])
    assert result.exit_code == 0, result.output
    assert "probe" in result.output and "cos 0." in result.output


def test_a_probe_that_is_not_a_batch_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="probe"):
        Checkpointer(ins.open(f"memory://probe-{uuid.uuid4().hex}", create=True), _model(), probe="batch")

"""One naming rule for a tensor, in Python and in the CLI.

A model wrapped the way sentence-transformers wraps one saves its weights under
``model/0.auto_model.encoder...``. ``inshrink show URL REF encoder.layer.0.attention.self.query.weight``
found it (the CLI matched the end of a path); ``snap["encoder.layer.0.attention.self.query.weight"]``
did not (Python tried only the path and ``model/`` + the path). Now both follow one rule
(docs/reference/names.md): the exact path, else ``model/`` + the name, else the one path
ending in ``/name`` or ``.name``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import inshrink_store as ins
from tests._cli_helpers import run, run_main

torch = pytest.importorskip("torch")
from inshrink_store.torch import Checkpointer, save_state  # noqa: E402

NAME = "encoder.layer.0.attention.self.query.weight"
STORED = f"model/0.auto_model.{NAME}"


def _wrapped_model() -> Any:
    """``0.auto_model.encoder.layer.0.attention.self.query.weight``, as a SentenceTransformer names it."""
    nn = torch.nn
    attention = nn.Module()
    attention.self = nn.Module()
    attention.self.query, attention.self.key = nn.Linear(4, 4), nn.Linear(4, 4)
    layer = nn.Module()
    layer.attention = attention
    encoder = nn.Module()
    encoder.layer = nn.ModuleList([layer])
    transformer = nn.Module()
    transformer.auto_model = nn.Module()
    transformer.auto_model.encoder = encoder
    return nn.Sequential(transformer)


def _saved(how: str, tmp_path: Path) -> str:
    url = str(tmp_path / how)
    model = _wrapped_model()
    if how == "save_state":
        save_state(ins.open(url, create=True), {"model": model.state_dict()})
    elif how == "checkpointer":
        with Checkpointer(ins.open(url, create=True), model, lossless=True, background=False) as ck:
            ck.save(1)
    else:  # the CLI's import of a torch.save file
        path = tmp_path / "wrapped.pt"
        torch.save(model.state_dict(), path)
        assert run("import", str(path), url).exit_code == 0
    return url


@pytest.mark.parametrize("how", ["save_state", "checkpointer", "import"])
def test_python_and_the_cli_find_the_same_tensor_by_its_module_name(how: str, tmp_path: Path) -> None:
    url = _saved(how, tmp_path)
    snap = ins.open(url).checkout()
    assert STORED in snap.names()
    shown = run("show", url, "main", NAME, "--json")
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["tensor"] == STORED
    assert snap.resolve_name(NAME) == STORED
    assert NAME in snap and "self.query.weight" in snap
    assert snap[NAME].shape == (4, 4)
    assert (snap.read(NAME) == snap.read(STORED)).all()
    for spelled in (STORED, f"0.auto_model.{NAME}", "auto_model." + NAME):  # every spelling, one tensor
        assert snap.resolve_name(spelled) == STORED
        assert json.loads(run("show", url, "main", spelled, "--json").stdout)["tensor"] == STORED


def test_an_ambiguous_or_missing_name_fails_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    url = _saved("save_state", tmp_path)
    snap = ins.open(url).checkout()
    with pytest.raises(ins.NotFoundError, match="query.weight.*key.weight|key.weight.*query.weight"):
        snap["weight"]
    assert "weight" not in snap
    code, _, stderr = run_main(monkeypatch, capsys, "show", url, "main", "weight")
    assert code == 1 and "query.weight" in stderr and "key.weight" in stderr
    with pytest.raises(ins.NotFoundError, match="did you mean"):
        snap["encoder.layer.0.attention.self.qeury.weight"]
    assert "nope" not in snap


def test_a_name_matches_whole_components_only(tmp_path: Path) -> None:
    url = _saved("save_state", tmp_path)
    snap = ins.open(url).checkout()
    assert "ery.weight" not in snap  # the end of a word is not a name
    with pytest.raises(ins.NotFoundError):
        snap.resolve_name("uery.weight")

"""Exports carry the file mode a plain ``open()`` gives under the process umask (issue 43,
item 9): ``export --format hf`` wrote ``model.safetensors`` and ``config.json`` with mode 0600
(the temp file's, from ``mkstemp``) where ``save_pretrained``'s files are readable as the
umask allows.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import inshrink_store as ins  # noqa: E402
from inshrink_store.torch import save_state  # noqa: E402
from tests._cli_helpers import run  # noqa: E402


@pytest.fixture(params=[0o022, 0o027])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    before = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(before)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_exports_have_the_mode_open_gives_under_the_umask(tmp_path: Path, umask: int) -> None:
    transformers = pytest.importorskip("transformers")
    bert = transformers.BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=8, max_position_embeddings=8, architectures=["BertModel"])
    url = str(tmp_path / "store")
    save_state(ins.open(url, create=True), {"model": transformers.BertModel(bert).state_dict()}, step=1)
    config = tmp_path / "config.json"
    config.write_text(bert.to_json_string())
    plain = tmp_path / "plain"
    with open(plain, "w"):
        pass
    expected = 0o666 & ~umask
    assert _mode(plain) == expected
    for args in (["x.safetensors"], ["x.pt"], ["hf", "--format", "hf", "--config", str(config)]):
        result = run("export", url, "main", str(tmp_path / args[0]), *args[1:])
        assert result.exit_code == 0, result.output
    written = [tmp_path / "x.safetensors", tmp_path / "x.pt", tmp_path / "hf" / "model.safetensors",
               tmp_path / "hf" / "config.json"]
    assert {str(p.name): oct(_mode(p)) for p in written} == {str(p.name): oct(expected) for p in written}
    assert not list(tmp_path.rglob("*.tmp"))  # no temp file left behind

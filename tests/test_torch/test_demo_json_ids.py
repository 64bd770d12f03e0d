"""`inshrink demo --json` names each version by its full snapshot id, as `log --json` does
(issue 33 item 11: it gave 10-character prefixes, which no other --json output uses)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from tests._cli_helpers import run  # noqa: E402


def test_demo_json_gives_the_full_snapshot_ids_log_json_gives(tmp_path: Path) -> None:
    url = str(tmp_path / "demo")
    result = run("demo", url, "--steps", "40", "--every", "20", "--fail-at", "30", "--json")
    assert result.exit_code == 0, result.output
    demo_ids = [r["snapshot"] for r in json.loads(result.stdout)["rows"]]
    log_ids = [e["id"] for e in reversed(json.loads(run("log", url, "--json").stdout))]
    assert demo_ids == log_ids and all(len(i) == 32 for i in demo_ids)

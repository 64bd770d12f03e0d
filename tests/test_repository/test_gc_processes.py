"""Writers, gc runs and a tagger in separate processes on one store: nothing is lost.

The adversarial run that found gc deleting a committed version used exactly this shape
(1 writer + 2 gc processes on the S3 emulator). Every acknowledged commit must read back
bit-exact afterwards, every tag must read back, and verify must pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import inshrink_store as ins

ACTORS = Path(__file__).with_name("_actors.py")
sys.path.insert(0, str(Path(__file__).parent))
from _actors import state  # noqa: E402


def _run(url: str, endpoint: str, seconds: float, roles: list[str]) -> list[list[dict]]:
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    procs = [subprocess.Popen([sys.executable, str(ACTORS), role, url, endpoint, str(seconds), "7"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for role in roles]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=seconds + 240)
        assert proc.returncode == 0, err[-3000:]
        outputs.append([json.loads(line) for line in out.splitlines() if line.strip()])
    return outputs


def _check(url: str, acked: list[dict]) -> None:
    repo = ins.open(url)
    assert acked, "the writer committed nothing"
    for entry in acked:
        loaded = repo.load(entry["id"])
        expected = state(7, entry["version"])
        for name, value in expected.items():
            assert loaded[name].tobytes() == value.tobytes(), (entry, name)
    for name, sid in repo.tags().items():
        assert repo.load(sid)["step"].tobytes(), name
    report = repo.verify()
    assert report.ok, report.problems
    final = repo.gc()
    assert final.dangling == []
    assert ins.open(url).verify().ok


def _start(url: str) -> None:
    repo = ins.open(url, create=True)
    repo.save(state(7, 0), message="v0", step=0)


@pytest.mark.slow
@pytest.mark.s3
def test_writer_two_gcs_and_a_tagger_on_s3_lose_nothing(s3_url: str, s3_server: str) -> None:
    _start(s3_url)
    outputs = _run(s3_url, s3_server, 25, ["writer", "gc", "gc", "tagger"])
    gc_runs = [o[-1] for o in outputs[1:3]]
    assert sum(g["gc"] for g in gc_runs) > 0, gc_runs  # gc did run beside the writer
    _check(s3_url, outputs[0])


@pytest.mark.slow
def test_writer_two_gcs_and_a_tagger_on_a_local_disk_lose_nothing(local_url: str) -> None:
    _start(local_url)
    outputs = _run(local_url, "-", 15, ["writer", "gc", "gc", "tagger"])
    assert sum(o[-1]["gc"] for o in outputs[1:3]) > 0
    _check(local_url, outputs[0])

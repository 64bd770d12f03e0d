"""The CLI against hostile input: rich markup in user data, damaged stores, odd paths.

Every command must print user text literally (``[/red]`` used to crash ``log``, ``ls``,
``diff`` and ``show``; ``[bold]`` vanished), and every error a user can act on must be
one line on stderr with exit 1, never a traceback. Also the ``tag``/``branch`` verbs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store._cli import main, versions
from tests._cli_helpers import run, run_main, runner  # noqa: F401

MESSAGE = "[bold]x[/red] :smile: [link=http://e]y[/link]"
TENSOR = "a[/red]"
OTHER = "b[bold]:smile:"
METRIC = "loss[/x]"
NOTE = "[red]note[/blue]"


def assert_one_line_error(code: int, stderr: str, *needles: str) -> None:
    assert code == 1, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for needle in needles:
        assert needle in lines[0], (needle, stderr)


@pytest.fixture
def hostile(tmp_path: Path) -> str:
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    repo.save({TENSOR: np.ones(3, np.float32), OTHER: np.zeros(2, np.float32)}, message=MESSAGE, step=1,
              metrics={METRIC: 1.5},
              metadata={"note": NOTE, "quantization": {"config": {"bins": NOTE}, "search": {"mode": NOTE}}})
    repo.save({TENSOR: np.full(3, 2, np.float32), OTHER: np.zeros(2, np.float32)}, message="[/]", step=2)
    return url


# -- 1. markup injection ------------------------------------------------------------------
def test_log_prints_messages_metrics_and_metadata_literally(hostile: str) -> None:
    result = run("log", hostile)
    assert result.exit_code == 0, result.output
    assert MESSAGE in result.stdout and "[/]" in result.stdout and f"{METRIC}=1.5" in result.stdout
    assert "(unreadable quantization record)" in result.stdout  # a garbage record is named, not shown


def test_ls_prints_tensor_names_literally(hostile: str) -> None:
    result = run("ls", hostile, "main~1")
    assert result.exit_code == 0, result.output
    assert TENSOR in result.stdout and OTHER in result.stdout


@pytest.mark.parametrize("values", [False, True])
def test_diff_prints_tensor_names_literally(hostile: str, values: bool) -> None:
    result = run("diff", hostile, "main~1", "main", *(["--values"] if values else []))
    assert result.exit_code == 0, result.output
    assert TENSOR in result.stdout
    if values:
        assert OTHER in result.stdout  # unchanged rows are listed with --values


@pytest.mark.parametrize("name", [TENSOR, OTHER])
def test_show_prints_tensor_names_literally(hostile: str, name: str) -> None:
    result = run("show", hostile, "main~1", name)
    assert result.exit_code == 0, result.output
    assert name in result.stdout


def test_du_tag_branch_gc_verify_accept_hostile_stores(hostile: str) -> None:
    for args in (["du", hostile], ["tag", hostile], ["branch", hostile], ["gc", hostile, "--dry-run"],
                 ["verify", hostile]):
        result = run(*args)
        assert result.exit_code == 0, (args, result.output)
    assert "[/]" in run("branch", hostile).stdout  # the head's message


def test_verify_names_a_hostile_tensor_literally(hostile: str, tmp_path: Path) -> None:
    reader = ins.open(hostile).checkout("main")
    oid = next(iter(reader.arrays()[TENSOR].chunk_ids.values()))
    victim = tmp_path / "store" / "objects" / oid[:2] / oid[2:]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    result = run("verify", hostile)
    assert result.exit_code == 1
    assert f":{TENSOR}" in result.stderr and "BAD" in result.stderr


def test_errors_print_user_text_literally(hostile: str, monkeypatch, capsys) -> None:
    code, _, stderr = run_main(monkeypatch, capsys, "ls", hostile, "[bold]nope[/red]")
    assert_one_line_error(code, stderr, "[bold]nope[/red]")


def test_urls_with_brackets_are_printed_literally(tmp_path: Path) -> None:
    url = str(tmp_path / "[red]store[/x]")
    result = run("init", url)
    assert result.exit_code == 0, result.output
    assert url in result.stdout


# -- 3. clear errors, never a traceback ---------------------------------------------------
def test_export_to_a_directory_is_a_clear_error(hostile: str, tmp_path: Path, monkeypatch, capsys) -> None:
    pytest.importorskip("safetensors")
    target = tmp_path / "outdir"
    target.mkdir()
    code, _, stderr = run_main(monkeypatch, capsys, "export", hostile, "main", str(target))
    assert_one_line_error(code, stderr, str(target))
    code, _, stderr = run_main(monkeypatch, capsys, "export", hostile, "main", str(tmp_path / "no" / "x.safetensors"))
    assert_one_line_error(code, stderr, str(tmp_path / "no"))


def test_init_under_or_at_a_file_is_a_clear_error(tmp_path: Path, monkeypatch, capsys) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("mine")
    for url in (str(blocker / "store"), str(blocker)):
        code, _, stderr = run_main(monkeypatch, capsys, "init", url)
        assert_one_line_error(code, stderr, str(blocker))
    assert blocker.read_text() == "mine"


def test_import_of_a_directory_is_a_clear_error(hostile: str, tmp_path: Path, monkeypatch, capsys) -> None:
    code, _, stderr = run_main(monkeypatch, capsys, "import", str(tmp_path), hostile)
    assert_one_line_error(code, stderr, str(tmp_path), "directory")


CORRUPT_CONFIGS = {
    "bad json": b"{bad",
    "bad utf-8": b'{"format": "\x80\xff"}',
    "not an object": b"[]",
    "empty": b"",
}


@pytest.mark.parametrize("content", list(CORRUPT_CONFIGS.values()), ids=list(CORRUPT_CONFIGS))
def test_a_corrupt_config_is_one_clear_line_in_every_command(hostile: str, tmp_path: Path, monkeypatch, capsys,
                                                             content: bytes) -> None:
    (tmp_path / "store" / "inshrink.json").write_bytes(content)
    for args in (["log", hostile], ["ls", hostile], ["show", hostile, "main", TENSOR], ["du", hostile],
                 ["diff", hostile, "main~1", "main"], ["verify", hostile], ["gc", hostile, "--dry-run"],
                 ["tag", hostile, "t"], ["branch", hostile], ["export", hostile, "main", str(tmp_path / "o.safetensors")],
                 ["init", hostile]):
        code, _, stderr = run_main(monkeypatch, capsys, *args)
        assert code == 1, (args, stderr)
        assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, (args, stderr)
        if args[0] != "init":  # init refuses an existing store before reading it
            assert "inshrink.json" in stderr, (args, stderr)


def test_a_config_that_is_a_directory_is_a_clear_error(hostile: str, tmp_path: Path, monkeypatch, capsys) -> None:
    config = tmp_path / "store" / "inshrink.json"
    config.unlink()
    config.mkdir()
    code, _, stderr = run_main(monkeypatch, capsys, "log", hostile)
    assert_one_line_error(code, stderr, "inshrink.json")


def test_a_corrupt_config_through_the_installed_entry_point(hostile: str, tmp_path: Path) -> None:
    (tmp_path / "store" / "inshrink.json").write_bytes(b"{bad")
    proc = subprocess.run([sys.executable, "-m", "inshrink_store._cli", "log", hostile],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "inshrink.json" in proc.stderr


@pytest.mark.parametrize("exc", [
    PermissionError(13, "Permission denied", "/srv/[x]/inshrink.json"),
    FileNotFoundError("/srv/[x]/inshrink.json"),
    IsADirectoryError(21, "Is a directory", "/srv/[x]/inshrink.json"),
    NotADirectoryError(20, "Not a directory", "/srv/[x]/inshrink.json"),
    OSError(28, "No space left on device", "/srv/[x]/inshrink.json"),
], ids=lambda e: type(e).__name__)
def test_main_turns_file_system_errors_into_one_line(monkeypatch, capsys, exc: OSError) -> None:
    def boom(url: str, create: bool = False) -> None:
        raise exc

    monkeypatch.setattr(versions, "_open", boom)  # where `log` looks its store opener up
    code, _, stderr = run_main(monkeypatch, capsys, "log", "somewhere")
    assert_one_line_error(code, stderr, "/srv/[x]/inshrink.json", "Expected", "instead")


@pytest.mark.parametrize("exc", [json.JSONDecodeError("Expecting value", "x", 0),
                                 UnicodeDecodeError("utf-8", b"\x80", 0, 1, "invalid start byte")],
                         ids=lambda e: type(e).__name__)
def test_main_turns_unreadable_store_files_into_one_line(hostile: str, monkeypatch, capsys, exc: Exception) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise exc

    monkeypatch.setattr(ins.Repository, "log", boom)
    code, _, stderr = run_main(monkeypatch, capsys, "log", hostile)
    assert_one_line_error(code, stderr, "inshrink verify")


def test_main_keeps_the_traceback_of_a_bug(hostile: str, monkeypatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(ins.Repository, "log", boom)
    monkeypatch.setattr(sys, "argv", ["inshrink", "log", hostile])
    with pytest.raises(RuntimeError, match="a bug"):
        main()


# -- 4. tag and branch verbs --------------------------------------------------------------
@pytest.fixture
def store(tmp_path: Path) -> str:
    url = str(tmp_path / "plain")
    repo = ins.open(url, create=True)
    repo.save({"w": np.zeros(4, np.float32)}, message="one", step=1)
    repo.save({"w": np.ones(4, np.float32)}, message="two", step=2)
    return url


def test_tag_create_list_and_delete(store: str, monkeypatch, capsys) -> None:
    repo = ins.open(store)
    first = repo.resolve("main~1")
    assert run("tag", store, "v1", "main~1").exit_code == 0
    created = run("tag", store, "v2", "--json")
    assert created.exit_code == 0, created.output
    assert json.loads(created.stdout) == {"name": "v2", "snapshot": repo.resolve("main"), "deleted": False}
    listed = run("tag", store, "--json")
    assert {t["name"]: t["snapshot"] for t in json.loads(listed.stdout)} == {"v1": first, "v2": repo.resolve("main")}
    assert "v1" in run("tag", store).stdout
    deleted = run("tag", store, "v1", "--delete")
    assert deleted.exit_code == 0, deleted.output
    assert "v1" in deleted.stdout and first in deleted.stdout
    assert ins.open(store).tags() == {"v2": repo.resolve("main")}
    assert json.loads(run("tag", store, "v2", "-d", "--json").stdout) == {
        "name": "v2", "snapshot": repo.resolve("main"), "deleted": True}
    # a tag can be re-created after deletion (tags are write-once, deletion is how to move one)
    assert run("tag", store, "v1", "main").exit_code == 0
    code, _, stderr = run_main(monkeypatch, capsys, "tag", store, "nope", "-d")
    assert_one_line_error(code, stderr, "nope")


def test_tag_and_branch_usage_errors_exit_2(store: str) -> None:
    for kind in ("tag", "branch"):
        assert run(kind, store, "-d").exit_code == 2  # nothing to delete
        assert run(kind, store, "x", "main", "-d").exit_code == 2  # a REF makes no sense with -d


def test_branch_create_list_and_delete(store: str, monkeypatch, capsys) -> None:
    repo = ins.open(store)
    first = repo.resolve("main~1")
    created = run("branch", store, "side", "main~1")
    assert created.exit_code == 0, created.output
    assert "side" in created.stdout and first in created.stdout
    assert ins.open(store).branches()["side"] == first
    repo.save({"w": np.full(4, 3, np.float32)}, branch="side", message="on side", step=3)
    listed = json.loads(run("branch", store, "--json").stdout)
    by_name = {b["name"]: b for b in listed}
    assert set(by_name) == {"main", "side"}
    assert by_name["side"]["message"] == "on side" and by_name["side"]["step"] == 3
    assert by_name["main"]["head"] == repo.resolve("main")
    table = run("branch", store)
    assert table.exit_code == 0 and "on side" in table.stdout and "main" in table.stdout
    assert json.loads(run("branch", store, "other", "--json").stdout) == {
        "name": "other", "head": repo.resolve("main"), "deleted": False}
    deleted = run("branch", store, "side", "-d")
    assert deleted.exit_code == 0, deleted.output
    assert "side" in deleted.stdout
    assert set(ins.open(store).branches()) == {"main", "other"}
    code, _, stderr = run_main(monkeypatch, capsys, "branch", store, "side", "--delete")
    assert_one_line_error(code, stderr, "side")
    code, _, stderr = run_main(monkeypatch, capsys, "branch", store, "main")
    assert_one_line_error(code, stderr, "main")  # exists already


def test_gc_reports_dangling_refs_as_warnings(store: str, tmp_path: Path) -> None:
    repo = ins.open(store)
    repo.create_branch("side", "main")
    lost = repo.save({"w": np.full(4, 5, np.float32)}, branch="side", message="lost", step=9).id
    repo.tag("keep-lost", lost)
    (tmp_path / "plain" / "snapshots" / lost).unlink()
    doc = run("gc", store, "--dry-run", "--json")
    assert doc.exit_code == 0, doc.output
    dangling = json.loads(doc.stdout)["dangling"]
    assert any("keep-lost" in d for d in dangling) and any("side" in d for d in dangling)
    text = run("gc", store, "--dry-run")
    assert text.exit_code == 0, text.output
    assert "warning:" in text.stderr and "keep-lost" in text.stderr
    assert "inshrink tag URL NAME -d" in text.stderr
    listed = json.loads(run("branch", store, "--json").stdout)
    assert next(b for b in listed if b["name"] == "side")["error"]  # listed, with why

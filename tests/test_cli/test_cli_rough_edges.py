"""The CLI's rough edges.

Backends fail in one line and fast; out-of-range options are usage errors (exit 2);
nothing surprising happens silently (export format, orphaned quantization options,
stores created on a misspelled path, a blank config column); the missing verbs and
hints exist; embeddings in a state dict from a file get ``embedding_bins``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store import _cli
from tests._cli_helpers import run, run_main, runner  # noqa: F401


def one_error_line(code: int, stderr: str, *needles: str) -> str:
    assert code == 1, stderr
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for needle in needles:
        assert needle in lines[0], (needle, stderr)
    return lines[0]


@pytest.fixture
def store(tmp_path: Path) -> str:
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    repo.save({"model/0.weight": w, "model/0.bias": np.zeros(32, np.float32),
               "model/2.weight": w[:16].copy()}, message="one", step=1)
    repo.save({"model/0.weight": w + 1, "model/0.bias": np.zeros(32, np.float32),
               "model/2.weight": w[:16].copy()}, message="two", step=2)
    return url


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A .pt state dict with an embedding table and a linear layer (both quantizable)."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    path = tmp_path / "ckpt.pt"
    torch.save({"embed.weight": torch.randn(512, 16, generator=gen),
                "proj.weight": torch.randn(128, 64, generator=gen),
                "proj.bias": torch.zeros(128)}, path)
    return path


# -- 1. backends: one line, a hint, and quickly --------------------------------------------
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: the CLI under test, counting the connections it opens to one port (written to a file at exit)
COUNTING_CLI = """
import atexit, runpy, socket, sys
port, counts = int(sys.argv[1]), sys.argv[2]
attempts = [0]
real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

def counted(real):
    def connect(self, address, *args):
        if isinstance(address, tuple) and len(address) >= 2 and address[1] == port:
            attempts[0] += 1
        return real(self, address, *args)
    return connect

socket.socket.connect, socket.socket.connect_ex = counted(real_connect), counted(real_connect_ex)
atexit.register(lambda: open(counts, "w").write(str(attempts[0])))
sys.argv = ["inshrink", *sys.argv[3:]]
runpy.run_module("inshrink_store._cli", run_name="__main__")
"""
#: connection attempts the CLI allows per request: one try and its ``max_attempts: 2``
#: retries (botocore counts retries there); botocore's own default is five tries with backoff
CLI_ATTEMPTS = 3
#: only stops a hang: the test asserts the bounded retries, not how fast they fail
HANG_GUARD_S = 600


def test_a_closed_s3_endpoint_is_one_line_with_a_hint_after_few_retries(tmp_path: Path) -> None:
    """A closed endpoint fails with one clear line rather than hanging in retries: the
    connection attempts are counted (a few, one failed read), not timed, so a loaded
    machine cannot fail it (it once asserted under 15 s of wall clock)."""
    pytest.importorskip("s3fs")
    port = _closed_port()
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "k",
           "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}
    env.pop("INSHRINK_TIMEOUT", None)
    counts = tmp_path / "attempts"
    for args in (["log", "s3://bucket/store"], ["import", str(tmp_path / "x.pt"), "s3://bucket/store"],
                 ["init", "s3://bucket/store"]):
        if args[0] == "import":
            pytest.importorskip("torch").save({"w": pytest.importorskip("torch").zeros(2)}, tmp_path / "x.pt")
        counts.unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, "-c", COUNTING_CLI, str(port), str(counts), *args],
                              capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
        line = one_error_line(proc.returncode, proc.stderr, "s3://bucket/store", "AWS_ENDPOINT_URL", "--timeout")
        assert "EndpointConnectionError" in line, line
        attempts = int(counts.read_text())
        assert 1 <= attempts <= CLI_ATTEMPTS, (
            f"Expected 1..{CLI_ATTEMPTS} connection attempts for {args} (one failed request and "
            f"its retries). Got {attempts} instead.")


def test_timeout_reaches_the_backend_options(monkeypatch) -> None:
    seen: list[dict] = []

    def fake_open(url: str, *, create: bool = False, storage_options=None, **kw):
        seen.append(storage_options)
        raise ins.StorageError("Expected to read x. Got boom instead.")

    monkeypatch.setattr(ins, "open", fake_open)
    assert run("--timeout", "12.5", "log", "s3://b/s").exit_code == 1
    assert seen[-1]["config_kwargs"]["connect_timeout"] == 12.5
    assert seen[-1]["config_kwargs"]["retries"] == {"max_attempts": 2}
    monkeypatch.setenv("INSHRINK_TIMEOUT", "7")
    assert run("log", "s3://b/s").exit_code == 1
    assert seen[-1]["config_kwargs"]["connect_timeout"] == 7
    monkeypatch.delenv("INSHRINK_TIMEOUT")
    assert run("log", "s3://b/s").exit_code == 1
    assert seen[-1]["config_kwargs"]["connect_timeout"] == _cli.DEFAULT_TIMEOUT
    pytest.importorskip("gcsfs")
    assert run("log", "gs://b/s").exit_code == 1
    assert seen[-1]["requests_timeout"].sock_connect == _cli.DEFAULT_TIMEOUT
    assert run("log", "memory://x").exit_code == 1 and seen[-1] is None
    for bad in ("0", "-1", "nan"):
        assert run("--timeout", bad, "log", "s3://b/s").exit_code == 2


NOISY_BACKEND = """
import logging, sys
import inshrink_store as ins
from inshrink_store._cli import main

def noisy(*args, **kwargs):
    try:
        raise ConnectionError("Cannot connect to host storage.googleapis.com:443")
    except ConnectionError as exc:
        logging.getLogger("gcsfs").exception("_request out of retries on exception: %s", exc)
        raise ins.StorageError("Expected to read inshrink.json in 'gs://b/s'. Got ConnectionError "
                               "instead; check the path, credentials, endpoint and network.") from exc

ins.Repository.log = noisy
sys.argv = ["inshrink", "log", sys.argv[1]]
main()
"""


def test_backend_logging_never_reaches_stderr(store: str) -> None:
    """gcsfs logs a traceback per failed retry before raising; the user sees one line."""
    proc = subprocess.run([sys.executable, "-c", NOISY_BACKEND, store], capture_output=True, text=True, timeout=HANG_GUARD_S)
    one_error_line(proc.returncode, proc.stderr, "ConnectionError")


# -- 2. exit codes, flags, --version -----------------------------------------------------
@pytest.mark.parametrize("options", [["--bins", "1"], ["--bins", "70000"], ["--bins", "4", "--prune", "1.5"],
                                     ["--bins", "4", "--protect", "-1"], ["--bins", "4", "--prune", "nan"],
                                     ["--bins", "4", "--embedding-bins", "1"]])
def test_out_of_range_quantization_options_are_usage_errors(checkpoint: Path, tmp_path: Path,
                                                           options: list[str]) -> None:
    url = str(tmp_path / "new")
    result = run("import", str(checkpoint), url, *options)
    assert result.exit_code == 2, result.output
    assert "Expected" in result.output
    assert not Path(url).exists()  # checked before anything is created


def test_json_and_other_flags_take_no_value_in_help() -> None:
    for command in ("log", "ls", "show", "diff", "export", "tag", "tags", "branch", "verify", "gc", "du", "import"):
        result = run(command, "--help")
        assert result.exit_code == 0, result.output
        for line in result.stdout.splitlines():
            for flag in ("--json", "--values", "--all", "--dry-run", "--delete", "--create"):
                if f"{flag} " in line:
                    assert "<bool>" not in line, (command, line)


def test_version() -> None:
    result = run("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"inshrink-store {ins.__version__}"


# -- 3. nothing surprising happens silently ------------------------------------------------
def test_export_picks_the_format_from_the_extension(store: str, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    expected = ins.open(store).load("main")
    for name in ("out.pt", "out.pth"):
        result = run("export", store, "main", str(tmp_path / name))
        assert result.exit_code == 0, result.output
        assert "wrote 3 tensors" in result.stdout
        loaded = torch.load(tmp_path / name, weights_only=True)
        assert set(loaded) == {"0.weight", "0.bias", "2.weight"}
        for key, tensor in loaded.items():
            np.testing.assert_array_equal(tensor.numpy(), expected[f"model/{key}"])
    assert run("export", store, "main", str(tmp_path / "out.safetensors")).exit_code == 0
    assert set(load_file(str(tmp_path / "out.safetensors"))) == {"0.weight", "0.bias", "2.weight"}
    refused = run("export", store, "main", str(tmp_path / "out.bin"))
    assert refused.exit_code == 2 and not (tmp_path / "out.bin").exists()
    assert ".safetensors" in refused.output


@pytest.mark.parametrize("options", [["--prune", "0.3"], ["--protect", "0.01"], ["--prune-metric", "magnitude"],
                                     ["--embedding-bins", "32"]])
def test_quantization_options_without_bins_are_usage_errors(checkpoint: Path, tmp_path: Path,
                                                           options: list[str]) -> None:
    result = run("import", str(checkpoint), str(tmp_path / "new"), *options)
    assert result.exit_code == 2, result.output
    assert "--bins" in result.output


def test_sensitivity_pruning_of_a_file_is_a_usage_error(checkpoint: Path, tmp_path: Path) -> None:
    result = run("import", str(checkpoint), str(tmp_path / "new"), "--bins", "8", "--prune", "0.1",
                 "--prune-metric", "sensitivity")
    assert result.exit_code == 2, result.output
    assert "gradients" in result.output
    assert run("import", str(checkpoint), str(tmp_path / "new"), "--bins", "8", "--prune-metric", "bogus").exit_code == 2


def test_import_creates_a_store_only_where_nothing_is_or_when_asked(checkpoint: Path, tmp_path: Path,
                                                                    monkeypatch, capsys) -> None:
    new = tmp_path / "brand-new"
    code, stdout, stderr = run_main(monkeypatch, capsys, "import", str(checkpoint), str(new))
    assert code == 0, stderr
    assert f"created a new store at {new}" in stderr and len(ins.open(str(new)).log()) == 1
    code, _, stderr = run_main(monkeypatch, capsys, "import", str(checkpoint), str(new))
    assert code == 0 and "created" not in stderr  # an existing store is just used

    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, stderr = run_main(monkeypatch, capsys, "import", str(checkpoint), str(empty))
    one_error_line(code, stderr, "--create", str(empty))
    assert list(empty.iterdir()) == []
    code, _, stderr = run_main(monkeypatch, capsys, "import", str(checkpoint), str(empty), "--create")
    assert code == 0 and "created a new store" in stderr

    project = tmp_path / "project"  # e.g. a misspelled store path that names someone's folder
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    for extra in ([], ["--create"]):
        code, _, stderr = run_main(monkeypatch, capsys, "import", str(checkpoint), str(project), *extra)
        one_error_line(code, stderr, str(project), "notes.txt")
    assert sorted(p.name for p in project.iterdir()) == ["notes.txt"]
    code, _, stderr = run_main(monkeypatch, capsys, "init", str(project))
    one_error_line(code, stderr, "notes.txt")

    code, _, stderr = run_main(monkeypatch, capsys, "import", str(tmp_path / "missing.pt"), str(tmp_path / "s2"))
    one_error_line(code, stderr, "missing.pt")
    assert not (tmp_path / "s2").exists()  # a missing file creates no store


def test_a_quantized_import_records_its_config_for_log(checkpoint: Path, tmp_path: Path) -> None:
    url = str(tmp_path / "q")
    result = run("import", str(checkpoint), url, "--bins", "8", "--prune", "0.1", "--protect", "0.01")
    assert result.exit_code == 0, result.output
    meta = json.loads(run("log", url, "--json").stdout)[0]["metadata"]["quantization"]
    record = ins.QuantizationRecord.from_dict(meta)
    assert record.config == ins.QuantConfig(bins=8, prune=0.1, protect=0.01) and record.search is None
    table = run("log", url)
    assert "bins=8 prune=0.1" in table.stdout and "protect=0.01" in table.stdout
    lossless = str(tmp_path / "l")
    assert run("import", str(checkpoint), lossless).exit_code == 0
    assert "quantization" not in json.loads(run("log", lossless, "--json").stdout)[0]["metadata"]


# -- 4. completeness -----------------------------------------------------------------------
def test_tags_lists_tags(store: str) -> None:
    assert run("tag", store, "v1", "main~1").exit_code == 0
    listed = run("tags", store, "--json")
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.stdout) == [{"name": "v1", "snapshot": ins.open(store).resolve("main~1")}]
    assert "v1" in run("tags", store).stdout


def test_diff_values_match_the_library(store: str) -> None:
    expected = ins.open(store).diff("main~1", "main", values=True).to_dict()
    result = run("diff", store, "main~1", "main", "--values", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads(json.dumps(expected))
    by_path = {t["path"]: t for t in expected["tensors"]}
    assert by_path["model/0.weight"]["max_abs_change"] == pytest.approx(1.0)
    assert by_path["model/2.weight"]["max_abs_change"] == 0.0


def test_show_matches_the_end_of_a_name_and_suggests_close_ones(store: str, monkeypatch, capsys) -> None:
    result = run("show", store, "main", "0.bias", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["tensor"] == "model/0.bias"
    assert json.loads(run("show", store, "main", "bias", "--json").stdout)["tensor"] == "model/0.bias"
    code, _, stderr = run_main(monkeypatch, capsys, "show", store, "main", "weight")
    one_error_line(code, stderr, "model/0.weight", "model/2.weight", "2 tensors")
    code, _, stderr = run_main(monkeypatch, capsys, "show", store, "main", "0.wieght")
    one_error_line(code, stderr, "did you mean", "model/0.weight")
    code, _, stderr = run_main(monkeypatch, capsys, "show", store, "main", "zzz")
    one_error_line(code, stderr, "zzz", "3 tensors", "inshrink ls")


def test_messages_count_in_the_singular_and_plural(tmp_path: Path) -> None:
    url = str(tmp_path / "one")
    ins.open(url, create=True).save({"w": np.ones(4, np.float32)})
    assert "ok: 1 version, 2 trees, 1 object (0 deltas)" in run("verify", url).stdout
    assert "kept 1 version;" in run("gc", url, "--dry-run").stdout
    pytest.importorskip("safetensors")
    assert "wrote 1 tensor to" in run("export", url, "main", str(tmp_path / "o.safetensors")).stdout


def test_init_on_an_existing_store_points_at_the_cli(store: str, monkeypatch, capsys) -> None:
    code, _, stderr = run_main(monkeypatch, capsys, "init", store)
    one_error_line(code, stderr, f"inshrink log {store}")
    assert "inshrink_store.open" not in stderr


@pytest.mark.s3
def test_a_missing_bucket_says_so(s3_server: str, checkpoint: Path, monkeypatch, capsys) -> None:
    url = "s3://no-such-bucket-here/store"
    for args in (["log", url], ["ls", url], ["init", url], ["import", str(checkpoint), url]):
        code, _, stderr = run_main(monkeypatch, capsys, *args)
        line = one_error_line(code, stderr, "bucket no-such-bucket-here does not exist")
        assert "inshrink init" not in line, (args, line)
    code, _, stderr = run_main(monkeypatch, capsys, "log", "s3://inshrink-test/no-store-here")
    one_error_line(code, stderr, "inshrink init")  # the bucket exists: the store does not


# -- 4e. embeddings in a state dict from a file ----------------------------------------------
def test_embedding_names_are_recognised() -> None:
    pytest.importorskip("torch")
    from inshrink_store.torch.tensors import infer_module_kinds

    two_d = np.zeros((4, 4), np.float32)
    names = ["model/embed.weight", "model/tok_embeddings.weight", "model/transformer.wte.weight",
             "model/transformer.wpe.weight", "model/model.embed_tokens.weight", "model/embedding.weight",
             "model/bert.embeddings.word_embeddings.weight", "model/pos_emb.weight", "embed_in.weight"]
    others = ["model/embed_proj.weight", "model/lm_head.weight", "model/embeddings.LayerNorm.weight",
              "model/embed.bias", "model/0.weight"]
    kinds = infer_module_kinds({**dict.fromkeys(names + others, two_d), "model/x.embed.weight": np.zeros(4)})
    assert kinds == dict.fromkeys(names, "Embedding")


def test_embedding_bins_apply_to_an_imported_file(checkpoint: Path, tmp_path: Path) -> None:
    url = str(tmp_path / "e")
    assert run("import", str(checkpoint), url, "--bins", "4").exit_code == 0, "import"
    rows = {r["tensor"]: r for r in json.loads(run("ls", url, "--json").stdout)["tensors"]}
    assert rows["model/proj.weight"]["levels"] <= 4
    assert 4 < rows["model/embed.weight"]["levels"] <= 16  # QuantConfig's embedding_bins default
    assert run("import", str(checkpoint), url, "--bins", "4", "--embedding-bins", "8").exit_code == 0
    rows = {r["tensor"]: r for r in json.loads(run("ls", url, "--json").stdout)["tensors"]}
    assert 4 < rows["model/embed.weight"]["levels"] <= 8 and rows["model/proj.weight"]["levels"] <= 4


def test_save_state_gives_embeddings_their_bins(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from inshrink_store.torch import save_state

    repo = ins.open(str(tmp_path / "s"), create=True)
    gen = torch.Generator().manual_seed(1)
    state = {"model": {"tok_embeddings.weight": torch.randn(256, 32, generator=gen),
                       "out.weight": torch.randn(256, 32, generator=gen)}}
    save_state(repo, state, quantize=ins.QuantConfig(bins=4, embedding_bins=32))
    arrays = repo.checkout().arrays()
    assert 16 < arrays["model/tok_embeddings.weight"].attributes["levels"] <= 32
    assert arrays["model/out.weight"].attributes["levels"] <= 4


# -- 5. every error path is one line ---------------------------------------------------------
def test_every_command_fails_in_one_line(store: str, tmp_path: Path, monkeypatch, capsys) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    nowhere = str(tmp_path / "nowhere")
    out = str(tmp_path / "o.safetensors")
    cases = [
        # a bad store path
        ["log", nowhere], ["ls", nowhere], ["show", nowhere, "main", "w"], ["diff", nowhere, "a", "b"],
        ["export", nowhere, "main", out], ["tag", nowhere], ["tags", nowhere], ["tag", nowhere, "t"],
        ["branch", nowhere], ["branch", nowhere, "b"], ["verify", nowhere], ["gc", nowhere], ["du", nowhere],
        ["init", str(blocker / "s")], ["import", str(blocker), str(blocker / "s")], ["demo", str(blocker / "s")],
        ["log", str(blocker)],
        # a bad ref
        ["log", store, "--branch", "nope"], ["ls", store, "nope"], ["show", store, "nope", "0.bias"],
        ["diff", store, "nope", "main"], ["diff", store, "main", "nope~9"], ["export", store, "nope", out],
        ["tag", store, "t", "nope"], ["branch", store, "b", "nope"], ["du", store, "nope"],
        ["tag", store, "nope", "-d"], ["branch", store, "nope", "-d"], ["log", store, "--branch", "main~99"],
        # a bad tensor
        ["show", store, "main", "nope"], ["show", store, "main", "weight"],
    ]
    for args in cases:
        code, _, stderr = run_main(monkeypatch, capsys, *args)
        assert code == 1, (args, stderr)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in stderr, (args, stderr)

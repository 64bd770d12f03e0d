"""``export --format hf`` writes the keys ``from_pretrained`` looks for (issue 43: a Lightning
version's keys carry the LightningModule's attribute, ``model.``, and loaded nothing)."""

from __future__ import annotations

import logging

import pytest

from inshrink_store.errors import FormatError
from inshrink_store.torch.pretrained import _matched

MODEL_KEYS = ["transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", "lm_head.weight"]


def test_keys_as_the_model_names_them_are_kept() -> None:
    state = {key: object() for key in MODEL_KEYS}
    assert _matched(state, MODEL_KEYS) == state


def test_a_framework_prefix_is_taken_off_and_what_lies_outside_it_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    state = {f"model.{key}": key for key in MODEL_KEYS}
    state["loss_fn.weight"] = "not the model's"
    with caplog.at_level(logging.WARNING):
        got = _matched(state, MODEL_KEYS)
    assert got == {key: key for key in MODEL_KEYS}
    assert "loss_fn.weight" in caplog.text and "'model.'" in caplog.text


def test_a_deeper_prefix_wins_only_when_it_matches_more() -> None:
    state = {"net.inner.transformer.wte.weight": 1, "net.inner.lm_head.weight": 2}
    assert _matched(state, MODEL_KEYS) == {"transformer.wte.weight": 1, "lm_head.weight": 2}


def test_weights_of_another_model_are_refused_rather_than_loaded_at_random() -> None:
    with pytest.raises(FormatError, match=r"none of them the model's.*'encoder\.layer\.0\.weight'|"
                                          r"'encoder\.layer\.0\.weight'.*none of them the model's"):
        _matched({"encoder.layer.0.weight": 1}, MODEL_KEYS)


def test_a_refused_export_writes_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import inshrink_store as ins
    from inshrink_store.torch import save_state
    from tests._cli_helpers import run

    url = str(tmp_path / "store")
    save_state(ins.open(url, create=True), {"model": torch.nn.Linear(4, 3).state_dict()}, step=1)
    config = tmp_path / "config.json"
    config.write_text(transformers.BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=8).to_json_string())
    result = run("export", url, "main", str(tmp_path / "hf"), "--format", "hf", "--config", str(config))
    assert result.exit_code == 1 and "none of them the model's" in str(result.exception or result.output)
    assert not (tmp_path / "hf").exists()

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

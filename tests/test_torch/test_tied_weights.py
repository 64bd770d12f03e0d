"""Issue 41 item 5: a parameter under two names (an embedding tied to the LM head) is stored
once per version and every reader gives it back tied: one tensor under both names.

It used to be copied twice by the Checkpointer's state copy, so each copy was quantized on
its own and ``load_state(exact=False)`` returned two tensors differing by up to 1.27; the
``--format hf`` export then wrote both keys."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")

import inshrink_store as ins  # noqa: E402
from inshrink_store.structure import STRUCTURE_ATTR  # noqa: E402
from inshrink_store.torch import Checkpointer, load_state, save_state  # noqa: E402
from tests._cli_helpers import run_main  # noqa: E402


class Tied(torch.nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.mid = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: Any) -> Any:
        return self.head(torch.tanh(self.mid(self.emb(x))))


def _train(model: Any, opt: Any, ck: Checkpointer | None = None) -> None:
    opt.zero_grad()
    model(torch.randint(0, 64, (8, 5))).logsumexp(-1).mean().backward()
    if ck is not None:
        ck.observe_gradients()
    opt.step()


def _saved_compressed(repo: Any, model: Any, saves: int = 3, **extra: Any) -> Any:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.warns(UserWarning, match="no eval_fn"), Checkpointer(repo, model, opt) as ck:
        for step in range(saves):
            _train(model, opt, ck)
            ck.save(step, extra=extra or None)
        return ck.wait()


def _alias_paths(skeleton: Any) -> list[str]:
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "__alias__" in node:
                found.append(node["__alias__"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(skeleton)
    return found


def test_a_tied_parameter_is_stored_once_and_read_back_tied() -> None:
    torch.manual_seed(0)
    repo = ins.open(f"memory://tied-{uuid.uuid4().hex}", create=True)
    model = Tied()
    info = _saved_compressed(repo, model)
    assert info.metadata["quantization"]["config"] is not None  # a lossy version
    reader = repo.checkout(info.id)
    stored = set(reader.load())
    assert "model/emb.weight" in stored and "model/head.weight" not in stored  # stored once
    assert _alias_paths(reader.attributes[STRUCTURE_ATTR]) == ["model/emb.weight"]
    for exact in (False, True):
        state = load_state(repo, info.id, exact=exact)["model"]
        assert state["emb.weight"] is state["head.weight"], exact  # one tensor under both names
    # a restore into a fresh model keeps its tie (one Parameter) and holds the stored values
    fresh = Tied()
    opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    with Checkpointer(repo, fresh, opt, lossless=True) as ck:
        ck.restore(info.id)
    assert fresh.head.weight is fresh.emb.weight
    assert torch.equal(fresh.emb.weight, load_state(repo, info.id)["model"]["emb.weight"])


def test_save_state_stores_a_tied_parameter_once() -> None:
    torch.manual_seed(1)
    repo = ins.open(f"memory://tied-save-state-{uuid.uuid4().hex}", create=True)
    model = Tied()
    info = save_state(repo, {"model": model.state_dict()}, quantize=ins.policy.DEFAULT_CONFIG)
    assert "model/head.weight" not in set(repo.checkout(info.id).load())
    state = load_state(repo, info.id)["model"]
    assert state["emb.weight"] is state["head.weight"]


def test_a_tied_gpt2_exports_one_key_that_from_pretrained_ties(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    from inshrink_store.torch.pretrained import config_json

    torch.manual_seed(2)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.warns(UserWarning, match="no eval_fn"), Checkpointer(repo, model, opt) as ck:
        for step in range(2):
            opt.zero_grad()
            model(torch.randint(0, 64, (4, 8)), labels=torch.randint(0, 64, (4, 8))).loss.backward()
            ck.observe_gradients()
            opt.step()
            ck.save(step, extra={"hf_config": config_json(model)})
    state = load_state(repo, exact=False)["model"]
    assert state["lm_head.weight"] is state["transformer.wte.weight"]
    out = tmp_path / "hf"
    code, _, stderr = run_main(monkeypatch, capsys, "export", url, "main", str(out), "--format", "hf")
    assert code == 0, stderr
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(out))
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    assert torch.equal(loaded.transformer.wte.weight, state["transformer.wte.weight"])


def test_tensors_sharing_memory_as_different_views_are_named(caplog: pytest.LogCaptureFixture) -> None:
    from inshrink_store.torch.tensors import shared_views

    fused = torch.randn(6, 4)
    tied = torch.randn(3, 3)
    leaves = {"qkv": fused, "q": fused[:2], "v": fused[4:], "emb": tied, "other": torch.randn(2)}
    assert sorted(tuple(sorted(pair)) for pair in shared_views(leaves)) == [("q", "qkv"), ("qkv", "v")]
    assert shared_views({"a": tied, "b": tied}) == []  # the same view: an alias, stored once
    repo = ins.open(f"memory://views-{uuid.uuid4().hex}", create=True)
    with caplog.at_level("WARNING"):
        save_state(repo, {"model": {"qkv": fused, "q": fused[:2]}})
    assert "model/q and model/qkv share memory" in caplog.text

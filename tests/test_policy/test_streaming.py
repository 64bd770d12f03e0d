"""A save's plans made as the writer reads them (issue 42, scale): the same plans and records as
planning the whole state first, one tensor's quantized copy in memory at a time, and a tensor
that did not change since its closed-loop parent never quantized."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import inshrink_store as ins
from inshrink_store.policy import QuantConfig, SearchPolicy
from inshrink_store.policy.candidates import Candidates
from inshrink_store.policy.moments import MomentPolicy
from inshrink_store.policy.partition import StateQuantizer
from inshrink_store.policy.streaming import MomentStream, StreamedPlanSet
from inshrink_store.torch import Checkpointer


def _state(seed: int, layers: int, side: int) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, str]]:
    """Weights and their Adam moments (a step counter per pair), and state prefix -> weight path."""
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    params: dict[str, str] = {}
    for i in range(layers):
        w = (rng.standard_normal((side, side + i)) * 0.05).astype(np.float32)
        g = (rng.standard_t(3, w.shape) * 1e-3).astype(np.float32)
        arrays[f"model/{i}.weight"] = w
        arrays[f"optimizer/state/{i}/exp_avg"] = (0.1 * g).astype(np.float32)
        arrays[f"optimizer/state/{i}/exp_avg_sq"] = (1e-3 * g * g).astype(np.float32)
        arrays[f"optimizer/state/{i}/step"] = np.array(5.0, np.float32)
        params[f"optimizer/state/{i}"] = f"model/{i}.weight"
    dtypes = dict.fromkeys(arrays, "F32")
    return arrays, dtypes, params


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), layers=st.integers(1, 4), side=st.sampled_from([40, 72]),
       prune=st.sampled_from([0.0, 0.5]), threads=st.sampled_from(["1", "3"]))
def test_streamed_plans_are_the_plans_made_up_front(seed: int, layers: int, side: int, prune: float,
                                                    threads: str) -> None:
    """Every plan (values, codec, attributes) and the moments' record: streamed = all at once,
    whatever the writer's thread count (joint pruning reads the weights' pruned masks)."""
    arrays, dtypes, params = _state(seed, layers, side)
    policy = SearchPolicy(base=QuantConfig(bins=16, prune=prune, min_numel=64))

    def candidates() -> Candidates:
        return Candidates(arrays, dtypes, {}, optimizer_params=params)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("INSHRINK_WRITE_THREADS", threads)
        eager = policy.decide(candidates(), None)
        streamed = policy.decide(candidates(), None, stream=True)
        assert isinstance(streamed.plans, StreamedPlanSet) and streamed.moments is None
        assert eager.plans is not None and sorted(eager.plans) == sorted(streamed.plans)
        for path in sorted(arrays, reverse=True):  # moments read before their weights: masks made on demand
            if path not in eager.plans:
                assert path not in streamed.plans
                continue
            a, b = eager.plans[path], streamed.plans[path]
            np.testing.assert_array_equal(a.values, b.values)
            assert a.serializer.to_dict() == b.serializer.to_dict() and dict(a.attributes) == dict(b.attributes)
        record = streamed.moment_record()
        assert eager.moments is not None and record is not None
        assert record.to_dict() == eager.moments.to_dict()


def test_a_moment_pair_is_planned_once_and_its_plans_handed_over_once() -> None:
    arrays, dtypes, params = _state(0, 2, 64)
    calls: list[str] = []

    class Counting(MomentPolicy):
        def plan(self, tensors: Any, *args: Any, **kwargs: Any) -> Any:
            calls.extend(p for p in tensors if p.endswith("exp_avg"))
            return super().plan(tensors, *args, **kwargs)

    stream = MomentStream(Counting(), {p: a for p, a in arrays.items() if p.startswith("optimizer/")}, dtypes, {},
                          weights=None, params=params, hyper={})
    for path in sorted(stream):
        stream[path]
    assert calls == ["optimizer/state/0/exp_avg", "optimizer/state/1/exp_avg"]
    stream["optimizer/state/0/exp_avg_sq"]  # read again (a retried commit): planned again, same plan
    assert calls[-1] == "optimizer/state/0/exp_avg" and len(calls) == 3
    with pytest.raises(KeyError):
        stream["optimizer/state/0/step"]


def _model(layers: int, side: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, side)
    model(x).square().mean().backward()
    opt.step()
    return model, opt


def test_a_checkpointer_save_holds_one_quantized_tensor_at_a_time(tmp_path: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each weight is quantized when the writer reaches it and freed once written: at any
    quantization, at most a couple of earlier quantized copies are alive (planning the whole
    state first held all of them)."""
    monkeypatch.setenv("INSHRINK_WRITE_THREADS", "1")
    alive: list[weakref.ref[Any]] = []
    most = [0]
    real = StateQuantizer.quantize

    def tracked(self: StateQuantizer, name: str) -> Any:
        q = real(self, name)
        alive.append(weakref.ref(q.values))
        most[0] = max(most[0], sum(r() is not None for r in alive))
        return q

    monkeypatch.setattr(StateQuantizer, "quantize", tracked)
    model, opt = _model(8, 96)
    repo = ins.open(str(tmp_path / "store"), create=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no eval_fn
        with Checkpointer(repo, model, opt) as ck:
            ck.save(1)
            info = ck.wait()
    assert len(alive) >= 8
    assert most[0] <= 2, most[0]
    assert info is not None and len(info.metadata["moments"]["tensors"]) == 8  # the record, after the write


def test_a_frozen_layer_is_not_quantized_again(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A closed-loop save keeps a tensor that did not change from its parent's objects: its plan
    is never made (with and without eval_fn), and it reads back as the parent stored it."""
    quantized: list[str] = []
    real = StateQuantizer.quantize

    def tracked(self: StateQuantizer, name: str) -> Any:
        quantized.append(name)
        return real(self, name)

    monkeypatch.setattr(StateQuantizer, "quantize", tracked)
    for eval_fn in (None, lambda m: 1.0):
        model, opt = _model(3, 64)
        repo = ins.open(str(tmp_path / f"store-{eval_fn is None}"), create=True)
        x = torch.randn(16, 64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Checkpointer(repo, model, opt, eval_fn=eval_fn) as ck:
                ck.save(1)
                first = ck.wait()
                for p in model[0].parameters():
                    p.requires_grad_(False)  # frozen from here on
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
                quantized.clear()
                ck.save(2)
                second = ck.wait()
        assert first is not None and second is not None
        assert "model/0.weight" not in quantized and "model/1.weight" in quantized, quantized
        a = repo.checkout(first.id).read("model/0.weight")
        b = repo.checkout(second.id)
        np.testing.assert_array_equal(a, b.read("model/0.weight"))
        assert b.index.array("model/0.weight").attributes.get("unchanged") is True


@pytest.mark.parametrize("eval_fn", [None, lambda m: 1.0])
def test_streamed_saves_store_the_bytes_of_plans_made_up_front(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                               eval_fn: Any) -> None:
    """Three Checkpointer saves (a keyframe, then closed-loop residuals of the weights and the
    moments): the same root trees and moment records whether the plans stream or not."""
    from inshrink_store.policy.search_policy import SearchPolicy as Policy

    decide = Policy.decide

    def runs(stream: bool) -> list[tuple[str, Any]]:
        def forced(self: Any, *args: Any, **kwargs: Any) -> Any:
            kwargs["stream"] = stream
            return decide(self, *args, **kwargs)

        monkeypatch.setattr(Policy, "decide", forced)
        model, opt = _model(3, 80)
        x = torch.randn(16, 80)
        repo = ins.open(str(tmp_path / f"store-{stream}"), create=True)
        out = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Checkpointer(repo, model, opt, eval_fn=eval_fn,
                              optimizer_policy=MomentPolicy(closed_loop=True)) as ck:
                for step in range(3):
                    opt.zero_grad()
                    model(x).square().mean().backward()
                    opt.step()
                    ck.observe_gradients()
                    ck.save(step)
                    info = ck.wait()
                    assert info is not None
                    out.append((info.root, info.metadata["moments"]))
        return out

    assert runs(True) == runs(False)

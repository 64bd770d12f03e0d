"""Closed-loop versions through the public API: each version's weights a quantized residual on
the previous version's stored values (object coder 4), read back bit for bit in a fresh
process, chains bounded by the keyframe interval, what gc and verify do with them, and
the Checkpointer's use of them."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store import object_format
from inshrink_store.cas import ClosedLoopCoding
from inshrink_store.policy import QuantConfig
from inshrink_store.policy.closed_loop import CODING, ClosedLoop, parent_bases
from inshrink_store.policy.planner import StatePlanner

W = "model/w"


def _save(repo: Any, parent: str | None, w: np.ndarray, config: QuantConfig) -> tuple[Any, Any]:
    """One closed-loop save of ``w`` (and a lossless bias) on ``parent``: (info, plans)."""
    tensors = {W: w, "model/b": np.arange(3, dtype=np.float32)}
    reader = repo.checkout(parent) if parent else None
    loop = ClosedLoop([W], parent_bases(reader, [W], tensors), tensors, repo.keyframe_interval)
    inner = StatePlanner(config).plan(loop.search_arrays(tensors), {W: "F32", "model/b": "F32"}, {})
    plans = loop.plans(dict(inner), tensors)
    return repo.save(tensors, quantize=plans), plans


def _headers(repo: Any, version: str) -> list[object_format.ObjectHeader]:
    objects = repo._parts.objects
    return [objects.header(oid) for key, oid in sorted(repo.checkout(version).index.chunk_ids(W).items())
            if key != "zarr.json"]


@pytest.mark.parametrize("shape", [(300, 500), (1100, 1030)])  # one chunk; two, the second an edge
def test_versions_are_residual_chains_that_read_back_bit_for_bit_in_a_fresh_process(tmp_path: Path,
                                                                                   shape: tuple[int, int]) -> None:
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True, keyframe_interval=4)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    w[0, :5] = [3e38, -3e38, 1e-42, 0.0, -0.0]  # extremes and subnormals, protected in the residual
    config = QuantConfig(bins=4, prune=0.3, min_numel=16)
    parent, expected, errors = None, {}, []
    for step in range(7):
        w = w + (rng.standard_normal(shape) * 0.002).astype(np.float32)
        info, plans = _save(repo, parent, w, config)
        parent = info.id
        expected[info.id] = plans[W].values
        errors.append(float(np.linalg.norm(plans[W].values[1:] - w[1:]) / np.linalg.norm(w[1:])))
        kinds = {(h.kind, h.coder, h.depth) for h in _headers(repo, info.id)}
        assert kinds == ({(0, object_format.CODER_CLOSED_LOOP, 0)} if step % 4 == 0 else {(1, object_format.CODER_CLOSED_LOOP, step % 4)})
        assert repo.checkout(info.id).index.array(W).attributes["coding"] == CODING
    assert errors[3] < errors[0] / 4  # closed loop: each residual corrects what the last one missed
    script = (
        "import json, sys, numpy as np, inshrink_store as ins\n"
        "repo = ins.open(sys.argv[1])\n"
        "out = {}\n"
        "for sid in json.loads(sys.argv[2]):\n"
        "    out[sid] = np.asarray(repo.checkout(sid).read('model/w')).tobytes().hex()\n"
        "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", script, url, json.dumps(sorted(expected))],
                          capture_output=True, text=True, check=True)
    got = json.loads(done.stdout)
    for sid, values in expected.items():
        assert bytes.fromhex(got[sid]) == values.tobytes(), sid
    assert ins.open(url).verify().ok


def test_the_same_state_gives_the_same_objects_whatever_the_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    ws = [(rng.standard_normal((400, 300)) * 0.05).astype(np.float32)]
    ws.append(ws[0] + (rng.standard_normal((400, 300)) * 0.01).astype(np.float32))
    roots = []
    for threads in ("1", "4"):
        monkeypatch.setenv("INSHRINK_WRITE_THREADS", threads)
        repo = ins.open(f"memory://cl-{uuid.uuid4().hex}", create=True)
        parent = None
        for w in ws:
            info, _ = _save(repo, parent, w, QuantConfig(bins=8, prune=0.5, min_numel=16))
            parent = info.id
        roots.append(repo.snapshot(parent).root)
    assert roots[0] == roots[1]


def test_a_coding_that_does_not_decode_to_the_values_is_stored_as_raw_floats(caplog: pytest.LogCaptureFixture) -> None:
    """The values stored never depend on the coding: a wrong body is caught before it is
    written, the chunk is stored as plain floats, and the version reads back exactly."""
    repo = ins.open(f"memory://cl-{uuid.uuid4().hex}", create=True)
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((200, 100)) * 0.05).astype(np.float32)
    info, _ = _save(repo, None, w, QuantConfig(bins=8, min_numel=16))
    tensors = {W: w + np.float32(0.01), "model/b": np.arange(3, dtype=np.float32)}
    loop = ClosedLoop([W], parent_bases(repo.checkout(info.id), [W], tensors), tensors, repo.keyframe_interval)
    inner = StatePlanner(QuantConfig(bins=8, min_numel=16)).plan(loop.search_arrays(tensors),
                                                                 {W: "F32", "model/b": "F32"}, {})
    plans = loop.plans(dict(inner), tensors)
    good = plans[W]
    body = good.object_coder((0, 0), (200, 100)).body
    wrong = body[:12] + (np.frombuffer(body[12:16], "<f4") * 2).astype("<f4").tobytes() + body[16:]

    class Wrong(dict):  # type: ignore[type-arg]
        def plan(self, *_: Any) -> Any:
            return self

    bad = Wrong(plans)
    bad[W] = type(good)(good.values, good.serializer, good.attributes, good.pruned,
                        lambda coords, shape: ClosedLoopCoding(wrong, True))
    with caplog.at_level(logging.WARNING, logger="inshrink_store.cas"):
        second = repo.save(tensors, quantize=bad)
    assert "stored as raw floats" in caplog.text
    assert np.array_equal(repo.checkout(second.id).read(W), good.values)
    assert {h.coder for h in _headers(repo, second.id)} <= {object_format.CODER_BYTEGROUP, object_format.CODER_NONE}


def test_a_mostly_pruned_residual_is_padded_to_the_readers_bound() -> None:
    """A reader refuses to allocate a large array from objects smaller than 1/MAX_CHUNK_EXPANSION
    of a chunk: a residual that keeps almost nothing must still be that large."""
    objects = ins.open(f"memory://cl-{uuid.uuid4().hex}", create=True)._parts.objects
    n = 1 << 24  # a 64 MiB chunk (a user's chunking: the default's 4 MiB chunks never get near it)
    base = np.full(n, 0.25, np.float32)
    base_id = objects.put(base.tobytes(), element="float32").oid
    q = __import__("inshrink_store.codecs.nuq", fromlist=["quantizer"]).quantizer((0.0, 1.0), 0.0, "float32", "float32")
    residual = np.zeros(n, np.float32)
    residual[7] = 1.0
    from inshrink_store.codecs import closed_loop
    body = closed_loop.encode(q.encode(residual), np.array([0.0, 1.0], np.float32))
    assert len(body) < n * 4 // object_format.MAX_CHUNK_EXPANSION  # would be refused unpadded
    result = objects.put((base + residual).tobytes(), base=base_id, element="float32",
                         closed=ClosedLoopCoding(body, True))
    assert objects.stored_size(result.oid) >= n * 4 // object_format.MAX_CHUNK_EXPANSION
    assert objects.header(result.oid).coder == object_format.CODER_CLOSED_LOOP
    assert objects.get(result.oid) == (base + residual).tobytes()


def test_gc_keeps_every_base_a_kept_version_needs(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((256, 128)) * 0.05).astype(np.float32)
    parent, values = None, {}
    for _ in range(5):
        w = w + (rng.standard_normal(w.shape) * 0.003).astype(np.float32)
        info, plans = _save(repo, parent, w, QuantConfig(bins=4, prune=0.5, min_numel=16))
        parent, values[info.id] = info.id, plans[W].values
    repo.gc(keep_last=1)  # the head is a residual on four older objects: they must stay
    fresh = ins.open(url)
    assert np.array_equal(fresh.checkout(parent).read(W), values[parent])
    assert fresh.verify().ok
    assert _headers(fresh, parent)[0].depth == 4


@pytest.fixture
def torch_mod() -> Any:
    return pytest.importorskip("torch")


def _train_run(torch: Any, url: str, *, lr: float = 1e-3, saves: int = 6, **kwargs: Any) -> tuple[Any, Any, Any]:
    from inshrink_store.torch import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (128,), generator=torch.Generator().manual_seed(2))

    def evaluate(m: Any) -> float:
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(m(x), y))

    repo = ins.open(url, create=True)
    ck = Checkpointer(repo, model, opt, eval_fn=evaluate, tolerance=0.05, higher_is_better=False,
                      background=False, **kwargs)
    for step in range(1, saves + 1):
        for _ in range(5):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            ck.observe_gradients()
            opt.step()
        ck.save(step)
    ck.close()
    return repo, model, opt


def test_the_checkpointer_stores_weights_closed_loop_and_restores_them(torch_mod: Any) -> None:
    torch = torch_mod
    url = f"memory://cl-{uuid.uuid4().hex}"
    repo, model, _opt = _train_run(torch, url, exact_resume=0)
    head = repo.checkout("main")
    weight = "model/0.weight"
    assert head.index.array(weight).attributes["coding"] == CODING
    assert {h.kind for h in (repo._parts.objects.header(o) for k, o in head.index.chunk_ids(weight).items()
                             if k != "zarr.json")} == {1}  # the head is a residual
    stored = head.read(weight)
    live = model.state_dict()["0.weight"].numpy()
    assert np.linalg.norm(stored - live) / np.linalg.norm(live) < 0.05
    from inshrink_store.torch import Checkpointer
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    ck = Checkpointer(ins.open(url), fresh, torch.optim.Adam(fresh.parameters()), background=False,
                      eval_fn=lambda m: 0.0, exact_resume=0)
    assert ck.restore() == 6 and ck.restored_exact is False
    assert np.array_equal(fresh.state_dict()["0.weight"].numpy(), stored)
    ck.close()


def test_exact_resume_is_bit_exact_with_closed_loop_and_open_loop_stays_available(torch_mod: Any) -> None:
    torch = torch_mod
    url = f"memory://cl-{uuid.uuid4().hex}"
    repo, model, _ = _train_run(torch, url)
    from inshrink_store.torch import Checkpointer
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    ck = Checkpointer(ins.open(url), fresh, torch.optim.Adam(fresh.parameters()), background=False, eval_fn=lambda m: 0.0)
    ck.restore()
    assert ck.restored_exact is True
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True))
    ck.close()
    open_url = f"memory://cl-{uuid.uuid4().hex}"
    open_repo, _, _ = _train_run(torch, open_url, closed_loop=False)
    meta = json.loads(open_repo.checkout("main").view.get("model/0.weight/zarr.json"))
    assert meta["codecs"][0]["name"] == "inshrink.nuq"
    with pytest.raises(ins.errors.InvalidInputError, match="closed_loop"):
        Checkpointer(ins.open(url), fresh, closed_loop="yes")  # type: ignore[arg-type]


def test_nan_and_inf_weights_are_kept_as_stored_and_read_back(tmp_path: Path) -> None:
    """Bad values in a weight: the version holds the planned values (NaN and ±inf where the
    tensor has them, in a residual as in a keyframe) and reads back bit for bit."""
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((128, 96)) * 0.05).astype(np.float32)
    parent = None
    for step in range(3):
        w = w + (rng.standard_normal(w.shape) * 0.003).astype(np.float32)
        if step == 1:
            w[3, :3] = [np.nan, np.inf, -np.inf]
        info, plans = _save(repo, parent, w, QuantConfig(bins=8, prune=0.3, min_numel=16))
        parent = info.id
        got = ins.open(url).checkout(info.id).read(W)
        assert got.tobytes() == np.asarray(plans[W].values).tobytes()
        assert np.isfinite(got[4:]).all()
    assert np.isnan(got[3, 0]) and np.isposinf(got[3, 1]) and np.isneginf(got[3, 2])
    assert ins.open(url).verify().ok


def test_when_no_residual_meets_the_tolerance_keyframes_are_searched_before_lossless(
        torch_mod: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Residuals limited to 98 % pruned at 4 levels cannot follow weights that move a lot
    between saves; the save then searches keyframes (the default space) and stores a
    quantized version, where it used to store the weights lossless."""
    torch = torch_mod
    from inshrink_store.policy import save_decision
    from inshrink_store.policy.search import SearchSpace

    monkeypatch.setattr(save_decision, "RESIDUAL_SPACE",
                        SearchSpace(bins=(4,), prune=(0.98,), metrics=("magnitude",), protect=(0.0005,)))
    url = f"memory://cl-{uuid.uuid4().hex}"
    with caplog.at_level(logging.INFO, logger="inshrink_store.torch.checkpointer"):
        # big steps (lr 0.05): a residual that keeps 2 % of its elements cannot follow them
        repo, model, _opt = _train_run(torch, url, lr=0.05, saves=3)
    assert any("searched keyframes" in r.getMessage() for r in caplog.records)
    for info in repo.log():
        assert info.metadata["quantization"]["config"] is not None, f"version at step {info.step} stored lossless"
        head = repo.checkout(info.id)
        for path in ("model/0.weight",):  # (the output layer is kept lossless by the policy)
            assert head.index.array(path).attributes.get("coding") == CODING, (info.step, path, head.index.array(path).attributes)
            assert np.isfinite(head.read(path)).all()
    final = repo.checkout("main").read("model/0.weight")
    live = model.state_dict()["0.weight"].numpy()
    assert np.linalg.norm(final - live) / np.linalg.norm(live) < 0.1

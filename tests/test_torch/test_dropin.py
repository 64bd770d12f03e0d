"""The Checkpointer as a drop-in for torch.save/torch.load: a full resume is bit-identical,
and load_state reads parts of a version onto a device."""

from __future__ import annotations

import random
import uuid
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import inshrink_store as ins  # noqa: E402
from inshrink_store.errors import InvalidInputError, NotFoundError  # noqa: E402
from inshrink_store.reader import SnapshotReader  # noqa: E402
from inshrink_store.torch import Checkpointer, RNGState, load_state, save_state  # noqa: E402

DATA = torch.randn(256, 16, generator=torch.Generator().manual_seed(7))
LABELS = (DATA[:, :3].sum(1) > 0).long() + 2 * (DATA[:, 3] > 0).long()


@pytest.fixture
def url() -> str:
    return f"memory://dropin-{uuid.uuid4().hex}"


class Run:
    """A loop that consumes every kind of state a resume must bring back: dropout and
    batches from torch's RNG, augmentation from NumPy's global RNG and Python's random, a
    NumPy Generator of its own, an LR schedule, an epoch and a position in the data."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                         torch.nn.Linear(64, 4))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)
        self.rng = np.random.default_rng(seed)
        self.epoch, self.position = 0, 0

    def step(self) -> float:
        order = torch.randperm(256)[:32]
        shift = int(np.random.randint(0, 16)) + int(self.rng.integers(0, 16))
        scale = 1.0 + random.random()
        x = torch.roll(DATA[order] * scale, shift, dims=1)
        loss = torch.nn.functional.cross_entropy(self.model(x), LABELS[order])
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.position += 32
        if self.position >= 256:
            self.epoch, self.position = self.epoch + 1, 0
        return loss.item()

    def extra(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "np_rng": self.rng.bit_generator.state}


def test_a_full_resume_is_bit_identical_to_an_uninterrupted_run(url: str) -> None:
    reference = Run(seed=0)
    for _ in range(10):
        reference.step()
    expected = [reference.step() for _ in range(5)]

    first = Run(seed=0)
    repo = ins.open(url, create=True)
    with Checkpointer(repo, first.model, first.opt, lossless=True,
                      extra_state={"scheduler": first.sched, "rng": RNGState()}) as ck:
        for _ in range(10):
            first.step()
        ck.save(10, extra=first.extra())

    # a new process: other weights, other optimizer, scheduler and RNG states
    resumed = Run(seed=123)
    resumed.step()
    with Checkpointer(ins.open(url), resumed.model, resumed.opt, lossless=True,
                      extra_state={"scheduler": resumed.sched, "rng": RNGState()}) as ck:
        assert ck.restore() == 10
        resumed.epoch, resumed.position = ck.extra["epoch"], ck.extra["position"]
        resumed.rng.bit_generator.state = ck.extra["np_rng"]
        got = [resumed.step() for _ in range(5)]

    assert got == expected  # floats compared exactly
    for (name, a), b in zip(reference.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert resumed.sched.state_dict() == reference.sched.state_dict()
    assert (resumed.epoch, resumed.position) == (reference.epoch, reference.position)
    ref_opt, got_opt = reference.opt.state_dict(), resumed.opt.state_dict()
    assert got_opt["param_groups"] == ref_opt["param_groups"]
    for k, v in ref_opt["state"].items():
        for name, t in v.items():
            assert torch.equal(got_opt["state"][k][name], t), (k, name)


def test_rng_state_round_trips_through_a_store_without_pickle(url: str) -> None:
    repo = ins.open(url, create=True)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    gauss = random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    assert isinstance(gauss, float)
    save_state(repo, {"rng": RNGState().state_dict()})
    expected = (random.random(), float(np.random.standard_normal()), float(torch.rand(1)))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    RNGState().load_state_dict(load_state(repo, prefix="rng"))
    assert (random.random(), float(np.random.standard_normal()), float(torch.rand(1))) == expected


def _state() -> dict[str, Any]:
    shared = torch.arange(6, dtype=torch.float32)
    return {
        "model": {"embed.weight": shared, "head.weight": shared, "head.bias": torch.zeros(3, dtype=torch.bfloat16)},
        "optimizer": {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.ones(6)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "extra": {"epoch": 3, "history": [torch.ones(2), torch.zeros(1)]},
    }


def test_load_state_with_a_prefix_reads_only_that_part(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = ins.open(url, create=True)
    save_state(repo, _state())
    read: list[str] = []
    real_read = SnapshotReader.read

    def recording(self: SnapshotReader, name: str) -> np.ndarray:
        read.append(name)
        return real_read(self, name)

    monkeypatch.setattr(SnapshotReader, "read", recording)
    model = load_state(repo, "main", prefix="model/")
    assert sorted(model) == ["embed.weight", "head.bias", "head.weight"]
    assert model["embed.weight"] is model["head.weight"]  # still tied
    assert model["head.bias"].dtype == torch.bfloat16
    assert all(p.startswith("model/") for p in read), read
    read.clear()
    assert load_state(repo, prefix="optimizer/state/0")["step"].item() == 4.0
    assert read == ["optimizer/state/0/exp_avg", "optimizer/state/0/step"]
    assert load_state(repo, prefix="optimizer")["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert torch.equal(load_state(repo, prefix="extra/history/0"), torch.ones(2))  # one tensor, by list index
    assert load_state(repo, prefix="extra/epoch") == 3
    assert sorted(load_state(repo, prefix="")) == ["extra", "model", "optimizer"]
    with pytest.raises(NotFoundError, match=r"Got no 'modle' under the top level instead; choose one of "
                                            r"\['extra', 'model', 'optimizer'\]"):
        load_state(repo, prefix="modle")
    with pytest.raises(InvalidInputError, match="Expected prefix"):
        load_state(repo, prefix=3)  # type: ignore[arg-type]


def test_load_state_prefix_on_a_store_written_by_plain_repo_save(url: str) -> None:
    repo = ins.open(url, create=True)
    repo.save({"model/w": np.ones(3, np.float32), "model/b": np.zeros(2, np.float32), "other": np.ones(1)})
    assert sorted(load_state(repo, prefix="model")) == ["b", "w"]
    assert torch.equal(load_state(repo, prefix="model/w"), torch.ones(3))
    with pytest.raises(NotFoundError, match=r"choose one of \['model', 'other'\]"):
        load_state(repo, prefix="opt")


def test_load_state_map_location_moves_every_tensor_and_keeps_ties(url: str) -> None:
    repo = ins.open(url, create=True)
    save_state(repo, _state())
    meta = load_state(repo, map_location=torch.device("meta"))
    assert meta["model"]["embed.weight"].is_meta and meta["optimizer"]["state"][0]["step"].is_meta
    assert meta["model"]["embed.weight"] is meta["model"]["head.weight"]
    on_cpu = load_state(repo, map_location="cpu", prefix="model")
    assert on_cpu["head.bias"].device.type == "cpu"
    if torch.cuda.is_available():
        gpu = load_state(repo, map_location="cuda:0")
        assert gpu["model"]["head.bias"].device.type == "cuda"
        assert torch.equal(gpu["extra"]["history"][0].cpu(), torch.ones(2))
    with pytest.raises(InvalidInputError, match="Expected map_location to be a device"):
        load_state(repo, map_location="gpu-please")
    with pytest.raises(InvalidInputError, match="device string or a torch.device"):
        load_state(repo, map_location={"cuda:0": "cpu"})

"""load_state's map_location: a device this torch cannot use is a clear InvalidInputError."""

from __future__ import annotations

import uuid

import pytest

torch = pytest.importorskip("torch")

import inshrink_store as ins  # noqa: E402
from inshrink_store.errors import InvalidInputError  # noqa: E402
from inshrink_store.torch import load_state, save_state  # noqa: E402


@pytest.fixture
def repo() -> ins.Repository:
    repo = ins.open(f"memory://maploc-{uuid.uuid4().hex}", create=True)
    save_state(repo, {"model": {"w": torch.ones(3)}})
    return repo


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
@pytest.mark.parametrize("where", ["cuda", "cuda:0", torch.device("cuda")],
                         ids=["str", "str-index", "torch.device"])
def test_a_cuda_map_location_on_a_cpu_only_torch_names_it_and_says_why(repo: ins.Repository, where: object) -> None:
    """Regression: torch's raw AssertionError ("Torch not compiled with CUDA enabled") escaped."""
    with pytest.raises(InvalidInputError, match=r"(?s)Expected map_location.*Got .*cuda.*CUDA is not available"):
        load_state(repo, map_location=where)
    with pytest.raises(InvalidInputError, match="CUDA is not available"):
        load_state(repo, map_location=where, prefix="model")
    assert torch.equal(load_state(repo, map_location="cpu")["model"]["w"], torch.ones(3))


def test_a_device_index_past_the_devices_here_is_named(repo: ins.Repository, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InvalidInputError, match=r"one of the 1 cuda devices here. Got 'cuda:3' instead"):
        load_state(repo, map_location="cuda:3")

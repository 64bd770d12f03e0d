"""Issue 33, item 7: more of what a training state holds comes back as it went in.

numpy arrays inside the state come back as numpy arrays; float8 (e4m3fn, e5m2) and complex
tensors are stored lossless, every bit pattern; ``torch.Size`` comes back as ``torch.Size``.
What is still refused is an error naming the key. Before: each was a FormatError, and a
``torch.Size`` came back as a plain tuple.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store import dtypes
from tests._cli_helpers import run

torch = pytest.importorskip("torch")
from inshrink_store.torch import load_state, save_state  # noqa: E402

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _roundtrip(url: str, state: dict[str, Any], **kwargs: Any) -> Any:
    repo = ins.open(url, create=True)
    save_state(repo, state)
    return load_state(ins.open(url), **kwargs)  # a fresh handle


def _same_bits(got: Any, want: Any) -> None:
    assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
    assert got.contiguous().view(torch.uint8).tolist() == want.contiguous().view(torch.uint8).tolist()


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_float8_every_bit_pattern_round_trips(memory_url: str, dtype: Any) -> None:
    every = torch.arange(256, dtype=torch.uint8).view(dtype)
    weight = torch.randn(16, 32).to(dtype)  # 2-D and float: still never quantized
    got = _roundtrip(memory_url, {"model": {"w": weight, "all": every.reshape(16, 16), "t": every[:7][::2]}})
    _same_bits(got["model"]["w"], weight)
    _same_bits(got["model"]["all"], every.reshape(16, 16))
    _same_bits(got["model"]["t"], every[:7][::2])


def test_float8_values_are_read_as_float32(memory_url: str) -> None:
    """show, diff and read_float widen float8 exactly, as torch does."""
    for dtype in FP8:
        every = torch.arange(256, dtype=torch.uint8).view(dtype)
        name = dtypes.get("F8_E4M3" if dtype == torch.float8_e4m3fn else "F8_E5M2")
        np.testing.assert_array_equal(name.to_float32(every.view(torch.uint8).numpy()), every.float().numpy())


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_float8_narrowing_matches_torch(dtype: Any) -> None:
    x = torch.cat([torch.randn(20000) * s for s in (1e-3, 1.0, 300.0, 1e5)]
                  + [torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 464.0, 61440.0])])
    name = dtypes.get("F8_E4M3" if dtype == torch.float8_e4m3fn else "F8_E5M2")
    np.testing.assert_array_equal(name.from_float32(x.numpy()), x.to(dtype).view(torch.uint8).numpy())


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_tensors_round_trip_exactly(memory_url: str, dtype: Any) -> None:
    real = torch.randn(8, 8, dtype=torch.float64)
    z = torch.complex(real, -real.flip(0)).to(dtype)
    z[0, 0] = complex(float("nan"), -0.0)
    z[0, 1] = complex(float("inf"), float("-inf"))
    got = _roundtrip(memory_url, {"model": {"z": z, "conj": z.conj(), "neg": z[1:3]._neg_view()}})
    _same_bits(got["model"]["z"], z)
    _same_bits(got["model"]["conj"], z.conj().resolve_conj())
    _same_bits(got["model"]["neg"], z[1:3]._neg_view().resolve_neg())


def test_numpy_arrays_come_back_as_numpy(memory_url: str) -> None:
    rng_state = np.random.default_rng(1).bit_generator.state  # dicts of ints: plain values
    legacy = np.random.RandomState(3).get_state()  # ('MT19937', uint32 array, int, int, float)
    arrays = {"f32": np.arange(6, dtype=np.float32).reshape(2, 3), "f16": np.ones(3, np.float16),
              "u16": np.arange(4, dtype=np.uint16), "u64": np.array([2**64 - 1], np.uint64),
              "scalar": np.array(2.5), "bool": np.array([True, False]), "c128": np.array([1 + 2j]),
              "strided": np.arange(12, dtype=np.int32)[::3], "big_endian": np.arange(3, dtype=">f4"),
              "empty": np.zeros((0, 3), np.int8)}
    state = {"model": {"w": torch.ones(2)}, "extra": {"arrays": arrays, "np_rng": rng_state, "legacy": legacy}}
    got = _roundtrip(memory_url, state)["extra"]
    for key, want in arrays.items():
        back = got["arrays"][key]
        assert type(back) is np.ndarray, key
        assert back.shape == want.shape and back.dtype == want.dtype.newbyteorder("="), key
        np.testing.assert_array_equal(back, want)
    assert got["np_rng"] == rng_state
    restored = np.random.RandomState()
    restored.set_state(got["legacy"])
    assert restored.randint(0, 2**31, 5).tolist() == np.random.RandomState(3).randint(0, 2**31, 5).tolist()
    assert type(got["legacy"]) is tuple and type(got["legacy"][1]) is np.ndarray


def test_numpy_arrays_stay_numpy_under_a_prefix_and_map_location(memory_url: str) -> None:
    got = _roundtrip(memory_url, {"extra": {"a": np.arange(3), "t": torch.ones(1)}}, prefix="extra",
                     map_location="cpu")
    assert type(got["a"]) is np.ndarray and isinstance(got["t"], torch.Tensor)


def test_torch_size_comes_back_as_torch_size(memory_url: str) -> None:
    state = {"extra": {"shape": torch.Size([2, 3]), "nested": [torch.Size([]), (torch.Size([4]), 1)],
                       "plain": (2, 3)}}
    got = _roundtrip(memory_url, state)["extra"]
    assert type(got["shape"]) is torch.Size and got["shape"] == torch.Size([2, 3])
    assert type(got["nested"][0]) is torch.Size and got["nested"][0] == torch.Size([])
    assert type(got["nested"][1][0]) is torch.Size and type(got["nested"][1]) is tuple
    assert type(got["plain"]) is tuple


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("make, needle", [
    (lambda: torch.ones(2, dtype=torch.complex32), "complex32"),
    (lambda: torch.ones(2, dtype=torch.float8_e4m3fnuz), "float8_e4m3fnuz"),
    (lambda: np.array(["a", "b"]), "<U1"),
    (lambda: np.array([object()], dtype=object), "object"),
    (lambda: {1, 2}, "set"),
], ids=["complex32", "fp8-fnuz", "numpy-str", "numpy-object", "set"])
def test_what_is_still_refused_names_the_key(memory_url: str, make: Any, needle: str) -> None:
    repo = ins.open(memory_url, create=True)
    with pytest.raises(ins.FormatError) as info:
        save_state(repo, {"extra": {"odd": {"key": make()}}})
    assert "extra/odd/key" in str(info.value) and needle in str(info.value), str(info.value)
    assert repo.branches() == {}


def test_the_cli_shows_float8_and_complex_tensors(memory_url: str, tmp_path: Path) -> None:
    repo = ins.open(memory_url, create=True)
    save_state(repo, {"model": {"f8": torch.tensor([1.0, -2.0, 448.0]).to(torch.float8_e4m3fn),
                                "z": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)}})
    shown = run("show", memory_url, "main", "f8", "--json")
    assert shown.exit_code == 0, shown.output
    assert '"dtype": "F8_E4M3"' in shown.stdout and '"max": 448.0' in shown.stdout
    shown = run("show", memory_url, "main", "z", "--json")
    assert shown.exit_code == 0 and '"dtype": "C64"' in shown.stdout, shown.output
    listed = run("ls", memory_url, "main")
    assert listed.exit_code == 0 and "F8_E4M3" in listed.stdout and "C64" in listed.stdout, listed.output


def test_the_checkpointer_keeps_numpy_and_sizes_in_extra(memory_url: str) -> None:
    from inshrink_store.torch import Checkpointer

    model = torch.nn.Linear(3, 2)
    ck = Checkpointer(ins.open(memory_url, create=True), model, lossless=True, background=False)
    ck.save(1, extra={"np_rng": np.random.RandomState(5).get_state(), "shape": torch.Size([3, 2])})
    ck.close()
    again = Checkpointer(ins.open(memory_url), torch.nn.Linear(3, 2), lossless=True, background=False)
    assert again.restore() == 1
    assert type(again.extra["np_rng"][1]) is np.ndarray and type(again.extra["shape"]) is torch.Size
    again.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_saves_float8_and_complex_shards(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from inshrink_store.torch import InshrinkStorageReader, InshrinkStorageWriter

    every = torch.arange(256, dtype=torch.uint8)
    state = {"e4m3": every.view(torch.float8_e4m3fn).reshape(16, 16).clone(),
             "e5m2": every.view(torch.float8_e5m2).clone(), "z": torch.randn(4, 4, dtype=torch.complex128)}
    url = str(tmp_path / "store")
    dcp.save(state, storage_writer=InshrinkStorageWriter(url), no_dist=True)
    assert ins.open(url).verify().ok
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=InshrinkStorageReader(url), no_dist=True)
    for key, want in state.items():
        _same_bits(target[key], want)

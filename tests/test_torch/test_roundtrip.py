"""torch state <-> store round trips: bit-exact values, exact structure, safe reading.

``save_state`` / ``load_state`` must give back the same nested structure (dict/list/tuple,
Python scalars of the same type), tensors of the same dtype and shape with the same bits
(NaN payloads and -0.0 included), tied tensors as one tensor, and a model + optimizer that
resume training bit-exact. Reading a checkpoint file never executes pickled code, and the
base package imports without torch.
"""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import inshrink_store as ins  # noqa: E402
from inshrink_store.errors import FormatError  # noqa: E402
from inshrink_store.torch import (  # noqa: E402
    export_safetensors,
    import_file,
    load_checkpoint_file,
    load_state,
    save_state,
)

HYPOTHESIS = settings(
    max_examples=25, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
]

#: the integer type of the same width, to compare raw bits (NaN payloads, -0.0)
_BITS = {
    torch.float64: torch.int64, torch.float32: torch.int32,
    torch.float16: torch.int16, torch.bfloat16: torch.int16,
}


# -- comparison helpers -----------------------------------------------------------------
def bits(t: Any) -> Any:
    """A tensor whose ``torch.equal`` is bit equality of ``t`` (contiguous, CPU)."""
    t = t.detach().cpu().contiguous()
    return t.view(_BITS[t.dtype]) if t.dtype in _BITS else t


def assert_tensor_same(got: Any, want: Any, where: str) -> None:
    assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__} is not a tensor"
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.device.type == "cpu", where
    assert torch.equal(bits(got), bits(want)), f"{where}: values differ bitwise"


def assert_same(got: Any, want: Any, where: str = "/") -> None:
    """Same nested structure, same scalar types and values (floats bitwise), same tensors."""
    if isinstance(want, torch.Tensor):
        assert_tensor_same(got, want, where)
        return
    if isinstance(want, dict):  # OrderedDict (a state_dict) comes back as a plain, ordered dict
        assert type(got) is dict, f"{where}: {type(got).__name__} is not a dict"
    else:
        assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        assert [type(k) for k in got] == [type(k) for k in want], f"{where}: key types"
        for k in want:
            assert_same(got[k], want[k], f"{where}{k}/")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}{i}/")
    elif isinstance(want, float):
        same_bits = struct.pack("<d", got) == struct.pack("<d", want)
        assert same_bits, f"{where}: {got!r} != {want!r}"  # -0.0 and NaN sign/payload included
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


# -- strategies ---------------------------------------------------------------------------
def _special_values(dtype: Any) -> Any:
    """Values that a float detour would lose: NaN payloads, -0.0, infinities, subnormals."""
    if dtype == torch.bfloat16:
        # 0x7FC1: quiet NaN with a payload bit; 0xFFFF (-1): negative NaN, all payload bits;
        # 0x7F81: signalling NaN; 0x8000: -0.0; 0x0001: smallest subnormal
        raw = [0x7FC1, -1, 0x7F81, -0x8000, 0x0001, 0x7F80]
        return torch.tensor(raw, dtype=torch.int16).view(torch.bfloat16)
    if dtype == torch.float16:
        return torch.tensor([0x7E01, -1, 0x7C01, -0x8000, 0x0001, 0x7C00], dtype=torch.int16).view(
            torch.float16)
    if dtype == torch.float32:
        return torch.tensor([0x7FC00001, -1, 0x7F800001, -0x80000000, 1], dtype=torch.int32).view(
            torch.float32)
    if dtype == torch.float64:
        return torch.tensor([0x7FF8000000000001, -1, -0x8000000000000000, 1],
                            dtype=torch.int64).view(torch.float64)
    return None


@st.composite
def tensors(draw: Any) -> Any:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
    n = math.prod(shape)
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        t = torch.randint(0, 2, (n,), generator=g).bool()
    elif dtype.is_floating_point:
        t = (torch.randn(n, generator=g, dtype=torch.float64) * 10 ** draw(st.integers(-3, 3))).to(dtype)
        special = _special_values(dtype)
        if n and draw(st.booleans()):
            k = min(n, special.numel())
            t.view(_BITS[dtype])[:k] = special.view(_BITS[dtype])[:k]  # raw bits, no float detour
    else:
        info = torch.iinfo(dtype)
        hi = info.max if dtype != torch.int64 else 2**62  # randint's bounds must fit int64
        t = torch.randint(info.min, hi, (n,), generator=g, dtype=torch.int64).to(dtype)
        if n:
            t[0] = info.min
            t[-1] = info.max
    return t.reshape(shape)


_KEY_ALPHABET = st.sampled_from("abcxyz_-.0123456789ABé")
str_keys = st.text(_KEY_ALPHABET, min_size=1, max_size=6).filter(
    lambda s: s not in (".", "..") and not s.startswith("__") and s != "zarr.json")
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.text(max_size=8),
)


def _dict_of(children: Any, keys: Any = str_keys) -> Any:
    return st.dictionaries(keys, children, max_size=4)


def _int_key_dict(children: Any) -> Any:
    """Optimizer-style: int keys, possibly beside str keys (never 1 and '1' together)."""
    keys = st.one_of(st.integers(-3, 50), st.integers(2**53, 2**64), str_keys)
    return st.dictionaries(keys, children, max_size=3).filter(
        lambda d: len({str(k) for k in d}) == len(d))


nested = st.recursive(
    st.one_of(tensors(), scalars),
    lambda children: st.one_of(
        _dict_of(children), _int_key_dict(children),
        st.lists(children, max_size=3), st.tuples(children, children),
    ),
    max_leaves=10,
)
states = st.dictionaries(str_keys, nested, min_size=1, max_size=4)


# -- 1. property: nested state round trip ---------------------------------------------------
@HYPOTHESIS
@given(state=states)
def test_nested_state_round_trips_exactly(memory_url: str, state: dict[str, Any]) -> None:
    repo = ins.open(memory_url, create=True)
    info = save_state(repo, state, message="prop")
    got = load_state(repo, info.id)
    assert_same(got, state)
    # distinct (non-empty) tensors stay distinct: only real ties come back as one object
    restored = [t for t in _tensor_leaves(got) if t.numel()]
    assert len({id(t) for t in restored}) == len(restored)


def _tensor_leaves(obj: Any) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensor_leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensor_leaves(v)]
    return []


@HYPOTHESIS
@given(state=states, data=st.data())
def test_ties_anywhere_in_the_state_come_back_as_one_tensor(memory_url: str, state: dict[str, Any],
                                                            data: Any) -> None:
    shared = data.draw(tensors().filter(lambda t: t.numel() > 0), label="shared")
    where = data.draw(st.lists(str_keys, min_size=2, max_size=4, unique=True), label="tied keys")
    state = {**state, "tied": dict.fromkeys(where, shared), "tied_list": [shared]}
    repo = ins.open(memory_url, create=True)
    save_state(repo, state)
    got = load_state(repo)
    assert_same(got, state)
    first = got["tied"][where[0]]
    assert all(got["tied"][k] is first for k in where) and got["tied_list"][0] is first
    assert sum(1 for p in repo.checkout().names() if p.startswith("tied")) == 1  # stored once


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3)], ids=str)
def test_each_dtype_and_shape_round_trips(memory_url: str, dtype: Any, shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    t = torch.arange(n, dtype=torch.float64).sub(n // 2).to(dtype).reshape(shape)
    repo = ins.open(memory_url, create=True)
    save_state(repo, {"w": t})
    got = load_state(repo)["w"]
    assert_tensor_same(got, t, "w")
    assert got.dim() == len(shape)


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_bf16_nan_payloads_and_negative_zero_survive(request: pytest.FixtureRequest,
                                                     backend: str) -> None:
    raw = torch.tensor([0x7FC1, -1, 0x7F81, -0x8000, 0x0000, 0x7F80, -0x0080], dtype=torch.int16)
    state = {
        "bf16": raw.view(torch.bfloat16),
        "f16": torch.tensor([0x7E01, -1, -0x8000], dtype=torch.int16).view(torch.float16),
        "f32": torch.tensor([0x7FC00001, -1, -0x80000000], dtype=torch.int32).view(torch.float32),
        "f64": torch.tensor([-0.0, float("nan"), float("-inf")], dtype=torch.float64),
        "scalars": [-0.0, float("nan"), float("inf"), 5e-324, 2**53 + 1, -(2**64)],
    }
    repo = ins.open(str(request.getfixturevalue(f"{backend}_url")), create=True)
    save_state(repo, state)
    got = load_state(repo)
    assert_same(got, state)
    assert torch.equal(got["bf16"].view(torch.int16), raw)
    assert math.copysign(1.0, got["scalars"][0]) == -1.0


def _float_from_bits(u: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", u))[0]


def _float_bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def test_python_float_nan_sign_and_payload_survive(memory_url: str) -> None:
    raw = [0xFFF8000000000000, 0x7FF8000000000001]  # -NaN, +NaN with a payload bit
    repo = ins.open(memory_url, create=True)
    save_state(repo, {"opt": {"nans": [_float_from_bits(u) for u in raw]}})
    got = load_state(repo)["opt"]["nans"]
    assert [_float_bits(x) for x in got] == raw


# -- 2. non-contiguous tensors --------------------------------------------------------------
def test_non_contiguous_tensors_round_trip(memory_url: str) -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    bf = torch.arange(60, dtype=torch.float32).reshape(6, 10).to(torch.bfloat16)
    state = {
        "transposed": base.t(),
        "stepped": base[:, ::3],
        "rows": base[1::2],
        "expanded": torch.arange(3, dtype=torch.int64).unsqueeze(0).expand(4, 3),
        "bf16_t": bf.t(),
        "negative_stride_like": base.flip(0),
        "offset_view": base[2:4, 5:],
    }
    assert not any(state[k].is_contiguous() for k in ("transposed", "stepped", "rows", "expanded",
                                                       "bf16_t", "offset_view"))
    repo = ins.open(memory_url, create=True)
    save_state(repo, state)
    got = load_state(repo)
    for k, want in state.items():
        assert_tensor_same(got[k], want, k)
        assert got[k].is_contiguous(), k


# -- 3. tied tensors ------------------------------------------------------------------------
class _TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.body = torch.nn.Linear(4, 4)
        self.lm_head = torch.nn.Linear(4, 11, bias=False)
        self.lm_head.weight = self.embed.weight  # tied

    def forward(self, x: Any) -> Any:
        return self.lm_head(torch.relu(self.body(self.embed(x))))


def test_tied_tensors_come_back_as_one_tensor(memory_url: str) -> None:
    torch.manual_seed(0)
    model = _TiedLM()
    sd = model.state_dict()
    assert sd["embed.weight"].data_ptr() == sd["lm_head.weight"].data_ptr()
    repo = ins.open(memory_url, create=True)
    info = save_state(repo, {"model": sd})
    got = load_state(repo, info.id)["model"]
    assert list(got) == list(sd)
    for k in sd:
        assert_tensor_same(got[k], sd[k], k)
    # documented (docs/reference/dtypes.md): stored once, come back as one tensor
    assert got["embed.weight"] is got["lm_head.weight"]
    assert repo.checkout(info.id).names().count("model/lm_head.weight") == 0
    # and they load back into a tied model, still tied
    fresh = _TiedLM()
    fresh.load_state_dict(got)
    assert fresh.lm_head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.embed.weight)


def test_views_of_one_storage_are_not_confused_with_ties(memory_url: str) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"a": base, "a_t": base.t(), "row": base[1], "same": base, "e1": torch.zeros(0),
             "e2": torch.zeros(0)}
    repo = ins.open(memory_url, create=True)
    save_state(repo, state)
    got = load_state(repo)
    for k, want in state.items():
        assert_tensor_same(got[k], want, k)
    assert got["a"] is got["same"]
    assert got["a_t"] is not got["a"] and got["row"] is not got["a"]


def test_distinct_empty_tensors_are_not_tied(memory_url: str) -> None:
    state = {"model": {"a": torch.zeros(0), "b": torch.zeros(0), "w": torch.ones(2)}}
    repo = ins.open(memory_url, create=True)
    save_state(repo, state)
    assert sorted(repo.checkout().names()) == ["model/a", "model/b", "model/w"]
    got = load_state(repo)["model"]
    assert got["a"] is not got["b"]


def test_tied_weights_export_with_every_exported_tensor_exact(memory_url: str, tmp_path: Path) -> None:
    st_torch = pytest.importorskip("safetensors.torch")
    torch.manual_seed(1)
    model = _TiedLM()
    sd = model.state_dict()
    repo = ins.open(memory_url, create=True)
    save_state(repo, {"model": sd})
    out = tmp_path / "tied.safetensors"
    export_safetensors(repo.checkout(), out)
    loaded = st_torch.load_file(str(out))
    assert "embed.weight" in loaded
    assert set(loaded) <= set(sd) and set(sd) - set(loaded) <= {"lm_head.weight"}
    for k, v in loaded.items():
        assert_tensor_same(v, sd[k], k)
    fresh = _TiedLM()  # a tied model needs only one of the tied names
    missing = fresh.load_state_dict(loaded, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


# -- 4. model + optimizer resume bit-exact ----------------------------------------------------
def _make(opt_name: str, seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    if opt_name == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=1e-4)
    elif opt_name == "adamw_amsgrad":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    return model, opt


def _steps(model: Any, opt: Any, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(8, 6, generator=g)
        y = torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("opt_name", ["adam", "sgd_momentum", "adamw_amsgrad"])
def test_model_and_optimizer_resume_bit_exact(memory_url: str, opt_name: str) -> None:
    model, opt = _make(opt_name, seed=1)
    _steps(model, opt, 3, seed=10)
    repo = ins.open(memory_url, create=True)
    info = save_state(repo, {"model": model.state_dict(), "optimizer": opt.state_dict()}, step=3)

    restored = load_state(repo, info.id)
    assert_same(restored["optimizer"], opt.state_dict())
    model2, opt2 = _make(opt_name, seed=999)  # different init: everything must come from the store
    model2.load_state_dict(restored["model"])
    opt2.load_state_dict(restored["optimizer"])

    _steps(model, opt, 3, seed=20)
    _steps(model2, opt2, 3, seed=20)
    for (name, p), p2 in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(bits(p), bits(p2)), name
    assert_same(opt2.state_dict(), opt.state_dict())


# -- 5. bad input ---------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_complex32_tensor_is_refused_naming_it(memory_url: str) -> None:
    """complex64 and complex128 are stored (tests/test_torch/test_state_types.py); complex32 is not."""
    repo = ins.open(memory_url, create=True)
    state = {"model": {"ok": torch.ones(2), "freq_cis": torch.ones(3, dtype=torch.complex32)}}
    with pytest.raises(FormatError, match=r"model/freq_cis") as exc:
        save_state(repo, state)
    assert "complex" in str(exc.value)
    assert repo.branches() == {}  # nothing was committed


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz],
                         ids=str)
def test_other_unsupported_dtypes_are_refused(memory_url: str, dtype: Any) -> None:
    repo = ins.open(memory_url, create=True)
    with pytest.raises(FormatError, match=r"bad_tensor"):
        save_state(repo, {"bad_tensor": torch.zeros(2).to(dtype)})


@pytest.mark.parametrize("kind", ["meta", "sparse_coo", "sparse_csr"])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support:UserWarning")
def test_sparse_and_meta_tensors_are_refused_naming_them(memory_url: str, kind: str) -> None:
    t = {"meta": lambda: torch.empty(2, 2, device="meta"),
         "sparse_coo": lambda: torch.eye(2).to_sparse(),
         "sparse_csr": lambda: torch.eye(2).to_sparse_csr()}[kind]()
    repo = ins.open(memory_url, create=True)
    with pytest.raises(FormatError, match=r"model/odd"):
        save_state(repo, {"model": {"ok": torch.ones(1), "odd": t}})


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_quantized_tensors_are_refused_naming_them(memory_url: str) -> None:
    q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    repo = ins.open(memory_url, create=True)
    with pytest.raises(FormatError, match=r"model/q"):
        save_state(repo, {"model": {"q": q}})


@pytest.mark.parametrize("key", ["a/b", "..", ".", "", "__x", "a\\b", "zarr.json"])
def test_unusable_keys_are_refused_naming_them(memory_url: str, key: str) -> None:
    repo = ins.open(memory_url, create=True)
    with pytest.raises(FormatError) as exc:
        save_state(repo, {"model": {key: torch.ones(1)}})
    assert repr(key) in str(exc.value)
    assert repo.branches() == {}


@pytest.mark.parametrize("key", [(1, 2), 1.5, None, True, b"w"], ids=repr)
def test_non_string_keys_are_refused(memory_url: str, key: Any) -> None:
    repo = ins.open(memory_url, create=True)
    with pytest.raises(FormatError, match="key"):
        save_state(repo, {"model": {key: torch.ones(1)}})


def test_int_keys_round_trip_and_clash_with_their_string(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    state = {"opt": {0: torch.ones(1), 7: {"step": 3}}, "names": {"0": 1}}
    save_state(repo, state)
    assert_same(load_state(repo), state)
    with pytest.raises(FormatError, match="distinct"):
        save_state(repo, {"m": {1: torch.ones(1), "1": torch.zeros(1)}})


def test_non_state_values_are_refused(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    with pytest.raises(FormatError, match="set"):
        save_state(repo, {"model": {"w": torch.ones(1)}, "misc": {1, 2}})
    with pytest.raises(FormatError):
        save_state(repo, [torch.ones(1)])  # type: ignore[arg-type]


# -- 6. malicious pickles ---------------------------------------------------------------------
class _Payload:
    """Unpickling this runs ``exec``: creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _evil_file(path: Path, marker: Path) -> Path:
    torch.save({"model": {"w": torch.ones(2)}, "extra": _Payload(marker)}, str(path))
    return path


def test_payload_is_live_when_loaded_unsafely(tmp_path: Path) -> None:
    """Control: the file really would execute code under a full unpickler."""
    marker = tmp_path / "control_marker"
    evil = _evil_file(tmp_path / "control.pt", marker)
    torch.load(str(evil), weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin"])
def test_malicious_pickle_is_refused_without_running_it(memory_url: str, tmp_path: Path,
                                                        suffix: str) -> None:
    marker = tmp_path / "pwned"
    evil = _evil_file(tmp_path / f"evil{suffix}", marker)
    with pytest.raises(FormatError, match="never unpickles code"):
        load_checkpoint_file(evil)
    assert not marker.exists()
    repo = ins.open(memory_url, create=True)
    with pytest.raises(FormatError):
        import_file(repo, evil)
    assert not marker.exists()
    assert repo.branches() == {}


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
def test_plain_pickle_file_with_os_system_is_refused(tmp_path: Path) -> None:
    import pickle

    marker = tmp_path / "pwned_os"

    class _OsSystem:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps({"model": _OsSystem()}))
    with pytest.raises(FormatError):
        load_checkpoint_file(evil)
    assert not marker.exists()


def test_safe_pt_file_imports(memory_url: str, tmp_path: Path) -> None:
    model, opt = _make("adam", seed=3)
    _steps(model, opt, 1, seed=4)
    f = tmp_path / "ok.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, str(f))
    repo = ins.open(memory_url, create=True)
    info = import_file(repo, f, message="import")
    got = load_state(repo, info.id)
    assert_same(got["model"], model.state_dict())
    assert_same(got["optimizer"], opt.state_dict())


# -- 7. the base package needs no torch ---------------------------------------------------------
def test_base_package_imports_without_torch() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # any "import torch" now raises ImportError
        import numpy as np
        import inshrink_store
        import inshrink_store.repository
        import inshrink_store.admin
        import inshrink_store.policy
        import inshrink_store._cli
        repo = inshrink_store.open("memory://no-torch-check", create=True)
        repo.save({"w": np.arange(4, dtype=np.float32)})
        assert (repo.load()["w"] == np.arange(4, dtype=np.float32)).all()
        try:
            import inshrink_store.torch
        except ImportError as exc:
            assert type(exc).__name__ == "MissingDependencyError", type(exc)
            assert "torch" in str(exc)
        else:
            raise AssertionError("inshrink_store.torch imported without torch")
        assert sys.modules["torch"] is None  # nothing replaced the block
        assert not [m for m in sys.modules if m.startswith("torch.")]
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("OK")


# -- 8. safetensors export --------------------------------------------------------------------
def test_export_safetensors_is_bit_exact(memory_url: str, tmp_path: Path) -> None:
    st_torch = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(5)
    model = {
        "w32": torch.randn(4, 5, generator=g),
        "w16": torch.randn(3, generator=g).half(),
        "bf": torch.tensor([0x7FC1, -1, -0x8000, 0x3F80], dtype=torch.int16).view(torch.bfloat16),
        "w64": torch.tensor([-0.0, float("nan")], dtype=torch.float64),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "i64": torch.tensor([-(2**63), 2**63 - 1]),
        "u8": torch.arange(256, dtype=torch.uint8),
        "mask": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "t": torch.randn(3, 4, generator=g).t(),
    }
    repo = ins.open(memory_url, create=True)
    info = save_state(repo, {"model": model, "optimizer": {"state": {}, "lr": 0.1}})
    out = tmp_path / "model.safetensors"
    n = export_safetensors(repo.checkout(info.id), out)
    assert n == len(model)
    loaded = st_torch.load_file(str(out))
    assert sorted(loaded) == sorted(model)
    for k, want in model.items():
        assert_tensor_same(loaded[k], want, k)
    # and the file imports back to the same version content
    assert_same(load_checkpoint_file(out)["model"], {k: loaded[k] for k in loaded})


@pytest.mark.parametrize("quantize", [None, "config"])
def test_save_state_reads_the_tensors_in_place_and_never_changes_them(memory_url: str, quantize: Any) -> None:
    """save_state does not copy the state (it ends before returning): it reads read-only
    views, so the lossless and quantized paths, the moments planner included, leave every
    tensor (contiguous, transposed, bfloat16) bit for bit as it was."""
    from inshrink_store.policy import QuantConfig
    from inshrink_store.policy.moments import MomentPolicy

    g = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.Linear(96, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 96, generator=g)).sum().backward()
    opt.step()
    state = {"model": {**model.state_dict(), "t": torch.randn(80, 64, generator=g).t(),
                       "half": torch.randn(4096, generator=g).to(torch.bfloat16)},
             "optimizer": opt.state_dict()}
    before = {k: v.clone() for k, v in state["model"].items()}
    before_opt = {i: {k: t.clone() for k, t in s.items()} for i, s in state["optimizer"]["state"].items()}
    repo = ins.open(memory_url, create=True)
    config = QuantConfig(bins=8, min_numel=1024) if quantize else None
    save_state(repo, state, quantize=config, moments=MomentPolicy(min_numel=1024) if quantize else None)
    for k, v in state["model"].items():
        assert torch.equal(v.view(torch.uint8) if v.dtype == torch.bfloat16 else v,
                           before[k].view(torch.uint8) if v.dtype == torch.bfloat16 else before[k]), k
    for i, s in state["optimizer"]["state"].items():
        assert all(torch.equal(t, before_opt[i][k]) for k, t in s.items()), i
    loaded = load_state(repo, "main")
    if quantize is None:
        assert all(torch.equal(loaded["model"][k], v) for k, v in before.items())

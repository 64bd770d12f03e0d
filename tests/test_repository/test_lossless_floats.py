"""Lossless float tensors in the store: inshrink.bytegroup, bit exact, same bytes every time.

float32, float16 and bfloat16 (uint16 bits declared ``BF16``) are saved through
``repo.save`` and checked out again; their zarr.json names the codec, and the chunk
objects do not depend on zarr's concurrency settings.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import inshrink_store as ins
from inshrink_store.testing import float_arrays

LOGICAL = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sample=float_arrays(max_dims=2, max_side=30))
def test_every_float_dtype_saves_and_checks_out_bit_exact(memory_url: str, sample) -> None:
    repo = ins.open(memory_url, create=True)
    info = repo.save({"model/w": sample.array}, dtypes={"model/w": LOGICAL[sample.dtype]})
    reader = repo.checkout(info.id)
    back = reader.load()["model/w"]
    assert back.dtype == sample.array.dtype and back.shape == sample.array.shape
    assert _bits(back) == _bits(sample.array)  # NaN payloads, -0.0, subnormals, ±Inf included
    doc = json.loads(reader.view.get("model/w/zarr.json"))
    assert doc["codecs"][1]["name"] == "inshrink.bytegroup"
    assert doc["codecs"][1]["configuration"]["dtype"] == sample.dtype
    assert doc["attributes"]["inshrink"]["dtype"] == LOGICAL[sample.dtype]


def test_a_multi_chunk_state_round_trips_on_a_local_disk(local_url: str) -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((3000, 1024)) * 0.02).astype(np.float32)  # three 4 MiB chunks
    state = {"model/w32": w, "model/w16": w[:1000].astype(np.float16),
             "model/wbf": ins.dtypes.float32_to_bf16(w[:2000]), "model/step": np.array(3, np.int64)}
    repo = ins.open(local_url, create=True)
    info = repo.save(state, dtypes={"model/wbf": "BF16"})
    reader = repo.checkout(info.id)
    loaded = reader.load()
    assert all(_bits(loaded[k]) == _bits(v) for k, v in state.items())
    names = {p: json.loads(reader.view.get(f"{p}/zarr.json"))["codecs"][-1]["name"] for p in state}
    assert names == {"model/w32": "inshrink.bytegroup", "model/w16": "inshrink.bytegroup",
                     "model/wbf": "inshrink.bytegroup", "model/step": "blosc"}
    stored = repo.stored_bytes(info.id)
    assert all(stored[p] < 0.95 * state[p].nbytes for p in ("model/w32", "model/w16", "model/wbf"))


@pytest.mark.parametrize("concurrency", [1, 3, 32])
def test_same_state_gives_the_same_chunk_objects_whatever_the_concurrency(memory_url: str, concurrency: int) -> None:
    rng = np.random.default_rng(1)
    state = {"model/a": (rng.standard_normal((2500, 1024)) * 0.02).astype(np.float32),
             "model/b": ins.dtypes.float32_to_bf16(rng.standard_normal((3000, 1024)).astype(np.float32))}
    repo = ins.open(memory_url, create=True)

    def chunk_ids(branch: str, **config: int) -> dict[str, dict[str, str]]:
        with zarr.config.set(config):
            info = repo.save(state, dtypes={"model/b": "BF16"}, branch=branch)
        return {p: dict(a.chunk_ids) for p, a in repo.checkout(info.id).arrays().items()}

    default = chunk_ids("default")
    assert chunk_ids("other", **{"async.concurrency": concurrency}) == default
    assert sum(len(ids) for ids in default.values()) >= 5  # several chunks per array


@given(seed=st.integers(0, 2**16))
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_ratio_estimate_is_what_the_store_keeps(memory_url: str, seed: int) -> None:
    from inshrink_store.policy.ratio import lossless_bytes

    rng = np.random.default_rng(seed)
    w = ins.dtypes.float32_to_bf16((rng.standard_normal((700, 900)) * 0.05).astype(np.float32))
    repo = ins.open(memory_url, create=True)
    info = repo.save({"t": w}, dtypes={"t": "BF16"}, branch=f"b{seed}")
    reader = repo.checkout(info.id)
    objects = reader.view.objects
    kept = sum(len(objects.get(oid)) for key, oid in reader.arrays()["t"].chunk_ids.items() if key != "zarr.json")
    assert lossless_bytes(w, "BF16") == kept

"""A tensor saved again with the same bits takes its parent's chunks: nothing is encoded.

The writer records an xxh3-128 of a lossless tensor's bits and of how it stores them
(``attributes.inshrink.content``); the next save of the same tensor under the same settings
adopts the parent's zarr.json and chunk ids instead of encoding the tensor again.
"""

from __future__ import annotations

import numpy as np
import pytest
import zarr

import inshrink_store as ins
from inshrink_store.codecs import bytegroup


def _state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model/a": rng.standard_normal((64, 32)).astype(np.float32),
        "model/b": rng.standard_normal(100).astype(np.float16),
        "optimizer/state/0/step": np.array(7, np.int64),
        "empty": np.zeros((0, 4), np.float32),
    }


@pytest.fixture
def encoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the float chunks the bytegroup codec encodes (alone, or as a keyframe and a
    delta against the parent's chunk in one go)."""
    calls: list[int] = []
    for name in ("encode_chunk", "encode_keyframe_and_delta"):
        real = getattr(bytegroup, name)

        def counting(data, *args, real=real, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(data.size)
            return real(data, *args, **kwargs)

        monkeypatch.setattr(bytegroup, name, counting)
    return calls


def test_saving_the_same_state_again_encodes_nothing_and_stores_the_same_version(
    store_url: str, encoded: list[int]
) -> None:
    repo = ins.open(store_url, create=True)
    state = _state()
    first = repo.save(state, message="v1")
    assert encoded, "the first save encodes its float tensors"
    encoded.clear()
    again = repo.save(state, message="v2")
    assert encoded == []
    assert again.root == first.root
    ins.index.CACHE.clear()
    loaded = ins.open(store_url).load("main")
    for name, value in state.items():
        np.testing.assert_array_equal(loaded[name], value)
    assert sorted(ins.open(store_url).checkout("main").names()) == sorted(state)
    assert not repo.verify().problems


def test_a_changed_bit_or_a_changed_declaration_is_encoded_again(store_url: str, encoded: list[int]) -> None:
    repo = ins.open(store_url, create=True)
    state = _state()
    repo.save(state, message="v1")
    changed = dict(state)
    flipped = state["model/a"].copy()
    flipped.view(np.uint32)[5, 3] ^= 1  # one mantissa bit
    changed["model/a"] = flipped
    encoded.clear()
    repo.save(changed, message="v2")
    # only that tensor: coded whole, and against its parent's chunk (the XOR delta trial)
    assert set(encoded) == {flipped.nbytes} and len(encoded) <= 2
    assert ins.open(store_url).load("main")["model/a"].tobytes() == flipped.tobytes()

    bits = {"w": np.arange(64, dtype=np.uint16)}
    repo.save(bits, message="as integers", branch="bits")
    encoded.clear()
    repo.save(bits, dtypes={"w": "BF16"}, message="as bfloat16", branch="bits")
    assert set(encoded) == {bits["w"].nbytes}  # same bits, another dtype: stored afresh
    reader = ins.open(store_url).checkout("bits")
    assert reader.dtypes() == {"w": "BF16"}


def test_adopted_tensors_keep_their_groups_readable_through_zarr(store_url: str) -> None:
    repo = ins.open(store_url, create=True)
    state = _state()
    repo.save(state, message="v1")
    repo.save(state, message="v2", attributes={"note": "same tensors"})
    group = zarr.open_group(store=ins.open(store_url).snapshot_store("main"), mode="r")
    assert group.attrs["note"] == "same tensors"
    np.testing.assert_array_equal(group["model"]["a"][...], state["model/a"])

"""The split of ``arrays`` into ``reader`` and ``writer``: the old names still work and are the
same objects, chunking can be chosen per write, and a reader exposes its index."""

from __future__ import annotations

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store import dtypes, index, writer, zarr_store


def test_zarr_store_keeps_its_names() -> None:
    for name in ("SnapshotChunks", "PendingChunks", "InshrinkStore", "load_root", "load_node",
                 "tree_path", "METADATA_KEY", "Entry"):
        assert hasattr(zarr_store, name)


def test_chunking_is_chosen_per_write(memory_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = ins.open(memory_url, create=True)
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    monkeypatch.setattr(writer, "default_chunks", lambda shape, itemsize: (16, 64))
    repo.save({"w": w})
    assert repo.checkout("main").arrays()["w"].chunks == (16, 64)


def test_a_reader_exposes_its_index_and_reads_bf16_as_float(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    values = np.array([1.5, -0.0, np.inf, np.nan], np.float32)
    bits = dtypes.float32_to_bf16(values)
    repo.save({"h": bits}, dtypes={"h": "BF16"})
    got = repo.checkout("main")
    assert isinstance(got.index, index.SnapshotIndex) and got.index is got.view.index
    assert got.arrays()["h"].dtype == "BF16" and got.arrays()["h"].itemsize == 2
    np.testing.assert_array_equal(got.read("h"), bits)
    as_float = got.read_float("h")
    assert as_float.dtype == np.float32
    assert np.array_equal(as_float.view(np.uint32), dtypes.bf16_to_float32(bits).view(np.uint32))

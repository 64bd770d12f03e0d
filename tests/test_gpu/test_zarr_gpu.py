"""zarr's GPU mode: with ``zarr.config.enable_gpu()`` the nuq codec takes and returns device
buffers, and stores exactly the bytes the host path stores (so either mode reads what the
other wrote). Skipped without CuPy or a device."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from inshrink_store import dtypes
from inshrink_store.codecs.nuq import NUQZarrCodec, quantizer
from tests.test_gpu._device import cupy_or_skip

pytestmark = pytest.mark.gpu
cp = cupy_or_skip()

CODEBOOK = [-0.25, -0.0625, 0.0, 0.0625, 0.25]


def _weights(element: str) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = (rng.standard_t(4, (300, 257)) * 0.05).astype(np.float32)
    x[::17, ::5] = np.nan
    return np.ascontiguousarray(dtypes.by_codec_name(element).from_float32(x))


def _array(store: zarr.abc.store.Store, element: str, shape: tuple[int, ...]) -> zarr.Array:
    bits = element == "bfloat16"
    return zarr.create_array(
        store, shape=shape, chunks=(128, 257), dtype="uint16" if bits else element,
        serializer=NUQZarrCodec(codebook=CODEBOOK, tolerance=0.01,
                                dtype="bfloat16" if bits else None),
        compressors=None, fill_value=0,
    )


def _chunks(store: zarr.storage.MemoryStore) -> dict[str, bytes]:
    return {k: v.to_bytes() for k, v in store._store_dict.items() if k.startswith("c/")}


@pytest.mark.parametrize("element", ["float32", "float16", "bfloat16"])
def test_gpu_mode_writes_the_host_bytes_and_reads_device_arrays(element):
    x = _weights(element)
    host_store, device_store = zarr.storage.MemoryStore(), zarr.storage.MemoryStore()
    _array(host_store, element, x.shape)[...] = x
    with zarr.config.enable_gpu():
        arr = _array(device_store, element, x.shape)
        arr[...] = cp.asarray(x)
        back = arr[...]
    assert isinstance(back, cp.ndarray)
    assert _chunks(device_store) == _chunks(host_store)
    host_back = zarr.open_array(host_store, mode="r")[...]
    assert back.get().tobytes() == host_back.tobytes()
    q = quantizer(tuple(CODEBOOK), 0.01, "bfloat16", element)
    assert _chunks(host_store)["c/0/0"] == q.encode(np.ascontiguousarray(x[:128]))


def test_gpu_mode_reads_a_quantized_repository_version():
    """The store's own reads (inshrink_store.zarr_store) hand the codec device buffers."""
    import inshrink_store as ins
    from inshrink_store.policy import QuantConfig

    repo = ins.open("memory://gpu-mode-read", create=True)
    w = (np.random.default_rng(1).standard_t(4, (512, 384)) * 0.02).astype(np.float32)
    repo.save({"model/w": w}, quantize=QuantConfig(bins=16, prune=0.1, protect=0.005))
    on_host = zarr.open_array(store=repo.snapshot_store("main"), path="model/w", mode="r")[...]
    with zarr.config.enable_gpu():
        on_device = zarr.open_array(store=repo.snapshot_store("main"), path="model/w",
                                    mode="r")[...]
    assert isinstance(on_device, cp.ndarray)
    assert on_device.get().tobytes() == on_host.tobytes()

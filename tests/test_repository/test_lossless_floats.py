"""Lossless float tensors in the store: raw bits in zarr, ``inshrink.bytegroup`` planes in
the object store (coder 3, XORed against the parent's chunk where smaller), bit exact,
same bytes every time.

float32, float16 and bfloat16 (uint16 bits declared ``BF16``) are saved through
``repo.save`` and checked out again; their zarr.json has zarr's ``bytes`` codec alone, and
the chunk objects do not depend on zarr's concurrency settings, on the writer's thread
count, or on whether the writer stores the chunks itself or through zarr's codec pipeline.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import inshrink_store as ins
from inshrink_store import cas, object_format, writer
from inshrink_store.testing import float_arrays
from inshrink_store.zarr_store import PendingChunks

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
    assert [c["name"] for c in doc["codecs"]] == ["bytes"]
    assert doc["attributes"]["inshrink"]["dtype"] == LOGICAL[sample.dtype]
    # coded by coder 3, or kept raw (coder 0) where that is no larger: a few elements
    coders = _coders(reader, "model/w")
    assert coders <= {object_format.CODER_BYTEGROUP, object_format.CODER_NONE} and bool(coders) == bool(sample.array.size)
    if sample.array.nbytes <= object_format.RAW_FLOATS_MAX:
        assert coders <= {object_format.CODER_NONE}


def _coders(reader: object, path: str) -> set[int]:
    """The object coders of the chunks of array ``path``."""
    objects = reader.view.objects  # type: ignore[attr-defined]
    ids = reader.arrays()[path].chunk_ids.values()  # type: ignore[attr-defined]
    return {objects.header(oid).coder for oid in ids}


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
    assert names == {"model/w32": "bytes", "model/w16": "bytes", "model/wbf": "bytes", "model/step": "blosc"}
    assert all(_coders(reader, p) == {object_format.CODER_BYTEGROUP} for p in ("model/w32", "model/w16", "model/wbf"))
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
    kept = sum(objects.stored_size(oid) - object_format.HEADER_SIZE
               for key, oid in reader.arrays()["t"].chunk_ids.items() if key != "zarr.json")
    assert lossless_bytes(w, "BF16") == kept


def _layouts() -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Float tensors in every layout the writer meets: several chunks with a partial edge
    chunk, transposed, Fortran-ordered and strided views, 0-d, empty, 3-d, all three
    float dtypes, next to a Blosc tensor."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((1100, 1030)) * 0.02).astype(np.float32)  # 4.5 MB: two chunks, the last partial
    state: dict[str, np.ndarray] = {
        "w/c_order": x, "w/transposed": x.T, "w/fortran": np.asfortranarray(x[:300, :200]),
        "w/strided": x[::2, ::3], "w/scalar": np.array(1.5, np.float32), "w/empty": np.zeros((0, 4), np.float32),
        "w/f16": x[:900].astype(np.float16), "w/bf16": ins.dtypes.float32_to_bf16(x[::2]),
        "w/three_d": rng.standard_normal((3, 500, 900)).astype(np.float32),
        "w/long": rng.standard_normal((1 << 21) + 12345).astype(np.float32),
        "w/ints": rng.integers(0, 100, (1000, 3)).astype(np.int32),
    }
    return state, {"w/bf16": "BF16"}


@pytest.fixture
def submitted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The tensors the writer's direct path queued (paths, in order)."""
    paths: list[str] = []
    submit = writer._ChunkPipeline.submit

    def spy(self: writer._ChunkPipeline, path: str, *args: object, **kwargs: object) -> None:
        paths.append(path)
        submit(self, path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(writer._ChunkPipeline, "submit", spy)
    return paths


def test_the_writer_stores_what_zarrs_codec_pipeline_stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            submitted: list[str]) -> None:
    state, declared = _layouts()
    direct = ins.open(str(tmp_path / "direct"), create=True).save(state, dtypes=declared)
    assert sorted(submitted) == sorted(p for p in state if p not in ("w/empty", "w/ints"))
    monkeypatch.setattr(writer, "_direct_codec", lambda *args: None)  # every chunk through zarr
    repo = ins.open(str(tmp_path / "zarr"), create=True)
    via_zarr = repo.save(state, dtypes=declared)
    assert direct.root == via_zarr.root  # same trees: same zarr.json documents and chunk ids
    loaded = repo.load()
    assert all(_bits(loaded[k]) == _bits(v) for k, v in state.items())


@pytest.mark.parametrize("threads", ["1", "3"])
def test_the_thread_count_changes_no_stored_byte(memory_url: str, monkeypatch: pytest.MonkeyPatch,
                                                  threads: str) -> None:
    state, declared = _layouts()
    default = ins.open(memory_url, create=True).save(state, dtypes=declared, branch="default")
    monkeypatch.setenv("INSHRINK_WRITE_THREADS", threads)
    other = ins.open(memory_url + "-other", create=True).save(state, dtypes=declared)
    assert other.root == default.root


def test_progress_hears_each_tensor_once_after_its_chunks_are_stored(memory_url: str) -> None:
    state, declared = _layouts()
    heard: list[tuple[str, int, int]] = []
    repo = ins.open(memory_url, create=True)
    info = repo.save(state, dtypes=declared, progress=lambda path, done, total: heard.append((path, done, total)))
    assert sorted(p for p, _, _ in heard) == sorted(state)
    assert [(d, t) for _, d, t in heard] == [(i + 1, len(state)) for i in range(len(state))]
    assert info.root == repo.log()[0].root


def test_a_failed_chunk_put_fails_the_save_after_every_chunk_ended(local_url: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    state, declared = _layouts()
    put = PendingChunks.put

    def failing(self: PendingChunks, key: str, value: bytes) -> None:
        if key in ("w/c_order/c/1/0", "w/three_d/c/2/0/0"):
            raise OSError(f"disk full at {key}")
        put(self, key, value)

    monkeypatch.setattr(PendingChunks, "put", failing)
    repo = ins.open(local_url, create=True)
    with pytest.raises(OSError, match="w/c_order/c/1/0"):  # the first failure in path order
        repo.save(state, dtypes=declared)
    assert not any(t.name.startswith(("inshrink-encode", "inshrink-put")) for t in threading.enumerate())
    assert not repo.branches()  # nothing committed
    monkeypatch.setattr(PendingChunks, "put", put)
    assert _bits(repo.load(repo.save(state, dtypes=declared).id)["w/c_order"]) == _bits(state["w/c_order"])


def test_quantized_chunks_skip_zarrs_pipeline_and_store_the_same_bytes(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       submitted: list[str]) -> None:
    """The nuq chain through the direct path: keyframes and deltas against the parent
    (two versions), several chunks with a partial edge chunk, float16 and bfloat16."""
    from inshrink_store.policy import QuantConfig

    state, declared = _layouts()
    state = {k: v for k, v in state.items() if k not in ("w/ints", "w/scalar")}
    rng = np.random.default_rng(3)
    second = {k: (v + (rng.standard_normal(v.shape) * 1e-3).astype(v.dtype)) if v.dtype.kind == "f" else v
              for k, v in state.items()}
    config = QuantConfig(bins=16, protect=0.01, min_numel=16)
    direct = ins.open(str(tmp_path / "direct"), create=True)
    direct_infos = [direct.save(s, dtypes=declared, quantize=config) for s in (state, second)]
    assert set(submitted) >= {"w/c_order", "w/long", "w/f16", "w/three_d"}
    quantized = [p for p, a in direct.checkout().arrays().items() if a.storage == "quantized"]
    assert {"w/c_order", "w/three_d", "w/f16", "w/bf16"} <= set(quantized)
    monkeypatch.setattr(writer, "_direct_codec", lambda *args: None)  # every chunk through zarr
    via_zarr = ins.open(str(tmp_path / "zarr"), create=True)
    zarr_infos = [via_zarr.save(s, dtypes=declared, quantize=config) for s in (state, second)]
    assert [i.root for i in direct_infos] == [i.root for i in zarr_infos]
    assert sorted(p.name for p in (tmp_path / "direct" / "objects").rglob("*")) == \
        sorted(p.name for p in (tmp_path / "zarr" / "objects").rglob("*"))  # deltas included


def test_slow_puts_hold_back_the_writer_threads(memory_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With an object store slower than the encoders, chunks must not pile up in the
    encoders' queue (a quantized tensor's planned values are a new array each): at most
    as many chunks as there are encoders are queued or encoding at any time.

    No timing is involved: every put waits until the writer thread has been held back
    (it asked for a third queue place and had to wait), so the bound is reached on any
    machine, however loaded; a writer with no bound never waits, and the puts' wait times
    out and the test fails instead of hanging."""
    from inshrink_store.policy import QuantConfig

    monkeypatch.setenv("INSHRINK_WRITE_THREADS", "2")
    rng = np.random.default_rng(5)
    state = {f"model/w{i}": (rng.standard_normal((64, 64)) * 0.05).astype(np.float32) for i in range(16)}
    held, peak, lock = [0], [0], threading.Lock()
    writer_held_back, gave_up = threading.Event(), threading.Event()

    class Counting(threading.BoundedSemaphore):
        def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
            ok = super().acquire(False)
            if not ok:
                writer_held_back.set()
                ok = super().acquire(blocking, timeout)
            if ok:
                with lock:
                    held[0] += 1
                    peak[0] = max(peak[0], held[0])
            return ok

        def release(self, n: int = 1) -> None:
            with lock:
                held[0] -= n
            super().release(n)

    real_init, real_put = writer._ChunkPipeline.__init__, PendingChunks.put

    def init(self: writer._ChunkPipeline, view: PendingChunks, encoders: int) -> None:
        real_init(self, view, encoders)
        self._queued = Counting(self._encoders_wanted)

    def slow_put(self: PendingChunks, key: str, value: object) -> None:
        # an object store's request, as slow as it takes (once given up, the rest go through)
        if not key.endswith("zarr.json") and not gave_up.is_set() and not writer_held_back.wait(timeout=10):
            gave_up.set()
        real_put(self, key, value)  # type: ignore[arg-type]

    monkeypatch.setattr(writer._ChunkPipeline, "__init__", init)
    monkeypatch.setattr(PendingChunks, "put", slow_put)
    info = ins.open(memory_url, create=True).save(state, quantize=QuantConfig(bins=8, min_numel=16))
    assert writer_held_back.is_set() and not gave_up.is_set()  # the writer thread waited for the encoders
    assert peak[0] == 2  # and the bound (two encoders) was reached, never passed
    loaded = ins.open(memory_url).load(info.id)
    assert all(loaded[k].shape == v.shape for k, v in state.items())


def test_an_array_written_anew_drops_its_parents_chunks_and_keeps_its_groups(memory_url: str) -> None:
    """The writer's own zarr.json path (no zarr.create_array) must do what create_array's
    overwrite does: a tensor that shrinks keeps none of the parent version's chunk keys, and
    every group above a tensor exists, so plain zarr lists the hierarchy."""
    repo = ins.open(memory_url, create=True)
    rng = np.random.default_rng(9)
    big = rng.standard_normal((1100, 1030)).astype(np.float32)  # two chunks
    repo.save({"a/b/w": big, "a/x": np.ones(3, np.float32)})
    small = rng.standard_normal((5, 7)).astype(np.float32)
    tx = repo.transaction()  # inherits the parent's arrays: a/b/w's two chunks are in its view
    tx.write({"a/b/w": small})
    info = tx.commit()
    reader = ins.open(repo.url).checkout(info.id)
    assert list(reader.arrays()["a/b/w"].chunk_ids) == ["c/0/0"]
    assert reader.load()["a/b/w"].tobytes() == small.tobytes()
    assert reader.load()["a/x"].tobytes() == np.ones(3, np.float32).tobytes()  # inherited
    group = zarr.open_group(store=reader.store, mode="r")
    assert sorted(group.group_keys()) == ["a"] and sorted(group["a"].group_keys()) == ["b"]  # type: ignore[union-attr]


@settings(max_examples=30, deadline=None)
@given(sample=float_arrays(max_dims=1, max_side=80))
def test_a_float_chunk_is_never_stored_larger_than_its_raw_bits(sample) -> None:
    """Coder 3's plane headers outweigh what it saves on a few elements (a 4-byte step
    counter took 72 bytes coded): such a keyframe is stored raw, header included at most
    40 bytes over the values themselves, and reads back bit for bit."""
    objects = cas.ObjectStore(ins.storage.open_storage("memory://raw-floats-" + str(sample.array.nbytes)))
    payload = np.ascontiguousarray(sample.array).tobytes()
    put = objects.put(payload, element=sample.dtype)
    assert objects.stored_size(put.oid) <= object_format.HEADER_SIZE + len(payload)
    assert cas.ObjectStore(objects.storage).get(put.oid) == payload


def test_a_step_counter_is_stored_raw() -> None:
    objects = cas.ObjectStore(ins.storage.open_storage("memory://raw-step-counter"))
    put = objects.put(np.float32(417).tobytes(), element="float32")
    assert objects.header(put.oid).coder == object_format.CODER_NONE
    assert objects.stored_size(put.oid) == object_format.HEADER_SIZE + 4

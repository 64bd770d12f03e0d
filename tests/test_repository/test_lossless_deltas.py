"""Lossless floats delta-coded against the parent version: the object store's coder 3 XORs a
chunk's byte planes with the parent's chunk of the same tensor where that codes smaller.

Between two checkpoints of a training run most weights keep their sign and exponent, so
those planes XOR to almost nothing. Every version still reads back bit for bit, chains
stay within the keyframe interval, gc keeps the bases a kept version needs, and damage
anywhere in a chain is an error naming the object, never wrong numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import inshrink_store as ins
from inshrink_store import cas, object_format
from inshrink_store.errors import IntegrityError
from inshrink_store.layout import object_path
from inshrink_store.policy import QuantConfig
from inshrink_store.storage import open_storage


def _url() -> str:
    return f"memory://lossless-deltas-{uuid.uuid4().hex}"


def _training_like(versions: int, shape: tuple[int, ...] = (300, 200), seed: int = 0) -> list[np.ndarray]:
    """Weights that drift a little each version, as between checkpoints of a run."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    out = []
    for _ in range(versions):
        w = w + (rng.standard_normal(shape) * 1e-4).astype(np.float32)
        out.append(w.copy())
    return out


def _objects(repo: ins.Repository, ref: str, path: str) -> list[object_format.ObjectHeader]:
    reader = repo.checkout(ref)
    objects = reader.view.objects
    return [objects.header(oid) for oid in reader.arrays()[path].chunk_ids.values()]


def test_a_drifting_tensor_is_stored_as_xor_deltas_and_reads_back_exactly() -> None:
    repo = ins.open(_url(), create=True)
    states = _training_like(3)
    infos = [repo.save({"model/w": w}) for w in states]
    headers = [_objects(repo, i.id, "model/w")[0] for i in infos]
    assert [h.kind for h in headers] == [object_format.KIND_WHOLE, object_format.KIND_DELTA, object_format.KIND_DELTA]
    assert all(h.coder == object_format.CODER_BYTEGROUP for h in headers)
    sizes = [repo.stored_bytes(i.id)["model/w"] for i in infos]
    assert sizes[1] < 0.8 * sizes[0] and sizes[2] < 0.8 * sizes[0]  # the XOR pays
    for info, w in zip(infos, states, strict=True):
        assert ins.open(repo.url).load(info.id)["model/w"].tobytes() == w.tobytes()
    assert repo.verify().ok


def test_chains_stop_at_the_keyframe_interval() -> None:
    repo = ins.open(_url(), create=True, keyframe_interval=3)
    states = _training_like(7, shape=(100, 50))  # 20 KB: above the size that is always whole
    infos = [repo.save({"model/w": w}) for w in states]
    depths = [_objects(repo, i.id, "model/w")[0].depth for i in infos]
    assert depths == [0, 1, 2, 0, 1, 2, 0]
    for info, w in zip(infos, states, strict=True):
        assert ins.open(repo.url).load(info.id)["model/w"].tobytes() == w.tobytes()


def test_unrelated_data_a_new_shape_or_a_quantized_parent_give_keyframes() -> None:
    repo = ins.open(_url(), create=True)
    rng = np.random.default_rng(1)
    repo.save({"model/w": rng.standard_normal((64, 64)).astype(np.float32)})
    info = repo.save({"model/w": rng.standard_normal((64, 64)).astype(np.float32) * 1e6})
    assert _objects(repo, info.id, "model/w")[0].kind == object_format.KIND_WHOLE  # nothing to gain
    info = repo.save({"model/w": rng.standard_normal((32, 64)).astype(np.float32)})
    assert _objects(repo, info.id, "model/w")[0].kind == object_format.KIND_WHOLE  # another shape
    w = rng.standard_normal((64, 64)).astype(np.float32)
    repo.save({"model/w": w}, quantize=QuantConfig(bins=8, min_numel=16))
    info = repo.save({"model/w": w})  # the parent's chunk is a quantized payload
    assert _objects(repo, info.id, "model/w")[0].kind == object_format.KIND_WHOLE
    assert repo.load(info.id)["model/w"].tobytes() == w.tobytes()


def test_gc_keeps_the_bases_of_kept_versions() -> None:
    repo = ins.open(_url(), create=True)
    states = _training_like(3, shape=(80, 60))
    infos = [repo.save({"model/w": w}) for w in states]
    assert _objects(repo, infos[2].id, "model/w")[0].kind == object_format.KIND_DELTA
    report = repo.gc(keep_last=1)  # the versions that hold the bases go
    assert len(report.deleted["snapshots"]) == 2
    fresh = ins.open(repo.url)
    assert fresh.load("main")["model/w"].tobytes() == states[2].tobytes()
    assert fresh.verify().ok


def test_a_damaged_base_is_an_error_naming_the_chain() -> None:
    repo = ins.open(_url(), create=True)
    states = _training_like(2, shape=(80, 60))  # above the size that is always whole
    first, second = (repo.save({"model/w": w}) for w in states)
    base = next(iter(repo.checkout(first.id).arrays()["model/w"].chunk_ids.values()))
    storage = open_storage(repo.url)
    stored = bytearray(storage.read(object_path(base)))
    stored[-1] ^= 0x01
    storage.write(object_path(base), bytes(stored))
    with pytest.raises(IntegrityError, match="checksum"):
        ins.open(repo.url).load(second.id)


float_bits = st.sampled_from(["float32", "float16", "bfloat16"]).flatmap(
    lambda element: st.tuples(st.just(element), st.integers(1, 400), st.integers(0, 2**31 - 1)))


@settings(max_examples=40, deadline=None)
@given(spec=float_bits, flips=st.integers(0, 64))
def test_the_object_store_round_trips_any_float_bits_against_any_base(spec: tuple[str, int, int], flips: int) -> None:
    """Arbitrary bit patterns (NaN payloads, signed zeros, subnormals, infinities) as
    payloads and bases; a delta decodes to its payload exactly."""
    element, n, seed = spec
    itemsize = 2 if element in ("float16", "bfloat16") else 4
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n * itemsize, dtype=np.uint8)
    payload = base.copy()
    payload[rng.integers(0, payload.size, flips)] ^= rng.integers(1, 256, flips, dtype=np.uint8)
    objects = cas.ObjectStore(open_storage(_url()))
    base_id = objects.put(base.tobytes(), element=element).oid
    with pytest.MonkeyPatch.context() as patch:  # small payloads are tried as deltas too here
        patch.setattr(cas, "FLOAT_DELTA_MIN", 0)
        patch.setattr(cas, "FLOAT_DELTA_SMALLEST", 0)
        put = objects.put(payload.tobytes(), base=base_id, element=element)
    fresh = cas.ObjectStore(objects.storage)  # no cache: decoded from what is stored
    assert fresh.get(put.oid) == payload.tobytes()
    assert fresh.get(base_id) == base.tobytes()
    header = fresh.header(put.oid)
    # coded, or raw where coding would not make it smaller (never larger than raw, bar the header)
    assert header.coder in (object_format.CODER_BYTEGROUP, object_format.CODER_NONE)
    # a delta too must store less than the raw bits would (it has to beat the keyframe stored)
    assert fresh.stored_size(put.oid) <= object_format.HEADER_SIZE + payload.size
    if not header.is_delta:
        assert (header.coder == object_format.CODER_NONE) == (payload.size <= object_format.RAW_FLOATS_MAX or fresh.stored_size(
            put.oid) == object_format.HEADER_SIZE + payload.size)
    if header.is_delta:
        assert header.base == base_id


def _counting_reads(storage: object) -> list[tuple[str, str]]:
    """Every read of ``storage`` from now on: ("whole", path) or ("range", path)."""
    reads: list[tuple[str, str]] = []
    original = (storage.read, storage.read_range)  # type: ignore[attr-defined]
    storage.read = lambda path, _r=original[0], _s=reads: _s.append(("whole", path)) or _r(path)  # type: ignore[attr-defined]
    storage.read_range = (  # type: ignore[attr-defined]
        lambda path, start, end, _r=original[1], _s=reads: _s.append(("range", path)) or _r(path, start, end))
    return reads


def test_small_chunks_delta_only_against_a_base_this_store_wrote_and_never_read_it() -> None:
    """Under FLOAT_DELTA_MIN a chunk is tried against its parent's chunk only when this
    object store wrote that chunk (its payload is at hand): then it is a delta, and of the
    base only its header is read (the stored object's depth). Another store (a restarted
    process) stores it whole without a read (reading the base costs two requests and a decode
    per small tensor). At the size a base is read whole."""
    below = cas.FLOAT_DELTA_MIN // 4 - 1
    w = _training_like(3, shape=(below,))
    storage = open_storage(_url())
    writer = cas.ObjectStore(storage)
    base_id = writer.put(w[0].tobytes(), element="float32").oid
    reads = _counting_reads(storage)
    put = writer.put(w[1].tobytes(), base=base_id, element="float32")
    # its header, for the depth; the write check (on in the tests) decodes against the payload at hand
    assert reads == [("range", object_path(base_id))]
    header = cas.ObjectStore(storage).header(put.oid)
    assert header.is_delta and header.base == base_id and header.depth == 1
    restarted = cas.ObjectStore(storage)
    reads.clear()
    again = restarted.put(w[2].tobytes(), base=put.oid, element="float32")
    assert reads == []
    assert not cas.ObjectStore(storage).header(again.oid).is_delta
    assert cas.ObjectStore(storage).get(put.oid) == w[1].tobytes()  # decoded from what is stored

    at = _training_like(2, shape=(cas.FLOAT_DELTA_MIN // 4,))
    fresh = cas.ObjectStore(open_storage(_url()))
    big_base = fresh.put(at[0].tobytes(), element="float32").oid
    reader = cas.ObjectStore(fresh.storage)
    big_reads = _counting_reads(fresh.storage)
    big = reader.put(at[1].tobytes(), base=big_base, element="float32")
    assert cas.ObjectStore(fresh.storage).header(big.oid).is_delta and ("whole", object_path(big_base)) in big_reads


def test_chunks_under_the_smallest_are_never_tried() -> None:
    """Under FLOAT_DELTA_SMALLEST (a bias of 64 floats) a chunk is a keyframe and nothing is
    read, even with its base at hand; at the size it is tried."""
    for n, expect_delta in ((cas.FLOAT_DELTA_SMALLEST // 4 - 1, False), (cas.FLOAT_DELTA_SMALLEST // 4, True)):
        w = _training_like(2, shape=(n,))
        w[1] = w[0].copy()
        w[1][0] += 1.0  # one value changed: every other plane XORs to zeros
        objects = cas.ObjectStore(open_storage(_url()))
        base_id = objects.put(w[0].tobytes(), element="float32").oid
        reads = _counting_reads(objects.storage)
        put = objects.put(w[1].tobytes(), base=base_id, element="float32")
        assert (reads != []) is expect_delta
        assert cas.ObjectStore(objects.storage).header(put.oid).is_delta is expect_delta


def test_small_chunk_chains_end_at_the_keyframe_interval() -> None:
    """A small chunk's delta chain restarts with a keyframe at the interval, as a large one's."""
    w = _training_like(7, shape=(512,))
    objects = cas.ObjectStore(open_storage(_url()), keyframe_interval=3)
    base = None
    depths = []
    for version in w:
        base = objects.put(version.tobytes(), base=base, element="float32").oid
        depths.append(cas.ObjectStore(objects.storage).header(base).depth)
    assert depths == [0, 1, 2, 0, 1, 2, 0]
    fresh = cas.ObjectStore(objects.storage)
    assert [fresh.get(objects.put(v.tobytes(), element="float32").oid) for v in w] == [v.tobytes() for v in w]


def test_a_payload_that_is_not_whole_elements_is_refused() -> None:
    objects = cas.ObjectStore(open_storage(_url()))
    with pytest.raises(ins.errors.FormatError, match="whole float32 elements"):
        objects.put(b"\x00" * 6, element="float32")
    with pytest.raises(ins.errors.FormatError, match="float element type"):
        objects.put(b"\x00" * 8, element="float64")


def test_a_tensor_changed_while_it_is_saved_is_refused_not_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw floats are read where they lie (no copy): bits that change between hashing and
    coding would make an object whose id does not match it. The put refuses instead."""
    from inshrink_store.codecs import bytegroup

    objects = cas.ObjectStore(open_storage(_url()))
    data = np.arange(64, dtype=np.float32)
    real = bytegroup.encode_chunk

    def racing(chunk, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(chunk, *args, **kwargs)
        data[3] += 1.0  # another thread writes to the tensor mid-save
        return out

    monkeypatch.setattr(bytegroup, "encode_chunk", racing)
    with pytest.raises(ins.errors.InvalidInputError, match="unchanged while they are saved"):
        objects.put(memoryview(data).cast("B"), element="float32")
    assert objects.storage.list("objects/") == {}


def test_a_small_delta_takes_the_depth_of_the_base_as_stored_not_as_written_here() -> None:
    """The base's depth is read from the stored object: when the same content was stored
    again by another writer (gc collected this store's copy, another chain wrote it), a delta
    on it is one deeper than that object, so its chain reads back."""
    w = _training_like(3, shape=(2048,))
    storage = open_storage(_url())
    mine = cas.ObjectStore(storage, keyframe_interval=8)
    first = mine.put(w[0].tobytes(), element="float32").oid
    second = mine.put(w[1].tobytes(), base=first, element="float32").oid  # depth 1 here
    other = cas.ObjectStore(storage, keyframe_interval=8)
    storage.delete(object_path(second))  # as a gc of an unreferenced copy would
    chain = None
    for version in _training_like(5, shape=(2048,), seed=7):  # another writer's chain, depth 4 below
        chain = other.put(version.tobytes(), base=chain, element="float32").oid
    stored = other._encode_floats(memoryview(w[1].tobytes()), chain, "float32")
    storage.write(object_path(second), stored)  # the same content, stored as that chain's delta
    depth = cas.ObjectStore(storage).header(second).depth
    assert depth != 1
    third = mine.put(w[2].tobytes(), base=second, element="float32").oid
    header = cas.ObjectStore(storage).header(third)
    assert header.is_delta and header.base == second and header.depth == depth + 1
    assert cas.ObjectStore(storage).get(third) == w[2].tobytes()


def test_small_tensors_stored_as_deltas_read_back_bit_exact_in_a_fresh_process(tmp_path: Path) -> None:
    """Small lossless tensors of skewed values (log-normal spans of many octaves, signed zeros,
    NaN and inf, float16 and bfloat16 among them) saved as versions through the public API in
    one process, most chunks as XOR deltas on the last version's: another process reads every
    version back bit for bit and verify passes."""
    rng = np.random.default_rng(3)
    state = {
        "conv": (rng.lognormal(-4, 3, 288) * rng.choice([-1, 1], 288)).astype(np.float32),
        "head": (rng.standard_normal((10, 256)) * 0.05).astype(np.float32),
        "norm": np.ones(1024, np.float16),
        "odd": np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40] * 50, np.float32),
    }
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    expected = {}
    for _ in range(6):
        state = {k: (v + (rng.standard_normal(v.shape) * 1e-4).astype(v.dtype)) if k != "odd" else v.copy()
                 for k, v in state.items()}
        state["odd"][rng.integers(0, 300)] = np.float32(rng.standard_normal())
        info = repo.save(state)
        expected[info.id] = {k: v.copy() for k, v in state.items()}
    reader = repo.checkout(info.id)
    deltas = [p for p, a in reader.arrays().items() for oid in a.chunk_ids.values()
              if reader.view.objects.header(oid).is_delta]
    assert {"head", "norm", "odd"} <= set(deltas)  # NaN, inf and -0.0 through the XOR planes too
    script = (
        "import json, sys, numpy as np, inshrink_store as ins\n"
        "repo = ins.open(sys.argv[1])\n"
        "out = {sid: {k: np.asarray(repo.checkout(sid).read(k)).tobytes().hex() for k in json.loads(sys.argv[3])}\n"
        "       for sid in json.loads(sys.argv[2])}\n"
        "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", script, url, json.dumps(sorted(expected)), json.dumps(sorted(state))],
                          capture_output=True, text=True, check=True, timeout=300)
    got = json.loads(done.stdout)
    for sid, arrays in expected.items():
        for name, values in arrays.items():
            assert bytes.fromhex(got[sid][name]) == values.tobytes(), (sid, name)
    assert ins.open(url).verify().ok

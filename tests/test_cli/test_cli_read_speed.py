"""verify, export and diff --values read in parallel and decode each object once (issue 43,
item 10): the same findings and bytes as the one-at-a-time reads they replace.

verify now groups objects by delta chain and reads each group base first on several
threads; these tests check it against the loop it replaced (every object in id order: its
header, then ``get``) on stores with long delta chains, damaged in several ways. The speed
itself is measured in ``benchmarks/bench_cli_reads.py``, never here."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import inshrink_store as ins
from inshrink_store import index
from inshrink_store.cas import ObjectStore
from inshrink_store.errors import InshrinkError
from inshrink_store.layout import object_path

diff_module = importlib.import_module("inshrink_store.admin.diff")  # the package exports a function diff


def _chained(url: str, versions: int = 5) -> ins.Repository:
    """Versions of slowly changing float tensors: lossless deltas in chains of several links."""
    repo = ins.open(url, create=True)
    rng = np.random.default_rng(7)
    state = {f"model/w{i}": (rng.standard_normal((64, 96)) * 0.02).astype(np.float32) for i in range(6)}
    state["model/big"] = (rng.standard_normal((300, 300)) * 0.02).astype(np.float32)
    state["step"] = np.arange(4, dtype=np.int64)
    for v in range(versions):
        repo.save(state, message=f"v{v}", step=v)
        state = {k: (a + (rng.standard_normal(a.shape) * 1e-4).astype(np.float32)) if a.dtype == np.float32 else a
                 for k, a in state.items()}
    return repo


def _old_object_loop(repo: ins.Repository) -> tuple[list[tuple[str, str, list[tuple[str, str]]]], int]:
    """The object check verify ran before: every used object in id order, one at a time."""
    parts = repo._parts
    fresh = ObjectStore(parts.storage, keyframe_interval=parts.objects.keyframe_interval)
    users: dict[str, set[tuple[str, str]]] = {}
    for sid in repo.snapshot_ids():
        reader = parts.reader(parts.history.get(sid), objects=fresh)
        for path, info in reader.arrays().items():
            for oid in info.chunk_ids.values():
                users.setdefault(oid, set()).add((sid, path))
    problems, deltas = [], 0
    for oid in sorted(users):
        try:
            if fresh.header(oid).is_delta:
                deltas += 1
            fresh.get(oid)
        except InshrinkError as exc:
            problems.append((oid, str(exc), sorted(users[oid])))
    return problems, deltas


def _delta_objects(repo: ins.Repository) -> list[str]:
    objects = repo._parts.objects
    ids = {oid for sid in repo.snapshot_ids() for info in repo._parts.reader(repo._parts.history.get(sid)).arrays().values()
           for oid in info.chunk_ids.values()}
    return sorted(oid for oid in ids if objects.header(oid).is_delta)


def test_the_store_has_long_chains(memory_url: str) -> None:
    repo = _chained(memory_url)
    objects = repo._parts.objects
    assert max(objects.header(oid).depth for oid in _delta_objects(repo)) >= 3


@pytest.mark.parametrize("damage", ["keyframe", "middle", "missing", "header"])
def test_verify_finds_what_the_one_at_a_time_loop_found(memory_url: str, damage: str) -> None:
    repo = _chained(memory_url)
    objects = repo._parts.objects
    deep = max(_delta_objects(repo), key=lambda oid: (objects.header(oid).depth, oid))
    chain = objects.chain(deep)  # deep ... keyframe
    storage = repo._storage
    if damage == "keyframe":
        target = chain[-1]
        data = bytearray(storage.read(object_path(target)))
        data[-5] ^= 0x5A
        storage.write(object_path(target), bytes(data))
    elif damage == "middle":
        target = chain[len(chain) // 2]
        data = bytearray(storage.read(object_path(target)))
        data[-3] ^= 0x01
        storage.write(object_path(target), bytes(data))
    elif damage == "missing":
        storage.delete(object_path(chain[1]))
    else:  # a header that does not parse
        target = chain[0]
        data = bytearray(storage.read(object_path(target)))
        data[0:4] = b"XXXX"
        storage.write(object_path(target), bytes(data))
    index.CACHE.clear()
    repo = ins.open(memory_url)
    expected, deltas = _old_object_loop(repo)
    index.CACHE.clear()
    report = ins.open(memory_url).verify()
    got = [(p.id, p.error, p.used_by) for p in report.problems if p.kind == "object"]
    assert expected  # the damage is found
    assert got == expected
    assert report.deltas == deltas
    assert [p for p in report.problems if p.kind != "object"] == []


def test_verify_progress_counts_every_object_once(memory_url: str) -> None:
    repo = _chained(memory_url)
    seen: list[tuple[str, int, int]] = []
    report = repo.verify(progress=lambda oid, done, total: seen.append((oid, done, total)))
    assert report.ok
    assert [d for _, d, _ in seen] == list(range(1, report.objects + 1))
    assert {t for _, _, t in seen} == {report.objects}
    assert len({oid for oid, _, _ in seen}) == report.objects


def test_export_reads_the_same_tensors(memory_url: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    from inshrink_store.torch.checkpoint_files import export_tensors

    repo = _chained(memory_url)
    reader = repo.checkout("main")
    calls: list[int] = []
    exported = export_tensors(reader, include_all=True, progress=lambda p, d, t: calls.append(d))
    assert calls == list(range(1, len(reader.names()) + 1))
    assert list(exported) == reader.names()
    for path, tensor in exported.items():
        assert tensor.numpy().tobytes() == ins.open(memory_url).checkout("main").read(path).tobytes()


def _reference_change(raw_a: np.ndarray, raw_b: np.ndarray) -> tuple[float, float]:
    """_value_change's figures as computed before (whole tensors widened to float64)."""
    va, vb = raw_a.astype(np.float64), raw_b.astype(np.float64)
    if va.size == 0:
        return 0.0, 0.0
    same = (va == vb) | (np.isnan(va) & np.isnan(vb))
    if not (np.isfinite(va[~same]).all() and np.isfinite(vb[~same]).all()):
        return math.inf, math.inf
    delta = np.abs(vb[~same] - va[~same])
    max_abs = float(delta.max()) if delta.size else 0.0
    norm = float(np.linalg.norm(va[np.isfinite(va)]))
    rel = float(np.linalg.norm(delta) / norm) if norm > 0 else (0.0 if max_abs == 0 else math.inf)
    return max_abs, rel


@pytest.mark.parametrize("seed", range(40))
def test_real_change_gives_the_figures_it_gave(seed: int) -> None:
    rng = np.random.default_rng(seed)
    shape = [(), (7,), (5, 9), (3, 4, 6)][seed % 4]
    dtype = [np.float32, np.float16, np.float64][seed % 3]
    a = rng.standard_normal(shape).astype(dtype)
    b = (a + rng.standard_normal(shape) * [0, 1e-3, 1][seed % 3]).astype(dtype)
    special = [np.nan, np.inf, -np.inf, 0.0]
    if a.size and seed % 5 in (1, 2):  # an inf or NaN that stays
        flat_a, flat_b = a.reshape(-1), b.reshape(-1)
        flat_a[0] = flat_b[0] = special[seed % 3]
    if a.size and seed % 5 == 3:  # one that appears
        b.reshape(-1)[-1] = special[seed % 4]
    if a.size and seed % 7 == 0:  # a's only values are not finite
        a[...] = np.inf
    other = b.astype(np.float32) if seed % 6 == 0 else b  # other dtype on b's side
    assert diff_module._real_change(a, other) == _reference_change(a, other)


def test_diff_values_on_a_chained_store(memory_url: str) -> None:
    repo = _chained(memory_url)
    report = repo.diff("main~1", "main", values=True)
    a, b = repo.checkout("main~1"), repo.checkout("main")
    for change in report.tensors:
        if change.dtype_a == "F32":
            max_abs, rel = _reference_change(a.read_float(change.path), b.read_float(change.path))
            assert change.max_abs_change == max_abs
            # model/big (90,000 values) takes the blockwise sums: the same sum in another order
            assert change.rel_l2_change == pytest.approx(rel, rel=1e-12, abs=0)
        else:
            assert change.bytes_changed is False


def _same_figures(got: tuple[float, float], expected: tuple[float, float]) -> bool:
    """Equal figures, NaN equal to NaN (a float64 overflow on both sides gives inf / inf)."""
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(got, expected, strict=True))


@pytest.mark.parametrize("seed", range(24))
def test_blockwise_change_gives_the_masked_figures(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """A tensor of several blocks whose values are all finite takes the blockwise pass: the
    max is the very figure, the relative norm the same sum in another order."""
    monkeypatch.setattr(diff_module, "_BLOCK", 16)  # 16 values a block: many blocks, a partial last one
    rng = np.random.default_rng(seed)
    size = [17, 100, 1000, 4099][seed % 4]
    dtype_a = [np.float32, np.float16, np.float64][seed % 3]
    dtype_b = dtype_a if seed % 2 else [np.float64, np.float32, np.float16][seed % 3]
    a = (rng.standard_normal(size) * [1, 1e-3, 1e3][seed % 3]).astype(dtype_a)
    b = (a + rng.standard_normal(size) * [1e-4, 1e-2, 0][seed % 3]).astype(dtype_b)
    if seed % 5 == 0:
        b[: size // 2] = a[: size // 2]  # half the values unchanged: they add nothing
    if seed % 7 == 0:
        a[:] = 0  # a's norm 0: unbounded unless nothing changed
    got = diff_module._real_change(a.reshape(-1, 1) if size % 2 == 0 else a, b)
    assert diff_module._finite_change(a, b) == got  # the blockwise pass gave it
    expected = _reference_change(a, b)
    assert got[0] == expected[0]
    assert got[1] == pytest.approx(expected[1], rel=1e-12, abs=0)


@pytest.mark.parametrize("case", ["steady inf", "new nan", "inf leaves", "float64 overflow", "square overflow",
                                  "all equal"])
def test_blockwise_change_leaves_non_finite_tensors_to_the_masked_passes(
        monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """An inf or NaN anywhere (or a float64 difference or square that overflows) sends the
    whole tensor to the masked passes: the figures they always gave, to the bit."""
    monkeypatch.setattr(diff_module, "_BLOCK", 16)
    rng = np.random.default_rng(3)
    a = rng.standard_normal(200)
    b = a + 1e-3
    if case == "steady inf":
        a[150] = b[150] = np.inf
    elif case == "new nan":
        b[40] = np.nan
    elif case == "inf leaves":
        a[199] = -np.inf
    elif case == "float64 overflow":
        a[7], b[7] = -1e308, 1e308
    elif case == "square overflow":
        b[9] = a[9] + 1e200
    else:
        b = a.copy()
    got = diff_module._real_change(a, b)
    with np.errstate(over="ignore", invalid="ignore"):
        assert _same_figures(got, _reference_change(a, b))
    assert _same_figures(got, diff_module._masked_change(a, b))
    if case == "all equal":
        assert got == (0.0, 0.0)
    else:
        assert diff_module._finite_change(a, b) is None


def test_a_read_only_read_gives_the_same_values(memory_url: str) -> None:
    """``read(writable=False)`` (what diff --values reads with) may skip the copy of a one-chunk
    tensor's decoded bytes: the same values, and the default read stays writable."""
    repo = _chained(memory_url)
    reader = repo.checkout("main")
    for path in reader.names():
        kept = reader.read(path)
        looked = reader.read(path, writable=False)
        assert kept.flags.writeable and kept.flags.c_contiguous
        assert looked.flags.c_contiguous and looked.dtype == kept.dtype and looked.shape == kept.shape
        assert looked.tobytes() == kept.tobytes()
        assert reader.read_float(path, writable=False).tobytes() == reader.read_float(path).tobytes()
    assert not reader.read("model/w0", writable=False).flags.writeable  # one chunk: the decoded bytes


def _finite_change_widening_twice(a: np.ndarray, b: np.ndarray) -> tuple[float, float] | None:
    """The blockwise pass as it was before a's blocks were widened once (issue 43, item 10)."""
    size = a.size
    delta = np.empty(min(size, diff_module._BLOCK), np.float64)
    square = np.empty_like(delta)
    max_abs = squares_delta = squares_a = 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, size, diff_module._BLOCK):
            stop = min(start + diff_module._BLOCK, size)
            d, s = delta[:stop - start], square[:stop - start]
            np.subtract(b[start:stop], a[start:stop], out=d, dtype=np.float64)
            np.abs(d, out=d)
            top = float(d.max())
            if not math.isfinite(top):
                return None
            max_abs = max(max_abs, top)
            squares_delta += float(np.add.reduce(np.square(d, out=d)))
            squares_a += float(np.add.reduce(np.square(a[start:stop], out=s, dtype=np.float64)))
    if not (math.isfinite(squares_delta) and math.isfinite(squares_a)):
        return None
    norm = math.sqrt(squares_a)
    return max_abs, (math.sqrt(squares_delta) / norm if norm > 0 else (0.0 if max_abs == 0 else math.inf))


@settings(max_examples=80, deadline=None)
@given(size=st.integers(1, 300), block=st.sampled_from([1, 7, 16, 64]), seed=st.integers(0, 2**32 - 1),
       dtypes=st.tuples(*[st.sampled_from(["float16", "float32", "float64", "longdouble"])] * 2),
       scale=st.sampled_from([0.0, 1e-30, 1e-3, 1.0, 1e30, 1e300]), special=st.sampled_from([None, np.inf, np.nan]))
def test_widening_a_once_gives_the_very_figures_of_widening_it_twice(size, block, seed, dtypes, scale, special) -> None:
    """Same input, same figures to the bit (a float64 of a block of ``a`` is the same value
    whether it is widened once or for each use), inf, NaN and overflows included."""
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore", invalid="ignore"):
        a = (rng.standard_normal(size) * scale).astype(dtypes[0])
        b = (a.astype(np.float64) + rng.standard_normal(size) * scale * 1e-3).astype(dtypes[1])
    if special is not None:
        b[seed % size] = special
    old_block = diff_module._BLOCK
    diff_module._BLOCK = block
    try:
        got, expected = diff_module._finite_change(a, b), _finite_change_widening_twice(a, b)
    finally:
        diff_module._BLOCK = old_block
    assert (got is None) == (expected is None)
    if got is not None and expected is not None:
        assert _same_figures(got, expected)

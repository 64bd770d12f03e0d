"""Old stores keep opening: small stores written by earlier releases, committed under
tests/fixtures/, must read back exactly as they did when they were written.

``store-objects-v1`` was written by the release before object format 2 (its objects have
the body-only checksum), ``store-objects-v2`` by the release before packed level ids (object
coder 2), ``store-objects-v3`` by the release before compressed trees (a keyframe with packed
ids), ``store-objects-v4`` by the release before object coder 3 (trees stored as zstd
frames; lossless floats as ``inshrink.bytegroup`` zarr chunks), ``store-objects-v5`` by the
release before inline nodes (lossless floats as raw bits in zarr, bytegroup-coded objects,
XOR deltas against the parent's chunk), ``store-objects-v6`` by the current one (root trees
of format 2 holding small nodes inline, tiny float chunks stored raw); all by
``tests/fixtures/make_store.py``. ``expected.json`` holds a hash of every tensor of every
version as first read, so any change in how old bytes decode fails here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import inshrink_store as ins

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
sys.path.insert(0, str(FIXTURES))
from make_store import tensors  # noqa: E402

STORES = sorted(EXPECTED)


def _digest(value: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()[:16]


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    copy = tmp_path / request.param  # reading never writes, but a test must not risk the fixture
    shutil.copytree(FIXTURES / request.param, copy)
    return request.param, str(copy)


def test_old_stores_read_back_bit_for_bit(store: tuple[str, str]) -> None:
    name, url = store
    repo = ins.open(url)
    assert sorted(repo.branches()) == ["main", "side"] and sorted(repo.tags()) == ["first"]
    assert [i.message for i in repo.log()] == ["v2", "v1", "v0"]
    for ref, digests in EXPECTED[name].items():
        loaded = repo.load(ref)
        assert {k: _digest(v) for k, v in sorted(loaded.items())} == digests, ref
    for version, ref in ((2, "main"), (1, "main~1"), (0, "first"), (10, "side")):
        loaded, original = repo.load(ref), tensors(version)
        for key in ("model/b", "model/bf16", "step", "mask"):  # lossless: exact
            np.testing.assert_array_equal(loaded[key], original[key])
        w, w0 = loaded["model/w"], original["model/w"]
        assert w.shape == w0.shape and np.linalg.norm(w - w0) / np.linalg.norm(w0) < 0.5
    assert repo.checkout("main").dtypes()["model/bf16"] == "BF16"
    assert repo.verify().ok


def test_old_stores_take_new_commits(store: tuple[str, str]) -> None:
    _, url = store
    repo = ins.open(url)
    info = repo.save(tensors(3), dtypes={"model/bf16": "BF16"}, message="v3")
    assert info.parent == repo.resolve("main~1")
    np.testing.assert_array_equal(repo.load("main")["model/b"], tensors(3)["model/b"])
    assert repo.gc().kept_snapshots >= 5 and repo.verify().ok


def test_the_newest_fixture_holds_a_packed_keyframe() -> None:
    """The fixture guards object coder 2 only if it really holds one."""
    from inshrink_store import cas

    root = FIXTURES / "store-objects-v3" / "objects"
    coders = {cas.parse_header(p.parent.name + p.name, p.read_bytes()).coder for p in root.rglob("*") if p.is_file()}
    assert cas.CODER_PACKED_ZSTD in coders


def test_the_newest_fixture_holds_compressed_trees() -> None:
    """The fixture guards compressed trees only if its trees really are zstd frames."""
    from inshrink_store.manifest import ZSTD_MAGIC

    trees = [p.read_bytes() for p in (FIXTURES / "store-objects-v4" / "trees").rglob("*") if p.is_file()]
    assert trees and all(t[:4] == ZSTD_MAGIC for t in trees)


def test_the_newest_fixture_holds_bytegroup_keyframes_and_xor_deltas() -> None:
    """The fixture guards object coder 3 only if it really holds a keyframe and a delta."""
    from inshrink_store import cas

    root = FIXTURES / "store-objects-v5" / "objects"
    kinds = {(h.kind, h.coder) for h in (cas.parse_header(p.parent.name + p.name, p.read_bytes())
                                         for p in root.rglob("*") if p.is_file())}
    assert {(cas.KIND_WHOLE, cas.CODER_BYTEGROUP), (cas.KIND_DELTA, cas.CODER_BYTEGROUP)} <= kinds


def test_the_newest_fixture_keeps_its_nodes_inline() -> None:
    """The fixture guards root tree format 2 only if its roots really hold nodes inline beside
    a node tree file (every tensor has a few chunks; the root group's attributes are over
    the inline limit)."""
    from inshrink_store.manifest import RootTree
    from inshrink_store.storage import open_storage

    url = str(FIXTURES / "store-objects-v6")
    storage, repo = open_storage(url), ins.open(url)
    roots = {repo.resolve(ref) for ref in ("main", "main~1", "first", "side")}
    trees = set(storage.list("trees"))
    mixed = 0
    for sid in roots:
        root_id = repo.log(sid)[0].root
        root = RootTree.from_bytes(storage.read(f"trees/{root_id[:2]}/{root_id[2:]}"), root_id)
        assert root.inline and set(root.nodes) <= {""}
        mixed += bool(root.nodes)  # the root group, on the versions saved with its padding
    assert mixed >= 2 and len(trees) > len({repo.log(sid)[0].root for sid in roots})


ESCAPED = FIXTURES / "store-packed-escapes"


def test_packed_keyframes_longer_than_their_payload_read_back_bit_for_bit(tmp_path: Path) -> None:
    """Releases e41198a..a828d53 committed such chunks and their reader refused them; a
    store holding them reads and verifies with no migration, each tensor as it was meant."""
    shutil.copytree(ESCAPED, tmp_path / "s")
    repo = ins.open(str(tmp_path / "s"))
    expected = json.loads((FIXTURES / "expected-packed-escapes.json").read_text())
    for ref, digests in expected.items():
        assert {k: _digest(v) for k, v in sorted(repo.load(ref).items())} == digests, ref
    report = repo.verify()
    assert report.ok, report.problems


def test_the_escape_fixture_holds_packed_streams_longer_than_their_payload() -> None:
    """The fixture guards the fixed bound only if a packed stream really passes the payload's length."""
    import zstandard

    from inshrink_store import cas

    longer = 0
    for path in (p for p in (ESCAPED / "objects").rglob("*") if p.is_file()):
        stored = path.read_bytes()
        header = cas.parse_header(path.parent.name + path.name, stored)
        if header.coder == cas.CODER_PACKED_ZSTD:
            stream = zstandard.ZstdDecompressor().decompress(stored[cas.HEADER_SIZE:])
            longer += len(stream) > header.logical_length
    assert longer >= 1

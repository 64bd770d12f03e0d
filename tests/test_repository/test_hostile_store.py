"""Regressions for hostile or corrupt stores: every failure is an InshrinkError naming the
thing at fault, before any allocation the store's real size does not justify."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import zstandard

import inshrink_store as ins
from inshrink_store import cas, index, manifest, object_format, reader, refs
from inshrink_store.codecs import _payload, vdelta
from inshrink_store.codecs.nuq import NUQ, NUQZarrCodec
from inshrink_store.codecs.vdelta import VDelta
from inshrink_store.errors import FormatError, IntegrityError
from inshrink_store.manifest import NodeTree, RootTree, Snapshot, check_commit_fields, check_id
from inshrink_store.zarr_store import tree_path

ZERO_ID = "0" * 32


def _quantized(n: int = 4096, seed: int = 0) -> bytes:
    ids = np.random.default_rng(seed).integers(0, 15, size=n).astype(np.uint8)
    return _payload.pack(16, ids, "bfloat16", np.zeros(0, np.uint16))


def _set_length(stored: bytes, length: int) -> bytes:
    return stored[:8] + struct.pack("<Q", length) + stored[16:]


def _crafted(kind: int, coder: int, depth: int, length: int, base: str | None, body: bytes,
             version: int = 2) -> bytes:
    base_raw = bytes.fromhex(base) if base else bytes(16)
    magic = object_format.MAGIC_V2 if version == 2 else object_format.MAGIC_V1
    head = object_format.HEADER.pack(magic, kind, coder, depth, length, base_raw, 0)[: object_format.CHECKED_HEADER]
    return head + struct.pack("<Q", object_format.object_checksum(head if version == 2 else b"", body)) + body


@pytest.fixture
def repo(memory_url: str) -> ins.Repository:
    return ins.open(memory_url, create=True)


# -- 1. object headers -----------------------------------------------------------------


def test_objects_are_written_as_format_2_with_the_header_checksummed(repo: ins.Repository) -> None:
    oid = repo._objects.put(b"hello world").oid
    stored = repo._storage.read(cas.object_path(oid))
    assert stored[:4] == b"ISO\x02"
    head = stored[: object_format.CHECKED_HEADER]
    expected = object_format.object_checksum(head, stored[object_format.HEADER_SIZE:])
    assert struct.unpack_from("<Q", stored, 32)[0] == expected


def test_format_1_objects_still_read(repo: ins.Repository) -> None:
    payload = _quantized()
    oid = manifest.content_id(payload)
    body = zstandard.ZstdCompressor().compress(payload)
    repo._storage.write(cas.object_path(oid),
                       object_format.frame(object_format.KIND_WHOLE, object_format.CODER_ZSTD, 0, payload, None, body, version=1))
    assert cas.ObjectStore(repo._storage).get(oid) == payload
    assert cas.ObjectStore(repo._storage).header(oid).version == 1
    raw = b"plain bytes"
    rid = manifest.content_id(raw)
    repo._storage.write(cas.object_path(rid),
                       object_format.frame(object_format.KIND_WHOLE, object_format.CODER_NONE, 0, raw, None, raw, version=1))
    assert cas.ObjectStore(repo._storage).get(rid) == raw


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("bit", range(0, 64, 5))
def test_one_flipped_bit_in_the_logical_length_is_an_integrity_error(
    repo: ins.Repository, version: int, bit: int
) -> None:
    payload = _quantized()
    oid = manifest.content_id(payload)
    body = zstandard.ZstdCompressor().compress(payload)
    stored = object_format.frame(object_format.KIND_WHOLE, object_format.CODER_ZSTD, 0, payload, None, body, version=version)
    length = struct.unpack_from("<Q", stored, 8)[0] ^ (1 << bit)
    # re-checksummed: a crafted length, not only a corrupt one, must be refused
    for data in (_set_length(stored, length),
                 _crafted(object_format.KIND_WHOLE, object_format.CODER_ZSTD, 0, length, None, body, version)):
        repo._storage.write(cas.object_path(oid), data)
        with pytest.raises(IntegrityError, match=oid):
            cas.ObjectStore(repo._storage).get(oid)


@pytest.mark.parametrize("length", [0, 7, 2**40, 2**63, 2**64 - 1])
def test_crafted_lengths_never_allocate(repo: ins.Repository, length: int) -> None:
    oid = "ab" * 16
    for coder, body in ((object_format.CODER_NONE, b"x" * 8),
                        (object_format.CODER_ZSTD, zstandard.ZstdCompressor().compress(b"\0" * 100))):
        repo._storage.write(cas.object_path(oid),
                           _crafted(object_format.KIND_WHOLE, coder, 0, length, None, body))
        with pytest.raises(IntegrityError, match=oid):
            cas.ObjectStore(repo._storage).get(oid)


def test_zstd_frame_declaring_more_than_the_header_is_refused(repo: ins.Repository) -> None:
    oid = "cd" * 16
    body = zstandard.ZstdCompressor().compress(b"\0" * 10_000)
    repo._storage.write(cas.object_path(oid),
                       _crafted(object_format.KIND_WHOLE, object_format.CODER_ZSTD, 0, 100, None, body))
    with pytest.raises(IntegrityError, match=f"{oid}.*|at most 100"):
        cas.ObjectStore(repo._storage).get(oid)
    # no content size in the frame: the streaming decoder stops past the declared length
    body = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 10_000)
    repo._storage.write(cas.object_path(oid),
                       _crafted(object_format.KIND_WHOLE, object_format.CODER_ZSTD, 0, 100, None, body))
    with pytest.raises(IntegrityError, match="at most 100"):
        cas.ObjectStore(repo._storage).get(oid)


def test_a_changed_base_id_fails_the_format_2_checksum(repo: ins.Repository) -> None:
    base = repo._objects.put(_quantized(seed=1)).oid
    changed = bytearray(_quantized(seed=1))
    changed[40] = (changed[40] + 1) % 15
    child = repo._objects.put(bytes(changed), base=base)
    assert child.kind == object_format.KIND_DELTA
    path = cas.object_path(child.oid)
    stored = bytearray(repo._storage.read(path))
    stored[20] ^= 0x01  # inside the base id: the header is still self-consistent
    repo._storage.write(path, bytes(stored))
    with pytest.raises(IntegrityError, match="checksum"):
        cas.ObjectStore(repo._storage).get(child.oid)


def test_header_uses_a_ranged_read_and_falls_back(repo: ins.Repository, monkeypatch) -> None:
    oid = repo._objects.put(b"some payload").oid
    calls = []
    original = repo._storage.fs.cat_file

    def ranged(path, start=None, end=None, **kw):  # type: ignore[no-untyped-def]
        calls.append((start, end))
        return original(path, start=start, end=end, **kw)

    monkeypatch.setattr(repo._storage.fs, "cat_file", ranged)
    header = repo._objects.header(oid)
    assert header.logical_length == len(b"some payload") and calls[0] == (0, object_format.HEADER_SIZE)

    def no_ranges(path, start=None, end=None, **kw):  # type: ignore[no-untyped-def]
        if start is not None:
            raise NotImplementedError
        return original(path, **kw)

    monkeypatch.setattr(repo._storage.fs, "cat_file", no_ranges)
    assert repo._objects.header(oid) == header
    with pytest.raises(ins.NotFoundError, match=ZERO_ID):
        repo._objects.header(ZERO_ID)


# -- 2. ids ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["../../x", "../" * 10 + "etc/passwd", "A" * 32, "0" * 31,
                                 "0" * 32 + "\n", "", None, 5, "g" * 32])
def test_ids_are_checked_before_building_paths(bad: object) -> None:
    with pytest.raises(IntegrityError, match="32 lowercase hex digits"):
        cas.object_path(bad)  # type: ignore[arg-type]
    with pytest.raises(IntegrityError, match="32 lowercase hex digits"):
        tree_path(bad)  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="in ref 'main'"):
        check_id(bad, "snapshot", "ref 'main'", FormatError)
    assert check_id("0123456789abcdef" * 2, "snapshot", "x") == "0123456789abcdef" * 2


def test_a_tree_naming_a_path_outside_the_store_is_refused(repo: ins.Repository) -> None:
    repo.save({"w": np.arange(4, dtype=np.float32)})
    reader = repo.checkout()
    node = reader.view.node_trees()["w"][1]
    bad = json.dumps({"format": 1, "metadata": node.metadata,
                      "chunks": {"c/0": "../../../../secret"}}, sort_keys=True).encode()
    with pytest.raises(IntegrityError, match="secret") as info:
        NodeTree.from_bytes(bad)
    assert "tree" in str(info.value)


# -- 3. manifests -----------------------------------------------------------------------


GOOD_SNAPSHOT = {"format": 1, "root": ZERO_ID, "parent": None, "time": "t", "message": "",
                 "step": None, "metrics": {}, "metadata": {}}


@pytest.mark.parametrize("change", [
    {"root": 5}, {"root": "../x"}, {"parent": 7}, {"time": None}, {"message": ["m"]},
    {"step": True}, {"step": 1.5}, {"step": "3"}, {"metrics": []}, {"metrics": {"a": "x"}},
    {"metrics": {"a": True}}, {"metrics": {"a": {"$float": "big"}}}, {"metadata": 3},
    {"metadata": {"a": {"$float": 1}}}, {"extra": 1},
])
def test_malformed_snapshots_are_integrity_errors(change: dict) -> None:
    data = manifest.canonical_json({**GOOD_SNAPSHOT, **change})
    sid = manifest.content_id(data)
    with pytest.raises(IntegrityError, match=f"snapshot {sid}"):
        Snapshot.from_bytes(data, sid)
    with pytest.raises(IntegrityError, match="snapshot"):
        Snapshot.from_bytes(data)


@pytest.mark.parametrize("data", [
    b"[]", b"5", b'"x"', b"{", b"\xff\xfe", b'{"format": true}', b'{"format": 1, "root": NaN}',
    b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
])
def test_non_documents_never_escape_as_other_errors(data: bytes) -> None:
    for parse in (Snapshot.from_bytes, RootTree.from_bytes, NodeTree.from_bytes):
        with pytest.raises((IntegrityError, FormatError)):
            parse(data)


def test_future_format_is_a_format_error() -> None:
    data = manifest.canonical_json({**GOOD_SNAPSHOT, "format": 2})
    with pytest.raises(FormatError, match="format version 1"):
        Snapshot.from_bytes(data)


@pytest.mark.parametrize("nodes", [
    {"/abs": ZERO_ID}, {"a/../b": ZERO_ID}, {"a//b": ZERO_ID}, {"a/": ZERO_ID}, {"": "x"},
    [], {"a": None},
])
def test_malformed_root_trees(nodes: object) -> None:
    with pytest.raises(IntegrityError, match="root tree"):
        RootTree.from_bytes(manifest.canonical_json({"format": 1, "nodes": nodes}))


@pytest.mark.parametrize("doc", [
    {"format": 1, "metadata": 5, "chunks": {}},
    {"format": 1, "metadata": None, "chunks": []},
    {"format": 1, "metadata": None, "chunks": {"../c": ZERO_ID}},
    {"format": 1, "metadata": None},
    {"format": 1, "metadata": None, "chunks": {}, "more": 1},
])
def test_malformed_node_trees(doc: dict) -> None:
    with pytest.raises(IntegrityError, match="tree"):
        NodeTree.from_bytes(manifest.canonical_json(doc))


def _replace_node(repo: ins.Repository, path: str, metadata: str | None = None,
                  chunks: dict | None = None) -> str:
    """Write a new snapshot whose node ``path`` has other metadata/chunks; its id."""
    reader = repo.checkout()
    tree = reader.view.node_trees()[path][1]
    node = NodeTree(tree.metadata if metadata is None else metadata,
                    tree.chunks if chunks is None else chunks)
    repo._storage.write(tree_path(node.id), node.to_bytes())
    old = reader.view.root
    root = RootTree({**old.nodes, path: node.id}, inline={p: t for p, t in old.inline.items() if p != path})
    repo._storage.write(tree_path(root.id), root.to_bytes())
    snap = Snapshot(root.id, None, "t")
    repo._storage.write(f"snapshots/{snap.id}", snap.to_bytes())
    return snap.id


@pytest.mark.parametrize("text", ["[1, 2]", "not json", "5", "[" * 5000])
def test_zarr_json_that_is_not_an_object_names_the_node(repo: ins.Repository, text: str) -> None:
    repo.save({"w": np.arange(4, dtype=np.float32)})
    sid = _replace_node(repo, "w", metadata=text)
    with pytest.raises(IntegrityError, match="'w'"):
        ins.open(repo.url).checkout(sid).arrays()


@pytest.mark.parametrize("change", [
    {"shape": "abc"}, {"shape": [-1]}, {"shape": [1.5]}, {"shape": [True]}, {"shape": [4, 4]},
    {"chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [0]}}},
    {"chunk_grid": {"name": "irregular"}}, {"chunk_grid": 3},
    {"attributes": {"inshrink": {"dtype": "F128"}}}, {"attributes": {"inshrink": {"dtype": []}}},
    {"data_type": "object"},
    {"chunk_key_encoding": {"name": "weird"}}, {"fill_value": "not a number"},
    {"codecs": [{"name": "no-such-codec"}]}, {"codecs": "x"},
])
def test_nonsense_array_metadata_names_the_tensor(repo: ins.Repository, change: dict) -> None:
    repo.save({"w": np.arange(4, dtype=np.float32)})
    doc = json.loads(repo.checkout().view.node_trees()["w"][1].metadata)
    doc.update(change)
    sid = _replace_node(repo, "w", metadata=json.dumps(doc))
    with pytest.raises((IntegrityError, FormatError), match="'w'"):
        ins.open(repo.url).checkout(sid).load()


# -- 4. shapes bounded by the chunks that exist --------------------------------------------


def test_the_writer_stores_every_chunk_even_all_zero_ones(repo: ins.Repository) -> None:
    repo.save({"z": np.zeros((3000, 1000), np.float32)})
    info = repo.checkout().arrays()["z"]
    assert len(info.chunk_ids) == math.prod(-(-s // c) for s, c in zip(info.shape, info.chunks, strict=True))


def test_a_huge_declared_shape_without_its_chunks_is_refused(repo: ins.Repository) -> None:
    repo.save({"w": np.ones((3000, 1000), np.float32)})
    doc = json.loads(repo.checkout().view.node_trees()["w"][1].metadata)
    doc["shape"] = [50000, 50000]
    sid = _replace_node(repo, "w", metadata=json.dumps(doc))
    reader = ins.open(repo.url).checkout(sid)
    with pytest.raises(IntegrityError, match="'w'.*2400 of its chunks"):
        reader.arrays()
    with pytest.raises(IntegrityError, match="'w'"):
        reader.load()


def test_one_tiny_chunk_declaring_a_huge_chunk_is_refused(repo: ins.Repository) -> None:
    repo.save({"w": np.ones((3000, 1000), np.float32)})
    view = repo.checkout().view
    doc = json.loads(view.node_trees()["w"][1].metadata)
    doc["shape"] = doc["chunk_grid"]["configuration"]["chunk_shape"] = [50000, 50000]
    first = view.node_trees()["w"][1].chunks["c/0/0"]
    sid = _replace_node(repo, "w", metadata=json.dumps(doc), chunks={"c/0/0": first})
    reader = ins.open(repo.url).checkout(sid)
    assert reader.arrays()["w"].logical_bytes == 50000 * 50000 * 4  # metadata only: fine
    with pytest.raises(IntegrityError, match="chunk 'c/0/0' of tensor 'w'"):
        reader.read("w")


def test_bogus_chunk_keys_do_not_count_as_chunks(repo: ins.Repository) -> None:
    repo.save({"w": np.ones((3000, 1000), np.float32)})
    view = repo.checkout().view
    doc = json.loads(view.node_trees()["w"][1].metadata)
    doc["shape"] = [30000, 1000]
    oid = view.node_trees()["w"][1].chunks["c/0/0"]
    sid = _replace_node(repo, "w", metadata=json.dumps(doc),
                        chunks={f"x/{i}": oid for i in range(40)})
    with pytest.raises(IntegrityError, match="all 29 of its chunks"):
        ins.open(repo.url).checkout(sid).arrays()


def test_small_sparse_arrays_from_plain_zarr_still_read(repo: ins.Repository) -> None:
    import zarr

    tx = repo.transaction()
    z = zarr.create_array(store=tx.store, name="sparse", shape=(100,), chunks=(10,),
                          dtype="float32", fill_value=0)
    z[:10] = 1.0  # zarr's default skips the nine all-zero chunks
    tx.commit()
    reader = repo.checkout()
    assert len(reader.arrays()["sparse"].chunk_ids) == 1
    np.testing.assert_array_equal(reader.read("sparse")[:10], np.ones(10, np.float32))


# -- 5. non-finite floats and commit fields ------------------------------------------------


def test_nan_and_inf_metrics_and_metadata_survive_a_commit(repo: ins.Repository) -> None:
    metrics = {"loss": math.nan, "best": math.inf, "worst": -math.inf, "acc": 0.5}
    metadata = {"trial": {"score": math.nan, "list": [math.inf, 1]}, "name": "x"}
    info = repo.save({"w": np.ones(3, np.float32)}, metrics=metrics, metadata=metadata)
    raw = zstandard.decompress(repo._storage.read(f"snapshots/{info.id}"))  # stored as a zstd frame
    json.loads(raw, parse_constant=lambda name: pytest.fail(f"non-strict JSON {name}"))
    back = ins.open(repo.url).snapshot(info.id)
    assert math.isnan(back.metrics["loss"]) and back.metrics["best"] == math.inf
    assert back.metrics["worst"] == -math.inf and back.metrics["acc"] == 0.5
    assert math.isnan(back.metadata["trial"]["score"])
    assert back.metadata["trial"]["list"] == [math.inf, 1] and back.metadata["name"] == "x"


def test_snapshot_float_encoding_round_trips() -> None:
    snap = Snapshot(ZERO_ID, None, "t", metrics={"a": math.nan},
                    metadata={"$float": 1, "b": {"c": -math.inf}})
    data = snap.to_bytes()
    assert b"NaN" not in snap.canonical() and b'{"$float":"nan"}' in snap.canonical()
    assert zstandard.decompress(data) == snap.canonical()
    back = Snapshot.from_bytes(data, manifest.content_id(data))
    assert math.isnan(back.metrics["a"]) and back.metadata["b"]["c"] == -math.inf
    assert back.metadata["$float"] == 1  # not the only key: an ordinary key


@pytest.mark.parametrize(("args", "field"), [
    ((1, None, None, None), "message"),
    (("", True, None, None), "step"), (("", "abc", None, None), "step"),
    (("", 1.7, None, None), "step"), (("", 3.0, None, None), "step"),
    (("", np.float64(3.0), None, None), "step"),
    (("", None, [1], None), "metrics"), (("", None, {"a": "x"}, None), r"metrics\['a'\]"),
    (("", None, {1: 2.0}, None), "metrics"), (("", None, {"a": None}, None), r"metrics\['a'\]"),
    (("", None, None, {"a": {1, 2}}), r"metadata\['a'\]"),
    (("", None, None, {"a": [object()]}), r"metadata\['a'\]\[0\]"),
    (("", None, None, {"a": {"$float": "nan"}}), r"metadata\['a'\].*reserved"),
    (("", None, None, {"$float": "nan"}), "metadata.*reserved"),
    (("", None, None, {1: 2}), "keys of metadata"),
    (("", None, None, [1]), "metadata"),
    (("", None, None, {"a": np.zeros(3)}), r"metadata\['a'\]"),
])
def test_check_commit_fields_refuses(args: tuple, field: str) -> None:
    with pytest.raises(FormatError, match=field):
        check_commit_fields(*args)


def test_check_commit_fields_normalises() -> None:
    message, step, metrics, metadata = check_commit_fields(
        "m", np.int64(7), {"a": np.float32(0.5), "b": 3, "c": math.nan},
        {"x": (1, np.int32(2), np.float16(0.5), np.bool_(True)), "y": {"z": None}},
    )
    assert (message, step) == ("m", 7) and type(step) is int
    assert metrics["a"] == 0.5 and metrics["b"] == 3.0 and math.isnan(metrics["c"])
    assert all(type(v) is float for v in metrics.values())
    assert metadata == {"x": [1, 2, 0.5, True], "y": {"z": None}}
    assert [type(v) for v in metadata["x"]] == [int, int, float, bool]
    manifest.canonical_json(manifest._encode_floats(metadata))
    assert check_commit_fields("", None, None, None) == ("", None, {}, {})


# -- 6. ref names --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["main\n", "main\r", "ma\nin", " main", "main "])
def test_ref_names_with_newlines_are_refused(name: str) -> None:
    with pytest.raises(FormatError):
        refs.check_name(name, "branch")


def test_parse_expression_is_anchored() -> None:
    assert refs.parse_expression("main~2^") == ("main", 3)
    for bad in ("main\nx", "main~2\nfoo", "a b", "main~x", "~3", "main~" + "9" * 40):
        with pytest.raises(FormatError):
            refs.parse_expression(bad)


# -- 7. codec configurations and declared sizes ---------------------------------------------


def test_unknown_codec_config_keys_are_format_errors() -> None:
    with pytest.raises(FormatError, match="'bogus'"):
        NUQ.from_config({"id": "inshrink.nuq", "codebook": [0.0], "bogus": 1})
    with pytest.raises(FormatError, match="'bogus'"):
        NUQZarrCodec.from_dict({"name": "inshrink.nuq",
                                "configuration": {"codebook": [0.0], "bogus": 1}})
    with pytest.raises(FormatError, match="'bogus'"):
        VDelta.from_config({"id": "inshrink.vdelta", "bogus": 1})
    for config in ({"codebook": "123"}, {"codebook": [0.0], "protected_dtype": ["x"]},
                   {"codebook": [0.0], "dtype": {}}, {"codebook": {"a": 1}}, {}):
        with pytest.raises(FormatError):
            NUQ.from_config({"id": "inshrink.nuq", **config})
        with pytest.raises(FormatError):
            NUQZarrCodec.from_dict({"name": "inshrink.nuq", "configuration": config})
    for config in ({"level": "3"}, {"level": [3]}, {"coder": ["zstd"]}, {"regroup": "yes"}):
        with pytest.raises(FormatError):
            VDelta.from_config({"id": "inshrink.vdelta", **config})
    assert NUQ.from_config(NUQ([0.0, 1.0]).get_config()).codebook == [0.0, 1.0]


def _huge_frame(declared: int, content: bytes) -> bytes:
    """A valid zstd frame of ``content`` whose header declares ``declared`` bytes."""
    frame = zstandard.ZstdCompressor(write_content_size=False, write_checksum=False).compress(content)
    fhd = frame[4]
    assert fhd & 0xE3 == 0  # no content size, not single-segment, no dictionary id
    # content size flag 3 (8 bytes), written after the window descriptor at offset 5
    return frame[:4] + bytes([fhd | 0xC0]) + frame[5:6] + struct.pack("<Q", declared) + frame[6:]


def test_vdelta_frame_declaring_a_huge_size_is_a_format_error() -> None:
    base = _quantized(seed=3)
    changed = bytearray(base)
    changed[60] = (changed[60] + 1) % 15
    codec = VDelta()
    delta = bytearray(codec.encode(bytes(changed), base=base))
    zlen = struct.unpack_from("<Q", delta, 40)[0]
    frame = bytes(delta[vdelta.HEADER_SIZE: vdelta.HEADER_SIZE + zlen])
    content = zstandard.ZstdDecompressor().decompress(frame)
    hostile = _huge_frame(790_000_000_000_000_000, content)
    assert zstandard.get_frame_parameters(hostile).content_size == 790_000_000_000_000_000
    rebuilt = (bytes(delta[:40]) + struct.pack("<Q", len(hostile)) + hostile
               + bytes(delta[vdelta.HEADER_SIZE + zlen:]))
    with pytest.raises(FormatError, match="declare at most"):
        codec.decode(rebuilt, base=base)
    assert codec.decode(bytes(delta), base=base) == bytes(changed)


def test_zstd_object_whose_frame_declares_a_huge_size(repo: ins.Repository) -> None:
    payload = b"\0" * 1000
    oid = manifest.content_id(payload)
    hostile = _huge_frame(2**62, payload)
    repo._storage.write(cas.object_path(oid),
                       _crafted(object_format.KIND_WHOLE, object_format.CODER_ZSTD, 0, 1000, None, hostile))
    with pytest.raises(IntegrityError, match=oid):
        cas.ObjectStore(repo._storage).get(oid)


def test_sparse_limit_constants_are_documented() -> None:
    assert index.SPARSE_LIMIT == 64 << 20 and reader.MAX_CHUNK_EXPANSION >= 1 << 16
    assert "SPARSE_LIMIT" in (reader.SnapshotReader.arrays.__doc__ or "")


def test_snapshot_metadata_that_decodes_to_a_float_is_refused() -> None:
    data = manifest.canonical_json({**GOOD_SNAPSHOT, "metadata": {"$float": "nan"}})
    with pytest.raises(IntegrityError, match="metadata as an object"):
        Snapshot.from_bytes(data)

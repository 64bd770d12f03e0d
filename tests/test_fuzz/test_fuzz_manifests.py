"""Snapshot, RootTree and NodeTree documents from random, mutated and deeply nested JSON;
commit fields from random values."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from inshrink_store.errors import FormatError
from inshrink_store.manifest import (
    NodeTree,
    RootTree,
    Snapshot,
    canonical_json,
    check_commit_fields,
    content_id,
    pack_tree,
)
from tests.test_fuzz._hostile import FAST, JSON, SLOW, bounded, mutate, mutate_bytes

ID = "0123456789abcdef" * 2
GOOD = {
    Snapshot: Snapshot(ID, None, "2026-01-01T00:00:00+00:00", "msg", 3, {"loss": math.nan},
                       {"trial": {"lr": 0.1, "inf": math.inf}}).to_bytes(),
    RootTree: RootTree({"": ID, "model": ID, "model/w": ID}).to_bytes(),
    NodeTree: NodeTree('{"node_type": "array"}', {"c/0/0": ID, "c/1/0": ID}).to_bytes(),
}
KINDS = list(GOOD)


def _plain(stored: bytes) -> bytes:
    """A stored document's JSON (trees are stored as a zstd frame of it)."""
    return zstandard.decompress(stored) if stored[:4] == b"\x28\xb5\x2f\xfd" else stored


def _parse(kind: type, data: bytes) -> None:
    with bounded() as outcome:
        doc = kind.from_bytes(data, content_id(data))
    with bounded():
        kind.from_bytes(data)  # no id to check: the schema alone decides
    if outcome.error is None:
        assert isinstance(doc, kind)
        if kind is Snapshot:  # a valid snapshot encodes back to strict JSON
            json.loads(_plain(doc.to_bytes()), parse_constant=lambda name: pytest.fail(name))


def _mutated_document(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(KINDS), label="kind")
    doc = mutate(json.loads(_plain(GOOD[kind])), data)
    try:
        raw = canonical_json(doc)
    except ValueError:  # the drawn value held a float JSON cannot carry
        return
    _parse(kind, raw)  # as a document written before documents were compressed
    _parse(kind, pack_tree(raw))  # as one is stored now


def _mutated_bytes(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(KINDS), label="kind")
    _parse(kind, mutate_bytes(GOOD[kind], data))


@FAST
@given(data=st.data())
def test_mutated_documents(data: st.DataObject) -> None:
    _mutated_document(data)


@FAST
@given(data=st.data())
def test_mutated_document_bytes(data: st.DataObject) -> None:
    _mutated_bytes(data)


@FAST
@given(doc=JSON)
def test_random_json_documents(doc: object) -> None:
    raw = json.dumps(doc).encode()
    for kind in KINDS:
        _parse(kind, raw)
        if isinstance(doc, dict):
            _parse(kind, json.dumps({**doc, "format": 1}).encode())


@FAST
@given(depth=st.integers(1, 200_000), opener=st.sampled_from(["[", '{"a":', '{"metadata":']))
def test_deep_nesting(depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    inner = "1" if opener != "[" else ""
    raw = ('{"format":1,"metadata":' + opener * depth + inner + closer * depth + "}").encode()
    for kind in KINDS:
        _parse(kind, raw)
        _parse(kind, (opener * depth + inner + closer * depth).encode())


def test_deep_nesting_at_the_recursion_limit() -> None:
    for depth in (50, 64, 65, 100, 900, 990, 1000, 5000, 100_000):
        meta = '{"x":' * depth + "1" + "}" * depth
        raw = ('{"format":1,"metadata":' + meta + ',"parent":null,"root":"' + ID
               + '","time":"t"}').encode()
        _parse(Snapshot, raw)


VALUES = st.one_of(
    JSON, st.floats(), st.sampled_from([np.float32(1.5), np.int64(3), np.bool_(True), np.float64("nan"),
                                        (1, 2), {1, 2}, object(), b"bytes", np.zeros(2), 3.0, 1.7]),
)


def _commit_fields(message: object, step: object, metrics: object, metadata: object) -> None:
    try:
        message, step, metrics, metadata = check_commit_fields(message, step, metrics, metadata)
    except FormatError:
        return
    snap = Snapshot(ID, None, "t", message, step, metrics, metadata)
    data = snap.to_bytes()
    json.loads(_plain(data), parse_constant=lambda name: pytest.fail(name))
    back = Snapshot.from_bytes(data, content_id(data))
    assert back.to_bytes() == data  # what was accepted is stored faithfully


@FAST
@given(message=VALUES, step=VALUES, metrics=st.one_of(st.dictionaries(st.text(max_size=4), VALUES), VALUES),
       metadata=st.one_of(st.dictionaries(st.text(max_size=4), VALUES), VALUES))
def test_commit_fields(message: object, step: object, metrics: object, metadata: object) -> None:
    _commit_fields(message, step, metrics, metadata)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_mutated_documents_long(data: st.DataObject) -> None:
    _mutated_document(data)
    _mutated_bytes(data)


@pytest.mark.slow
@SLOW
@given(message=VALUES, step=VALUES, metrics=st.one_of(st.dictionaries(st.text(max_size=4), VALUES), VALUES),
       metadata=st.one_of(st.dictionaries(st.text(max_size=4), VALUES), VALUES))
def test_commit_fields_long(message: object, step: object, metrics: object, metadata: object) -> None:
    _commit_fields(message, step, metrics, metadata)

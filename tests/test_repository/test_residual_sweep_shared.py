"""The residual-only sweep never deletes an object a committed version's chunk uses.

Objects are addressed by their content, so one object can be both a residual piece and an
array chunk: a lossless float chunk is stored as its raw bits, and raw bits can be any bytes,
a piece's (``IRP\\x01`` first) included. ``gc_residuals`` dropping a residual must then keep
that piece, whichever was written first.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store.residual import PIECE_MAGIC
from tests.test_repository._quantized_residuals import QC, quiet_quantizer, seeded  # noqa: F401 - an autouse fixture


def _piece_payload() -> tuple[np.ndarray, bytes]:
    """A tensor whose residual has one piece of whole float32 elements, and that piece's
    payload (content addressing: saving the same tensor anywhere gives the same piece)."""
    for seed in range(32):
        scratch = ins.open(f"memory://scratch-{uuid.uuid4().hex}", create=True)
        info = scratch.save({"p": seeded(seed)}, quantize=QC, exact_resume=1)
        residual = scratch.residual(info.id)
        assert residual is not None
        (oid,) = residual.arrays["p"].pieces
        payload = bytes(scratch._objects.get(oid))
        if len(payload) % 4 == 0:
            return seeded(seed), payload
    raise AssertionError("no piece of whole float32 elements in 32 seeds")


@pytest.mark.parametrize("first", ["piece", "chunk"])
def test_the_residual_sweep_keeps_a_piece_that_is_also_a_committed_chunk(memory_url: str, first: str) -> None:
    tensor, payload = _piece_payload()
    collide = np.frombuffer(payload, np.float32).copy()  # raw bits equal to the piece, magic first
    repo = ins.open(memory_url, create=True)
    if first == "chunk":
        repo.save({"c": collide}, message="lossless chunk")
    dropped = repo.save({"p": tensor}, quantize=QC, exact_resume=1, message="residual dropped next")
    head = repo.save({"c": collide, "q": np.ones(4, np.float32)}, message="lossless head")
    residual = repo.residual(dropped.id)
    assert residual is not None
    (piece,) = residual.arrays["p"].pieces
    chunk_ids = set(repo.checkout(head.id).arrays()["c"].chunk_ids.values())
    assert piece in chunk_ids  # the collision: one object, a piece and a chunk
    assert bytes(repo._objects.get(piece))[:4] == PIECE_MAGIC

    report = repo.gc_residuals()

    assert report.deleted["residuals"]  # the old residual is dropped ...
    fresh = ins.open(memory_url)
    assert fresh.residual(dropped.id) is None
    assert fresh.checkout(head.id).read("c").tobytes() == payload  # ... its piece, a chunk, is not
    assert fresh.verify().ok

"""Regenerate the golden vectors of ``inshrink.vdelta`` under ``codecs/inshrink.vdelta/vectors/``.

Why a script: the vectors are the on-disk compatibility promise, so they must be
reproducible from seeded inputs. Each folder holds ``config.json`` (numcodecs config),
``base.bin`` (base payload), ``input.npy`` (the current payload as a uint8 array) and
``encoded.bin``. A committed vector is never rewritten with different bytes: if the
encoder's output changed, this script stops, because that is a format change (bump
the format version and add new vectors instead). Run: ``python codecs/inshrink.vdelta/make_vectors.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numcodecs
import numpy as np

import inshrink_store.codecs.vdelta  # noqa: F401  (registers the codec)
from inshrink_store.codecs import _payload

FOLDER = Path(__file__).resolve().parent / "vectors"


def write(name: str, config: dict[str, object], current: bytes, base: bytes) -> str:
    """Write one vector, or check that the committed one still encodes to the same bytes."""
    codec = numcodecs.get_codec(dict(config))
    encoded = codec.encode(current, base=base)
    assert codec.decode(encoded, base=base) == current, f"{name}: round trip failed"
    folder = FOLDER / name
    if (folder / "encoded.bin").exists():
        if (folder / "encoded.bin").read_bytes() != encoded:
            sys.exit(f"{name}: the encoder's bytes changed; that is a format change, see the docstring")
        return f"{name}: unchanged"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "base.bin").write_bytes(base)
    np.save(folder / "input.npy", np.frombuffer(current, np.uint8).copy(), allow_pickle=False)
    (folder / "encoded.bin").write_bytes(encoded)
    return f"{name}: written ({len(encoded)} bytes)"


def vectors() -> list[str]:
    rng = np.random.default_rng(7)
    prev = rng.integers(0, 16, 256).astype(np.uint8)
    base = _payload.pack(17, prev, "bfloat16", np.zeros(0, np.uint16))
    cur = prev.copy()
    cur[::9] = (cur[::9] + 1) % 16
    cur[:3] = 16
    current = _payload.pack(17, cur, "bfloat16", np.array([0x3F80, 0x7FC0, 0xFF80], np.uint16))
    wide_ids = (np.arange(256) * 7 % 301).astype(np.uint16)
    wide = _payload.pack(301, wide_ids, "float32", np.ones(int(np.count_nonzero(wide_ids == 300)), np.float32))
    empty = _payload.pack(5, np.zeros(0, np.uint8), "bfloat16", np.zeros(0, np.uint16))
    same_ids = _payload.pack(17, prev, "float32", np.zeros(0, np.float32))  # ids unchanged: all-zero delta
    v1 = {"id": "inshrink.vdelta", "level": 3}  # written before "coder" was in the config
    return [
        write("regrouped", {**v1, "regroup": True}, current, base),
        write("plain", {**v1, "regroup": False}, current, base),
        write("levels-change-uint16", {**v1, "regroup": True}, wide, base),
        write("empty", {**v1, "regroup": True}, empty, empty),
        write("unchanged-ids-float32", {"id": "inshrink.vdelta", "coder": "zstd", "level": 3,
                                        "regroup": True}, same_ids, base),
    ]


if __name__ == "__main__":
    print("\n".join(vectors()))

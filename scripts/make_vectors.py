"""Regenerate the committed golden vectors under codecs/<id>/vectors/ (run only on purpose).

Each vector is a folder: config.json (numcodecs config), input.npy (np.save, no pickle; decoded.npy, what decode
must return;
for inshrink.vdelta the current payload as uint8), encoded.bin, and base.bin for codecs
whose decode takes a base. tests/test_codecs/test_golden_vectors.py decodes every one:
old vectors must keep decoding, that is the on-disk compatibility promise.
"""

from __future__ import annotations

import json
from pathlib import Path

import numcodecs
import numpy as np

import inshrink_store.codecs.nuq  # noqa: F401  (registers)
import inshrink_store.codecs.vdelta  # noqa: F401
from inshrink_store.codecs import _payload, bf16

ROOT = Path(__file__).resolve().parents[1] / "codecs"


def write(codec_id: str, name: str, config: dict, array: np.ndarray, base: bytes | None = None) -> None:
    folder = ROOT / codec_id / "vectors" / name
    folder.mkdir(parents=True, exist_ok=True)
    codec = numcodecs.get_codec(dict(config))
    encoded = codec.encode(array.tobytes() if base is not None else array, **({"base": base} if base else {}))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    np.save(folder / "input.npy", array, allow_pickle=False)
    (folder / "encoded.bin").write_bytes(bytes(encoded))
    if base is not None:
        (folder / "base.bin").write_bytes(base)
    else:  # lossy codecs: the exact decoded array is part of the contract too
        decoded = np.asarray(codec.decode(encoded)).view(array.dtype).reshape(array.shape)
        np.save(folder / "decoded.npy", decoded, allow_pickle=False)


def nuq() -> None:
    rng = np.random.default_rng(2024)
    cb = [-0.5, -0.125, 0.0, 0.125, 0.5]
    f32 = np.concatenate([np.array(cb, np.float32), [np.nan, np.inf, -np.inf, 3.0, -0.0]]).astype(np.float32)
    write("inshrink.nuq", "float32-special", {"id": "inshrink.nuq", "codebook": cb, "tolerance": 0.0,
          "protected_dtype": "bfloat16", "dtype": "float32"}, f32)
    write("inshrink.nuq", "float32-nearest", {"id": "inshrink.nuq", "codebook": cb, "tolerance": "inf",
          "protected_dtype": "float32", "dtype": "float32"}, rng.standard_normal(64).astype(np.float32) * 0.3)
    write("inshrink.nuq", "float16", {"id": "inshrink.nuq", "codebook": cb, "tolerance": 0.05,
          "protected_dtype": "bfloat16", "dtype": "float16"}, (rng.standard_normal(40) * 0.3).astype(np.float16))
    write("inshrink.nuq", "bfloat16", {"id": "inshrink.nuq", "codebook": cb, "tolerance": 0.01,
          "protected_dtype": "bfloat16", "dtype": "bfloat16"},
          bf16.from_float32((rng.standard_normal(40) * 0.3).astype(np.float32)))
    many = [float(v) for v in bf16.round_float32(np.linspace(-4, 4, 300).astype(np.float32))]
    write("inshrink.nuq", "uint16-ids", {"id": "inshrink.nuq", "codebook": many, "tolerance": "inf",
          "protected_dtype": "bfloat16", "dtype": "float32"}, np.linspace(-5, 5, 500).astype(np.float32))
    write("inshrink.nuq", "empty", {"id": "inshrink.nuq", "codebook": [0.0], "tolerance": 0.0,
          "protected_dtype": "bfloat16", "dtype": "float32"}, np.zeros(0, np.float32))


def vdelta() -> None:
    rng = np.random.default_rng(7)
    prev = rng.integers(0, 16, 256).astype(np.uint8)
    base = _payload.pack(17, prev, "bfloat16", np.zeros(0, np.uint16))
    cur = prev.copy()
    cur[::9] = (cur[::9] + 1) % 16
    cur[:3] = 16
    current = _payload.pack(17, cur, "bfloat16", np.array([0x3F80, 0x7FC0, 0xFF80], np.uint16))
    as_u8 = lambda b: np.frombuffer(b, np.uint8).copy()  # noqa: E731
    write("inshrink.vdelta", "regrouped", {"id": "inshrink.vdelta", "level": 3, "regroup": True}, as_u8(current), base)
    write("inshrink.vdelta", "plain", {"id": "inshrink.vdelta", "level": 3, "regroup": False}, as_u8(current), base)
    wide = _payload.pack(301, (np.arange(256) * 7 % 301).astype(np.uint16), "float32",
                         np.ones(int(np.count_nonzero(np.arange(256) * 7 % 301 == 300)), np.float32))
    write("inshrink.vdelta", "levels-change-uint16", {"id": "inshrink.vdelta", "level": 3, "regroup": True},
          as_u8(wide), base)
    empty = _payload.pack(5, np.zeros(0, np.uint8), "bfloat16", np.zeros(0, np.uint16))
    write("inshrink.vdelta", "empty", {"id": "inshrink.vdelta", "level": 3, "regroup": True}, as_u8(empty), empty)


if __name__ == "__main__":
    nuq()
    vdelta()

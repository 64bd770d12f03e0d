"""Regenerate the committed ``inshrink.nuq`` golden vectors (run only on purpose).

The vectors under ``codecs/inshrink.nuq/vectors/`` are the on-disk compatibility
promise: tests decode every one and re-encode its input to the same bytes. This
script only records where they came from; ``tests/test_codecs/test_golden_vectors.py``
runs it into a temporary folder and checks that it still reproduces them, so a
change to the encoder that moves a single byte is noticed. Never regenerate a
vector to make a test pass: add a new vector (and a format version) instead.

Vector format (shared by every codec id), one folder per vector::

    config.json   the numcodecs configuration (with "id")
    input.npy     np.save, no pickle; bfloat16 as uint16 with config dtype "bfloat16";
                  for delta codecs the uint8 bytes of the current payload
    encoded.bin   the exact encoded bytes
    decoded.npy   optional, lossy codecs: what decode must return when it differs
                  from input (absent: decode gives input back bit-exact)
    base.bin      optional, delta codecs: decode(encoded, base=base), encode(input, base=base)

Usage: ``python codecs/inshrink.nuq/make_vectors.py [--root DIR]`` (default: the repo's codecs/).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from inshrink_store import dtypes
from inshrink_store.codecs.nuq import NUQ

ROOT = Path(__file__).resolve().parents[1]  # codecs/
CODEBOOK = [-0.5, -0.125, 0.0, 0.125, 0.5]


def write(root: Path, name: str, config: dict[str, Any], array: np.ndarray) -> None:
    folder = root / "inshrink.nuq" / "vectors" / name
    folder.mkdir(parents=True, exist_ok=True)
    codec = NUQ(**{k: v for k, v in config.items() if k != "id"})
    encoded = codec.encode(array)
    decoded = codec.decode(encoded).reshape(array.shape)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    np.save(folder / "input.npy", array, allow_pickle=False)
    (folder / "encoded.bin").write_bytes(encoded)
    np.save(folder / "decoded.npy", decoded, allow_pickle=False)


def config(codebook: list[float], tolerance: float | str, protected: str, dtype: str) -> dict[str, Any]:
    return {"id": "inshrink.nuq", "codebook": codebook, "tolerance": tolerance,
            "protected_dtype": protected, "dtype": dtype}


def main(root: Path) -> None:
    rng = np.random.default_rng(2024)
    special = np.concatenate([np.array(CODEBOOK, np.float32), [np.nan, np.inf, -np.inf, 3.0, -0.0]])
    write(root, "float32-special", config(CODEBOOK, 0.0, "bfloat16", "float32"),
          special.astype(np.float32))
    write(root, "float32-nearest", config(CODEBOOK, "inf", "float32", "float32"),
          rng.standard_normal(64).astype(np.float32) * 0.3)
    write(root, "float16", config(CODEBOOK, 0.05, "bfloat16", "float16"),
          (rng.standard_normal(40) * 0.3).astype(np.float16))
    write(root, "bfloat16", config(CODEBOOK, 0.01, "bfloat16", "bfloat16"),
          dtypes.float32_to_bf16((rng.standard_normal(40) * 0.3).astype(np.float32)))
    many = [float(v) for v in dtypes.round_bf16(np.linspace(-4, 4, 300).astype(np.float32))]
    write(root, "uint16-ids", config(many, "inf", "bfloat16", "float32"),
          np.linspace(-5, 5, 500).astype(np.float32))
    write(root, "empty", config([0.0], 0.0, "bfloat16", "float32"), np.zeros(0, np.float32))
    # added after the first six: a 0-d array whose one value is protected and rounded
    write(root, "scalar-0d", config([-1.0, 0.0, 1.0], 0.5, "bfloat16", "float32"),
          np.array(3.14159, np.float32))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="folder holding <codec id>/vectors/")
    main(parser.parse_args().root)

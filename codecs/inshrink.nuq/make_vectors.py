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


def config(codebook: list[float], tolerance: float | str, protected: str, dtype: str,
           scales: list[float] | None = None) -> dict[str, Any]:
    made: dict[str, Any] = {"id": "inshrink.nuq", "codebook": codebook, "tolerance": tolerance,
                            "protected_dtype": protected, "dtype": dtype}
    if scales is not None:  # the optional key is left out of the earlier vectors' configs
        made["scales"] = scales
    return made


def float32_exact(values: list[float]) -> list[float]:
    """Scales as the configuration must hold them: each exactly a float32."""
    return [float(v) for v in np.asarray(values, np.float32)]


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
    # added with the "scales" key: 2-D float32 arrays whose columns differ in scale by 10^6.
    # Nearest scaled centre (tolerance "inf"), with NaN, ±Inf, a huge value and -0.0
    scales = float32_exact([1e-3, 0.37, 2.0, 1234.5])
    x = (np.random.default_rng(7).standard_normal((6, 4)) * 0.3 * scales).astype(np.float32)
    x[1, 0], x[2, 1], x[3, 2], x[4, 3], x[5, 0] = np.nan, np.inf, -np.inf, 3e38, -0.0
    write(root, "float32-scaled", config(CODEBOOK, "inf", "bfloat16", "float32", scales), x)
    # tolerance 0: exact scaled centres (they read back bit for bit) and off-centre values,
    # protected as bfloat16 (0.3, 1.0078125); 1.001 in the scale-2.0 column rounds to
    # 1.0 = 0.5 * 2.0 in bfloat16, so it takes that centre's id (what decode-then-encode gives)
    scales = float32_exact([0.01, 3.7, 2.0])
    ids = np.random.default_rng(11).integers(0, len(CODEBOOK), (5, 3))
    x = (np.asarray(CODEBOOK, np.float32)[ids] * np.asarray(scales, np.float32)).astype(np.float32)
    x[0, 0], x[1, 1], x[2, 2], x[3, 0], x[4, 1] = 0.3, 1.0078125, 1.001, np.nan, -0.0
    write(root, "float32-scaled-exact", config(CODEBOOK, 0.0, "bfloat16", "float32", scales), x)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="folder holding <codec id>/vectors/")
    main(parser.parse_args().root)

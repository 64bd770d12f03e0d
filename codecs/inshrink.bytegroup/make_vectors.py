"""Regenerate (or check) the golden vectors of ``inshrink.bytegroup``.

The vectors are the on-disk compatibility promise, so they come from seeded inputs.
Vector format: ``codecs/inshrink.nuq/make_vectors.py``; here ``input.npy`` holds the
element carrier array (float32, float16, or uint16 bit patterns for bfloat16), except in
vectors with ``base.bin`` (encoded against a base chunk), whose ``input.npy`` is the uint8
bytes of the chunk, as for every delta codec. A committed vector is never rewritten with
different bytes: if the encoder's output changed, this script stops, because that is a
format change (bump the format version and add new vectors instead). Vectors named
``v2-*`` are format 2 (coder ``zstd+huffman``); the others are format 1 (coder ``zstd``).

Usage: ``python codecs/inshrink.bytegroup/make_vectors.py [--root DIR]`` (default: the
repo's ``codecs/``; tests run it into a temporary folder and compare).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from inshrink_store import dtypes
from inshrink_store.codecs.bytegroup import ByteGroup

ROOT = Path(__file__).resolve().parents[1]  # codecs/


def write(root: Path, name: str, config: dict[str, Any], array: np.ndarray,
          base: np.ndarray | None = None) -> str:
    """Write one vector under ``root``, or check that the one there still encodes the same."""
    codec = ByteGroup(**{k: v for k, v in config.items() if k != "id"})
    base_bytes = None if base is None else base.tobytes()
    encoded = codec.encode(array, base=base_bytes)
    decoded = codec.decode(encoded, base=base_bytes)
    assert decoded.tobytes() == array.tobytes(), f"{name}: round trip failed"
    folder = root / "inshrink.bytegroup" / "vectors" / name
    if (folder / "encoded.bin").exists():
        if (folder / "encoded.bin").read_bytes() != encoded:
            sys.exit(f"{name}: the encoder's bytes changed; that is a format change, see the docstring")
        return f"{name}: unchanged"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if base is None:
        np.save(folder / "input.npy", array, allow_pickle=False)
    else:
        np.save(folder / "input.npy", np.frombuffer(array.tobytes(), np.uint8).copy(), allow_pickle=False)
        (folder / "base.bin").write_bytes(base_bytes or b"")
    (folder / "encoded.bin").write_bytes(encoded)
    return f"{name}: written ({len(encoded)} bytes)"


def config(dtype: str, level: int = 3, coder: str = "zstd") -> dict[str, Any]:
    return {"id": "inshrink.bytegroup", "coder": coder, "dtype": dtype, "level": level}


def v2(dtype: str, level: int = 1) -> dict[str, Any]:
    """Format 2: what the store writes (sign last, Huffman and packed planes)."""
    return config(dtype, level, "zstd+huffman")


def special_f32() -> np.ndarray:
    """±0, ±Inf, quiet/signalling NaNs with payloads and both signs, subnormals, extremes."""
    bits = np.array([
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
        0x7FC12345, 0xFFBFFFFF, 0x00000001, 0x807FFFFF, 0x00400000, 0x7F7FFFFF, 0xFF7FFFFF,
        0x00800000, 0x3F800000,
    ], np.uint32)
    return bits.view(np.float32)


def weights(rng: np.random.Generator, n: int) -> np.ndarray:
    return (rng.standard_normal(n) * 0.02).astype(np.float32)


def main(root: Path) -> list[str]:
    rng = np.random.default_rng(2026)
    f32 = np.concatenate([special_f32(), weights(rng, 240)])
    f16_bits = np.array([0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01, 0x7DFF, 0x0001,
                         0x83FF, 0x7BFF, 0xFBFF, 0x0400, 0x3C00], np.uint16)
    f16 = np.concatenate([f16_bits.view(np.float16), (rng.standard_normal(100) * 0.1).astype(np.float16)])
    bf16_bits = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x7FFF, 0x0001,
                          0x807F, 0x7F7F, 0xFF7F, 0x0080, 0x3F80], np.uint16)
    bf16 = np.concatenate([bf16_bits, dtypes.float32_to_bf16(weights(rng, 200))])
    parent = weights(rng, 256)
    child = parent.copy()
    child[::7] += np.float32(1e-3)  # a few updated weights: most planes XOR to zeros
    rng2 = np.random.default_rng(2027)  # format 2 inputs: drawn after, so format 1's stay put
    packed = weights(rng2, 3000)
    packed[::9] = 0.0
    packed[5::17] = np.float32(3e38)  # rare exponents: escapes of the packed exponent plane
    few_bits = (weights(rng2, 2000).view(np.uint32) & np.uint32(0xFFFFFF80)).view(np.float32)
    child2 = packed.copy()
    child2[::11] += np.float32(1e-3)
    return [
        write(root, "v2-float32-special", v2("float32"), f32),
        write(root, "v2-float16-special", v2("float16"), f16),
        write(root, "v2-bfloat16-special", v2("bfloat16"), bf16),
        write(root, "v2-float32-packed-escapes", v2("float32"), packed),
        write(root, "v2-bfloat16-packed", v2("bfloat16", 3), dtypes.float32_to_bf16(packed)),
        write(root, "v2-float32-one-bit-plane", v2("float32"), few_bits),
        write(root, "v2-empty", v2("float32"), np.zeros(0, np.float32)),
        write(root, "v2-float32-xor-base", v2("float32"), child2, base=packed),
        write(root, "float32-special", config("float32"), f32),
        write(root, "float16-special", config("float16"), f16),
        write(root, "bfloat16-special", config("bfloat16"), bf16),
        write(root, "float32-level1", config("float32", 1), weights(rng, 1024)),
        write(root, "empty", config("float32"), np.zeros(0, np.float32)),
        write(root, "scalar-0d", config("float32"), np.array(-0.0, np.float32)),
        write(root, "float32-xor-base", config("float32"), child, base=parent),
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="folder holding <codec id>/vectors/")
    print("\n".join(main(parser.parse_args().root)))

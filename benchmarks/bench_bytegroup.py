"""Lossless float chunks: ``inshrink.bytegroup`` (format 1 and 2) vs Blosc zstd + shuffle (the
store's lossless codec before format 2), plain zstd, ZipNN. The store-level comparison on a
real pretrained model is ``bench_lossless.py``.

Inputs (seeded, CPU only, nothing downloaded): the weights of a 64-2048-2048-10 MLP trained
for a few Adam steps on sklearn's digits, as float32 and cast to bfloat16 (uint16 bits),
cut into the writer's 4 MiB chunks. Each method encodes every chunk and is checked to decode
bit-exact; speeds are MB/s of raw input, best of ``REPEAT`` runs, single thread. The XOR rows
encode the final weights against the weights a few steps earlier (the parent version).
ZipNN is compared when ``import zipnn`` works (put a folder holding it on ``PYTHONPATH``);
it is skipped, and said so, otherwise.

Prints a markdown table; writes nothing. Run: ``python -m benchmarks bytegroup``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numcodecs
import numpy as np
import zstandard

from inshrink_store import dtypes
from inshrink_store.codecs.bytegroup import ByteGroup

CHUNK_BYTES = 4 << 20  # inshrink_store.writer.CHUNK_BYTES
REPEAT = 3
STEPS, PARENT_STEPS = 30, 25


def trained_weights() -> tuple[np.ndarray, np.ndarray]:
    """(final, parent): all weights flattened, after STEPS and PARENT_STEPS Adam steps."""
    import torch
    from sklearn.datasets import load_digits

    torch.manual_seed(0)
    torch.set_num_threads(1)
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    model = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.ReLU(),
                                torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def flat() -> np.ndarray:
        return np.concatenate([p.detach().numpy().reshape(-1) for p in model.parameters()]).astype(np.float32)

    parent = flat()
    for step in range(STEPS):
        idx = torch.randint(0, len(x), (256,))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        if step + 1 == PARENT_STEPS:
            parent = flat()
    return flat(), parent


def chunks(a: np.ndarray) -> list[np.ndarray]:
    per = CHUNK_BYTES // a.itemsize
    return [a[i:i + per] for i in range(0, a.size, per)]


Method = tuple[Callable[[np.ndarray, np.ndarray], bytes], Callable[[bytes, np.ndarray], bytes]]


def methods(dtype: str) -> dict[str, Method]:
    blosc = numcodecs.Blosc(cname="zstd", clevel=3, shuffle=numcodecs.Blosc.SHUFFLE)
    blosc.blocksize = 0
    zc, zd = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    out: dict[str, Method] = {
        "blosc zstd-3 shuffle (the store before)": (lambda c, b: bytes(blosc.encode(c)),
                                         lambda e, b: bytes(blosc.decode(e))),
        "zstd-3": (lambda c, b: zc.compress(c.tobytes()), lambda e, b: zd.decompress(e)),
    }
    for coder, level in (("zstd", 1), ("zstd", 3), ("zstd+huffman", 1)):
        codec = ByteGroup(dtype, level=level, coder=coder)
        name = f"bytegroup {coder} level {level}" + (" (the store)" if coder != "zstd" else "")
        out[name] = (lambda c, b, k=codec: k.encode(c),
                                           lambda e, b, k=codec: k.decode(e).tobytes())
        out[f"{name} XOR parent"] = (lambda c, b, k=codec: k.encode(c, base=b),
                                                      lambda e, b, k=codec: k.decode(e, base=b).tobytes())
    zipnn = load_zipnn()
    if zipnn is not None:
        z = zipnn.ZipNN(method="zstd", input_format="byte", bytearray_dtype=dtype, threads=1)
        out["zipnn zstd (1 thread)"] = (lambda c, b: bytes(z.compress(c.tobytes())),
                                       lambda e, b: bytes(z.decompress(e)))
    return out


_ZIPNN_NOTE: list[str] = []


def load_zipnn():  # type: ignore[no-untyped-def]
    try:
        import zipnn
    except Exception as exc:  # not installed, or its C extension did not build
        if not _ZIPNN_NOTE:
            _ZIPNN_NOTE.append(f"ZipNN skipped: import failed ({type(exc).__name__}: {exc}).")
        return None
    return zipnn


def measure(name: str, method: Method, cur: list[np.ndarray], par: list[np.ndarray]) -> str:
    encode, decode = method
    raw = sum(c.nbytes for c in cur)
    best_e = best_d = float("inf")
    encoded: list[bytes] = []
    for _ in range(REPEAT):
        t = time.perf_counter()
        encoded = [encode(c, b) for c, b in zip(cur, par, strict=True)]
        best_e = min(best_e, time.perf_counter() - t)
        t = time.perf_counter()
        decoded = [decode(e, b) for e, b in zip(encoded, par, strict=True)]
        best_d = min(best_d, time.perf_counter() - t)
    for c, d in zip(cur, decoded, strict=True):
        assert c.tobytes() == d, f"{name}: not bit-exact"
    stored = sum(len(e) for e in encoded)
    return (f"| {name} | {stored / 1e6:.2f} | {raw / stored:.3f} | {raw / 1e6 / best_e:.0f} | "
            f"{raw / 1e6 / best_d:.0f} |")


def main() -> None:
    final, parent = trained_weights()
    inputs = {
        "float32": (final, parent),
        "bfloat16": (dtypes.float32_to_bf16(final), dtypes.float32_to_bf16(parent)),
    }
    for dtype, (cur, par) in inputs.items():
        print(f"\n### {dtype}: {cur.nbytes / 1e6:.1f} MB, {len(chunks(cur))} chunks of 4 MiB, "
              f"{STEPS} Adam steps (parent: step {PARENT_STEPS})\n")
        print("| method | stored MB | ratio | encode MB/s | decode MB/s |\n|---|---|---|---|---|")
        for name, method in methods(dtype).items():
            print(measure(name, method, chunks(cur), chunks(par)), flush=True)
    for note in _ZIPNN_NOTE:
        print("\n" + note)


if __name__ == "__main__":
    main()

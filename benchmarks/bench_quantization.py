"""Quantized storage vs int8 + zstd vs lossless zstd, on the same weights, in one run.

What a user weighs: bytes stored, error introduced, and how fast a checkpoint is
encoded and read back. Every method gets the same seeded, trained-looking weights
(heavy-tailed, per-layer scales). The inshrink rows go through the public path
(``repo.save(..., quantize=QuantConfig(...))`` into a ``memory://`` store and
``checkout().read``), so planning (sketch, k-means, partition) is included; the
codec rows time the NUQ codec alone on one tensor against the ALGORITHM.md targets
(encode >= 50 M params/s/core, decode >= 150 M params/s/core). Peak memory is
measured with tracemalloc (numpy reports its buffers to it).

Run through ``python -m benchmarks run``.
"""

from __future__ import annotations

import tracemalloc
import uuid
from typing import Any

import numpy as np
from numcodecs import Zstd

import inshrink_store as ins
from benchmarks.machine_info import timed
from inshrink_store.codecs.nuq import NUQ
from inshrink_store.policy.config import QuantConfig
from inshrink_store.policy.partition import TensorInput, quantize_tensor

CONFIGS = {
    "inshrink 16 bins, protect 0.5 %": QuantConfig(bins=16, prune=0.0, protect=0.005),
    "inshrink 8 bins, prune 30 %": QuantConfig(bins=8, prune=0.3, protect=0.005),
    "inshrink 4 bins, prune 50 %": QuantConfig(bins=4, prune=0.5, protect=0.0005),
}


def make_weights(n_params: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Linear layers of trained-looking weights: Student-t (df 4) tails, per-layer scale."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    width, i = 1024, 0
    while sum(a.size for a in out.values()) < n_params:
        scale = 0.02 * (1.0 + 0.5 * (i % 3))
        out[f"layers.{i}.weight"] = (rng.standard_t(4, size=(width, width)) * scale).astype(np.float32)
        out[f"layers.{i}.bias"] = (rng.standard_normal(width) * 0.01).astype(np.float32)
        i += 1
    return out


def trained_mlp(steps: int) -> tuple[dict[str, np.ndarray], Any]:
    """A real trained model: the demo's MLP (64-1024-1024-10, 1.1 M parameters) trained
    with Adam on scikit-learn's digits; returns its weights and a test-accuracy function."""
    import torch

    from inshrink_store.torch.demo import load_digits_split, make_model

    torch.manual_seed(0)
    xtr, ytr, xte, yte = load_digits_split()
    model = make_model(hidden=1024)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, len(ytr), (64,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}

    def accuracy(values: dict[str, np.ndarray]) -> float:
        model.load_state_dict({k: torch.tensor(np.asarray(v)) for k, v in values.items()})
        with torch.no_grad():
            return float((model(xte).argmax(1) == yte).float().mean())

    return weights, accuracy


def _rel_l2(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    num = sum(float(np.sum((a[k].astype(np.float64) - b[k]) ** 2)) for k in a)
    den = sum(float(np.sum(a[k].astype(np.float64) ** 2)) for k in a)
    return float(np.sqrt(num / den))


def lossless_zstd(weights: dict[str, np.ndarray]) -> dict[str, Any]:
    codec = Zstd(level=3)
    t_enc, blobs = timed(lambda: {k: codec.encode(v) for k, v in weights.items()})
    t_dec, back = timed(lambda: {k: np.frombuffer(codec.decode(b), np.float32).reshape(weights[k].shape)
                                  for k, b in blobs.items()})
    return {"bytes": sum(len(b) for b in blobs.values()), "enc_s": t_enc, "dec_s": t_dec,
            "rel_l2": _rel_l2(weights, back), "back": back}


def int8_zstd(weights: dict[str, np.ndarray]) -> dict[str, Any]:
    """Per-tensor absmax int8 (uniform, 255 levels) then zstd-3: the usual simple baseline."""
    codec = Zstd(level=3)

    def enc() -> dict[str, tuple[float, bytes]]:
        out = {}
        for k, v in weights.items():
            scale = float(np.abs(v).max()) / 127.0 or 1.0
            q = np.clip(np.rint(v / scale), -127, 127).astype(np.int8)
            out[k] = (scale, codec.encode(q))
        return out

    t_enc, blobs = timed(enc)
    t_dec, back = timed(lambda: {
        k: (np.frombuffer(codec.decode(b), np.int8).astype(np.float32) * s).reshape(weights[k].shape)
        for k, (s, b) in blobs.items()})
    return {"bytes": sum(len(b) + 4 for _, b in blobs.values()), "enc_s": t_enc, "dec_s": t_dec,
            "rel_l2": _rel_l2(weights, back), "back": back}


def inshrink(weights: dict[str, np.ndarray], config: QuantConfig) -> dict[str, Any]:
    url = f"memory://inshrink-bench-{uuid.uuid4().hex}"
    repo = ins.open(url, create=True)
    t_enc, _ = timed(lambda: repo.save(weights, quantize=config, message="bench"))
    snap = repo.checkout("main")
    t_dec, back = timed(lambda: {k: snap.read(k) for k in weights})
    stored = sum(repo._storage.list("objects").values())
    repo._storage.fs.rm(repo._storage.root, recursive=True)
    return {"bytes": stored, "enc_s": t_enc, "dec_s": t_dec, "rel_l2": _rel_l2(weights, back), "back": back}


def save_peak_memory(weights: dict[str, np.ndarray], config: QuantConfig) -> tuple[float, float]:
    """Peak memory allocated while quantizing and saving, over the weights' own bytes, and
    the part of it the object cache still holds after the save (the quantized payloads kept
    for the next version's delta, up to the cache's bound)."""
    repo = ins.open(f"memory://inshrink-bench-{uuid.uuid4().hex}", create=True)
    tracemalloc.start()
    repo.save(weights, quantize=config, message="bench")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    stored_now = sum(repo._storage.list("objects").values())
    cached = repo._objects._cache._size
    repo._storage.fs.rm(repo._storage.root, recursive=True)
    # what stays allocated is the store's own copy (memory://); the rest is working memory
    logical = sum(v.nbytes for v in weights.values())
    return (peak - stored_now) / logical, cached / logical


def codec_speed(weight: np.ndarray, config: QuantConfig, repeats: int) -> dict[str, float]:
    """NUQ codec alone on one tensor, and peak memory of planning + encoding it."""
    tracemalloc.start()
    planned = quantize_tensor(TensorInput(weight), config)
    _, plan_peak = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    # what the store does: the planner snaps values onto the codebook (protected ones to
    # bfloat16), then the codec encodes them at tolerance 0, a lossless step
    snapped = planned.values
    codec = NUQ(planned.codebook, tolerance=0.0, protected_dtype=config.protected_dtype)
    base, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    encoded = codec.encode(snapped)
    _, enc_peak = tracemalloc.get_traced_memory()
    enc_peak -= base
    tracemalloc.stop()
    enc = min(timed(lambda: codec.encode(snapped))[0] for _ in range(repeats))
    dec = min(timed(lambda: codec.decode(encoded))[0] for _ in range(repeats))
    return {"params": weight.size, "enc_mps": weight.size / enc / 1e6, "dec_mps": weight.size / dec / 1e6,
            "plan_peak_x": plan_peak / weight.nbytes, "enc_peak_x": enc_peak / weight.nbytes}


def _methods(weights: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    rows = {"lossless zstd-3": lossless_zstd(weights), "int8 absmax + zstd-3": int8_zstd(weights)}
    for name, config in CONFIGS.items():
        rows[name] = inshrink(weights, config)
    return rows


def run(quick: bool = False) -> dict[str, Any]:
    n_params = 4_000_000 if quick else 32_000_000
    weights = make_weights(n_params)
    default = CONFIGS["inshrink 16 bins, protect 0.5 %"]
    synthetic: dict[str, Any] = {"logical": sum(v.nbytes for v in weights.values()),
                 "params": sum(v.size for v in weights.values()), "rows": _methods(weights)}
    for r in synthetic["rows"].values():
        r.pop("back")
    # the peak depends on how the writer's threads interleave: the worst of 3 saves, and the best
    peaks = [save_peak_memory(weights, default) for _ in range(1 if quick else 3)]
    synthetic["peak_x"], synthetic["cache_x"] = max(peaks)
    synthetic["peak_low_x"] = min(peaks)[0]
    big = np.concatenate([weights[k].ravel() for k in sorted(weights) if k.endswith("weight")][:4])
    speed = codec_speed(big, default, repeats=2 if quick else 3)
    del weights, big

    trained, accuracy = trained_mlp(steps=150 if quick else 400)
    rows = _methods(trained)
    for r in rows.values():
        r["accuracy"] = accuracy(r.pop("back"))
    real = {"logical": sum(v.nbytes for v in trained.values()), "params": sum(v.size for v in trained.values()),
            "rows": rows, "accuracy": accuracy(trained)}
    return {"synthetic": synthetic, "trained": real, "codec": speed}


def to_markdown(res: dict[str, Any]) -> str:
    syn, real, c = res["synthetic"], res["trained"], res["codec"]
    lines = [
        f"**Trained model**: the demo MLP 64→1024→1024→10 ({real['params'] / 1e6:.2f} M parameters) trained "
        f"with Adam on scikit-learn digits; test accuracy uncompressed **{real['accuracy']:.4f}**. "
        "Accuracy below is of the model loaded back from each stored form.",
        "",
        "| method | stored KB | ratio | rel. L2 error | test accuracy |",
        "|---|---|---|---|---|",
    ]
    for name, r in real["rows"].items():
        lines.append(f"| {name} | {r['bytes'] / 1e3:.0f} | {real['logical'] / r['bytes']:.1f}× | "
                     f"{r['rel_l2']:.2e} | {r['accuracy']:.4f} |")
    logical, params = syn["logical"], syn["params"]
    lines += [
        "",
        f"**Throughput**: {params / 1e6:.1f} M float32 parameters ({logical / 1e6:.0f} MB), 1024×1024 linear "
        "layers of Student-t (df 4) values with per-layer scales, seeded. One version, so no delta: "
        "keyframe ratios. The inshrink encode column is the whole path, planning (sketch, k-means, "
        "partition) + NUQ + store write, in one process on both cores (the writer plans tensors on its threads, encodes and stores chunks on its own encoder and put threads; a restore decodes chunks with the arrays' codecs outside zarr's event loop); decode is reading every tensor back.",
        "",
        "| method | stored MB | ratio | rel. L2 error | encode M params/s | decode M params/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in syn["rows"].items():
        lines.append(f"| {name} | {r['bytes'] / 1e6:.2f} | {logical / r['bytes']:.1f}× | {r['rel_l2']:.2e} | "
                     f"{params / r['enc_s'] / 1e6:.1f} | {params / r['dec_s'] / 1e6:.1f} |")
    lines += [
        "",
        f"- NUQ codec alone on a {c['params'] / 1e6:.1f} M-element tensor (16 levels, one thread): "
        f"encode **{c['enc_mps']:.0f} M params/s** (target ≥ 50 per core), decode **{c['dec_mps']:.0f} "
        f"M params/s** (target ≥ 150 per core).",
        f"- Peak memory of a quantized save of the whole {logical / 1e6:.0f} MB state, the worst of "
        f"3 saves: **{syn['peak_x']:.2f}×** the model's bytes on top of the model itself (the best "
        f"{syn.get('peak_low_x', syn['peak_x']):.2f}×: it depends on how the writer's threads "
        f"interleave; tensors are planned and encoded a few at a time), of which {syn['cache_x']:.2f}× is the object "
        "cache: the quantized payloads kept after the save for the next version's delta (at "
        f"most 512 MiB); working memory alone {syn['peak_x'] - syn['cache_x']:.2f}×. "
        f"Per tensor: planning {c['plan_peak_x']:.1f}×, "
        f"encoding {c['enc_peak_x']:.1f}× that tensor's bytes.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(to_markdown(run(quick="--quick" in sys.argv)))

"""Reference implementations of the methods the store is compared with (numpy + zstandard).

Each class is a small, readable model of a published method, written here from its
description, not a port of its code; its docstring says what it models and what it
simplifies. They share one contract, so the experiment treats them alike:

- ``handles(path, array, params)``: the arrays the method compresses. Every other array
  (biases, small tensors, step counters, and the optimizer state of the methods that
  define none) is stored lossless with zstd-3 by :class:`BaselineStore`.
- ``settings``: the method's knob, most aggressive first. The store keeps the first
  setting whose restored model is within the tolerance, judged by the same ``eval_fn``
  and the same rule as the Checkpointer's search, and stores the weights lossless when
  none is. ``(None,)``: a method with fixed settings (no search).
- ``encode(arrays, setting, chain) -> blobs`` and ``decode(blobs, specs, chain) ->
  (arrays, chain)``: a real round trip through bytes, whose decoded values are what a
  resume gets. ``chain`` holds what a decoder knows from the versions before (previous
  restored values, level ids, grids), derived only from stored bytes; the methods that
  code deltas need it.

Every method stores each version; the byte counts include its headers and codebooks.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import zstandard

from benchmarks.evaluate.state import Captured
from inshrink_store.policy import SearchPolicy

MIN_NUMEL = 4096  # like the store's QuantConfig.min_numel: smaller tensors stay lossless
Arrays = dict[str, np.ndarray]
Blobs = dict[str, bytes]
Specs = Mapping[str, tuple[tuple[int, ...], np.dtype]]
Chain = dict[str, Any]


def zstd(data: bytes, level: int = 3) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(data)


def unzstd(blob: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(blob)


def is_weight(path: str, array: np.ndarray) -> bool:
    """A weight the lossy methods compress: float32, at least 2-D and MIN_NUMEL elements
    (the tensors the store quantizes too)."""
    return path.startswith("model/") and array.dtype == np.float32 and array.ndim >= 2 and array.size >= MIN_NUMEL


class Codec(Protocol):
    name: str
    settings: tuple[Any, ...]

    def handles(self, path: str, array: np.ndarray, params: Mapping[str, str]) -> bool: ...
    def encode(self, arrays: Arrays, setting: Any, chain: Chain) -> Blobs: ...
    def decode(self, blobs: Blobs, specs: Specs, chain: Chain) -> tuple[Arrays, Chain]: ...
    def after_lossless(self, arrays: Arrays) -> Chain: ...


def _raw(blob: bytes, spec: tuple[tuple[int, ...], np.dtype]) -> np.ndarray:
    shape, dtype = spec
    return np.frombuffer(unzstd(blob), dtype=dtype).reshape(shape).copy()


# -- lossless ---------------------------------------------------------------------------------
class Zstd:
    """Lossless: each array's bytes through zstd-3, every version whole."""

    name = "zstd-3"
    settings: tuple[Any, ...] = (None,)

    def handles(self, path: str, array: np.ndarray, params: Mapping[str, str]) -> bool:
        return True

    def encode(self, arrays: Arrays, setting: Any, chain: Chain) -> Blobs:
        return {p: zstd(a.tobytes()) for p, a in arrays.items()}

    def decode(self, blobs: Blobs, specs: Specs, chain: Chain) -> tuple[Arrays, Chain]:
        return {p: _raw(b, specs[p]) for p, b in blobs.items()}, {}

    def after_lossless(self, arrays: Arrays) -> Chain:
        return {}


class ZipNN(Zstd):
    """Lossless: ZipNN (byte grouping of the floats' exponent bytes, then entropy coding), one
    thread, every version whole. Arrays of other dtypes go through zstd-3."""

    name = "ZipNN"

    def __init__(self) -> None:
        import zipnn

        self._z = zipnn.ZipNN(input_format="numpy", threads=1)

    def encode(self, arrays: Arrays, setting: Any, chain: Chain) -> Blobs:
        # ZipNN overwrites its input: it compresses a copy
        return {p: b"Z" + bytes(self._z.compress(a.copy())) if a.dtype == np.float32 and a.size
                else b"S" + zstd(a.tobytes()) for p, a in arrays.items()}

    def decode(self, blobs: Blobs, specs: Specs, chain: Chain) -> tuple[Arrays, Chain]:
        out = {}
        for p, b in blobs.items():
            if b[:1] == b"Z":
                out[p] = np.array(self._z.decompress(b[1:]), dtype=np.float32).reshape(specs[p][0])
            else:
                out[p] = _raw(b[1:], specs[p])
        return out, {}


# -- lossy, weights only -------------------------------------------------------------------------
class _WeightsOnly:
    settings: tuple[Any, ...] = (None,)

    def handles(self, path: str, array: np.ndarray, params: Mapping[str, str]) -> bool:
        return is_weight(path, array)

    def after_lossless(self, arrays: Arrays) -> Chain:
        return {}


class Int8Absmax(_WeightsOnly):
    """int8 absmax: per tensor, ``scale = max|w| / 127`` and ``round(w / scale)`` in int8,
    zstd-3, every version whole. The usual "just cast it to int8" baseline; no search."""

    name = "int8 absmax"

    def encode(self, arrays: Arrays, setting: Any, chain: Chain) -> Blobs:
        blobs = {}
        for p, a in arrays.items():
            scale = np.float32(float(np.abs(a).max()) / 127 or 1.0)
            q = np.clip(np.rint(a / scale), -127, 127).astype(np.int8)
            blobs[p] = struct.pack("<f", scale) + zstd(q.tobytes())
        return blobs

    def decode(self, blobs: Blobs, specs: Specs, chain: Chain) -> tuple[Arrays, Chain]:
        out = {}
        for p, b in blobs.items():
            (scale,) = struct.unpack("<f", b[:4])
            q = np.frombuffer(unzstd(b[4:]), np.int8).reshape(specs[p][0])
            out[p] = q.astype(np.float32) * np.float32(scale)
        return out, {}


def _uniform_grid(lo: float, hi: float, bits: int) -> tuple[np.float32, np.float32, np.float32]:
    """(lo, hi, step) of a uniform grid of 2**bits levels, in float32 as stored."""
    lo32, hi32 = np.float32(lo), np.float32(hi)
    step = np.float32((float(hi32) - float(lo32)) / (2 ** bits - 1)) or np.float32(1.0)
    return lo32, hi32, step


def _snap(a: np.ndarray, lo: np.float32, step: np.float32, bits: int) -> np.ndarray:
    return np.clip(np.rint((a - lo) / step), 0, 2 ** bits - 1).astype(np.uint8)


class UniformAdaptive(_WeightsOnly):
    """Check-N-Run style: uniform (min-max, asymmetric) quantization per tensor with an
    adaptively chosen bit width, every version whole.

    Models: Check-N-Run (Eisenman et al., NSDI 2022) quantizes checkpoints uniformly and picks
    the bit width adaptively so that accuracy holds over the run's restores. Simplifies: the
    bit width (2-8) is picked per checkpoint by the same tolerance check as our search (the
    smallest width within it), one width for the whole model; Check-N-Run's differential
    checkpointing of touched embedding rows does not apply to dense models (every weight
    changes every step), so each version is stored whole. Level ids are one byte each,
    zstd-3 (which recovers most of the unused bits)."""

    name = "uniform adaptive (Check-N-Run)"
    settings = (2, 3, 4, 5, 6, 8)

    def encode(self, arrays: Arrays, setting: Any, chain: Chain) -> Blobs:
        blobs = {}
        for p, a in arrays.items():
            lo, hi, step = _uniform_grid(float(a.min()), float(a.max()), setting)
            blobs[p] = struct.pack("<Bff", setting, lo, hi) + zstd(_snap(a, lo, step, setting).tobytes())
        return blobs

    def decode(self, blobs: Blobs, specs: Specs, chain: Chain) -> tuple[Arrays, Chain]:
        out = {}
        for p, b in blobs.items():
            bits, lo, hi = struct.unpack("<Bff", b[:9])
            lo32, _, step = _uniform_grid(lo, hi, bits)
            ids = np.frombuffer(unzstd(b[9:]), np.uint8).reshape(specs[p][0])
            out[p] = lo32 + ids.astype(np.float32) * step
        return out, {}


def entropy_bits(a: np.ndarray, bins: int = 256) -> float:
    """Shannon entropy (bits) of a tensor's values on a ``bins``-bin histogram of its range."""
    counts, _ = np.histogram(a, bins=bins)
    p = counts[counts > 0] / a.size
    return float(-(p * np.log2(p)).sum())


class EntropyDelta(_WeightsOnly):
    """QD-Compressor style: per-layer uniform quantization whose bit width follows the layer's
    entropy, and a mod-B delta of the level ids against the previous version.

    Models: QD-Compressor (Zhang et al., ICCD 2021): layers whose values carry more
    information (higher entropy) get more bits; consecutive versions are stored as the
    difference of their quantized ids modulo the level count, then entropy coded. Simplifies:
    a layer gets ``base + round(H_layer - mean H)`` bits (clipped to 2..8), ``base`` picked per
    checkpoint by our tolerance check; a layer keeps its previous grid while its values fit
    in it (a refit pads the range by 5 %) so that ids stay comparable, and the delta
    ``(prev - curr) mod 2**bits`` is taken only then (else the layer is a keyframe); the
    delta is not regrouped (that is the store's addition); zstd-3 codes it."""

    name = "entropy delta (QD-Compressor)"
    settings = (2, 3, 4, 5, 6, 7, 8)

    def encode(self, arrays: Arrays, setting: Any, chain: Chain) -> Blobs:
        entropy = {p: entropy_bits(a) for p, a in arrays.items()}
        mean = sum(entropy.values()) / max(len(entropy), 1)
        blobs = {}
        for p, a in arrays.items():
            bits = int(min(8, max(2, setting + round(entropy[p] - mean))))
            blobs[p] = self._encode_one(a, bits, chain.get(p))
        return blobs

    def _encode_one(self, a: np.ndarray, bits: int, prev: Any) -> bytes:
        lo, hi = float(a.min()), float(a.max())
        fits = prev is not None and prev[0] == bits and prev[1] <= lo and hi <= prev[2]
        if not fits:
            pad = 0.05 * (hi - lo)
            lo, hi = lo - pad, hi + pad
        else:
            lo, hi = prev[1], prev[2]
        lo32, hi32, step = _uniform_grid(lo, hi, bits)
        ids = _snap(a, lo32, step, bits)
        payload = ((prev[3].astype(np.int16) - ids) % (2 ** bits)).astype(np.uint8) if fits else ids
        return struct.pack("<BBff", int(fits), bits, lo32, hi32) + zstd(payload.tobytes())

    def decode(self, blobs: Blobs, specs: Specs, chain: Chain) -> tuple[Arrays, Chain]:
        out, after = {}, {}
        for p, b in blobs.items():
            delta, bits, lo, hi = struct.unpack("<BBff", b[:10])
            payload = np.frombuffer(unzstd(b[10:]), np.uint8).reshape(specs[p][0])
            ids = ((chain[p][3].astype(np.int16) - payload) % (2 ** bits)).astype(np.uint8) if delta else payload
            lo32, hi32, step = _uniform_grid(lo, hi, bits)
            out[p] = lo32 + ids.astype(np.float32) * step
            after[p] = (bits, float(lo32), float(hi32), ids)
        return out, after


def _exponent_codes(r: np.ndarray, keep: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes, centres): residual values grouped by (sign, binary exponent); the ``keep``
    buckets of largest exponent kept (code 1..keep, centre = the bucket's mean), the rest 0."""
    flat = r.reshape(-1)
    nonzero = flat != 0
    exponent = np.zeros(flat.size, np.int64)
    exponent[nonzero] = np.floor(np.log2(np.abs(flat[nonzero]))).astype(np.int64)
    key = np.where(nonzero, exponent * 2 + (flat < 0), np.iinfo(np.int64).min)
    buckets = np.unique(key[nonzero])[::-1][:keep]  # largest exponents first (priority)
    codes = np.zeros(flat.size, np.uint8)
    centres = np.zeros(len(buckets), np.float32)
    for i, k in enumerate(buckets):
        members = key == k
        codes[members] = i + 1
        centres[i] = flat[members].mean()
    return codes.reshape(r.shape), centres


class ExponentBuckets(_WeightsOnly):
    """LC-Checkpoint style: the residual against the previous *restored* weights, quantized by
    binary exponent with priority to the largest exponents.

    Models: LC-Checkpoint (Chen et al., VLDB 2020): delta of consecutive checkpoints,
    exponent-based quantization (values with the same sign and exponent share one bucket,
    represented by its mean) and priority promotion (only the ``2**bits - 1`` buckets of
    largest magnitude are kept, smaller residuals become 0), then Huffman coding. Simplifies:
    ``bits`` (2-6) picked per checkpoint by our tolerance check; zstd-3 instead of Huffman;
    the first version is the residual against zero. Dropped residuals are not lost: the next
    version's residual is taken against what was restored, so they come back."""

    name = "exponent buckets (LC-Checkpoint)"
    settings = (2, 3, 4, 5, 6)

    def encode(self, arrays: Arrays, setting: Any, chain: Chain) -> Blobs:
        blobs = {}
        for p, a in arrays.items():
            prev = chain.get(p)
            codes, centres = _exponent_codes(a - prev if prev is not None else a, 2 ** setting - 1)
            blobs[p] = struct.pack("<B", len(centres)) + centres.tobytes() + zstd(codes.tobytes())
        return blobs

    def decode(self, blobs: Blobs, specs: Specs, chain: Chain) -> tuple[Arrays, Chain]:
        out = {}
        for p, b in blobs.items():
            (k,) = struct.unpack("<B", b[:1])
            centres = np.concatenate([[0.0], np.frombuffer(b[1:1 + 4 * k], np.float32)]).astype(np.float32)
            codes = np.frombuffer(unzstd(b[1 + 4 * k:]), np.uint8).reshape(specs[p][0])
            prev = chain.get(p)
            residual = centres[codes]
            out[p] = residual + prev if prev is not None else residual
        return out, dict(out)

    def after_lossless(self, arrays: Arrays) -> Chain:
        return {p: a.copy() for p, a in arrays.items()}


# -- lossy, weights and Adam moments ---------------------------------------------------------------
def kmeans_1d(values: np.ndarray, k: int, iterations: int = 12, sample: int = 65536) -> np.ndarray:
    """Up to ``k`` sorted centres of a 1-D k-means (quantile start, Lloyd steps on a seeded
    sample): what ExCP's k-means quantizer needs, small and deterministic."""
    if values.size == 0:
        return np.zeros(0, np.float32)
    x = values.astype(np.float64).reshape(-1)
    if x.size > sample:
        x = np.random.default_rng(0).choice(x, sample, replace=False)
    x = np.sort(x)
    centres = np.unique(np.quantile(x, (np.arange(k) + 0.5) / k))
    for _ in range(iterations):
        idx = np.searchsorted((centres[1:] + centres[:-1]) / 2, x)
        counts = np.bincount(idx, minlength=len(centres))
        sums = np.bincount(idx, weights=x, minlength=len(centres))
        centres = sums[counts > 0] / counts[counts > 0]
    return centres.astype(np.float32)


def _pack_codes(values: np.ndarray, mask: np.ndarray, bits: int) -> bytes:
    """Survivors of ``mask`` as codes 1..2**bits-1 of their k-means centres, pruned as 0; two
    4-bit codes per byte; zstd-19 (the 'strong archiver')."""
    centres = kmeans_1d(values[mask], 2 ** bits - 1)
    codes = np.zeros(values.size, np.uint8)
    if centres.size:
        edges = (centres[1:] + centres[:-1]) / 2
        codes[mask.reshape(-1)] = np.searchsorted(edges, values[mask].reshape(-1)).astype(np.uint8) + 1
    if codes.size % 2:
        codes = np.append(codes, 0)
    packed = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    return struct.pack("<B", len(centres)) + centres.tobytes() + zstd(packed.tobytes(), level=19)


def _unpack_codes(blob: bytes, shape: tuple[int, ...]) -> np.ndarray:
    (k,) = struct.unpack("<B", blob[:1])
    centres = np.concatenate([[0.0], np.frombuffer(blob[1:1 + 4 * k], np.float32)]).astype(np.float32)
    packed = np.frombuffer(unzstd(blob[1 + 4 * k:]), np.uint8)
    codes = np.empty(packed.size * 2, np.uint8)
    codes[0::2], codes[1::2] = packed & 15, packed >> 4
    return centres[codes[:math.prod(shape)]].reshape(shape)


class ExcpJoint:
    """ExCP style: weight residuals and Adam moments pruned jointly, 4-bit k-means codes.

    Models: ExCP (Li et al., ICML 2024). Weights: the residual against the previous *restored*
    weights, pruned where ``|r| <= alpha / sqrt(v) * median(|W|)`` (alpha = 5e-5, v Adam's
    second moment). Moments (not residualized): an entry is kept only where ``v > beta *
    mean(v)`` (beta = 2) and its weight residual is kept. Survivors: k-means to 15 centres
    plus zero, two 4-bit codes per byte, then a strong archiver (zstd-19 here, 7-Zip there).
    Simplifies: ExCP's fixed hyperparameters, no search (it has no tolerance rule); a weight
    without moments (frozen) keeps every nonzero residual; 1-D k-means on a seeded sample.
    Pruned moments come back as 0, so Adam restarts those entries: faithful to ExCP, and
    what our update guard exists to catch."""

    name = "joint weight-moment pruning (ExCP)"
    settings: tuple[Any, ...] = (None,)
    alpha, beta, bits = 5e-5, 2.0, 4

    def handles(self, path: str, array: np.ndarray, params: Mapping[str, str]) -> bool:
        if is_weight(path, array):
            return True
        owner, _, key = path.rpartition("/")
        return key in ("exp_avg", "exp_avg_sq") and params.get(owner, "").startswith("model/") \
            and array.size >= MIN_NUMEL and array.ndim >= 2

    def encode(self, arrays: Arrays, setting: Any, chain: Chain) -> Blobs:
        owners = {w: o for o, w in chain.get("__params__", {}).items()}
        blobs = {}
        for p, w in arrays.items():
            if not p.startswith("model/"):
                continue
            prev = chain.get(p)
            r = w - prev if prev is not None else w
            v = arrays.get(f"{owners.get(p)}/exp_avg_sq")
            if v is None:
                blobs[p] = _pack_codes(r, r != 0, self.bits)
                continue
            with np.errstate(divide="ignore"):  # v = 0: an infinite threshold, pruned
                threshold = self.alpha / np.sqrt(v) * np.median(np.abs(w))
            kept = np.abs(r) > threshold
            blobs[p] = _pack_codes(r, kept, self.bits)
            moments = kept & (v > self.beta * v.mean())
            for key in ("exp_avg", "exp_avg_sq"):
                blobs[f"{owners[p]}/{key}"] = _pack_codes(arrays[f"{owners[p]}/{key}"], moments, self.bits)
        return blobs

    def decode(self, blobs: Blobs, specs: Specs, chain: Chain) -> tuple[Arrays, Chain]:
        out = {p: _unpack_codes(b, specs[p][0]) for p, b in blobs.items()}
        for p in out:
            if p.startswith("model/") and chain.get(p) is not None:
                out[p] = out[p] + chain[p]
        after = {p: a for p, a in out.items() if p.startswith("model/")}
        return out, {**after, "__params__": chain.get("__params__", {})}

    def after_lossless(self, arrays: Arrays) -> Chain:
        return {p: a.copy() for p, a in arrays.items() if p.startswith("model/")}


# -- the store every baseline writes into --------------------------------------------------------
@dataclass
class VersionBytes:
    """One version's bytes: logical (the uncompressed arrays) and stored, weights and all;
    ``stored_metadata`` is the part of ``stored`` that describes rather than holds values
    (the store's per-array JSON documents, a baseline's structure JSON)."""

    step: int
    logical_weights: int
    logical: int
    stored_weights: int
    stored: int
    setting: str
    stored_metadata: int = 0


@dataclass
class BaselineStore:
    """One baseline run's disk: every version's bytes, and the newest version decoded.

    ``save`` compresses a captured state (searching the codec's setting when an ``evaluate``
    is given), really decodes it, and keeps the decoded arrays: what :meth:`restore` hands a
    fresh process after a failure. A process that restarts would decode the same bytes from
    disk; keeping the decoded arrays is only a shortcut in time."""

    codec: Codec
    tolerance: float
    higher_is_better: bool
    versions: list[VersionBytes] = field(default_factory=list)
    chain: Chain = field(default_factory=dict)
    newest: Arrays | None = None
    evaluations: int = 0

    def save(self, captured: Captured, step: int, evaluate: Callable[[Arrays | None], float] | None) -> None:
        handled = {p: a for p, a in captured.arrays.items() if self.codec.handles(p, a, captured.params)}
        rest = {p: a for p, a in captured.arrays.items() if p not in handled}
        specs = {p: (a.shape, a.dtype) for p, a in captured.arrays.items()}
        self.chain.setdefault("__params__", captured.params)
        setting, blobs, decoded = self._choose(handled, specs, evaluate)
        rest_blobs = Zstd().encode(rest, None, {})
        restored_rest, _ = Zstd().decode(rest_blobs, specs, {})
        self.newest = {**restored_rest, **decoded}
        sizes = {p: len(b) for p, b in {**rest_blobs, **blobs}.items()}
        self.versions.append(VersionBytes(
            step, captured.logical_bytes("model/"), captured.logical_bytes(),
            sum(n for p, n in sizes.items() if p.startswith("model/")),
            sum(sizes.values()) + captured.skeleton_bytes, setting, captured.skeleton_bytes))

    def _choose(self, handled: Arrays, specs: Specs, evaluate: Callable[[Arrays | None], float] | None
                ) -> tuple[str, Blobs, Arrays]:
        """The first setting within the tolerance (or the fixed one); none: lossless."""
        params = self.chain.get("__params__", {})
        policy = SearchPolicy(tolerance=self.tolerance, higher_is_better=self.higher_is_better)
        baseline = evaluate(None) if evaluate is not None and self.codec.settings != (None,) else None
        for setting in self.codec.settings:
            blobs = self.codec.encode(handled, setting, self.chain)
            decoded, after = self.codec.decode(blobs, specs, self.chain)
            if baseline is not None:
                self.evaluations += 1
                assert evaluate is not None
                if not policy.within(evaluate(decoded), baseline):
                    continue
            self.chain = after
            self.chain.setdefault("__params__", params)
            return str(setting) if setting is not None else "fixed", blobs, decoded
        blobs = Zstd().encode(handled, None, {})
        self.chain = {**self.codec.after_lossless(handled), "__params__": params}
        return "lossless (none within tolerance)", blobs, Zstd().decode(blobs, specs, {})[0]

    def restore(self) -> Arrays:
        assert self.newest is not None, "restore before any save"
        return self.newest


#: the lossy baselines, by key (the lossless ones run on the uninterrupted run's checkpoints)
LOSSY: dict[str, Callable[[], Codec]] = {
    "int8": Int8Absmax, "cnr": UniformAdaptive, "qd": EntropyDelta, "lc": ExponentBuckets, "excp": ExcpJoint,
}
LOSSLESS: dict[str, Callable[[], Codec]] = {"zstd": Zstd, "zipnn": ZipNN}


def lossless_codecs() -> dict[str, Codec]:
    """The lossless codecs that can run here: ZipNN is an optional install (the ``bench`` extra)."""
    out: dict[str, Codec] = {}
    for key, make in LOSSLESS.items():
        try:
            out[key] = make()
        except ImportError:
            continue
    return out

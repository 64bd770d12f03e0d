"""The figures the page reports, computed from the JSON results (one definition each).

- Ratio: the logical bytes of every version a run stored (what uncompressed checkpoints of
  the same versions would take) over the bytes the run stored for them. *Weights*: the
  ``model/`` tensors only; *history*: the whole training state (weights, Adam moments,
  counters, scheduler); *on disk*: history plus the restore residual still on disk at the
  end - all bytes the run left behind.
- Change of final quality: relative, positive when worse - ``(ref - q) / ref`` for accuracy,
  ``(q - ref) / ref`` for a loss - against the uninterrupted run that never compressed.
- Overhead: seconds the training loop spent in checkpointing, over its training seconds;
  the store's background work (search, encoding, commit on its own thread) apart.
"""

from __future__ import annotations

from typing import Any


def _sum(usage: dict[str, Any], name: str) -> int:
    return sum(v[name] for v in usage["versions"])


def ratios(usage: dict[str, Any]) -> dict[str, float]:
    logical_w, logical = _sum(usage, "logical_weights"), _sum(usage, "logical")
    stored_w, stored = _sum(usage, "stored_weights"), _sum(usage, "stored")
    return {"weights": logical_w / max(stored_w, 1), "history": logical / max(stored, 1),
            "disk": logical / max(stored + usage.get("residual", 0), 1)}


def residual_fraction(usage: dict[str, Any]) -> float:
    """The restore residual on disk as a fraction of one raw version of the whole state (the
    price of a bit-exact restart, paid once): with the history's ratio H, N versions take
    N / (N / H + this) of their raw bytes' ratio on disk."""
    versions = usage.get("versions") or []
    return usage.get("residual", 0) / max(versions[-1]["logical"], 1) if versions else 0.0


def metadata_share(usage: dict[str, Any]) -> float:
    """The share of the stored history that is documents (snapshots and zarr.json), not values."""
    return _sum(usage, "stored_metadata") / max(_sum(usage, "stored"), 1)


def per_version(usage: dict[str, Any], weights: bool) -> list[tuple[int, float]]:
    """(step, ratio of that version's new bytes) - deltas and dedup show here."""
    logical, stored = ("logical_weights", "stored_weights") if weights else ("logical", "stored")
    return [(v["step"], v[logical] / max(v[stored], 1)) for v in usage["versions"]]


def quality(run: dict[str, Any], metric: str) -> float:
    return float(run["final"][metric])


def change(reference: float, value: float, metric: str) -> float:
    """Relative change of quality, positive when worse."""
    return (reference - value) / reference if metric == "accuracy" else (value - reference) / reference


def run_change(runs: dict[str, Any], key: str, metric: str) -> float:
    return change(quality(runs["reference"], metric), quality(runs[key], metric), metric)


def overhead(run: dict[str, Any]) -> tuple[float, float]:
    """(loop seconds in checkpointing, background seconds), each over training seconds."""
    background = run["usage"]["background_s"] if run.get("usage") else 0.0
    return run["checkpoint_s"] / run["train_s"], background / run["train_s"]

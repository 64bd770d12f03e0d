"""Every throughput and memory target in one table, from the results of the run's sections.

The targets are the project's (per CPU-second, i.e. per core, on whatever machine runs the
benchmarks); each row names the section it comes from and, when a target is missed, where
the time or memory goes.
"""

from __future__ import annotations

from typing import Any


def _store_vs_torch(store: dict[str, Any]) -> tuple[float, float]:
    rows = {name: save for name, save, _load, _size in store["rows"]}
    return rows["inshrink (lossless)"], rows["torch.save"]


def _search_rate(search: dict[str, Any]) -> float:
    later = [r for r in search["rows"] if r["how"] == "estimated" and r["checkpoint"] > 1]
    return min(search["n"] / 1e6 / (r["search_cpu"] + r["save_cpu"]) for r in later)


def _scaling_spread(scaling: dict[str, Any]) -> tuple[float, float]:
    rates = [r["params"] / 1e6 / r["save_cpu"] for r in scaling["rows"]]
    return min(rates), max(rates)


def to_markdown(results: dict[str, Any]) -> str:
    """The table, from ``results`` keyed by section label (sections not run are left out)."""
    lines = ["| target | measured | met | section |", "|---|---|---|---|"]
    stages = results.get("stages")
    if stages:
        n = stages["n"]
        save, load = n / 1e6 / stages["save"][1], n / 1e6 / stages["load"][1]
        lines.append(f"| quantized save, whole path: >= 50 M params/s per core | {save:.1f} | "
                     f"{'yes' if save >= 50 else 'no: planning is about half of it (sketch, k-means, snapping), the rest NUQ encode, zstd and fsynced writes'} "
                     "| stages |")
        lines.append(f"| restore: >= 150 M params/s per core | {load:.1f} | {'yes' if load >= 150 else 'no'} "
                     "| stages |")
    store = results.get("lossless store")
    if store:
        ours, theirs = _store_vs_torch(store)
        met = "yes" if ours <= 2 * theirs else (
            "no: one fsynced file per object, trees and the commit, and first-touch page faults on this VM")
        lines.append(f"| lossless save: <= 2x torch.save of the same state to the same disk (stretch 1x) | "
                     f"{ours / theirs:.1f}x ({ours:.2f} s against {theirs:.2f} s) | {met} | lossless store |")
    search = results.get("search")
    if search:
        rate = _search_rate(search)
        met = "yes" if rate >= 25 else (
            "no: every evaluated configuration is quantized whole (masks, snapping) and each part is sketched; "
            "the ratios themselves are estimated")
        lines.append(f"| search + planning + encode per later checkpoint, no eval_fn: >= 25 M params/s per core | "
                     f"{rate:.1f} | {met} | search |")
    quantization = results.get("quantization")
    if quantization:
        syn = quantization["synthetic"]
        peak, cache = syn["peak_x"], syn["cache_x"]
        working = peak - cache
        met = "yes" if peak <= 0.5 else (
            f"working memory yes ({working:.2f}x); with the object cache of quantized payloads kept for the next "
            f"delta ({cache:.2f}x, at most 512 MiB) no" if working <= 0.5 else "no")
        lines.append(f"| peak extra memory of a save: <= 0.5x the model | {peak:.2f}x | {met} | quantization |")
    scaling = results.get("scaling")
    if scaling:
        low, high = _scaling_spread(scaling)
        sizes = [r["params"] for r in scaling["rows"]]
        lines.append(f"| cost linear in model size, {sizes[0] / 1e6:.0f} M to {sizes[-1] / 1e6:.0f} M parameters | "
                     f"save {low:.1f}-{high:.1f} M params per CPU-s | {'yes' if high <= 1.35 * low else 'no'} | "
                     "scaling |")
    return "\n".join(lines)

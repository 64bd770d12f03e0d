"""Every throughput and memory target in one table, from the results of the run's sections.

The targets are the project's (per CPU-second, i.e. per core, on whatever machine runs the
benchmarks); each row names the section it comes from and, when a target is missed, where
the time or memory goes.
"""

from __future__ import annotations

import re
from typing import Any

#: a row measured on one thread ("(1 thread, ...)", ", 1 thread)"), not "11 threads"
ONE_THREAD = re.compile(r"[ (]1 thread[,)]")
#: a row of the codec with its compiled loops turned off beside the same row with them on
#: (not the main row of a machine without numba, which says "numpy passes: numba not installed")
NUMPY_PASSES = re.compile(r"numpy passes[,)]")


def _key(name: str) -> str:
    """A lossless row's key: its method, then " numpy" and " 1" for those variants."""
    return (name.split(" (")[0] + (" numpy" if NUMPY_PASSES.search(name) else "")
            + (" 1" if ONE_THREAD.search(name) else ""))


def _store_vs_torch(store: dict[str, Any]) -> tuple[float, float]:
    rows = {name: save for name, save, _load, _size in store["rows"]}
    return rows["inshrink (lossless)"], rows["torch.save"]


def _search_rate(search: dict[str, Any]) -> float:
    later = [r for r in search["rows"] if r["how"] == "estimated" and r["checkpoint"] > 1]
    return min(search["n"] / 1e6 / (r["search_cpu"] + r["save_cpu"]) for r in later)


def _flat(scaling: dict[str, Any], cpu: str) -> tuple[float, float, float]:
    """(lowest, highest, largest size's) params per CPU-second of ``cpu`` over the sizes."""
    rates = [r["params"] / 1e6 / r[cpu] for r in scaling["rows"]]
    return min(rates), max(rates), rates[-1]


def _disk_note(floats: dict[str, Any]) -> str:
    disk = floats.get("disk")
    if not disk:
        return ""
    return f" and this disk takes {disk[0] * 1e3:.2f} ms to create a file, {disk[1] * 1e3:.2f} ms a folder"


def _against_zipnn(floats: dict[str, Any]) -> list[str]:
    """Rows of the lossless target (issue: ratio >= ZipNN's, save time <= its compress time),
    one per dtype: the ratio, the store's save and its codec beside ZipNN on as many threads."""
    lines = []
    for res in floats["results"]:
        rows = {_key(name): (t, size) for name, t, _load, size in res["rows"]}
        for key in [k for k in rows if k.endswith(" 1")]:  # on one core "all cores" is one thread
            rows.setdefault(key[:-2], rows[key])
        if "ZipNN" not in rows:
            lines.append(f"| lossless {res['dtype']}: ratio and save time against ZipNN | ZipNN not installed | – | lossless floats |")
            continue
        fresh, zipnn, codec = rows["inshrink store"], rows["ZipNN"], rows["the store's codec alone"]
        store = rows.get("inshrink store in use", fresh)  # what every save after a store's first few pays
        written = rows["ZipNN + write"]
        codec1, zipnn1 = rows["the store's codec alone 1"], rows["ZipNN 1"]
        ratio = zipnn[1] / store[1]  # ours over theirs: stored bytes inverted
        save_met = "yes" if store[0] <= zipnn[0] else (
            "no: the save writes one fsynced file per object (chunks, a tree per tensor of over 4 chunks, the root "
            f"tree, snapshot, ref and lease){_disk_note(floats)}; "
            + ("the codec alone is faster than ZipNN" if codec[0] <= zipnn[0] else "and the codec alone is slower than ZipNN"))
        plain, plain1 = rows.get("the store's codec alone numpy"), rows.get("the store's codec alone numpy 1")
        numpy_rows = ""
        if plain is not None and plain1 is not None:
            saved = rows["inshrink store numpy"][0]
            numpy_rows = (f"; without numba (numpy passes) the fresh store's save is {saved:.3f} s, the codec "
                          f"{plain[0] / zipnn[0]:.2f}x ZipNN on all cores and {plain1[0] / zipnn1[0]:.2f}x on one")
        lines.append(f"| lossless {res['dtype']}: ratio >= ZipNN's | {ratio:.3f}x ZipNN's | "
                     f"{'yes' if ratio >= 1 else 'no'} | lossless floats |")
        lines.append(f"| lossless {res['dtype']}: store save <= ZipNN compress (all cores, in memory) | "
                     f"{store[0] / zipnn[0]:.2f}x ({store[0]:.3f} s against {zipnn[0]:.3f} s) in a store in use, "
                     f"{fresh[0] / zipnn[0]:.2f}x in a fresh one; against ZipNN + write (one fsynced file) "
                     f"{store[0] / written[0]:.2f}x; codec alone {codec[0] / zipnn[0]:.2f}x on all cores, "
                     f"{codec1[0] / zipnn1[0]:.2f}x on one{numpy_rows} | {save_met} | lossless floats |")
        lines.append(f"| lossless {res['dtype']}: codec alone <= ZipNN compress (in memory, one thread) | "
                     f"{codec1[0] / zipnn1[0]:.2f}x ({codec1[0]:.3f} s against {zipnn1[0]:.3f} s) | "
                     f"{'yes' if codec1[0] <= zipnn1[0] else 'no'} | lossless floats |")
    return lines


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
    floats = results.get("lossless floats")
    if floats:
        lines += _against_zipnn(floats)
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
            f"delta ({cache:.2f}x, at most 512 MiB) no" if working <= 0.5 else
            f"no: working memory {working:.2f}x (several tensors planned at once on the writer's threads, each "
            f"2.8x its own bytes while planned) plus the object cache of quantized payloads kept for the next "
            f"delta ({cache:.2f}x, at most 512 MiB)")
        low = syn.get("peak_low_x", peak)
        lines.append(f"| peak extra memory of a save: <= 0.5x the model | {peak:.2f}x (worst of 3; best {low:.2f}x) "
                     f"| {met} | quantization |")
    scaling = results.get("scaling")
    if scaling:
        sizes = [r["params"] for r in scaling["rows"]]
        parts, linear = [], True
        for what, cpu in (("save", "save_cpu"), ("restore", "load_cpu")):
            low, high, last = _flat(scaling, cpu)
            parts.append(f"{what} {low:.0f}-{high:.0f} M params per CPU-s, {last:.0f} at the largest")
            rates = sorted(r["params"] / r[cpu] for r in scaling["rows"])
            linear &= last * 1e6 >= 0.75 * rates[len(rates) // 2]  # the largest size keeps pace
        lines.append(f"| cost linear in model size, {sizes[0] / 1e6:.0f} M to {sizes[-1] / 1e6:.0f} M parameters | "
                     f"{'; '.join(parts)} | {'yes' if linear else 'no: the largest size runs slower per parameter (at 300 M a restore fills 1.2 GB of fresh memory; on this VM numpy alone takes about 1.4 s per GB to touch fresh pages)'}"
                     " | scaling |")
    return "\n".join(lines)

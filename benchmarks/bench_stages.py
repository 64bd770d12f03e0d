"""Where the time of a quantized save and of its restore goes, stage by stage.

The 32.5 M-parameter state of ``bench_quantization.py`` (1024x1024 Student-t layers) is
saved with 16 levels (0.5 % protected) into a fresh local store and read back, three times
(the run of each that used the least CPU is shown: the machine is shared). Each stage
is a function of the library wrapped, for this run only, with a timer of the *CPU time of
the calling thread* (``time.thread_time``): stages run on several threads at once (the
writer's pool, zarr's codec threads), where wall-clock sums would count waiting. A stage
that calls another stage includes it; the table says so.

    python -m benchmarks stages      # prints the markdown section
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import inshrink_store as ins  # noqa: E402
from inshrink_store import cas, manifest  # noqa: E402
from inshrink_store.codecs import nuq  # noqa: E402
from inshrink_store.policy import QuantConfig, codebook_choice, kmeans, partition, sketch, snapping  # noqa: E402
from inshrink_store.storage import local  # noqa: E402

N_PARAMS = 32_500_000
REPEAT = 3  # saves and restores; the table shows the one of each that used the least CPU
CONFIG = QuantConfig(bins=16, protect=0.005)

#: (stage, where it lives, owner object, attribute, included in); every place that holds
#: a reference to the function is patched (modules that imported it by name too)
SAVE_STAGES: list[tuple[str, str, list[tuple[Any, str]], str]] = [
    ("plan one tensor (all of planning)", "policy/partition.py `quantize_tensor`",
     [(partition, "quantize_tensor")], ""),
    ("sketch (log-space histogram)", "policy/sketch.py `LogSketch.from_values`",
     [(sketch.LogSketch, "from_values")], "planning"),
    ("k-means (codebook)", "policy/kmeans.py `fit_codebook`",
     [(kmeans, "fit_codebook"), (partition, "fit_codebook"), (codebook_choice, "fit_codebook")], "planning"),
    ("error statistics (partition)", "policy/snapping.py `error_stats`",
     [(snapping, "error_stats"), (partition, "error_stats")], "planning"),
    ("snap values to levels, zero the pruned (partition)", "policy/snapping.py `snap_pruned`",
     [(snapping, "snap_pruned"), (partition, "snap_pruned")], "planning"),
    ("NUQ encode (ids + protected values)", "codecs/nuq.py `Quantizer.encode_array`",
     [(nuq.Quantizer, "encode_array")], ""),
    ("entropy coding (zstd of the payload)", "cas.py `ObjectStore._encode`",
     [(cas.ObjectStore, "_encode")], ""),
    ("hashing (content ids)", "manifest.py `content_id`",
     [(manifest, "content_id"), (cas, "content_id")], ""),
    ("write (fsynced files)", "storage/local.py `LocalStorage._write`",
     [(local.LocalStorage, "_write")], ""),
]
LOAD_STAGES: list[tuple[str, str, list[tuple[Any, str]], str]] = [
    ("read objects", "storage/local.py `LocalStorage.read_range` / `read`",
     [(local.LocalStorage, "read_range"), (local.LocalStorage, "read")], ""),
    ("object decode (zstd, delta chains, checksums)", "cas.py `ObjectStore.get`",
     [(cas.ObjectStore, "get")], "includes read"),
    ("NUQ decode (ids -> values)", "codecs/nuq.py `Quantizer.decode`",
     [(nuq.Quantizer, "decode")], ""),
]


@contextlib.contextmanager
def timed(stages: list[tuple[str, str, list[tuple[Any, str]], str]]) -> Iterator[Counter[str]]:
    """Wrap each stage's function with a thread-CPU timer for the duration of the block
    (``bench_save_cost --stages`` times the Checkpointer's stages with it too)."""
    spent: Counter[str] = Counter()
    lock = threading.Lock()
    active = threading.local()
    saved = []

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(active, name, 0)
            setattr(active, name, depth + 1)
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(active, name, depth)
                if depth == 0:  # recursion (k-means restarts, delta chains) counted once
                    with lock:
                        spent[name] += time.thread_time() - start
        return wrapped

    for name, _where, places, _note in stages:
        for owner, attr in places:
            original = owner.__dict__[attr]
            saved.append((owner, attr, original))
            if isinstance(original, classmethod):
                setattr(owner, attr, classmethod(wrap(name, original.__func__)))
            else:
                setattr(owner, attr, wrap(name, original))
    try:
        yield spent
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


def run(quick: bool = False) -> dict[str, Any]:
    from benchmarks.bench_quantization import make_weights

    n = N_PARAMS // 8 if quick else N_PARAMS
    weights = make_weights(n)
    with tempfile.TemporaryDirectory() as tmp:
        repo = ins.open(os.path.join(tmp, "warmup"), create=True)  # imports, caches, JIT-free warm up
        repo.save(make_weights(1_000_000, seed=1), quantize=CONFIG)
        saves, loads = [], []
        for attempt in range(REPEAT):  # the run with the least CPU of each: the machine is shared
            store = os.path.join(tmp, f"store-{attempt}")
            repo = ins.open(store, create=True)
            with timed(SAVE_STAGES) as save_spent:
                wall, cpu = time.perf_counter(), time.process_time()
                repo.save(weights, quantize=CONFIG, message="bench")
                saves.append(((time.perf_counter() - wall, time.process_time() - cpu), dict(save_spent)))
            ins.index.CACHE.clear()
            fresh = ins.open(store)
            with timed(LOAD_STAGES) as load_spent:
                wall, cpu = time.perf_counter(), time.process_time()
                loaded = fresh.load()
                loads.append(((time.perf_counter() - wall, time.process_time() - cpu), dict(load_spent)))
            assert sorted(loaded) == sorted(weights)
        save, save_spent = min(saves, key=lambda run: run[0][1])
        load, load_spent = min(loads, key=lambda run: run[0][1])
    return {"n": n, "cores": os.cpu_count(), "save": save, "load": load,
            "save_spent": dict(save_spent), "load_spent": dict(load_spent)}


def to_markdown(r: dict[str, Any]) -> str:
    n = r["n"]

    def table(title: str, stages: list[tuple[str, str, list[tuple[Any, str]], str]],
              spent: dict[str, float], total: tuple[float, float]) -> list[str]:
        wall, cpu = total
        lines = [f"**{title}**: {wall:.2f} s wall, {cpu:.2f} s CPU on {r['cores']} cores "
                 f"({n / 1e6 / wall:.1f} M params/s wall, {n / 1e6 / cpu:.1f} M params/s per CPU-second).", "",
                 "| stage | where | CPU s | share of CPU | M params per CPU-s |", "|---|---|---|---|---|"]
        for name, where, _places, note in stages:
            s = spent.get(name, 0.0)
            label = f"{name} (part of {note})" if note and note != "includes read" else name
            if note == "includes read":
                label = f"{name} (includes reading)"
            lines.append(f"| {label} | {where} | {s:.3f} | {s / cpu:.0%} | {n / 1e6 / s if s else float('inf'):.0f} |")
        top = sum(spent.get(name, 0.0) for name, _w, _p, note in stages if not note)
        lines.append(f"| everything else (zarr, metadata, threads, copies) | | {max(cpu - top, 0):.3f} | "
                     f"{max(cpu - top, 0) / cpu:.0%} | |")
        return lines

    out = [f"{n / 1e6:.1f} M float32 parameters, 16 levels, 0.5 % protected, saved into a fresh local "
           f"store and loaded back by a fresh handle, {REPEAT} times; shown is the save and the load "
           "that used the least CPU (the machine is shared). CPU seconds per stage are summed over every "
           "thread (`time.thread_time` around the library function named); a stage inside "
           "another is marked, the others add up to the total.", ""]
    out += table("Quantized save", SAVE_STAGES, r["save_spent"], r["save"])
    out += [""]
    out += table("Restore (load every tensor)", LOAD_STAGES, r["load_spent"], r["load"])
    save_rate, load_rate = n / 1e6 / r["save"][1], n / 1e6 / r["load"][1]
    out += ["", "Against the throughput targets (per CPU-second, i.e. per core):", "",
            "| target | measured | met |", "|---|---|---|",
            f"| quantized save, whole path, >= 50 M params/s per core | {save_rate:.1f} | "
            f"{'yes' if save_rate >= 50 else 'no: planning and the per-tensor machinery around the codec (above)'} |",
            f"| restore >= 150 M params/s per core | {load_rate:.1f} | "
            f"{'yes' if load_rate >= 150 else 'no: NUQ decode and zarr around it (above)'} |"]
    return "\n".join(out)


def main() -> None:
    print(to_markdown(run(quick="--quick" in sys.argv)))


if __name__ == "__main__":
    main()

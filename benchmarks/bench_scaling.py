"""Does the cost of a save and a restore grow linearly with the model? 1 M to 300 M parameters.

The state of ``bench_quantization.py`` (1024x1024 Student-t layers and their biases) at
sizes from 1 M to 300 M float32 parameters, each saved with 16 levels (0.5 % protected) into a
fresh local store and loaded back by a fresh handle, twice (the save and the load that used
the least CPU are kept: the machine is shared). Reported per size: wall and CPU seconds, and
parameters per CPU-second; linear cost means a flat last column. A plot goes to
``docs/img/scaling.png`` when matplotlib is installed.

    python -m benchmarks scaling [--quick]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import inshrink_store as ins  # noqa: E402
from inshrink_store.policy import QuantConfig  # noqa: E402

SIZES = (1_000_000, 3_000_000, 10_000_000, 30_000_000, 100_000_000, 300_000_000)
QUICK_SIZES = (1_000_000, 3_000_000, 10_000_000)
CONFIG = QuantConfig(bins=16, protect=0.005)
REPEAT = 2  # per size; the least CPU of each of save and load is kept
PLOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "scaling.png"


def _measure(n: int, workdir: str) -> dict[str, float]:
    from benchmarks.bench_quantization import make_weights

    weights = make_weights(n)
    params = sum(a.size for a in weights.values())
    path = os.path.join(workdir, f"store-{n}-{time.monotonic_ns()}")
    repo = ins.open(path, create=True)
    wall, cpu = time.perf_counter(), time.process_time()
    repo.save(weights, quantize=CONFIG, message="scaling")
    save_wall, save_cpu = time.perf_counter() - wall, time.process_time() - cpu
    del weights
    ins.index.CACHE.clear()
    fresh = ins.open(path)
    wall, cpu = time.perf_counter(), time.process_time()
    loaded = fresh.load()
    load_wall, load_cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert sum(a.size for a in loaded.values()) == params
    return {"params": params, "save_wall": save_wall, "save_cpu": save_cpu,
            "load_wall": load_wall, "load_cpu": load_cpu}


def run(quick: bool = False) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        _measure(1_000_000, tmp)  # warm up: imports, thread pools, tables
        for n in QUICK_SIZES if quick else SIZES:
            tries = [_measure(n, tmp) for _ in range(REPEAT)]
            save = min(tries, key=lambda r: r["save_cpu"])
            load = min(tries, key=lambda r: r["load_cpu"])
            rows.append({**save, "load_wall": load["load_wall"], "load_cpu": load["load_cpu"]})
    return {"rows": rows, "plot": _plot(rows)}


def _plot(rows: list[dict[str, float]]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    params = [r["params"] / 1e6 for r in rows]
    for key, label in (("save_wall", "quantized save (wall)"), ("save_cpu", "quantized save (CPU)"),
                       ("load_wall", "restore (wall)")):
        ax.loglog(params, [r[key] for r in rows], marker="o", label=label)
    # through the largest size: small sizes carry a fixed cost (imports aside: threads, metadata)
    ax.loglog(params, [rows[-1]["save_cpu"] * p / params[-1] for p in params], "k:", label="linear")
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel("seconds")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=100)
    plt.close(fig)
    return True


def to_markdown(result: dict[str, Any]) -> str:
    lines = [
        "The 16-level save (0.5 % protected) of `bench_quantization.py`'s state at each size, into a "
        "fresh local store, then a load of every tensor by a fresh handle. Linear cost means a flat "
        "'per CPU-s' column.", "",
        "| parameters | save s (wall) | save CPU s | save M params per CPU-s | restore s (wall) | "
        "restore M params per CPU-s |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        m = r["params"] / 1e6
        lines.append(f"| {m:.1f} M | {r['save_wall']:.2f} | {r['save_cpu']:.2f} | {m / r['save_cpu']:.1f} | "
                     f"{r['load_wall']:.2f} | {m / r['load_cpu']:.0f} |")
    if result["plot"]:
        lines += ["", "![save and restore time against model size](img/scaling.png)"]
    return "\n".join(lines)


def main() -> None:
    print(to_markdown(run(quick="--quick" in sys.argv)))


if __name__ == "__main__":
    main()

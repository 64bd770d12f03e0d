"""The CLI's whole-store reads on a lossless store (issue 43, item 10): ``verify``,
``export --all`` and ``diff --values``, in MB/s of logical bytes over wall time and over the
process's CPU time (per core). The store: six versions of a ~250 MiB float32 state (a
30,522 x 384 embedding, 96 matrices and their first moments) changing slightly per version,
so most objects are lossless deltas in chains of up to five links.

    python -m benchmarks.bench_cli_reads [STORE_DIR]   (built there if missing)
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import inshrink_store as ins


def build(url: str, versions: int = 6) -> None:
    rng = np.random.default_rng(0)
    shapes = [(30522, 384)] + [(384, 384)] * 48 + [(1536, 384)] * 24 + [(384, 1536)] * 24 + [(384,)] * 100
    state = {f"model/t{i:03d}": rng.standard_normal(s, dtype=np.float32) * 0.02 for i, s in enumerate(shapes)}
    for key in [k for k, a in state.items() if a.ndim == 2 and 1536 not in a.shape]:
        state[key.replace("model/", "optimizer/state/") + "/exp_avg"] = state[key] * 0.01
    repo = ins.open(url, create=True)
    for v in range(versions):
        repo.save(state, message=f"v{v}", step=v)
        state = {k: a + rng.standard_normal(a.shape, dtype=np.float32) * 1e-4 for k, a in state.items()}


def measure(url: str) -> list[tuple[str, float, float, float]]:
    """(command, MiB read, wall s, cpu s) of each command, on a fresh handle."""
    from inshrink_store.torch.tensors import export_torch

    repo = ins.open(url)
    logical = sum(i.logical_bytes for i in repo.checkout("main").arrays().values())
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            "verify": lambda: repo.verify().snapshots * logical,
            "export --all": lambda: export_torch(ins.open(url).checkout("main"), f"{tmp}/x.pt", include_all=True) and logical,
            "diff --values": lambda: (ins.open(url).diff("main~1", "main", values=True), 2 * logical)[1],
        }
        for name, run in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            read = run()
            out.append((name, read / 2**20, time.perf_counter() - wall, time.process_time() - cpu))
    return out


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.gettempdir()) / "inshrink-bench-cli-reads"
    if not (folder / "inshrink.json").exists():
        build(str(folder))
    for name, mib, wall, cpu in measure(str(folder)):
        mb = mib * 2**20 / 1e6
        print(f"{name:14s} {mib:6.0f} MiB  wall {wall:5.2f} s ({mb / wall:4.0f} MB/s)  "
              f"cpu {cpu:5.2f} s ({mb / cpu:4.0f} MB/s per core)")


if __name__ == "__main__":
    main()

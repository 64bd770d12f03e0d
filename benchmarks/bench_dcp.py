"""torch.distributed.checkpoint: save and load times with 1, 2 and 4 ranks, inshrink against DCP's own.

The same sharded state (DTensors, ``Shard(0)`` over the ranks: model weights and an Adam-like
moment per layer, seeded, weight-like values) is saved twice and loaded once by each storage:

- ``InshrinkStorageWriter`` on moto's S3 server (127.0.0.1), lossless and quantized (16 levels);
- DCP's ``FsspecWriter`` on the same S3 server (torch.save files, one per rank);
- DCP's ``FileSystemWriter`` on the local disk.

Each storage first saves once, untimed, somewhere else (first-call costs of each library).
The second timed save holds the same state, as a run whose frozen tensors do not change would:
DCP's writers store it again, the store adds nothing but documents. Times are wall-clock
seconds of rank 0 (DCP ends each call with a collective, so every rank is done by then);
the loads reshard nothing (same layout) and are checked against what was saved. gloo
process groups of spawned processes; on a machine with fewer cores than ranks the ranks
share them. Needs torch, s3fs and ``moto[server]``. Run alone:
``python -m benchmarks dcp [--quick] [--mib N]``; prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from benchmarks.bench_requests import s3_server

WIDTH = 512
WORLDS = (1, 2, 4)
STORAGES = ("inshrink S3 lossless", "inshrink S3 quantized 16", "DCP FsspecWriter S3", "DCP FileSystemWriter disk")


def make_tensors(mib: int) -> dict[str, Any]:
    """Weight-like float32 tensors totalling about ``mib`` MiB: per layer a weight and a moment."""
    import torch

    g = torch.Generator().manual_seed(0)
    layers = max(1, mib * (1 << 20) // (2 * 4 * WIDTH * WIDTH))
    tensors = {}
    for i in range(layers):
        tensors[f"model.layer{i}.weight"] = torch.randn(WIDTH, WIDTH, generator=g) * 0.02
        tensors[f"optim.layer{i}.exp_avg"] = torch.randn(WIDTH, WIDTH, generator=g) * 1e-4
    return tensors


def _state(mesh: Any, tensors: dict[str, Any], blank: bool = False) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    state: dict[str, Any] = {"model": {}, "optim": {}, "step": 100}
    for fqn, t in tensors.items():
        top, rest = fqn.split(".", 1)
        state[top][rest] = distribute_tensor(torch.zeros_like(t) if blank else t, mesh, [Shard(0)])
    return state


def _storage(kind: str, url: str, disk: str, run: int, options: dict[str, Any]) -> tuple[Any, Any]:
    """(writer, reader) of one storage for save number ``run`` (DCP's writers: a folder each;
    run 0, the untimed warm-up, goes to a place of its own everywhere)."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from inshrink_store.policy import QuantConfig
    from inshrink_store.torch import InshrinkStorageReader, InshrinkStorageWriter

    if kind.startswith("inshrink"):
        quantize = QuantConfig(bins=16) if "quantized" in kind else None
        store = f"{url}/{'q' if quantize else 'lossless'}{'-warm-up' if run == 0 else ''}"
        return (InshrinkStorageWriter(store, quantize=quantize, storage_options=options, step=run),
                InshrinkStorageReader(store, storage_options=options))
    if kind.startswith("DCP Fsspec"):
        path = f"{url}/{'warm-up' if run == 0 else 'fsspec'}/ckpt-{run}"
        return FsspecWriter(path, **options), FsspecReader(path, **options)
    path = os.path.join(disk, f"ckpt-{run}") if run else os.path.join(os.path.dirname(disk), "warm-up")
    return FileSystemWriter(path), FileSystemReader(path)


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _worker(rank: int, world: int, port: int, mib: int, url: str, disk: str, options: dict[str, Any],
            out: str) -> None:
    import fsspec
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        tensors = make_tensors(mib)
        fsspec.filesystem("s3", **options).ls(url.split("/")[2])  # s3fs imported, its client made: untimed
        rows = {}
        for kind in STORAGES:
            state = _state(mesh, tensors)
            writer, _ = _storage(kind, url, disk, 0, options)
            dcp.save(state, storage_writer=writer)  # warm-up: first-call costs of each library, untimed
            saves = []
            for run in (1, 2):
                writer, reader = _storage(kind, url, disk, run, options)
                saves.append(_timed(lambda w=writer, s=state: dcp.save(s, storage_writer=w)))
            target = _state(mesh, tensors, blank=True)
            load = _timed(lambda r=reader, t=target: dcp.load(t, storage_reader=r))
            if "quantized" not in kind:
                for fqn, t in tensors.items():
                    top, rest = fqn.split(".", 1)
                    assert torch.equal(target[top][rest].to_local(), torch.chunk(t, world)[rank]), (kind, fqn)
            rows[kind] = {"save": saves[0], "save_again": saves[1], "load": load}
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stored_mib(kind: str, url: str, disk: str) -> float:
    import fsspec

    if kind.startswith("DCP FileSystem"):
        return sum(f.stat().st_size for f in Path(disk).rglob("*") if f.is_file()) / (1 << 20)
    fs, root = fsspec.core.url_to_fs(url)
    sub = "fsspec" if kind.startswith("DCP Fsspec") else ("q" if "quantized" in kind else "lossless")
    return float(fs.du(f"{root}/{sub}", total=True)) / (1 << 20)


def run(mib: int = 32, worlds: tuple[int, ...] = WORLDS) -> list[dict[str, Any]]:
    """Rows of (ranks, storage, save, save again, load seconds, stored MiB after both saves)."""
    import fsspec
    import torch.multiprocessing as mp

    results = []
    with s3_server() as bucket:
        conf = fsspec.config.conf["s3"]
        options = {"client_kwargs": conf["client_kwargs"], "key": conf["key"], "secret": conf["secret"],
                   "token": conf["token"]}
        for world in worlds:
            url = f"{bucket}/{uuid.uuid4().hex[:8]}-{world}"
            with tempfile.TemporaryDirectory() as scratch:
                disk, out = os.path.join(scratch, "disk"), os.path.join(scratch, "rows.json")
                mp.spawn(_worker, args=(world, _free_port(), mib, url, disk, options, out), nprocs=world, join=True)
                rows = json.loads(Path(out).read_text())
                for kind in STORAGES:
                    results.append({"ranks": world, "storage": kind, **rows[kind],
                                    "stored_mib": _stored_mib(kind, url, disk)})
    return results


def table(rows: list[dict[str, Any]], mib: int) -> str:
    lines = [f"State: {mib} MiB of float32 (model weights and Adam-like moments, 512x512 tensors), "
             "saved twice, then loaded.", "",
             "| ranks | storage | save (s) | save again, same state (s) | load (s) | stored after both saves (MiB) |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['ranks']} | {r['storage']} | {r['save']:.2f} | {r['save_again']:.2f} | "
                     f"{r['load']:.2f} | {r['stored_mib']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 MiB of state instead of --mib")
    parser.add_argument("--mib", type=int, default=32, help="MiB of state (default 32)")
    args = parser.parse_args()
    mib = 8 if args.quick else args.mib
    print(table(run(mib), mib))


if __name__ == "__main__":
    main()

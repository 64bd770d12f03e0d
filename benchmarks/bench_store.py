"""Lossless store vs torch.save vs safetensors on the same ~100 MB state dict.

Measures save and load wall time and stored bytes side by side, and the bytes a second
save of the same state adds (dedup); then what a state of thousands of small tensors costs
per tensor (every tensor is at least one object: a fixed cost that a single file does not
pay). Run through ``python -m benchmarks run``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import inshrink_store as ins
from benchmarks.machine_info import dir_bytes, timed
from inshrink_store.torch import load_state, save_state


def make_state(target_mb: int = 100) -> dict[str, torch.Tensor]:
    """A transformer-shaped float32 state dict of about ``target_mb`` MB (seeded)."""
    torch.manual_seed(0)
    d, layers = 1024, 0
    state: dict[str, torch.Tensor] = {"embed.weight": torch.randn(8192, d) * 0.02}
    while sum(t.numel() * 4 for t in state.values()) < target_mb * 1e6:
        p = f"layers.{layers}."
        state[p + "attn.qkv.weight"] = torch.randn(3 * d, d) * 0.02
        state[p + "attn.out.weight"] = torch.randn(d, d) * 0.02
        state[p + "mlp.up.weight"] = torch.randn(2 * d, d) * 0.02
        state[p + "norm.weight"] = torch.ones(d)
        state[p + "mlp.up.bias"] = torch.zeros(2 * d)
        layers += 1
    return state


def _fsynced(write, path: Path):  # type: ignore[no-untyped-def]
    """Write one fresh file and make it durable, as the store's save does."""
    def run() -> None:
        write(path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    return run


REPEAT = 3  # best of, each run into fresh files (the machine is shared)


def run(target_mb: int = 100) -> dict[str, object]:
    state = make_state(target_mb)
    logical = sum(t.numel() * t.element_size() for t in state.values())
    work = Path(tempfile.mkdtemp(prefix="inshrink-bench-"))
    rows = []
    try:
        for name, suffix, save, load in (("torch.save", "pt", lambda p: torch.save(state, p),
                                          lambda p: torch.load(p, weights_only=True)),
                                         ("safetensors", "safetensors", lambda p: save_file(state, p), load_file)):
            saves, loads = [], []
            for i in range(REPEAT):
                path = work / f"state-{i}.{suffix}"
                saves.append(timed(_fsynced(save, path))[0])
                loads.append(timed(lambda path=path, load=load: load(path))[0])
            rows.append((name, min(saves), min(loads), path.stat().st_size))

        saves, loads = [], []
        for i in range(REPEAT):
            repo = ins.open(str(work / f"store-{i}"), create=True)
            saves.append(timed(lambda repo=repo: save_state(repo, {"model": state}, step=1))[0])
            first = dir_bytes(work / f"store-{i}")
            ins.index.CACHE.clear()
            fresh = ins.open(str(work / f"store-{i}"))
            t_load, loaded = timed(lambda fresh=fresh: load_state(fresh, "main"))
            loads.append(t_load)
        assert all(torch.equal(loaded["model"][k], v) for k, v in state.items())
        rows.append(("inshrink (lossless)", min(saves), min(loads), first))
        t_save2, _ = timed(lambda: save_state(repo, {"model": state}, step=2))
        second = dir_bytes(work / f"store-{REPEAT - 1}") - first
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"logical": logical, "rows": rows, "second_save_bytes": second, "second_save_s": t_save2,
            "cores": os.cpu_count(), "many": many_tensors(200 if target_mb < 100 else 2000)}


def many_tensors(count: int = 2000) -> dict[str, float]:
    """Save (into a new store, then a second version of changed values) and load of ``count``
    small float32 tensors (two of three of 64 values, one of 1,024: norms, biases, step
    counters of a large model), against torch.save of the same dict to one fsynced file."""
    gen = torch.Generator().manual_seed(0)
    state = {f"layers.{i // 10}.t{i % 10}": torch.randn(64 if i % 3 else 1024, generator=gen)
             for i in range(count)}
    changed = {k: v + 1 for k, v in state.items()}
    work = Path(tempfile.mkdtemp(prefix="inshrink-many-"))
    try:
        t_torch = min(timed(_fsynced(lambda p: torch.save(state, p), work / f"many-{i}.pt"))[0]
                      for i in range(REPEAT))
        repo = ins.open(str(work / "store"), create=True)
        t_first, _ = timed(lambda: save_state(repo, {"model": state}, step=1))
        t_second, _ = timed(lambda: save_state(repo, {"model": changed}, step=2))
        ins.index.CACHE.clear()
        fresh = ins.open(str(work / "store"))
        t_load, loaded = timed(lambda: load_state(fresh, "main"))
        assert all(torch.equal(loaded["model"][k], v) for k, v in changed.items())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"count": count, "torch": t_torch, "first": t_first, "second": t_second, "load": t_load}


def markdown(result: dict[str, object]) -> str:
    logical = result["logical"]
    lines = [
        f"State dict: {logical / 1e6:.1f} MB float32 (transformer-shaped, random init, seeded). "
        f"Best of {REPEAT}, each save into fresh files made durable (fsync), as the store's save is; "
        "the store's load is a fresh handle's.",
        "",
        "| format | save s | load s | stored MB | ratio vs logical |",
        "|---|---|---|---|---|",
    ]
    for name, ts, tl, size in result["rows"]:  # type: ignore[union-attr]
        lines.append(f"| {name} | {ts:.2f} | {tl:.2f} | {size / 1e6:.1f} | {logical / size:.3f}x |")
    lines += ["", f"Second save of the same state: {result['second_save_bytes']} bytes added "
              f"(trees, snapshot and ref only), {result['second_save_s']:.2f} s."]
    many = result.get("many")
    if isinstance(many, dict):
        n = many["count"]
        lines += ["", f"**{n:,} small tensors** (float32, 64 or 1,024 values each): torch.save to one "
                  f"fsynced file {many['torch']:.3f} s; the store's first save {many['first']:.2f} s "
                  f"({many['first'] / n * 1e3:.2f} ms per tensor), a second version of changed values "
                  f"{many['second']:.2f} s ({many['second'] / n * 1e3:.2f} ms per tensor), load "
                  f"{many['load']:.2f} s. Each tensor is at least one chunk object, a fsynced "
                  "file (its node lives in the root tree): on a model whose tensors are few and large "
                  "this is noise, on thousands of tiny ones it is most of the save."]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(run()))

"""What one checkpoint of a training state costs, side by side: a plain copy, ``torch.save``, the Checkpointer.

Issue 42's table: an MLP of 33.6 M parameters (2048 -> 4096 -> 4096 -> 2048, fp32, seeded) with
AdamW's state (403 MB), trained a few seeded steps between rounds. Each round, interleaved so a
busy machine weighs on every row alike:

- **plain copy**: every tensor of the model's and optimizer's state dicts cloned (the floor of
  what a save that lets the loop go on must block for);
- **torch.save + fsync**: both state dicts into one file, flushed to disk;
- **Checkpointer lossless**: a ``Checkpointer(lossless=True)`` that saves every round (its
  later saves; the store adopts unchanged tensors);
- **compressed, first save**: a fresh ``Checkpointer`` (no ``eval_fn``: the base configuration
  for the weights, Adam's moments compressed and guarded) into a fresh store;
- **compressed, later saves**: one ``Checkpointer`` that saves every round (closed-loop
  residuals against its previous version).

For the Checkpointer rows, *blocked* is how long ``save`` held the loop and *background* the
time from ``save`` until ``wait`` returned (the version committed). Medians over the rounds
(the later-save rows leave out their first round, which is a first save).
Targets (issue 42): compressed first save <= 10x torch.save+fsync, later saves <= 3x, lossless
<= 1.5x; blocked <= 2x a plain copy + 50 ms.

    python -m benchmarks save_cost                       # 3 rounds (several minutes on 2 cores)
    python -m benchmarks save_cost --out benchmarks/recorded/save_cost.md
    python -m benchmarks save_cost --quick               # a tiny MLP, to check the harness
    python -m benchmarks save_cost --stages              # and where a first and a later save spend CPU

``--stages`` adds one more first save and later save of the same state, each library stage
wrapped in a timer of its thread's CPU (``bench_stages.timed``): where the compressed rows'
time goes, the profile behind a missed target.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks import machine_info

FULL = (2048, 4096, 4096, 2048)
QUICK = (64, 256, 256, 64)
ROWS = ("plain copy", "torch.save + fsync", "Checkpointer lossless", "compressed, first save",
        "compressed, later saves")
#: (row, most seconds as a multiple of torch.save + fsync)
TARGETS = {"Checkpointer lossless": 1.5, "compressed, first save": 10.0, "compressed, later saves": 3.0}


def _model(widths: tuple[int, ...]) -> tuple[Any, Any, Any]:
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(64, widths[0], generator=generator), torch.randn(64, widths[-1], generator=generator))
    return model, opt, batch


def _train(model: Any, opt: Any, batch: tuple[Any, Any], steps: int, cks: list[Any]) -> None:
    import torch

    x, y = batch
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        for ck in cks:
            ck.observe_gradients()


def _copy_s(model: Any, opt: Any) -> float:
    import torch

    start = time.perf_counter()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    copied = {"model": {k: v.detach().clone() for k, v in state["model"].items()},
              "optimizer": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                            for i, s in state["optimizer"]["state"].items()}}
    seconds = time.perf_counter() - start
    del copied
    return seconds


def _torch_save_s(model: Any, opt: Any, folder: str) -> float:
    import torch

    path = os.path.join(folder, "state.pt")
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.remove(path)
    return seconds


def _checkpoint(ck: Any, step: int) -> tuple[float, float]:
    """(blocked, background) seconds of one save."""
    start = time.perf_counter()
    ck.save(step)
    blocked = time.perf_counter() - start
    ck.wait()
    return blocked, time.perf_counter() - start


def checkpointer_stages() -> list[tuple[str, str, list[tuple[Any, str]], str]]:
    """The Checkpointer's stages, in ``bench_stages.timed``'s form: (stage, where, patched
    places, the stage it is part of). Imported late: the library loads with the benchmark."""
    from inshrink_store import cas, manifest, residual
    from inshrink_store.codecs import bytegroup, nuq, vdelta
    from inshrink_store.policy import moments, partition
    from inshrink_store.storage import local

    return [
        ("Adam moments: quantize, guard", "policy/moments.py `plan_moments`", [(moments, "plan_moments")], ""),
        ("weights: sketches", "policy/partition.py `PartitionCache.sketch`",
         [(partition.PartitionCache, "sketch")], ""),
        ("weights: plan (codebook, snap, errors)", "policy/partition.py `quantize_tensor`",
         [(partition, "quantize_tensor")], ""),
        ("NUQ encode (ids + protected values)", "codecs/nuq.py `Quantizer.encode_array`",
         [(nuq.Quantizer, "encode_array")], ""),
        ("delta against the parent's ids", "codecs/vdelta.py `VDelta.encode`", [(vdelta.VDelta, "encode")], ""),
        ("restore residual (exact resume)", "residual.py `ResidualWriter.add`",
         [(residual.ResidualWriter, "add")], ""),
        ("lossless byte planes + zstd", "codecs/bytegroup.py `ByteGroup.encode`",
         [(bytegroup.ByteGroup, "encode")], ""),
        ("entropy coding (zstd of payloads)", "cas.py `ObjectStore._encode`", [(cas.ObjectStore, "_encode")], ""),
        ("hashing (content ids)", "manifest.py `content_id`", [(manifest, "content_id"), (cas, "content_id")], ""),
        ("write (fsynced files)", "storage/local.py `LocalStorage._write`", [(local.LocalStorage, "_write")], ""),
    ]


def stage_profile(model: Any, opt: Any, batch: tuple[Any, Any], folder: str, steps: int = 5) -> dict[str, Any]:
    """CPU per stage of a first save and a later save by one compressed Checkpointer, with
    the process's CPU over each (from ``save`` until ``wait`` returns)."""
    import inshrink_store as ins
    from benchmarks.bench_stages import timed
    from inshrink_store.torch import Checkpointer

    stages = checkpointer_stages()
    out: dict[str, Any] = {"stages": [(name, where) for name, where, _p, _n in stages]}
    with Checkpointer(ins.open(os.path.join(folder, "stages"), create=True), model, opt) as ck:
        for label in ("first", "later"):
            _train(model, opt, batch, steps, [ck])
            with timed(stages) as spent:
                cpu, wall = time.process_time(), time.perf_counter()
                ck.save(len(out))
                ck.wait()
                out[label] = {"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall,
                              "spent": dict(spent)}
    return out


def stages_markdown(profile: dict[str, Any]) -> str:
    """The stage table: each stage's CPU seconds and share, first save and later save."""
    first, later = profile["first"], profile["later"]
    lines = ["", "Where the compressed saves spend CPU (`--stages`: one more first and later save of the same "
             "state, each library stage timed by its thread's CPU; a stage nested in another is counted "
             "in both, so shares may add up past 100 %):", "",
             "| stage | where | first save CPU s | share | later save CPU s | share |", "|---|---|---|---|---|---|"]
    for name, where in profile["stages"]:
        a, b = first["spent"].get(name, 0.0), later["spent"].get(name, 0.0)
        lines.append(f"| {name} | {where} | {a:.2f} | {a / first['cpu']:.0%} | {b:.2f} | {b / later['cpu']:.0%} |")
    lines.append(f"| the whole save (process CPU, every thread) | | {first['cpu']:.2f} | 100% | "
                 f"{later['cpu']:.2f} | 100% |")
    lines.append(f"| wall clock | | {first['wall']:.2f} | | {later['wall']:.2f} | |")
    return "\n".join(lines) + "\n"


def run(quick: bool = False, rounds: int | None = None, steps: int = 5, stages: bool = False) -> dict[str, Any]:
    import torch

    import inshrink_store as ins
    from inshrink_store.torch import Checkpointer

    torch.set_num_threads(os.cpu_count() or 1)
    rounds = rounds or (2 if quick else 3)
    model, opt, batch = _model(QUICK if quick else FULL)
    params = sum(p.numel() for p in model.parameters())
    seconds: dict[str, list[float]] = {row: [] for row in ROWS}
    blocked: dict[str, list[float]] = {row: [] for row in ROWS[2:]}
    load = machine_info.load_average()
    with tempfile.TemporaryDirectory(prefix="inshrink-save-cost-", dir=os.environ.get("INSHRINK_BENCH_DIR")) as tmp, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no eval_fn: the Checkpointer says so once per instance
        lossless = Checkpointer(ins.open(os.path.join(tmp, "lossless"), create=True), model, opt, lossless=True)
        later = Checkpointer(ins.open(os.path.join(tmp, "later"), create=True), model, opt)
        _train(model, opt, batch, steps, [later])
        for r in range(rounds):
            seconds["plain copy"].append(_copy_s(model, opt))
            seconds["torch.save + fsync"].append(_torch_save_s(model, opt, tmp))
            for row, ck in (("Checkpointer lossless", lossless), ("compressed, later saves", later)):
                b, s = _checkpoint(ck, r)
                if r > 0 or rounds == 1:  # the first round of a continuing Checkpointer is a first save
                    seconds[row].append(s)
                    blocked[row].append(b)
            with Checkpointer(ins.open(os.path.join(tmp, f"first-{r}"), create=True), model, opt) as first:
                b, s = _checkpoint(first, r)
            seconds["compressed, first save"].append(s)
            blocked["compressed, first save"].append(b)
            _train(model, opt, batch, steps, [later])
        lossless.close()
        later.close()
        stored = ins.open(os.path.join(tmp, "later")).du()[0]
        ratio = stored.logical_bytes / max(1, stored.new_stored_bytes - stored.residual_bytes)
        profile = stage_profile(model, opt, batch, tmp, steps) if stages else None
    load = max(load, machine_info.load_average())
    return {"quick": quick, "rounds": rounds, "params": params, "state_bytes": 3 * 4 * params, "load": load,
            "seconds": seconds, "blocked": blocked, "later_ratio": ratio, "machine": machine_info.describe(),
            "stages": profile}


def summary(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per row: median seconds, its multiple of torch.save + fsync, median blocked seconds."""
    base = statistics.median(result["seconds"]["torch.save + fsync"])
    out = {}
    for row in ROWS:
        s = statistics.median(result["seconds"][row])
        entry = {"seconds": s, "ratio": s / base}
        if row in result["blocked"]:
            entry["blocked"] = statistics.median(result["blocked"][row])
        out[row] = entry
    return out


def to_markdown(result: dict[str, Any]) -> str:
    rows = summary(result)
    command = "python -m benchmarks save_cost" + (" --quick" if result["quick"] else "") \
        + (" --stages" if result.get("stages") else "")
    copy_s = rows["plain copy"]["seconds"]
    limit = 2 * copy_s + 0.05
    lines = [
        "## What one checkpoint costs: a plain copy, torch.save, the Checkpointer", "",
        f"`{command}` (issue 42): an MLP of {result['params'] / 1e6:.1f} M parameters with AdamW's state "
        f"({result['state_bytes'] / 1e6:.0f} MB), a few training steps between rounds, {result['rounds']} "
        "interleaved rounds, medians (the later-save rows leave out their first round). Checkpointer rows: "
        "background is `save` until `wait` returns, blocked is `save` alone. "
        f"{result['machine']}; load {result['load']:.1f} on {os.cpu_count()} cores (other jobs shared them).", "",
        "| | seconds | x torch.save+fsync | blocked s | target |",
        "|---|---|---|---|---|",
    ]
    for row in ROWS:
        r = rows[row]
        target = ""
        if row in TARGETS:
            target = f"<= {TARGETS[row]:g}x: **{'met' if r['ratio'] <= TARGETS[row] else 'missed'}**"
        blocked = f"{r['blocked']:.2f}" if "blocked" in r else ""
        if "blocked" in r:
            target += ("; " if target else "") + f"blocked <= {limit:.2f} s: " \
                      f"**{'met' if r['blocked'] <= limit else 'missed'}**"
        lines.append(f"| {row} | {r['seconds']:.2f} | {r['ratio']:.1f}x | {blocked} | {target} |")
    lines += ["", f"The later saves' version stores the state {result['later_ratio']:.1f}x smaller than its "
              "logical bytes (weights and moments; restore residual left out)."]
    text = "\n".join(lines) + "\n"
    if result.get("stages"):
        text += stages_markdown(result["stages"])
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny MLP and 2 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; 2 with --quick)")
    parser.add_argument("--out", type=Path, default=None, help="also write the section to this file")
    parser.add_argument("--stages", action="store_true",
                        help="also profile one first and one later compressed save stage by stage")
    args = parser.parse_args(argv)
    text = to_markdown(run(args.quick, args.rounds, stages=args.stages))
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

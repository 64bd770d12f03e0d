"""Checkpointing a GPU training run, side by side: what each way of saving costs the loop.

Why: the number a GPU user feels is how long a save holds the training loop, and then
whether the checkpoint is committed before the next one is due and restores exactly. One
process trains a GPT-2-style model (transformers' ``GPT2LMHeadModel``, AdamW, bf16 autocast
on a GPU) for ``--steps`` steps, saving every ``--every``, once per way of saving:

- ``none``: no checkpoints (the loop's own time);
- ``torch.save+fsync``: one file per save, flushed to disk;
- ``DCP``: ``torch.distributed.checkpoint.save`` with its ``FileSystemWriter``;
- ``DCP async_save``: the same, returning a future (DCP's own staging to the host);
- ``inshrink lossless``: ``Checkpointer(lossless=True)``;
- ``inshrink compressed``: ``Checkpointer(eval_fn=held-out loss)`` (the method: a search per save).

For each: the loop's wall time, the time saves held the loop's thread (per save, mean and
worst; the GPU is synchronised before each save so only the save's own time counts), the
time from the last save to its commit, bytes on disk, the restore time and whether the
restore gives back the model and optimizer state of the last save bit for bit.

    python -m benchmarks gpu_training              # GPT-2 124 M on the GPU (or the CPU)
    python -m benchmarks gpu_training --small      # a tiny model on the CPU (CI runs this)

Not part of ``benchmarks/run.py`` (the benchmark machine has no GPU); its GPU figures are
in ``docs/benchmarks.md`` with the machine that measured them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Workload:
    small: bool
    steps: int
    every: int
    device: str = field(init=False)

    def __post_init__(self) -> None:
        self.device = "cuda" if torch.cuda.is_available() and not self.small else "cpu"

    def config(self) -> Any:
        from transformers import GPT2Config

        if self.small:
            return GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=500,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=512, vocab_size=50257,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def fresh(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        from transformers import GPT2LMHeadModel

        torch.manual_seed(0)
        model = GPT2LMHeadModel(self.config()).to(self.device)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4)

    def tokens(self, seed: int, rows: int | None = None) -> torch.Tensor:
        seq, batch = (32, 4) if self.small else (512, 8)
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.config().vocab_size, (rows or batch, seq), generator=g).to(self.device)

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, i: int) -> None:
        x = self.tokens(i)
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.device == "cuda"):
            loss = model(x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def held_out_loss(self, model: torch.nn.Module) -> float:
        x = self.tokens(10**6, rows=1).to(next(model.parameters()).device)
        with torch.no_grad(), torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.device.type == "cuda"):
            return float(model(x, labels=x).loss)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


@dataclass
class Row:
    name: str
    loop_s: float
    blocked_mean_ms: float
    blocked_max_ms: float
    commit_s: float
    disk_mb: float
    restore_s: float | None
    exact: bool | None
    held_loss: float
    blocked_ms: list[float] = field(default_factory=list)  # each save's
    details: dict[str, Any] = field(default_factory=dict)


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bit-equal nested state (tensors compared on the CPU, everything else with ==)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.detach().cpu(), b.detach().cpu()))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class Saver:
    """One way of saving: ``save`` in the loop, ``finish`` after it, ``restore`` into fresh objects."""

    name = "none"

    def __init__(self, work: Workload, path: Path) -> None:
        self.work, self.path = work, path

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Before the loop, untimed: what a training script does once (open a store)."""

    def details(self) -> dict[str, Any]:
        """Anything this way of saving measured itself (the Checkpointer's own timings)."""
        return {}

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        pass

    def finish(self) -> None:
        pass

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError


class TorchSave(Saver):
    name = "torch.save+fsync"

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        self.last = self.path / f"step-{step}.pt"
        with open(self.last, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        state = torch.load(self.last, map_location=self.work.device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


def _dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state as DCP's docs save and load it (parameters' names as the optimizer's keys)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


class Dcp(Saver):
    name = "DCP"

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        self.last = self.path / f"step-{step}"
        dcp.save(_dcp_state(model, optimizer), storage_writer=dcp.FileSystemWriter(str(self.last)))

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = _dcp_state(model, optimizer)
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(self.last)))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


class DcpAsync(Dcp):
    name = "DCP async_save"
    future: Any = None

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if self.future is not None:
            self.future.result()
        self.last = self.path / f"step-{step}"
        self.future = dcp.async_save(_dcp_state(model, optimizer),
                                     storage_writer=dcp.FileSystemWriter(str(self.last)))

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()


class Inshrink(Saver):
    name = "inshrink lossless"
    lossless = True

    def _checkpointer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, create: bool) -> Any:
        import inshrink_store as ins
        from inshrink_store.torch import Checkpointer

        repo = ins.open(str(self.path / "store"), create=create)
        if self.lossless:
            return Checkpointer(repo, model, optimizer, lossless=True)
        return Checkpointer(repo, model, optimizer, eval_fn=self.work.held_out_loss, higher_is_better=False)

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.ck = self._checkpointer(model, optimizer, create=True)

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        self.ck.save(step)

    def details(self) -> dict[str, Any]:
        return {"timings": [{k: round(v, 3) for k, v in t.items()} for t in self.ck.timings]}

    def finish(self) -> None:
        self.ck.close()

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        with self._checkpointer(model, optimizer, create=False) as ck:
            ck.restore()


class InshrinkCompressed(Inshrink):
    name = "inshrink compressed"
    lossless = False


#: training steps each row runs untimed, on its own copy of the model, before its loop
WARMUP_STEPS = 3


def run(work: Workload, saver_type: type[Saver], root: Path, stages: bool = False) -> Row:
    """One way of saving through the loop; ``stages``: time the Checkpointer's library stages
    by thread CPU over the whole run (``bench_save_cost --stages``'s list) into its details."""
    if stages and issubclass(saver_type, Inshrink):
        from benchmarks.bench_save_cost import checkpointer_stages
        from benchmarks.bench_stages import timed

        listed = checkpointer_stages()
        with timed(listed) as spent:
            cpu = time.process_time()
            row = run(work, saver_type, root)
            cpu = time.process_time() - cpu
        row.details["stages_cpu_s"] = {name: round(spent.get(name, 0.0), 2) for name, _w, _p, _n in listed}
        row.details["process_cpu_s"] = round(cpu, 2)
        return row
    path = root / saver_type.__name__
    path.mkdir(parents=True, exist_ok=True)
    saver = saver_type(work, path)
    model, optimizer = work.fresh()
    # untimed warm-up on a copy, so no row pays the process's first CUDA kernels, cuBLAS
    # handles and allocations (the first row used to: its loop ran 1.6 s slower than the
    # steps of the rows after it)
    scratch, scratch_opt = work.fresh()
    for i in range(WARMUP_STEPS):
        work.step(scratch, scratch_opt, 2 * 10**6 + i)
    del scratch, scratch_opt
    work.sync()
    saver.setup(model, optimizer)
    blocked: list[float] = []
    reference: dict[str, Any] = {}
    work.sync()
    start = time.perf_counter()
    last_save = start
    for i in range(1, work.steps + 1):
        work.step(model, optimizer, i)
        if saver_type is not Saver and i % work.every == 0:
            if i + work.every > work.steps:  # the last save: remember what it must restore (untimed)
                work.sync()
                pause = time.perf_counter()
                reference = {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                             "optimizer": _cpu_clone(optimizer.state_dict())}
                start += time.perf_counter() - pause
            work.sync()
            t0 = time.perf_counter()
            saver.save(model, optimizer, i)
            last_save = time.perf_counter()
            blocked.append(last_save - t0)
    work.sync()
    loop_s = time.perf_counter() - start
    saver.finish()
    commit_s = time.perf_counter() - last_save if blocked else 0.0
    restore_s: float | None = None
    exact: bool | None = None
    if blocked:
        fresh, fresh_opt = work.fresh()
        work.sync()
        t0 = time.perf_counter()
        saver.restore(fresh, fresh_opt)
        work.sync()
        restore_s = time.perf_counter() - t0
        exact = _same_state({"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict()}, reference)
    return Row(saver_type.name, round(loop_s, 3), round(1e3 * sum(blocked) / max(len(blocked), 1), 1),
               round(1e3 * max(blocked, default=0.0), 1), round(commit_s, 3), round(_disk_bytes(path) / 1e6, 1),
               None if restore_s is None else round(restore_s, 3), exact, round(work.held_out_loss(model), 4),
               [round(1e3 * b, 1) for b in blocked], saver.details())


def _cpu_clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _cpu_clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_clone(v) for v in obj)
    return obj


VARIANTS: tuple[type[Saver], ...] = (Saver, TorchSave, Dcp, DcpAsync, Inshrink, InshrinkCompressed)


def table(rows: list[Row], work: Workload, params: int) -> str:
    device = torch.cuda.get_device_name() if work.device == "cuda" else "CPU"
    lines = [f"{device}; GPT-2 {params / 1e6:.1f} M params, AdamW; {work.steps} steps, a save every "
             f"{work.every}; raw state ~{params * 12 / 1e6:.0f} MB", "",
             "| way of saving | loop s | blocked per save ms (mean / worst) | last save to commit s | "
             "on disk MB | restore s | restore exact |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.loop_s} | {r.blocked_mean_ms} / {r.blocked_max_ms} | {r.commit_s} | "
                     f"{r.disk_mb} | {r.restore_s if r.restore_s is not None else '-'} | "
                     f"{'-' if r.exact is None else 'yes' if r.exact else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, emit: Callable[[str], None] = print) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny model on the CPU, to check the harness")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--every", type=int, default=None)
    ap.add_argument("--limit-s", type=float, default=600.0, help="skip the ways of saving not started by then")
    ap.add_argument("--only", default=None, help="comma-separated way names to run (default: all)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--stages", action="store_true",
                    help="time the Checkpointer's stages (thread CPU) in the inshrink rows' details")
    args = ap.parse_args(argv)
    work = Workload(args.small, args.steps or (8 if args.small else 60), args.every or (4 if args.small else 20))
    params = sum(p.numel() for p in work.fresh()[0].parameters())
    root = Path(tempfile.mkdtemp(prefix="bench-gpu-training-"))
    rows: list[Row] = []
    began = time.perf_counter()
    wanted = None if args.only is None else {w.strip() for w in args.only.split(",")}
    try:
        for variant in VARIANTS:
            if wanted is not None and variant.name not in wanted:
                continue
            if time.perf_counter() - began > args.limit_s:
                emit(f"{variant.name}: skipped (past --limit-s {args.limit_s:g})")
                continue
            row = run(work, variant, root, stages=args.stages)
            rows.append(row)
            emit(json.dumps(asdict(row)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    emit(table(rows, work, params))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()

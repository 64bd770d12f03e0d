"""One training run with a checkpoint every N steps and simulated failures.

The loop trains a workload from a seeded start and, at every checkpoint, hands the state to
the method under test. After the checkpoints chosen by :func:`failure_points` the process
"dies": model, optimizer and scheduler are thrown away, fresh ones are made (seeded
differently, so nothing leaks), and the method restores the newest checkpoint into them.
A failure strikes right after a checkpoint: a real one would also lose the steps since
then, but those are re-run on the same batches (batches are a function of the step) and
change nothing but the time, so they are skipped.

Timing: ``train_s`` is forward, backward and optimizer step only; ``checkpoint_s`` is the
time the loop spends in the method (observing gradients, saving, and the last save's drain
at the end), ``restore_s`` the time of the restores (a fresh process loading the newest
checkpoint; the dying process's wait for its last commit is in neither). The store's search and encoding run on
its background thread (``Usage.background_s``); the baselines run in the loop.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.evaluate.baselines import lossless_codecs
from benchmarks.evaluate.methods import LosslessTaps, Usage
from benchmarks.evaluate.workloads import Workload, cosine
from inshrink_store.policy import DEFAULT_CONFIG
from inshrink_store.policy.partition import TensorInput, is_quantizable, layer_type, quantize_tensor


@dataclass
class RunResult:
    """What one run gives: held-out loss at every checkpoint (``curve``) and right after each
    restore (``restored``), the final test quality, the bytes stored, and the time split."""

    label: str
    curve: list[tuple[int, float]] = field(default_factory=list)
    restored: list[tuple[int, float]] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)
    usage: Usage | None = None
    lossless: dict[str, Usage] = field(default_factory=dict)
    lossless_s: dict[str, float] = field(default_factory=dict)
    train_s: float = 0.0
    checkpoint_s: float = 0.0
    restore_s: float = 0.0
    restores: int = 0
    probe: dict[str, float] = field(default_factory=dict)


def scratch_dir() -> str | None:
    """Where the runs' stores live: a RAM disk (``/dev/shm``) when there is one, so that the
    machine's disk (shared, and slow to fsync) does not blur the timings; else the temp dir."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def failure_points(checkpoints: int, failures: int) -> set[int]:
    """The checkpoints (1-based) after which the process fails: ``failures`` of them, evenly
    spread over all but the last (the final model is the trained one, not a restored one)."""
    if failures == 0:
        return set()
    if failures > checkpoints - 1:
        raise ValueError(f"Expected at most {checkpoints - 1} failures for {checkpoints} checkpoints. "
                         f"Got {failures} instead; checkpoint more often.")
    points = {math.floor((i + 0.5) * (checkpoints - 1) / failures) + 1 for i in range(failures)}
    assert len(points) == failures
    return points


def _step(workload: Workload, model: Any, optimizer: Any, step: int) -> None:
    optimizer.zero_grad()
    workload.loss(model, *workload.batch(step)).backward()


def run(workload: Workload, method: Any, failures: int, tolerance: float, label: str = "") -> RunResult:
    """Train ``workload`` checkpointed by ``method`` (None: the uninterrupted reference, which
    feeds the lossless methods instead) with ``failures`` failures."""
    with tempfile.TemporaryDirectory(prefix="inshrink-eval-", dir=scratch_dir()) as tmp:
        return _run(workload, method, failures, tolerance, label, Path(tmp))


def _run(workload: Workload, method: Any, failures: int, tolerance: float, label: str, workdir: Path) -> RunResult:
    out = RunResult(label)
    model, optimizer = workload.fresh(0)
    scheduler = cosine(optimizer, workload.steps)
    proc = method.begin(workload, tolerance, workdir) if method is not None else None
    taps = LosslessTaps(lossless_codecs(), workdir) if method is None else None
    if proc is not None:
        proc.start(model, optimizer, scheduler)
    fail_after = failure_points(workload.checkpoints, failures if proc is not None else 0)
    step = 0
    while step < workload.steps:
        t = time.perf_counter()
        _step(workload, model, optimizer, step)
        t_observe = time.perf_counter()
        if proc is not None:
            proc.observe()
        t_opt = time.perf_counter()
        optimizer.step()
        scheduler.step()
        step += 1
        done = time.perf_counter()
        out.train_s += (t_observe - t) + (done - t_opt)
        out.checkpoint_s += t_opt - t_observe
        if step % workload.every:
            continue
        out.curve.append((step, workload.quality(model)["loss"]))
        t = time.perf_counter()
        if proc is not None:
            proc.save(step)
        else:
            assert taps is not None
            taps.save(step, model, optimizer, scheduler)
        out.checkpoint_s += time.perf_counter() - t
        if step // workload.every in fail_after:
            fail_after.discard(step // workload.every)
            proc.fail()
            model, optimizer = workload.fresh(step)  # a new process: fresh objects, another seed
            scheduler = cosine(optimizer, workload.steps)
            t = time.perf_counter()
            step = proc.resume(model, optimizer, scheduler)
            out.restore_s += time.perf_counter() - t
            out.restores += 1
            out.restored.append((step, workload.quality(model)["loss"]))
    t = time.perf_counter()
    if proc is not None:
        out.usage = proc.finish()
    else:
        assert taps is not None
        out.lossless, out.lossless_s = taps.usages(), dict(taps.seconds)
    out.checkpoint_s += time.perf_counter() - t
    out.final = workload.quality(model)
    if proc is None:
        out.probe = probe(workload, model)
    return out


def probe(workload: Workload, model: Any) -> dict[str, float]:
    """Per quantizable tensor of the final model: the relative change of the search's metric
    (positive: worse) when that tensor alone is quantized with the store's base configuration
    (16 levels, 0.5 % protected; embeddings take ``embedding_bins``, also 16). Shows which
    tensor a tolerance runs out on."""
    base = workload.evaluate(model)
    kinds = {f"{name}.{p}".lstrip("."): type(m).__name__ for name, m in model.named_modules()
             for p, _ in m.named_parameters(recurse=False)}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {}
    for name in sorted(kinds):
        values = state[name].numpy()
        t = TensorInput(values, layer_type=layer_type(values.shape, kinds[name]))
        if not is_quantizable(t, DEFAULT_CONFIG):
            continue
        trial = copy.deepcopy(model)
        q = quantize_tensor(t, DEFAULT_CONFIG).values.reshape(values.shape)
        trial.load_state_dict({**state, name: torch.from_numpy(q)})
        value = workload.evaluate(trial)
        out[name] = (base - value) / base if workload.higher_is_better else (value - base) / base
    return out

"""Checkpointer: dynamic quantization from a training loop, off the critical path.

In the loop, after ``backward()``, call :meth:`Checkpointer.observe_gradients`; it keeps
an exponential moving average of the gradients (``ema = 0.9 g + 0.1 ema``) on the CPU,
only over the last ``ema_batches`` batches before a checkpoint is due, so sensitivity
``|g*w|`` costs no extra pass. :meth:`save` copies the state (the only part training
waits for), then a background thread searches the configuration, encodes and commits.
A background failure is raised by the next call. :meth:`restore` loads a version and
makes the next save delta-code against it, so the chain survives a failure.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import zstandard

from inshrink_store.codecs.nuq import NUQ
from inshrink_store.errors import InshrinkError, LeaseBrokenError
from inshrink_store.policy import QuantConfig, StatePlanner
from inshrink_store.policy.partition import PartitionCache
from inshrink_store.policy.search import SearchPoint, SearchResult, SearchSpace, search
from inshrink_store.torch.tensors import STRUCTURE_ATTR, load_state, state_to_arrays, torch

log = logging.getLogger(__name__)
_PLANS_KEPT = 2  # candidate plan sets held at once during a search (each ~ the model's size)

#: used when there is no eval function: conservative, documented in docs/guides/training-loop.md
DEFAULT_CONFIG = QuantConfig(bins=16, prune=0.0, protect=0.005)


class BackgroundSaveError(InshrinkError):
    """A background save failed; raised by the Checkpointer's next call, with the cause chained."""


def _cpu_copy(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


class _FixedPlans:
    """A Planner that returns plans already computed (during the search) for this state."""

    def __init__(self, plans: dict[str, Any]) -> None:
        self.plans = plans

    def plan(self, tensors: Any, dtypes: Any, previous: Any) -> dict[str, Any]:
        return self.plans


class Checkpointer:
    """Saves ``model`` (and ``optimizer``) into ``repo`` with the method of Inshrinkerator."""

    def __init__(self, repo: Any, model: Any, optimizer: Any = None, eval_fn: Callable[[Any], float] | None = None,
                 tolerance: float = 0.05, every: int | None = None, *, higher_is_better: bool = True,
                 ema_batches: int = 50, branch: str = "main", background: bool = True,
                 space: SearchSpace | None = None, optimizer_policy: Any = None,
                 gc_wait: float = 600.0) -> None:
        self.repo, self.model, self.optimizer, self.eval_fn = repo, model, optimizer, eval_fn
        self.tolerance, self.every, self.higher_is_better = tolerance, every, higher_is_better
        self.ema_batches, self.branch, self.space = ema_batches, branch, space or SearchSpace()
        #: a repository Planner for ``optimizer/`` tensors (e.g. ``StatePlanner(QuantConfig(...),
        #: scope="optimizer/")``); None keeps the optimizer state lossless, the default: the search
        #: only evaluates the model, so nothing would check what a lossy optimizer costs.
        self.optimizer_policy = optimizer_policy
        #: how long a save waits for a running gc (logged) before it fails; a commit that a gc
        #: fenced off (it judged this process dead) is retried at once, the state still in hand
        self.gc_wait = gc_wait
        self._ema: dict[str, Any] = {}
        self._batches = 0
        self._parent: str | None = None
        self._previous: QuantConfig | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="inshrink-save") if background else None
        self._pending: Future[Any] | None = None
        self._lock = threading.Lock()
        self.last_search: SearchResult | None = None
        self.timings: list[dict[str, float]] = []
        if eval_fn is None:
            warnings.warn(
                "Checkpointer has no eval_fn: every checkpoint uses the conservative default "
                f"{DEFAULT_CONFIG.bins} levels, no pruning, {DEFAULT_CONFIG.protect:.1%} protected. "
                "Pass eval_fn to let the search pick the most aggressive safe configuration.",
                stacklevel=2)

    # -- in the loop -----------------------------------------------------------------------
    def observe_gradients(self) -> None:
        """Fold the current gradients into the sensitivity EMA (call after backward())."""
        self._batches += 1
        if self.every and (self._batches % self.every) < self.every - self.ema_batches:
            return
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if p.grad is None:
                    continue
                g = p.grad.detach().to("cpu", dtype=torch.float32, copy=True)
                prev = self._ema.get(name)
                self._ema[name] = g if prev is None else g.mul_(0.9).add_(prev, alpha=0.1)

    def save(self, step: int, metrics: dict[str, float] | None = None, message: str | None = None) -> Any:
        """Checkpoint now. Returns the SnapshotInfo (foreground) or a Future of it (background)."""
        self._raise_failure()
        self.wait()
        start = time.perf_counter()
        model_state = _cpu_copy(self.model.state_dict())
        state = {"model": model_state}
        if self.optimizer is not None:
            state["optimizer"] = _cpu_copy(self.optimizer.state_dict())
        sensitivity = {f"model/{n}": (self._ema[n] * model_state[n].float()).abs().numpy()
                       for n in self._ema if n in model_state}
        # cleared here, in the loop's thread: the next window starts now, whatever the background does
        self._ema = {}
        kinds = {f"model/{name}.{p}": type(mod).__name__ for name, mod in self.model.named_modules()
                 for p, _ in mod.named_parameters(recurse=False)}
        eval_model = copy.deepcopy(self.model).to("cpu") if self.eval_fn is not None else None
        copy_s = time.perf_counter() - start
        job = (state, sensitivity, kinds, eval_model, step, metrics, message, copy_s)
        if self._pool is None:
            return self._save(*job)
        self._pending = self._pool.submit(self._save, *job)
        return self._pending

    def wait(self) -> Any:
        """Block until the background save (if any) is committed; re-raise its failure."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            return pending.result()
        except BaseException as exc:
            raise BackgroundSaveError(f"Expected the background checkpoint to commit. Got {exc!r} instead.") from exc

    def _raise_failure(self) -> None:
        if self._pending is not None and self._pending.done() and self._pending.exception() is not None:
            self.wait()

    def restore(self, ref: str = "main") -> int | None:
        """Load model and optimizer state of ``ref``; returns its step. Saves continue from it."""
        self.wait()
        snapshot_id = self.repo.resolve(ref)
        state = load_state(self.repo, snapshot_id)
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        info = self.repo.snapshot(snapshot_id)
        self._parent = snapshot_id
        config = info.metadata.get("quantization", {}).get("config")
        self._previous = QuantConfig.from_dict(config) if config else None
        self._ema.clear()
        return info.step

    # -- background ------------------------------------------------------------------------
    def _save(self, state: dict[str, Any], sensitivity: dict[str, np.ndarray], kinds: dict[str, str],
              eval_model: Any, step: int, metrics: dict[str, float] | None, message: str | None,
              copy_s: float) -> Any:
        t0 = time.perf_counter()
        arrays, dtypes, skeleton = state_to_arrays(state)
        previous = self._previous_codecs()
        # The search reads a candidate's plans for its ratio, maybe for an evaluation, and
        # the winner's once more to write it. Each plan set is a quantized copy of the
        # model, so only the most recent few are kept (ratios are remembered separately);
        # the shared sketches make re-planning an evicted candidate cheap.
        planners: OrderedDict[QuantConfig, StatePlanner] = OrderedDict()
        partitions = PartitionCache()
        ratios: dict[QuantConfig, float] = {}

        def planner(config: QuantConfig) -> StatePlanner:
            if config in planners:
                planners.move_to_end(config)
                return planners[config]
            p = StatePlanner(config, sensitivity=sensitivity, module_kinds=kinds, scope="model/",
                             cache=partitions)
            p.plans = dict(p.plan(arrays, dtypes, previous))  # type: ignore[attr-defined]
            planners[config] = p
            while len(planners) > _PLANS_KEPT:
                planners.popitem(last=False)
            return p

        def to_config(point: SearchPoint) -> QuantConfig:
            return QuantConfig(**{**DEFAULT_CONFIG.to_dict(), **point.to_dict()})

        model_paths = [p for p in arrays if p.startswith("model/")]
        logical = sum(arrays[p].nbytes for p in model_paths)

        def measure_ratio(point: SearchPoint | QuantConfig) -> float:
            config = point if isinstance(point, QuantConfig) else to_config(point)
            if config not in ratios:
                ratios[config] = _measure(config)
            return ratios[config]

        def _measure(config: QuantConfig) -> float:
            plans = planner(config).plans  # type: ignore[attr-defined]
            stored = 0
            for path in model_paths:
                if path in plans:
                    codec = plans[path].serializer
                    payload = NUQ(codec.codebook, 0.0, codec.protected_dtype,
                                  codec.dtype or str(plans[path].values.dtype)).encode(plans[path].values)
                    stored += len(zstandard.ZstdCompressor(level=3).compress(payload))
                else:
                    stored += len(zstandard.ZstdCompressor(level=3).compress(arrays[path].tobytes()))
            return logical / max(stored, 1)

        baseline = None
        result: SearchResult | None = None
        if self.eval_fn is not None and eval_model is not None:
            baseline = float(self.eval_fn(eval_model))
            originals = {n: t.clone() for n, t in eval_model.state_dict().items()}

            def is_feasible(point: SearchPoint) -> tuple[bool, float]:
                plans = planner(to_config(point)).plans  # type: ignore[attr-defined]
                quantized = dict(originals)
                for path, plan in plans.items():
                    name = path[len("model/"):]
                    values = plan.values
                    t = torch.from_numpy(values.view(np.int16).copy()).view(torch.bfloat16) \
                        if dtypes[path] == "BF16" else torch.from_numpy(values.copy())
                    quantized[name] = t.reshape(originals[name].shape)
                eval_model.load_state_dict(quantized)
                quality = float(self.eval_fn(eval_model))
                eval_model.load_state_dict(originals)
                return self._within(quality, baseline), quality

            metrics_available = ("magnitude", "sensitivity") if sensitivity else ("magnitude",)
            result = search(measure_ratio, is_feasible, previous=self._previous, space=self.space,
                            metrics_available=metrics_available)
            # nothing within tolerance: this checkpoint is stored lossless (chosen None)
            chosen = to_config(result.best) if result.best is not None else None
        else:
            chosen = DEFAULT_CONFIG
        t_search = time.perf_counter() - t0
        plans = dict(planner(chosen).plans) if chosen is not None else {}  # type: ignore[attr-defined]
        if self.optimizer_policy is not None:
            optimizer_arrays = {p: a for p, a in arrays.items() if p.startswith("optimizer/")}
            plans.update(self.optimizer_policy.plan(optimizer_arrays, dtypes, previous))
        quantize = _FixedPlans(plans) if plans else None
        metadata = {"quantization": {
            "config": None if chosen is None else chosen.to_dict(),
            "baseline_quality": baseline, "tolerance": self.tolerance,
            "higher_is_better": self.higher_is_better,
            "search": None if result is None else result.to_dict(),
            "model_ratio_estimate": None if chosen is None else measure_ratio(chosen),
        }}
        info = self._commit(arrays, dtypes=dtypes, attributes={STRUCTURE_ATTR: skeleton}, quantize=quantize,
                            branch=self.branch, parent=self._parent, step=step, metrics=metrics,
                            message=message or f"step {step}", metadata=metadata)
        self._parent = info.id
        self._previous = chosen
        self.last_search = result
        self.timings.append({"copy_s": copy_s, "search_s": t_search, "total_s": time.perf_counter() - t0 + copy_s})
        return info

    def _commit(self, arrays: dict[str, Any], **kwargs: Any) -> Any:
        """``repo.save`` that rides out a gc: waits for it (up to ``gc_wait`` s, logged) and
        retries a commit the gc fenced off, so a gc never costs the run a checkpoint."""
        def waiting(message: str) -> None:
            log.warning("checkpoint at step %s: %s (up to %.0f s)", kwargs.get("step"), message, self.gc_wait)

        for attempt in range(1, 4):
            try:
                return self.repo.save(arrays, gc_wait=self.gc_wait, on_wait=waiting, **kwargs)
            except LeaseBrokenError:
                if attempt == 3:
                    raise
                log.warning("checkpoint at step %s: a gc fenced off this commit; retrying (%d/3)",
                            kwargs.get("step"), attempt + 1)
        raise AssertionError("unreachable")

    def _within(self, quality: float, baseline: float) -> bool:
        slack = self.tolerance * abs(baseline)
        return quality >= baseline - slack if self.higher_is_better else quality <= baseline + slack

    def _previous_codecs(self) -> dict[str, dict[str, Any]]:
        parent = self._parent
        if parent is None:
            heads = self.repo.branches()
            parent = heads.get(self.branch)
        if parent is None:
            return {}
        from inshrink_store.arrays import previous_codecs

        return previous_codecs(self.repo.checkout(parent).view)

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from typing_extensions import Unpack

from inshrink_store.errors import BackgroundSaveError, FormatError, LeaseBrokenError
from inshrink_store.policy import (
    DEFAULT_CONFIG,
    Candidates,
    PlanSet,
    QuantConfig,
    QuantizationRecord,
    SearchPolicy,
)
from inshrink_store.policy.search import SearchResult, SearchSpace
from inshrink_store.policy.search_policy import PolicyArgs
from inshrink_store.torch.tensors import (
    STRUCTURE_ATTR,
    array_to_tensor,
    load_state,
    state_to_arrays,
    torch,
)
from inshrink_store.writer import previous_codecs

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_CONFIG", "BackgroundSaveError", "Checkpointer"]


def _cpu_copy(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


@dataclass(frozen=True)
class _Job:
    """What the loop's thread hands the background save: copies, never live objects."""

    state: dict[str, Any]
    sensitivity: dict[str, Any]  # path -> |g*w| as numpy, over the last EMA window
    kinds: dict[str, str]  # path -> owning module's class name (layer types)
    eval_model: Any  # a CPU copy of the model to evaluate candidates on (None: no eval_fn)
    step: int
    metrics: dict[str, float] | None
    message: str | None
    copy_s: float


class _QuantizedEval:
    """``eval_fn`` on a CPU copy of the model with a candidate's values loaded.

    ``evaluate(None)`` scores the copy as it is (the baseline); the unquantized weights
    are kept once, at the first candidate, and put back after every evaluation."""

    def __init__(self, eval_fn: Callable[[Any], float], model: Any, dtypes: dict[str, str]) -> None:
        self.eval_fn, self.model, self.dtypes = eval_fn, model, dtypes
        self.originals: dict[str, Any] | None = None

    def __call__(self, plans: PlanSet | None) -> float:
        if plans is None:
            return float(self.eval_fn(self.model))
        if self.originals is None:
            self.originals = {n: t.clone() for n, t in self.model.state_dict().items()}
        quantized = dict(self.originals)
        for path, plan in plans.items():
            name = path[len("model/"):]
            quantized[name] = array_to_tensor(plan.values, self.dtypes[path]).reshape(self.originals[name].shape)
        self.model.load_state_dict(quantized)
        try:
            return float(self.eval_fn(self.model))
        finally:
            self.model.load_state_dict(self.originals)


class Checkpointer:
    """Saves ``model`` (and ``optimizer``) into ``repo`` with the method of Inshrinkerator.

    ``policy`` (a :class:`~inshrink_store.policy.SearchPolicy`) decides what each checkpoint
    stores; the 0.1 keywords ``tolerance``, ``higher_is_better``, ``space`` and
    ``optimizer_policy`` still work and build it. ``every``: the save interval in steps, so
    the gradient EMA runs only over the last ``ema_batches`` batches before each save.
    ``gc_wait``: how long a save waits for a running gc (logged) before it fails; a commit
    that a gc fenced off (it judged this process dead) is retried at once, state in hand.
    """

    def __init__(self, repo: Any, model: Any, optimizer: Any = None, eval_fn: Callable[[Any], float] | None = None,
                 every: int | None = None, *, policy: SearchPolicy | None = None, ema_batches: int = 50,
                 branch: str = "main", background: bool = True, gc_wait: float = 600.0,
                 **legacy: Unpack[PolicyArgs]) -> None:
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 0):
            raise FormatError(
                f"Expected every to be an int (steps between saves) or None. Got {every!r} instead; "
                f"tolerance is keyword-only: pass tolerance={every!r} or policy=SearchPolicy(...)."
            )
        if policy is not None and legacy:
            raise FormatError(
                f"Expected either policy= or the keywords {sorted(legacy)}. Got both instead; "
                "set those fields on the SearchPolicy."
            )
        self.policy = policy if policy is not None else SearchPolicy.from_args(**legacy)
        self.repo, self.model, self.optimizer, self.eval_fn = repo, model, optimizer, eval_fn
        self.every, self.ema_batches, self.branch, self.gc_wait = every, ema_batches, branch, gc_wait
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
            base = self.policy.base
            warnings.warn(
                "Checkpointer has no eval_fn: every checkpoint uses the conservative default "
                f"{base.bins} levels, no pruning, {base.protect:.1%} protected. "
                "Pass eval_fn to let the search pick the most aggressive safe configuration.",
                stacklevel=2)

    # the 0.1 attributes, read from the policy
    @property
    def tolerance(self) -> float:
        return self.policy.tolerance

    @property
    def higher_is_better(self) -> bool:
        return self.policy.higher_is_better

    @property
    def space(self) -> SearchSpace:
        return self.policy.space

    @property
    def optimizer_policy(self) -> Any:
        return self.policy.optimizer

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
        job = _Job(state, sensitivity, kinds, eval_model, step, metrics, message, copy_s)
        if self._pool is None:
            return self._save(job)
        self._pending = self._pool.submit(self._save, job)
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
        recorded = info.metadata.get("quantization")
        self._previous = None if recorded is None else QuantizationRecord.from_dict(recorded).config
        self._ema.clear()
        return info.step

    # -- background ------------------------------------------------------------------------
    def _save(self, job: _Job) -> Any:
        t0 = time.perf_counter()
        arrays, dtypes, skeleton = state_to_arrays(job.state)
        candidates = Candidates(arrays, dtypes, self._previous_codecs(), sensitivity=job.sensitivity,
                                module_kinds=job.kinds, keep=self.policy.keep)
        evaluate = None
        if self.eval_fn is not None and job.eval_model is not None:
            evaluate = _QuantizedEval(self.eval_fn, job.eval_model, dtypes)
        decision = self.policy.decide(candidates, evaluate, previous=self._previous)
        t_search = time.perf_counter() - t0
        info = self._commit(arrays, dtypes=dtypes, attributes={STRUCTURE_ATTR: skeleton}, quantize=decision.plans,
                            branch=self.branch, parent=self._parent, step=job.step, metrics=job.metrics,
                            message=job.message or f"step {job.step}",
                            metadata={"quantization": decision.record.to_dict()})
        self._parent, self._previous, self.last_search = info.id, decision.record.config, decision.record.search
        self.timings.append({"copy_s": job.copy_s, "search_s": t_search,
                             "total_s": time.perf_counter() - t0 + job.copy_s})
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

    def _previous_codecs(self) -> dict[str, dict[str, Any]]:
        parent = self._parent
        if parent is None:
            heads = self.repo.branches()
            parent = heads.get(self.branch)
        if parent is None:
            return {}
        return previous_codecs(self.repo.checkout(parent).view)

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

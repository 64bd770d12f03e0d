"""How a run is checkpointed: the store's Checkpointer (and its ablations) or a baseline.

Every method is used the same way by the training loop (:mod:`.experiment`): ``start`` in
a process, ``observe`` after each backward, ``save`` at every checkpoint, ``resume`` in a
fresh process after a failure (returns the step it resumed at), ``finish`` at the end (the
bytes every version took). The store's own run goes through the public API only, except
the one ablation the library has no public switch for (regrouping off, see
:data:`Ours.regroup`). A failure is ``fail`` (the process dies once its last checkpoint is
committed) then ``resume`` in the new process.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import inshrink_store as ins
from benchmarks.evaluate import rollback
from benchmarks.evaluate.baselines import BaselineStore, Codec, VersionBytes, zstd
from benchmarks.evaluate.state import Captured, capture, load, load_weights
from benchmarks.evaluate.workloads import Workload
from inshrink_store.codecs.vdelta import VDelta
from inshrink_store.policy import SearchPolicy
from inshrink_store.policy.moments import DEFAULT_MOMENTS, ROLLBACK_MOMENTS, MomentPolicy
from inshrink_store.policy.search import SearchSpace
from inshrink_store.torch import Checkpointer, save_state


@dataclass
class Usage:
    """What a run stored: per version bytes, the restore residual still on disk at the end
    (the store only), each version's setting, and checkpoint work done off the loop."""

    versions: list[VersionBytes]
    residual: int = 0
    settings: list[str] = field(default_factory=list)
    background_s: float = 0.0
    exact_resumes: int = 0
    metadata_zstd: float = 1.0  # what another zstd pass would leave of the per-array documents
    #: bytes of the ``optimizer/`` tensors over all versions: (logical, stored); the store only
    moments: tuple[int, int] | None = None
    #: the rollback check (:mod:`benchmarks.evaluate.rollback`), when the method asks for one
    rollback: dict[str, Any] | None = None


def store_versions(repo: Any) -> list[VersionBytes]:
    """Every version's bytes from ``repo.du``: the restore residual left out (it is reported
    apart), metadata = what no tensor prefix holds (the version's snapshot document and trees:
    each array's zarr.json)."""
    whole = repo.du()
    parts = {prefix: repo.du(prefix=prefix) for prefix in ("model/", "optimizer/", "extra/")}
    out = []
    for i, r in enumerate(whole):
        values = sum(rows[i].new_stored_bytes for rows in parts.values())
        stored = r.new_stored_bytes - r.residual_bytes
        out.append(VersionBytes(r.step, parts["model/"][i].logical_bytes, r.logical_bytes,
                                parts["model/"][i].new_stored_bytes, stored, "", stored - values))
    return out


def tree_zstd_ratio(root: Path) -> float:
    """Compressed over stored size of the store's tree documents (each array's zarr.json): what a
    second zstd pass would still leave (about 1 now that trees are stored as zstd frames)."""
    raw = packed = 0
    for path in sorted((root / "trees").rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            raw, packed = raw + len(data), packed + len(zstd(data))
    return packed / raw if raw else 1.0


def _config_label(config: dict[str, Any] | None) -> str:
    if config is None:
        return "lossless"
    prune = f"{config['prune']:.0%} {config['prune_metric'][:3]}" if config["prune"] else "0%"
    return f"{config['bins']}/{prune}/{config['protect']:.2%}"


# -- the store ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ours:
    """A Checkpointer configuration. ``exact_resume``: the Checkpointer's (1: bit-exact resume
    from the newest version's restore residual; 0: resume from the stored values).
    ``paper_space``: with ``exact_resume=0`` still search ``space`` (the aggressive cube, as the
    paper does) instead of the policy's conservative resume space. The ablation switches:
    ``space`` (pruning or protection off), ``moments``, ``keyframe_interval=1`` (no delta),
    ``regroup=False`` (no rearrangement), ``gradients=False`` (magnitude scores only)."""

    key: str
    label: str
    exact_resume: int = 1
    paper_space: bool = False
    space: SearchSpace = field(default_factory=SearchSpace)
    moments: MomentPolicy = DEFAULT_MOMENTS
    keyframe_interval: int | None = None
    regroup: bool = True
    gradients: bool = True
    #: with exact resume: after the run, restore the version at this fraction of the run lossy
    #: and train on (:mod:`benchmarks.evaluate.rollback`); 0: no rollback check
    rollback_at: float = 0.0
    #: the moments of versions a restart never loads as stored (None: ``moments`` for every version)
    history_moments: MomentPolicy | None = ROLLBACK_MOMENTS

    def policy(self, tolerance: float, higher_is_better: bool) -> SearchPolicy:
        resume = {"resume_space": self.space} if self.paper_space else {}
        return SearchPolicy(tolerance=tolerance, higher_is_better=higher_is_better, space=self.space,
                            optimizer=self.moments, history_moments=self.history_moments, **resume)

    def begin(self, workload: Workload, tolerance: float, workdir: Path) -> OursRun:
        return OursRun(self, workload, tolerance, str(workdir / self.key))


class OursRun:
    """One run's store at ``url``; each process (start or resume) opens it afresh."""

    def __init__(self, spec: Ours, workload: Workload, tolerance: float, url: str) -> None:
        self.spec, self.workload, self.tolerance, self.url = spec, workload, tolerance, url
        ins.open(url, create=True, keyframe_interval=spec.keyframe_interval)
        self.ck: Checkpointer | None = None
        self.background_s, self.exact = 0.0, 0

    def _repo(self) -> Any:
        repo = ins.open(self.url)
        if not self.spec.regroup:
            # benchmark-only switch: the library has no public option for the store's delta codec
            repo._objects._delta = VDelta(regroup=False)
        return repo

    def start(self, model: Any, optimizer: Any, scheduler: Any) -> None:
        self.ck = Checkpointer(self._repo(), model, optimizer, eval_fn=self.workload.evaluate,
                               every=self.workload.every,
                               policy=self.spec.policy(self.tolerance, self.workload.higher_is_better),
                               extra_state={"scheduler": scheduler}, exact_resume=self.spec.exact_resume)

    def observe(self) -> None:
        if self.spec.gradients:
            assert self.ck is not None
            self.ck.observe_gradients()

    def save(self, step: int) -> None:
        assert self.ck is not None
        self.ck.save(step)

    def _close(self) -> None:
        assert self.ck is not None
        self.ck.close()
        self.background_s += sum(t["total_s"] for t in self.ck.timings)

    def fail(self) -> None:
        """The process dies once its last checkpoint is committed."""
        self._close()

    def resume(self, model: Any, optimizer: Any, scheduler: Any) -> int:
        self.start(model, optimizer, scheduler)
        assert self.ck is not None
        step = self.ck.restore("main") or 0
        self.exact += bool(self.ck.restored_exact)
        return step

    def finish(self) -> Usage:
        self._close()
        repo = ins.open(self.url)
        residual = sum(r.residual_bytes for r in repo.du())
        settings = [_config_label(i.metadata.get("quantization", {}).get("config")) for i in reversed(repo.log())]
        rows = repo.du(prefix="optimizer/")
        moments = (sum(r.logical_bytes for r in rows), sum(r.new_stored_bytes for r in rows))
        checked = rollback.check(self.workload, self.url, self.spec.rollback_at) if self.spec.rollback_at else None
        return Usage(store_versions(repo), residual, settings, self.background_s, self.exact,
                     tree_zstd_ratio(Path(self.url)), moments, checked)


# -- the baselines ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Baseline:
    """A baseline codec applied to the whole state at every checkpoint; resumes load its
    restored (lossy) values into a fresh process."""

    key: str
    label: str
    make: Callable[[], Codec]

    def begin(self, workload: Workload, tolerance: float, workdir: Path) -> BaselineRun:
        return BaselineRun(BaselineStore(self.make(), tolerance, workload.higher_is_better), workload)


class BaselineRun:
    def __init__(self, store: BaselineStore, workload: Workload) -> None:
        self.store, self.workload = store, workload
        self.objects: tuple[Any, Any, Any] | None = None
        self.newest: Captured | None = None

    def start(self, model: Any, optimizer: Any, scheduler: Any) -> None:
        self.objects = (model, optimizer, scheduler)

    def observe(self) -> None:
        pass

    def save(self, step: int) -> None:
        assert self.objects is not None
        self.newest = capture(*self.objects)
        scratch = copy.deepcopy(self.objects[0])
        dtypes = self.newest.dtypes

        def evaluate(arrays: dict[str, np.ndarray] | None) -> float:
            model = scratch if arrays is None else _with(scratch, arrays, dtypes)
            return self.workload.evaluate(model)

        self.store.save(self.newest, step, evaluate)

    def fail(self) -> None:
        self.objects = None

    def resume(self, model: Any, optimizer: Any, scheduler: Any) -> int:
        assert self.newest is not None
        load(self.newest, self.store.restore(), model, optimizer, scheduler)
        self.objects = (model, optimizer, scheduler)
        return self.store.versions[-1].step

    def finish(self) -> Usage:
        return Usage(self.store.versions, settings=[v.setting for v in self.store.versions])


def _with(scratch: Any, arrays: dict[str, np.ndarray], dtypes: dict[str, str]) -> Any:
    model = copy.deepcopy(scratch)
    load_weights(model, arrays, dtypes)
    return model


# -- lossless, on the uninterrupted run --------------------------------------------------------------
class LosslessTaps:
    """The lossless methods, fed the uninterrupted run's checkpoints: ours (the store without
    quantization: chunk dedup and its float codec), ZipNN and zstd-3. Each version is
    decoded and checked bit-exact, so a resume from any of them continues the uninterrupted
    run exactly: ten restores change nothing, and the reference run stands for them."""

    def __init__(self, codecs: dict[str, Codec], workdir: Path) -> None:
        self.codecs = codecs
        self.stores = {k: BaselineStore(c, 0.0, True) for k, c in codecs.items()}
        self.repo = ins.open(str(workdir / "lossless"), create=True)
        self.seconds = {"ours": 0.0, **dict.fromkeys(codecs, 0.0)}

    def save(self, step: int, model: Any, optimizer: Any, scheduler: Any) -> None:
        t = time.perf_counter()
        save_state(self.repo, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                               "extra": {"scheduler": scheduler.state_dict()}}, step=step)
        self.seconds["ours"] += time.perf_counter() - t
        captured = capture(model, optimizer, scheduler)
        for key, store in self.stores.items():
            t = time.perf_counter()
            store.save(captured, step, None)
            self.seconds[key] += time.perf_counter() - t
            restored = store.restore()
            assert all(np.array_equal(restored[p], a) for p, a in captured.arrays.items()), f"{key}: not exact"

    def usages(self) -> dict[str, Usage]:
        ours = store_versions(self.repo)
        return {"ours": Usage(ours, settings=["lossless"] * len(ours)),
                **{k: Usage(s.versions, settings=[v.setting for v in s.versions]) for k, s in self.stores.items()}}

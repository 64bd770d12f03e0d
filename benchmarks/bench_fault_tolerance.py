"""Ten failures in one run: what each way of resuming does to the final quality.

The experiment the method is judged by: a run checkpointed by the Checkpointer (search
within a 1 % tolerance of held-out loss) fails ten times, evenly spread, and each time
resumes in a fresh model, optimizer and Checkpointer from the newest version - like a
process that died. Compared with one uninterrupted run that never compressed:

- ``exact_resume=1`` (the default): the newest version keeps its restore residual, so every
  resume is bit-exact and the run must end exactly where the uninterrupted one does;
- ``exact_resume=0``: every resume loads the stored, quantized weights and moments; the
  Checkpointer then searches the policy's ``resume_space`` (16-64 levels, at most 40 %
  pruned), more conservative than the aggressive space (``--sweep`` compares them).

Two workloads, every input seeded, CPU only: the demo's MLP on scikit-learn's digits
(held-out cross-entropy) and a small character-level transformer language model on a text
drawn from a fixed random grammar (held-out loss per character). Reported: final held-out
loss against the uninterrupted run, the whole state's stored ratio (history, and on disk with
the newest residual), the residual's share of the bytes; the loss curves are plotted to
``docs/img/fault-tolerance.png`` when matplotlib is installed.

Run: ``python -m benchmarks fault_tolerance [--quick]``.
"""

from __future__ import annotations

import math
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import inshrink_store as ins
from inshrink_store.policy import SearchPolicy
from inshrink_store.policy.search import SearchSpace
from inshrink_store.torch import Checkpointer
from inshrink_store.torch.demo import load_digits_split, make_model

ROOT = Path(__file__).resolve().parents[1]
PLOT = ROOT / "docs" / "img" / "fault-tolerance.png"
TOLERANCE = 0.01
FAILURES = 10


# -- workloads ------------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    make_model: Callable[[], Any]
    make_optimizer: Callable[[Any], Any]
    batch: Callable[[int], tuple[Any, Any]]  # step -> (inputs, targets), the same for every run
    loss: Callable[[Any, Any, Any], Any]  # model, inputs, targets -> scalar loss
    held_out: tuple[Any, Any]
    steps: int
    every: int


def _digits(steps: int) -> Workload:
    xtr, ytr, xte, yte = load_digits_split()
    gen = torch.Generator().manual_seed(1)
    order = [torch.randint(0, len(ytr), (64,), generator=gen) for _ in range(steps)]

    def loss(model: Any, x: Any, y: Any) -> Any:
        return torch.nn.functional.cross_entropy(model(x), y)

    return Workload("MLP on digits", make_model, lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
                    lambda s: (xtr[order[s]], ytr[order[s]]), loss, (xte, yte), steps, steps // 20)


def grammar_text(chars: int, seed: int = 0) -> str:
    """Sentences from a fixed random grammar: a Zipf vocabulary of made-up words, each word
    followed by words from its own small set (bigram structure), so there is much to learn."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, rng.integers(2, 8))) for _ in range(300)]
    zipf = 1.0 / np.arange(1, len(vocab) + 1)
    zipf /= zipf.sum()
    follows = [rng.choice(len(vocab), 8, p=zipf) for _ in vocab]
    words, current = [], int(rng.choice(len(vocab), p=zipf))
    total = 0
    while total < chars:
        words.append(vocab[current])
        total += len(vocab[current]) + 1
        if rng.random() < 0.12:
            words[-1] += "."
            current = int(rng.choice(len(vocab), p=zipf))
        else:
            current = int(follows[current][rng.integers(0, 8)])
    return " ".join(words)


class TinyLM(torch.nn.Module):
    """A 2-layer causal transformer over characters (context 32, width 64)."""

    def __init__(self, vocab: int, width: int = 64, context: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.randn(context, width) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: Any) -> Any:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.position[:n]
        return self.head(self.blocks(h, mask=self.mask[:n, :n], is_causal=True))


def _language(steps: int) -> Workload:
    text = grammar_text(400_000)
    alphabet = sorted(set(text))
    data = torch.tensor([alphabet.index(c) for c in text])
    split = int(0.9 * len(data))
    train, test = data[:split], data[split:]
    gen = torch.Generator().manual_seed(2)
    starts = [torch.randint(0, len(train) - 33, (16,), generator=gen) for _ in range(steps)]
    held = torch.stack([test[i:i + 33] for i in range(0, 33 * 128, 33)])

    def batch(s: int) -> tuple[Any, Any]:
        seq = torch.stack([train[i:i + 33] for i in starts[s].tolist()])
        return seq[:, :-1], seq[:, 1:]

    def loss(model: Any, x: Any, y: Any) -> Any:
        return torch.nn.functional.cross_entropy(model(x).reshape(-1, len(alphabet)), y.reshape(-1))

    def make() -> Any:
        torch.manual_seed(0)
        return TinyLM(len(alphabet))

    return Workload("transformer LM", make, lambda m: torch.optim.AdamW(m.parameters(), lr=2e-3),
                    batch, loss, (held[:, :-1], held[:, 1:]), steps, steps // 20)


# -- one run -------------------------------------------------------------------------------
@dataclass
class Run:
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss)
    final: float = math.nan
    logical: int = 0
    stored: int = 0
    residual: int = 0
    exact_resumes: int = 0


def _held_out(w: Workload, model: Any) -> float:
    with torch.no_grad():
        return float(w.loss(model, *w.held_out))


def _schedule(opt: Any, steps: int) -> Any:
    """Cosine decay to zero over the run, so the final model is a settled point (with a
    constant rate the held-out loss swings by half from one checkpoint to the next)."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))


def run(w: Workload, exact_resume: int | None, failures: int = FAILURES, optimizer: str = "compressed",
        **policy: Any) -> Run:
    """One training run; ``exact_resume`` None: no Checkpointer at all (the reference).
    ``optimizer`` and ``policy`` (SearchPolicy fields) set how versions are stored."""
    torch.manual_seed(0)
    model = w.make_model()
    opt = w.make_optimizer(model)
    sched = _schedule(opt, w.steps)
    out = Run()
    fail_at = set() if exact_resume is None else {
        int((i + 0.5) * w.steps / failures) for i in range(failures)}
    tmp = tempfile.TemporaryDirectory()
    repo = ins.open(f"{tmp.name}/store", create=True) if exact_resume is not None else None

    def checkpointer(m: Any, o: Any, sc: Any) -> Any:
        return Checkpointer(repo, m, o, eval_fn=lambda mm: _held_out(w, mm), every=w.every,
                            extra_state={"scheduler": sc},
                            policy=SearchPolicy(**{"tolerance": TOLERANCE, "higher_is_better": False,
                                                   "optimizer": optimizer, **policy}),
                            exact_resume=exact_resume or 0)

    ck = checkpointer(model, opt, sched) if repo is not None else None
    step = 0
    while step < w.steps:
        x, y = w.batch(step)
        opt.zero_grad()
        w.loss(model, x, y).backward()
        if ck is not None:
            ck.observe_gradients()
        opt.step()
        sched.step()
        step += 1
        if step % w.every == 0:
            out.curve.append((step, _held_out(w, model)))
            if ck is not None:
                ck.save(step)
        if ck is not None and step in fail_at:
            ck.close()  # the process dies; a new one starts from the store
            fail_at.discard(step)
            torch.manual_seed(step)
            model = w.make_model()
            opt = w.make_optimizer(model)
            sched = _schedule(opt, w.steps)
            ck = checkpointer(model, opt, sched)
            step = ck.restore("main") or 0
            out.exact_resumes += bool(ck.restored_exact)
    if ck is not None:
        ck.close()
    out.final = _held_out(w, model)
    if repo is not None:
        rows = repo.du()
        out.logical = rows[-1].cumulative_logical_bytes
        out.residual = sum(r.residual_bytes for r in rows)
        out.stored = rows[-1].cumulative_stored_bytes - out.residual
    tmp.cleanup()
    return out


def plot(results: dict[str, dict[str, Run]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 3.6), dpi=110)
    for ax, (name, runs) in zip(np.atleast_1d(axes), results.items(), strict=True):
        for label, r in runs.items():
            steps, losses = zip(*r.curve, strict=True)
            ax.plot(steps, losses, label=label)
        ax.set_title(f"{name}: {FAILURES} failures")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


MODES = {"uninterrupted, never compressed": None, "exact_resume=1 (default)": 1, "exact_resume=0": 0}


def markdown(quick: bool = False) -> str:
    warnings.simplefilter("ignore", UserWarning)
    workloads = [_digits(300 if quick else 600), _language(200 if quick else 500)]
    results = {w.name: {label: run(w, mode) for label, mode in MODES.items()} for w in workloads}
    lines = [
        f"{FAILURES} failures evenly spread over each run, each resumed in a fresh model, optimizer and "
        f"Checkpointer from the newest version (search tolerance {TOLERANCE:.0%} of held-out loss). "
        "Final held-out loss against the uninterrupted run that never compressed; the whole state's "
        "ratio over every version (history) and on disk with the newest version's restore residual.",
        "",
        "| workload | resume | exact resumes | final loss | vs uninterrupted | history ratio | on disk | "
        "residual share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        base = runs["uninterrupted, never compressed"].final
        for label, r in runs.items():
            if MODES[label] is None:
                lines.append(f"| {name} | {label} | - | {r.final:.4f} | - | - | - | - |")
                continue
            disk = r.stored + r.residual
            lines.append(
                f"| {name} | {label} | {r.exact_resumes}/{FAILURES} | {r.final:.4f} | "
                f"{(r.final - base) / base:+.2%} | {r.logical / max(r.stored, 1):.1f}x | "
                f"{r.logical / max(disk, 1):.1f}x | {r.residual / max(disk, 1):.0%} |")
    if plot(results, PLOT):
        lines += ["", f"![held-out loss with failures](img/{PLOT.name})"]
    return "\n".join(lines)


#: the weights' configuration of every version in the sweep (exact_resume=0, moments compressed)
SWEEP: dict[str, int | str | None] = {
    "the default search space": None, "16 levels, no pruning": 16, "64 levels, no pruning": 64,
    "256 levels, no pruning (the resume space before closed-loop versions)": 256,
    "16-64 levels, up to 40 % pruned (the resume space)": "resume"}


def sweep(quick: bool = False) -> str:
    """Why exact_resume=0 searches the resume space: the final loss after ten lossy restores
    with the weights stored at fixed resolutions (``--sweep``; docs/guides/what-you-get-back.md)."""
    warnings.simplefilter("ignore", UserWarning)
    workloads = [_digits(300 if quick else 600), _language(200 if quick else 500)]
    lines = ["| weights stored with | " + " | ".join(w.name for w in workloads) + " |",
             "|---|" + "---|" * len(workloads)]
    base = {w.name: run(w, None).final for w in workloads}
    for label, bins in SWEEP.items():
        cells = []
        for w in workloads:
            space = (SearchPolicy().space if bins is None else SearchPolicy().resume_space if bins == "resume"
                     else SearchSpace(bins=(int(bins),), prune=(0.0,), metrics=("magnitude",), protect=(0.005,)))
            # resume_space=space: with exact_resume=0 the Checkpointer searches the resume space
            r = run(w, 0, space=space, resume_space=space)
            cells.append(f"{(r.final - base[w.name]) / base[w.name]:+.2%}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(sweep(quick="--quick" in sys.argv) if "--sweep" in sys.argv else markdown(quick="--quick" in sys.argv))

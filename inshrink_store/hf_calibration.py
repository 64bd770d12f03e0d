"""Calibrating an import: which tensors of a Hugging Face text model matter, measured on the user's text.
Layer: Hugging Face, below Lightning and the CLI, above ``torch``.

``inshrink import model.safetensors STORE --target-ratio 12 --calibrate lines.txt`` needs the
model itself, not only its tensors: the calibration runs it. The tool can build a model when
the checkpoint is a ``.safetensors`` file inside a Hugging Face model folder: ``config.json``
and the tokenizer's files beside it, an architecture the installed ``transformers`` builds
with ``AutoModel`` (BERT, RoBERTa, DistilBERT, MiniLM, MPNet, ELECTRA, GPT-2 and the other
text encoders and decoders). The model is built from ``config.json`` and loaded with the
checkpoint's own tensors (not whatever weights the folder also holds); the text file's lines
(up to :data:`MAX_LINES`, each cut at :data:`MAX_TOKENS` tokens) are the calibration batch.
What is measured and why: :mod:`inshrink_store.torch.calibration`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from inshrink_store.errors import FormatError, InvalidInputError, require
from inshrink_store.policy import Allocation, AllocationPlanner

#: calibration lines read from the text file (more add time, little precision)
MAX_LINES = 256
#: tokens per line
MAX_TOKENS = 128


def _lines(text: Path) -> list[str]:
    try:
        raw = text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"Expected a UTF-8 text file of calibration lines at {str(text)!r}. Got {exc} "
                                "instead.") from exc
    lines = [line.strip() for line in raw.splitlines() if line.strip()][:MAX_LINES]
    if not lines:
        raise InvalidInputError(f"Expected at least one non-empty line of calibration text in {str(text)!r}. "
                                "Got none instead.")
    return lines


def _key_of(name: str, keys: set[str]) -> str | None:
    """The checkpoint key of a model parameter: the name itself, or the name under the
    shortest prefix (``bert.`` for a task model's file read by the base model)."""
    if name in keys:
        return name
    matches = sorted((k for k in keys if k.endswith("." + name)), key=len)
    return matches[0] if matches else None


def calibrated_planner(checkpoint: Path, text: Path, allocation: Allocation, file_keys: Iterable[str],
                       prefix: str = "model/") -> AllocationPlanner:
    """The allocation planner of ``allocation`` for the tensors of ``checkpoint`` (stored as
    ``prefix + key``), with weights and Linear input moments measured on the lines of ``text``."""
    folder = checkpoint.resolve().parent
    if checkpoint.suffix != ".safetensors" or not (folder / "config.json").is_file():
        raise FormatError(
            f"Expected --calibrate's checkpoint to be a .safetensors file in a Hugging Face model folder "
            f"(config.json beside it). Got {str(checkpoint)!r} instead; without the model's architecture the "
            "tool cannot run it on your text. Calibrate in Python instead: inshrink_store.torch.allocate(model, "
            "calibration=...)."
        )
    transformers = require("transformers", "hf")
    torch = require("torch", "torch")
    from safetensors.torch import load_file

    from inshrink_store.torch.calibration import allocate

    try:
        config = transformers.AutoConfig.from_pretrained(str(folder))
        model = transformers.AutoModel.from_config(config)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError) as exc:
        raise FormatError(f"Expected a model and tokenizer transformers can build from {str(folder)!r}. "
                          f"Got {type(exc).__name__}: {exc} instead.") from exc
    tensors = load_file(str(checkpoint))
    keys = set(file_keys)
    mapping = {name: _key_of(name, keys) for name, _ in model.named_parameters()}
    found = {name: key for name, key in mapping.items() if key is not None}
    if len(found) < max(1, len(mapping) // 2):
        missing = sorted(n for n, k in mapping.items() if k is None)[:5]
        raise FormatError(
            f"Expected the checkpoint's tensors to be the parameters of the model config.json describes. Got "
            f"{len(found)} of {len(mapping)} found (missing e.g. {missing}) instead."
        )
    own = model.state_dict()
    model.load_state_dict({n: tensors[k].to(own[n].dtype) for n, k in found.items() if n in own}, strict=False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    batch: dict[str, Any] = dict(tokenizer(_lines(text), padding=True, truncation=True, max_length=MAX_TOKENS,
                                           return_tensors="pt"))
    if "token_type_ids" in batch and "token_type_ids" not in model.forward.__code__.co_varnames:
        batch.pop("token_type_ids")
    with torch.random.fork_rng():
        measured = allocate(model, target_ratio=allocation.target_ratio, max_error=allocation.max_error,
                            calibration=batch, protect=allocation.protect, protected_dtype=allocation.protected_dtype,
                            levels=allocation.levels, min_numel=allocation.min_numel,
                            codebook_reuse_tolerance=allocation.codebook_reuse_tolerance,
                            channel_scales=allocation.channel_scales)
    rename = {name: prefix + key for name, key in found.items()}
    weights = {rename[n]: w for n, w in (measured.weights or {}).items() if n in rename}
    hessians = {rename[n]: h for n, h in measured.hessians.items() if n in rename}
    return AllocationPlanner(allocation, module_kinds={rename[n]: k for n, k in measured.module_kinds.items()
                                                       if n in rename},
                             weights=weights, hessians=hessians)

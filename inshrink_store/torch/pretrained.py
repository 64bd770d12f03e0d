"""A version as a folder ``transformers``' ``from_pretrained`` loads (``inshrink export --format hf``).
Layer: torch, below Hugging Face and Lightning, above the facade (a client of the store).

What ``save_pretrained`` writes, and only that: ``model.safetensors`` (the model's state dict
by its own keys, without the store's ``model/``; weights the model ties once; ``{"format":
"pt"}`` in its metadata as transformers writes it) and ``config.json``. The weights alone do
not say which architecture they belong to, so the config comes from, the first found winning:

1. ``config=`` (``--config``): a folder holding ``config.json``, that file, or a dict;
2. the version itself: ``extra/hf_config``, the ``config.json`` text
   (:func:`config_json`) that :class:`~inshrink_store.hf.InshrinkCallback` records with every
   save, and that a ``Checkpointer`` or ``save_state`` user stores with
   ``extra={"hf_config": config_json(model)}``;
3. ``copy_from``'s ``config.json``.

``copy_from`` (``--copy-from``) copies the rest of an original model folder (tokenizer,
generation config, a SentenceTransformer's module configs) but never a weight file: the
weights are the version's. Writing the folder does not need transformers; where it is
installed, the config's model is built on the meta device to learn which weights it ties
(a version stores a tied parameter once and reads it back as one tensor under both names,
but a Checkpointer's versions written before issue 41 kept two copies, and a state saved without the live tensors
cannot show its ties).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from inshrink_store.errors import FormatError, NotFoundError, require
from inshrink_store.torch.checkpoint_files import export_state, save_safetensors, write_atomically
from inshrink_store.torch.tensors import ExactBits, reader_state

if TYPE_CHECKING:
    from inshrink_store import SnapshotReader

torch = require("torch", "torch")
log = logging.getLogger(__name__)

__all__ = ["HF_CONFIG", "PretrainedExport", "config_json", "export_pretrained"]

#: where a version keeps its transformers config: the JSON text of ``config.json``
HF_CONFIG = "extra/hf_config"
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
#: weight files of any framework: ``copy_from`` never copies them (the weights are the version's)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".ot",
                   ".gguf", ".pb", ".tflite", ".npz")


@dataclasses.dataclass(frozen=True)
class PretrainedExport:
    """What :func:`export_pretrained` wrote: ``tensors`` in ``model.safetensors``, where the
    config came from (``"config"``, ``"version"`` or ``"copy_from"``), and the files copied
    from ``copy_from`` (relative paths)."""

    directory: Path
    tensors: int
    config_from: str
    copied: tuple[str, ...]


def config_json(model: object) -> str:
    """The ``config.json`` text ``save_pretrained`` would write for ``model`` (a transformers
    model, or its config): only the settings that differ from the config class's defaults,
    ``architectures`` naming the model's class and ``dtype`` its dtype, as ``save_pretrained``
    sets them, so that ``AutoModel...from_pretrained`` and pipelines pick the right head. Store it with a
    version as ``extra={"hf_config": config_json(model)}``."""
    config: Any = getattr(model, "config", model)  # duck-typed: checked just below
    if not callable(getattr(config, "to_json_string", None)):
        raise FormatError(
            f"Expected a transformers model or config (with .config.to_json_string()). Got "
            f"{type(model).__name__} instead; pass the model whose weights the version holds.")
    data = json.loads(config.to_json_string(use_diff=True))
    if config is not model:
        data["architectures"] = [type(model).__name__]
        dtype = getattr(model, "dtype", None)
        if isinstance(dtype, torch.dtype) and "torch_dtype" not in data:  # transformers < 4.56 names it so
            data["dtype"] = str(dtype).removeprefix("torch.")
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def export_pretrained(reader: SnapshotReader, directory: str | os.PathLike[str], *,
                      config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
                      copy_from: str | os.PathLike[str] | None = None, residual: ExactBits | None = None,
                      progress: Callable[[str, int, int], None] | None = None) -> PretrainedExport:
    """Write ``reader``'s version to ``directory`` (created if missing) as ``save_pretrained``
    would: ``model.safetensors`` and ``config.json`` (module docstring: where the config comes
    from), then ``copy_from``'s other files. Quantized tensors are written as their stored
    values in the dtype they were saved in; with the version's ``residual``, the exact bits."""
    directory = Path(directory)
    source = None if copy_from is None else _source_folder(copy_from)
    if directory.exists() and not directory.is_dir():
        raise FormatError(
            f"Expected a folder to export to (from_pretrained loads a folder). Got the file "
            f"{str(directory)!r} instead; name a folder, e.g. {str(directory.with_suffix(''))!r}.")
    if source is not None and directory.resolve() == source.resolve():
        raise FormatError(
            f"Expected an export folder other than --copy-from's. Got {str(directory)!r} for both instead: "
            "the export would overwrite the original's weights; export to a new folder.")
    text, config_from = _config_text(reader, config, source)
    state = _model_state(export_state(reader, residual=residual, progress=progress))
    with tempfile.TemporaryDirectory(prefix="inshrink-config-") as scratch:  # asked before anything is written
        _write_text(str(Path(scratch) / CONFIG_NAME), text)
        model = _config_model(Path(scratch))
    if model is not None:
        state = _matched(state, model[0])
    directory.mkdir(parents=True, exist_ok=True)
    write_atomically(directory / CONFIG_NAME, lambda tmp: _write_text(tmp, text))
    weights = _weights(state, model[1] if model is not None and _has_duplicates(state) else None)
    save_safetensors(weights, directory / WEIGHTS_NAME, {"format": "pt"})
    copied = _copy_folder(source, directory) if source is not None else ()
    return PretrainedExport(directory, len(weights), config_from, copied)


def _write_text(path: str, text: str) -> None:
    Path(path).write_text(text, encoding="utf-8")


def _source_folder(copy_from: str | os.PathLike[str]) -> Path:
    source = Path(copy_from)
    if not source.is_dir():
        raise FormatError(
            f"Expected --copy-from to name the original model's folder (its tokenizer and config files). "
            f"Got {str(source)!r}, {'a file' if source.exists() else 'which does not exist'}, instead; name "
            "the folder from_pretrained loaded the model from.")
    return source


def _config_text(reader: Any, config: Any, source: Path | None) -> tuple[str, str]:
    """``config.json``'s text and where it came from (module docstring: the order)."""
    if isinstance(config, Mapping):
        return _checked(dict(config), "config="), "config"
    if config is not None:
        return _read_config(Path(config)), "config"
    stored = _stored_config(reader)
    if stored is not None:
        return stored, "version"
    if source is not None and (source / CONFIG_NAME).is_file():
        return _read_config(source / CONFIG_NAME), "copy_from"
    raise NotFoundError(
        f"Expected a model config for the from_pretrained folder. Got none instead: version "
        f"{reader.id[:12]} holds no {HF_CONFIG} (InshrinkCallback records it; a Checkpointer or save_state "
        "adds it with extra={'hf_config': config_json(model)}); pass --config with the original model's "
        "folder or its config.json (Python: config=...), or --copy-from a folder that has one.")


def _stored_config(reader: Any) -> str | None:
    try:
        value = reader_state(reader, prefix=HF_CONFIG)
    except NotFoundError:
        return None
    if isinstance(value, Mapping):
        return _checked(dict(value), f"the version's {HF_CONFIG}")
    if not isinstance(value, str):
        raise FormatError(
            f"Expected {HF_CONFIG} of version {reader.id[:12]} to be config.json's text. Got "
            f"{type(value).__name__} instead; pass --config with the model's config.json.")
    return _checked(_parse(value, f"the version's {HF_CONFIG}"), f"the version's {HF_CONFIG}")


def _read_config(path: Path) -> str:
    file = path / CONFIG_NAME if path.is_dir() else path
    if not file.is_file():
        raise NotFoundError(
            f"Expected a config.json at {str(file)!r}. Got {'a folder without one' if path.is_dir() else 'no such file'} "
            "instead; pass the folder the model was loaded from, or its config.json.")
    return _checked(_parse(file.read_text(encoding="utf-8"), str(file)), str(file))


def _parse(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise FormatError(f"Expected {where} to be JSON (a transformers config.json). Got: {exc}") from None


def _checked(data: Any, where: str) -> str:
    """The config as ``save_pretrained`` formats it, once it is one: AutoConfig needs
    ``model_type`` to know which config class (and so which model) to build."""
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        got = "a JSON object without model_type" if isinstance(data, dict) else type(data).__name__
        raise FormatError(
            f"Expected {where} to be a transformers config (a JSON object with model_type, e.g. \"bert\"). "
            f"Got {got} instead; pass the config.json of the model these weights belong to.")
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _model_state(state: Any) -> dict[str, Any]:
    """The version's model state dict, once it is one: tensors by state-dict key."""
    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise FormatError(
                f"Expected the model's state dict to hold tensors only. Got {type(tensor).__name__} at "
                f"{key!r} instead: a from_pretrained folder holds weights; export it to a .pt with --all.")
        if "/" in key:
            raise FormatError(
                f"Expected the version to hold a model state dict (stored under model/). Got stored paths "
                f"such as {key!r} instead; save the weights as save_state(repo, {{'model': state_dict}}).")
    return dict(state)


def _weights(state: dict[str, Any], tied: list[list[str]] | None) -> dict[str, Any]:
    """The model's state dict by its keys, as ``save_pretrained`` writes it: of each group of
    keys the config's model ties (``tied``), only the first (the input embedding, not the head
    that shares it), since ``from_pretrained`` ties the others again; a tied key whose values
    differ stays. Any other tensor stored under several keys is written under each, copied:
    safetensors refuses tensors that share memory, and a key the model does not tie again
    must hold its own values."""
    state = dict(state)
    for group in tied or []:
        present = [key for key in group if key in state]
        for key in present[1:]:
            kept = state[present[0]]
            if state[key] is kept or (state[key].shape == kept.shape and state[key].dtype == kept.dtype
                                      and torch.equal(state[key], kept)):
                del state[key]
            else:
                log.warning("%s and %s are tied in the model but differ in the version: both written, and "
                            "from_pretrained keeps one of them", present[0], key)
    weights: dict[str, Any] = {}
    seen: set[int] = set()
    for key, tensor in state.items():  # tied keys come back from the store as one tensor object
        weights[key] = tensor.clone() if id(tensor) in seen else tensor
        seen.add(id(tensor))
    return weights


def _has_duplicates(state: Mapping[str, Any]) -> bool:
    """Whether two keys hold one tensor or the same values: only then can the model's ties
    matter, and only then is transformers imported to learn them (seconds, for the CLI)."""
    if len({id(t) for t in state.values()}) < len(state):
        return True
    seen: set[Any] = set()
    for tensor in state.values():
        if not isinstance(tensor, torch.Tensor):
            continue
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        key = (tuple(tensor.shape), tensor.dtype, xxhash.xxh3_128_digest(data))
        if key in seen:
            return True
        seen.add(key)
    return False


def _config_model(directory: Path) -> tuple[list[str], list[list[str]]] | None:
    """The state-dict keys the model of ``directory``'s config.json loads, and the groups of
    them it ties (one parameter under several names), each in the model's order; asked of the
    model itself, built by transformers on the meta device (no memory, no weights). None when
    transformers is missing or cannot build it (a remote-code model is never run): the keys
    are then written as stored and nothing is dropped."""
    try:
        import transformers
    except ImportError:
        return None
    verbosity = transformers.logging.get_verbosity()
    # its warnings about the config are from_pretrained's to give
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # unannotated in transformers
    try:
        config = transformers.AutoConfig.from_pretrained(str(directory))
        names = getattr(config, "architectures", None) or []
        cls = getattr(transformers, names[0], None) if names else None
        with torch.device("meta"):
            model = (cls(config) if cls is not None
                     else transformers.AutoModel.from_config(config))  # type: ignore[no-untyped-call]  # unannotated in transformers
    except Exception as exc:  # any failure only means the model's keys are not known
        log.info("could not build the config's model to learn its keys and tied weights (%s): all keys "
                 "written as stored", exc)
        return None
    finally:
        transformers.logging.set_verbosity(verbosity)
    groups: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(tensor), []).append(name)
    keys = [name for names in groups.values() for name in names]
    return keys, [names for names in groups.values() if len(names) > 1]


def _matched(state: dict[str, Any], expected: list[str]) -> dict[str, Any]:
    """The version's state dict under the keys ``from_pretrained`` looks for.

    Why: a training framework's state dict names the transformers model by the attribute
    that holds it (a LightningModule's ``self.model`` gives ``model.transformer.wte.weight``).
    Written as stored, ``from_pretrained`` matches none of those keys and initialises every
    weight at random, saying so only in a log line. So: when one key prefix (``model.``)
    makes more of the version's keys the model's own than the keys as stored do, that prefix
    is taken off and the keys outside it (a loss module's, a metric's) are left out, logged;
    when no key matches the model at all, the export is refused rather than written."""
    wanted = set(expected)
    hits: dict[str, int] = {"": sum(key in wanted for key in state)}
    for key in state:  # each prefix (up to a dot) that leaves one of the model's keys
        for i, ch in enumerate(key):
            if ch == "." and key[i + 1:] in wanted:
                hits[key[: i + 1]] = hits.get(key[: i + 1], 0) + 1
    best = max(sorted(hits), key=lambda prefix: hits[prefix])  # ties: the shortest, "" first
    best_hits = hits[best]
    if best_hits == 0:
        raise FormatError(
            f"Expected the version's state dict to hold the weights of the config's model (keys such as "
            f"{expected[0]!r}). Got keys such as {next(iter(state), '(none)')!r} instead, none of them the "
            "model's: from_pretrained would initialise every weight at random. Export the model's own state "
            "dict (save it under model/), or pass the config of the model these weights belong to.")
    if not best:
        return state
    left_out = sorted(key for key in state if not key.startswith(best))
    if left_out:
        log.warning("exported the weights under %r without that prefix, as from_pretrained names them; left "
                    "out %d tensor(s) outside it: %s", best, len(left_out), ", ".join(left_out[:5]))
    return {key[len(best):]: tensor for key, tensor in state.items() if key.startswith(best)}


def _copy_folder(source: Path, directory: Path) -> tuple[str, ...]:
    """Copy ``source``'s files (subfolders too, links followed: a hub cache's snapshot folder
    holds links; hidden names skipped) but its weights and its ``config.json``, which
    the export writes from the config in use."""
    copied = []
    for root, dirs, files in os.walk(source):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            relative = (Path(root) / name).relative_to(source)
            if name.startswith(".") or name.lower().endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json"):
                continue
            if relative.as_posix() == CONFIG_NAME:
                continue
            target = directory / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(root) / name, target)
            copied.append(relative.as_posix())
    return tuple(copied)

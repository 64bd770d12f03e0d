"""Checkpoint files in and out of a store (the CLI layer, the package's top layer):
``import`` (a .safetensors or .pt file as a new version, lossless or quantized, with the
checks of its quantization options) and ``export`` (a version as a .safetensors or .pt
file, or a folder ``from_pretrained`` loads).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer

import inshrink_store as ins
from inshrink_store._cli.core import _flag, _n, _say, out, progress_bar
from inshrink_store._cli.opening import _open, _open_for_import
from inshrink_store.errors import FormatError
from inshrink_store.policy import DEFAULT_MOMENTS, MAX_LEVELS, Allocation, QuantizationRecord


def _check_allocation_options(target_ratio: float | None, max_error: float | None, bins: int | None,
                              prune: float | None, protect: float | None, embedding_bins: int | None) -> Any:
    """Usage errors (exit 2) for --target-ratio / --max-error; the Allocation to import with,
    or None when neither was given."""
    if target_ratio is None and max_error is None:
        return None
    if target_ratio is not None and max_error is not None:
        raise typer.BadParameter(
            "Expected one of --target-ratio and --max-error. Got both instead; keep the one you "
            "care about (a size, or an error).", param_hint="'--max-error'")
    given = "--target-ratio" if target_ratio is not None else "--max-error"
    clash = [name for name, value in (("--bins", bins), ("--prune", prune),
                                      ("--embedding-bins", embedding_bins)) if value is not None]
    if clash:
        raise typer.BadParameter(
            f"Expected {given} without {', '.join(clash)}: it picks each tensor's levels itself "
            f"(and never prunes). Got both instead; drop {', '.join(clash)}, or {given}.",
            param_hint=f"'{clash[0]}'")
    if target_ratio is not None and not (math.isfinite(target_ratio) and target_ratio >= 1):
        raise typer.BadParameter(f"Expected a ratio of at least 1 (e.g. 12). Got {target_ratio} instead.",
                                 param_hint="'--target-ratio'")
    if max_error is not None and not (math.isfinite(max_error) and max_error > 0):
        raise typer.BadParameter(
            f"Expected a relative error above 0 (e.g. 0.05 for 5 %). Got {max_error} instead.",
            param_hint="'--max-error'")
    if protect is not None and not 0.0 <= protect <= 0.5:
        raise typer.BadParameter(f"Expected a fraction from 0 to 0.5. Got {protect} instead; e.g. "
                                 "--protect 0.005.", param_hint="'--protect'")
    from inshrink_store.policy import Allocation

    return Allocation(target_ratio=target_ratio, max_error=max_error,
                      protect=0.005 if protect is None else protect)


def _check_quantize_options(bins: int | None, prune: float | None, protect: float | None,
                            prune_metric: str | None, embedding_bins: int | None) -> Any:
    """Usage errors (exit 2) for out-of-range or orphaned quantization options; the
    QuantConfig to import with, or None for a lossless import."""
    for name, value in (("--bins", bins), ("--embedding-bins", embedding_bins)):
        if value is not None and not 2 <= value <= MAX_LEVELS:
            raise typer.BadParameter(
                f"Expected a whole number from 2 to {MAX_LEVELS} (usually 4 to 32). Got {value} "
                f"instead; e.g. {name} 16.", param_hint=f"'{name}'")
    for name, fraction in (("--prune", prune), ("--protect", protect)):
        if fraction is not None and not 0.0 <= fraction <= 0.5:
            raise typer.BadParameter(
                f"Expected a fraction from 0 to 0.5. Got {fraction} instead; e.g. {name} 0.1 "
                "(10% of the values).", param_hint=f"'{name}'")
    if prune_metric is not None and prune_metric != "magnitude":
        why = ("a checkpoint file holds no gradients to score sensitivity with; use magnitude "
               "(sensitivity needs the Checkpointer in a training loop)"
               if prune_metric == "sensitivity" else "use magnitude")
        raise typer.BadParameter(f"Expected magnitude. Got {prune_metric!r} instead: {why}.",
                                 param_hint="'--prune-metric'")
    if bins is None:
        given = [name for name, value in (("--prune", prune), ("--protect", protect),
                                          ("--prune-metric", prune_metric),
                                          ("--embedding-bins", embedding_bins)) if value is not None]
        if given:
            raise typer.BadParameter(
                f"Expected --bins with {', '.join(given)} (they only apply when quantizing). Got no "
                "--bins instead; add --bins N (e.g. --bins 16), or drop them for a lossless import.",
                param_hint=f"'{given[0]}'")
        return None
    from inshrink_store.policy import QuantConfig

    return QuantConfig(bins=bins, prune=0.0 if prune is None else prune, prune_metric="magnitude",
                       protect=0.005 if protect is None else protect,
                       embedding_bins=16 if embedding_bins is None else embedding_bins)


def import_(
    file: Annotated[Path, typer.Argument(help=".safetensors, or .pt/.pth (state_dict or {model, optimizer})")],
    url: str,
    message: Annotated[str, typer.Option("--message", "-m")] = "",
    step: Annotated[int | None, typer.Option("--step")] = None,
    branch: Annotated[str, typer.Option("--branch")] = "main",
    bins: Annotated[int | None, typer.Option(
        "--bins", help=f"Quantize float tensors (2-D and up, under model/) to this many levels, 2..{MAX_LEVELS}; "
        "without it the import is lossless.")] = None,
    prune: Annotated[float | None, typer.Option(
        "--prune", help="With --bins: fraction (0..0.5) of each tensor's smallest values set to 0. [default: 0]")] = None,
    prune_metric: Annotated[str | None, typer.Option(
        "--prune-metric", help="With --bins: what --prune ranks by; only magnitude for a file (it has no "
        "gradients). [default: magnitude]")] = None,
    protect: Annotated[float | None, typer.Option(
        "--protect", help="With --bins: fraction (0..0.5) of the largest values kept in bfloat16. "
        "[default: 0.005]")] = None,
    embedding_bins: Annotated[int | None, typer.Option(
        "--embedding-bins", help="With --bins: levels for embedding tables: 2-D weights whose module name "
        "ends in embed/emb/embedding(s) (tok_embeddings, word_embeddings, pos_emb...), starts with embed_ "
        "(embed_tokens, embed_positions), or is wte/wpe. [default: 16]")] = None,
    create: Annotated[bool, _flag(
        "--create", help="Create the store in an empty folder. A path where nothing exists yet is "
        "always created (and said so on stderr); a folder of other files never is.")] = False,
    optimizer: Annotated[str | None, typer.Option(
        "--optimizer", help="The file's optimizer state: 'compressed' (Adam moments quantized, each "
        "checked by the update it drives) or 'lossless'. [default: compressed with --bins, "
        "--target-ratio or --max-error, else lossless]")] = None,
    target_ratio: Annotated[float | None, typer.Option(
        "--target-ratio", help="Instead of --bins: choose each tensor's levels so that the model's "
        "tensors are stored this many times smaller (e.g. 12), with the least error for those bytes.")] = None,
    max_error: Annotated[float | None, typer.Option(
        "--max-error", help="Instead of --bins: the fewest bytes whose root-mean-square relative "
        "weight error over the quantized tensors is at most this (e.g. 0.05).")] = None,
    calibrate: Annotated[Path | None, typer.Option(
        "--calibrate", help="With --target-ratio or --max-error: a UTF-8 text file, one example per line "
        "(up to 256 are used), on which the model is run to measure which tensors matter and to round "
        "its Linear layers for their outputs. The checkpoint must be a .safetensors file in a Hugging Face "
        "model folder (config.json and the tokenizer beside it) of a text model transformers builds with "
        "AutoModel (BERT, RoBERTa, DistilBERT, MiniLM, MPNet, GPT-2...). Without it, tensors are weighted "
        "by their role (embeddings, attention, MLP).")] = None,
) -> None:
    """Import a checkpoint file as a new version; prints the snapshot id.

    With --bins (or --target-ratio / --max-error) the version records its quantization
    settings (shown by `inshrink log`)."""
    from inshrink_store.torch import load_checkpoint_file, save_state

    quantize = _check_allocation_options(target_ratio, max_error, bins, prune, protect, embedding_bins)
    if calibrate is not None and quantize is None:
        raise typer.BadParameter("Expected --target-ratio or --max-error with --calibrate (it tells the "
                                 "allocation which tensors matter). Got neither instead.", param_hint="'--calibrate'")
    if quantize is None:
        quantize = _check_quantize_options(bins, prune, protect, prune_metric, embedding_bins)
    if optimizer is not None and optimizer not in ("compressed", "lossless"):
        raise typer.BadParameter(f"Expected compressed or lossless. Got {optimizer!r} instead.",
                                 param_hint="'--optimizer'")
    compressed = optimizer == "compressed" or (optimizer is None and quantize is not None)
    if file.is_dir():
        raise FormatError(
            f"Expected a checkpoint file (.safetensors, .pt or .pth). Got the directory {str(file)!r} "
            "instead; name one file inside it."
        )
    if not file.is_file():
        raise ins.NotFoundError(
            f"Expected a checkpoint file at {str(file)!r}. Got no such file instead; check the path."
        )
    state = load_checkpoint_file(file)  # a file that is no checkpoint fails before a store is created
    planner: Any = quantize
    if calibrate is not None and isinstance(quantize, Allocation):
        from inshrink_store.hf_calibration import calibrated_planner

        # measured before the store is touched: a model that cannot be built fails first
        planner = calibrated_planner(file, calibrate, quantize, state.get("model", {}).keys())
    repo = _open_for_import(url, create)
    commit: dict[str, Any] = {}
    if quantize is not None:
        # a fixed configuration, not a search: nothing was measured against a tolerance
        record = (QuantizationRecord(config=None, allocation=quantize, tolerance=0.0, higher_is_better=True)
                  if isinstance(quantize, Allocation) else
                  QuantizationRecord(config=quantize, tolerance=0.0, higher_is_better=True))
        commit["metadata"] = {"quantization": record.to_dict()}
    with progress_bar("import") as update:
        info = save_state(repo, state, message=message or file.name, step=step, branch=branch,
                          quantize=planner, moments=DEFAULT_MOMENTS if compressed else None,
                          progress=update, **commit)
    _say(out, info.id)

EXPORT_FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch"}
#: --format's values -> the format; ``hf`` is a folder, the others a file whose extension agrees
FORMAT_NAMES = {"safetensors": "safetensors", "pt": "torch", "hf": "hf"}


def export(
    url: str, ref: str,
    output: Annotated[Path, typer.Argument(
        metavar="OUT", help="Output file; its extension picks the format: .safetensors, or .pt/.pth "
        "(torch.save of the model's state dict; loads with torch.load(weights_only=True)). With "
        "--format hf, a folder (created if missing).")],
    all_tensors: Annotated[bool, _flag("--all", help="The whole saved state: .pt/.pth hold it nested as saved "
                                       "({'model': ..., 'optimizer': ..., ...}: load_state_dict takes each part); "
                                       ".safetensors is flat, one tensor per stored path "
                                       "(optimizer/state/0/exp_avg), the structure as JSON in its metadata.")] = False,
    exact: Annotated[bool, _flag("--exact", help="The exact bits the version was saved from (its restore "
                                 "residual; only the newest versions of a branch keep one).")] = False,
    format_: Annotated[str | None, typer.Option(
        "--format", metavar="FORMAT", help="hf: a folder transformers' from_pretrained loads (model.safetensors "
        "and config.json, as save_pretrained writes them). safetensors or pt: as OUT's extension says. "
        "[default: from OUT's extension]")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", metavar="PATH", help="With --format hf: the model's config.json, or the folder holding it "
        "(the original model's). [default: the config the version was saved with (InshrinkCallback records "
        "it), else --copy-from's config.json]")] = None,
    copy_from: Annotated[Path | None, typer.Option(
        "--copy-from", metavar="DIR", help="With --format hf: also copy this folder's other files (tokenizer, "
        "generation and SentenceTransformer configs), never its weights; e.g. the folder the model was "
        "loaded from.")] = None,
) -> None:
    """Write a version's model tensors (a Checkpointer's model/, a Lightning checkpoint's
    state_dict; every tensor with --all) to a .safetensors, .pt or .pth file, or with --format hf
    to a folder from_pretrained loads (bit-exact for lossless versions, and with --exact for
    the newest versions of a Checkpointer's branch)."""
    if format_ is not None and format_ not in FORMAT_NAMES:
        raise typer.BadParameter(f"Expected one of {', '.join(FORMAT_NAMES)}. Got {format_!r} instead; e.g. "
                                 "--format hf for a from_pretrained folder.", param_hint="'--format'")
    if format_ != "hf" and (config is not None or copy_from is not None):
        given = "--config" if config is not None else "--copy-from"
        raise typer.BadParameter(f"Expected {given} with --format hf only. Got it for a file export instead; "
                                 f"add --format hf (OUT is then a folder), or drop {given}.", param_hint=f"'{given}'")
    if format_ == "hf":
        if all_tensors:
            raise typer.BadParameter(
                "Expected --format hf without --all. Got both instead: a from_pretrained folder holds the "
                "model's weights only; export the whole state to a .pt with --all.", param_hint="'--all'")
        if output.exists() and not output.is_dir():
            raise FormatError(
                f"Expected a folder for --format hf (from_pretrained loads a folder). Got the file "
                f"{str(output)!r} instead; name a folder, e.g. {str(output.with_suffix(''))!r}.")
        fmt = "hf"
    else:
        fmt = _export_file_format(output, format_)
    repo = _open(url)
    reader = repo.checkout(ref)
    residual = repo.residual(reader.id) if exact else None
    if exact and residual is None and any(a.storage == "quantized" for a in reader.arrays().values()):
        raise ins.NotFoundError(
            f"Expected the restore residual of {ref!r} ({reader.id[:12]}) for --exact. Got none instead: only "
            "the newest versions of a branch keep one (Checkpointer exact_resume), and gc collects the rest; "
            "export without --exact for the stored values.")
    bit_exact = " (bit-exact)" if residual is not None else ""
    with progress_bar("export") as update:
        if fmt == "hf":
            from inshrink_store.torch import export_pretrained

            done = export_pretrained(reader, output, config=config, copy_from=copy_from, residual=residual,
                                     progress=update)
        elif fmt == "safetensors":
            from inshrink_store.torch import export_safetensors

            count = export_safetensors(reader, output, include_all=all_tensors, progress=update, residual=residual)
        else:
            from inshrink_store.torch import export_torch

            count = export_torch(reader, output, include_all=all_tensors, progress=update, residual=residual)
    if fmt != "hf":
        _say(out, f"wrote {_n(count, 'tensor')} to ", str(output), bit_exact)
        return
    where = {"config": "--config", "version": "the version", "copy_from": "--copy-from"}[done.config_from]
    _say(out, f"wrote {_n(done.tensors, 'tensor')} to ", str(output / "model.safetensors"), bit_exact,
         f", config.json from {where}",
         f", {_n(len(done.copied), 'file')} copied from " if done.copied else "",
         str(copy_from) if done.copied else "")


def _export_file_format(output: Path, format_: str | None) -> str:
    """The file format OUT's extension names (which --format, if given, must agree with), once
    OUT's folder exists."""
    if output.is_dir():
        raise FormatError(
            f"Expected a file path to export to. Got the directory {str(output)!r} instead; name a "
            f"file, e.g. {str(output / 'model.safetensors')!r}, or add --format hf for a from_pretrained folder."
        )
    fmt = EXPORT_FORMATS.get(output.suffix.lower())
    if fmt is None:
        raise typer.BadParameter(
            f"Expected a file name ending in .safetensors, .pt or .pth (it picks the format). Got "
            f"{output.name!r} instead; e.g. {str(output.with_suffix('.safetensors'))!r}, or add --format hf "
            "for a from_pretrained folder.", param_hint="'OUT'")
    if format_ is not None and FORMAT_NAMES[format_] != fmt:
        raise typer.BadParameter(
            f"Expected OUT to end in {'.safetensors' if format_ == 'safetensors' else '.pt or .pth'} for "
            f"--format {format_}. Got {output.name!r} instead; rename it, or drop --format.", param_hint="'OUT'")
    parent = output.parent
    if not parent.is_dir():
        raise FormatError(
            f"Expected the directory {str(parent)!r} to exist for the export. Got "
            f"{'a file' if parent.exists() else 'no such directory'} instead; create it first "
            "or pick another path."
        )
    return fmt

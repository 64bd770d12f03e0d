"""The commands that create a store and look at its versions (the CLI layer, the package's
top layer): ``init``, ``log``, ``ls``, ``show`` and ``diff``, with the summaries of a
version's records that ``log`` prints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import numpy as np
import typer
from rich.table import Table

import inshrink_store as ins
from inshrink_store._cli.core import (
    JsonOpt,
    _flag,
    _json,
    _row,
    _say,
    _session,
    _size,
    _storage_options,
    err,
    out,
    progress_bar,
)
from inshrink_store._cli.opening import (
    _naming_a_missing_bucket,
    _open,
    _reading_config,
    _refuse_a_foreign_folder,
    _require_room_for_store,
    _what_is_at,
)
from inshrink_store.errors import FormatError, InshrinkError
from inshrink_store.policy import MomentRecord, QuantizationRecord


def init(url: str) -> None:
    """Create an empty store at URL: a new path or an empty folder (or bucket prefix)."""
    _session.url = url
    _require_room_for_store(url)
    state, entries = _what_is_at(url)
    _refuse_a_foreign_folder(url, state, entries)
    try:
        with _reading_config(url), _naming_a_missing_bucket(url):
            repo = ins.init(url, storage_options=_storage_options(url))
    except ins.AlreadyExistsError:
        raise ins.AlreadyExistsError(
            f"Expected no store at {url!r} to create one. Got an existing inshrink store instead; "
            f"look at it with `inshrink log {url}`, or pick a new path for a new store."
        ) from None
    _say(out, "initialised inshrink store at ", repo.url)

def log(
    url: str,
    branch: Annotated[str, typer.Option("--branch", help="Branch or ref to start from.")] = "main",
    limit: Annotated[int | None, typer.Option("--limit", "-n")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Versions of a branch, newest first: time, step, message, metrics."""
    entries = _open(url).log(branch, limit=limit)  # reopened below for the residuals (cached)
    repo = _open(url)
    tags = _tags_by_snapshot(repo)
    if as_json:
        _json([{**e.to_dict(), "tags": tags.get(e.id, [])} for e in entries])
        return
    tagged = any(e.id in tags for e in entries)  # the column only where a version shown is tagged
    probed = any("probe" in e.metadata for e in entries)  # a Checkpointer given probe= records it
    table = Table("snapshot", *(["tags"] if tagged else []), "time", "step", "message", "metrics", "config",
                  "search", "moments", *(["probe"] if probed else []), "exact")
    for e in entries:
        metrics = " ".join(f"{k}={_number(v)}" for k, v in e.metrics.items())
        cfg, search = _quantization_summary(e.metadata.get("quantization"))
        _row(table, e.id[:12], *([", ".join(tags.get(e.id, [])) or "-"] if tagged else []),
             e.time[:19].replace("T", " "), e.step if e.step is not None else "-",
             e.message, metrics, cfg, search,
             "dropped (weights only)" if "weights_only" in e.metadata else _moments_summary(e.metadata.get("moments")),
             *([_probe_summary(e.metadata.get("probe"))] if probed else []), _exact_summary(repo, e))
    out.print(table)


def _tags_by_snapshot(repo: ins.Repository) -> dict[str, list[str]]:
    """Snapshot id -> its tags, sorted: `log` marks the versions a tag keeps (a Checkpointer's
    ``keep-<step>`` and ``best-<step>`` among them) through gc."""
    out: dict[str, list[str]] = {}
    for name, sid in sorted(repo.tags().items()):
        out.setdefault(sid, []).append(name)
    return out


def _exact_summary(repo: ins.Repository, info: Any) -> str:
    """The `log` column: whether a version restores bit-exact, and its residual's bytes."""
    raw = info.metadata.get("residual")
    if raw is None:
        lossy = info.metadata.get("quantization", {}) or {}
        return "-" if not (lossy.get("config") or lossy.get("allocation")) else "no"
    try:
        kept = repo.residual(info.id)
    except InshrinkError:
        return "(unreadable residual)"
    if kept is None:
        return "no (residual collected)"
    return f"yes ({_size(kept.ref.stored_bytes)})"


def _probe_summary(raw: Any) -> str:
    """The `log` column of a version's probe record: its stored model's output against the
    live one's on the Checkpointer's probe batch (``-`` when the version has none)."""
    if raw is None:
        return "-"
    if not isinstance(raw, dict) or not all(isinstance(raw.get(k), (int, float)) and not isinstance(raw.get(k), bool)
                                            for k in ("cosine_mean", "cosine_min", "rel_error")):
        return "(unreadable probe record)"
    return f"cos {raw['cosine_mean']:.4f} (min {raw['cosine_min']:.4f}), err {raw['rel_error']:.2%}"


def _moments_summary(raw: Any) -> str:
    """The `log` column of a version's moments record: how many pairs were compressed and the
    worst update figures (``-`` when the version has no record)."""
    if raw is None:
        return "-"
    try:
        summary = MomentRecord.from_dict(raw).summary()
    except FormatError:
        return "(unreadable moments record)"
    if summary["skipped"]:
        return "lossless (not Adam-shaped)"
    if not summary["quantized"]:
        return f"lossless ({summary['lossless']} pairs)"
    return (f"{summary['quantized']} compressed, {summary['lossless']} lossless; update cos >= "
            f"{summary['min_update_cosine']:.3f}, err <= {summary['max_update_rel_error']:.1%}")


def _quantization_summary(raw: Any) -> tuple[str, str]:
    """(config, search) columns of `log` from a version's quantization record."""
    if raw is None:
        return "", "-"
    try:
        record = QuantizationRecord.from_dict(raw)
    except FormatError:
        return "(unreadable quantization record)", "-"
    config, allocation = record.config, record.allocation
    if allocation is not None:
        target = (f"target_ratio={allocation.target_ratio:g}" if allocation.target_ratio is not None
                  else f"max_error={allocation.max_error:g}")
        cfg = f"per-tensor levels, {target} protect={allocation.protect}"
    elif config is None:
        cfg = "lossless (nothing within tolerance)" if record.search is not None else "lossless"
    else:
        cfg = f"bins={config.bins} prune={config.prune} prune_metric={config.prune_metric} protect={config.protect}"
    search = record.search
    summary = "-" if search is None else f"{search.mode}: {search.evaluations} evaluated of {len(search.trials)} tried"
    if record.allocation_search is not None:
        summary = f"target ratio bisection: {len(record.allocation_search)} evaluated"
    return cfg, summary


def _number(v: Any) -> str:
    """A metric value: 4 significant digits when it is a number, as written otherwise."""
    return f"{v:.4g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def ls(url: str, ref: Annotated[str, typer.Argument()] = "main", as_json: JsonOpt = False) -> None:
    """Tensors of a version: shape, dtype, logical and stored bytes, how each is stored."""
    repo = _open(url)
    reader = repo.checkout(ref)
    stored_bytes = repo.stored_bytes(reader.id)
    rows: list[dict[str, Any]] = []
    for path, info in sorted(reader.arrays().items()):
        stored = stored_bytes.get(path, 0)
        attrs = info.attributes
        rows.append({
            "tensor": path, "param": reader.param_of(path), "shape": list(info.shape), "dtype": info.dtype,
            "logical_bytes": info.logical_bytes,
            "stored_bytes": stored, "storage": info.storage, "levels": attrs.get("levels"),
            "pruned_fraction": attrs.get("pruned_fraction"), "protected_fraction": attrs.get("protected_fraction"),
            "update_cosine": attrs.get("update_cosine"), "update_rel_error": attrs.get("update_rel_error"),
        })
    if as_json:
        _json({"snapshot": reader.id, "tensors": rows})
        return
    guarded = any(r["update_cosine"] is not None for r in rows)
    named = any(r["param"] is not None for r in rows)  # the column only where a moment has a name
    columns = ["tensor", *(["param"] if named else []), "shape", "dtype", "logical", "stored", "storage", "levels",
               "pruned", "protected"]
    table = Table(*columns, *(["update cos", "update err"] if guarded else []))
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.2f}%"

    for r in rows:
        guard = ([_figure(r["update_cosine"], ".4f"), _figure(r["update_rel_error"], ".1%")] if guarded else [])
        _row(table, r["tensor"], *([r["param"] or "-"] if named else []),
             "x".join(map(str, r["shape"])) or "()", r["dtype"], _size(r["logical_bytes"]),
             _size(r["stored_bytes"]), r["storage"], r["levels"] or "-",
             pct(r["pruned_fraction"]), pct(r["protected_fraction"]), *guard)
    out.print(table)
    if guarded:
        _say(err, "update cos / err: the Adam update from the stored moments against the exact one "
                  "(cosine, relative norm error)")
    if named:
        _say(err, "param: the parameter an optimizer tensor belongs to; "
                  "`inshrink show URL REF optimizer/state/<param>/exp_avg` names it so")


def _figure(value: Any, spec: str) -> str:
    return "-" if not isinstance(value, (int, float)) or isinstance(value, bool) else format(value, spec)


def _find_tensor(reader: ins.SnapshotReader, name: str, url: str, ref: str) -> str:
    """The tensor path NAME means: :meth:`SnapshotReader.resolve_name`, the rule Python
    follows too; a NotFoundError that says to list the tensors names this store's command."""
    try:
        return reader.resolve_name(name)
    except ins.NotFoundError as exc:
        raise ins.NotFoundError(str(exc).replace("`inshrink ls`", f"`inshrink ls {url} {ref}`")) from None


def show(
    url: str, ref: str,
    tensor: Annotated[str, typer.Argument(
        help="Tensor path, state-dict key, optimizer/state/<param name>/exp_avg, or the end of one: "
        "`query.weight` finds the one tensor ending in /query.weight or .query.weight (docs/reference/names.md).")],
    as_json: JsonOpt = False,
) -> None:
    """Shape, dtype and summary statistics of one tensor (reads only that tensor)."""
    reader = _open(url).checkout(ref)
    path = _find_tensor(reader, tensor, url, ref)
    info = reader.arrays()[path]
    values = reader.read_float(path)
    param = reader.param_of(path)
    stats: dict[str, Any] = {"tensor": path, **({"param": param} if param is not None else {}),
                             "snapshot": reader.id, "shape": list(info.shape),
                             "dtype": info.dtype, "storage": info.storage, "numel": int(values.size)}
    if values.size and values.dtype.kind in "fiub":
        v = values.astype(np.float64)
        finite = v[np.isfinite(v)]
        stats.update({
            "min": float(finite.min()) if finite.size else None,
            "max": float(finite.max()) if finite.size else None,
            "mean": float(finite.mean()) if finite.size else None,
            "std": float(finite.std()) if finite.size else None,
            "zeros": int(np.count_nonzero(v == 0)), "nan": int(np.isnan(v).sum()),
            "inf": int(np.isinf(v).sum()),
        })
    stats.update({k: v for k, v in info.attributes.items() if k not in ("dtype", "storage")})
    if as_json:
        _json(stats)
        return
    for key, value in stats.items():
        _say(out, (f"{key:>18}", "bold"), "  ", str(value))


def diff(
    url: str, ref_a: str, ref_b: str,
    values: Annotated[bool, _flag("--values", help="Also read both versions: max abs and relative L2 change (equal infs and NaNs are no change, a value that becomes or stops being inf or NaN is inf; integer, bool and byte tensors: whether their bytes changed).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Tensors added, removed, changed and unchanged between two versions."""
    repo = _open(url)
    if values:
        with progress_bar("diff") as update:
            report = repo.diff(ref_a, ref_b, values=True, progress=update)
    else:
        report = repo.diff(ref_a, ref_b)
    if as_json:
        _json(report.to_dict())
        return
    table = Table("tensor", "status", "chunks changed", "new bytes", "storage", "max |Δ|", "rel L2 Δ")
    for t in report.tensors:
        if t.status == "unchanged" and not values:
            continue
        fmt = lambda x: "-" if x is None else f"{x:.3g}"  # noqa: E731
        _row(table, t.path, t.status, f"{t.chunks_changed}/{t.chunks_total}", _size(t.new_bytes),
             t.storage_b or "-", *_value_cells(t, fmt))
    out.print(table)
    counts = report.to_dict()["counts"]
    _say(out, " ".join(f"{k}: {v}" for k, v in counts.items()) + f"  new bytes: {_size(report.new_bytes)}")


def _value_cells(t: Any, fmt: Callable[[float | None], str]) -> tuple[str, str]:
    """`diff`'s max |Δ| and rel L2 Δ cells; an integer, bool or byte tensor (an RNG state) gets
    only whether its bytes changed: a distance between such values means nothing."""
    if t.bytes_changed is None:
        return fmt(t.max_abs_change), fmt(t.rel_l2_change)
    return "-", "bytes changed" if t.bytes_changed else "same bytes"

"""The whole-store commands (the CLI layer, the package's top layer): ``verify`` (every
checksum and delta chain), ``gc`` (delete what no kept version reaches) and ``du`` (where
the stored bytes are, per version and for the whole store).
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from inshrink_store._cli.core import (
    JsonOpt,
    _flag,
    _json,
    _n,
    _ratio,
    _row,
    _say,
    _size,
    err,
    out,
    progress_bar,
)
from inshrink_store._cli.opening import _open
from inshrink_store.admin import usage_document


def verify(url: str, as_json: JsonOpt = False) -> None:
    """Check every reachable object's checksum, id and delta chain; exit 1 on any problem."""
    repo = _open(url)
    with progress_bar("verify") as update:
        report = repo.verify(progress=update)
    if as_json:
        _json(report.to_dict())
    elif report.ok:
        _say(out, f"ok: {_n(report.snapshots, 'version')}, {_n(report.trees, 'tree')}, "
                  f"{_n(report.objects, 'object')} ({_n(report.deltas, 'delta')}) verified")
    else:
        for p in report.problems:
            users = ", ".join(f"{s[:12]}:{t}" for s, t in p.used_by[:10])
            _say(err, (f"BAD {p.kind} {p.id}", "red"), ": ", str(p.error))
            if users:
                _say(err, "    used by ", users)
    if not report.ok:
        raise typer.Exit(1)


def gc(
    url: str,
    keep_last: Annotated[int | None, typer.Option("--keep-last", min=1, help="Keep only the last N versions per branch (and tags).")] = None,
    dry_run: Annotated[bool, _flag("--dry-run", help="Only report what would be deleted.")] = False,
    stale_after: Annotated[float, typer.Option(
        "--stale-after", min=0,
        help="A writer lease unrenewed this many seconds is a dead process's: gc fences that writer "
             "off (it can no longer publish). Writers on this machine whose process is gone are "
             "recognised at once.")] = 300.0,
    wait: Annotated[float, typer.Option(
        "--wait", min=0, help="Wait up to this many seconds for commits in progress to finish.")] = 0.0,
    as_json: JsonOpt = False,
) -> None:
    """Delete what no kept version reaches. Refuses (exit 1) while a commit is in progress.
    Safe beside any number of writers and gc runs; a gc cut short leaves only garbage.

    Refs that point at missing snapshots are reported as warnings (and as "dangling" in
    --json), not collected: delete them with `inshrink tag URL NAME -d` or
    `inshrink branch URL NAME -d`."""
    repo = _open(url)
    with progress_bar("gc") as update:
        report = repo.gc(keep_last=keep_last, dry_run=dry_run, progress=update, stale_after=stale_after,
                         wait=wait, on_wait=lambda message: _say(err, message))
    dangling = [str(d) for d in (getattr(report, "dangling", None) or [])]
    if as_json:
        _json({**report.to_dict(), "dangling": dangling})
        return
    for d in dangling:
        _say(err, ("warning:", "yellow"), " ", d)
    if dangling:
        points = "points at a missing snapshot; delete it" if len(dangling) == 1 else \
            "point at missing snapshots; delete them"
        _say(err, ("warning:", "yellow"), f" {_n(len(dangling), 'ref')} {points} "
             "with `inshrink tag URL NAME -d` or `inshrink branch URL NAME -d`")
    verb = "would delete" if dry_run else "deleted"
    counts = ", ".join(_n(len(v), *_GC_NOUNS.get(k, (k, k))) for k, v in report.deleted.items())
    freed = "would free" if dry_run else "freed"
    _say(out, f"kept {_n(report.kept_snapshots, 'version')}; {verb} {counts}; {freed} {_size(report.freed_bytes)}")


#: report.deleted's groups as (one, many)
_GC_NOUNS = {"refs": ("ref", "refs"), "snapshots": ("snapshot", "snapshots"), "trees": ("tree", "trees"),
             "objects": ("object", "objects"), "temp": ("temp file", "temp files"), "leases": ("lease", "leases")}


def du(
    url: str, ref: Annotated[str, typer.Argument()] = "main",
    prefix: Annotated[str, typer.Option("--prefix", help="Only tensors under this path, e.g. model/.")] = "",
    as_json: JsonOpt = False,
) -> None:
    """Per version: logical bytes, new stored bytes, cumulative stored bytes and the ratio so far
    (logical bytes of the versions up to it / their new stored bytes; for a training state the
    weights' and the optimizer's apart); then where every byte under the store is, and the
    ratios of the ref (logical bytes of its versions / their new stored bytes and delta bases)
    and of the store (logical bytes of every kept version / every byte under the store).
    --json prints the same figures, each ratio with the bytes it divides and what they count."""
    repo = _open(url)
    # the whole store's accounting only where the rows are the whole of each version (no prefix)
    summary = None if prefix else repo.du_summary(ref)
    rows = summary.rows if summary is not None else repo.du(ref, prefix)
    # a training state's parts apart: the weights' and the optimizer's overall ratios
    part_rows = {} if prefix else {name: repo.du(ref, name + "/") for name in ("model", "optimizer")}
    part_rows = {name: found for name, found in part_rows.items() if any(r.logical_bytes for r in found)}
    if as_json:
        _json(usage_document(ref, prefix, rows, summary, part_rows))
        return
    parts = {name: {r.snapshot: r for r in found} for name, found in part_rows.items()}
    labels = {"model": "weights overall", "optimizer": "optimizer overall"}
    residuals = any(r.residual_bytes for r in rows)
    # no ratio of a version's logical bytes to the bytes it added: a version that dedups
    # against its parent would show thousands (issue 43)
    table = Table("snapshot", "step", "logical", "new stored", "deltas", "cumulative", "ratio so far",
                  *(labels[name] for name in parts), *(["exact resume"] if residuals else []))
    for r in rows:
        _row(table, r.snapshot[:12], r.step if r.step is not None else "-", _size(r.logical_bytes),
             _size(r.new_stored_bytes), f"{r.delta_objects}/{r.new_objects}",
             _size(r.cumulative_stored_bytes), _ratio(r.cumulative_ratio),
             *(_ratio(by_id[r.snapshot].cumulative_ratio) for by_id in parts.values()),
             *([_size(r.residual_bytes) if r.residual_bytes else "-"] if residuals else []))
    out.print(table)
    _say(out, "ratio so far: logical bytes of the versions up to the row / their new stored bytes"
         + (" (without the delta bases, other refs and documents counted below)" if summary is not None else ""))
    if summary is not None:
        out.print(_du_totals(summary))
        _say(out, f"ratio of {summary.ref}: {_n(len(summary.rows), 'version')}, "
                  f"{_size(summary.ref_logical_bytes)} logical / {_size(summary.ref_stored)} stored "
                  f"(new stored and delta bases) = {_ratio(summary.ref_ratio)}")
        _say(out, f"ratio of the store: {_n(summary.kept_versions, 'version')} kept, "
                  f"{_size(summary.kept_logical_bytes)} logical / {_size(summary.total)} under the store "
                  f"= {_ratio(summary.ratio)}")
    if residuals:
        _say(err, "exact resume: the restore residual each newest version keeps (in new stored; gc "
                  "collects it once the version is no longer among the newest)")


def _du_totals(summary: Any) -> Table:
    """`du`'s second table: every byte under the store counted once, so the total is what the
    store's folders hold (the rows alone leave out, e.g., keyframes of deleted versions)."""
    table = Table("where the bytes are", "stored")
    for label, n in ((f"versions of {summary.ref} (new stored above)", summary.versions),
                     ("delta bases no row counts (kept deltas need them)", summary.delta_bases),
                     ("other refs (branches, tags, older ref files)", summary.other_refs),
                     ("documents and refs (other versions' snapshots, ref files, settings, leases)", summary.metadata),
                     ("unreferenced (the next gc deletes it)", summary.unreferenced),
                     ("total under the store", summary.total)):
        _row(table, label, _size(n))
    return table

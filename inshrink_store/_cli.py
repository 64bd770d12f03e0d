"""The ``inshrink`` command line: verbs on a store URL, calling the public API only.

Exit codes: 0 ok, 1 a problem found (bad object, unknown ref, failed import), 2 usage
error. ``--json`` prints machine-readable output; long work shows a progress bar on
stderr. Errors print one clear line, never a traceback.

Everything that comes from the user or the store (messages, tensor names, refs, metadata,
URLs, error text) reaches rich as :class:`rich.text.Text`, never as a markup string, so
``[/red]`` or ``:smile:`` in a commit message is printed as written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

import inshrink_store as ins
from inshrink_store.errors import FormatError, InshrinkError
from inshrink_store.policy.record import QuantizationRecord

app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Versioned, compressed checkpoint stores. Every command takes a store URL "
    "(a path, file://, memory://, s3://, gs://).",
)
CONFIG_FILE = "inshrink.json"


def _console(stderr: bool = False) -> Console:
    """A terminal gets its own width; a pipe or a log file gets a wide one, so tables are
    never squeezed into rich's default 80 columns and truncated with ellipses."""
    console = Console(stderr=stderr)
    return console if console.is_terminal or os.environ.get("COLUMNS") else Console(stderr=stderr, width=200)


out = _console()
err = _console(stderr=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
DeleteOpt = Annotated[bool, typer.Option("--delete", "-d", help="Delete NAME instead of creating it.")]


def _text(value: Any) -> Text:
    """A cell or a piece of a line that is printed literally: never parsed as markup or emoji."""
    return value if isinstance(value, Text) else Text(str(value))


def _row(table: Table, *cells: Any) -> None:
    table.add_row(*(_text(c) for c in cells))


def _say(console: Console, *parts: str | tuple[str, str]) -> None:
    """Print one line assembled from literal strings and ``(text, style)`` pairs.

    Nothing is parsed as markup and the line is never wrapped, so user text survives
    intact (a log line is easy to grep)."""
    console.print(Text.assemble(*parts), soft_wrap=True)


@contextmanager
def progress_bar(label: str) -> Iterator[Callable[[str, int, int], None]]:
    """A rich progress bar on stderr, fed by the library's (item, done, total) callbacks."""
    with Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[item]}", markup=False), console=err, transient=True,
        disable=not err.is_terminal,
    ) as bar:
        task = bar.add_task(label, total=None, item="")

        def update(item: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, item=str(item)[:40])

        yield update


def _size(n: float | int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ratio(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isinf(x)) else f"{x:.2f}x"


def _json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")


def _local_path(url: str) -> Path | None:
    """The directory a store URL names on this machine, or None for a remote or memory URL."""
    if url.startswith("file://"):
        return Path(url[len("file://"):])
    return None if "://" in url else Path(url)


def _require_room_for_store(url: str) -> None:
    """Before creating a local store: the path and its parents must not be (under) a file."""
    path = _local_path(url)
    if path is None:
        return
    for p in (path, *path.parents):
        if p.is_symlink() or p.exists():
            if not p.is_dir():
                raise FormatError(
                    f"Expected a directory (or nothing yet) at {str(p)!r} to create the store "
                    f"{url!r} in. Got a file there instead; pick another path for the store."
                )
            return


@contextmanager
def _reading_config(url: str) -> Iterator[None]:
    """A damaged inshrink.json (bad JSON, bad UTF-8, not an object) becomes one clear error."""
    try:
        yield
    except InshrinkError:
        raise
    except (ValueError, AttributeError, TypeError) as exc:
        where = f"{url.rstrip('/')}/{CONFIG_FILE}"
        raise FormatError(
            f"Expected {where!r} to hold the store's settings as a JSON object. Got an unreadable "
            f"file instead ({type(exc).__name__}: {exc}); restore it from a backup, or move the "
            "store aside and create a new one with `inshrink init`."
        ) from exc


def _open(url: str, create: bool = False) -> ins.Repository:
    if create:
        _require_room_for_store(url)
    with _reading_config(url):
        return ins.open(url, create=create)


@app.command()
def init(url: str) -> None:
    """Create an empty store at URL."""
    _require_room_for_store(url)
    with _reading_config(url):
        repo = ins.init(url)
    _say(out, "initialised inshrink store at ", repo.url)


@app.command("import")
def import_(
    file: Annotated[Path, typer.Argument(help=".safetensors, or .pt/.pth (state_dict or {model, optimizer})")],
    url: str,
    message: Annotated[str, typer.Option("--message", "-m")] = "",
    step: Annotated[int | None, typer.Option("--step")] = None,
    branch: Annotated[str, typer.Option("--branch")] = "main",
    bins: Annotated[int | None, typer.Option("--bins", help="Quantize float tensors to this many levels.")] = None,
    prune: Annotated[float, typer.Option("--prune", help="Fraction pruned to 0 (with --bins).")] = 0.0,
    prune_metric: Annotated[str, typer.Option("--prune-metric")] = "magnitude",
    protect: Annotated[float, typer.Option("--protect", help="Fraction kept in bfloat16 (with --bins).")] = 0.005,
    create: Annotated[bool, typer.Option("--create/--no-create", help="Create the store if missing.")] = True,
) -> None:
    """Import a checkpoint file as a new version; prints the snapshot id."""
    from inshrink_store.torch import import_file

    if file.is_dir():
        raise FormatError(
            f"Expected a checkpoint file (.safetensors, .pt or .pth). Got the directory {str(file)!r} "
            "instead; name one file inside it."
        )
    repo = _open(url, create=create)
    quantize = None
    if bins is not None:
        from inshrink_store.policy import QuantConfig

        quantize = QuantConfig(bins=bins, prune=prune, prune_metric=prune_metric, protect=protect)
    with progress_bar("import") as update:
        info = import_file(repo, file, message=message or file.name, step=step, branch=branch,
                           quantize=quantize, progress=update)
    _say(out, info.id)


@app.command()
def log(
    url: str,
    branch: Annotated[str, typer.Option("--branch", help="Branch or ref to start from.")] = "main",
    limit: Annotated[int | None, typer.Option("--limit", "-n")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Versions of a branch, newest first: time, step, message, metrics."""
    entries = _open(url).log(branch, limit=limit)
    if as_json:
        _json([e.to_dict() for e in entries])
        return
    table = Table("snapshot", "time", "step", "message", "metrics", "config", "search")
    for e in entries:
        metrics = " ".join(f"{k}={_number(v)}" for k, v in e.metrics.items())
        cfg, search = _quantization_summary(e.metadata.get("quantization"))
        _row(table, e.id[:12], e.time[:19].replace("T", " "), e.step if e.step is not None else "-",
             e.message, metrics, cfg, search)
    out.print(table)


def _quantization_summary(raw: Any) -> tuple[str, str]:
    """(config, search) columns of `log` from a version's quantization record."""
    if raw is None:
        return "", "-"
    try:
        record = QuantizationRecord.from_dict(raw)
    except FormatError:
        return "(unreadable quantization record)", "-"
    config = record.config
    if config is None:
        cfg = "lossless (nothing within tolerance)" if record.search is not None else "lossless"
    else:
        cfg = f"bins={config.bins} prune={config.prune} prune_metric={config.prune_metric} protect={config.protect}"
    search = record.search
    summary = "-" if search is None else f"{search.mode}: {search.evaluations} evaluated of {len(search.trials)} tried"
    return cfg, summary


def _number(v: Any) -> str:
    """A metric value: 4 significant digits when it is a number, as written otherwise."""
    return f"{v:.4g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


@app.command("ls")
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
            "tensor": path, "shape": list(info.shape), "dtype": info.dtype, "logical_bytes": info.logical_bytes,
            "stored_bytes": stored, "storage": info.storage, "levels": attrs.get("levels"),
            "pruned_fraction": attrs.get("pruned_fraction"), "protected_fraction": attrs.get("protected_fraction"),
        })
    if as_json:
        _json({"snapshot": reader.id, "tensors": rows})
        return
    table = Table("tensor", "shape", "dtype", "logical", "stored", "storage", "levels", "pruned", "protected")
    for r in rows:
        pct = lambda x: "-" if x is None else f"{100 * x:.2f}%"  # noqa: E731
        _row(table, r["tensor"], "x".join(map(str, r["shape"])) or "()", r["dtype"], _size(r["logical_bytes"]),
             _size(r["stored_bytes"]), r["storage"], r["levels"] or "-",
             pct(r["pruned_fraction"]), pct(r["protected_fraction"]))
    out.print(table)


@app.command()
def show(url: str, ref: str, tensor: str, as_json: JsonOpt = False) -> None:
    """Shape, dtype and summary statistics of one tensor (reads only that tensor)."""
    reader = _open(url).checkout(ref)
    path = reader.resolve_name(tensor)
    info = reader.arrays()[path]
    values = reader.read_float(path)
    stats: dict[str, Any] = {"tensor": path, "snapshot": reader.id, "shape": list(info.shape),
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


@app.command()
def diff(
    url: str, ref_a: str, ref_b: str,
    values: Annotated[bool, typer.Option("--values", help="Also read both versions: max abs and relative L2 change.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Tensors added, removed, changed and unchanged between two versions."""
    report = _open(url).diff(ref_a, ref_b, values=values)
    if as_json:
        _json(report.to_dict())
        return
    table = Table("tensor", "status", "chunks changed", "new bytes", "storage", "max |Δ|", "rel L2 Δ")
    for t in report.tensors:
        if t.status == "unchanged" and not values:
            continue
        fmt = lambda x: "-" if x is None else f"{x:.3g}"  # noqa: E731
        _row(table, t.path, t.status, f"{t.chunks_changed}/{t.chunks_total}", _size(t.new_bytes),
             t.storage_b or "-", fmt(t.max_abs_change), fmt(t.rel_l2_change))
    out.print(table)
    counts = report.to_dict()["counts"]
    _say(out, " ".join(f"{k}: {v}" for k, v in counts.items()) + f"  new bytes: {_size(report.new_bytes)}")


@app.command()
def export(
    url: str, ref: str, output: Annotated[Path, typer.Argument(metavar="OUT.safetensors")],
    all_tensors: Annotated[bool, typer.Option("--all", help="Also export optimizer state (full paths).")] = False,
) -> None:
    """Write a version's model tensors to a .safetensors file (bit-exact for lossless versions)."""
    from inshrink_store.torch import export_safetensors

    if output.is_dir():
        raise FormatError(
            f"Expected a file path to export to. Got the directory {str(output)!r} instead; name a "
            f"file, e.g. {str(output / 'model.safetensors')!r}."
        )
    parent = output.parent
    if not parent.is_dir():
        raise FormatError(
            f"Expected the directory {str(parent)!r} to exist for the export. Got "
            f"{'a file' if parent.exists() else 'no such directory'} instead; create it first "
            "or pick another path."
        )
    reader = _open(url).checkout(ref)
    with progress_bar("export") as update:
        count = export_safetensors(reader, output, include_all=all_tensors, progress=update)
    _say(out, f"wrote {count} tensors to ", str(output))


def _check_name_mode(kind: str, name: str | None, ref: str | None, delete: bool) -> None:
    if delete and name is None:
        raise typer.BadParameter(f"Expected the {kind} NAME to delete. Got none instead; "
                                 f"run `inshrink {kind} URL NAME --delete`.")
    if delete and ref is not None:
        raise typer.BadParameter(f"Expected no REF with --delete. Got {ref!r} instead; "
                                 f"run `inshrink {kind} URL NAME --delete` alone.")


@app.command()
def tag(
    url: str,
    name: Annotated[str | None, typer.Argument(help="Tag to create or delete; none lists the tags.")] = None,
    ref: Annotated[str | None, typer.Argument(help="Version to tag (default: main).")] = None,
    delete: DeleteOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Name a version (tags are write-once), delete a tag with -d, or list tags (no NAME)."""
    _check_name_mode("tag", name, ref, delete)
    repo = _open(url)
    if name is None:
        tags = repo.tags()
        if as_json:
            _json([{"name": n, "snapshot": sid} for n, sid in sorted(tags.items())])
            return
        table = Table("tag", "snapshot")
        for n, sid in sorted(tags.items()):
            _row(table, n, sid)
        out.print(table)
        return
    if delete:
        sid = repo.delete_tag(name)
        if as_json:
            _json({"name": name, "snapshot": sid, "deleted": True})
        else:
            _say(out, "deleted tag ", name, f" (was -> {sid})")
        return
    sid = repo.tag(name, ref or "main")
    if as_json:
        _json({"name": name, "snapshot": sid, "deleted": False})
    else:
        _say(out, name, f" -> {sid}")


@app.command()
def branch(
    url: str,
    name: Annotated[str | None, typer.Argument(help="Branch to create or delete; none lists the branches.")] = None,
    ref: Annotated[str | None, typer.Argument(help="Version the new branch starts at (default: main).")] = None,
    delete: DeleteOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """List branches (no NAME), create NAME at REF, or delete NAME with -d."""
    _check_name_mode("branch", name, ref, delete)
    repo = _open(url)
    if name is None:
        rows = []
        for n, head in sorted(repo.branches().items()):
            row: dict[str, Any] = {"name": n, "head": head, "step": None, "time": None, "message": None}
            try:
                info = repo.snapshot(head)
                row.update(step=info.step, time=info.time, message=info.message)
            except (InshrinkError, OSError, ValueError) as exc:  # a dangling head: list it, say why
                row["error"] = str(exc)
            rows.append(row)
        if as_json:
            _json(rows)
            return
        table = Table("branch", "head", "step", "time", "message")
        for r in rows:
            missing = "error" in r
            _row(table, r["name"], r["head"][:12], "-" if r["step"] is None else r["step"],
                 "-" if missing else str(r["time"])[:19].replace("T", " "),
                 "(head snapshot unreadable: run `inshrink verify`)" if missing else r["message"])
        out.print(table)
        return
    if delete:
        sid = repo.delete_branch(name)
        if as_json:
            _json({"name": name, "head": sid, "deleted": True})
        else:
            _say(out, "deleted branch ", name, f" (was at {sid})")
        return
    sid = repo.create_branch(name, ref or "main")
    if as_json:
        _json({"name": name, "head": sid, "deleted": False})
    else:
        _say(out, "branch ", name, f" -> {sid}")


@app.command()
def verify(url: str, as_json: JsonOpt = False) -> None:
    """Check every reachable object's checksum, id and delta chain; exit 1 on any problem."""
    repo = _open(url)
    with progress_bar("verify") as update:
        report = repo.verify(progress=update)
    if as_json:
        _json(report.to_dict())
    elif report.ok:
        _say(out, f"ok: {report.snapshots} versions, {report.trees} trees, {report.objects} objects "
                  f"({report.deltas} deltas) verified")
    else:
        for p in report.problems:
            users = ", ".join(f"{s[:12]}:{t}" for s, t in p.used_by[:10])
            _say(err, (f"BAD {p.kind} {p.id}", "red"), ": ", str(p.error))
            if users:
                _say(err, "    used by ", users)
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def gc(
    url: str,
    keep_last: Annotated[int | None, typer.Option("--keep-last", min=1, help="Keep only the last N versions per branch (and tags).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report what would be deleted.")] = False,
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
        _say(err, ("warning:", "yellow"), f" {len(dangling)} ref(s) point at missing snapshots; delete them "
             "with `inshrink tag URL NAME -d` or `inshrink branch URL NAME -d`")
    verb = "would delete" if dry_run else "deleted"
    counts = ", ".join(f"{len(v)} {k}" for k, v in report.deleted.items())
    _say(out, f"kept {report.kept_snapshots} versions; {verb} {counts}; {verb.split()[-1]} {_size(report.freed_bytes)}")


@app.command()
def du(
    url: str, ref: Annotated[str, typer.Argument()] = "main",
    prefix: Annotated[str, typer.Option("--prefix", help="Only tensors under this path, e.g. model/.")] = "",
    as_json: JsonOpt = False,
) -> None:
    """Per version: logical bytes, new stored bytes, cumulative stored bytes, ratio."""
    rows = _open(url).du(ref, prefix)
    if as_json:
        _json([r.to_dict() for r in rows])
        return
    table = Table("snapshot", "step", "logical", "new stored", "deltas", "cumulative", "ratio", "overall")
    for r in rows:
        _row(table, r.snapshot[:12], r.step if r.step is not None else "-", _size(r.logical_bytes),
             _size(r.new_stored_bytes), f"{r.delta_objects}/{r.new_objects}",
             _size(r.cumulative_stored_bytes), _ratio(r.ratio), _ratio(r.cumulative_ratio))
    out.print(table)


@app.command()
def demo(
    url: Annotated[str, typer.Argument(
        help="Where to create the demo store: a new path, an empty directory, or a previous demo store "
        "(which is replaced). Any other existing path is refused.")] = "./inshrink-demo",
    steps: Annotated[int, typer.Option("--steps", min=1)] = 600,
    every: Annotated[int, typer.Option("--every", min=1, help="Checkpoint every N steps.")] = 50,
    tolerance: Annotated[float, typer.Option("--tolerance", help="Accuracy drop allowed, relative.")] = 0.02,
    fail_at: Annotated[int | None, typer.Option("--fail-at", help="Simulate a crash at this step, then resume.")] = 430,
    as_json: JsonOpt = False,
) -> None:
    """Train a small MLP on the digits data set, checkpointing with dynamic quantization."""
    from inshrink_store.torch.demo import run_demo

    def say(line: str) -> None:
        _say(err, (line, "dim"))

    _require_room_for_store(url)
    result = run_demo(url, steps=steps, every=every, fail_at=fail_at, tolerance=tolerance, progress=say)
    if as_json:
        _json(dataclasses.asdict(result))
        return
    table = Table("step", "bins", "prune", "protect", "search", "evals", "weights", "w. ratio",
                  "+optimizer", "state ratio", "accuracy")
    for r in result.rows:
        c = r["config"] or {}
        _row(table, r["step"], c.get("bins", "lossless"),
             f"{c['prune']:.0%} {c['prune_metric'][:3]}" if c else "-",
             f"{c['protect']:.2%}" if c else "-", r["search"] or "-", r["evaluations"],
             _size(r["model_stored_bytes"]), _ratio(r["model_ratio"]),
             _size(r["stored_bytes"]), _ratio(r["ratio"]),
             "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}")
    out.print(table)
    weights = result.model_logical_bytes / max(result.model_stored_bytes, 1)
    total = result.logical_bytes / max(result.stored_bytes, 1)
    _say(out, f"model weights: {_size(result.model_stored_bytes)} stored for {_size(result.model_logical_bytes)}: ",
         (f"{weights:.1f}x", "bold"), " smaller end to end")
    _say(out, f"whole training state (Adam moments kept lossless): {_size(result.stored_bytes)} for "
              f"{_size(result.logical_bytes)}: ", (f"{total:.1f}x", "bold"))
    _say(out, "accuracy restored from the last compressed checkpoint: ", (f"{result.restored_accuracy:.3f}", "bold"),
         f" (uncompressed run: {result.reference_accuracy:.3f})")
    if result.resumed_from_step is not None:
        _say(out, f"resumed after a simulated failure from step {result.resumed_from_step}")
    _say(out, f"training {result.train_s:.1f}s, waiting on checkpoints {result.checkpoint_wait_s:.2f}s, "
              f"search in the background {result.search_s:.1f}s")
    _say(out, "inspect it: inshrink log ", url, "  ·  inshrink du ", url)


def _error_line(exc: BaseException) -> str:
    """One line for an error the user can act on: "Expected X. Got Y instead." plus the fix."""
    if isinstance(exc, InshrinkError):
        line = str(exc)
    elif isinstance(exc, json.JSONDecodeError):
        line = (f"Expected valid JSON in the store. Got malformed JSON instead ({exc.msg} at line {exc.lineno}, "
                f"column {exc.colno}); the store may be damaged: run `inshrink verify` and restore "
                "the file from a backup.")
    elif isinstance(exc, UnicodeDecodeError):
        line = (f"Expected UTF-8 text in the store. Got undecodable bytes instead ({exc.reason} at byte "
                f"{exc.start}); the store may be damaged: run `inshrink verify` and restore the file "
                "from a backup.")
    elif isinstance(exc, OSError):
        line = _os_error_line(exc)
    else:
        line = f"{type(exc).__name__}: {exc}"
    return " ".join(line.split())


def _os_error_line(exc: OSError) -> str:
    target = exc.filename2 if exc.filename2 is not None else exc.filename
    if target is None and len(exc.args) == 1:  # fsspec raises FileNotFoundError(path)
        target = exc.args[0]
    where = repr(str(target)) if target is not None else "the path"
    if isinstance(exc, FileNotFoundError):
        return f"Expected {where} to exist. Got no such file or directory instead; check the path."
    if isinstance(exc, IsADirectoryError):
        return f"Expected a file at {where}. Got a directory instead; give the path of a file."
    if isinstance(exc, NotADirectoryError):
        return (f"Expected {where} to be a directory or a new path. Got a file in the way instead; "
                "pick another path.")
    if isinstance(exc, PermissionError):
        return (f"Expected permission to use {where}. Got permission denied instead; check its "
                "permissions or pick another path.")
    if isinstance(exc, FileExistsError):
        return f"Expected nothing at {where}. Got an existing file instead; pick another path."
    return (f"Expected {where} to be readable and writable. Got {exc.strerror or exc} instead; "
            "check the path, free space and permissions.")


def main() -> None:
    """Entry point: errors the user can act on become one line on stderr and exit 1 (store
    errors, file system errors, unreadable JSON or text); usage errors exit 2. Anything else
    is a bug and keeps its traceback."""
    try:
        app(standalone_mode=True)
    except (InshrinkError, OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        _say(err, ("error:", "red"), " ", _error_line(exc))
        sys.exit(1)


if __name__ == "__main__":
    main()

"""The ``inshrink`` command line: verbs on a store URL, calling the public API only.

Exit codes: 0 ok, 1 a problem found (bad object, unknown ref, failed import, an
unreachable backend), 2 usage error (a bad option value or combination). ``--json``
prints machine-readable output; long work shows a progress bar on stderr. Errors print
one clear line, never a traceback; backend loggers (gcsfs, botocore) are kept quiet.

s3:// and gs:// stores are opened with a short connect timeout (``--timeout``, or the
``INSHRINK_TIMEOUT`` environment variable; 5 seconds by default) and few retries, so a
missing endpoint or network fails in seconds, not minutes.

Everything that comes from the user or the store (messages, tensor names, refs, metadata,
URLs, error text) reaches rich as :class:`rich.text.Text`, never as a markup string, so
``[/red]`` or ``:smile:`` in a commit message is printed as written.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import fsspec
import numpy as np
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

import inshrink_store as ins
from inshrink_store.errors import FormatError, InshrinkError
from inshrink_store.policy.allocation import Allocation
from inshrink_store.policy.config import MAX_LEVELS
from inshrink_store.policy.moments import DEFAULT_MOMENTS, MomentRecord
from inshrink_store.policy.record import QuantizationRecord
from inshrink_store.storage import require_supported

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



def _flag(*names: str, help: str) -> Any:  # noqa: A002 - typer's own keyword
    """A plain on/off flag: no value, and shown without a ``<bool>`` type in --help."""
    return typer.Option(*names, metavar="", help=help)


JsonOpt = Annotated[bool, _flag("--json", help="Print JSON instead of a table.")]
DeleteOpt = Annotated[bool, _flag("--delete", "-d", help="Delete NAME instead of creating it.")]

DEFAULT_TIMEOUT = 5.0
TIMEOUT_ENV = "INSHRINK_TIMEOUT"
REMOTE = ("s3", "s3a", "gs", "gcs")


@dataclasses.dataclass
class _Session:
    """Settings of this invocation (global options) and the store URL being worked on."""

    timeout: float = DEFAULT_TIMEOUT
    url: str | None = None


_session = _Session()


def _n(count: int, noun: str, plural: str | None = None) -> str:
    """``1 version``, ``2 versions``."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def _show_version(value: bool) -> None:
    if value:
        _say(out, f"inshrink-store {ins.__version__}")
        raise typer.Exit()


def _check_timeout(value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(
            f"Expected a number of seconds above 0. Got {value!r} instead; e.g. --timeout 30 "
            f"(or {TIMEOUT_ENV}=30)."
        )
    return value


@app.callback()
def _options(
    version: Annotated[bool, typer.Option(
        "--version", metavar="", is_eager=True, callback=_show_version,
        help="Print the version (inshrink-store X.Y.Z) and exit.")] = False,
    timeout: Annotated[float, typer.Option(
        "--timeout", envvar=TIMEOUT_ENV, metavar="SECONDS", callback=_check_timeout,
        help="Connect timeout for s3:// and gs:// stores (retried once). Give it before the "
        "command: inshrink --timeout 30 log s3://bucket/store.")] = DEFAULT_TIMEOUT,
) -> None:
    _session.timeout = timeout
    _session.url = None


def _protocol(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def _storage_options(url: str) -> dict[str, Any] | None:
    """Backend options for the CLI: a short connect timeout and few retries on s3:// and
    gs:// (botocore's defaults wait far longer when an endpoint or the network is gone).
    Other settings come from fsspec's configuration and the usual environment variables
    (AWS_ENDPOINT_URL, AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS...)."""
    protocol = _protocol(url)
    if protocol in ("s3", "s3a"):
        configured = (fsspec.config.conf.get("s3") or {}).get("config_kwargs") or {}
        return {"config_kwargs": {"retries": {"max_attempts": 2}, **configured,
                                  "connect_timeout": _session.timeout}}
    if protocol in ("gs", "gcs"):
        try:
            import aiohttp
        except ImportError:  # gcsfs is not installed: Storage names the extra to install
            return None
        return {"requests_timeout": aiohttp.ClientTimeout(total=None, sock_connect=_session.timeout)}
    return None


def _backend_hint(url: str | None) -> str:
    """Where a remote backend gets its settings, for an error line about it."""
    protocol = _protocol(url or "")
    if protocol in ("s3", "s3a"):
        where = ("S3 credentials come from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, "
                 "an endpoint other than AWS from AWS_ENDPOINT_URL")
    elif protocol in ("gs", "gcs"):
        where = ("GCS credentials come from GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth "
                 "application-default login`")
    else:
        return ""
    return (f" ({where}; connections time out after {_session.timeout:g}s: change it with "
            f"`inshrink --timeout SECONDS ...` or {TIMEOUT_ENV}.)")


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
    _session.url = url
    if create:
        _require_room_for_store(url)
    with _reading_config(url), _naming_a_missing_bucket(url):
        return ins.open(url, create=create, storage_options=_storage_options(url))


def _remote_fs(url: str) -> tuple[Any, str]:
    """The fsspec file system and root path of a remote URL, with the CLI's options (a scheme
    no store supports is refused first, not tried)."""
    require_supported(url)
    fs, root = fsspec.core.url_to_fs(url, **(_storage_options(url) or {}))
    return fs, root.rstrip("/")


def _missing_bucket(url: str) -> str | None:
    """The bucket of an s3:// or gs:// URL when the backend says it does not exist, else
    None (also when that cannot be told: the error at hand is then reported as it is)."""
    if _protocol(url) not in REMOTE:
        return None
    try:
        fs, root = _remote_fs(url)
        bucket = root.split("/", 1)[0]
        if bucket:
            fs.info(bucket)  # not fs.exists: it answers False for a closed endpoint too
    except FileNotFoundError:
        return bucket
    except Exception:  # noqa: BLE001 - only a hint: any other failure means "cannot tell"
        return None
    return None


def _no_bucket_error(url: str, bucket: str) -> ins.NotFoundError:
    return ins.NotFoundError(
        f"Expected the bucket {bucket!r} of {url!r} to exist. Got no such bucket instead (bucket "
        f"{bucket} does not exist); create the bucket first, or check the URL's spelling."
    )


@contextmanager
def _naming_a_missing_bucket(url: str) -> Iterator[None]:
    """"No store here" or a failed write in a bucket that does not exist says so."""
    try:
        yield
    except (ins.NotFoundError, FileNotFoundError, ins.StorageError) as exc:
        # S3 and GCS say "The specified bucket does not exist" (NoSuchBucket); a write there
        # is a FileNotFoundError, a read "no store here": ask the backend before saying so
        cause = str(exc.__cause__ or exc).lower()
        named = "bucket does not exist" in cause or "nosuchbucket" in cause
        bucket = _missing_bucket(url) if named or not isinstance(exc, ins.StorageError) else None
        if bucket is None:
            raise
        raise _no_bucket_error(url, bucket) from exc


def _what_is_at(url: str) -> tuple[str, list[str]]:
    """What a store URL names now: ``store`` (an inshrink.json is there), ``missing``
    (nothing at all), ``empty`` (an empty folder), ``nonempty`` (other files: returned,
    a few of them) or ``nobucket``."""
    path = _local_path(url)
    if path is not None:
        if not path.exists() and not path.is_symlink():
            return "missing", []
        if not path.is_dir():
            return "nonempty", [path.name]
        if (path / CONFIG_FILE).exists() or (path / CONFIG_FILE).is_symlink():
            return "store", []
        entries = sorted(p.name for p in path.iterdir())
        return ("nonempty" if entries else "empty"), entries
    _session.url = url
    try:  # fs.info and fs.ls, not fs.exists: that answers False for a closed endpoint too
        fs, root = _remote_fs(url)
        try:
            fs.info(f"{root}/{CONFIG_FILE}")
            return "store", []
        except FileNotFoundError:
            pass
        try:
            names = sorted(str(n).rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(root, detail=False))
        except (FileNotFoundError, NotADirectoryError):
            names = []
    except InshrinkError:
        raise
    except Exception as exc:  # noqa: BLE001 - every backend raises its own types
        raise ins.StorageError(
            f"Expected to look at {url!r}. Got {type(exc).__name__}: {str(exc)[:300]} instead; "
            "check the path, credentials, endpoint and network."
        ) from exc
    if names:
        return "nonempty", names
    return ("nobucket", []) if _missing_bucket(url) else ("missing", [])  # no empty folders in a bucket


def _refuse_a_foreign_folder(url: str, state: str, entries: list[str]) -> None:
    """A store is never created among someone else's files (or where a bucket is missing)."""
    if state == "nobucket":
        bucket = (_missing_bucket(url) or url.split("://", 1)[-1].split("/", 1)[0])
        raise _no_bucket_error(url, bucket)
    if state == "nonempty":
        shown = ", ".join(repr(e) for e in entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise FormatError(
            f"Expected a new path or an empty folder at {url!r} to create a store in. Got a folder "
            f"that is not an inshrink store instead ({_n(len(entries), 'entry', 'entries')}: {shown}); "
            "check the path, or pick a new one such as a subfolder."
        )


@app.command()
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


def _open_for_import(url: str, create: bool) -> ins.Repository:
    """The store to import into: an existing one, or a new one where nothing exists yet
    (or in an empty folder with --create), announced on stderr."""
    _session.url = url
    _require_room_for_store(url)
    state, entries = _what_is_at(url)
    if state == "store":
        return _open(url)
    _refuse_a_foreign_folder(url, state, entries)
    if state == "empty" and not create:
        raise ins.NotFoundError(
            f"Expected an inshrink store at {url!r}. Got an empty folder instead; pass --create to "
            f"make a new store there (or run `inshrink init {url}`), or check the path."
        )
    repo = _open(url, create=True)
    _say(err, "created a new store at ", repo.url)
    return repo


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


@app.command("import")
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
) -> None:
    """Import a checkpoint file as a new version; prints the snapshot id.

    With --bins (or --target-ratio / --max-error) the version records its quantization
    settings (shown by `inshrink log`)."""
    from inshrink_store.torch import load_checkpoint_file, save_state

    quantize = _check_allocation_options(target_ratio, max_error, bins, prune, protect, embedding_bins)
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
                          quantize=quantize, moments=DEFAULT_MOMENTS if compressed else None,
                          progress=update, **commit)
    _say(out, info.id)


@app.command()
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
             e.message, metrics, cfg, search, _moments_summary(e.metadata.get("moments")),
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
    for r in rows:
        pct = lambda x: "-" if x is None else f"{100 * x:.2f}%"  # noqa: E731
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


@app.command()
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


@app.command()
def diff(
    url: str, ref_a: str, ref_b: str,
    values: Annotated[bool, _flag("--values", help="Also read both versions: max abs and relative L2 change (integer, bool and byte tensors: whether their bytes changed).")] = False,
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


EXPORT_FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch"}
#: --format's values -> the format; ``hf`` is a folder, the others a file whose extension agrees
FORMAT_NAMES = {"safetensors": "safetensors", "pt": "torch", "hf": "hf"}


@app.command()
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
    """Write a version's model tensors to a .safetensors, .pt or .pth file, or with --format hf
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


def _check_name_mode(kind: str, name: str | None, ref: str | None, delete: bool) -> None:
    if delete and name is None:
        raise typer.BadParameter(f"Expected the {kind} NAME to delete. Got none instead; "
                                 f"run `inshrink {kind} URL NAME --delete`.")
    if delete and ref is not None:
        raise typer.BadParameter(f"Expected no REF with --delete. Got {ref!r} instead; "
                                 f"run `inshrink {kind} URL NAME --delete` alone.")


def _list_tags(repo: ins.Repository, as_json: bool) -> None:
    tags = repo.tags()
    if as_json:
        _json([{"name": n, "snapshot": sid} for n, sid in sorted(tags.items())])
        return
    table = Table("tag", "snapshot")
    for n, sid in sorted(tags.items()):
        _row(table, n, sid)
    out.print(table)


@app.command()
def tags(url: str, as_json: JsonOpt = False) -> None:
    """List the tags (the same as `inshrink tag URL`)."""
    _list_tags(_open(url), as_json)


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
        _list_tags(repo, as_json)
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


@app.command()
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


@app.command()
def du(
    url: str, ref: Annotated[str, typer.Argument()] = "main",
    prefix: Annotated[str, typer.Option("--prefix", help="Only tensors under this path, e.g. model/.")] = "",
    as_json: JsonOpt = False,
) -> None:
    """Per version: logical bytes, new stored bytes, cumulative stored bytes, ratio (and, for a
    training state, the weights' and the optimizer's overall ratios apart)."""
    repo = _open(url)
    # the whole store's accounting only where the rows are the whole of each version (no prefix)
    summary = None if prefix or as_json else repo.du_summary(ref)
    rows = summary.rows if summary is not None else repo.du(ref, prefix)
    # a training state's parts apart: the weights' and the optimizer's overall ratios
    parts = {} if prefix else {name: {r.snapshot: r for r in repo.du(ref, name + "/")}
                               for name in ("model", "optimizer")}
    parts = {name: by_id for name, by_id in parts.items() if any(r.logical_bytes for r in by_id.values())}
    if as_json:
        _json([{**r.to_dict(), **{f"{name}_cumulative_ratio": by_id[r.snapshot].cumulative_ratio
                                  for name, by_id in parts.items()}} for r in rows])
        return
    labels = {"model": "weights overall", "optimizer": "optimizer overall"}
    residuals = any(r.residual_bytes for r in rows)
    table = Table("snapshot", "step", "logical", "new stored", "deltas", "cumulative", "ratio", "overall",
                  *(labels[name] for name in parts), *(["exact resume"] if residuals else []))
    for r in rows:
        _row(table, r.snapshot[:12], r.step if r.step is not None else "-", _size(r.logical_bytes),
             _size(r.new_stored_bytes), f"{r.delta_objects}/{r.new_objects}",
             _size(r.cumulative_stored_bytes), _ratio(r.ratio), _ratio(r.cumulative_ratio),
             *(_ratio(by_id[r.snapshot].cumulative_ratio) for by_id in parts.values()),
             *([_size(r.residual_bytes) if r.residual_bytes else "-"] if residuals else []))
    out.print(table)
    if summary is not None:
        out.print(_du_totals(summary))
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
                     ("documents and refs (snapshots, settings, leases)", summary.metadata),
                     ("unreferenced (the next gc deletes it)", summary.unreferenced),
                     ("total under the store", summary.total)):
        _row(table, label, _size(n))
    return table


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
                  "moments", "m. ratio", "state", "state ratio", "accuracy")
    for r in result.rows:
        c = r["config"] or {}
        _row(table, r["step"], c.get("bins", "lossless"),
             f"{c['prune']:.0%} {c['prune_metric'][:3]}" if c else "-",
             f"{c['protect']:.2%}" if c else "-", r["search"] or "-", r["evaluations"],
             _size(r["model_stored_bytes"]), _ratio(r["model_ratio"]),
             _size(r["optimizer_stored_bytes"]), _ratio(r["optimizer_ratio"]),
             _size(r["stored_bytes"]), _ratio(r["ratio"]),
             "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}")
    out.print(table)
    weights = result.model_logical_bytes / max(result.model_stored_bytes, 1)
    total = result.logical_bytes / max(result.stored_bytes, 1)
    _say(out, f"model weights: {_size(result.model_stored_bytes)} stored for {_size(result.model_logical_bytes)}: ",
         (f"{weights:.1f}x", "bold"), " smaller end to end")
    moments = result.optimizer_logical_bytes / max(result.optimizer_stored_bytes, 1)
    _say(out, f"Adam moments: {_size(result.optimizer_stored_bytes)} stored for "
              f"{_size(result.optimizer_logical_bytes)}: ", (f"{moments:.1f}x", "bold"),
         " smaller (each tensor checked by the update it drives)")
    _say(out, f"whole training state: {_size(result.stored_bytes)} stored for "
              f"{_size(result.logical_bytes)}: ", (f"{total:.1f}x", "bold"), " smaller end to end")
    if result.residual_bytes:
        on_disk = result.stored_bytes + result.residual_bytes
        _say(out, f"exact resume: the newest version's restore residual, {_size(result.residual_bytes)} more "
                  f"({_size(on_disk)} on disk: {result.logical_bytes / max(on_disk, 1):.1f}x)")
    _say(out, "accuracy restored from the last compressed checkpoint: ", (f"{result.restored_accuracy:.3f}", "bold"),
         f" (uncompressed run: {result.reference_accuracy:.3f})")
    if result.resumed_from_step is not None:
        how = ", bit-exact (restore residual)" if result.resumed_exact else ", from the compressed values"
        _say(out, f"resumed after a simulated failure from step {result.resumed_from_step}{how}")
    _say(out, f"training {result.train_s:.1f}s, waiting on checkpoints {result.checkpoint_wait_s:.2f}s, "
              f"search in the background {result.search_s:.1f}s")
    _say(out, "inspect it: inshrink log ", url, "  ·  inshrink du ", url)


def _error_line(exc: BaseException) -> str:
    """One line for an error the user can act on: "Expected X. Got Y instead." plus the fix."""
    if isinstance(exc, ins.StorageError):
        line = str(exc) + _backend_hint(_session.url)
    elif isinstance(exc, InshrinkError):
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
    # backends log their retries and tracebacks (gcsfs, botocore) before raising; with no
    # handler configured Python prints them to stderr: the error line says it all
    logging.getLogger().addHandler(logging.NullHandler())
    try:
        app(standalone_mode=True)
    except (InshrinkError, OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        _say(err, ("error:", "red"), " ", _error_line(exc))
        sys.exit(1)


if __name__ == "__main__":
    main()

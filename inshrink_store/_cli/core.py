"""The ``inshrink`` command line's core (the CLI layer, the package's top layer): the typer
app and its global options, the settings of one invocation, shared option types, output
helpers (consoles, tables, sizes, JSON, the progress bar) and :func:`main`, which turns
errors into one line. The commands themselves live in the sibling modules and are
registered on :data:`app` by ``inshrink_store._cli``.

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
from typing import Annotated, Any

import fsspec
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

import inshrink_store as ins
from inshrink_store.errors import InshrinkError
from inshrink_store.storage import remote_service

app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Versioned, compressed checkpoint stores. Every command takes a store URL "
    "(a path, file://, memory://, s3://, gs://).",
)

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


def _storage_options(url: str) -> dict[str, Any] | None:
    """Backend options for the CLI: a short connect timeout and few retries on s3:// and
    gs:// (botocore's defaults wait far longer when an endpoint or the network is gone).
    Other settings come from fsspec's configuration and the usual environment variables
    (AWS_ENDPOINT_URL, AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS...)."""
    service = remote_service(url)
    if service == "s3":
        configured = (fsspec.config.conf.get("s3") or {}).get("config_kwargs") or {}
        return {"config_kwargs": {"retries": {"max_attempts": 2}, **configured,
                                  "connect_timeout": _session.timeout}}
    if service == "gcs":
        try:
            import aiohttp
        except ImportError:  # gcsfs is not installed: Storage names the extra to install
            return None
        return {"requests_timeout": aiohttp.ClientTimeout(total=None, sock_connect=_session.timeout)}
    return None


def _backend_hint(url: str | None) -> str:
    """Where a remote backend gets its settings, for an error line about it."""
    service = remote_service(url or "")
    if service == "s3":
        where = ("S3 credentials come from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, "
                 "an endpoint other than AWS from AWS_ENDPOINT_URL")
    elif service == "gcs":
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

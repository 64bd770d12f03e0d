"""From a store URL to a store, for the commands (the CLI layer, the package's top layer):
opening one with the CLI's backend options, looking at what a URL names before creating a
store there (a new path, an empty folder, someone else's files, a missing bucket), and the
clear errors for a damaged ``inshrink.json`` or a bucket that does not exist.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec

import inshrink_store as ins
from inshrink_store._cli.core import _n, _say, _session, _storage_options, err
from inshrink_store.errors import FormatError, InshrinkError
from inshrink_store.layout import CONFIG_FILE
from inshrink_store.storage import local_path, remote_service, require_supported


def _local_path(url: str) -> Path | None:
    """The directory a store URL names on this machine, or None for a remote or memory URL
    (storage's scheme table says which)."""
    path = local_path(url)
    return None if path is None else Path(path)


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
    if remote_service(url) is None:
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

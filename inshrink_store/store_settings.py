"""The store's settings file, ``inshrink.json``: written once when a store is made, read and
checked on every open (the format version, the keyframe interval), and the typed parts an
opened store is made of.
Layer: beside the write session (``session`` | ``rank_writer`` | ``store_settings``), above ``parts``.

Why apart from the facade (:mod:`inshrink_store.repository`): making and opening a store is
the one job of the facade that needs the format's own names (``layout.CONFIG_FILE``,
``manifest.FORMAT_VERSION``) and the object store's defaults; the facade only fronts the
rooms, and without this job it imports at most 12 of them (issue 45).
"""

from __future__ import annotations

import json
import os
from typing import Any

from inshrink_store.cas import DEFAULT_KEYFRAME_INTERVAL, ObjectStore
from inshrink_store.errors import AlreadyExistsError, FormatError, IntegrityError
from inshrink_store.history import History
from inshrink_store.layout import CONFIG_FILE
from inshrink_store.manifest import FORMAT_VERSION, canonical_json, utc_now
from inshrink_store.parts import StoreParts
from inshrink_store.refs import Refs
from inshrink_store.storage import Storage

#: the largest keyframe interval a store's settings may name
MAX_KEYFRAME_INTERVAL = 4096


def create(storage: Storage, url: str, keyframe_interval: int | None = None, *, exist_ok: bool = False) -> None:
    """Write the settings of an empty store at ``storage`` (``url``: as the caller named it);
    an existing store is an AlreadyExistsError unless ``exist_ok``."""
    if storage.is_local and os.path.exists(storage.root) and not os.path.isdir(storage.root):
        raise FormatError(
            f"Expected a folder (or nothing) at {url!r} to create a store in. Got a file there "
            "instead; choose another path."
        )
    settings = {
        "format": FORMAT_VERSION,
        "created": utc_now(),
        "keyframe_interval": keyframe_interval or DEFAULT_KEYFRAME_INTERVAL,
    }
    try:
        storage.create_exclusive(CONFIG_FILE, canonical_json(settings))
    except FileNotFoundError:
        storage.require_bucket()  # an object store's "no such file" on a write: its bucket is missing
        raise
    except FileExistsError:
        if not exist_ok:
            raise AlreadyExistsError(
                f"Expected no store at {url!r}. Got an existing inshrink store instead; "
                "open it with inshrink_store.open(url)."
            ) from None


def require_store(storage: Storage) -> None:
    """Where opening found no settings file: the NotFoundError that names what is missing (the
    bucket, the folder or the store), or nothing when the settings file is there after all."""
    storage.require_exists(CONFIG_FILE)


def open_parts(storage: Storage, keyframe_interval: int | None = None) -> tuple[dict[str, Any], StoreParts]:
    """(the settings, the typed parts) of the store at ``storage``, its settings checked:
    FileNotFoundError when it has none, FormatError for another format, IntegrityError for
    settings that are not what a store writes. ``keyframe_interval`` overrides the stored one."""
    settings = read(storage)
    if settings.get("format") != FORMAT_VERSION:
        raise FormatError(
            f"Expected store format {FORMAT_VERSION}. Got {settings.get('format')!r} "
            "instead; upgrade inshrink-store to read this store."
        )
    interval = keyframe_interval or settings.get("keyframe_interval", DEFAULT_KEYFRAME_INTERVAL)
    if isinstance(interval, bool) or not isinstance(interval, int) or not 1 <= interval <= MAX_KEYFRAME_INTERVAL:
        raise IntegrityError(
            f"Expected keyframe_interval in {storage.url!r}/{CONFIG_FILE} to be an integer "
            f"from 1 to {MAX_KEYFRAME_INTERVAL}. Got {interval!r} instead: the store's settings are corrupt."
        )
    objects = ObjectStore(storage, keyframe_interval=interval)
    return settings, StoreParts(storage, objects, Refs(storage), History(storage))


def read(storage: Storage) -> dict[str, Any]:
    """``inshrink.json`` as a dict, or an IntegrityError naming the file and what is wrong."""
    raw = storage.read(CONFIG_FILE)
    try:
        settings = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(
            f"Expected {storage.url!r}/{CONFIG_FILE} to hold the store's settings as JSON. Got "
            f"{len(raw)} bytes that are not JSON instead ({type(exc).__name__}): the file is "
            "corrupt; it holds only the format and keyframe interval, so restore it from "
            'another store (e.g. {"format": 1, "keyframe_interval": 8}).'
        ) from None
    if not isinstance(settings, dict):
        raise IntegrityError(
            f"Expected {storage.url!r}/{CONFIG_FILE} to hold a JSON object. Got a "
            f"{type(settings).__name__} instead: the file is corrupt."
        )
    return settings

"""Reading a codec's configuration, the same way for every codec: clear errors, no guessing.
Layer: codecs, storage and structure (siblings, none importing another), above the helpers.

zarr.json (and numcodecs configs) are data anything may have written, so a codec entry that
is not ``{"name": ..., "configuration": {...}}`` or a configuration with a key this version
does not know is a :class:`FormatError` naming it, never a silently ignored setting.
"""

from __future__ import annotations

from typing import Any

from zarr.core.common import parse_named_configuration

from inshrink_store.errors import FormatError


def named_configuration(data: Any, codec: str) -> Any:
    """The ``configuration`` of a zarr v3 codec entry named ``codec``."""
    try:
        _, config = parse_named_configuration(data, codec)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise FormatError(
            f"Expected a codec entry {{'name': {codec!r}, 'configuration': {{...}}}}. "
            f"Got {data!r:.80} instead ({exc})."
        ) from None
    return config


def check_config(config: Any, allowed: tuple[str, ...], codec: str) -> dict[str, Any]:
    """A codec configuration as keyword arguments: a dict with only ``allowed`` keys (a
    FormatError names the first unknown one)."""
    if not isinstance(config, dict):
        raise FormatError(f"Expected the {codec} configuration to be a dict. Got {config!r:.80} instead.")
    unknown = [k for k in config if k not in allowed]
    if unknown:
        raise FormatError(
            f"Expected only the keys {list(allowed)} in the {codec} configuration. Got the "
            f"unknown key {unknown[0]!r:.80} instead; remove it (or upgrade inshrink-store if "
            "a newer version wrote it)."
        )
    return dict(config)

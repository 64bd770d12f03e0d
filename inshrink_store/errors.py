"""One error tree for the whole library, grouped by what the caller should do.

- ``NotFoundError`` (also a ``KeyError``): check the ref, tensor or URL.
- ``ConflictError``: another writer committed first; rebase or retry.
- ``IntegrityError``: stored bytes do not match their hash or checksum; stop and
  run ``inshrink verify``.
- ``FormatError`` (also a ``ValueError``): malformed payload, config or input.
- ``MissingDependencyError`` (also an ``ImportError``): install the named extra.

Messages follow "Expected X. Got Y instead." plus the fix where one exists.
Only the standard library lives here, so every layer can import it.
"""

from __future__ import annotations


class InshrinkError(Exception):
    """Base of every error raised on purpose by inshrink-store."""


class NotFoundError(InshrinkError, KeyError):
    """A ref, snapshot, tensor, object or store that does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class ConflictError(InshrinkError):
    """Another writer advanced the branch first; nothing was lost, retry or rebase."""


class AlreadyExistsError(ConflictError):
    """A name that must be new is taken: a tag, a branch, a store at that URL."""


class GcRunningError(ConflictError):
    """A gc holds the store and did not finish within the wait; nothing was written, retry."""


class LeaseBrokenError(ConflictError):
    """A gc judged this writer dead before it published; nothing was published, retry."""


class IntegrityError(InshrinkError):
    """Stored bytes fail their content hash or checksum, or a delta chain is broken."""


class FormatError(InshrinkError, ValueError):
    """Malformed payload, configuration, URL, name or unsupported input."""


class MissingDependencyError(InshrinkError, ImportError):
    """An optional dependency is needed; the message names the extra to install."""


def require(module: str, extra: str):  # type: ignore[no-untyped-def]
    """Import an optional module or raise an error naming the pip extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"Expected the optional module {module!r} to be installed. Got an ImportError "
            f"instead ({exc}). Install it with: pip install 'inshrink-store[{extra}]'"
        ) from exc

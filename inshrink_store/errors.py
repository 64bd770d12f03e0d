"""One error tree for the whole library, grouped by what the caller should do.
Layer: errors, the bottom one: it imports nothing of the package; every module may import it.

- ``NotFoundError`` (also a ``KeyError``): check the ref, tensor or URL.
- ``ConflictError``: someone else got there first; nothing was lost, retry or rebase.
  ``AlreadyExistsError`` (a tag, branch or store name is taken), ``GcRunningError``
  (a gc holds the store), ``LeaseBrokenError`` (a gc fenced this commit off).
- ``IntegrityError``: stored bytes are damaged (hash, checksum, malformed document);
  stop and run ``inshrink verify``. ``WriteCheckError``: a save caught itself about to
  store an object it could not read back (a bug; nothing was committed).
- ``FormatError`` (also a ``ValueError``): data in a format this version cannot use (a
  codec payload, an unknown format version). Its subclass ``InvalidInputError`` is a bad
  argument (a name, a config, a tensor, commit fields): fix the call.
- ``StorageError`` (also an ``OSError``): the backend failed (credentials, network,
  permissions); the data is fine.
- ``MissingDependencyError`` (also an ``ImportError``): install the named extra.
- ``BackgroundSaveError``: a Checkpointer's background save failed; the cause is chained.

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


class WriteCheckError(IntegrityError):
    """The writer produced an object its own reader would refuse or decode differently: a
    bug in inshrink-store, caught before the version was committed (nothing was lost). The
    message names the tensor, chunk and coder; please report it."""


class FormatError(InshrinkError, ValueError):
    """Malformed payload, configuration, URL, name or unsupported input."""


class StorageError(InshrinkError, OSError):
    """The storage backend failed (credentials, network, permissions, a full disk): nothing
    is wrong with the data; the message names the operation, the path and the cause."""


class InvalidInputError(FormatError):
    """A bad argument: a name, configuration, tensor, URL or commit field the caller passed.

    A subclass of FormatError so that code catching FormatError keeps working; catch
    InvalidInputError to tell "fix the call" apart from "this data cannot be used"."""


class BackgroundSaveError(InshrinkError):
    """A background save failed; raised by the Checkpointer's next call, with the cause chained."""


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

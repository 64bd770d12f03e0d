"""FlakyStorage: a :class:`~inshrink_store.storage.Storage` that fails on purpose.

Why it ships: a store is only as safe as its behaviour when storage hiccups. An S3 GET
throttled once, a disk that returns EIO, a PUT that timed out after the server stored it —
each must leave every committed version intact (the operation may fail; nothing that was
committed may be lost). ``FlakyStorage`` wraps the storage of a real store and makes chosen
or random calls fail, so a test can check exactly that, on memory, a local disk or an
object store, with the public API::

    import inshrink_store as ins
    from inshrink_store.testing import FlakyStorage

    ins.init(url)
    flaky = FlakyStorage.for_url(url)
    repo = ins.Repository(flaky)              # the store, reached through the wrapper
    flaky.fail("read", "snapshots/*", times=2)  # the next two snapshot reads fail
    ...                                       # repo.gc(...) may raise, must lose nothing
    with flaky.paused():                      # faults off: check what is left
        repo.verify()

What fails, and how:

- Operations come in four kinds (:data:`KINDS`): ``read`` (``read``, ``read_range``,
  ``size``, ``exists``, ``exists_durably``), ``write`` (``write``, ``create_exclusive``),
  ``list`` (``list``, ``temp_files``) and ``delete``. A rule names a kind or one method.
- A rule matches paths with :func:`fnmatch.fnmatchcase` over the store-relative path
  (``*`` also matches ``/``; ``objects/*`` is every chunk object); a listing matches by its
  prefix.
- :meth:`FlakyStorage.fail` with ``times=N`` is transient (the next N matching calls fail,
  then the rule is spent); ``times=None`` is permanent until :meth:`clear`.
- :meth:`FlakyStorage.fail_randomly` fails each matching call with a probability. The
  decision is a hash of (seed, method, path, how many times *that* method was called on
  *that* path), not a draw from one random stream, so the same program gets the same
  faults even when its calls run on a thread pool in a different order each time (the
  writer stores chunks in parallel): a failing run replays exactly, which is what a
  hypothesis state machine needs to shrink a failure.
- ``error="storage"`` raises :class:`InjectedStorageError` (a
  :class:`~inshrink_store.errors.StorageError`, what every backend raises for a failed
  request); ``error="os"`` raises :class:`InjectedOSError`, a bare ``OSError`` (EIO), as a
  backend that leaks its own exception would. Both carry :class:`InjectedFault`, so a test
  can tell an injected fault that came through unchanged from a real failure.
- ``when="after"`` (writes and deletes) performs the operation, *then* raises: the
  ambiguous outcome of a request that timed out after the server acted. A commit whose
  ref creation fails that way has committed although its caller saw an error.

Never injected: ``FileNotFoundError`` and ``FileExistsError``. Those are answers, not
failures (this object does not exist; another writer created it first), and code is
right to act on them; a storage that lies about them is corrupt, not flaky.

Every way the store reaches a file is a method of the protocol, so every one can fail here:
the wrapper has no fsspec filesystem to go around it by (the store's last such path, an
object's header read through a file handle where a ranged read failed, is
:meth:`~inshrink_store.storage.Storage.read_start` now).

Counters (:attr:`FlakyStorage.stats`) say how many calls of each kind were made and how
many faults were injected; :attr:`FlakyStorage.injected` lists each fault.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import hashlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from inshrink_store.errors import InvalidInputError, StorageError
from inshrink_store.storage import Storage, open_storage

T = TypeVar("T")
Kind = Literal["read", "write", "list", "delete"]
ErrorKind = Literal["storage", "os"]
When = Literal["before", "after"]

#: the methods of each kind of operation a rule can name
KINDS: dict[str, tuple[str, ...]] = {
    "read": ("read", "read_range", "read_start", "size", "exists", "exists_durably"),
    "write": ("write", "create_exclusive"),
    "list": ("list", "temp_files"),
    "delete": ("delete",),
}
_KIND_OF = {method: kind for kind, methods in KINDS.items() for method in methods}
_ERRORS = ("storage", "os")


class InjectedFault(Exception):  # noqa: N818 - a marker base: InjectedStorageError, InjectedOSError
    """Base of every exception a :class:`FlakyStorage` raises: ``op`` (the method), ``path``;
    ``except InjectedFault`` catches exactly the faults a test asked for."""

    op: str
    path: str


class InjectedStorageError(StorageError, InjectedFault):
    """An injected backend failure, raised as the backends raise theirs (a StorageError)."""

    def __init__(self, op: str, path: str, message: str) -> None:
        super().__init__(message)
        self.op, self.path = op, path


class InjectedOSError(OSError, InjectedFault):
    """An injected raw ``OSError`` (EIO): a backend that leaks its own exception type."""

    def __init__(self, op: str, path: str, message: str) -> None:
        super().__init__(errno.EIO, message)
        self.op, self.path = op, path


@dataclass
class FaultRule:
    """One way calls fail: which calls (``op``: a kind or a method; ``pattern``: paths),
    how (``error``, ``when``), and for how long (``times`` left; None: until cleared) or how
    often (``probability``, with ``seed``)."""

    op: str
    pattern: str = "*"
    times: int | None = 1
    error: ErrorKind = "storage"
    when: When = "before"
    probability: float | None = None
    seed: int = 0
    key: Callable[[str], str] | None = None
    injected: int = 0

    def matches(self, method: str, path: str) -> bool:
        if self.op not in (method, _KIND_OF[method]):
            return False
        if self.times is not None and self.times <= 0:
            return False
        return fnmatch.fnmatchcase(path, self.pattern)

    def fires(self, method: str, path: str, nth: int) -> bool:
        """Whether the ``nth`` call of ``method`` on ``path`` fails (a matching call)."""
        if self.probability is None:
            return True
        name = path if self.key is None else self.key(path)
        digest = hashlib.blake2b(f"{self.seed}\0{method}\0{name}\0{nth}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2.0**64 < self.probability


@dataclass(frozen=True)
class Injected:
    """One injected fault, as recorded in :attr:`FlakyStorage.injected`."""

    op: str
    kind: str
    path: str
    error: str
    when: str


@dataclass
class FaultStats:
    """Counters: calls made and faults injected, per kind of operation."""

    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_faults(self) -> int:
        return sum(self.faults.values())

    def to_dict(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "faults": dict(self.faults),
                "total_calls": self.total_calls, "total_faults": self.total_faults}


class FlakyStorage:
    """A :class:`~inshrink_store.storage.Storage` that passes every call to ``inner`` unless
    a fault rule says it fails (see the module's docstring). Use it wherever the store takes
    a storage: ``inshrink_store.Repository(FlakyStorage(inner))``.

    Capability flags, ``url`` and ``root`` are ``inner``'s: the store behaves as
    it does on that backend, faults aside. Thread-safe: the writer calls it from its thread
    pool. ``max_recorded`` bounds :attr:`injected` (the counters keep counting)."""

    url: str
    storage_options: dict[str, Any]
    root: str
    protocol: str
    is_local: bool
    is_remote: bool
    supports_rename: bool
    atomic_create: bool
    listing_consistent: bool

    def __init__(self, inner: Storage, *, max_recorded: int = 10_000) -> None:
        if isinstance(inner, FlakyStorage):
            raise InvalidInputError(
                "Expected a backend's storage to wrap. Got a FlakyStorage instead; add rules to it "
                "rather than wrapping it again.")
        self.inner = inner
        # the inner storage's identity and capabilities, fixed for its life: the store must
        # behave as it does on that backend (copied, not delegated: the protocol's members
        # are plain attributes)
        self.url, self.storage_options, self.root = inner.url, inner.storage_options, inner.root
        self.protocol, self.is_local, self.is_remote = inner.protocol, inner.is_local, inner.is_remote
        self.supports_rename, self.atomic_create = inner.supports_rename, inner.atomic_create
        self.listing_consistent = inner.listing_consistent
        self.rules: list[FaultRule] = []
        self.stats = FaultStats()
        self.injected: list[Injected] = []
        self.max_recorded = max_recorded
        self._enabled = True
        self._lock = threading.Lock()
        self._nth: dict[tuple[str, str], int] = {}

    @classmethod
    def for_url(cls, url: str, storage_options: dict[str, Any] | None = None) -> FlakyStorage:
        """A FlakyStorage over the storage :func:`~inshrink_store.storage.open_storage` gives
        ``url`` (the store must exist: ``inshrink_store.init(url)`` first)."""
        return cls(open_storage(url, storage_options))

    def __repr__(self) -> str:
        return f"FlakyStorage({self.inner!r}, {len(self.rules)} rules, {self.stats.total_faults} faults injected)"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- rules ----------------------------------------------------------------------------
    def fail(self, op: str, pattern: str = "*", *, times: int | None = 1, error: ErrorKind = "storage",
             when: When = "before") -> FaultRule:
        """Make calls of ``op`` (a kind of :data:`KINDS` or one of their methods) on paths
        matching ``pattern`` fail: the next ``times`` of them (transient), or every one until
        :meth:`clear` with ``times=None`` (permanent). Returns the rule (its ``injected``
        counts its faults)."""
        if times is not None and (isinstance(times, bool) or not isinstance(times, int) or times < 1):
            raise InvalidInputError(f"Expected times to be an int >= 1, or None (permanent). Got {times!r} instead.")
        return self._add(FaultRule(op, pattern, times, error, when))

    def fail_randomly(self, probability: float, *, ops: tuple[str, ...] = tuple(KINDS), pattern: str = "*",
                      seed: int = 0, error: ErrorKind = "storage", when: When = "before",
                      key: Callable[[str], str] | None = None) -> list[FaultRule]:
        """Fail each call of ``ops`` on paths matching ``pattern`` with ``probability``,
        deterministically for ``seed`` (see the module's docstring); until :meth:`clear`.

        ``key`` maps a path to the name hashed in its place. Why: a snapshot id holds its
        commit time and a lease name a random token, so two runs of one program touch
        different paths there; a ``key`` that names them by something stable (the order in
        which the test first met them) makes the second run get the first run's faults."""
        if not 0.0 <= probability <= 1.0:
            raise InvalidInputError(f"Expected a probability in [0, 1]. Got {probability!r} instead.")
        return [self._add(FaultRule(op, pattern, None, error, when, probability, seed, key)) for op in ops]

    def _add(self, rule: FaultRule) -> FaultRule:
        if rule.op not in KINDS and rule.op not in _KIND_OF:
            raise InvalidInputError(
                f"Expected op to be one of {sorted(KINDS)} or a storage method ({sorted(_KIND_OF)}). "
                f"Got {rule.op!r} instead.")
        if rule.error not in _ERRORS:
            raise InvalidInputError(f"Expected error to be 'storage' or 'os'. Got {rule.error!r} instead.")
        if rule.when not in ("before", "after"):
            raise InvalidInputError(f"Expected when to be 'before' or 'after'. Got {rule.when!r} instead.")
        kind = _KIND_OF.get(rule.op, rule.op)
        if rule.when == "after" and kind not in ("write", "delete"):
            raise InvalidInputError(
                f"Expected when='after' only for writes and deletes (the operation happens, then fails). "
                f"Got it for {rule.op!r} instead: a failed read or listing has no effect to keep.")
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every rule (the counters stay)."""
        with self._lock:
            self.rules.clear()

    @property
    def enabled(self) -> bool:
        """False while :meth:`paused`: every call goes through, and none is counted."""
        return self._enabled

    @contextlib.contextmanager
    def paused(self) -> Iterator[FlakyStorage]:
        """No faults (and no counting) inside the block: check what a faulty run left."""
        saved, self._enabled = self._enabled, False
        try:
            yield self
        finally:
            self._enabled = saved

    # -- the decision -------------------------------------------------------------------------
    def _fault(self, method: str, path: str) -> FaultRule | None:
        """Count the call; the rule it triggers, if any (a transient rule is spent by one)."""
        if not self._enabled:
            return None
        kind = _KIND_OF[method]
        with self._lock:
            self.stats.calls[kind] += 1
            nth = self._nth.get((method, path), 0)
            self._nth[(method, path)] = nth + 1
            for rule in self.rules:
                if rule.matches(method, path) and rule.fires(method, path, nth):
                    if rule.times is not None:
                        rule.times -= 1
                    rule.injected += 1
                    self.stats.faults[kind] += 1
                    if len(self.injected) < self.max_recorded:
                        self.injected.append(Injected(method, kind, path, rule.error, rule.when))
                    return rule
        return None

    def reset_counts(self) -> None:
        """Zero the counters, the record of faults and the per-path call numbers that seeded
        random rules hash (rules stay)."""
        with self._lock:
            self.stats = FaultStats()
            self.injected.clear()
            self._nth.clear()

    def _raise(self, rule: FaultRule, method: str, path: str) -> None:
        message = (f"Expected to {method} {path or '/'} in {self.inner.url!r}. Got an injected fault "
                   f"({rule.error}, {rule.when} the operation) instead: FlakyStorage was told to fail it.")
        if rule.error == "os":
            raise InjectedOSError(method, path, message)
        raise InjectedStorageError(method, path, message)

    def _call(self, method: str, path: str, fn: Callable[[], T]) -> T:
        rule = self._fault(method, path)
        if rule is None:
            return fn()
        if rule.when == "after":
            fn()
        self._raise(rule, method, path)
        raise AssertionError("unreachable")

    # -- the Storage protocol: operations that can fail -------------------------------------
    def read(self, path: str) -> bytes:
        return self._call("read", path, lambda: self.inner.read(path))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        return self._call("read_range", path, lambda: self.inner.read_range(path, start, end))

    def read_start(self, path: str, length: int) -> bytes:
        return self._call("read_start", path, lambda: self.inner.read_start(path, length))

    def size(self, path: str) -> int:
        return self._call("size", path, lambda: self.inner.size(path))

    def exists(self, path: str) -> bool:
        return self._call("exists", path, lambda: self.inner.exists(path))

    def exists_durably(self, path: str) -> bool:
        return self._call("exists_durably", path, lambda: self.inner.exists_durably(path))

    def write(self, path: str, data: bytes) -> None:
        self._call("write", path, lambda: self.inner.write(path, data))

    def create_exclusive(self, path: str, data: bytes) -> None:
        self._call("create_exclusive", path, lambda: self.inner.create_exclusive(path, data))

    def list(self, prefix: str) -> dict[str, int]:
        return self._call("list", prefix, lambda: self.inner.list(prefix))

    def temp_files(self) -> dict[str, tuple[int, float | None]]:
        return self._call("temp_files", "", self.inner.temp_files)

    def delete(self, path: str) -> None:
        self._call("delete", path, lambda: self.inner.delete(path))

    def require_bucket(self) -> None:
        self.inner.require_bucket()

    def require_exists(self, marker: str) -> None:
        self.inner.require_exists(marker)


__all__ = ["KINDS", "FaultRule", "FaultStats", "FlakyStorage", "Injected", "InjectedFault", "InjectedOSError",
           "InjectedStorageError"]

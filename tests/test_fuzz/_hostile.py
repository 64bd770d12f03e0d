"""Shared pieces of the fuzz suite: the only allowed failure, a memory bound, JSON strategies.

Every fuzz test feeds hostile bytes or documents to a reader and requires that it either
succeeds (with the right answer, where one is known) or raises an ``InshrinkError``
subclass; anything else escaping (KeyError, TypeError, MemoryError, OverflowError,
RecursionError, ...) fails the test. ``bounded`` also fails a test whose traced peak
allocation passes ``limit`` bytes: hostile inputs here are a few KiB, so a reader that
allocates what a header declares instead of what the input can hold is caught.
"""

from __future__ import annotations

import contextlib
import tracemalloc
from collections.abc import Iterator
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from inshrink_store.errors import InshrinkError

MEMORY_LIMIT = 64 << 20

#: default run: a modest budget (the whole folder stays well under a minute)
FAST = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
#: ``-m slow``: the large budget
SLOW = settings(max_examples=5000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Outcome:
    """What a guarded call did: ``error`` is the InshrinkError it raised, or None."""

    error: InshrinkError | None = None
    peak: int = 0


@contextlib.contextmanager
def bounded(limit: int = MEMORY_LIMIT) -> Iterator[Outcome]:
    """Allow only InshrinkError out of the block, and at most ``limit`` traced bytes."""
    outcome = Outcome()
    tracemalloc.start()
    try:
        yield outcome
    except InshrinkError as exc:
        outcome.error = exc
    finally:
        outcome.peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert outcome.peak < limit, f"peak allocation {outcome.peak} bytes for a hostile input"


INTERESTING_INTS = st.sampled_from(
    [0, 1, -1, 2, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**53, 2**62, 2**63 - 1,
     2**63, 2**64 - 1, 2**64, 10**30, -(2**63)]
)
INTERESTING_STRINGS = st.sampled_from(
    ["", "..", "../../x", "/abs", "a//b", "c/0", "c/0/0", "zarr.json", "\x00", "main\n",
     "0" * 32, "f" * 32, "A" * 32, "nan", "inf", "$float", "regular", "default", "v2",
     "float32", "uint16", "bool", "object", "inshrink.nuq", "blosc", "bytes", "array", "group"]
)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), INTERESTING_INTS,
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12), INTERESTING_STRINGS,
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=8), INTERESTING_STRINGS), inner, max_size=5),
        st.fixed_dictionaries({"$float": st.one_of(st.sampled_from(["nan", "inf", "-inf"]), inner)}),
    ),
    max_leaves=12,
)


def paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every location in a JSON document (the root is ``()``)."""
    out = [prefix]
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            out += paths(value, (*prefix, i))
    return out


def mutate(doc: Any, data: st.DataObject) -> Any:
    """Replace, delete or add one value somewhere in ``doc`` (a parsed JSON document)."""
    where = data.draw(st.sampled_from(paths(doc)), label="path")
    action = data.draw(st.sampled_from(["replace", "delete", "add"]), label="action")
    new = data.draw(JSON, label="value")
    if not where:
        return new if action != "add" or not isinstance(doc, dict) else {**doc, "extra": new}
    parent = doc
    for step in where[:-1]:
        parent = parent[step]
    last = where[-1]
    if action == "delete":
        del parent[last]
    elif action == "add" and isinstance(parent, dict):
        parent[data.draw(st.text(max_size=6), label="key")] = new
    else:
        parent[last] = new
    return doc


def mutate_bytes(raw: bytes, data: st.DataObject) -> bytes:
    """Flip bits, truncate, extend or overwrite a span of ``raw``."""
    buf = bytearray(raw)
    action = data.draw(st.sampled_from(["flip", "truncate", "extend", "overwrite", "random"]),
                       label="byte action")
    if action == "flip" and buf:
        for pos in data.draw(st.lists(st.integers(0, len(buf) - 1), min_size=1, max_size=4)):
            buf[pos] ^= 1 << data.draw(st.integers(0, 7))
    elif action == "truncate":
        del buf[data.draw(st.integers(0, max(len(buf) - 1, 0))):]
    elif action == "extend":
        buf += data.draw(st.binary(min_size=1, max_size=64))
    elif action == "overwrite" and buf:
        start = data.draw(st.integers(0, len(buf) - 1))
        span = data.draw(st.binary(min_size=1, max_size=16))
        buf[start:start + len(span)] = span
    else:
        buf = bytearray(data.draw(st.binary(max_size=256)))
    return bytes(buf)

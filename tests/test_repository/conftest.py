"""Temporary backend fixtures for the repository tests (memory and local only).

``tests/conftest.py`` (owned elsewhere) is meant to provide ``memory_url``,
``local_url``, ``s3_url``, ``gcs_url`` and ``store_url``; these have the same
names so this file can simply be deleted once that one exists.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fsspec.implementations.memory import MemoryFileSystem


def _clear_memory(root: str) -> None:
    """memory:// is one process-global dict: drop everything under ``root``."""
    prefix = f"/{root}"
    for key in [k for k in MemoryFileSystem.store if k == prefix or k.startswith(prefix + "/")]:
        MemoryFileSystem.store.pop(key, None)
    MemoryFileSystem.pseudo_dirs[:] = [
        d for d in MemoryFileSystem.pseudo_dirs if not (d == prefix or d.startswith(prefix + "/"))
    ]


@pytest.fixture
def memory_url() -> Iterator[str]:
    name = f"inshrink-test-{uuid.uuid4().hex}"
    yield f"memory://{name}"
    _clear_memory(name)


@pytest.fixture
def local_url(tmp_path: Path) -> str:
    return str(tmp_path / "store")


@pytest.fixture(params=["memory", "local"])
def store_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))

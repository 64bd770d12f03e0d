"""HTTP requests each store operation makes against an object store (S3).

On an object store a request costs tens of milliseconds, so the number of requests, not
the bytes, is what makes a small operation slow. This counts them against moto's S3
server on 127.0.0.1, in process: a hook on aiobotocore's ``AioEndpoint._send`` (every
request s3fs sends goes through it) counts each request by HTTP method; a GET whose query
has ``list-type=2`` is a listing and counted as LIST, not GET. Every input is seeded and
the counts do not depend on the machine. Needs s3fs and ``moto[server]`` (the ``s3`` and
``test`` extras). Run through ``python -m benchmarks run`` or alone:
``python -m benchmarks requests [--quick]``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import numpy as np

import inshrink_store as ins
from inshrink_store.index import CACHE

BUCKET = "inshrink-bench"
_SERVERS = itertools.count()  # one bucket per server started in this process
COLUMNS = ("GET", "LIST", "PUT", "HEAD", "DELETE")
#: dummy credentials: moto accepts anything, and these keep botocore off the host's own
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
SHAPE = (64, 64)
READ = "layer7.weight"


# -- counting -----------------------------------------------------------------------------


def kind_of(method: str, url: str) -> str:
    """GET, LIST (a GET of a ``list-type=2`` listing), PUT, HEAD, DELETE or another method."""
    if method == "GET" and "list-type=2" in urlsplit(url).query.split("&"):
        return "LIST"
    return method


class RequestCounter:
    """Every request sent while installed, as (method, URL); thread safe."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def record(self, method: str, url: str) -> None:
        with self._lock:
            self.requests.append((method, url))

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()

    def counts(self) -> dict[str, int]:
        """Requests by kind (see :func:`kind_of`), plus ``total``."""
        with self._lock:
            found = collections.Counter(kind_of(m, u) for m, u in self.requests)
        return {"total": sum(found.values()), **found}


@contextlib.contextmanager
def counting() -> Iterator[RequestCounter]:
    """Count every request s3fs sends until the block ends, then restore the endpoint."""
    from aiobotocore.endpoint import AioEndpoint

    counter = RequestCounter()
    original = AioEndpoint._send

    async def send(self: Any, request: Any) -> Any:
        counter.record(str(request.method).upper(), str(request.url))
        return await original(self, request)

    AioEndpoint._send = send  # type: ignore[method-assign]
    try:
        yield counter
    finally:
        AioEndpoint._send = original  # type: ignore[method-assign]


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 with one bucket, fsspec pointed at it; yields the
    bucket's URL. Environment, fsspec configuration and logging are restored after."""
    import fsspec
    from moto.server import ThreadedMotoServer

    saved_env = {name: os.environ.get(name) for name in AWS_ENV}
    saved_conf = fsspec.config.conf.get("s3")
    werkzeug = logging.getLogger("werkzeug")  # moto's server logs every request otherwise
    saved_level = werkzeug.level
    werkzeug.setLevel(logging.ERROR)
    os.environ.update(AWS_ENV)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        fsspec.config.conf["s3"] = {
            "client_kwargs": {"endpoint_url": f"http://{host}:{port}"},
            "key": AWS_ENV["AWS_ACCESS_KEY_ID"],
            "secret": AWS_ENV["AWS_SECRET_ACCESS_KEY"],
            "token": AWS_ENV["AWS_SESSION_TOKEN"],
            "skip_instance_cache": True,
        }
        # moto keeps its buckets in the process, not the server: a second server in the same run
        # (run.py starts one per section) would find the first one's bucket and objects
        bucket = f"{BUCKET}-{next(_SERVERS)}"
        fsspec.filesystem("s3").mkdir(bucket)
        yield f"s3://{bucket}"
    finally:
        server.stop()
        werkzeug.setLevel(saved_level)
        if saved_conf is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved_conf
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# -- the workload -------------------------------------------------------------------------


def make_state(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` seeded 64x64 float32 tensors named ``layer<i>.weight``."""
    rng = np.random.default_rng(seed)
    return {f"layer{i}.weight": rng.standard_normal(SHAPE).astype(np.float32) for i in range(n)}


def _measure(counter: RequestCounter, fn: Callable[[], Any], *, cold: bool = True) -> tuple[dict[str, int], Any]:
    if cold:
        CACHE.clear()  # as a fresh process sees the store
    counter.reset()
    result = fn()
    counts = counter.counts()
    counter.reset()
    return counts, result


def _open_and_read(url: str, path: str) -> np.ndarray:
    return np.asarray(ins.open(url).checkout("main")[path][...])


def run(quick: bool = False) -> dict[str, Any]:
    """Request counts per operation; ``quick`` uses 300 tensors instead of 1000 for the
    large snapshot (the point, a count that does not grow with it, shows the same) and a
    history of 30 versions instead of 100 for ``log``."""
    big = 300 if quick else 1000
    versions = 30 if quick else 100
    rows: list[tuple[str, dict[str, int]]] = []
    with s3_server() as bucket, counting() as counter:
        run_id = uuid.uuid4().hex[:8]
        url = f"{bucket}/{run_id}-100"
        state = make_state(100)
        repo = ins.init(url)
        counts, _ = _measure(counter, lambda: repo.save(state, message="v0"))
        rows.append(("save the first version (100 tensors, no parent)", counts))

        counts, _ = _measure(counter, lambda: ins.open(url))
        rows.append(("`ins.open` of a store", counts))
        counts, got = _measure(counter, lambda: _open_and_read(url, READ))
        assert np.array_equal(got, state[READ])
        rows.append(("open + read one tensor of a 100-tensor snapshot (cold cache)", counts))

        url_big = f"{bucket}/{run_id}-{big}"
        state_big = make_state(big, seed=1)
        ins.init(url_big).save(state_big, message="v0")
        counts, got = _measure(counter, lambda: _open_and_read(url_big, READ))
        assert np.array_equal(got, state_big[READ])
        rows.append((f"open + read one tensor of a {big}-tensor snapshot (cold cache)", counts))

        repo = ins.open(url)
        for version, cold in ((1, True), (2, False)):
            state = {**state, READ: state[READ] + np.float32(1)}
            counts, _ = _measure(counter, lambda s=state, v=version: repo.save(s, message=f"v{v}"), cold=cold)
            when = "cold cache" if cold else "warm: right after the previous save, same process"
            rows.append((f"save with a parent, 1 of 100 tensors changed ({when})", counts))
        counts, _ = _measure(counter, lambda: repo.save(state, message="v3"))
        rows.append(("save the same 100 tensors again (cold cache)", counts))

        url_log = f"{bucket}/{run_id}-log"
        small = make_state(3, seed=2)
        repo_log = ins.init(url_log)
        for step in range(versions):
            small["layer0.weight"][0, 0] = step
            repo_log.save(small, message=f"v{step}", step=step)
        repo_log = ins.open(url_log)
        counts, log = _measure(counter, repo_log.log)
        assert len(log) == versions
        rows.append((f"`log` of {versions} versions (cold cache)", counts))

        kept = len(repo.log())
        counts, report = _measure(counter, repo.verify)
        assert report.ok, report
        rows.append((f"`verify` of the 100-tensor store ({kept} versions)", counts))
        counts, _ = _measure(counter, repo.gc)
        rows.append((f"`gc` of the 100-tensor store ({kept} versions, nothing to delete)", counts))
        assert np.array_equal(_open_and_read(url, READ), state[READ])
    return {"rows": rows, "big": big, "versions": versions}


def to_markdown(result: dict[str, Any]) -> str:
    rows: list[tuple[str, dict[str, int]]] = result["rows"]
    others = sorted({k for _, c in rows for k, v in c.items() if v and k != "total" and k not in COLUMNS})
    columns = (*COLUMNS, *others)
    lines = [
        "HTTP requests per store operation on S3: moto's S3 server on 127.0.0.1 (loopback), "
        "counted in process by a hook on the S3 client (aiobotocore's `AioEndpoint._send`, "
        "which every s3fs request goes through). LIST is a GET with `list-type=2` (a "
        "listing); GET counts the other GETs, including the one-byte ranged GET that checks "
        "whether an object exists. Tensors are seeded 64x64 float32, one chunk each, saved "
        "lossless on branch `main`. \"Cold cache\" means the process-wide index of "
        "snapshots was emptied first (`inshrink_store.index.CACHE.clear()`), as in a fresh "
        "process. Reads include opening the store (the `ins.open` row); the other rows "
        f"count the operation alone. `log` walks {result['versions']} versions of a "
        "3-tensor state. Counts are exact and do not depend on the machine.",
        "",
        "| operation | requests | " + " | ".join(columns) + " |",
        "|---|" + "---|" * (len(columns) + 1),
    ]
    for name, counts in rows:
        cells = " | ".join(str(counts.get(c, 0)) for c in columns)
        lines.append(f"| {name} | {counts['total']} | {cells} |")
    lines += [
        "",
        "A read fetches the settings, the branch's ref (a listing and the newest ref file), "
        "the snapshot, the root tree, the node trees on the tensor's path (none for a node of "
        "up to 4 chunks: the root holds it inline) and its chunk "
        "object, however many tensors the snapshot holds. A save from a cold cache reads "
        "every node tree of its parent once (one GET per tensor not held inline); right after the same "
        "process saved that parent it reads none (a commit keeps the trees it wrote). Each "
        "new object and tree is checked absent (a one-byte ranged GET) before it is "
        "written; a tree or chunk the parent already names is not. `verify` and `gc` read "
        "each distinct tree once per run, and `verify` every object.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print(to_markdown(run(quick="--quick" in args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU path: NUQ encode and decode throughput against the CPU path and a plain copy.

Why: training state lives on the GPU, and today every checkpoint copies full-precision
tensors to the host before compressing them. On the device only the level ids (one byte per
weight) and the few protected values cross to the host, so a save should hold the training
loop for less than the copy it replaces. Targets on an H100: encode >= 20 GB/s, decode
>= 50 GB/s of float32 weights.

Measured on trained-looking float32 weights already on the device (Gaussian at a layer's
scale, snapped to a 16-level codebook as the policy snaps them, 0.5 % left as protected
outliers; tolerance 0, as the writer configures the codec), best of ``--reps`` runs:

- ``encode -> host bytes``: device tensor to the payload in host memory (what the store
  writes), and ``encode -> device payload`` (zarr GPU mode: the payload stays on the device);
- ``decode host payload``: payload bytes in host memory to values on the device, and
  ``decode device payload``;
- ``device-to-host copy``: the same tensor copied to pinned and to pageable host memory,
  what a save pays today before any compression;
- ``CPU encode`` / ``CPU decode``: the numpy path on the host copy (one thread);
- ``save blocks the loop``: a toy training loop (matmuls) on the device, saving every
  ``--save-every`` steps: the time one save holds the loop when the state is copied to the
  host and encoded there in the background, and when it is encoded on the device.

Every GPU payload is checked against the CPU payload of the same tensor (byte-identical).
Needs CuPy and a CUDA device (``pip install 'inshrink-store[gpu]'``); without them it says
so and exits 0. Not part of ``benchmarks/run.py``: the benchmark machine has no GPU.

    python -m benchmarks gpu --numel 268435456
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from inshrink_store.codecs import _gpu
from inshrink_store.codecs._xp import to_host
from inshrink_store.codecs.nuq import Quantizer, quantizer

TARGETS = {"encode": 20.0, "decode": 50.0}  # GB/s of float32 input on an H100
LEVELS = 16
OUTLIERS = 0.005


def _best(fn: Callable[[], Any], reps: int, sync: Callable[[], None]) -> tuple[float, Any]:
    """Best wall time of ``reps`` runs (after one warm-up), the device drained each time."""
    result = fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best, result


def _weights(cp: Any, numel: int) -> tuple[Any, Quantizer]:
    """Snapped device weights and their quantizer: centres from a host sample's quantiles."""
    x = cp.random.standard_normal(numel, dtype=cp.float32) * cp.float32(0.02)
    sample = x[:: max(1, numel // 1_000_000)].get()
    centres = tuple(float(c) for c in np.unique(
        np.quantile(sample, np.linspace(0.01, 0.99, LEVELS - 1)).astype(np.float32)))
    q = quantizer(centres, 0.0, "bfloat16", "float32")
    ids, _ = _gpu.assign_levels(x, "float32", q.mids, q.centres, None, q.id_dtype)
    snapped = cp.asarray(q.centres)[ids]
    keep = cp.random.random(numel) < OUTLIERS
    return cp.where(keep, x, snapped), q


def _row(name: str, seconds: float, nbytes: int, target: float | None = None) -> str:
    rate = nbytes / seconds / 1e9
    mark = "" if target is None else f"   target >= {target:g} GB/s: {'met' if rate >= target else 'NOT met'}"
    return f"{name:<34} {seconds * 1e3:9.2f} ms {rate:9.2f} GB/s{mark}"


def throughput(cp: Any, numel: int, reps: int) -> list[str]:
    sync = cp.cuda.Device().synchronize
    x, q = _weights(cp, numel)
    nbytes = numel * 4
    host = x.get()
    cpu_encode, cpu_payload = _best(lambda: q.encode(host), max(1, reps // 3), lambda: None)
    cpu_decode, _ = _best(lambda: q.decode(cpu_payload), max(1, reps // 3), lambda: None)
    encode, payload = _best(lambda: q.encode(x), reps, sync)
    encode_dev, payload_dev = _best(lambda: q.encode_array(x), reps, sync)
    if payload != cpu_payload or payload_dev.get().tobytes() != cpu_payload:
        raise SystemExit("GPU payload differs from the CPU payload: byte identity is broken")
    payload_host = np.frombuffer(payload, np.uint8)
    decode, _ = _best(lambda: q.decode(cp.asarray(payload_host)), reps, sync)
    decode_dev, _ = _best(lambda: q.decode(payload_dev), reps, sync)
    pinned = _pinned(cp, host.shape, np.float32)
    copy_pinned, _ = _best(lambda: x.get(out=pinned), reps, sync)
    copy_pageable, _ = _best(lambda: x.get(), reps, sync)
    # where encode -> host bytes and decode of a host payload spend their time (rates below
    # are per float32 input byte, as the targets): the payload's own copies and conversion
    payload_to_host, host_payload = _best(lambda: to_host(payload_dev), reps, sync)
    to_bytes, _ = _best(lambda: host_payload.tobytes(), reps, sync)
    up_pageable, _ = _best(lambda: cp.asarray(payload_host), reps, sync)
    steps = _encode_steps(q, x, reps, sync)
    payload_pinned = _pinned(cp, payload_host.shape, np.uint8)
    payload_pinned[...] = payload_host
    up_pinned, _ = _best(lambda: cp.asarray(payload_pinned), reps, sync)
    return [
        f"{numel:,} float32 weights ({nbytes / 2**30:.2f} GiB), payload {len(payload) / 2**20:.1f} MiB, "
        f"{q.levels} levels, {OUTLIERS:.1%} protected",
        _row("GPU encode -> host bytes", encode, nbytes, TARGETS["encode"]),
        _row("GPU encode -> device payload", encode_dev, nbytes),
        _row("GPU decode host payload", decode, nbytes, TARGETS["decode"]),
        _row("GPU decode device payload", decode_dev, nbytes),
        _row("device-to-host copy (pinned)", copy_pinned, nbytes),
        _row("device-to-host copy (pageable)", copy_pageable, nbytes),
        _row("  payload device->host (to_host)", payload_to_host, nbytes),
        _row("  payload host array -> bytes", to_bytes, nbytes),
        _row("  payload host->device (pageable)", up_pageable, nbytes),
        _row("  payload host->device (pinned)", up_pinned, nbytes),
        _row("  encode -> host bytes: on the device", steps[0], nbytes),
        _row("  encode -> host bytes: to_host", steps[1], nbytes),
        _row("  encode -> host bytes: tobytes", steps[2], nbytes),
        _row("CPU encode (numpy, 1 thread)", cpu_encode, nbytes),
        _row("CPU decode (numpy, 1 thread)", cpu_decode, nbytes),
    ]


def _encode_steps(q: Quantizer, x: Any, reps: int, sync: Callable[[], None]) -> tuple[float, float, float]:
    """``q.encode(x)`` split into its steps, each timed inside the same call (the run with the
    least total of ``reps``): the payload on the device, its copy to the host (``to_host``:
    a fresh pinned block from CuPy's pool each call, as the codec does), and ``tobytes``."""
    best: tuple[float, float, float] = (float("inf"),) * 3
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        payload = q.encode_array(x)
        sync()
        t1 = time.perf_counter()
        host = to_host(payload)
        t2 = time.perf_counter()
        host.tobytes()
        t3 = time.perf_counter()
        del payload, host
        if t3 - t0 < sum(best):
            best = (t1 - t0, t2 - t1, t3 - t2)
    return best


def _pinned(cp: Any, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    import cupyx

    return cupyx.empty_pinned(shape, dtype=dtype)


def blocking(cp: Any, numel: int, steps: int, save_every: int) -> list[str]:
    """How long one save holds a training loop: copy + background CPU encode vs GPU encode."""
    sync = cp.cuda.Device().synchronize
    state, q = _weights(cp, numel)
    a = cp.random.standard_normal((4096, 4096), dtype=cp.float32)
    b = cp.empty_like(a)
    background: list[threading.Thread] = []

    def step() -> None:
        cp.matmul(a, a, out=b)
        cp.divide(b, cp.linalg.norm(b), out=a)

    def copy_then_cpu() -> None:
        host = state.get()  # the loop waits for this copy only, as the Checkpointer's does
        thread = threading.Thread(target=q.encode, args=(host,))
        thread.start()
        background.append(thread)

    def on_gpu() -> None:
        q.encode(state)

    rows = []
    for name, save in (("none", None), ("copy + CPU encode", copy_then_cpu), ("GPU encode", on_gpu)):
        held = []
        sync()
        start = time.perf_counter()
        for i in range(steps):
            step()
            if save is not None and i % save_every == 0:
                sync()
                t = time.perf_counter()
                save()
                sync()
                held.append(time.perf_counter() - t)
        sync()
        total = time.perf_counter() - start
        for thread in background:
            thread.join()
        background.clear()
        per_save = f"{np.median(held) * 1e3:9.2f} ms per save" if held else " " * 21
        rows.append(f"save: {name:<28} {per_save}   loop {total:.2f} s for {steps} steps")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 28, help="weights per tensor")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60, help="training steps in the loop")
    parser.add_argument("--save-every", type=int, default=20)
    args = parser.parse_args()
    reason = _gpu.why_unavailable()
    if reason is not None:
        print(f"bench_gpu: no GPU available here ({reason}); nothing to measure.")
        return
    cp = _gpu.require_cupy()
    device = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    print(f"device: {device.decode() if isinstance(device, bytes) else device}, CuPy {cp.__version__}")
    for line in throughput(cp, args.numel, args.reps) + blocking(cp, args.numel, args.steps,
                                                                 args.save_every):
        print(line)


if __name__ == "__main__":
    main()

"""What reading your writes costs a quantized save: every quantized object is decoded and
compared with its payload before it is stored (``cas.ObjectStore._check_writable``).

One quantized save (16 levels) of 8 float32 tensors of 1024 x 1024 (32 MiB) into ``memory://``,
with the check as it ships and with it patched out, interleaved in one process, median of
5 saves each. Raw floats are decoded only with ``INSHRINK_VERIFY_WRITES=1``, off here, as in
production. Run alone: ``python -m benchmarks write_check``; prints the two medians
and their ratio.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

os.environ["INSHRINK_VERIFY_WRITES"] = "0"

import inshrink_store as ins  # noqa: E402
from inshrink_store import cas  # noqa: E402
from inshrink_store.policy import QuantConfig  # noqa: E402


def main(repeats: int = 5) -> dict[str, float]:
    rng = np.random.default_rng(0)
    state = {f"model/w{i}": (rng.standard_normal((1024, 1024)) * 0.02).astype(np.float32) for i in range(8)}
    real = cas.ObjectStore._check_writable
    times: dict[str, list[float]] = {"with the check": [], "check patched out": []}
    try:
        for rep in range(repeats):
            for mode in times:
                cas.ObjectStore._check_writable = real if mode == "with the check" else (  # type: ignore[method-assign]
                    lambda self, *args: None)
                repo = ins.open(f"memory://bench-write-check-{rep}-{len(mode)}", create=True)
                start = time.perf_counter()
                repo.save({k: v + rep * 1e-3 for k, v in state.items()}, quantize=QuantConfig(bins=16))
                times[mode].append(time.perf_counter() - start)
    finally:
        cas.ObjectStore._check_writable = real  # type: ignore[method-assign]
    medians = {mode: statistics.median(values) for mode, values in times.items()}
    for mode, seconds in medians.items():
        print(f"{mode}: {seconds:.3f} s")
    print(f"ratio: {medians['with the check'] / medians['check patched out']:.3f}")
    return medians


if __name__ == "__main__":
    main()

"""Throughput of the ``inshrink.vdelta`` codec against the ALGORITHM.md target
(>= 100 M ids/s per core, encode and decode), on chunks shaped like the store's.

Ids are 16 levels + protected, drawn from a bell-shaped level distribution (as
k-means on trained weights gives); the next version moves a fraction of elements
one level up or down, as a late (2 %) and an early (16 %) training step do. Each
delta is timed with and without regrouping; bytes are against the whole payload.
Run through ``python -m benchmarks run``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.machine_info import best_of
from inshrink_store.codecs import _payload
from inshrink_store.codecs.vdelta import VDelta

LEVELS = 17  # 16 centres + protected


def _payloads(n: int, changed: float, seed: int = 0) -> tuple[bytes, bytes]:
    rng = np.random.default_rng(seed)
    prev = np.clip(np.rint(rng.normal(7.5, 2.5, n)), 0, LEVELS - 2).astype(np.uint8)
    step = rng.choice(np.array([-1, 1], np.int16), size=n) * (rng.random(n) < changed)
    cur = np.clip(prev.astype(np.int16) + step, 0, LEVELS - 2).astype(np.uint8)
    none = np.empty(0, np.uint16)
    return (_payload.pack(LEVELS, prev, "bfloat16", none), _payload.pack(LEVELS, cur, "bfloat16", none))


def run(quick: bool = False) -> dict[str, Any]:
    n = 1 << 20  # one 1 M-element chunk: the store's default chunk of float32 is 4 MiB
    repeats = 3 if quick else 7
    rows = []
    for changed in (0.02, 0.16):
        base, cur = _payloads(n, changed)
        for regroup in (True, False):
            codec = VDelta(regroup=regroup)
            delta = codec.encode(cur, base=base)
            assert bytes(codec.decode(delta, base=base)) == cur
            rows.append({
                "changed": changed, "regroup": regroup, "ratio": len(cur) / len(delta),
                "enc": n / best_of(lambda c=codec, b=base, x=cur: c.encode(x, base=b), repeats)[0] / 1e6,
                "dec": n / best_of(lambda c=codec, d=delta, b=base: c.decode(d, base=b), repeats)[0] / 1e6,
            })
    return {"n": n, "rows": rows}


def to_markdown(res: dict[str, Any]) -> str:
    lines = [
        f"One chunk of {res['n'] / 2**20:.0f} M ids (uint8, {LEVELS} levels), one thread, best of several runs. "
        "Ratio is the whole payload's bytes over the delta's.",
        "",
        "| ids changed | regroup | delta ratio vs whole payload | encode M ids/s | decode M ids/s |",
        "|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['changed']:.0%} | {'yes' if r['regroup'] else 'no'} | {r['ratio']:.1f}× | "
                     f"{r['enc']:.0f} | {r['dec']:.0f} |")
    lines += ["", "Target: ≥ 100 M ids/s per core for encode and decode."]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(to_markdown(run(quick="--quick" in sys.argv)))

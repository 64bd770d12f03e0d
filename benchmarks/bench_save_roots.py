"""Root trees and decision records of 37 deterministic Checkpointer saves, to compare two commits.

A refactor of the save path that must not change what is stored (issue 45's one decision:
"the same saves must write the same bytes") is checked by running this before and after and
comparing the two files: ``python -m benchmarks save_roots before.json`` on the old commit,
``... after.json`` on the new, then ``cmp before.json after.json``. Ten runs of a small MLP
with Adam, background=False, one thread: no ``eval_fn`` (the policy's base), the budgeted
search with a keyframe fallback forced at the fourth save (its residual search's two trials
fail), the exhaustive search, a keyframe interval of 2 (chains end), closed-loop moments,
``exact_resume=0`` (the resume space), a restore into a new Checkpointer mid-run, the open
loop, lossless, and a probe. Each save gives its root tree (every array's bytes and
attributes), its step, whether it fell back, and its ``metadata`` records without timings.
Counts, not times: the machine's load does not matter.
"""
from __future__ import annotations

import argparse
import json
import logging
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

import inshrink_store as ins
from inshrink_store.policy import MomentPolicy, SearchPolicy
from inshrink_store.torch import Checkpointer

#: the log lines of the current run (a fallback's line tells it fell back)
logs: list[str] = []


class _Lines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        logs.append(record.getMessage())


def problem() -> tuple[Any, Any, Any, Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 192), torch.nn.ReLU(), torch.nn.Linear(192, 192),
                                torch.nn.ReLU(), torch.nn.Linear(192, 2))
    return x, y, model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: Any, opt: Any, x: Any, y: Any, steps: int, ck: Any) -> None:
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        ck.observe_gradients()
        opt.step()


def scrub(d: Any) -> Any:
    """``d`` without wall-clock figures (seconds, stop reasons): what two runs agree on."""
    if isinstance(d, dict):
        return {k: scrub(v) for k, v in d.items() if "second" not in k and not k.endswith("_s") and k != "stop"}
    if isinstance(d, list):
        return [scrub(v) for v in d]
    return d


def run(name: str, saves: int = 5, kf: int | None = None, restore_at: int | None = None,
        strict_at: int | None = None, **kw: Any) -> list[dict[str, Any]]:
    """``saves`` saves of one run (``kw``: the Checkpointer's keywords), each as the output lists it."""
    x, y, model, opt = problem()
    repo = ins.open(f"memory://roots-{uuid.uuid4().hex}", create=True, keyframe_interval=kf)
    calls = {"n": 0, "strict": False}

    def acc(m: Any) -> float:
        calls["n"] += 1
        if calls["strict"] and calls["n"] in (2, 3):
            return 0.0  # the residual search's trials fail: the keyframe fallback runs
        with torch.no_grad():
            return float((m(x).argmax(1) == y).float().mean())

    fn = None if kw.pop("no_eval", False) else acc
    out = []
    ck = Checkpointer(repo, model, opt, eval_fn=fn, background=False, **kw)
    for i in range(saves):
        train(model, opt, x, y, 5, ck)
        calls["n"], calls["strict"] = 0, (i == strict_at)
        if restore_at == i:
            ck.close()
            _, _, model, opt = problem()
            ck = Checkpointer(repo, model, opt, eval_fn=fn, background=False, **kw)
            ck.restore()
            train(model, opt, x, y, 5, ck)
        before = len(logs)
        info = ck.save(10 * (i + 1))
        fell = any("no closed-loop residual within tolerance" in m for m in logs[before:])
        out.append({"run": name, "step": info.step, "root": info.root, "fallback": fell,
                    "meta": scrub({k: v for k, v in info.metadata.items() if k in ("quantization", "moments", "probe")})})
    ck.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks save_roots", description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON file to write (compare two with cmp)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # the lossy default's warning
    torch.set_num_threads(1)
    logging.getLogger("inshrink_store").addHandler(_Lines())
    logging.getLogger("inshrink_store").setLevel(logging.INFO)
    results = []
    pol = SearchPolicy(tolerance=0.02)
    results += run("default-noeval", no_eval=True)
    results += run("eval-budgeted", policy=pol, strict_at=3)
    results += run("eval-exhaustive", policy=SearchPolicy(tolerance=0.02, max_evals=None, max_evaluations=6), saves=3)
    results += run("keyframe-interval-2", policy=pol, kf=2)
    results += run("moments-closed", policy=SearchPolicy(tolerance=0.02, optimizer=MomentPolicy(closed_loop=True)), saves=4)
    results += run("exact0", policy=pol, exact_resume=0, saves=3)
    results += run("restore", policy=pol, restore_at=2, saves=4)
    results += run("open-loop", policy=pol, closed_loop=False, saves=3)
    results += run("lossless", lossless=True, saves=2, no_eval=True)
    results += run("probe", policy=pol, probe=torch.ones(4, 32), saves=3)
    Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True))
    print(len(results), "saves;", sum(r["fallback"] for r in results), "fallbacks;",
          len({r["root"] for r in results}), "distinct roots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

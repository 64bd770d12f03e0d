"""The walk of one later Checkpointer.save through the package's rooms (modules), loop to storage.

Issue 45's done-when asks for "a walk of one ``Checkpointer.save`` from the loop to storage
(rooms visited, returns to a room), before and after" the save's decision became one policy
module. This benchmark counts, not times: a small MLP with Adam is trained and saved three
times (``background=False``, so the whole save runs on the calling thread; ``eval_fn`` given,
so the search, the closed loop's residuals and the budget all take part), and the third save,
a closed-loop residual, is traced with :func:`sys.setprofile`.

How the walk is read: at every call and every return the module whose code then runs is
noted (a return hands execution back to the caller's module), consecutive notes of one module
are collapsed into one stay, and only the package's own modules count (numpy, torch and zarr
are corridors, not rooms). ``rooms`` is how many modules the save enters, ``stays`` the length
of the collapsed walk, ``returns`` the stays in a room already visited (``stays - rooms``).
The same figures are given by layer (``inshrink_store.torch``, ``.policy``, ``.codecs``, ...:
the module's first name below the package). ``checkpointer`` is the stays in
``torch/checkpointer.py`` (how often the save comes back to the Checkpointer), and
``torch_to_policy`` how often the walk steps from the torch layer into the policy (the
Checkpointer asking the policy, and the evaluator ``eval_fn`` runs in handing plans over). Threads the writer starts are not traced: what
they do is storage's, reached through the write session the walk does enter.

``python -m benchmarks save_walk`` prints the figures and the first rooms in order;
``--rooms`` lists every module with its stays.
"""

from __future__ import annotations

import argparse
import sys
import uuid
import warnings
from collections import Counter
from itertools import pairwise
from types import FrameType
from typing import Any

PACKAGE = "inshrink_store"


def _module(frame: FrameType | None) -> str | None:
    if frame is None:
        return None
    name = frame.f_globals.get("__name__")
    return name if isinstance(name, str) and (name == PACKAGE or name.startswith(PACKAGE + ".")) else None


def walk(save: Any) -> list[str]:
    """The package modules ``save()`` runs in, in order, consecutive repeats collapsed."""
    seen: list[str] = []

    def note(module: str | None) -> None:
        if module is not None and (not seen or seen[-1] != module):
            seen.append(module)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            note(_module(frame))
        elif event == "return":
            note(_module(frame.f_back))

    sys.setprofile(profile)
    try:
        save()
    finally:
        sys.setprofile(None)
    return seen


def layer(module: str) -> str:
    """``inshrink_store.policy.search`` -> ``policy``; the package itself -> ``(package)``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(package)"


def collapse(names: list[str]) -> list[str]:
    return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]


def figures(seen: list[str]) -> dict[str, int]:
    layers = collapse([layer(m) for m in seen])
    into_policy = sum(1 for a, b in pairwise(layers) if a == "torch" and b == "policy")
    return {"rooms": len(set(seen)), "stays": len(seen), "returns": len(seen) - len(set(seen)),
            "layers": len(set(layers)), "layer_stays": len(layers), "layer_returns": len(layers) - len(set(layers)),
            "checkpointer": seen.count(f"{PACKAGE}.torch.checkpointer"), "torch_to_policy": into_policy}


def later_save_walk() -> list[str]:
    """Train, save twice, and walk the third save (a closed-loop residual with ``eval_fn``)."""
    import torch

    import inshrink_store as ins
    from benchmarks.bench_save_roots import problem, train
    from inshrink_store.policy import SearchPolicy
    from inshrink_store.torch import Checkpointer

    torch.set_num_threads(1)
    x, y, model, opt = problem()  # the same seeded problem as save_roots' runs

    def accuracy(m: Any) -> float:
        with torch.no_grad():
            return float((m(x).argmax(1) == y).float().mean())

    repo = ins.open(f"memory://save-walk-{uuid.uuid4().hex}", create=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the lossy-default warning of the first save
        with Checkpointer(repo, model, opt, eval_fn=accuracy, policy=SearchPolicy(tolerance=0.02),
                          background=False) as ck:
            for step in (10, 20, 30):
                train(model, opt, x, y, 5, ck)
                if step < 30:
                    ck.save(step)
            return walk(lambda: ck.save(30))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks save_walk", description=__doc__.splitlines()[0])
    parser.add_argument("--rooms", action="store_true", help="list every module entered, with its stays")
    parser.add_argument("--first", type=int, default=40, help="print the walk's first N stays (default 40)")
    args = parser.parse_args(argv)
    seen = later_save_walk()
    print("one later Checkpointer.save (closed-loop residual, eval_fn, background=False):")
    for key, value in figures(seen).items():
        print(f"  {key:16} {value}")
    print("the walk by layer, first stays: " + " > ".join(collapse([layer(m) for m in seen])[:args.first]))
    print("the walk by module, first stays: " + " > ".join(m.removeprefix(PACKAGE + ".") for m in seen[:args.first]))
    if args.rooms:
        for module, count in sorted(Counter(seen).items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {count:6d}  {module}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

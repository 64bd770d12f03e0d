"""Weights-only tiers: bytes on disk with and without Retention(full_state_for_last=K).

An MLP (256-1024-256-10, 0.53 M parameters) trained with Adam, seeded, CPU only; one version
every 5 steps, ``--saves`` of them, ``Retention(max_to_keep=--max-to-keep)`` against the same
with ``full_state_for_last=--full``. For lossless saves and the default (quantized weights,
compressed moments), at keyframe intervals 8 (the default) and 2: the bytes under each store
(``benchmarks.machine_info.dir_bytes``, which ``du_summary().total`` matches), and their ratio.
Every store is verified. Run: ``python -m benchmarks tiers`` (prints markdown).
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import torch

import inshrink_store as ins
from benchmarks.machine_info import dir_bytes
from inshrink_store.torch import Checkpointer, Retention


def _store(root: Path, retention: Retention, lossless: bool, saves: int, keyframe_interval: int) -> int:
    """Bytes under a store after ``saves`` versions with ``retention``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    repo = ins.open(str(root), create=True, keyframe_interval=keyframe_interval)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the default's "no eval_fn" warning
        with Checkpointer(repo, model, opt, lossless=lossless, retention=retention, background=False) as ck:
            for step in range(1, saves + 1):
                for _ in range(5):
                    model(torch.randn(64, 256)).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                ck.save(step)
    assert repo.verify().problems == []
    total = dir_bytes(root)
    assert repo.du_summary("main").total == total
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--max-to-keep", type=int, default=10)
    parser.add_argument("--full", type=int, default=2, help="full_state_for_last")
    parser.add_argument("--quick", action="store_true", help="6 saves, max_to_keep 4")
    args = parser.parse_args(argv)
    saves, keep = (6, 4) if args.quick else (args.saves, args.max_to_keep)
    print(f"| saves | keyframe interval | max_to_keep={keep} | + full_state_for_last={args.full} | ratio |")
    print("|---|---|---|---|---|")
    for lossless in (True, False):
        for interval in (8, 2):
            with tempfile.TemporaryDirectory() as tmp:
                whole = _store(Path(tmp) / "whole", Retention(keep), lossless, saves, interval)
                tiered = _store(Path(tmp) / "tiered", Retention(keep, full_state_for_last=args.full), lossless,
                                saves, interval)
            kind = "lossless" if lossless else "default"
            print(f"| {saves} {kind} | {interval} | {whole / 1e6:.2f} MB | {tiered / 1e6:.2f} MB | "
                  f"{tiered / whole:.2f} |", flush=True)


if __name__ == "__main__":
    main()

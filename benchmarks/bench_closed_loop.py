"""Open loop against closed loop: how far each version's stored weights are from the live ones,
and what each version's weights cost, on one training run checkpointed both ways.

    python -m benchmarks closed_loop     # writes docs/img/closed-loop.png, prints a table

The run: an MLP (64 -> 256 -> 256 -> 10, 85 k parameters) trained with Adam on a fixed
synthetic classification set (labels from a fixed random
linear teacher), a checkpoint every 20 steps (16 in all), the Checkpointer's
search with ``eval_fn`` (loss on a held-out batch, tolerance 5 %) and its defaults otherwise,
once with ``closed_loop=True`` (the default) and once with ``closed_loop=False``. Every input
is seeded, so the figures reproduce; the two runs train identically (the store never touches
the live model). The error is ‖stored − live‖ / ‖live‖ over the model's quantized weights.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SAVES, EVERY = 16, 20


def _run(closed: bool, store: str) -> tuple[list[float], list[int], int]:
    """(error of each version, model bytes of each version, logical model bytes per version)."""
    import torch

    import inshrink_store as ins
    from inshrink_store.torch import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(64, 10, generator=g)  # labels a model can learn: a fixed linear teacher
    x, xv = torch.randn(2048, 64, generator=g), torch.randn(256, 64, generator=g)
    y, yv = (x @ teacher).argmax(1), (xv @ teacher).argmax(1)

    def loss(m: Any) -> float:
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(m(xv), yv))

    repo = ins.open(store, create=True)
    ck = Checkpointer(repo, model, opt, eval_fn=loss, tolerance=0.05, higher_is_better=False,
                      background=False, closed_loop=closed)
    live: list[dict[str, np.ndarray]] = []
    for save in range(SAVES):
        for step in range(EVERY):
            i = (save * EVERY + step) % 16
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i * 128:(i + 1) * 128]), y[i * 128:(i + 1) * 128]).backward()
            ck.observe_gradients()
            opt.step()
        ck.save((save + 1) * EVERY)
        live.append({k: v.detach().numpy().copy() for k, v in model.state_dict().items() if v.ndim == 2})
    ck.close()
    errors = []
    for info, weights in zip(reversed(repo.log()), live, strict=True):
        reader = repo.checkout(info.id)
        diff = sum(float(np.sum((reader.read(f"model/{k}") - w) ** 2)) for k, w in weights.items())
        norm = sum(float(np.sum(w.astype(np.float64) ** 2)) for w in weights.values())
        errors.append((diff / norm) ** 0.5)
    rows = repo.du(prefix="model/")
    return errors, [r.new_stored_bytes for r in rows], rows[0].logical_bytes


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        closed = _run(True, str(Path(tmp) / "closed"))
        opened = _run(False, str(Path(tmp) / "open"))
    print("| version | open loop: error | open loop: weights ratio | closed loop: error | closed loop: weights ratio |")
    print("|---|---|---|---|---|")
    for i in range(SAVES):
        print(f"| {i + 1} | {opened[0][i]:.4f} | {opened[2] / opened[1][i]:.1f}x | {closed[0][i]:.4f} | "
              f"{closed[2] / closed[1][i]:.1f}x |")
    for name, (errors, stored, logical) in (("open loop", opened), ("closed loop", closed)):
        print(f"{name}: mean error {np.mean(errors):.4f}, weights over all versions {SAVES * logical / sum(stored):.1f}x")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return 0
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    versions = range(1, SAVES + 1)
    ax.plot(versions, opened[0], "o-", label="open loop (each version quantized afresh)")
    ax.plot(versions, closed[0], "s-", label="closed loop (residual on the stored version)")
    ax.set_yscale("log")
    ax.set_xlabel("version")
    ax.set_ylabel("‖stored − live‖ / ‖live‖")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = ROOT / "docs" / "img" / "closed-loop.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

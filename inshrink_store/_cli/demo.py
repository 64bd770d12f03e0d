"""``inshrink demo`` (the CLI layer, the package's top layer): trains a small MLP with the
Checkpointer (``inshrink_store.torch.demo``) and prints what each version stored and how
well the compressed checkpoints restore.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer
from rich.table import Table

from inshrink_store._cli.core import JsonOpt, _json, _ratio, _row, _say, _size, err, out
from inshrink_store._cli.opening import _require_room_for_store


def demo(
    url: Annotated[str, typer.Argument(
        help="Where to create the demo store: a new path, an empty directory, or a previous demo store "
        "(which is replaced). Any other existing path is refused.")] = "./inshrink-demo",
    steps: Annotated[int, typer.Option("--steps", min=1)] = 600,
    every: Annotated[int, typer.Option("--every", min=1, help="Checkpoint every N steps.")] = 50,
    tolerance: Annotated[float, typer.Option("--tolerance", help="Accuracy drop allowed, relative.")] = 0.02,
    fail_at: Annotated[int | None, typer.Option("--fail-at", help="Simulate a crash at this step, then resume.")] = 430,
    as_json: JsonOpt = False,
) -> None:
    """Train a small MLP on the digits data set, checkpointing with dynamic quantization."""
    from inshrink_store.torch.demo import run_demo

    def say(line: str) -> None:
        _say(err, (line, "dim"))

    _require_room_for_store(url)
    result = run_demo(url, steps=steps, every=every, fail_at=fail_at, tolerance=tolerance, progress=say)
    if as_json:
        _json(dataclasses.asdict(result))
        return
    table = Table("step", "bins", "prune", "protect", "search", "evals", "weights", "w. ratio",
                  "moments", "m. ratio", "state", "state ratio", "accuracy")
    for r in result.rows:
        c = r["config"] or {}
        _row(table, r["step"], c.get("bins", "lossless"),
             f"{c['prune']:.0%} {c['prune_metric'][:3]}" if c else "-",
             f"{c['protect']:.2%}" if c else "-", r["search"] or "-", r["evaluations"],
             _size(r["model_stored_bytes"]), _ratio(r["model_ratio"]),
             _size(r["optimizer_stored_bytes"]), _ratio(r["optimizer_ratio"]),
             _size(r["stored_bytes"]), _ratio(r["ratio"]),
             "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}")
    out.print(table)
    weights = result.model_logical_bytes / max(result.model_stored_bytes, 1)
    total = result.logical_bytes / max(result.stored_bytes, 1)
    _say(out, f"model weights: {_size(result.model_stored_bytes)} stored for {_size(result.model_logical_bytes)}: ",
         (f"{weights:.1f}x", "bold"), " smaller end to end")
    moments = result.optimizer_logical_bytes / max(result.optimizer_stored_bytes, 1)
    _say(out, f"Adam moments: {_size(result.optimizer_stored_bytes)} stored for "
              f"{_size(result.optimizer_logical_bytes)}: ", (f"{moments:.1f}x", "bold"),
         " smaller (each tensor checked by the update it drives)")
    _say(out, f"whole training state: {_size(result.stored_bytes)} stored for "
              f"{_size(result.logical_bytes)}: ", (f"{total:.1f}x", "bold"), " smaller end to end")
    if result.residual_bytes:
        on_disk = result.stored_bytes + result.residual_bytes
        _say(out, f"exact resume: the newest version's restore residual, {_size(result.residual_bytes)} more "
                  f"({_size(on_disk)} on disk: {result.logical_bytes / max(on_disk, 1):.1f}x)")
    _say(out, "accuracy restored from the last compressed checkpoint: ", (f"{result.restored_accuracy:.3f}", "bold"),
         f" (uncompressed run: {result.reference_accuracy:.3f})")
    if result.resumed_from_step is not None:
        how = ", bit-exact (restore residual)" if result.resumed_exact else ", from the compressed values"
        _say(out, f"resumed after a simulated failure from step {result.resumed_from_step}{how}")
    _say(out, f"training {result.train_s:.1f}s, waiting on checkpoints {result.checkpoint_wait_s:.2f}s, "
              f"search in the background {result.search_s:.1f}s")
    _say(out, "inspect it: inshrink log ", url, "  ·  inshrink du ", url)

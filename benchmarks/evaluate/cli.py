"""``python -m benchmarks evaluate``: run the evaluation, write the page, the plots and the data.

    python -m benchmarks evaluate                       # full: docs/evaluation.md, docs/img/evaluation/
    python -m benchmarks evaluate --quick --out DIR     # smoke test: tiny runs, into DIR
    python -m benchmarks evaluate --quick --finetune    # the smoke test with the fine-tune too (minutes)
    python -m benchmarks evaluate --from-json FILE      # the page and plots again, from saved results

Quick mode never writes into docs/: without ``--out`` it writes into a new temporary folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

STARTED = time.perf_counter()
ROOT = Path(__file__).resolve().parents[2]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny runs (seconds), to check the harness")
    parser.add_argument("--finetune", action="store_true",
                        help="with --quick: also the fine-tune of all-MiniLM-L6-v2, tiny (minutes, not seconds); "
                             "the full evaluation always runs it")
    parser.add_argument("--no-finetune", action="store_true",
                        help="the full evaluation without the fine-tune (its 20 versions of a 22.6 M-parameter "
                             "state take about an hour of the evaluation on 2 cores)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for evaluation.md and img/evaluation/ (default: docs/, or a new "
                             "temporary folder with --quick)")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="rewrite the page and plots from an evaluation.json instead of running")
    return parser


def _out(args: argparse.Namespace) -> Path:
    if args.out is not None:
        return args.out
    if args.quick:
        return Path(tempfile.mkdtemp(prefix="inshrink-evaluate-"))
    return ROOT / "docs"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from benchmarks.evaluate import plan, plots, report, workloads

    torch.set_num_threads(1)  # one core trains, the other runs the store's background thread
    warnings.simplefilter("ignore", UserWarning)
    out = _out(args)
    images = out / "img" / "evaluation"
    images.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks evaluate" + (" --quick" if args.quick else "") + (
        " --finetune" if args.quick and args.finetune else "") + (
        " --no-finetune" if args.no_finetune and not args.quick else "")
    if args.from_json is not None:
        results = json.loads(args.from_json.read_text())
        wall_s = results["meta"]["wall_s"]
        command = results["meta"]["command"]
    else:
        results = plan.evaluate(workloads.all_workloads(args.quick, args.finetune, not args.no_finetune), plan.Plan.make(args.quick))
        wall_s = time.perf_counter() - STARTED
        results["meta"] = {"command": command, "wall_s": wall_s, "machine": report.machine()}
        results = plan.compact(results)
        (images / "evaluation.json").write_text(json.dumps(results, separators=(",", ":")) + "\n")
    drawn = plots.draw_all(results, images)
    page = report.write(results, out, command, wall_s, plotted=bool(drawn))
    print(f"wrote {page} and {images}/ ({wall_s:.0f} s)", file=sys.stderr)
    return 0

"""The one benchmark command: every comparison side by side, written to docs/benchmarks.md.

    python -m benchmarks run            # full sizes (~100 MB state, 32 M params; 10-15 min on 2 cores)
    python -m benchmarks run --quick    # small sizes, to check the harness (about a minute)

Sections: the lossless store vs torch.save and safetensors; lossless floats of a real
pretrained model (CREPE, from the ``bench`` extra) vs ZipNN, byte-grouped zstd, Blosc,
torch.save and safetensors; quantization vs int8 + zstd
and lossless zstd (ratio, error, accuracy of a trained model, throughput, memory); the
delta codec's throughput; a
real training run checkpointing into the store (with and without regrouping and
deltas); the whole training state with Adam's moments compressed vs lossless, and
training resumed from compressed moments (a plot in docs/img/); ten failures in one run,
resumed exactly and lossily (a plot); where a quantized save and a restore spend their
CPU, stage by stage, against the throughput targets; what a checkpoint's search costs
without ``eval_fn``, with ratios estimated from sketches against ratios measured by
encoding every candidate; save and restore time from 1 M to
300 M parameters (a plot); the HTTP requests each store operation makes on
S3 (moto's server on loopback); distributed saves through ``torch.distributed.checkpoint`` with
1, 2 and 4 ranks against DCP's own writers. The entropy-coder study has its own command (``bench_entropy_coders.py``)
and page (``docs/understanding/deltas.md``): it is research, not a target.
Timings are wall clock on whatever machine runs this; the page records which. Benchmarks that
take minutes on their own (the search's budget on trained workloads, the frameworks, a 500 M
state, the CLI's reads) run apart; their sections, as their commands printed them, are kept in
``benchmarks/recorded/`` and included here (``RECORDED``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any, TypeVar

from benchmarks import machine_info  # light: the standard library only

STARTED = time.perf_counter()  # before the benchmark modules (and torch) are imported
LOAD_AT_START = machine_info.load_average()

from benchmarks import (  # noqa: E402 - after STARTED, which times their imports
    bench_dcp,
    bench_delta,
    bench_fault_tolerance,
    bench_lossless,
    bench_moments,
    bench_quantization,
    bench_requests,
    bench_scaling,
    bench_search,
    bench_stages,
    bench_store,
    bench_training,
    targets,
)

ROOT = Path(__file__).resolve().parents[1]
Kept = TypeVar("Kept")


#: benchmarks run apart, in the page's order: (file in benchmarks/recorded/, its command). Each
#: file holds the section as the command printed it (a ``## `` title first); rerun the command
#: and replace the file to refresh it
RECORDED = (
    ("search_budget.md", "python -m benchmarks search_budget"),
    ("frameworks.md", "python -m benchmarks frameworks"),
    ("scale_state.md", "python -m benchmarks scale_state"),
    ("save_cost.md", "python -m benchmarks save_cost --out benchmarks/recorded/save_cost.md"),
    ("cli_reads.md", "python -m benchmarks cli_reads"),
    ("closed_loop_moments.md", "python -m benchmarks.evaluate.single {cnn,lm,transfer} --methods ours-closed,ours-open "
                               "--rollback-at 0.5"),
)


def recorded_sections() -> list[str]:
    """The recorded sections that exist, each ending in one blank line."""
    folder = Path(__file__).with_name("recorded")
    return [(folder / name).read_text().rstrip() + "\n" for name, _ in RECORDED if (folder / name).exists()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, to check the harness")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md",
                        help="where to write the results page (default: docs/benchmarks.md)")
    args = parser.parse_args(argv)

    sections, took = [], []
    results: dict[str, Any] = {}

    def kept(label: str, result: Kept) -> Kept:
        results[label] = result  # the targets table reads every section's figures
        return result

    steps = [
        ("Lossless store vs torch.save and safetensors", "lossless store",
         lambda: bench_store.markdown(kept("lossless store", bench_store.run(target_mb=20 if args.quick else 100)))),
        ("Lossless floats: the store vs ZipNN, zstd, torch.save, safetensors", "lossless floats",
         lambda: bench_lossless.to_markdown(kept("lossless floats", bench_lossless.run(quick=args.quick)))),
        ("Quantization vs int8 + zstd and lossless zstd", "quantization",
         lambda: bench_quantization.to_markdown(kept("quantization", bench_quantization.run(quick=args.quick)))),
        ("Delta codec throughput", "delta codec",
         lambda: bench_delta.to_markdown(bench_delta.run(quick=args.quick))),
        ("A training run checkpointing into the store", "training run",
         lambda: bench_training.to_markdown(bench_training.run(quick=args.quick))),
        ("The whole training state: Adam moments compressed", "moments",
         lambda: bench_moments.markdown(quick=args.quick)),
        ("Ten failures in one run: exact and lossy resumes", "fault tolerance",
         lambda: bench_fault_tolerance.markdown(quick=args.quick)),
        ("Where a quantized save and a restore spend their time", "stages",
         lambda: bench_stages.to_markdown(kept("stages", bench_stages.run(quick=args.quick)))),
        ("What a checkpoint's search costs: estimated ratios against measured ones", "search",
         lambda: bench_search.to_markdown(kept("search", bench_search.run(quick=args.quick)))),
        ("Cost against model size: 1 M to 300 M parameters", "scaling",
         lambda: bench_scaling.to_markdown(kept("scaling", bench_scaling.run(quick=args.quick)))),
        ("Requests against an object store (S3)", "object-store requests",
         lambda: bench_requests.to_markdown(bench_requests.run(quick=args.quick))),
        ("Distributed saves through torch.distributed.checkpoint (S3)", "DCP",
         lambda: bench_dcp.table(bench_dcp.run(mib=8 if args.quick else 32), 8 if args.quick else 32)),
        ("Every throughput and memory target", "targets",
         lambda: "Per CPU-second (per core) on this machine, from the sections above.\n\n"
                 + targets.to_markdown(results)),
    ]
    for title, label, step in steps:
        t0 = time.perf_counter()
        print(f"[{title}] ...", file=sys.stderr, flush=True)
        body = step()
        took.append(f"{label} {time.perf_counter() - t0:.0f} s")
        print(f"[{title}] {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        sections.append(f"## {title}\n\n{body}\n")

    command = "python -m benchmarks run" + (" --quick" if args.quick else "")
    page = "\n".join([
        "# Benchmarks",
        "",
        f"Produced by `{command}` on {datetime.date.today().isoformat()}. The whole command ran "
        f"for {time.perf_counter() - STARTED:.0f} s of wall clock on the machine below, imports "
        f"included (sections in order: {', '.join(took)}); other jobs on the same cores make it "
        f"slower (1-minute load average {LOAD_AT_START:.1f} when it started, "
        f"{machine_info.load_average():.1f} when it ended; "
        f"{os.cpu_count()} means both cores busy).",
        "",
        f"Machine: {machine_info.describe()}. The machine is shared, so treat speeds as within ±30 %; "
        "ratios and errors are exact and reproducible (every input is seeded).",
        "",
        *sections,
        # sections of the benchmarks that run apart (minutes each, or a trained workload): each
        # has its own command, which prints the section; it is kept in benchmarks/recorded/
        *recorded_sections(),
        # recorded by hand from runs on a lent GPU machine (this one has none): kept as it stands
        (Path(__file__).with_name("gpu_results.md")).read_text(),
        "## Measured elsewhere, each with its own command",
        "",
        "- Rate and distortion on real pretrained models (per-tensor allocation vs one configuration, "
        "k-means + zstd, int8/int4; bits per level id vs their entropy): "
        "`python -m benchmarks rate_distortion` writes "
        "[understanding/rate-distortion.md](understanding/rate-distortion.md).",
        "- The paper's fault-tolerance experiment with its baselines, tolerance sweep and restores: "
        "`python -m benchmarks evaluate` writes [evaluation.md](evaluation.md).",
        "- Entropy coders for level-id deltas: `python -m benchmarks entropy_coders` writes "
        "[understanding/deltas.md](understanding/deltas.md).",
        "",
    ])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page)
    print(page)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""docs/evaluation.md, written from the JSON results: tables, the goals, the paper beside us.

The prose around the tables is fixed; every figure in it comes from the results, so a
rerun rewrites the page consistently (ratios and qualities are deterministic, timings are
not).
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any

from benchmarks import machine_info
from benchmarks.evaluate import metrics, plots
from benchmarks.evaluate.plan import ABLATIONS, MAIN

GOAL_WEIGHTS, GOAL_STATE, GOAL_CHANGE = 30.0, 10.0, 0.005
PAPER_PARAMETERS = (60e6, 355e6)  # the paper's models: ResNet-152 (60 M) to GPT-2 Medium (355 M)
COUNTS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def x(value: float) -> str:
    return f"{value:.1f}×"


def pct(value: float) -> str:
    return f"{100 * value:+.2f} %"


def size(parameters: float) -> str:
    """A parameter count for people: ``284 k``, ``22.6 M``, ``355 M``."""
    return f"{parameters / 1e6:.3g} M" if parameters >= 1e6 else f"{parameters / 1e3:.0f} k"


def count(n: int) -> str:
    return COUNTS[n] if n < len(COUNTS) else str(n)


def sizes(results: dict[str, Any]) -> tuple[float, float]:
    """The smallest and the largest model's parameter count."""
    every = [w["parameters"] for w in results["workloads"].values()]
    return min(every), max(every)


def against_paper(results: dict[str, Any]) -> str:
    """How much smaller these models are than the paper's, from the results."""
    small, large = sizes(results)
    return (f"{PAPER_PARAMETERS[0] / large:.0f} to {PAPER_PARAMETERS[1] / small:,.0f} times smaller than the "
            f"paper's ({size(small)} to {size(large)} parameters here, {size(PAPER_PARAMETERS[0])} to "
            f"{size(PAPER_PARAMETERS[1])} there)")


def machine() -> str:
    """CPU model, cores, memory, and the versions that matter (the line benchmarks/run.py prints)."""
    return machine_info.describe(("numpy", "torch"))


# -- tables -------------------------------------------------------------------------------------------
def _metric_cell(run: dict[str, Any], metric: str) -> str:
    return f"{run['final'][metric]:.4f}"


def main_table(results: dict[str, Any], name: str) -> list[str]:
    runs, work = results["runs"][name], results["workloads"][name]
    metric, ref = work["metric"], runs["reference"]
    lines = [f"| method | restores (bit-exact) | weights | whole state, history | whole state, on disk | "
             f"final test {metric} | change | test loss | loop overhead | background | restore, each |",
             "|---|---|---|---|---|---|---|---|---|---|---|",
             f"| uninterrupted, never compressed | 0 | – | – | – | {_metric_cell(ref, metric)} | – | "
             f"{ref['final']['loss']:.4f} | – | – | – |"]
    for key, usage in ref["lossless"].items():
        r = metrics.ratios(usage)
        lines.append(f"| {results['lossless_labels'][key]} | exact by construction | {x(r['weights'])} | "
                     f"{x(r['history'])} | {x(r['disk'])} | {_metric_cell(ref, metric)} | {pct(0.0)} | "
                     f"{ref['final']['loss']:.4f} | {ref['lossless_s'][key] / ref['train_s']:.0%} | – | – |")
    for key in MAIN:
        run = runs[key]
        lines.append(_method_row(results["labels"][key], run, runs, metric))
    return lines


def _method_row(label: str, run: dict[str, Any], runs: dict[str, Any], metric: str) -> str:
    r = metrics.ratios(run["usage"])
    loop, background = metrics.overhead(run)
    each = run["restore_s"] / run["restores"] if run["restores"] else 0.0
    return (f"| {label} | {run['restores']} ({run['usage']['exact_resumes']}) | {x(r['weights'])} | "
            f"{x(r['history'])} | {x(r['disk'])} | {_metric_cell(run, metric)} | "
            f"{pct(metrics.change(runs['reference']['final'][metric], run['final'][metric], metric))} | "
            f"{run['final']['loss']:.4f} | {loop:.0%} | {background:.0%} | {each:.2f} s |")


def settings_line(results: dict[str, Any], name: str) -> str:
    """The configurations the default Checkpointer chose, first and last version."""
    s = results["runs"][name]["ours"]["usage"]["settings"]
    p = results["runs"][name]["ours-paper"]["usage"]["settings"]
    return (f"Configurations chosen (levels / pruned / protected), first → last version: default "
            f"`{s[0]}` → `{s[-1]}`; paper setting `{p[0]}` → `{p[-1]}`.")


def goals(results: dict[str, Any], key: str) -> list[tuple[str, bool, str]]:
    """Per workload: (title, met, the figures) for the goal: >= 30x weights and >= 10x whole
    state (on disk) at <= 0.5 % change of the final quality."""
    out = []
    for name, work in results["workloads"].items():
        runs = results["runs"][name]
        r = metrics.ratios(runs[key]["usage"])
        c = metrics.run_change(runs, key, work["metric"])
        met = r["weights"] >= GOAL_WEIGHTS and r["disk"] >= GOAL_STATE and c <= GOAL_CHANGE
        misses = [what for what, ok in (("weights", r["weights"] >= GOAL_WEIGHTS),
                                        ("whole state", r["disk"] >= GOAL_STATE),
                                        ("quality", c <= GOAL_CHANGE)) if not ok]
        figures = f"{x(r['weights'])} weights, {x(r['disk'])} whole state, {pct(c)}"
        out.append((work["title"], met, figures + ("" if met else f" (missed: {', '.join(misses)})")))
    return out


def summary(results: dict[str, Any]) -> list[str]:
    lines = ["| workload | ours, default: weights | whole state (on disk) | change | "
             "ours, paper setting: weights | whole state | change | best baseline on whole state |",
             "|---|---|---|---|---|---|---|---|"]
    for name, work in results["workloads"].items():
        runs, metric = results["runs"][name], work["metric"]
        d, p = metrics.ratios(runs["ours"]["usage"]), metrics.ratios(runs["ours-paper"]["usage"])
        best = max((k for k in MAIN if not k.startswith("ours")),
                   key=lambda k: metrics.ratios(runs[k]["usage"])["disk"])
        b = metrics.ratios(runs[best]["usage"])
        lines.append(f"| {work['title']} | {x(d['weights'])} | {x(d['disk'])} | "
                     f"{pct(metrics.run_change(runs, 'ours', metric))} | {x(p['weights'])} | {x(p['disk'])} | "
                     f"{pct(metrics.run_change(runs, 'ours-paper', metric))} | {MAIN[best].label}: "
                     f"{x(b['disk'])}, {pct(metrics.run_change(runs, best, metric))} |")
    return lines


def bytes_table(results: dict[str, Any]) -> list[str]:
    """Where the default store's bytes go."""
    lines = ["| workload | weights | Adam moments and counters | documents (snapshots and zarr.json) | "
             "restore residual | whole state on disk |",
             "|---|---|---|---|---|---|"]
    for name, work in results["workloads"].items():
        usage = results["runs"][name]["ours"]["usage"]
        total = sum(v["stored"] for v in usage["versions"]) + usage["residual"]
        weights = sum(v["stored_weights"] for v in usage["versions"])
        meta = sum(v["stored_metadata"] for v in usage["versions"])
        rest = total - usage["residual"] - weights - meta
        shares = [f"{n / total:.0%}" for n in (weights, rest, meta, usage["residual"])]
        lines.append(f"| {work['title']} | " + " | ".join(shares) + f" | {x(metrics.ratios(usage)['disk'])} |")
    return lines


def rollback_lines(results: dict[str, Any]) -> list[str]:
    """The default run's rollback check per workload (none in results saved before it existed)."""
    rows = []
    for name, work in results["workloads"].items():
        usage = results["runs"][name]["ours"]["usage"]
        check = usage.get("rollback")
        if not check:
            continue
        metric = work["metric"]
        reference = metrics.quality(results["runs"][name]["reference"], metric)
        changes = [pct(metrics.change(reference, float(check[v]["final"][metric]), metric))
                   for v in ("stored", "moments reset")]
        moments = usage.get("moments")
        ratio = x(moments[0] / max(moments[1], 1)) if moments else "-"
        rows.append(f"| {work['title']} | {check['version']} of {work['checkpoints']} (step "
                    f"{check['stored']['step']}) | {ratio} | {changes[0]} | {changes[1]} |")
    if not rows:
        return []
    return ["## Rollback check", "",
            "With the default exact resume a restart never reads the lossy values: the newest version's "
            "restore residual gives back the exact bits. What the lossy history is for is rollbacks, "
            "evaluations and exports. Here the default run's middle version (older than the newest, so it "
            "has no residual) is restored into a fresh process and trained on to the end on the same "
            "batches; training on from the exact state at that step is the reference itself. The last "
            "column drops Adam's state after the same restore (a checkpoint without moments); change of the "
            "final quality, positive when worse (`benchmarks/evaluate/rollback.py`). Dropping the moments "
            "costs little next to restoring lossy weights, so with exact resume the moments are stored "
            "for rollbacks: a looser guard (update cosine 0.8, error 0.6), first attempts at 8 levels with 80 % "
            "then 60 % of m pruned, and moments from 64 elements up (`SearchPolicy.history_moments`, "
            "default `ROLLBACK_MOMENTS`). With the "
            "strict guard a lossy resume keeps (cosine 0.95, error 0.3) the same rollbacks changed the final "
            "quality +0.09 % (CNN, loss) / +1.28 % / +1.75 %, at 17.9× / 9.9× / 10.1× on the moments "
            "(`python -m benchmarks.evaluate.single NAME --methods ours,ours-strict --rollback-at 0.5`).", "",
            "| workload | version restored | moments ratio | final change, stored moments | "
            "final change, moments dropped |", "|---|---|---|---|---|", *rows, ""]


def probe_lines(results: dict[str, Any]) -> list[str]:
    """The tensors the search's tolerance runs out on first, per workload."""
    lines = []
    for name, work in results["workloads"].items():
        probe = results["runs"][name]["reference"]["probe"]
        top = sorted(probe.items(), key=lambda kv: -kv[1])[:3]
        cells = ", ".join(f"`{t}` {pct(c)}" for t, c in top)
        lines.append(f"- {work['title']}: {cells}")
    return lines


def lossless_versions(results: dict[str, Any], key: str) -> dict[str, int]:
    """Workload title -> versions of ``key`` stored lossless (nothing within the tolerance)."""
    return {w["title"]: results["runs"][n][key]["usage"]["settings"].count("lossless")
            for n, w in results["workloads"].items()}


def why(results: dict[str, Any]) -> list[str]:
    """The reasons behind the goals' outcome, with their figures."""
    d = {w["title"]: metrics.ratios(results["runs"][n]["ours"]["usage"]) for n, w in results["workloads"].items()}
    meta = {f"{w['title']}, {size(w['parameters'])} parameters":
            metrics.metadata_share(results["runs"][n]["ours"]["usage"]) for n, w in results["workloads"].items()}
    fraction = {w["title"]: metrics.residual_fraction(results["runs"][n]["ours"]["usage"])
                for n, w in results["workloads"].items()}
    lossless = {t: n for t, n in lossless_versions(results, "ours").items() if n}
    checkpoints = {w["title"]: w["checkpoints"] for w in results["workloads"].values()}
    out = [
        "Why the figures are what they are:",
        "",
        "- **Exact resumes.** The default resumes bit-exact from the newest version's restore residual, "
        "so its final quality is the uninterrupted run's, exactly, whatever the tolerance. The residual is "
        "the price: the history's ratio against the on-disk one ("
        + "; ".join(f"{t}: {x(r['history'])} → {x(r['disk'])}" for t, r in d.items())
        + "). It exists for the newest version only, so its share falls as the run gets longer: it is "
        + ", ".join(f"{fraction[t]:.2f}" for t in d) + " of one raw version of the whole state, and with "
        "the history's ratio H, N versions are N / (N / H + that fraction) smaller on disk.",
        "- **Documents.** Every version writes its snapshot (the search's trials, one record per Adam "
        "pair) and, for each array that changed, its zarr.json (the codebook, the codec chain, the shape) "
        "in a tree document, each compact JSON stored as a zstd frame, and each counted in the version's "
        "bytes. Every Adam moment and step counter is an array of its own; that is "
        + ", ".join(f"{v:.0%} ({t})" for t, v in meta.items()) + " of the default's stored history (table "
        "below): it weighs on small models, and its share falls as the model grows. Each codebook is "
        "written in the fewest digits that name its float32 centres (it was two fifths of the zarr.json "
        "text before), and a snapshot is a sixth of its JSON. Fewer arrays for the small tensors (one per "
        "Adam moment and step counter today) is what would lift the small models' whole-state figures "
        "further.",
        "- **Small tensors and moments.** Weights under 4096 elements (biases, norms, the LM's position "
        "table) stay lossless; Adam's two moments are two thirds of the state and are guarded by the "
        "update they drive, so they compress less than the weights. With exact resume they serve "
        "rollbacks only, and are stored with the looser guard the rollback check below supports, from "
        "64 elements up (`SearchPolicy.history_moments`).",
    ]
    if lossless:
        out.append(
            "- **Versions stored lossless.** " + ", ".join(f"{t}: {n} of {checkpoints[t]}" for t, n in lossless.items())
            + " versions of the default were stored lossless because no point of the search space was within the tolerance. "
            "The search has no axis for the embedding table: it always gets the base configuration's 16 "
            "levels, and quantizing that table alone already costs more than the tolerance (the most "
            "sensitive tensors below, each quantized alone with the base configuration on the final "
            "uninterrupted model). Then the whole model is stored lossless, not just that tensor.")
    out.append("- **Lossy resumes.** In the paper's setting every restore hands training the stored "
               "model. Stored closed loop, a version is within one residual's error of the live weights "
               "(keyframes, every `keyframe_interval` versions, carry a whole quantization error), so the "
               "damage adds up far less than when each version was quantized afresh (see the restore "
               f"sweep). These models are {against_paper(results)}, "
               "with less redundancy, and more sensitive to a few levels per tensor.")
    out.append(excp_line(results))
    out.append(overhead_line(results))
    return out


def excp_line(results: dict[str, Any]) -> str:
    """Why the ExCP-style baseline does well here, with its figures."""
    cells, gentler = [], True
    for name, work in results["workloads"].items():
        runs = results["runs"][name]
        change = metrics.run_change(runs, "excp", work["metric"])
        gentler = gentler and change < metrics.run_change(runs, "ours-paper", work["metric"])
        cells.append(f"{work['short']} {x(metrics.ratios(runs['excp']['usage'])['disk'])} at {pct(change)}")
    return ("- **ExCP style** reaches these whole-state ratios (" + "; ".join(cells) + ")"
            + (", with less damage than ours in the paper's setting on every workload" if gentler else "")
            + ". Each of its versions is a residual "
            "against the previous *restored* weights, as ours are now (closed loop: the model's float32 "
            "weights are stored as the residual on the previous version's stored values); where it gains "
            "its whole-state ratio is Adam's moments, which it prunes hard (they restart from zero after a "
            "restore, which these short runs absorb), and it keeps no restore residual. It has no "
            "tolerance check, so nothing bounds its damage on another model.")


def overhead_line(results: dict[str, Any]) -> str:
    """Checkpoint cost against the checkpoint interval, per workload (the default store)."""
    cells = []
    for name, work in results["workloads"].items():
        run = results["runs"][name]["ours"]
        per_ckpt = run["usage"]["background_s"] / len(run["usage"]["versions"])
        interval = run["train_s"] / work["checkpoints"]
        cells.append(f"{work['short']} {per_ckpt:.2f} s against {interval:.2f} s")
    return ("- **Overhead.** The store's background work per checkpoint (search, encoding, commit) against "
            "the seconds of training between two checkpoints: " + "; ".join(cells) + ". When the work takes "
            "longer than the interval, the next save waits for it: that is the loop overhead column. Here a "
            "checkpoint comes every fraction of a second of training; at the paper's interval of hours the "
            "same seconds are a fraction of a percent.")


def ablation_table(results: dict[str, Any]) -> list[str]:
    names = [n for n in results["workloads"] if "abl:no-delta" in results["runs"][n]]
    head = " | ".join(f"{results['workloads'][n]['title']}: weights / whole / change" for n in names)
    lines = [f"| variant | knob | {head} |", "|---|---|" + "---|" * len(names)]
    rows = [("ours-paper", "paper setting, all parts on", "–")] + [
        (f"abl:{k}", label.label, results["knobs"][f"abl:{k}"]) for k, (label, _) in ABLATIONS.items()]
    for key, label, knob in rows:
        cells = []
        for n in names:
            runs, metric = results["runs"][n], results["workloads"][n]["metric"]
            r = metrics.ratios(runs[key]["usage"])
            cells.append(f"{x(r['weights'])} / {x(r['history'])} / {pct(metrics.run_change(runs, key, metric))}")
        lines.append(f"| {label} | {knob} | " + " | ".join(cells) + " |")
    return lines


def tolerance_table(results: dict[str, Any]) -> list[str]:
    names = [n for n in results["workloads"] if any(k.startswith("tol:") for k in results["runs"][n])]
    head = " | ".join(f"{results['workloads'][n]['title']}: weights / whole / change" for n in names)
    lines = [f"| tolerance ε | {head} |", "|---|" + "---|" * len(names)]
    for eps in results["plan"]["tolerances"]:
        key = "ours-paper" if eps == results["tolerance"] else f"tol:{eps}"
        cells = []
        for n in names:
            runs, metric = results["runs"][n], results["workloads"][n]["metric"]
            r = metrics.ratios(runs[key]["usage"])
            cells.append(f"{x(r['weights'])} / {x(r['history'])} / {pct(metrics.run_change(runs, key, metric))}")
        lines.append(f"| {eps:g} | " + " | ".join(cells) + " |")
    return lines


def restores_table(results: dict[str, Any]) -> list[str]:
    """Change per restore count; a classifier also gets its test loss (accuracy is coarse)."""
    names = [n for n in results["workloads"] if len(plots.restore_series(results, n)) > 2]
    columns = []  # (title, restores -> change)
    for n in names:
        work = results["workloads"][n]
        columns.append((f"{work['short']} ({work['metric']})", dict(plots.restore_series(results, n))))
        if work["metric"] != "loss":
            columns.append((f"{work['short']} (test loss)", dict(plots.restore_series(results, n, "loss"))))
    lines = ["| restores | " + " | ".join(t for t, _ in columns) + " | paper, ResNet-152 (accuracy) |",
             "|---|" + "---|" * (len(columns) + 1)]
    for count in results["plan"]["restores"]:
        paper = plots.PAPER_RESTORES.get(count)
        cells = [pct(series[count]) if count in series else "–" for _, series in columns]
        lines.append(f"| {count} | " + " | ".join(cells) + f" | {'–' if paper is None else f'{paper:+.2f} %'} |")
    return lines


def workloads_table(results: dict[str, Any]) -> list[str]:
    lines = ["| workload | model | data | parameters (trainable) | steps | checkpoints (every) | quality |",
             "|---|---|---|---|---|---|---|"]
    for work in results["workloads"].values():
        lines.append(f"| {work['title']} | {work['model']} | {work['data']} | {size(work['parameters'])} "
                     f"({size(work['trainable'])}) | {work['steps']} | {work['checkpoints']} "
                     f"({work['every']}) | test {work['metric']} |")
    return lines


def _paper_cell(results: dict[str, Any], name: str, key: str, kind: str = "weights") -> str:
    runs, work = results["runs"][name], results["workloads"][name]
    if key not in runs:
        return ""
    r = metrics.ratios(runs[key]["usage"])[kind]
    return f"{work.get('short', work['title'])} {x(r)}, {pct(metrics.run_change(runs, key, work['metric']))}"


TRANSFER = ("transfer", "finetune")  # the workloads that fine-tune a pre-trained model


def paper_table(results: dict[str, Any]) -> list[str]:
    """Our headline figures beside the paper's (its ten-failure runs on 8x A40)."""
    def cells(key: str, kind: str = "weights", names: tuple[str, ...] | None = None) -> str:
        chosen = names if names is not None else tuple(results["workloads"])
        return "; ".join(c for n in chosen if n in results["runs"] and (c := _paper_cell(results, n, key, kind)))

    tight = "ours-paper" if results["tolerance"] == 0.01 else "tol:0.01"
    return [
        "| | the paper (ResNet-152, ViT-L32, BERT-Base, GPT-2 Medium; 8× A40) | here (CPU) |",
        "|---|---|---|",
        "| ours, ten lossy restores: weights ratio, final quality change | 39.09× 0.50 %; 26.19× −0.46 %; "
        f"29.25× 0.80 %; 29.81× 0.61 % | paper setting: {cells('ours-paper')} |",
        f"| ours as shipped (exact resume): weights ratio, change | – | {cells('ours')} |",
        f"| ours, whole training state on disk | not measured (weights only) | {cells('ours', 'disk')} |",
        f"| Check-N-Run | 5.71×, 7.82×, 6.78×, 6.35× | {cells('cnr')} |",
        f"| QD-Compressor | 11.82×, 16.31×, failed, 22.15× | {cells('qd')} |",
        "| transfer learning | BERT-Large 11.32×, Pythia-1B 9.99×, no quality loss | paper setting: "
        f"{cells('ours-paper', names=TRANSFER) or '–'}; default: {cells('ours', names=TRANSFER) or '–'} |",
        f"| tolerance ε = 0.01 | ResNet-152 21.82×, no degradation | {cells(tight) or '–'} |",
        "| 5 / 10 / 20 lossy restores | 0.16 % / 0.50 % / 1.1 % (ResNet-152) | the restore sweep above |",
    ]


# -- the page ---------------------------------------------------------------------------------------------
def page(results: dict[str, Any], command: str, wall_s: float, images: str) -> str:
    tol, failures = results["tolerance"], results["plan"]["failures"]
    wall = f"{wall_s / 60:.1f} minutes" if wall_s >= 120 else f"{wall_s:.0f} s"
    parts = [
        "# Evaluation: failures, restores, baselines and ablations",
        "",
        "What a checkpoint store is trusted for: a long run fails again and again, resumes from its "
        "newest compressed checkpoint each time, and must still end where it would have ended. This "
        f"page trains {count(len(results['workloads']))} models of {size(sizes(results)[0])} to "
        f"{size(sizes(results)[1])} parameters on the CPU, fails each run {failures} times, and compares the "
        "store with lossless formats, with reference implementations of the published lossy methods "
        "and with the store minus each of its parts: one command, every method on the same runs and the "
        "same checkpoint schedule.",
        "",
        f"Produced by `{command}` on {datetime.date.today().isoformat()} in {wall} of wall clock on: "
        f"{machine()}. The machine's 2 cores are shared with other jobs, so times are within ±30 %; "
        "ratios and qualities are deterministic (every input is seeded) and reproduce exactly.",
        "",
        "## Summary",
        "",
        *summary(results),
        "",
        f"The goal: at least {GOAL_WEIGHTS:.0f}× on the weights and {GOAL_STATE:.0f}× on the whole training "
        f"state, at most {GOAL_CHANGE:.1%} change of the final quality, after {failures} restores.",
        "",
        *[f"- ours, default, {title}: **{'met' if met else 'missed'}**: {fig}"
          for title, met, fig in goals(results, "ours")],
        *[f"- ours, paper setting, {title}: **{'met' if met else 'missed'}**: {fig}"
          for title, met, fig in goals(results, "ours-paper")],
        "",
        *why(results),
        "",
        "Where the default store's bytes go (share of everything the run left on disk):",
        "",
        *bytes_table(results),
        "",
        "The tensors the tolerance runs out on first: each quantized alone with the base configuration "
        "(16 levels, 0.5 % protected) on the final uninterrupted model, change of the search's metric on "
        "the validation batch:",
        "",
        *probe_lines(results),
        "",
        "## The workloads",
        "",
        *workloads_table(results),
        "",
        *HOW.format(tol=f"{tol:.0%}", failures=failures).splitlines(),
        "",
        f"## {failures} failures: every method",
        "",
        *COLUMNS,
    ]
    for name, work in results["workloads"].items():
        parts += ["", f"### {work['title']}", "", *main_table(results, name), "", settings_line(results, name)]
    parts += ["", *rollback_lines(results)]
    parts += [
        "", "## Ratio against quality", "",
        "Every method of the tables above, one point each (lossless ones at 0 % change); the dashed "
        "line is the 0.5 % goal. Top: weights; bottom: the whole training state on disk.", "",
        f"![ratio against final quality change]({images}/ratio-vs-quality.png)",
        "", "## Every version's ratio", "",
        *TIMELINE_TEXT, "",
        f"![ratio of every version]({images}/timeline.png)",
        "", "## Ablations", "",
        f"The paper's setting (lossy resumes, so quality differences show) with one part of the method "
        f"off at a time; weights ratio / whole-state ratio (history) / final quality change, {failures} "
        "restores each.", "",
        *ablation_table(results), "",
        *ABLATION_TEXT,
        "", "## Tolerance sweep", "",
        f"The paper's setting at {count(len(results['plan']['tolerances']))} tolerances ε of the search ({failures} lossy restores each); "
        "weights ratio / whole-state ratio / final quality change.", "",
        *tolerance_table(results), "",
        "", "## Restores against quality", "",
        "The paper's setting with 0 to 20 lossy restores (0: the run is never restored, so compression "
        "never touches it and it ends exactly where the uninterrupted run does). With the default "
        "`exact_resume=1` every one of these is 0: each resume is bit-exact.", "",
        *restores_table(results), "",
        "The CNN's test accuracy moves in steps of one image in 397 (0.25 %); its test loss is the finer "
        "view.", "",
        f"![final quality change against restores]({images}/restores.png)",
        "", "## Loss curves with and without restores", "",
        "Test loss at every checkpoint; a triangle is the loss right after a restore (the restored model "
        "before it trains on). The default resumes bit-exact, so its curve lies on the uninterrupted one.",
        "", f"![test loss with restores]({images}/loss-curves.png)",
        "", "## The baselines, as implemented here", "", *BASELINES,
        "", "## Beside the paper", "", *paper_table(results), "", paper_text(results),
        "", "## Regenerate", "",
        "The whole page, its plots and `evaluation.json` (every figure, as data) come from one command, "
        f"about {wall} here:",
        "",
        "<!-- docs-test: skip (run from a checkout of the repository: benchmarks/ is not installed; 45-90 minutes) -->",
        "```bash",
        "python -m benchmarks evaluate",
        "```",
        "",
        "The smoke test CI runs (tiny runs of the first three workloads, 2 restores, written to a folder of "
        "your choice, never over this page; `--finetune` adds a tiny fine-tune, minutes more):",
        "",
        "<!-- docs-test: skip (run from a checkout of the repository: benchmarks/ is not installed) -->",
        "```bash",
        'python -m benchmarks evaluate --quick --out "$(mktemp -d)"',
        "```",
        "",
    ]
    return "\n".join(parts)


HOW = """## How the experiment runs

- **Schedule.** Every method of a workload sees the same run: the same seed, the same batches
  (a function of the step), a checkpoint every `every` steps, the same learning-rate schedule
  (cosine decay to zero, so the final model is a settled point).
- **Failures.** {failures} times per run, right after a checkpoint (evenly spread, never after the
  last), the process "dies": model, optimizer and scheduler are thrown away, fresh ones are made
  with another seed, a fresh Checkpointer (or baseline reader) opens the store and restores the
  newest checkpoint, and training goes on from its step. A real failure also loses the steps since
  the last checkpoint; they are re-run on the same batches and change nothing but time, so they are
  skipped.
- **The reference.** One uninterrupted run that never compressed; the lossless methods are fed its
  checkpoints and every version is checked bit-exact on decode, so resuming from any of them
  continues that run exactly.
- **Search.** Ours and the baselines that have a knob (Check-N-Run's bit width, QD-Compressor's
  base bits, LC-Checkpoint's bucket count) keep, at every checkpoint, the most aggressive setting
  whose restored model is within ε = {tol} of the live model on a held-out validation batch,
  with the same `eval_fn`: accuracy for the classifier, loss for the language models (as the paper
  does). Final quality is measured on a separate test set.
- **Ratio.** All bytes a run stored for its versions against the uncompressed bytes of the same
  versions: *weights* (the model's tensors), *whole state, history* (weights, Adam moments,
  counters, scheduler: every version), *whole state, on disk* (history plus the restore residual
  still there at the end: everything the run left behind).
- **Overhead.** Seconds the training loop spent in checkpointing over its seconds of training
  (forward, backward, optimizer step). The store copies the state in the loop and searches,
  encodes and commits on a background thread (the *background* column, the same ratio); the
  baselines run in the loop. The stores live on a RAM disk (`/dev/shm`), so a disk's write time
  is not in these figures. These runs train for a fraction of a second between checkpoints, the
  paper's for hours: the share shrinks with the interval, the cost of one checkpoint does not.
- **Change.** Relative change of the final test metric against the uninterrupted run, positive
  when worse (accuracy down, loss up)."""

COLUMNS = [
    "Columns: restores in the run and how many were bit-exact; the three ratios; the final test "
    "metric and its change; the test loss (for the classifier a finer view than accuracy); the "
    "overhead; the mean time of one restore. *Ours, exact_resume=0* resumes from stored values but "
    "searches the conservative resume space (16-64 levels, at most 40 % pruned) that the store uses when "
    "there is no residual; *the paper's setting* also resumes from stored values and keeps the full "
    "search space, as the paper does.",
]

TIMELINE_TEXT = [
    "The ratio of each version's new bytes (a version stored as a delta against its parent costs "
    "only what changed; a keyframe, every 8 versions by default, costs the whole payload). The "
    "baselines without deltas store every version whole, so their line is flat; the lossless store "
    "gains only from its float codec, and from deduplication of tensors that never change (the frozen "
    "half of the transfer workload).",
]

ABLATION_TEXT = [
    "Each knob is public API except one: the store has no public option to turn off the regrouping "
    "of its delta streams, so that row swaps the store's delta codec through a private attribute "
    "(a benchmark-only switch). Magnitude-only scoring needs no knob: without "
    "`observe_gradients()` the Checkpointer has no sensitivity and scores by magnitude alone.",
]

BASELINES = [
    "Each is a small reference implementation written for this evaluation (numpy and zstandard), "
    "applied to the training state at every checkpoint; resumes load its restored values. What each "
    "models, and what it simplifies:",
    "",
    "- **zstd-3, ZipNN**: lossless, each version whole (ZipNN groups the floats' exponent bytes "
    "before entropy coding). **Ours, lossless** is the store without quantization: its float codec "
    "and deduplication of unchanged tensors.",
    "- **int8 absmax**: per tensor, `scale = max|w| / 127`, int8 codes, zstd. No search.",
    "- **Check-N-Run style**: uniform min–max quantization per tensor; the bit width (2–8) chosen at "
    "every checkpoint as the smallest within the tolerance; every version whole (Check-N-Run's "
    "differential checkpointing of touched embedding rows does not apply to dense models).",
    "- **QD-Compressor style**: per-layer uniform quantization whose bit width follows the layer's "
    "entropy (`base + round(H − mean H)`, base searched); the level ids of a layer whose values still "
    "fit its previous grid are stored as `(prev − curr) mod 2^bits` against the previous version "
    "(no regrouping: that is ours), else whole.",
    "- **LC-Checkpoint style**: the residual against the previous *restored* weights, bucketed by "
    "sign and binary exponent; only the `2^bits − 1` buckets of largest exponent are kept, each as "
    "its mean (bits searched); zstd instead of Huffman.",
    "- **ExCP style**: weight residuals against the previous restored weights pruned where "
    "`|r| ≤ α/√v · median|W|` (α = 5e-5); Adam moments kept only where `v > 2·mean(v)` and the "
    "weight's residual is kept; survivors coded as 4-bit k-means ids (15 centres and zero), zstd-19. "
    "Fixed hyperparameters, no search, and pruned moments come back as zero.",
    "",
    "Only ours and ExCP compress the optimizer state; the weight-only methods keep Adam's moments "
    "lossless (zstd), which is why their whole-state ratios stay near 1.5×.",
]

def paper_text(results: dict[str, Any]) -> str:
    return (f"These models are {against_paper(results)}, and the paper's trained for hours between "
            "checkpoints on GPUs; these are CPU-sized stand-ins, so compare the shape of the results (which "
            "method wins, how damage grows with restores), not the digits. Two differences of method matter: "
            "the paper compresses the weights only and resumes from lossy checkpoints; the store compresses "
            "the whole training state and, by default, resumes bit-exact from the newest version.")


def write(results: dict[str, Any], out: Path, command: str, wall_s: float, plotted: bool = True) -> Path:
    """``out/evaluation.md`` (images referenced as ``img/evaluation/...``); without plots (no
    matplotlib) each figure is replaced by a line saying so."""
    text = page(results, command, wall_s, "img/evaluation")
    if not plotted:
        text = re.sub(r"^!\[[^\]]*\]\([^)]*\)$", "(no plot: matplotlib is not installed; "
                      "`pip install -e '.[bench]'`)", text, flags=re.M)
    path = out / "evaluation.md"
    path.write_text(text, encoding="utf-8")
    return path

"""The page's four figures, drawn from the JSON results with matplotlib (Agg, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.evaluate import metrics

SHORT = {
    "ours": "ours (default)", "ours-er0": "ours, exact_resume=0", "ours-paper": "ours, paper setting",
    "int8": "int8", "cnr": "Check-N-Run", "qd": "QD-Compressor", "lc": "LC-Checkpoint", "excp": "ExCP",
    "abl:no-regroup": "- rearrangement", "abl:no-delta": "- delta", "abl:no-protect": "- protection",
    "abl:no-prune": "- pruning", "abl:magnitude": "magnitude only",
    "lossless:ours": "lossless (ours)", "lossless:zipnn": "ZipNN", "lossless:zstd": "zstd",
}
FILES = ("ratio-vs-quality.png", "timeline.png", "restores.png", "loss-curves.png")
#: the paper's degradation after n restores (ResNet-152)
PAPER_RESTORES = {5: 0.16, 10: 0.50, 20: 1.1}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _points(results: dict[str, Any], name: str) -> list[tuple[str, dict[str, float], float]]:
    """(label, ratios, change %) for every method of one workload, lossless ones included."""
    runs, metric = results["runs"][name], results["workloads"][name]["metric"]
    keys = [k for k in SHORT if k in runs]
    out = [(SHORT[k], metrics.ratios(runs[k]["usage"]), 100 * metrics.run_change(runs, k, metric)) for k in keys]
    for k, usage in runs["reference"]["lossless"].items():
        out.append((SHORT[f"lossless:{k}"], metrics.ratios(usage), 0.0))
    return out


def _style(label: str) -> dict[str, Any]:
    """Colour by family: ours red, its ablations orange, lossy baselines blue, lossless grey."""
    if label.startswith("ours"):
        return {"color": "C3", "marker": "o"}
    if label.startswith("-") or label.startswith("magnitude"):
        return {"color": "C1", "marker": "s"}
    if label in ("lossless (ours)", "ZipNN", "zstd"):
        return {"color": "grey", "marker": "D"}
    return {"color": "C0", "marker": "^"}


def _times(axis: Any) -> None:
    """A log axis of ratios: ticks at 1, 2 and 5 of each decade, written 1×, 2×, 5×, 10×."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
    axis.set_minor_locator(NullLocator())


def _plain_log(axis: Any) -> None:
    """A log axis with ticks at 1, 2 and 5 of each decade, written as plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    axis.set_minor_locator(NullLocator())


def _ratio_axis(ax: Any) -> None:
    ax.set_xscale("log")
    _times(ax.xaxis)


def ratio_vs_quality(results: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    names = list(results["runs"])
    fig, axes = plt.subplots(2, len(names), figsize=(5.4 * len(names), 8.5), dpi=100, squeeze=False)
    for col, name in enumerate(names):
        for row, (kind, title) in enumerate((("weights", "weights"), ("disk", "whole state, on disk"))):
            ax = axes[row][col]
            for i, (label, r, c) in enumerate(sorted(_points(results, name), key=lambda p: p[1][kind])):
                ax.scatter(r[kind], c, s=30, **_style(label))
                ax.annotate(label, (r[kind], c), fontsize=6.5, xytext=(3, 3 if i % 2 else -8),
                            textcoords="offset points")
            ax.axhline(0.5, color="grey", lw=0.8, ls="--")
            _ratio_axis(ax)
            ax.set_xlabel(f"{title} ratio (x)")
            ax.set_ylabel("final quality change, % (worse ->)")
            ax.set_title(f"{results['workloads'][name]['title']}\n{title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


TIMELINE = ("ours", "ours-paper", "excp", "lc", "qd", "cnr", "int8")


def timeline(results: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    names = list(results["runs"])
    fig, axes = plt.subplots(2, len(names), figsize=(5.2 * len(names), 7), dpi=100, squeeze=False)
    for col, name in enumerate(names):
        runs = results["runs"][name]
        for row, weights in enumerate((True, False)):
            ax = axes[row][col]
            for k in TIMELINE:
                steps, values = zip(*metrics.per_version(runs[k]["usage"], weights), strict=True)
                ax.plot(steps, values, marker=".", lw=1, label=SHORT[k])
            steps, values = zip(*metrics.per_version(runs["reference"]["lossless"]["ours"], weights), strict=True)
            ax.plot(steps, values, lw=1, ls=":", color="black", label=SHORT["lossless:ours"])
            ax.set_yscale("log")
            _times(ax.yaxis)
            ax.set_xlabel("step")
            ax.set_ylabel("version's ratio, " + ("weights" if weights else "whole state"))
            ax.set_title(results["workloads"][name]["title"], fontsize=9)
            if row == 0 and col == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def restores(results: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=100)
    for name in results["runs"]:
        series = restore_series(results, name)
        if len(series) > 2:
            ns, changes = zip(*series, strict=True)
            ax.plot(ns, [100 * c for c in changes], marker="o", label=results["workloads"][name]["title"])
    ax.scatter(list(PAPER_RESTORES), list(PAPER_RESTORES.values()), marker="x", color="black",
               label="paper, ResNet-152")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(list(results["plan"]["restores"]))
    ax.set_xlabel("lossy restores in the run")
    ax.set_ylabel("final quality change, % (worse ->)")
    ax.set_title("ours, paper setting (resume from the stored values)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def restore_series(results: dict[str, Any], name: str, metric: str | None = None) -> list[tuple[int, float]]:
    """(restores, change of ``metric``, the workload's own by default) of the paper's setting: 0 is
    the reference itself (compression never touches a run that is not restored), the plan's
    failure count is the main run."""
    runs, metric = results["runs"][name], metric or results["workloads"][name]["metric"]
    plan = results["plan"]
    out = []
    for n in plan["restores"]:
        key = "ours-paper" if n == plan["failures"] else f"restores:{n}"
        if n == 0:
            out.append((0, 0.0))
        elif key in runs:
            out.append((n, metrics.run_change(runs, key, metric)))
    return out


CURVES = ("ours", "ours-paper", "excp", "qd")


def loss_curves(results: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    names = list(results["runs"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 3.8), dpi=100, squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        runs = results["runs"][name]
        steps, losses = zip(*runs["reference"]["curve"], strict=True)
        ax.plot(steps, losses, color="black", lw=2.2, label="uninterrupted, never compressed")
        for i, k in enumerate(CURVES):
            steps, losses = zip(*runs[k]["curve"], strict=True)
            ax.plot(steps, losses, lw=1, color=f"C{i}", label=SHORT[k])
            if runs[k]["restored"]:
                rs, rl = zip(*runs[k]["restored"], strict=True)
                ax.scatter(rs, rl, s=12, color=f"C{i}", marker="v")
        ax.set_yscale("log")
        _plain_log(ax.yaxis)
        ax.set_xlabel("step")
        ax.set_ylabel("test loss (v: right after a restore)")
        ax.set_title(results["workloads"][name]["title"], fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def draw_all(results: dict[str, Any], folder: Path) -> list[Path]:
    """Every figure into ``folder``; none when matplotlib (the ``bench`` extra) is missing."""
    try:
        _pyplot()
    except ImportError:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    made = []
    for name, draw in zip(FILES, (ratio_vs_quality, timeline, restores, loss_curves), strict=True):
        draw(results, folder / name)
        made.append(folder / name)
    return made

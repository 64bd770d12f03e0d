"""The CLI's whole-store reads on a lossless store (issue 43, item 10): ``inshrink verify
STORE``, ``inshrink export STORE main OUT.safetensors --all`` (and ``OUT.pt --all``) and
``inshrink diff STORE main~1 main --values``, each run as the command itself (the typer app,
in this process, on a fresh store handle), in MB/s of logical bytes over wall time and over
the process's CPU time (per core): the target is >= 200 MB/s per core for each.

The store: six versions of a ~250 MiB float32 state (a 30,522 x 384 embedding, 96 matrices
and their first moments) changing slightly per version, so most objects are lossless deltas
in chains of up to five links. Logical bytes: verify counts every version's tensors (it
checks every object of all six), export the version's, diff both versions'. Each command runs
``--repeat`` times (default 3); the row is the run of least CPU time (a shared machine's other
jobs only ever add to it), with the range of the others. Each export writes a new file: the
one the run before wrote is deleted first, untimed (replacing it made the export's rename
free that file's pages, 0.05-0.15 CPU s, a cost of deleting the old file, not of exporting).

    python -m benchmarks cli_reads [STORE_DIR] [--repeat N] [--only verify export diff] [--chains]
        [--against OTHER_TREE]
    (the store is built there if missing; --only runs the commands whose names start so)

``--against OTHER_TREE`` compares this tree's code with another checkout's (``git worktree add
/tmp/old COMMIT``), on a loaded machine: each tree in a long-lived process of its own (the
commands run once first, untimed), the commands run in both alternately, command by command,
``--repeat`` times (default 3), the order flipped every round; MB/s per core, best and median.

``--chains`` times the part the byte-plane chain decode changed, alone and in one process:
``ObjectStore.get`` of every chunk object of the newest version that is a lossless delta
(its whole chain, nothing cached) decoded in byte planes, and link by link as before
(``_decode_links``), alternately, best of ``--repeat`` rounds by CPU time.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

import inshrink_store as ins
from inshrink_store import index


def build(url: str, versions: int = 6) -> None:
    rng = np.random.default_rng(0)
    shapes = [(30522, 384)] + [(384, 384)] * 48 + [(1536, 384)] * 24 + [(384, 1536)] * 24 + [(384,)] * 100
    state = {f"model/t{i:03d}": rng.standard_normal(s, dtype=np.float32) * 0.02 for i, s in enumerate(shapes)}
    for key in [k for k, a in state.items() if a.ndim == 2 and 1536 not in a.shape]:
        state[key.replace("model/", "optimizer/state/") + "/exp_avg"] = state[key] * 0.01
    repo = ins.open(url, create=True)
    for v in range(versions):
        repo.save(state, message=f"v{v}", step=v)
        state = {k: a + rng.standard_normal(a.shape, dtype=np.float32) * 1e-4 for k, a in state.items()}


def _cli(*args: str) -> None:
    from typer.testing import CliRunner

    from inshrink_store._cli import app

    result = CliRunner().invoke(app, list(args))
    if result.exit_code != 0:
        raise RuntimeError(f"inshrink {' '.join(args)} exited {result.exit_code}: {result.output}")


def measure(url: str, repeat: int = 3, only: tuple[str, ...] = ()) -> list[tuple[str, float, list[tuple[float, float]]]]:
    """(command, MiB read, [(wall s, cpu s) of each run]) of each command (those whose name
    starts with one of ``only``, when given)."""
    repo = ins.open(url)
    logical = sum(i.logical_bytes for i in repo.checkout("main").arrays().values())
    versions = len(repo.snapshot_ids())
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        commands = {
            "verify": (["verify", url], versions * logical),
            "export --all (.safetensors)": (["export", url, "main", f"{tmp}/x.safetensors", "--all"], logical),
            "export --all (.pt)": (["export", url, "main", f"{tmp}/x.pt", "--all"], logical),
            "diff --values": (["diff", url, "main~1", "main", "--values"], 2 * logical),
        }
        _cli("ls", url)  # imports and compiled kernels loaded before any timing
        for name, (args, read) in commands.items():
            if only and not name.startswith(only):
                continue
            runs = []
            for _ in range(repeat):
                index.CACHE.clear()  # each run as a fresh process would find it: nothing decoded
                for made in Path(tmp).iterdir():  # a new file, as a first export writes it (not timed)
                    made.unlink()
                wall, cpu = time.perf_counter(), time.process_time()
                _cli(*args)
                runs.append((time.perf_counter() - wall, time.process_time() - cpu))
            out.append((name, read / 2**20, runs))
    return out


#: what --against runs in each tree: the commands named on stdin, one per line, each as measure
#: runs them (after one untimed run of each), the CPU s of each printed; uses only the CLI and
#: the index cache, so an older tree runs it too
_SERVE = """
import json, sys, tempfile, time
from pathlib import Path
from typer.testing import CliRunner
from inshrink_store import index
from inshrink_store._cli import app
url, tmp = sys.argv[1], tempfile.mkdtemp()
commands = {name: [a.replace("{tmp}", tmp) for a in args] for name, args in json.loads(sys.argv[2]).items()}
def run(args):
    for made in Path(tmp).iterdir():
        made.unlink()
    index.CACHE.clear()
    cpu = time.process_time()
    result = CliRunner().invoke(app, args)
    if result.exit_code != 0:
        raise SystemExit(f"inshrink {args} exited {result.exit_code}: {result.output}")
    return time.process_time() - cpu
for args in commands.values():
    run(args)
print("ready", flush=True)
for line in sys.stdin:
    print(run(commands[line.strip()]), flush=True)
"""


def alternate(url: str, other: Path, repeat: int = 3, only: tuple[str, ...] = ()) -> str:
    """The ``--against`` table: MB/s per core of each command in ``other`` (another checkout)
    and in this tree, run alternately in two long-lived processes."""
    import json
    import os
    import statistics
    import subprocess
    import sys

    repo = ins.open(url)
    logical = sum(i.logical_bytes for i in repo.checkout("main").arrays().values())
    commands = {
        "verify": (["verify", url], len(repo.snapshot_ids()) * logical),
        "export --all (.safetensors)": (["export", url, "main", "{tmp}/x.safetensors", "--all"], logical),
        "export --all (.pt)": (["export", url, "main", "{tmp}/x.pt", "--all"], logical),
        "diff --values": (["diff", url, "main~1", "main", "--values"], 2 * logical),
    }
    chosen = {name: c for name, c in commands.items() if not only or name.startswith(only)}
    trees = {"other": other.resolve(), "this": Path(__file__).resolve().parents[1]}
    workers = {}
    for key, root in trees.items():
        env = dict(os.environ, PYTHONPATH=str(root))
        workers[key] = subprocess.Popen(
            [sys.executable, "-c", _SERVE, url, json.dumps({n: a for n, (a, _) in chosen.items()})],
            cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert workers[key].stdout is not None and workers[key].stdout.readline().strip() == "ready", key
    cpu: dict[tuple[str, str], list[float]] = {(k, n): [] for k in trees for n in chosen}
    loads = []
    for round_ in range(repeat):
        loads.append(os.getloadavg()[0])
        for name in chosen:
            for key in (("other", "this") if round_ % 2 == 0 else ("this", "other")):
                worker = workers[key]
                assert worker.stdin is not None and worker.stdout is not None
                worker.stdin.write(name + "\n")
                worker.stdin.flush()
                cpu[(key, name)].append(float(worker.stdout.readline()))
    for worker in workers.values():
        assert worker.stdin is not None
        worker.stdin.close()
        worker.wait()
    lines = [f"{other} against this tree, {repeat} runs of each alternated, load {min(loads):.1f}-{max(loads):.1f}", "",
             "| command | other: best / median MB/s per core | this: best / median |", "|---|---|---|"]
    for name, (_, read) in chosen.items():
        cells = [f"{read / 1e6 / min(cpu[(k, name)]):.0f} / {read / 1e6 / statistics.median(cpu[(k, name)]):.0f}"
                 for k in trees]
        lines.append(f"| `{name}` | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def measure_chains(url: str, repeat: int = 3) -> str:
    """The ``--chains`` table: MB/s per core of the newest version's delta chunks, decoded in
    byte planes and link by link."""
    from inshrink_store.cas import ObjectStore
    from inshrink_store.object_format import CODER_BYTEGROUP

    repo = ins.open(url)
    objects = repo.checkout("main").view.objects
    oids = sorted({oid for info in repo.checkout("main").arrays().values() for oid in info.chunk_ids.values()})
    deltas = [oid for oid in oids if (h := objects.header(oid)).is_delta and h.coder == CODER_BYTEGROUP]
    logical = sum(objects.header(oid).logical_length for oid in deltas)
    best = {"byte planes (get)": 0.0, "link by link (before)": 0.0}
    for _ in range(repeat):
        for name in best:
            fresh = ObjectStore(objects.storage)
            cpu = time.process_time()
            for oid in deltas:
                if name.startswith("byte"):
                    fresh.get(oid)
                else:
                    fresh._decode_links(*fresh._read_chain(oid))  # noqa: SLF001 - the old path, for the comparison
            best[name] = max(best[name], logical / 1e6 / (time.process_time() - cpu))
    lines = [f"{len(deltas)} delta chunks of the newest version, {logical / 2**20:.0f} MiB, chains of up to "
             f"{max(objects.header(oid).depth for oid in deltas) + 1} objects", "",
             "| decode | MB/s per core (best of the rounds) |", "|---|---|"]
    lines += [f"| {name} | {value:.0f} |" for name, value in best.items()]
    return "\n".join(lines)


def to_markdown(rows: list[tuple[str, float, list[tuple[float, float]]]]) -> str:
    lines = ["| command | MiB read | wall s | MB/s | CPU s | MB/s per core (target 200) |",
             "|---|---|---|---|---|---|"]
    for name, mib, runs in rows:
        mb = mib * 2**20 / 1e6
        wall, cpu = min(runs, key=lambda r: r[1])
        cpus = sorted(c for _, c in runs)
        spread = f" ({mb / cpus[-1]:.0f}-{mb / cpus[0]:.0f})" if len(cpus) > 1 else ""
        lines.append(f"| `{name}` | {mib:.0f} | {wall:.2f} | {mb / wall:.0f} | {cpu:.2f} | "
                     f"{mb / cpu:.0f}{spread} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", nargs="?", type=Path,
                        default=Path(tempfile.gettempdir()) / "inshrink-bench-cli-reads")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=[], help="commands to run (default: all)")
    parser.add_argument("--chains", action="store_true", help="time the delta chains' decode alone")
    parser.add_argument("--against", type=Path, help="another checkout: its code and this one's, alternated")
    args = parser.parse_args()
    if not (args.store / "inshrink.json").exists():
        build(str(args.store))
    if args.against is not None:
        print(alternate(str(args.store), args.against, args.repeat, tuple(args.only)))
        return
    if args.chains:
        print(measure_chains(str(args.store), args.repeat))
        return
    print(to_markdown(measure(str(args.store), args.repeat, tuple(args.only))))


if __name__ == "__main__":
    main()

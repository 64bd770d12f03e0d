"""Every code block in README.md and docs/**/*.md runs as written, in a fresh folder.

A fenced block tagged ``python`` or ``bash`` is run; any other block (output samples,
layouts, formulas) must say why it is not. A marker is an HTML comment on the last
non-blank line before the opening fence:

    <!-- docs-test: skip (REASON) -->   never run (needs credentials, installs, is output...)
    <!-- docs-test: slow (REASON) -->   run only with ``python -m pytest -m slow``
    <!-- docs-test: continue -->        runs in the same process and folder as the block
                                        of the same language before it in the page (the
                                        page builds on it), concatenated into one script

Each block (or chain of continued blocks) runs in a subprocess whose working directory is a
new temporary folder, with this interpreter's ``bin`` first on PATH (so ``python`` and
``inshrink`` are the ones under test) and a time limit that only stops a hang: a block is
not judged by how fast it runs (a loaded machine once failed a README block at 90 s), and
blocks too long for every run are marked slow by their authors. A python block that
defines ``test_`` functions is run with pytest, as the docs tell readers to. The selected
blocks are started together on a few worker threads when the first of them runs (each
subprocess keeps to one compute thread), so the page checks take about half the time on
two cores.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
RUNNABLE = ("python", "bash")
TIME_LIMIT_S = 600  # per block, its own run only (not its wait for a worker): a hang guard
SLOW_TIME_LIMIT_S = 1800  # the same for slow blocks and the demo
WORKERS = max(1, min(4, os.cpu_count() or 1))

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$")
MARKER = re.compile(r"^<!--\s*docs-test:\s*(\w+)\s*(?:\((.*)\))?\s*-->$")


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None = None
    reason: str | None = None


@dataclass
class Group:
    """One subprocess: a block and the blocks that continue it."""

    blocks: list[Block] = field(default_factory=list)

    @property
    def lang(self) -> str:
        return self.blocks[0].lang

    @property
    def id(self) -> str:
        return f"{self.blocks[0].page}:{self.blocks[0].line}"

    @property
    def slow(self) -> bool:
        return any(b.marker == "slow" for b in self.blocks)

    @property
    def code(self) -> str:
        return "\n\n".join(b.code for b in self.blocks)


def parse_page(page: str, text: str) -> tuple[list[Block], list[str]]:
    """The fenced blocks of one page with their markers, and every problem with the markers."""
    lines = text.splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            if "docs-test" in lines[i] and not MARKER.match(lines[i].strip()):
                problems.append(f"{page}:{i + 1}: malformed docs-test marker {lines[i].strip()!r}")
            elif MARKER.match(lines[i].strip()):
                after = next((line for line in lines[i + 1:] if line.strip()), "")
                if not FENCE.match(after):
                    problems.append(f"{page}:{i + 1}: docs-test marker not right before a code block")
            i += 1
            continue
        fence, lang = opened.group(1), opened.group(2).lower()
        end = i + 1
        while end < len(lines) and not re.match(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        if end == len(lines):
            problems.append(f"{page}:{i + 1}: code block never closed")
        block = Block(page, i + 1, lang, textwrap.dedent("\n".join(lines[i + 1:end])) + "\n")
        before = i - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = MARKER.match(lines[before].strip()) if before >= 0 else None
        if marker:
            block.marker, block.reason = marker.group(1), (marker.group(2) or "").strip() or None
        blocks.append(block)
        i = end + 1
    return blocks, problems


def check_block(block: Block) -> list[str]:
    where = f"{block.page}:{block.line}"
    if block.marker not in (None, "skip", "slow", "continue"):
        return [f"{where}: unknown docs-test marker {block.marker!r} (skip, slow or continue)"]
    if block.marker in ("skip", "slow") and not block.reason:
        return [f"{where}: `docs-test: {block.marker}` needs a reason: "
                f"<!-- docs-test: {block.marker} (why) -->"]
    if block.lang not in RUNNABLE and block.marker != "skip":
        return [f"{where}: a ```{block.lang or '(no language)'} block is never run; mark it "
                "<!-- docs-test: skip (why: output sample, layout, ...) --> or tag it python/bash"]
    return []


def collect(texts: dict[str, str]) -> tuple[list[Group], list[str], dict[str, list[Block]]]:
    """Groups to run, marker problems, and every page's blocks, from page name -> text."""
    groups: list[Group] = []
    problems: list[str] = []
    pages: dict[str, list[Block]] = {}
    for page, text in texts.items():
        blocks, page_problems = parse_page(page, text)
        problems += page_problems
        pages[page] = blocks
        last: dict[str, Group] = {}
        for block in blocks:
            problems += check_block(block)
            if block.marker == "skip" or block.lang not in RUNNABLE:
                continue
            if block.marker == "continue":
                if block.lang not in last:
                    problems.append(f"{block.page}:{block.line}: `docs-test: continue` but no "
                                    f"earlier {block.lang} block in the page to continue")
                    continue
                last[block.lang].blocks.append(block)
                continue
            group = Group([block])
            groups.append(group)
            last[block.lang] = group
    return groups, problems, pages


GROUPS, PROBLEMS, PAGES = collect(
    {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in DOC_FILES})


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("PYTHONSTARTUP", None)
    for threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(threads, "1")  # blocks run side by side: no thread oversubscription
    return env


def _command(group: Group, folder: Path) -> list[str]:
    if group.lang == "bash":
        (folder / "doc_block.sh").write_text(group.code)
        return ["bash", "-euo", "pipefail", "doc_block.sh"]
    if re.search(r"^def test_", group.code, re.MULTILINE):
        (folder / "test_doc_block.py").write_text(group.code)
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_doc_block.py"]
    (folder / "doc_block.py").write_text(group.code)
    return [sys.executable, "doc_block.py"]


def test_markers_are_well_formed() -> None:
    """Every skip says why; nothing that looks like code is silently left out."""
    assert not PROBLEMS, "\n".join(PROBLEMS)


def test_marker_rules_are_enforced() -> None:
    page = textwrap.dedent("""\
        <!-- docs-test: skip -->
        ```python
        print("no reason given")
        ```
        ```text
        an output sample nobody marked
        ```
        <!-- docs-test: skip (an output sample) -->
        ```
        marked, so fine
        ```
        <!-- docs-test: continue -->
        ```bash
        echo "nothing to continue"
        ```
        ```python
        x = 1
        ```

        <!-- docs-test: continue -->

        ```python
        assert x == 1
        ```
        <!-- docs-test: sometimes (a typo) -->
        ```python
        pass
        ```
        <!-- docs-test skip (malformed) -->
        <!-- docs-test: skip (before prose, not a block) -->
        Some prose.
        """)
    groups, problems, _ = collect({"page.md": page})
    assert [p.split(": ", 1)[0] for p in problems] == [
        "page.md:29", "page.md:30", "page.md:2", "page.md:5", "page.md:13", "page.md:26"], problems
    assert "not right before a code block" in problems[1]
    problems.pop(1)
    assert "needs a reason" in problems[1] and "never run" in problems[2]
    assert "no earlier bash block" in problems[3] and "unknown docs-test marker" in problems[4]
    chained = [g for g in groups if len(g.blocks) == 2]
    assert len(chained) == 1 and chained[0].code == "x = 1\n\n\nassert x == 1\n"


def test_pages_have_runnable_blocks() -> None:
    assert any(g.blocks[0].page == "README.md" for g in GROUPS), "the README's quick starts must run"


def _run(group: Group, folder: Path) -> tuple[float, subprocess.CompletedProcess[str] | None]:
    """Run one group; ``None`` when it ran past its time limit (it hung)."""
    limit = SLOW_TIME_LIMIT_S if group.slow else TIME_LIMIT_S
    try:
        return limit, subprocess.run(_command(group, folder), cwd=folder, env=_env(),
                                     capture_output=True, text=True, timeout=limit,
                                     stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return limit, None


@pytest.fixture(scope="session")
def block_runs(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future]:
    """Start every selected block at once (on WORKERS threads); each test waits for its own."""
    selected = [item.callspec.params["group"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_block_runs"]
    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="doc-block")
    runs = {g.id: pool.submit(_run, g, tmp_path_factory.mktemp("doc-block")) for g in selected}
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize(
    "group",
    [pytest.param(g, id=g.id, marks=[pytest.mark.slow] if g.slow else []) for g in GROUPS],
)
def test_block_runs(group: Group, block_runs: dict[str, Future]) -> None:
    limit, done = block_runs[group.id].result()
    if done is None:
        pytest.fail(f"{group.id}: still running after {limit} s, a hang guard far above any "
                    "block's run; look for a block waiting on input, a server or a lock")
    if done.returncode != 0:
        pytest.fail(f"{group.id} ({group.lang}) exited {done.returncode}:\n"
                    f"--- code ---\n{group.code}\n--- stdout ---\n{done.stdout[-4000:]}\n"
                    f"--- stderr ---\n{done.stderr[-4000:]}")


# -- what the pages say, beyond their blocks -------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)}


def test_pages_stand_alone() -> None:
    """Readers get the method from our pages: nothing points outside the repository."""
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        for needle in ("ALGORITHM.md", "DESIGN.md", "../shared", "shared/"):
            assert needle not in text, f"{path.relative_to(ROOT)} points readers at {needle}"


def test_relative_links_resolve() -> None:
    broken = []
    for path in DOC_FILES:
        for target in LINK.findall(path.read_text(encoding="utf-8")):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_torch_pins_match_constraints() -> None:
    """A `torch==X` in the docs is the version constraints.txt pins."""
    pin = re.search(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(), re.M)
    assert pin, "constraints.txt pins torch"
    for path in DOC_FILES:
        for version in re.findall(r"torch==([\w.+]+)", path.read_text(encoding="utf-8")):
            assert version == pin.group(1), f"{path.relative_to(ROOT)} says torch=={version}"


CODEC_GUIDE = "docs/guides/testing-your-codec.md"
PROBE = """
import json, sys
import numpy as np
from inshrink_store.testing import check_codec_roundtrip
exec(compile(open("codec.py").read(), "codec.py", "exec"))
messages = []
for value in (2.0**23, float("inf"), float("nan")):
    try:
        check_codec_roundtrip(FixedPoint(8), np.array(value, np.float32), max_abs_error=2.0**-9)
    except AssertionError as exc:
        messages.append(f"AssertionError: {exc}")
json.dump(messages, sys.stdout)
"""


def test_codec_guide_quotes_the_real_failures(tmp_path: Path) -> None:
    """The guide's FixedPoint example fails on values it cannot hold; quote what it prints."""
    example = next(b for b in PAGES[CODEC_GUIDE] if "class FixedPoint" in b.code)
    body = example.code.split("\n@settings")[0]  # the codec, without its property test
    (tmp_path / "codec.py").write_text(body)
    (tmp_path / "probe.py").write_text(PROBE)
    done = subprocess.run([sys.executable, "probe.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=TIME_LIMIT_S, env=_env(), check=True)
    messages = json.loads(done.stdout)
    assert len(messages) == 3, messages
    guide = " ".join((ROOT / CODEC_GUIDE).read_text(encoding="utf-8").split())
    exact = platform.machine().lower() in ("x86_64", "amd64")  # the guide quotes x86-64's casts
    for message in messages:
        quoted = " ".join(message.split()) if exact else re.split(r"[\d\[]", message)[0]
        assert quoted in guide, f"{CODEC_GUIDE} should quote: {message}"


@pytest.mark.slow
def test_readme_demo_prints_its_summary(tmp_path: Path) -> None:
    """`inshrink demo` prints the README's summary lines (figures may differ by machine)."""
    sample = next(b for b in PAGES["README.md"] if b.reason and "inshrink demo" in b.reason
                  and b.lang == "text")
    done = subprocess.run(["inshrink", "demo"], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=SLOW_TIME_LIMIT_S, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-4000:]
    printed = done.stdout.splitlines()
    for line in sample.code.splitlines():
        shape = re.sub(r"\d+(?:\\\.\d+)?", lambda _: r"\d+(?:\.\d+)?", re.escape(line))
        assert any(re.fullmatch(shape, p.strip()) for p in printed), (
            f"README's demo sample says {line!r}; the demo printed:\n{done.stdout[-3000:]}")

"""A hypothesis state machine: commit, tag, branch, checkout and gc against a plain model.

The model is a dict of versions (snapshot id -> tensors), each branch's history and
the tags. After any sequence of operations, every version the model says is kept
must read back exactly, ``log`` must list each branch's surviving history newest
first, gc must delete exactly what the model drops, and ``verify`` must pass.
"""

from __future__ import annotations

import uuid

import numpy as np
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

import inshrink_store as ins
from inshrink_store import manifest

NAMES = ["a", "b", "deep/c"]


def _tensor(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (int(rng.integers(0, 5)), int(rng.integers(1, 4)))
    if seed % 2:
        return rng.integers(-50, 50, size=shape, dtype=np.int32)
    return rng.standard_normal(shape).astype(np.float32)


STATES = st.dictionaries(st.sampled_from(NAMES), st.integers(0, 6), min_size=1).map(
    lambda seeds: {name: _tensor(seed) for name, seed in seeds.items()}
)
BRANCH_NAMES = st.sampled_from(["main", "dev", "exp.1"])
TAG_NAMES = st.sampled_from(["best", "v1", "t-2"])


class RepositoryMachine(RuleBasedStateMachine):
    branch_names = Bundle("branch_names")

    def __init__(self) -> None:
        super().__init__()
        self.name = f"machine-{uuid.uuid4().hex}"
        self.repo = ins.open(f"memory://{self.name}", create=True)
        self.states: dict[str, dict[str, np.ndarray]] = {}  # alive versions
        self.parents: dict[str, str | None] = {}
        self.heads: dict[str, str] = {}
        self.tag_map: dict[str, str] = {}
        #: each branch's ref files, by seq: the version create_branch started it at (seq 0),
        #: then each commit; gc removes a ref file with its version (read: an id not in states)
        self.journals: dict[str, list[str]] = {}
        self.counter = 0

    def teardown(self) -> None:
        for key in [k for k in MemoryFileSystem.store if k.startswith(f"/{self.name}/")]:
            MemoryFileSystem.store.pop(key, None)

    # -- model helpers -----------------------------------------------------------------
    def history(self, branch: str) -> list[str]:
        """What ``log`` lists (and ``branch~N`` counts): the head, then each version's parent,
        or where gc removed the parent, the version the ref files say was committed before it
        and is still kept (:meth:`_kept_before`), newest first."""
        out: list[str] = []
        current: str | None = self.heads[branch]
        while current is not None and current in self.states and current not in out:
            out.append(current)
            parent = self.parents[current]
            current = parent if parent is None or parent in self.states else self._kept_before(current)
        return out

    def _kept_before(self, sid: str) -> str | None:
        """The model of ``history._kept_before``: on each branch with a ref file ``s`` naming
        ``sid``, where ref file ``s - 1`` is gone or names its parent, the newest kept version
        a ref file below ``s - 1`` names; taken only when the branches agree."""
        found: set[str] = set()
        for entries in self.journals.values():
            for s, named in enumerate(entries):
                if named != sid:
                    continue
                before = entries[s - 1] if s >= 1 and entries[s - 1] in self.states else None
                if before not in (None, self.parents[sid]):
                    continue
                for older in reversed(entries[:max(s - 1, 0)]):
                    if older in self.states and older != self.parents[sid]:
                        found.add(older)
                        break
        return found.pop() if len(found) == 1 else None

    def check_reads_back(self, sid: str) -> None:
        loaded = self.repo.load(sid)
        expected = self.states[sid]
        assert sorted(loaded) == sorted(expected)
        for name, value in expected.items():
            assert loaded[name].dtype == value.dtype and loaded[name].shape == value.shape
            assert loaded[name].tobytes() == value.tobytes(), (sid, name)

    # -- rules ---------------------------------------------------------------------------
    @rule(target=branch_names, branch=BRANCH_NAMES, state=STATES)
    def commit(self, branch: str, state: dict[str, np.ndarray]) -> str:
        if branch not in self.heads and branch != "main" and self.heads:
            branch = "main"  # other branches are born through create_branch
        self.counter += 1
        info = self.repo.save(state, branch=branch, message=f"commit {self.counter}", step=self.counter)
        assert info.parent == self.heads.get(branch)
        assert info.id not in self.states
        self.states[info.id] = state
        self.parents[info.id] = info.parent
        self.heads[branch] = info.id
        self.journals.setdefault(branch, []).append(info.id)
        return branch

    @precondition(lambda self: bool(self.heads))
    @rule(name=BRANCH_NAMES, source=branch_names, back=st.integers(0, 3))
    def create_branch(self, name: str, source: str, back: int) -> None:
        history = self.history(source)
        if name in self.heads:
            try:
                self.repo.create_branch(name, source)
            except ins.ConflictError:
                return
            raise AssertionError(f"branch {name} created twice")
        if back >= len(history):
            if back == len(history) and self.parents[history[-1]] is not None:
                return  # resolves to a gc'ed id: see test_bad_input.py::test_ref_past_gc_cut_is_not_found
            try:
                self.repo.create_branch(name, f"{source}~{back}")
            except ins.NotFoundError:
                return
            raise AssertionError(f"{source}~{back} resolved beyond the kept history")
        assert self.repo.create_branch(name, f"{source}~{back}") == history[back]
        self.heads[name] = history[back]
        self.journals[name] = [history[back]]

    @precondition(lambda self: bool(self.heads))
    @rule(name=TAG_NAMES, source=branch_names, back=st.integers(0, 2))
    def tag(self, name: str, source: str, back: int) -> None:
        history = self.history(source)
        if back >= len(history):
            return
        if name in self.tag_map:
            try:
                self.repo.tag(name, history[back])
            except ins.ConflictError:
                assert self.repo.tags()[name] == self.tag_map[name]
                return
            raise AssertionError(f"tag {name} written twice")
        assert self.repo.tag(name, f"{source}~{back}") == history[back]
        self.tag_map[name] = history[back]

    @precondition(lambda self: bool(self.heads))
    @rule(source=branch_names, back=st.integers(0, 4))
    def checkout(self, source: str, back: int) -> None:
        history = self.history(source)
        if back < len(history):
            assert self.repo.resolve(f"{source}~{back}") == history[back]
            self.check_reads_back(history[back])
        else:
            try:
                self.repo.checkout(f"{source}~{back}")
            except ins.NotFoundError:
                return
            raise AssertionError(f"{source}~{back} resolved beyond the kept history")

    @precondition(lambda self: bool(self.heads))
    @rule(keep_last=st.none() | st.integers(1, 3))
    def gc(self, keep_last: int | None) -> None:
        kept = set(self.tag_map.values())
        for branch in self.heads:
            kept.update(self.history(branch)[:keep_last])
        dropped = set(self.states) - kept
        report = self.repo.gc(keep_last=keep_last)
        assert sorted(p.split("/")[1] for p in report.deleted["snapshots"]) == sorted(dropped)
        self.states = {sid: s for sid, s in self.states.items() if sid in kept}
        for sid in self.states:
            self.check_reads_back(sid)
        assert self.repo.verify().ok
        again = self.repo.gc(keep_last=keep_last, dry_run=True)
        assert not any(again.deleted.values()), again.deleted

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def refs_and_log_match_the_model(self) -> None:
        assert self.repo.branches() == self.heads
        assert self.repo.tags() == self.tag_map
        assert self.repo.snapshot_ids() == sorted(self.states)
        for branch in self.heads:
            assert [i.id for i in self.repo.log(branch)] == self.history(branch)


RepositoryMachine.TestCase.settings = settings(
    max_examples=15, stateful_step_count=12, deadline=None
)
TestRepositoryMachine = RepositoryMachine.TestCase


class TestRepositoryMachineTreeFiles(RepositoryMachine.TestCase):
    """The same model with every array's node a tree file (only groups inline)."""

    settings = settings(max_examples=8, stateful_step_count=12, deadline=None)

    def setUp(self) -> None:
        self._inline_max = manifest.INLINE_MAX_CHUNKS
        manifest.INLINE_MAX_CHUNKS = 0

    def tearDown(self) -> None:
        manifest.INLINE_MAX_CHUNKS = self._inline_max

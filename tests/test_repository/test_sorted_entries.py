"""SortedEntries: a dict whose keys stay sorted whoever changes it, so a save finds the
keys under an array's path by bisection instead of testing every key (quadratic)."""

from __future__ import annotations

import pickle

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import inshrink_store as ins
from inshrink_store.index import Entry
from inshrink_store.zarr_store import PendingChunks, SortedEntries

KEYS = st.text(alphabet="ab/c0", min_size=1, max_size=6)
OPS = st.lists(st.tuples(st.sampled_from(["set", "del", "pop", "setdefault", "update", "under", "popitem",
                                          "clear", "ior", "bulk",
                                          "setdefault_none"]), KEYS), max_size=40)


def _apply(target: dict[str, Entry], op: str, key: str, sorted_target: bool) -> None:
    entry = Entry(oid=key.ljust(32, "0"))
    if op == "set":
        target[key] = entry
    elif op == "del" and key in target:
        del target[key]
    elif op == "pop":
        target.pop(key, None)
    elif op == "setdefault":
        target.setdefault(key, entry)
    elif op == "update":
        target.update({key: entry, key + "/x": entry})
    elif op == "bulk":  # many new keys at once: the one-sort path
        target.update({f"{key}/{i:02d}": entry for i in range(40)})
    elif op == "ior":
        target |= {key + "0": entry}
    elif op == "setdefault_none":
        target.setdefault(key)
    elif op == "popitem" and target:
        target.popitem()
    elif op == "clear" and len(key) == 1:
        target.clear()
    elif op == "under":
        if sorted_target:
            assert isinstance(target, SortedEntries)
            target.delete_under(key)
        else:
            for k in [k for k in target if k.startswith(key)]:
                del target[k]


@settings(max_examples=200, deadline=None)
@given(start=st.dictionaries(KEYS, st.just(Entry(inline=b"{}")), max_size=10), ops=OPS)
def test_behaves_like_a_dict_with_keys_kept_sorted(start: dict[str, Entry], ops: list[tuple[str, str]]) -> None:
    plain, ours = dict(start), SortedEntries(start)
    for op, key in ops:
        _apply(plain, op, key, False)
        _apply(ours, op, key, True)
        assert dict(ours) == plain
        assert ours.sorted_keys() == sorted(plain)
    copy = pickle.loads(pickle.dumps(ours))
    assert isinstance(copy, SortedEntries) and dict(copy) == plain and copy.sorted_keys() == sorted(plain)


def test_delete_under_leaves_keys_that_only_share_a_stem() -> None:
    entries = SortedEntries({k: Entry(inline=b"") for k in ["a/0", "a/b/0", "a0", "ab/0", "a", "b/0"]})
    entries.delete_under("a/")
    assert entries.sorted_keys() == ["a", "a0", "ab/0", "b/0"]


def test_a_save_over_a_parent_drops_what_the_parent_held_under_a_path() -> None:
    """An array written where the parent had a group of arrays replaces that group: the
    prefix deletion runs on the inherited keys, and the version holds only the new array."""
    repo = ins.open("memory://sorted-entries", create=True)
    repo.save({"layer/a": np.arange(4, dtype=np.float32), "layer/b": np.ones(3, np.float32),
               "other": np.zeros(2, np.float32)})
    with repo.transaction() as tx:
        view = tx.view
        assert isinstance(view, PendingChunks) and isinstance(view.entries, SortedEntries)
        tx.write({"layer": np.full(5, 7, np.float32)})
        assert view.keys() == ["layer/c/0", "layer/zarr.json", "other/c/0", "other/zarr.json", "zarr.json"]
        tx.commit("layer becomes an array")
    loaded = repo.load()
    assert sorted(loaded) == ["layer", "other"]
    np.testing.assert_array_equal(loaded["layer"], np.full(5, 7, np.float32))

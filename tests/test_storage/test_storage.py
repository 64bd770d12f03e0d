"""The fsspec adapter: the same few guarantees on memory, local disk, S3 and GCS.

Everything above ``Storage`` assumes these: missing files raise
``FileNotFoundError``; exclusive create is decided once and never overwrites;
listings show what other writers created a moment ago (refs are found by listing).
"""

from __future__ import annotations

import threading

import pytest

from inshrink_store.errors import FormatError, MissingDependencyError
from inshrink_store.storage import open_storage


def test_read_write_list_delete(store_url: str) -> None:
    storage = open_storage(store_url)
    with pytest.raises(FileNotFoundError):
        storage.read("objects/ab/missing")
    assert storage.list("objects") == {}
    storage.write("objects/ab/cdef", b"12345")
    storage.write("objects/ab/cdef", b"12345")  # content-addressed: rewriting is harmless
    storage.write("objects/cd/0123", b"")
    storage.write("refs/x", b"r")
    assert storage.read("objects/ab/cdef") == b"12345"
    assert storage.exists("objects/ab/cdef") and not storage.exists("objects/ab/nope")
    assert storage.list("objects") == {"objects/ab/cdef": 5, "objects/cd/0123": 0}
    storage.delete("objects/ab/cdef")
    storage.delete("objects/ab/cdef")  # deleting twice is not an error (gc may be re-run)
    assert list(storage.list("objects")) == ["objects/cd/0123"]


def test_exclusive_create_never_overwrites(store_url: str) -> None:
    storage = open_storage(store_url)
    storage.create_exclusive("refs/branches/main/000000000000", b"first")
    with pytest.raises(FileExistsError):
        storage.create_exclusive("refs/branches/main/000000000000", b"second")
    assert storage.read("refs/branches/main/000000000000") == b"first"
    assert storage.list("refs") == {"refs/branches/main/000000000000": 5}


def test_a_second_handle_sees_new_files_at_once(store_url: str) -> None:
    """Two handles on one store, as two processes would have: a listing or read in
    one must never be served from a cache that predates the other's write."""
    one, two = open_storage(store_url), open_storage(store_url)
    one.create_exclusive("refs/branches/main/000000000000", b"a")
    assert list(two.list("refs/branches/main")) == ["refs/branches/main/000000000000"]
    one.create_exclusive("refs/branches/main/000000000001", b"b")
    assert list(two.list("refs/branches/main")) == [
        "refs/branches/main/000000000000", "refs/branches/main/000000000001",
    ]
    assert two.read("refs/branches/main/000000000001") == b"b"
    with pytest.raises(FileExistsError):
        two.create_exclusive("refs/branches/main/000000000001", b"c")


def test_concurrent_exclusive_creates_have_one_winner(store_url: str) -> None:
    outcomes: list[str] = []
    barrier = threading.Barrier(4, timeout=30)

    def create(data: bytes) -> None:
        storage = open_storage(store_url)
        barrier.wait()
        try:
            storage.create_exclusive("refs/tags/best", data)
            outcomes.append(data.decode())
        except FileExistsError:
            outcomes.append("exists")

    threads = [threading.Thread(target=create, args=(f"w{i}".encode(),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [o for o in outcomes if o != "exists"]
    assert len(winners) == 1 and len(outcomes) == 4
    assert open_storage(store_url).read("refs/tags/best") == winners[0].encode()


def test_local_leftover_temp_files_are_not_listed(local_url: str) -> None:
    storage = open_storage(local_url)
    storage.create_exclusive("refs/branches/main/000000000000", b"a")
    # what a writer killed between writing its temp file and linking it leaves
    storage.write("refs/branches/main/000000000001.tmp-deadbeef", b"half")
    assert list(storage.list("refs")) == ["refs/branches/main/000000000000"]


def test_bad_urls_get_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FormatError, match="store URL"):
        open_storage("")
    with pytest.raises(FormatError, match="nosuchproto"):
        open_storage("nosuchproto://bucket/x")

    import fsspec.core

    def no_backend(url: str, **kwargs: object) -> None:
        raise ImportError("No module named 's3fs'")

    monkeypatch.setattr(fsspec.core, "url_to_fs", no_backend)
    with pytest.raises(MissingDependencyError, match=r"inshrink-store\[s3\]"):
        open_storage("s3://bucket/store")
    with pytest.raises(MissingDependencyError, match=r"inshrink-store\[gcs\]"):
        open_storage("gs://bucket/store")


def test_local_writes_never_follow_a_symlinked_folder_out_of_the_store(tmp_path) -> None:
    import os

    import numpy as np

    import inshrink_store as ins
    from inshrink_store.storage import open_storage

    outside = tmp_path / "outside"
    outside.mkdir()
    store = tmp_path / "store"
    repo = ins.open(str(store), create=True)
    os.makedirs(store / "snapshots", exist_ok=True)
    os.rmdir(store / "snapshots")
    os.symlink(outside, store / "snapshots")
    with pytest.raises(ins.IntegrityError, match="symlink"):
        repo.save({"w": np.ones(3, np.float32)})
    assert list(outside.iterdir()) == []
    (outside / "secret").write_bytes(b"top secret")
    with pytest.raises(ins.IntegrityError, match="symlink"):
        open_storage(str(store)).read("snapshots/secret")


def test_backend_failures_are_one_storage_error_naming_operation_and_path() -> None:
    """A closed endpoint is not corrupt data: a StorageError (also an OSError) that says
    which operation on which path failed and why, never a botocore traceback."""
    pytest.importorskip("s3fs")
    import inshrink_store as ins

    options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "key": "k", "secret": "s",
               "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    storage = open_storage("s3://bucket/store", options)
    with pytest.raises(ins.StorageError, match=r"read inshrink.json in 's3://bucket/store'.*EndpointConnectionError") as info:
        storage.read("inshrink.json")
    assert isinstance(info.value, OSError) and isinstance(info.value.__cause__, Exception)
    with pytest.raises(ins.StorageError, match="create refs/x"):
        storage.create_exclusive("refs/x", b"1")


def test_each_url_gets_its_backend(tmp_path) -> None:
    from inshrink_store.storage import LocalStorage, MemoryStorage, open_storage

    assert type(open_storage(str(tmp_path))) is LocalStorage
    assert type(open_storage(f"file://{tmp_path}")) is LocalStorage
    assert type(open_storage("memory://x")) is MemoryStorage
    local = open_storage(str(tmp_path / "s"))
    local.write("a/b", b"0123456789")
    assert local.read_range("a/b", 2, 5) == b"234" and local.size("a/b") == 10
    assert local.list("") == {"a/b": 10} and local.temp_files() == {}


def test_a_linked_object_folder_is_refused_and_a_linked_root_is_fine(tmp_path) -> None:
    """Below the root each new folder is checked with one lstat: a link as the second level
    (objects/<xx> -> outside) is refused like a link at the first; the root itself may be a
    link (a store opened through one), and every write lands in its target."""
    import os

    import numpy as np

    import inshrink_store as ins
    from inshrink_store.storage import open_storage

    outside = tmp_path / "outside"
    outside.mkdir()
    real = tmp_path / "real"
    (real / "objects").mkdir(parents=True)
    os.symlink(outside, real / "objects" / "ab")
    storage = open_storage(str(real))
    with pytest.raises(ins.IntegrityError, match="symlink"):
        storage.write("objects/ab/cdef", b"x")
    assert list(outside.iterdir()) == []
    storage.write("objects/cd/ef01", b"y")  # a fresh folder beside it is made and written
    assert (real / "objects" / "cd" / "ef01").read_bytes() == b"y"

    os.symlink(tmp_path / "target", tmp_path / "link")
    (tmp_path / "target").mkdir()
    repo = ins.open(str(tmp_path / "link" / "store"), create=True)
    repo.save({"w": np.arange(5, dtype=np.float32)})
    assert ins.open(str(tmp_path / "target" / "store")).load()["w"].tolist() == [0, 1, 2, 3, 4]


def test_relying_on_an_existing_local_file_makes_its_folder_entry_durable(tmp_path, monkeypatch) -> None:
    """exists_durably: a present file's folder is fsynced (another writer may have renamed
    it into place a moment ago and not fsynced the folder yet); a missing one costs nothing.
    Every dedup by lookup goes through it: an object put twice, a tree, a residual."""
    import numpy as np

    import inshrink_store as ins
    from inshrink_store.cas import ObjectStore
    from inshrink_store.storage import local, open_storage

    synced: list[str] = []
    real = local.fsync_directory
    monkeypatch.setattr(local, "fsync_directory", lambda d: (synced.append(d), real(d)))
    storage = open_storage(str(tmp_path / "s"))
    storage.write("objects/ab/cd", b"x")
    synced.clear()
    assert open_storage(str(tmp_path / "s")).exists_durably("objects/ab/cd") is True  # another handle
    assert synced == [str(tmp_path / "s" / "objects" / "ab")]
    assert storage.exists_durably("objects/ab/ef") is False and len(synced) == 1

    objects = ObjectStore(storage)
    first = objects.put(b"payload " * 100)
    synced.clear()
    again = objects.put(b"payload " * 100)  # found, not written: relied on
    assert again.oid == first.oid and again.stored_bytes == 0 and len(synced) == 1

    repo = ins.open(str(tmp_path / "r"), create=True)
    repo.save({"w": np.ones(4, np.float32)})
    synced.clear()
    ins.open(str(tmp_path / "r")).save({"w": np.ones(4, np.float32)}, branch="other")  # every object exists
    assert synced, "a save relying on objects it did not write made none of their folders durable"


def test_new_folders_names_are_made_durable_at_the_next_commit_point_once_per_parent(tmp_path, monkeypatch) -> None:
    """A write fsyncs its file's folder; the names of folders it wrote into (objects/<xx>,
    perhaps made a moment ago by any writer) wait for the next exclusive create (a fence, a
    ref), which first fsyncs each pending parent once, deepest first: objects/ once for
    twenty new shard folders. Then the new file's own folder chain (a new branch's refs
    folder) is made durable too; a second commit point with nothing new fsyncs no parent."""
    from inshrink_store.storage import atomic, local, open_storage

    synced: list[str] = []
    real = atomic.fsync_directory

    def record(d: str) -> None:
        synced.append(d)
        real(d)

    monkeypatch.setattr(atomic, "fsync_directory", record)
    monkeypatch.setattr(local, "fsync_directory", record)
    root = tmp_path / "s"
    storage = open_storage(str(root))
    for i in range(20):
        storage.write(f"objects/{i:02x}/{i:030x}", b"x")
    assert synced == [str(root / "objects" / f"{i:02x}") for i in range(20)]  # each file's folder only
    synced.clear()
    storage.create_exclusive("refs/branches/main/000000000000", b"y" * 32)
    ref_folder = root / "refs" / "branches" / "main"
    assert synced == [str(root / "objects"), str(root), str(tmp_path),  # pending parents, deepest first
                      str(ref_folder),  # the ref's own name
                      str(root / "refs" / "branches"), str(root / "refs"), str(root)]  # its new folders' names
    synced.clear()
    storage.create_exclusive("refs/branches/main/000000000001", b"z" * 32)
    assert synced == [str(ref_folder)]


def test_a_path_climbing_out_through_a_missing_folder_is_refused(tmp_path) -> None:
    """".." below a folder that does not exist yet cannot climb out of the store: the
    containment check sees the component before it looks at the disk."""
    import inshrink_store as ins
    from inshrink_store.storage import open_storage

    store = tmp_path / "store"
    store.mkdir()
    storage = open_storage(str(store))
    with pytest.raises(ins.IntegrityError):
        storage.write("objects/zz/../../../outside/pwn", b"x")
    assert not (tmp_path / "outside").exists()


def test_a_local_storage_pickles_for_process_pools_and_the_copy_writes_durably(tmp_path) -> None:
    """Process pools pickle storage handles: the copy has its own locks, knows no folder
    durable yet (so it fsyncs again), and writes and commits like the original."""
    import pickle

    from inshrink_store.storage import open_storage

    original = open_storage(str(tmp_path / "s"))
    original.write("objects/ab/cd", b"x")
    copy = pickle.loads(pickle.dumps(original))
    assert copy.url == original.url and copy.read("objects/ab/cd") == b"x"
    assert copy._durable_folders == set() and copy._pending_parents == set()
    copy.write("objects/ef/01", b"y")
    copy.create_exclusive("refs/branches/main/000000000000", b"z" * 32)
    assert (tmp_path / "s" / "objects" / "ef" / "01").read_bytes() == b"y"
    assert copy._pending_parents == set()

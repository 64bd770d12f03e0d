"""torch.distributed.checkpoint through the store: sharded saves become one version, loads reshard.

Real DCP with the gloo backend on the CPU. Spawned process groups are costly (each process
imports torch), so one 2-rank run (a module fixture) does every save the tests then check
from this process: lossless, saved twice (dedup), quantized, a rank failing mid-save,
``dcp.async_save``, and a :class:`DistributedCheckpointer` with a search. Loads run with 1
rank (in this process, ``no_dist``) and with 4 spawned ranks, each sharding differently than
the save did. Nothing a load reads is unpickled: a crafted value that would run code is refused.
"""

from __future__ import annotations

import gc
import json
import math
import os
import pickle
import socket
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.planner import SavePlan  # noqa: E402

import inshrink_store as ins  # noqa: E402
from inshrink_store.errors import ConflictError, IntegrityError, InvalidInputError, NotFoundError  # noqa: E402
from inshrink_store.policy import (  # noqa: E402
    QuantConfig,
    SearchPolicy,
    shard_quant,  # noqa: E402
)
from inshrink_store.policy.search import SearchSpace  # noqa: E402
from inshrink_store.policy.sketch import LogSketch  # noqa: E402
from inshrink_store.torch import (  # noqa: E402
    DistributedCheckpointer,
    InshrinkStorageReader,
    InshrinkStorageWriter,
)
from inshrink_store.torch.dcp_format import DOC_ATTR, fqn_component, plain_value, shard_path  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning", "ignore::FutureWarning")

QUANT = QuantConfig(bins=16, protect=0.01, min_numel=1024)
SEARCH_SPACE = SearchSpace(bins=(4, 16), prune=(0.0,), protect=(0.005,), metrics=("magnitude",))


# -- the state, the same in every process ----------------------------------------------------------
def full_tensors() -> dict[str, Any]:
    """Every tensor of the test state, whole (FQN -> tensor), from a fixed seed."""
    g = torch.Generator().manual_seed(1234)
    return {
        "model.fc1.weight": torch.randn(64, 96, generator=g),
        "model.fc1.bias": torch.randn(64, generator=g),
        "model.embed.weight": torch.randn(40, 48, generator=g).to(torch.bfloat16),
        "model.zeros": torch.zeros(32, 64),
        "model.counter": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "optim.fc1.exp_avg": torch.randn(64, 96, generator=g) * 1e-3,
    }


#: how the 2-rank save shards each tensor (dim), None: a plain tensor on every rank
SAVE_SHARDING = {"model.fc1.weight": 0, "model.embed.weight": 1, "model.zeros": 0, "optim.fc1.exp_avg": 0,
                 "model.fc1.bias": None, "model.counter": None}
VALUES = {"step": 7, "extra": {"lr": 0.01, "betas": (0.9, 0.999), "name": "run-1", "nan": float("nan"),
                               "shape": torch.Size([3, 4])}}


def nest(flat: dict[str, Any], values: dict[str, Any] | None = None) -> dict[str, Any]:
    """FQN -> tensor as the nested state DCP flattens back to those FQNs."""
    state: dict[str, Any] = {"model": {}, "optim": {}}
    for fqn, tensor in flat.items():
        top, rest = fqn.split(".", 1)
        state[top][rest] = tensor
    state.update(values or {})
    return state


def sharded(mesh: Any, tensors: dict[str, Any], sharding: dict[str, int | None]) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {fqn: t.clone() if sharding[fqn] is None else distribute_tensor(t, mesh, [Shard(sharding[fqn])])
            for fqn, t in tensors.items()}


def local(tensor: Any) -> Any:
    """This rank's part of a loaded tensor (no collective: gloo has no bfloat16 gathers)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def bits(t: Any) -> Any:
    """A tensor's bits, comparable with torch.equal (NaN equals itself)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32) if t.dtype == torch.float32 else t


def mine(full: Any, dim: int | None, rank: int, world: int) -> Any:
    return full if dim is None else torch.chunk(full, world, dim=dim)[rank]


def blank_values() -> dict[str, Any]:
    return {"step": 0, "extra": {"lr": 0.0, "betas": (0.0, 0.0), "name": "", "nan": 0.0, "shape": torch.Size([])}}


# -- process groups ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(fn: Any, world: int, *args: Any) -> None:
    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


def init(rank: int, world: int, port: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), INSHRINK_WRITE_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


class FailingWriter(InshrinkStorageWriter):
    """Rank 1 writes its shards (objects land in the store), then fails."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        if self.rank == 1:
            raise RuntimeError("rank 1 lost its disk")
        return future


def writer_leases(url: str) -> list[str]:
    folder = Path(url) / "leases" / "writers"
    return sorted(os.listdir(folder)) if folder.exists() else []


def _quality(model: Any) -> float:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 32, generator=g)
    with torch.no_grad():
        return -float(torch.nn.functional.mse_loss(model(x), x[:, :8]))


def _small_model() -> Any:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))


def _session_worker(rank: int, world: int, port: int, url: str) -> None:
    """Every save the tests check, on 2 ranks."""
    mesh = init(rank, world, port)
    try:
        state = nest(sharded(mesh, full_tensors(), SAVE_SHARDING), VALUES)
        md = dcp.save(state, storage_writer=InshrinkStorageWriter(url, step=1, message="first"))
        assert md.storage_data["snapshot"] == ins.open(url).resolve("main"), rank  # every rank learns the version
        dcp.save(state, storage_writer=InshrinkStorageWriter(url, step=2))
        dcp.save(state, storage_writer=InshrinkStorageWriter(url, "q", quantize=QUANT, step=2))

        bumped = {f: t + 1 if t.is_floating_point() else t for f, t in full_tensors().items()}
        failing = FailingWriter(url, step=3)
        with pytest.raises(CheckpointException, match="rank 1 lost its disk"):
            dcp.save(nest(sharded(mesh, bumped, SAVE_SHARDING), VALUES), storage_writer=failing)
        if rank == 0:
            assert writer_leases(url), "the coordinator holds its lease until it gives up"
            failing.abort()
            assert writer_leases(url) == []
        dist.barrier()

        future = dcp.async_save(state, storage_writer=InshrinkStorageWriter(url, "async", step=4))
        assert future.result().storage_data["snapshot"] == ins.open(url).resolve("async")

        model = _small_model()
        checkpointer = DistributedCheckpointer(
            url, {"model": model.state_dict()}, eval_fn=_quality, eval_model=model if rank == 0 else None,
            policy=SearchPolicy(tolerance=0.5, higher_is_better=True, space=SEARCH_SPACE), branch="search")
        snapshot = checkpointer.save(step=10, metrics={"quality": 1.0})
        assert checkpointer.last_record is not None and checkpointer.last_record.config is not None
        fresh = _small_model()
        for p in fresh.parameters():
            torch.nn.init.zeros_(p)
        restorer = DistributedCheckpointer(url, {"model": fresh.state_dict()}, branch="search")
        assert restorer.restore(snapshot) == 10 and restorer.previous == checkpointer.last_record.config
        stored = ins.open(url).checkout(snapshot)
        for name, tensor in fresh.state_dict().items():  # the stored (quantized) values, on every rank
            assert np.array_equal(tensor.numpy(), stored.read(shard_path(f"model.{name}", (0,) * tensor.dim()))), name
    finally:
        dist.destroy_process_group()


def _load_worker(rank: int, world: int, port: int, url: str, expected_q: str) -> None:
    """4 ranks, sharded differently from the 2-rank save (rows where it split columns)."""
    from safetensors.torch import load_file

    mesh = init(rank, world, port)
    try:
        resharding = {fqn: (None if dim is None else 1 - dim if fqn.endswith("weight") else 0)
                      for fqn, dim in SAVE_SHARDING.items()}
        full = full_tensors()
        target = sharded(mesh, {f: torch.zeros_like(t) for f, t in full.items()}, resharding)
        state = nest(target, blank_values())
        dcp.load(state, storage_reader=InshrinkStorageReader(url))
        for fqn, tensor in target.items():
            assert torch.equal(bits(local(tensor)), bits(mine(full[fqn], resharding[fqn], rank, world))), fqn
        assert state["step"] == 7 and state["extra"]["shape"] == torch.Size([3, 4])

        quantized = load_file(expected_q)
        target = sharded(mesh, {f: torch.zeros_like(t) for f, t in full.items()}, resharding)
        dcp.load(nest(target, blank_values()), storage_reader=InshrinkStorageReader(url, "q"))
        for fqn, tensor in target.items():  # the same stored values, whatever the layout
            assert torch.equal(bits(local(tensor)), bits(mine(quantized[fqn], resharding[fqn], rank, world))), fqn
    finally:
        dist.destroy_process_group()


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A store holding every 2-rank save of :func:`_session_worker`."""
    url = str(tmp_path_factory.mktemp("dcp") / "store")
    spawn(_session_worker, 2, url)
    return url


def load_one_rank(url: str, ref: str = "main") -> tuple[dict[str, Any], dict[str, Any]]:
    """A 1-rank load (this process, no process group): FQN -> whole tensor, and the state."""
    target = {f: torch.zeros_like(t) for f, t in full_tensors().items()}
    state = nest(target, blank_values())
    dcp.load(state, storage_reader=InshrinkStorageReader(url, ref), no_dist=True)
    return target, state


# -- the 2-rank saves ------------------------------------------------------------------------------
def test_lossless_save_on_two_ranks_loads_bit_exact_on_one(saved: str) -> None:
    tensors, state = load_one_rank(saved)
    for fqn, expected in full_tensors().items():
        assert torch.equal(bits(tensors[fqn]), bits(expected)), fqn
    extra = state["extra"]
    assert state["step"] == 7 and extra["name"] == "run-1" and extra["betas"] == (0.9, 0.999)
    assert math.isnan(extra["nan"]) and type(extra["shape"]) is torch.Size and extra["shape"] == torch.Size([3, 4])


def test_one_version_per_save_holding_each_rank_shards(saved: str) -> None:
    repo = ins.open(saved)
    assert [(i.step, i.message) for i in repo.log("main")] == [(2, ""), (1, "first")]
    names = repo.checkout("main").names()
    assert shard_path("model.fc1.weight", (0, 0)) in names and shard_path("model.fc1.weight", (32, 0)) in names
    assert shard_path("model.embed.weight", (0, 24)) in names  # column shards of the second rank
    doc = repo.checkout("main").attributes[DOC_ATTR]
    assert doc["values"]["step"] == {"encoding": "json", "value": 7}
    assert doc["values"]["extra.shape"]["encoding"] == "torch"  # a torch.Size is not plain JSON
    assert [c["offsets"] for c in doc["tensors"]["model.fc1.weight"]["chunks"]] == [[0, 0], [32, 0]]


def test_every_version_the_ranks_saved_passes_verify(saved: str) -> None:
    """verify checks DCP documents as a load does (chunks tiling each tensor, field types,
    nesting): real sharded saves, row and column shards, quantized or not, all pass."""
    report = ins.open(saved).verify()
    assert report.problems == [] and report.snapshots >= 4


def test_saving_the_same_state_again_stores_nothing_new(saved: str) -> None:
    repo = ins.open(saved)
    first, second = repo.stored_bytes("main~1"), repo.stored_bytes("main")
    assert first == second  # the same objects, adopted unencoded from the parent
    usage = repo.du("main")
    # nothing new but the version's own snapshot document (its tree is the parent's)
    document = repo._storage.size(f"snapshots/{usage[-1].snapshot}")
    assert usage[-1].new_stored_bytes == document < usage[0].new_stored_bytes


def test_identical_shards_of_different_ranks_are_one_object(saved: str) -> None:
    reader = ins.open(saved).checkout("main")
    ids = [reader.index.chunk_ids(shard_path("model.zeros", (row, 0))) for row in (0, 16)]
    chunk_ids = [sorted(oid for key, oid in i.items() if key != "zarr.json") for i in ids]
    assert chunk_ids[0] == chunk_ids[1] and len(chunk_ids[0]) == 1


def test_a_rank_failing_mid_save_leaves_no_version_and_garbage_for_gc(saved: str) -> None:
    repo = ins.open(saved)
    assert [i.step for i in repo.log("main")] == [2, 1]  # step 3 never became visible
    assert writer_leases(saved) == []
    tensors, _ = load_one_rank(saved)  # the previous version is intact
    assert torch.equal(tensors["model.fc1.weight"], full_tensors()["model.fc1.weight"])
    # both ranks wrote their (changed) shards before rank 1 failed: objects nothing names,
    # which gc collects; no tree or snapshot was written (only a commit writes those)
    report = repo.gc(dry_run=True)
    assert len(report.deleted["objects"]) >= 4
    assert report.deleted["trees"] == report.deleted["snapshots"] == []


def test_async_save_commits_a_version(saved: str) -> None:
    repo = ins.open(saved)
    assert repo.snapshot("async").step == 4
    tensors, _ = load_one_rank(saved, "async")
    assert torch.equal(tensors["optim.fc1.exp_avg"], full_tensors()["optim.fc1.exp_avg"])


def test_quantized_shards_share_one_codebook_and_stay_within_error(saved: str) -> None:
    repo = ins.open(saved)
    reader = repo.checkout("q")
    doc = reader.attributes[DOC_ATTR]
    tensors, state = load_one_rank(saved, "q")
    full = full_tensors()
    for fqn in ("model.fc1.weight", "model.embed.weight"):
        entry = doc["tensors"][fqn]
        codebook = entry["quantization"]["codebook"]
        for chunk in entry["chunks"]:
            config = reader.index.array_doc(chunk["array"])["codecs"][0]["configuration"]
            assert config["codebook"] == codebook, (fqn, chunk["array"])  # one codebook, every shard
        got, want = tensors[fqn].float(), full[fqn].float()
        protected = ~torch.isin(got, torch.tensor(codebook, dtype=torch.float32))
        assert protected.float().mean() <= 2.5 * QUANT.protect  # the shared cut, from the merged sketch
        reference = _reference_error(full[fqn])  # repo.save quantizing the whole tensor in one process
        error = float((got - want).norm() / want.norm())
        assert 0 < error <= 1.2 * reference, (fqn, error, reference)
    assert doc["tensors"]["optim.fc1.exp_avg"].get("quantization") is None  # optimizer state: exact
    assert torch.equal(tensors["optim.fc1.exp_avg"], full["optim.fc1.exp_avg"])
    assert torch.equal(tensors["model.counter"], full["model.counter"]) and state["step"] == 7


def _reference_error(tensor: Any) -> float:
    """The relative error of repo.save quantizing the whole tensor with QUANT, one process."""
    from inshrink_store.policy.partition import TensorInput, quantize_tensor

    values = tensor.float().numpy()
    dtype = "BF16" if tensor.dtype == torch.bfloat16 else "F32"
    q = quantize_tensor(TensorInput(values, dtype=dtype), QUANT)
    return float(np.linalg.norm(q.values - values) / np.linalg.norm(values))


def test_search_decides_on_rank_zero_and_every_rank_quantizes(saved: str) -> None:
    info = ins.open(saved).snapshot("search")
    record = info.metadata["quantization"]
    assert info.step == 10 and record["config"] is not None and record["search"] is not None
    arrays = ins.open(saved).checkout("search").arrays()
    assert {a.storage for p, a in arrays.items() if p.startswith("model.0.weight")} == {"quantized"}
    assert {a.storage for p, a in arrays.items() if p.startswith("model.0.bias")} == {"lossless"}


def test_four_ranks_reshard_what_two_saved(saved: str, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    quantized, _ = load_one_rank(saved, "q")
    expected = tmp_path / "q.safetensors"
    save_file({f: t.contiguous() for f, t in quantized.items()}, str(expected))
    spawn(_load_worker, 4, saved, str(expected))


# -- in this process -----------------------------------------------------------------------------
def test_the_lease_covers_a_save_from_plan_to_commit(tmp_path: Path) -> None:
    """gc cannot run between the coordinator's planning (before any rank writes) and its
    commit; a save that never reached its commit holds the lease until the writer gives up,
    starts its next save, or is dropped."""
    url = str(tmp_path / "store")
    writer = InshrinkStorageWriter(url)
    writer.set_up_storage_writer(True, rank=0)
    writer.prepare_global_plan([SavePlan([])])
    repo = ins.open(url)
    with pytest.raises(ConflictError, match="commit in progress"):
        repo.gc()
    writer.abort()
    repo.gc()
    writer.prepare_global_plan([SavePlan([])])
    writer.set_up_storage_writer(True, rank=0)  # the next save starts: the stale lease goes
    assert writer_leases(url) == []
    writer.prepare_global_plan([SavePlan([])])
    assert writer_leases(url)
    del writer
    gc.collect()
    assert writer_leases(url) == []


def test_a_commit_between_ranks_reads_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    state = {"w": torch.ones(3)}
    dcp.save(state, storage_writer=InshrinkStorageWriter(url), no_dist=True)
    early = InshrinkStorageReader(url)
    early.read_metadata()
    dcp.save({"w": torch.zeros(3)}, storage_writer=InshrinkStorageWriter(url), no_dist=True)
    late = InshrinkStorageReader(url)
    late.read_metadata()
    plans = [early.prepare_local_plan(_load_plan()), late.prepare_local_plan(_load_plan())]
    with pytest.raises(ConflictError, match="pin a snapshot id"):
        early.prepare_global_plan(plans)


def _load_plan() -> Any:
    from torch.distributed.checkpoint.planner import LoadPlan

    return LoadPlan([])


def test_loading_a_version_not_saved_through_dcp_names_the_way(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    ins.open(url, create=True).save({"w": np.ones(3, np.float32)})
    with pytest.raises(CheckpointException, match="load_state"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=InshrinkStorageReader(url), no_dist=True)


def test_a_stored_value_that_would_run_code_is_refused(tmp_path: Path) -> None:
    url, marker = str(tmp_path / "store"), tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> Any:
            return (exec, (f"open({str(marker)!r}, 'w').write('ran')",))

    repo = ins.open(url, create=True)
    doc = {"format": 1, "version": "1.0.0", "planner_data": None, "storage_meta": None, "quantize": None,
           "tensors": {}, "values": {"evil": {"encoding": "torch", "array": "evil/bytes"}}}
    bad = pickle.dumps(Payload(), protocol=2)  # what torch.load(weights_only=False) would run
    repo.save({"evil/bytes": np.frombuffer(bad, np.uint8)}, attributes={DOC_ATTR: doc})
    with pytest.raises(CheckpointException, match="refusing to unpickle"):
        dcp.load({"evil": 0}, storage_reader=InshrinkStorageReader(url), no_dist=True)
    assert not marker.exists()


def test_a_corrupt_document_is_an_integrity_error(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    dcp.save({"w": torch.ones(2, 2)}, storage_writer=InshrinkStorageWriter(url), no_dist=True)
    repo = ins.open(url)
    doc = json.loads(json.dumps(repo.checkout().attributes[DOC_ATTR]))
    doc["tensors"]["w"]["chunks"][0]["sizes"] = [2]
    arrays = repo.load()
    repo.save(arrays, attributes={DOC_ATTR: doc})
    reader = InshrinkStorageReader(url)
    with pytest.raises(IntegrityError, match="chunk offsets and sizes of rank 2"):
        reader.read_metadata()


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_unsupported_tensors_fail_before_anything_is_written(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    with pytest.raises(CheckpointException, match="'z'.*complex32"):  # complex64 and 128 are stored
        dcp.save({"z": torch.zeros(2, dtype=torch.complex32)}, storage_writer=InshrinkStorageWriter(url),
                 no_dist=True)
    with pytest.raises(NotFoundError):
        ins.open(url).resolve("main")


def test_fqns_become_safe_distinct_path_components() -> None:
    names = ["a.b", "a/b", "a%2Fb", "__x", ".", "..", "", "zarr.json", "a\\b"]
    components = [fqn_component(n) for n in names]
    assert len(set(components)) == len(names)
    for c in components:
        assert c and "/" not in c and "\\" not in c and not c.startswith("__") and c not in (".", "..", "zarr.json")


def test_plain_values_keep_their_types_or_are_not_plain() -> None:
    from inshrink_store.structure import unflatten

    value = {"lr": 0.1, "betas": (0.9, 0.99), 3: [None, True, "x"], "neg": -0.0}
    assert unflatten(plain_value(value), {}) == value
    assert plain_value(torch.Size([2])) is None and plain_value({"t": torch.ones(1)}) is None
    assert plain_value(list(range(100_000))) is None  # too long to inline


def test_merged_shard_sketches_decide_exactly_as_the_whole_tensor() -> None:
    """The property quantization across ranks rests on: shards' sketches merged in any order
    give the decisions of the whole tensor, bit for bit."""
    rng = np.random.default_rng(0)
    whole = {"model.a": rng.standard_normal((64, 64)).astype(np.float32),
             "model.b": rng.standard_normal((32, 128)).astype(np.float32) * 3}
    config = QuantConfig(bins=8, prune=0.2, protect=0.01, min_numel=100)
    chosen = shard_quant.shard_targets({f: ("F32", a.shape) for f, a in whole.items()}, config)
    at_once = shard_quant.decide_shards(chosen, {f: LogSketch.from_values(a) for f, a in whole.items()}, config, chosen)
    ranks = [{f: LogSketch.from_values(a[i::3]) for f, a in whole.items()} for i in range(3)]
    for order in (ranks, ranks[::-1]):
        shards = [{f: shard_quant.sketch_from_json(shard_quant.sketch_to_json(s)) for f, s in r.items()} for r in order]
        assert shard_quant.decide_shards(chosen, shard_quant.merge_sketches(shards), config, chosen) == at_once
    stats = [shard_quant.quantize_shard(a, at_once[f], "F32", config).stats for f, a in whole.items()]
    pruned = sum(s["pruned_fraction"] * whole[f].size for s, f in zip(stats, whole, strict=True))
    assert 0.18 <= pruned / sum(a.size for a in whole.values()) <= 0.22  # one threshold pooled over the layer type
    assert all(0.005 <= s["protected_fraction"] <= 0.02 for s in stats)


@pytest.mark.s3
def test_one_rank_save_and_load_on_s3(s3_url: str) -> None:
    state = nest(full_tensors(), VALUES)
    dcp.save(state, storage_writer=InshrinkStorageWriter(s3_url, quantize=QUANT), no_dist=True)
    tensors, loaded = load_one_rank(s3_url)
    assert torch.equal(tensors["model.counter"], full_tensors()["model.counter"]) and loaded["step"] == 7
    assert ins.open(s3_url).checkout().arrays()[shard_path("model.fc1.weight", (0, 0))].storage == "quantized"


def test_shards_quantized_differently_are_never_committed(tmp_path: Path) -> None:
    """The coordinator's guard on determinism: two shards of one tensor reporting different
    codebooks (ranks that computed different results) fail the commit, and free the lease."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.storage import WriteResult

    url = str(tmp_path / "store")
    writer = InshrinkStorageWriter(url, quantize=QUANT)
    writer.set_up_storage_writer(True, rank=0)
    writer.prepare_global_plan([SavePlan([]), SavePlan([])])
    chunks = [ChunkStorageMetadata(torch.Size([row, 0]), torch.Size([2, 4])) for row in (0, 2)]
    metadata = Metadata({"model.w": TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                          torch.Size([4, 4]), chunks)})
    results = [[WriteResult(MetadataIndex("model.w", [row, 0]), 32,
                            {"array": shard_path("model.w", (row, 0)), "node": {"metadata": "{}", "chunks": {}},
                             "quantization": {"codebook": [0.0, float(row)]}})] for row in (0, 2)]
    with pytest.raises(IntegrityError, match="one codebook"):
        writer.finish(metadata, results)
    assert writer_leases(url) == []
    with pytest.raises(NotFoundError):
        ins.open(url).resolve("main")


def test_saves_without_collectives_are_refused(tmp_path: Path) -> None:
    writer = InshrinkStorageWriter(str(tmp_path / "store"))
    with pytest.raises(InvalidInputError, match="use_collectives=True"):
        writer.set_up_storage_writer(True, rank=0, use_collectives=False)


@pytest.mark.parametrize("cls", [InshrinkStorageReader, InshrinkStorageWriter])
def test_reader_and_writer_take_the_same_checkpoint_ids(cls: Any, tmp_path: Path) -> None:
    """torch asks both sides which ids they take and what their id is: a local path or a URL
    of a protocol fsspec knows; the id is the store URL, and ``reset`` moves it."""
    assert cls.validate_checkpoint_id(str(tmp_path / "store"))
    assert cls.validate_checkpoint_id(tmp_path / "store")
    assert cls.validate_checkpoint_id("memory://ids")
    assert not cls.validate_checkpoint_id("no-such-protocol-x://bucket/store")
    assert not cls.validate_checkpoint_id("")
    assert not cls.validate_checkpoint_id(None)
    side = cls(str(tmp_path / "a"))
    assert side.checkpoint_id == str(tmp_path / "a")
    side.reset(tmp_path / "b")
    assert side.checkpoint_id == str(tmp_path / "b")

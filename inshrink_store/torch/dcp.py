"""``torch.distributed.checkpoint`` (DCP) storage: every rank writes its shards, one version.
Layer: torch, below Hugging Face and Lightning, above the facade (a client of the store).

``dcp.save(state, storage_writer=InshrinkStorageWriter(url))`` and
``dcp.load(state, storage_reader=InshrinkStorageReader(url))`` work as with DCP's own
storage, resharding included (save on 8 ranks, load on 2); the checkpoint is one version of
a branch, with dedup, delta coding and (``quantize=QuantConfig(...)``) quantization.
The layout is in :mod:`~inshrink_store.torch.dcp_format`.

How a save runs, in DCP's order:

1. ``prepare_global_plan`` (the coordinator) opens the write session: it takes the store's
   writer lease, then reads the branch head (the parent). The lease is taken before any rank
   writes anything, and gc neither starts nor deletes while it is held, so no object a rank
   writes, or skips because the store has it, can be collected before the commit. The
   parent, and with ``quantize`` which tensors to quantize, reach every rank in its plan.
2. ``write_data`` (every rank): with ``quantize``, each rank sketches its shards of the
   tensors to quantize and the sketches are gathered over the process group (JSON in uint8
   tensors, :mod:`~inshrink_store.torch.dcp_comm`), so every shard of a tensor gets one
   codebook and one set of thresholds (:mod:`~inshrink_store.policy.shard_quant`). Then each
   rank writes its shards as zarr arrays: chunk objects straight into the store
   (write-once, content-addressed: ranks need no coordination), unchanged lossless shards
   adopted from the parent without encoding. What the coordinator needs to commit, each
   array's zarr.json and chunk ids, goes back in the ``WriteResult``\\ s as JSON-native data.
3. ``finish`` (the coordinator, only if every rank succeeded): the arrays are staged into the
   write session (``WriteSession.stage_array``), the root group holding DCP's metadata as
   JSON with them (``stage_group``), and become the version's trees; the session commits
   (fence, then the branch ref created exclusively). ``dcp.save`` returns DCP's ``Metadata``
   on every rank with ``storage_data = {"snapshot": id, "branch": ..., "url": ...}``.

A rank that fails leaves no visible version and the previous one intact: DCP skips
``finish``, nothing names what was written, and gc removes it later. The coordinator's
lease stays held until the writer's next save, :meth:`InshrinkStorageWriter.abort`, or the
writer being dropped (gc waits for it meanwhile, which is safe, never lossy).

Nothing is pickled into the store, and reading never unpickles: see ``dcp_format``.

This module is the entry point; the code is in :mod:`~inshrink_store.torch.dcp_writer` (the
writer, the coordinator's commit), :mod:`~inshrink_store.torch.dcp_rank` (a rank's part of a
save), :mod:`~inshrink_store.rank_writer` (where a rank writes its arrays) and
:mod:`~inshrink_store.torch.dcp_reader` (the reader, the document read back).
"""

from inshrink_store.torch.dcp_rank import WRITE_BATCH_BYTES
from inshrink_store.torch.dcp_reader import READ_WINDOW, InshrinkStorageReader, read_document
from inshrink_store.torch.dcp_writer import InshrinkStorageWriter

__all__ = ["READ_WINDOW", "WRITE_BATCH_BYTES", "InshrinkStorageReader", "InshrinkStorageWriter", "read_document"]

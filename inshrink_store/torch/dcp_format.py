"""What a DCP checkpoint is in the store: array names, the JSON document of DCP's metadata,
and plain Python values as JSON. No pickle is written, and none is ever read.
Layer: torch, below Hugging Face and Lightning, above the facade (a client of the store).

Layout of one version saved through :class:`~inshrink_store.torch.dcp.InshrinkStorageWriter`:

- each tensor shard DCP writes is its own zarr array ``<fqn>/@<offsets>``
  (``model.fc.weight/@0,0``, ``model.fc.weight/@512,0``), so every rank writes its shards
  side by side and a reader fetches only the chunks a resharded load needs;
- a non-tensor value (DCP's "bytes" items: a step counter, ``param_groups``) that is plain
  Python data (None, bool, int, float, str, and lists, tuples and dicts of them, with types
  kept exactly) is JSON inside the document; anything else (e.g. a dict holding tensors) is
  the ``torch.save`` bytes DCP produced, stored as a uint8 array ``<fqn>/bytes`` and only
  ever read back with ``torch.load(weights_only=True)``, which refuses to run code;
- the root group's attribute ``inshrink_dcp`` holds DCP's global metadata as JSON: every
  tensor's dtype, global size and chunks (offsets, sizes, array), every value, the planner's
  key mappings, and for quantized tensors the one codebook their shards share. That document
  is defined and checked in :mod:`inshrink_store.dcp_document` (torch-free, so ``verify``
  checks it as a load does) and re-exported here.

An FQN becomes one path component: ``%``, ``/`` and ``\\`` are percent-encoded, and a name
zarr or the store reserves (empty, ``.``, ``..``, ``zarr.json``, a leading ``__``) gets its
first character encoded, so every FQN has its own group.
"""

from __future__ import annotations

from inshrink_store.dcp_document import (
    DOC_ATTR,
    FORMAT,
    INLINE_LIMIT,
    Chunk,
    DcpDocument,
    TensorEntry,
    ValueEntry,
    plain_value,
)
from inshrink_store.structure import METADATA_KEY

__all__ = ["DOC_ATTR", "FORMAT", "INLINE_LIMIT", "Chunk", "DcpDocument", "TensorEntry", "ValueEntry", "bytes_path",
           "fqn_component", "plain_value", "shard_path"]

_RESERVED = ("", ".", "..", METADATA_KEY)


# -- names ------------------------------------------------------------------------------------
def fqn_component(fqn: str) -> str:
    """``fqn`` as one safe path component (injective: ``%`` is encoded first)."""
    text = fqn.replace("%", "%25").replace("/", "%2F").replace("\\", "%5C")
    if text in _RESERVED or text.startswith("__"):
        text = f"%{ord(text[0]):02X}{text[1:]}" if text else "%00"
    return text


def shard_path(fqn: str, offsets: tuple[int, ...] | list[int]) -> str:
    """The array of the shard of ``fqn`` at ``offsets`` (``@`` alone for a 0-d tensor)."""
    return f"{fqn_component(fqn)}/@{','.join(str(int(o)) for o in offsets)}"


def bytes_path(fqn: str) -> str:
    """The uint8 array of a value stored as ``torch.save`` bytes."""
    return f"{fqn_component(fqn)}/bytes"

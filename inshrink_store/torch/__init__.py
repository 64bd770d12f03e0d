"""The PyTorch boundary: the only package of inshrink-store that imports torch.
Layer: torch, below Hugging Face and Lightning, above the facade (a client of the store).

``save_state`` / ``load_state`` move nested state dicts in and out of a repository
bit-exact; ``Checkpointer`` runs dynamic quantization from a training loop, keeps what
:class:`Retention` says, and carries ``extra`` state (schedulers, :class:`RNGState`, epoch).
For ``torch.distributed.checkpoint``, :class:`InshrinkStorageWriter` and
:class:`InshrinkStorageReader` make one ``dcp.save`` one version (every rank writes its
shards), and :class:`DistributedCheckpointer` adds the configuration search.
"""

from inshrink_store.policy import SearchPolicy
from inshrink_store.torch.calibration import (
    allocate,
    calibration_fisher,
    calibration_hessians,
    calibration_weights,
)
from inshrink_store.torch.checkpoint_files import (
    export_safetensors,
    export_state,
    export_tensors,
    export_torch,
    import_file,
    load_checkpoint_file,
    save_safetensors,
)
from inshrink_store.torch.checkpointer import (
    DEFAULT_CONFIG,
    BackgroundSaveError,
    Checkpointer,
    Retention,
    RNGState,
)
from inshrink_store.torch.dcp import InshrinkStorageReader, InshrinkStorageWriter
from inshrink_store.torch.dcp_checkpointer import DistributedCheckpointer
from inshrink_store.torch.pretrained import PretrainedExport, config_json, export_pretrained
from inshrink_store.torch.tensors import (
    TORCH_DTYPES,
    array_to_tensor,
    arrays_to_state,
    load_state,
    load_state_report,
    save_state,
    state_to_arrays,
    tensor_to_array,
)

__all__ = [
    "DEFAULT_CONFIG", "TORCH_DTYPES", "BackgroundSaveError", "Checkpointer", "DistributedCheckpointer",
    "InshrinkStorageReader", "InshrinkStorageWriter", "PretrainedExport", "RNGState", "Retention",
    "SearchPolicy", "allocate", "array_to_tensor", "calibration_fisher", "calibration_hessians",
    "calibration_weights",
    "arrays_to_state", "config_json", "export_pretrained", "export_safetensors", "export_state",
    "export_tensors", "export_torch", "import_file",
    "load_checkpoint_file", "load_state",
    "load_state_report",
    "save_safetensors", "save_state", "state_to_arrays", "tensor_to_array",
]

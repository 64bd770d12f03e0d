"""inshrink-store: versioned, content-addressed checkpoint storage with dynamic quantization.
Layer: none; the root re-exports the layers' public API (docs/reference/architecture.md).

``import inshrink_store as ins`` needs only numpy, zarr, numcodecs, fsspec and xxhash;
torch lives in :mod:`inshrink_store.torch`, cupy, s3fs and gcsfs are optional.
Everything a caller gets back from the public API is importable from here.
"""

from inshrink_store.admin import DiffReport, GcReport, Problem, TensorChange, UsageRow, VerifyReport
from inshrink_store.errors import (
    AlreadyExistsError,
    BackgroundSaveError,
    ConflictError,
    FormatError,
    GcRunningError,
    InshrinkError,
    IntegrityError,
    InvalidInputError,
    LeaseBrokenError,
    MissingDependencyError,
    NotFoundError,
    StorageError,
    WriteCheckError,
)
from inshrink_store.index import ArrayInfo
from inshrink_store.policy import QuantConfig, QuantizationRecord
from inshrink_store.reader import SnapshotReader
from inshrink_store.repository import (
    Repository,
    SnapshotInfo,
    Transaction,
    WriteSession,
    init,
    open,  # noqa: A004 - mirrors zarr.open / fsspec.open
)

__version__ = "0.1.0"

__all__ = [
    # opening a store
    "Repository", "init", "open",
    # what the API returns
    "ArrayInfo", "DiffReport", "GcReport", "Problem", "QuantConfig", "QuantizationRecord", "SnapshotInfo",
    "SnapshotReader", "TensorChange", "Transaction", "UsageRow", "VerifyReport", "WriteSession",
    # errors
    "AlreadyExistsError", "BackgroundSaveError", "ConflictError", "FormatError", "GcRunningError",
    "InshrinkError", "IntegrityError", "InvalidInputError", "LeaseBrokenError", "MissingDependencyError",
    "NotFoundError", "StorageError", "WriteCheckError",
    "__version__",
]

"""inshrink-store: versioned, content-addressed checkpoint storage with dynamic quantization.

``import inshrink_store as ins`` needs only numpy, zarr, numcodecs, fsspec and xxhash;
torch lives in :mod:`inshrink_store.torch`, cupy, s3fs and gcsfs are optional.
"""

from inshrink_store.errors import (
    AlreadyExistsError,
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
)
from inshrink_store.repository import Repository, SnapshotInfo, Transaction, init, open  # noqa: A004

__version__ = "0.1.0"

__all__ = [
    "AlreadyExistsError", "ConflictError", "FormatError", "GcRunningError", "InshrinkError", "IntegrityError", "InvalidInputError",
    "LeaseBrokenError", "MissingDependencyError",
    "NotFoundError", "StorageError", "Repository", "SnapshotInfo", "Transaction", "init", "open", "__version__",
]

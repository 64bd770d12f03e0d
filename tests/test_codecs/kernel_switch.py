"""The switch the compiled-loop tests flip: ``INSHRINK_KERNELS`` set or unset for a block.

Both sets of loops (the lossless codec's and the quantized path's) read the same variable,
so their tests compare the same two runs of one public function with this one helper."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from inshrink_store.codecs import _kernels


@contextmanager
def kernels_env(value: str | None) -> Iterator[None]:
    """``INSHRINK_KERNELS`` set to ``value`` (None: unset, the loops on) inside the block."""
    before = os.environ.pop(_kernels.ENV, None)
    if value is not None:
        os.environ[_kernels.ENV] = value
    try:
        yield
    finally:
        os.environ.pop(_kernels.ENV, None)
        if before is not None:
            os.environ[_kernels.ENV] = before
